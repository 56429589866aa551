/* worker._native: the CPython binding of the native core (limited API, abi3).
 *
 * Tensors reach torch as DLPack capsules, never through torch's C++ ABI, so one build serves every
 * torch version. Errors are raised as memsvc.errors classes, the project's single exception tree;
 * long operations release the GIL. */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "msv.h"

/* ---- errors ---- */
static PyObject *g_err[9];

static PyObject *raise_last(void) {
  int code = msv_last_error_code();
  PyObject *cls = (code > 0 && code < 9 && g_err[code]) ? g_err[code] : g_err[MSV_E_BACKEND];
  PyErr_SetString(cls, msv_last_error());
  return NULL;
}

static int load_errors(void) {
  static const char *names[9] = {NULL, "InvalidArgument", "NotFound", "WrongState", "OutOfMemory",
                                 "TransitionInProgress", "IntegrityError", "Unavailable", "BackendError"};
  PyObject *mod = PyImport_ImportModule("memsvc.errors");
  if (!mod) return -1;
  for (int i = 1; i < 9; i++) {
    g_err[i] = PyObject_GetAttrString(mod, names[i]);
    if (!g_err[i]) {
      Py_DECREF(mod);
      return -1;
    }
  }
  Py_DECREF(mod);
  return 0;
}

/* Whether a buffer holds `itemsize`-byte items, native or little-endian, of a format letter in
 * `kinds` ('>' and '!' fall through as bad). */
static int items_are(const Py_buffer *v, Py_ssize_t itemsize, const char *kinds) {
  const char *f = v->format ? v->format : "B";
  if (*f && strchr("@=<", *f)) f++;
  return v->itemsize == itemsize && f[0] && !f[1] && strchr(kinds, f[0]);
}

/* ---- DLPack (v0.8 ABI) ---- */
typedef struct {
  int32_t device_type, device_id;
} DLDevice;
typedef struct {
  uint8_t code, bits;
  uint16_t lanes;
} DLDataType;
typedef struct {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape, *strides;
  uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *);
} DLManagedTensor;

typedef struct {
  DLManagedTensor m;
  msv_allocator *alloc;
  uint64_t addr;
  int host; /* a host buffer rather than a pool allocation */
  int64_t shape[];
} owned_tensor;

/* Called by the consumer (torch) when the tensor dies, possibly without the GIL: C only. */
static void owned_deleter(DLManagedTensor *m) {
  owned_tensor *t = (owned_tensor *)m;
  if (t->host) msv_host_free(t->alloc, t->addr);
  else msv_free(t->alloc, t->addr);
  msv_release(t->alloc);
  free(t);
}

static void capsule_destructor(PyObject *cap) {
  if (PyCapsule_IsValid(cap, "dltensor")) { /* never consumed */
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m && m->deleter) m->deleter(m);
  }
}

static PyObject *make_capsule(msv_allocator *a, uint64_t addr, int host, PyObject *shape, int code, int bits,
                              int device_type, int device_id) {
  Py_ssize_t nd = PySequence_Size(shape);
  if (nd < 0) {
    if (host) msv_host_free(a, addr);
    else msv_free(a, addr);
    return NULL;
  }
  owned_tensor *t = calloc(1, sizeof *t + (size_t)(nd ? nd : 1) * sizeof(int64_t));
  if (!t) {
    if (host) msv_host_free(a, addr);
    else msv_free(a, addr);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < nd; i++) {
    PyObject *it = PySequence_GetItem(shape, i);
    t->shape[i] = it ? PyLong_AsLongLong(it) : -1;
    Py_XDECREF(it);
    if (PyErr_Occurred()) {
      free(t);
      if (host) msv_host_free(a, addr);
      else msv_free(a, addr);
      return NULL;
    }
  }
  t->m.dl_tensor.data = (void *)(uintptr_t)addr;
  t->m.dl_tensor.device = (DLDevice){device_type, device_id};
  t->m.dl_tensor.ndim = (int32_t)nd;
  t->m.dl_tensor.dtype = (DLDataType){(uint8_t)code, (uint8_t)bits, 1};
  t->m.dl_tensor.shape = t->shape;
  t->m.dl_tensor.strides = NULL; /* compact row-major */
  t->m.deleter = owned_deleter;
  t->alloc = a;
  t->addr = addr;
  t->host = host;
  msv_retain(a);
  PyObject *cap = PyCapsule_New(&t->m, "dltensor", capsule_destructor);
  if (!cap) owned_deleter(&t->m);
  return cap;
}

/* ---- the Allocator type ---- */
typedef struct {
  PyObject_HEAD msv_allocator *a;
} AllocatorObject;

static msv_allocator *get(AllocatorObject *self) {
  if (!self->a) PyErr_SetString(g_err[MSV_E_STATE], "allocator is closed");
  return self->a;
}

