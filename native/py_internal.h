/* What the files of worker._native, the CPython binding of the native core, share.
 *
 * Every one of them includes this first: it pins the limited API (3.11) before Python.h, so the one
 * abi3 build serves every CPython >= 3.11. The binding parses arguments, releases the GIL around
 * long native calls, and raises the memsvc.errors classes; the work itself is in msv.h. */
#ifndef MSV_PY_INTERNAL_H
#define MSV_PY_INTERNAL_H

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "msv.h"

/* ---- py_errors.c: the memsvc.errors class of each MSV_E_* code ---- */
#define N_ERRORS 9
extern PyObject *g_err[N_ERRORS];
int load_errors(void);
/* Raise the calling thread's last native error as its class; returns NULL. */
PyObject *raise_last(void);
/* Raise OutOfMemory ("out of host memory for <what>"), never the builtin MemoryError; returns NULL. */
PyObject *raise_no_memory(const char *what);

/* ---- py_dlpack.c ---- */
/* What a capsule owns and frees when its tensor dies: a pool allocation, a host buffer, or a staged
 * file (only a staged file uses mem's size and handle). */
typedef enum { OWN_POOL, OWN_HOST, OWN_STAGED } own_kind;
/* A DLPack capsule owning `mem` (at mem.addr); frees it on failure. */
PyObject *make_capsule(msv_allocator *a, own_kind kind, msv_staged mem, PyObject *shape, int code, int bits,
                       int device_type, int device_id);

/* ---- py_buffers.c: arrays out of Python arguments ---- */
int get_items(PyObject *obj, const char *what, Py_ssize_t itemsize, const char *kinds, int writable,
              Py_buffer *view);
int read_u64s(PyObject *obj, const char *what, uint64_t **out, Py_ssize_t *n);

/* ---- the Allocator type (py_allocator.c) ---- */
typedef struct {
  PyObject_HEAD msv_allocator *a;
} AllocatorObject;

/* The native allocator of a handle, or NULL with WrongState raised once it is closed. */
static inline msv_allocator *allocator_of(AllocatorObject *self) {
  if (!self->a) PyErr_SetString(g_err[MSV_E_STATE], "allocator is closed");
  return self->a;
}

int add_allocator_type(PyObject *m);
/* its methods kept beside what they call: py_transitions.c */
PyObject *Allocator_sleep(AllocatorObject *self, PyObject *args);
PyObject *Allocator_wake(AllocatorObject *self, PyObject *args);
/* py_stats.c */
/* The name memsvc.vocabulary.TagState gives a tag state (MSV_TAG_*). */
const char *tag_state_name(int state);
PyObject *Allocator_tag_stats(AllocatorObject *self, PyObject *args);
PyObject *Allocator_counters(AllocatorObject *self, PyObject *args);
PyObject *Allocator_mem_info(AllocatorObject *self, PyObject *unused);
/* py_copies.c */
PyObject *Allocator_copy_blocks(AllocatorObject *self, PyObject *args);
PyObject *Allocator_copy_block_ids(AllocatorObject *self, PyObject *args);
PyObject *Allocator_copies_wait(AllocatorObject *self, PyObject *unused);
PyObject *Allocator_has_method(AllocatorObject *self, PyObject *args);
PyObject *Allocator_new_stream(AllocatorObject *self, PyObject *unused);

/* ---- py_fence.c: the Fence type, a copy in flight ---- */
typedef struct FenceObject FenceObject;
int add_fence_type(PyObject *m);
/* A fence that is already done; made before a copy is enqueued, so nothing can fail after it. */
FenceObject *fence_new(void);
/* Make it wait for `fence` on `a`, taking over one reference to `a`. */
void fence_arm(FenceObject *f, msv_allocator *a, uint64_t fence);

/* ---- py_kv.c: module functions of the KV cache's block ownership ---- */
PyObject *mod_kv_check(PyObject *m, PyObject *args);
PyObject *mod_kv_move(PyObject *m, PyObject *args);

#endif
