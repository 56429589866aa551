/* Tensors for torch as DLPack capsules (the v0.8 ABI), never through torch's C++ ABI, so one build
 * serves every torch version. Each capsule owns its allocation and a reference to the allocator:
 * the memory is freed when torch drops the tensor (or when the capsule dies unconsumed), and the
 * allocator outlives every tensor made from it. */
#include "py_internal.h"

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
  own_kind kind;
  msv_staged mem;
  int64_t shape[];
} owned_tensor;

static void free_owned(msv_allocator *a, own_kind kind, const msv_staged *mem) {
  if (kind == OWN_HOST) msv_host_free(a, mem->addr);
  else if (kind == OWN_STAGED) msv_unstage(a, mem);
  else msv_free(a, mem->addr);
}

/* Called by the consumer (torch) when the tensor dies, possibly without the GIL: C only. */
static void owned_deleter(DLManagedTensor *m) {
  owned_tensor *t = (owned_tensor *)m;
  free_owned(t->alloc, t->kind, &t->mem);
  msv_release(t->alloc);
  free(t);
}

static void capsule_destructor(PyObject *cap) {
  if (PyCapsule_IsValid(cap, "dltensor")) { /* never consumed */
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m && m->deleter) m->deleter(m);
  }
}

PyObject *make_capsule(msv_allocator *a, own_kind kind, msv_staged mem, PyObject *shape, int code, int bits,
                       int device_type, int device_id) {
  Py_ssize_t nd = PySequence_Size(shape);
  if (nd < 0) {
    free_owned(a, kind, &mem);
    return NULL;
  }
  owned_tensor *t = calloc(1, sizeof *t + (size_t)(nd ? nd : 1) * sizeof(int64_t));
  if (!t) {
    free_owned(a, kind, &mem);
    return raise_no_memory("a tensor's DLPack record");
  }
  for (Py_ssize_t i = 0; i < nd; i++) {
    PyObject *it = PySequence_GetItem(shape, i);
    t->shape[i] = it ? PyLong_AsLongLong(it) : -1;
    Py_XDECREF(it);
    if (PyErr_Occurred()) {
      free(t);
      free_owned(a, kind, &mem);
      return NULL;
    }
  }
  t->m.dl_tensor.data = (void *)(uintptr_t)mem.addr;
  t->m.dl_tensor.device = (DLDevice){device_type, device_id};
  t->m.dl_tensor.ndim = (int32_t)nd;
  t->m.dl_tensor.dtype = (DLDataType){(uint8_t)code, (uint8_t)bits, 1};
  t->m.dl_tensor.shape = t->shape;
  t->m.dl_tensor.strides = NULL; /* compact row-major */
  t->m.deleter = owned_deleter;
  t->alloc = a;
  t->kind = kind;
  t->mem = mem;
  msv_retain(a);
  PyObject *cap = PyCapsule_New(&t->m, "dltensor", capsule_destructor);
  if (!cap) owned_deleter(&t->m);
  return cap;
}