static int Allocator_init(AllocatorObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"backend", "device", "host_capacity", "granularity", "arena_va_bytes", "host_chunk_bytes",
                           "host_reserve_bytes", "checksum", "prefault_threads", "huge_pages", NULL};
  msv_config c;
  memset(&c, 0, sizeof c);
  unsigned long long cap = 0, gran = 0, va = 0, chunk = 0, reserve = 0;
  int checksum = 0, huge_pages = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "ii|KKKKKpip", kwlist, &c.backend, &c.device, &cap, &gran, &va, &chunk,
                                   &reserve, &checksum, &c.prefault_threads, &huge_pages))
    return -1;
  if (c.backend != MSV_BACKEND_HOST && c.backend != MSV_BACKEND_CUDA) {
    PyErr_SetString(g_err[MSV_E_INVALID], "backend must be 0 (host) or 1 (cuda)");
    return -1;
  }
  c.host_capacity = cap, c.granularity = gran, c.arena_va_bytes = va, c.host_chunk_bytes = chunk;
  c.host_reserve_bytes = reserve, c.checksum = checksum, c.no_huge_pages = !huge_pages;
  if (self->a) {
    PyErr_SetString(g_err[MSV_E_STATE], "allocator already initialised");
    return -1;
  }
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = msv_create(&c, &self->a);
  Py_END_ALLOW_THREADS if (rc) {
    raise_last();
    return -1;
  }
  return 0;
}

static void Allocator_dealloc(AllocatorObject *self) {
  if (self->a) msv_release(self->a);
  self->a = NULL;
  PyTypeObject *tp = Py_TYPE((PyObject *)self);
  freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  f(self);
  Py_DECREF(tp);
}

static PyObject *Allocator_close(AllocatorObject *self, PyObject *unused) {
  (void)unused;
  if (self->a) {
    msv_host_prepin_cancel(self->a); /* a prepin still running on another thread stops at its next chunk */
    msv_release(self->a);
    self->a = NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *Allocator_alloc(AllocatorObject *self, PyObject *args) {
  const char *tag;
  long long size;
  if (!PyArg_ParseTuple(args, "sL", &tag, &size)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  if (size <= 0) return PyErr_Format(g_err[MSV_E_INVALID], "allocation size must be > 0, got %lld", size);
  uint64_t p;
  int rc;
  msv_retain(a); /* a close() on another thread must not destroy it under this call */
  Py_BEGIN_ALLOW_THREADS rc = msv_alloc(a, tag, (size_t)size, &p);
  Py_END_ALLOW_THREADS msv_release(a);
  if (rc) return raise_last();
  return PyLong_FromUnsignedLongLong(p);
}

static PyObject *Allocator_free(AllocatorObject *self, PyObject *args) {
  unsigned long long p;
  if (!PyArg_ParseTuple(args, "K", &p)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  if (msv_free(a, p)) return raise_last();
  Py_RETURN_NONE;
}

/* tensor(tag, nbytes, shape, dlpack_code, bits) -> DLPack capsule owning a fresh allocation */
static PyObject *Allocator_tensor(AllocatorObject *self, PyObject *args) {
  const char *tag;
  long long nbytes;
  PyObject *shape;
  int code, bits;
  if (!PyArg_ParseTuple(args, "sLOii", &tag, &nbytes, &shape, &code, &bits)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  if (nbytes <= 0) return PyErr_Format(g_err[MSV_E_INVALID], "tensor size must be > 0 bytes, got %lld", nbytes);
  uint64_t p;
  int rc;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_alloc(a, tag, (size_t)nbytes, &p);
  Py_END_ALLOW_THREADS if (rc) {
    msv_release(a);
    return raise_last();
  }
  msv_backend *b = msv_get_backend(a);
  int cuda = b->kind == MSV_BACKEND_CUDA;
  PyObject *cap = make_capsule(a, p, 0, shape, code, bits, cuda ? 2 : 1, cuda ? b->device : 0);
  msv_release(a); /* the capsule holds its own reference; on failure it already freed p */
  return cap;
}

/* host_tensor(nbytes, shape, dlpack_code, bits) -> capsule of a page-locked host buffer (CPU) */
static PyObject *Allocator_host_tensor(AllocatorObject *self, PyObject *args) {
  long long nbytes;
  PyObject *shape;
  int code, bits;
  if (!PyArg_ParseTuple(args, "LOii", &nbytes, &shape, &code, &bits)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  if (nbytes <= 0) return PyErr_Format(g_err[MSV_E_INVALID], "host buffer size must be > 0 bytes, got %lld", nbytes);
  uint64_t p;
  int rc;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_host_alloc(a, (size_t)nbytes, &p);
  Py_END_ALLOW_THREADS if (rc) {
    msv_release(a);
    return raise_last();
  }
  PyObject *cap = make_capsule(a, p, 1, shape, code, bits, 1, 0);
  msv_release(a); /* the capsule holds its own reference; on failure it already freed p */
  return cap;
}

static int parse_tags(PyObject *seq, const char ***tags, Py_ssize_t *n) {
  *n = PySequence_Size(seq);
  if (*n < 0) return -1;
  *tags = calloc((size_t)(*n ? *n : 1), sizeof(char *));
  if (!*tags) {
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < *n; i++) {
    PyObject *it = PySequence_GetItem(seq, i);
    if (!it) return -1;
    if (!PyUnicode_Check(it)) {
      Py_DECREF(it);
      PyErr_SetString(g_err[MSV_E_INVALID], "tags must be strings");
      return -1;
    }
    (*tags)[i] = PyUnicode_AsUTF8AndSize(it, NULL); /* borrowed from the list's item */
    Py_DECREF(it);
    if (!(*tags)[i]) return -1;
  }
  return 0;
}

/* sleep([(tag, action), ...]) */
static PyObject *Allocator_sleep(AllocatorObject *self, PyObject *args) {
  PyObject *pairs;
  if (!PyArg_ParseTuple(args, "O", &pairs)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  Py_ssize_t n = PySequence_Size(pairs);
  if (n < 0) return NULL;
  PyObject *keep = PyList_New(0); /* keeps tag strings alive while the GIL is released */
  const char **tags = calloc((size_t)(n ? n : 1), sizeof(char *));
  int *actions = calloc((size_t)(n ? n : 1), sizeof(int));
  PyObject *ret = NULL;
  if (!keep || !tags || !actions) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *pr = PySequence_GetItem(pairs, i);
    const char *t;
    int act;
    if (!pr) goto done;
    int ok = PyArg_ParseTuple(pr, "si", &t, &act);
    if (ok) PyList_Append(keep, pr);
    Py_DECREF(pr);
    if (!ok) goto done;
    tags[i] = t, actions[i] = act;
  }
  int rc;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_sleep(a, tags, actions, (size_t)n);
  Py_END_ALLOW_THREADS msv_release(a);
  if (rc) raise_last();
  else ret = Py_NewRef(Py_None);
done:
  Py_XDECREF(keep);
  free(tags), free(actions);
  return ret;
}

static PyObject *Allocator_wake(AllocatorObject *self, PyObject *args) {
  PyObject *seq = Py_None;
  if (!PyArg_ParseTuple(args, "|O", &seq)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  const char **tags = NULL;
  Py_ssize_t n = 0;
  if (seq != Py_None && parse_tags(seq, &tags, &n)) {
    free(tags);
    return NULL;
  }
  int rc;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_wake(a, seq == Py_None ? NULL : tags, (size_t)n);
  Py_END_ALLOW_THREADS msv_release(a);
  free(tags);
  if (rc) return raise_last();
  Py_RETURN_NONE;
}

static const char *state_name(int s) {
  return s == MSV_TAG_AWAKE ? "awake" : s == MSV_TAG_OFFLOADED ? "offloaded" : "discarded";
}

static PyObject *Allocator_tag_stats(AllocatorObject *self, PyObject *args) {
  int nonblocking = 0;
  if (!PyArg_ParseTuple(args, "|p", &nonblocking)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  size_t n = 0;
  msv_tag_stats probe;
  int rc;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_tag_stats_all(a, &probe, 0, &n, nonblocking);
  Py_END_ALLOW_THREADS if (rc) {
    msv_release(a);
    return raise_last();
  }
  size_t cap = n + 8; /* room for tags created meanwhile */
  msv_tag_stats *st = calloc(cap, sizeof *st);
  if (!st) {
    msv_release(a);
    return PyErr_NoMemory();
  }
  Py_BEGIN_ALLOW_THREADS rc = msv_tag_stats_all(a, st, cap, &n, nonblocking);
  Py_END_ALLOW_THREADS msv_release(a);
  if (rc) {
    free(st);
    return raise_last();
  }
  if (n > cap) n = cap;
  PyObject *out = PyList_New(0);
  for (size_t i = 0; out && i < n; i++) {
    PyObject *d = Py_BuildValue("{s:s,s:s,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "tag", st[i].tag, "state",
                                state_name(st[i].state), "base", (unsigned long long)st[i].base, "mapped_bytes",
                                (unsigned long long)st[i].mapped_bytes, "layout_bytes",
                                (unsigned long long)st[i].layout_bytes, "allocated_bytes",
                                (unsigned long long)st[i].allocated_bytes, "offloaded_bytes",
                                (unsigned long long)st[i].offloaded_bytes, "discarded_bytes",
                                (unsigned long long)st[i].discarded_bytes, "allocations",
                                (unsigned long long)st[i].n_allocs, "extents", (unsigned long long)st[i].n_extents);
    if (!d || PyList_Append(out, d)) {
      Py_XDECREF(d);
      Py_CLEAR(out);
      break;
    }
    Py_DECREF(d);
  }
  free(st);
  return out;
}

static PyObject *Allocator_counters(AllocatorObject *self, PyObject *args) {
  int nonblocking = 0;
  if (!PyArg_ParseTuple(args, "|p", &nonblocking)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  msv_counters c;
  int rc;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_get_counters(a, &c, nonblocking);
  Py_END_ALLOW_THREADS msv_release(a);
  if (rc) return raise_last();
  return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:d,s:d,s:d,s:d,s:K,s:K,s:K,s:K,s:d,s:d,s:d,s:d}", "bytes_offloaded",
                       c.bytes_offloaded, "bytes_restored", c.bytes_restored, "bytes_verified", c.bytes_verified,
                       "sleeps", c.sleeps, "wakes", c.wakes, "last_sleep_seconds", c.last_sleep_seconds,
                       "last_wake_seconds", c.last_wake_seconds, "last_sleep_unmap_seconds",
                       c.last_sleep_unmap_seconds, "last_wake_map_seconds", c.last_wake_map_seconds,
                       "host_chunks_created", c.host_chunks_created, "host_chunks_reused",
                       c.host_chunks_reused, "host_held_bytes", (unsigned long long)c.host_held_bytes,
                       "host_reserve_bytes", (unsigned long long)c.host_reserve_bytes, "host_prefault_seconds",
                       c.host_prefault_seconds, "host_register_seconds", c.host_register_seconds,
                       "last_copy_validate_seconds", c.last_copy_validate_seconds, "last_copy_seconds",
                       c.last_copy_seconds);
}

static PyObject *Allocator_mem_info(AllocatorObject *self, PyObject *unused) {
  (void)unused;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  msv_backend *b = msv_get_backend(a);
  size_t f = 0, t = 0;
  if (b->mem_info(b, &f, &t)) return raise_last();
  return Py_BuildValue("(KK)", (unsigned long long)f, (unsigned long long)t);
}

/* Read a sequence (or int64 buffer) of non-negative ints into a fresh array. */
static int read_u64s(PyObject *obj, const char *what, uint64_t **out, Py_ssize_t *n) {
  *out = NULL;
  Py_buffer view;
  if (PyObject_CheckBuffer(obj) && PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
    if (!items_are(&view, 8, "qQlL")) {
      PyBuffer_Release(&view);
      PyErr_Format(g_err[MSV_E_INVALID], "%s: buffer must hold 64-bit integers", what);
      return -1;
    }
    *n = view.len / 8;
    *out = malloc((size_t)(*n ? *n : 1) * 8);
    if (*out) memcpy(*out, view.buf, (size_t)*n * 8);
    PyBuffer_Release(&view);
    if (!*out) return PyErr_NoMemory(), -1;
    for (Py_ssize_t i = 0; i < *n; i++)
      if ((int64_t)(*out)[i] < 0) {
        PyErr_Format(g_err[MSV_E_INVALID], "%s[%zd] is negative", what, i);
        return -1;
      }
    return 0;
  }
  PyErr_Clear();
  *n = PySequence_Size(obj);
  if (*n < 0) {
    PyErr_Clear();
    PyErr_Format(g_err[MSV_E_INVALID], "%s must be a sequence of integers", what);
    return -1;
  }
  *out = malloc((size_t)(*n ? *n : 1) * 8);
  if (!*out) return PyErr_NoMemory(), -1;
  for (Py_ssize_t i = 0; i < *n; i++) {
    PyObject *it = PySequence_GetItem(obj, i);
    if (!it) return -1;
    long long v = PyLong_Check(it) ? PyLong_AsLongLong(it) : -1;
    int bad = !PyLong_Check(it);
    Py_DECREF(it);
    if (PyErr_Occurred() || bad) {
      PyErr_Clear();
      PyErr_Format(g_err[MSV_E_INVALID], "%s[%zd] must be an integer in [0, 2**63)", what, i);
      return -1;
    }
    if (v < 0) {
      PyErr_Format(g_err[MSV_E_INVALID], "%s[%zd] is negative", what, i);
      return -1;
    }
    (*out)[i] = (uint64_t)v;
  }
  return 0;
}

/* copy_blocks(src_ptrs, dst_ptrs, sizes, method=0, stream=0) */
static PyObject *Allocator_copy_blocks(AllocatorObject *self, PyObject *args) {
  PyObject *so, *dobj, *zo;
  int method = MSV_COPY_AUTO;
  unsigned long long stream = 0;
  if (!PyArg_ParseTuple(args, "OOO|iK", &so, &dobj, &zo, &method, &stream)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  uint64_t *src = NULL, *dst = NULL, *sz = NULL;
  Py_ssize_t ns = 0, nd = 0, nz = 0;
  PyObject *ret = NULL;
  if (read_u64s(so, "src_ptrs", &src, &ns) || read_u64s(dobj, "dst_ptrs", &dst, &nd) || read_u64s(zo, "sizes", &sz, &nz))
    goto done;
  if (ns != nd || ns != nz) {
    PyErr_Format(g_err[MSV_E_INVALID], "mismatched lengths: %zd sources, %zd destinations, %zd sizes", ns, nd, nz);
    goto done;
  }
  int rc;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_copy_blocks(a, src, dst, sz, (size_t)ns, method, stream);
  Py_END_ALLOW_THREADS msv_release(a);
  if (rc) raise_last();
  else ret = Py_NewRef(Py_None);
done:
  free(src), free(dst), free(sz);
  return ret;
}

/* ---- the Fence type: a copy in flight ---- */
typedef struct {
  PyObject_HEAD msv_allocator *a; /* held: the backend outlives every fence */
  uint64_t fence;
  int state; /* FENCE_PENDING, FENCE_WAITING (a thread waits without the GIL), FENCE_DONE */
} FenceObject;
enum { FENCE_PENDING, FENCE_WAITING, FENCE_DONE };

static PyTypeObject *g_fence_type;

static PyObject *Fence_wait(FenceObject *self, PyObject *unused) {
  (void)unused;
  if (self->state == FENCE_DONE) Py_RETURN_NONE;
  if (self->state == FENCE_WAITING)
    return PyErr_Format(g_err[MSV_E_STATE], "another thread is waiting on this fence");
  self->state = FENCE_WAITING;
  int rc;
  uint64_t f = self->fence;
  Py_BEGIN_ALLOW_THREADS rc = msv_fence_wait(self->a, f);
  Py_END_ALLOW_THREADS self->state = FENCE_DONE;
  self->fence = 0;
  if (rc) return raise_last();
  Py_RETURN_NONE;
}

static PyObject *Fence_done(FenceObject *self, void *unused) {
  (void)unused;
  return PyBool_FromLong(self->state == FENCE_DONE);
}

static void Fence_dealloc(FenceObject *self) {
  if (self->a) {
    if (self->state == FENCE_PENDING) msv_fence_release(self->a, self->fence); /* FENCE_WAITING holds a ref */
    msv_release(self->a);
  }
  PyTypeObject *tp = Py_TYPE((PyObject *)self);
  freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  f(self);
  Py_DECREF(tp);
}

static PyMethodDef Fence_methods[] = {
    {"wait", (PyCFunction)Fence_wait, METH_NOARGS, "Block (without the GIL) until the copy is done; raise if it failed."},
    {NULL, NULL, 0, NULL}};
static PyGetSetDef Fence_getset[] = {{"done", (getter)Fence_done, NULL, "whether wait() returned", NULL},
                                     {NULL, NULL, NULL, NULL, NULL}};
static PyType_Slot Fence_slots[] = {{Py_tp_dealloc, Fence_dealloc},
                                    {Py_tp_methods, Fence_methods},
                                    {Py_tp_getset, Fence_getset},
                                    {Py_tp_doc, "A copy enqueued on the device: wait() once it must be complete."},
                                    {0, NULL}};
static PyType_Spec Fence_spec = {"worker._native.Fence", sizeof(FenceObject), 0,
                                 Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, Fence_slots};

/* copy_block_ids(src_base, dst_base, block_bytes, src_ids, dst_ids, method=0, stream=0, wait=True)
 * -> None, or with wait=False a Fence once the copy is enqueued */
static PyObject *Allocator_copy_block_ids(AllocatorObject *self, PyObject *args) {
  unsigned long long src_base, dst_base, block_bytes, stream = 0;
  PyObject *so, *dobj;
  int method = MSV_COPY_AUTO, wait = 1;
  if (!PyArg_ParseTuple(args, "KKKOO|iKp", &src_base, &dst_base, &block_bytes, &so, &dobj, &method, &stream, &wait))
    return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  uint64_t *src = NULL, *dst = NULL;
  Py_ssize_t ns = 0, nd = 0;
  PyObject *ret = NULL;
  FenceObject *fo = NULL;
  if (read_u64s(so, "src_ids", &src, &ns) || read_u64s(dobj, "dst_ids", &dst, &nd)) goto done;
  if (ns != nd) {
    PyErr_Format(g_err[MSV_E_INVALID], "mismatched lengths: %zd source ids, %zd destination ids", ns, nd);
    goto done;
  }
  if (!wait && !(fo = PyObject_New(FenceObject, g_fence_type))) goto done;
  if (fo) fo->a = NULL, fo->fence = 0, fo->state = FENCE_DONE;
  int rc;
  uint64_t fence = 0;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_copy_block_ids(a, src_base, dst_base, block_bytes, (const int64_t *)src,
                                                 (const int64_t *)dst, (size_t)ns, method, stream, fo ? &fence : NULL);
  Py_END_ALLOW_THREADS if (rc) {
    msv_release(a);
    raise_last();
  } else if (fo) {
    fo->a = a; /* the reference taken above */
    fo->fence = fence;
    fo->state = FENCE_PENDING;
    ret = (PyObject *)fo;
    fo = NULL;
  } else {
    msv_release(a);
    ret = Py_NewRef(Py_None);
  }
done:
  Py_XDECREF((PyObject *)fo);
  free(src), free(dst);
  return ret;
}

/* copies_wait(): wait for every copy enqueued on the allocator's own stream */
static PyObject *Allocator_copies_wait(AllocatorObject *self, PyObject *unused) {
  (void)unused;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  int rc;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_copies_wait(a);
  Py_END_ALLOW_THREADS msv_release(a);
  if (rc) return raise_last();
  Py_RETURN_NONE;
}

static PyObject *Allocator_has_method(AllocatorObject *self, PyObject *args) {
  int m;
  if (!PyArg_ParseTuple(args, "i", &m)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  msv_backend *b = msv_get_backend(a);
  return PyBool_FromLong(b->has_method(b, m));
}

static PyObject *Allocator_set_checksum(AllocatorObject *self, PyObject *args) {
  int on;
  if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  msv_set_checksum(a, on);
  Py_RETURN_NONE;
}

static PyObject *Allocator_set_host_reserve(AllocatorObject *self, PyObject *args) {
  unsigned long long n;
  if (!PyArg_ParseTuple(args, "K", &n)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS msv_set_host_reserve(a, n);
  Py_END_ALLOW_THREADS msv_release(a);
  Py_RETURN_NONE;
}

/* prepin_host(nbytes): page-lock host chunks for the offload engine now, not on the first sleep */
static PyObject *Allocator_prepin_host(AllocatorObject *self, PyObject *args) {
  long long n;
  if (!PyArg_ParseTuple(args, "L", &n)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  if (n < 0) return PyErr_Format(g_err[MSV_E_INVALID], "bytes to pre-pin must be >= 0, got %lld", n);
  int rc;
  msv_retain(a); /* faulting and pinning take seconds: a close() meanwhile must not destroy it */
  Py_BEGIN_ALLOW_THREADS rc = msv_host_prepin(a, (size_t)n);
  Py_END_ALLOW_THREADS msv_release(a);
  if (rc) return raise_last();
  Py_RETURN_NONE;
}

static PyObject *Allocator_lookup(AllocatorObject *self, PyObject *args) {
  unsigned long long p, size = 1;
  if (!PyArg_ParseTuple(args, "K|K", &p, &size)) return NULL;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  uint64_t base;
  char tag[64];
  if (msv_lookup(a, p, size, &base, tag, sizeof tag)) return raise_last();
  return Py_BuildValue("(Ks)", (unsigned long long)base, tag);
}

static PyObject *Allocator_install_torch_hook(AllocatorObject *self, PyObject *unused) {
  (void)unused;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  msv_hook_install(a);
  Py_RETURN_NONE;
}

static PyObject *Allocator_info(AllocatorObject *self, PyObject *unused) {
  (void)unused;
  msv_allocator *a = get(self);
  if (!a) return NULL;
  msv_backend *b = msv_get_backend(a);
  return Py_BuildValue("{s:s,s:i,s:K}", "backend", b->name, "device", b->device, "granularity",
                       (unsigned long long)b->granularity);
}

static PyMethodDef Allocator_methods[] = {
    {"close", (PyCFunction)Allocator_close, METH_NOARGS, "Drop this handle; memory is released once no tensor uses it."},
    {"alloc", (PyCFunction)Allocator_alloc, METH_VARARGS, "alloc(tag, size) -> address"},
    {"free", (PyCFunction)Allocator_free, METH_VARARGS, "free(address)"},
    {"tensor", (PyCFunction)Allocator_tensor, METH_VARARGS, "tensor(tag, nbytes, shape, code, bits) -> DLPack capsule"},
    {"host_tensor", (PyCFunction)Allocator_host_tensor, METH_VARARGS, "host_tensor(nbytes, shape, code, bits) -> capsule"},
    {"sleep", (PyCFunction)Allocator_sleep, METH_VARARGS, "sleep([(tag, action), ...])"},
    {"wake", (PyCFunction)Allocator_wake, METH_VARARGS, "wake(tags=None)"},
    {"tag_stats", (PyCFunction)Allocator_tag_stats, METH_VARARGS, "tag_stats(nonblocking=False): per-tag statistics"},
    {"counters", (PyCFunction)Allocator_counters, METH_VARARGS, "counters(nonblocking=False)"},
    {"mem_info", (PyCFunction)Allocator_mem_info, METH_NOARGS, "(free, total) device bytes"},
    {"copy_blocks", (PyCFunction)Allocator_copy_blocks, METH_VARARGS, "copy_blocks(src, dst, sizes, method, stream)"},
    {"copy_block_ids", (PyCFunction)Allocator_copy_block_ids, METH_VARARGS,
     "copy_block_ids(src_base, dst_base, block_bytes, src_ids, dst_ids, method, stream, wait=True) -> None | Fence"},
    {"copies_wait", (PyCFunction)Allocator_copies_wait, METH_NOARGS, "wait for every copy on the allocator's stream"},
    {"has_method", (PyCFunction)Allocator_has_method, METH_VARARGS, "has_method(method) -> bool"},
    {"set_checksum", (PyCFunction)Allocator_set_checksum, METH_VARARGS, "set_checksum(on)"},
    {"set_host_reserve", (PyCFunction)Allocator_set_host_reserve, METH_VARARGS, "set_host_reserve(bytes)"},
    {"prepin_host", (PyCFunction)Allocator_prepin_host, METH_VARARGS,
     "prepin_host(bytes): map, pre-fault and page-lock offload chunks now; raises the host reserve to bytes"},
    {"lookup", (PyCFunction)Allocator_lookup, METH_VARARGS, "lookup(addr, size=1) -> (base, tag)"},
    {"install_torch_hook", (PyCFunction)Allocator_install_torch_hook, METH_NOARGS, "route msv_torch_malloc here"},
    {"info", (PyCFunction)Allocator_info, METH_NOARGS, "backend name, device, granularity"},
    {NULL, NULL, 0, NULL}};

static PyType_Slot Allocator_slots[] = {{Py_tp_init, Allocator_init},
                                        {Py_tp_dealloc, Allocator_dealloc},
                                        {Py_tp_methods, Allocator_methods},
                                        {Py_tp_doc, "The native allocator: arenas per tag over one backend."},
                                        {0, NULL}};

static PyType_Spec Allocator_spec = {"worker._native.Allocator", sizeof(AllocatorObject), 0,
                                     Py_TPFLAGS_DEFAULT, Allocator_slots};

/* ---- module functions ---- */
static PyObject *mod_cuda_device_count(PyObject *m, PyObject *unused) {
  (void)m, (void)unused;
  int n = 0;
  msv_cuda_available(&n);
  return PyLong_FromLong(n);
}

static PyObject *mod_cuda_unavailable_reason(PyObject *m, PyObject *unused) {
  (void)m, (void)unused;
  int n = 0;
  if (msv_cuda_available(&n) == MSV_OK) Py_RETURN_NONE;
  return PyUnicode_FromString(msv_last_error());
}

static PyObject *mod_set_pool_tag(PyObject *m, PyObject *args) {
  (void)m;
  const char *tag;
  if (!PyArg_ParseTuple(args, "s", &tag)) return NULL;
  msv_hook_set_tag(tag);
  Py_RETURN_NONE;
}

static PyObject *mod_checksum(PyObject *m, PyObject *args) {
  (void)m;
  Py_buffer v;
  if (!PyArg_ParseTuple(args, "y*", &v)) return NULL;
  uint64_t s = msv_checksum_cpu(v.buf, (size_t)v.len, 0);
  PyBuffer_Release(&v);
  return PyLong_FromUnsignedLongLong(s);
}

/* A C-contiguous buffer of `itemsize`-byte items, `kinds` naming the accepted format letters. */
static int get_items(PyObject *obj, const char *what, Py_ssize_t itemsize, const char *kinds, int writable,
                     Py_buffer *view) {
  int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj, view, flags) != 0) {
    PyErr_Clear();
    PyErr_Format(g_err[MSV_E_INVALID], "%s must be a contiguous%s array", what, writable ? ", writable" : "");
    return -1;
  }
  if (!items_are(view, itemsize, kinds)) {
    PyBuffer_Release(view);
    PyErr_Format(g_err[MSV_E_INVALID], "%s must hold %zd-byte items of kind '%s'", what, itemsize, kinds);
    return -1;
  }
  return 0;
}

/* From this many ids the KV passes run without the GIL: the event loop serves other calls meanwhile.
 * Both read each id once and bound-check it where it is used, so another thread changing an array
 * meanwhile costs a wrong answer or an error, never an access out of bounds; the KV cache's own
 * arrays are touched by one thread at a time, under the runner's lock. */
#define KV_NOGIL_MIN 1024

/* kv_check(src, dst, n_src, n_dst, owner_dst) -> (code, index): see msv_kv_check */
static PyObject *mod_kv_check(PyObject *m, PyObject *args) {
  (void)m;
  PyObject *so, *dobj, *oo;
  long long n_src, n_dst;
  if (!PyArg_ParseTuple(args, "OOLLO", &so, &dobj, &n_src, &n_dst, &oo)) return NULL;
  Py_buffer s, d, o;
  if (get_items(so, "src", 8, "qlQL", 0, &s)) return NULL;
  if (get_items(dobj, "dst", 8, "qlQL", 0, &d)) return PyBuffer_Release(&s), NULL;
  if (get_items(oo, "owner_dst", 8, "ql", 0, &o)) return PyBuffer_Release(&s), PyBuffer_Release(&d), NULL;
  PyObject *ret = NULL;
  if (s.len != d.len)
    PyErr_Format(g_err[MSV_E_INVALID], "%zd source ids but %zd destination ids", s.len / 8, d.len / 8);
  else if (n_dst < 0 || o.len / 8 < n_dst)
    PyErr_Format(g_err[MSV_E_INVALID], "owner_dst holds %zd blocks, fewer than n_dst = %lld", o.len / 8, n_dst);
  else {
    size_t bad = 0, n = (size_t)(s.len / 8);
    int code;
    if (n < KV_NOGIL_MIN) code = msv_kv_check(s.buf, d.buf, n, n_src, n_dst, o.buf, &bad);
    else {
      Py_BEGIN_ALLOW_THREADS code = msv_kv_check(s.buf, d.buf, n, n_src, n_dst, o.buf, &bad);
      Py_END_ALLOW_THREADS
    }
    if (code == MSV_KV_NO_MEMORY) PyErr_NoMemory();
    else ret = Py_BuildValue("(in)", code, (Py_ssize_t)bad);
  }
  PyBuffer_Release(&s), PyBuffer_Release(&d), PyBuffer_Release(&o);
  return ret;
}

/* kv_move(src, dst, owner_src, owner_dst, slot_block, slot_host, to_host) -> blocks whose owner moved */
static PyObject *mod_kv_move(PyObject *m, PyObject *args) {
  (void)m;
  PyObject *obj[6];
  int to_host;
  if (!PyArg_ParseTuple(args, "OOOOOOp", &obj[0], &obj[1], &obj[2], &obj[3], &obj[4], &obj[5], &to_host)) return NULL;
  static const char *names[6] = {"src", "dst", "owner_src", "owner_dst", "slot_block", "slot_host"};
  Py_buffer v[6];
  int got = 0, rc = 0;
  for (; got < 6; got++) {
    int host = got == 5;
    if (get_items(obj[got], names[got], host ? 1 : 8, host ? "?bB" : (got < 2 ? "qlQL" : "ql"), got >= 2, &v[got])) {
      rc = -1;
      break;
    }
  }
  if (!rc && v[0].len != v[1].len) {
    PyErr_Format(g_err[MSV_E_INVALID], "%zd source ids but %zd destination ids", v[0].len / 8, v[1].len / 8);
    rc = -1;
  }
  if (!rc && v[4].len / 8 != v[5].len) {
    PyErr_Format(g_err[MSV_E_INVALID], "slot_block and slot_host differ in length");
    rc = -1;
  }
  size_t moved = 0;
  if (!rc) {
    size_t n = (size_t)(v[0].len / 8);
    int bad;
    if (n < KV_NOGIL_MIN)
      bad = msv_kv_move(v[0].buf, v[1].buf, n, v[2].buf, (size_t)(v[2].len / 8), v[3].buf, (size_t)(v[3].len / 8),
                        v[4].buf, v[5].buf, (size_t)v[5].len, to_host, &moved);
    else {
      Py_BEGIN_ALLOW_THREADS bad = msv_kv_move(v[0].buf, v[1].buf, n, v[2].buf, (size_t)(v[2].len / 8), v[3].buf,
                                               (size_t)(v[3].len / 8), v[4].buf, v[5].buf, (size_t)v[5].len, to_host,
                                               &moved);
      Py_END_ALLOW_THREADS
    }
    if (bad) {
      raise_last();
      rc = -1;
    }
  }
  for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
  return rc ? NULL : PyLong_FromSize_t(moved);
}

static PyMethodDef mod_methods[] = {
    {"cuda_device_count", mod_cuda_device_count, METH_NOARGS, "CUDA devices the driver reports (0 without a driver)."},
    {"cuda_unavailable_reason", mod_cuda_unavailable_reason, METH_NOARGS, "why the cuda backend cannot run, or None"},
    {"set_pool_tag", mod_set_pool_tag, METH_VARARGS, "tag for allocations made through the torch hook"},
    {"checksum", mod_checksum, METH_VARARGS, "the offload checksum of a bytes-like object"},
    {"kv_check", mod_kv_check, METH_VARARGS, "kv_check(src, dst, n_src, n_dst, owner_dst) -> (code, index)"},
    {"kv_move", mod_kv_move, METH_VARARGS, "kv_move(src, dst, owner_src, owner_dst, slot_block, slot_host, to_host) -> owned blocks moved"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_native", "memsvc native allocator core", -1, mod_methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
  if (load_errors()) return NULL;
  PyObject *m = PyModule_Create(&moddef);
  if (!m) return NULL;
  PyObject *t = PyType_FromSpec(&Allocator_spec);
  if (!t || PyModule_AddObject(m, "Allocator", t)) {
    Py_XDECREF(t);
    Py_DECREF(m);
    return NULL;
  }
  g_fence_type = (PyTypeObject *)PyType_FromSpec(&Fence_spec);
  if (!g_fence_type || PyModule_AddObject(m, "Fence", Py_NewRef((PyObject *)g_fence_type))) {
    Py_DECREF(m);
    return NULL;
  }
  PyModule_AddIntConstant(m, "BACKEND_HOST", MSV_BACKEND_HOST);
  PyModule_AddIntConstant(m, "BACKEND_CUDA", MSV_BACKEND_CUDA);
  PyModule_AddIntConstant(m, "KEEP", MSV_ACTION_KEEP);
  PyModule_AddIntConstant(m, "OFFLOAD", MSV_ACTION_OFFLOAD);
  PyModule_AddIntConstant(m, "DISCARD", MSV_ACTION_DISCARD);
  PyModule_AddIntConstant(m, "COPY_AUTO", MSV_COPY_AUTO);
  PyModule_AddIntConstant(m, "COPY_LOOP", MSV_COPY_LOOP);
  PyModule_AddIntConstant(m, "COPY_BATCH", MSV_COPY_BATCH);
  PyModule_AddIntConstant(m, "COPY_KERNEL", MSV_COPY_KERNEL);
  PyModule_AddIntConstant(m, "KV_OK", MSV_KV_OK);
  PyModule_AddIntConstant(m, "KV_SRC_RANGE", MSV_KV_SRC_RANGE);
  PyModule_AddIntConstant(m, "KV_DST_RANGE", MSV_KV_DST_RANGE);
  PyModule_AddIntConstant(m, "KV_SRC_TWICE", MSV_KV_SRC_TWICE);
  PyModule_AddIntConstant(m, "KV_DST_TWICE", MSV_KV_DST_TWICE);
  PyModule_AddIntConstant(m, "KV_DST_IN_USE", MSV_KV_DST_IN_USE);
  return m;
}
