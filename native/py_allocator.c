/* The Allocator type: one handle on a native allocator (arenas per tag over one backend). Here are
 * its life cycle, tensors, knobs and lookups, and its method table; the transitions, numbers and
 * copies are in py_transitions.c, py_stats.c and py_copies.c. Long calls release the GIL and hold
 * a reference to the allocator meanwhile, so a close() on another thread never destroys it under
 * them. */
#include "py_internal.h"

static int Allocator_init(AllocatorObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"backend", "device", "host_capacity", "granularity", "arena_va_bytes", "host_chunk_bytes",
                           "host_reserve_bytes", "checksum", "prefault_threads", "huge_pages", "offload_dir", NULL};
  msv_config c;
  memset(&c, 0, sizeof c);
  unsigned long long cap = 0, gran = 0, va = 0, chunk = 0, reserve = 0;
  int checksum = 0, huge_pages = 1;
  const char *offload_dir = "";
  if (!PyArg_ParseTupleAndKeywords(args, kw, "ii|KKKKKpips", kwlist, &c.backend, &c.device, &cap, &gran, &va, &chunk,
                                   &reserve, &checksum, &c.prefault_threads, &huge_pages, &offload_dir))
    return -1;
  if (strlen(offload_dir) >= sizeof c.offload_dir) {
    PyErr_SetString(g_err[MSV_E_INVALID], "offload_dir is too long");
    return -1;
  }
  snprintf(c.offload_dir, sizeof c.offload_dir, "%s", offload_dir);
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
  msv_allocator *a = allocator_of(self);
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
  msv_allocator *a = allocator_of(self);
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
  msv_allocator *a = allocator_of(self);
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
  PyObject *cap = make_capsule(a, OWN_POOL, (msv_staged){p, 0, 0}, shape, code, bits, cuda ? 2 : 1, cuda ? b->device : 0);
  msv_release(a); /* the capsule holds its own reference; on failure it already freed p */
  return cap;
}

/* host_tensor(nbytes, shape, dlpack_code, bits) -> capsule of a page-locked host buffer (CPU) */
static PyObject *Allocator_host_tensor(AllocatorObject *self, PyObject *args) {
  long long nbytes;
  PyObject *shape;
  int code, bits;
  if (!PyArg_ParseTuple(args, "LOii", &nbytes, &shape, &code, &bits)) return NULL;
  msv_allocator *a = allocator_of(self);
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
  PyObject *cap = make_capsule(a, OWN_HOST, (msv_staged){p, 0, 0}, shape, code, bits, 1, 0);
  msv_release(a); /* the capsule holds its own reference; on failure it already freed p */
  return cap;
}

/* stage_file(fd, offset, length, threads) -> capsule of a uint8 [length] tensor on the device holding
 * those bytes of the file (filestream.c); its memory is unmapped when the tensor dies */
static PyObject *Allocator_stage_file(AllocatorObject *self, PyObject *args) {
  int fd, threads;
  long long offset, length;
  if (!PyArg_ParseTuple(args, "iLLi", &fd, &offset, &length, &threads)) return NULL;
  msv_allocator *a = allocator_of(self);
  if (!a) return NULL;
  if (offset < 0 || length <= 0)
    return PyErr_Format(g_err[MSV_E_INVALID], "a file range to stage needs offset >= 0 and length > 0, got %lld, %lld",
                        offset, length);
  msv_staged mem;
  int rc;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_stage_file(a, fd, (uint64_t)offset, (uint64_t)length, threads, &mem);
  Py_END_ALLOW_THREADS if (rc) {
    msv_release(a);
    return raise_last();
  }
  msv_backend *b = msv_get_backend(a);
  int cuda = b->kind == MSV_BACKEND_CUDA;
  PyObject *shape = Py_BuildValue("(L)", length);
  PyObject *cap = shape ? make_capsule(a, OWN_STAGED, mem, shape, 1 /* kDLUInt */, 8, cuda ? 2 : 1, cuda ? b->device : 0)
                        : NULL;
  if (!shape) msv_unstage(a, &mem);
  Py_XDECREF(shape);
  msv_release(a);
  return cap;
}

static PyObject *Allocator_set_checksum(AllocatorObject *self, PyObject *args) {
  int on;
  if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
  msv_allocator *a = allocator_of(self);
  if (!a) return NULL;
  msv_set_checksum(a, on);
  Py_RETURN_NONE;
}

static PyObject *Allocator_set_host_reserve(AllocatorObject *self, PyObject *args) {
  unsigned long long n;
  if (!PyArg_ParseTuple(args, "K", &n)) return NULL;
  msv_allocator *a = allocator_of(self);
  if (!a) return NULL;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS msv_set_host_reserve(a, n);
  Py_END_ALLOW_THREADS msv_release(a);
  Py_RETURN_NONE;
}

/* cancel_prepin(): a prepin running on another thread stops before its next chunk, and none starts
 * again (the worker gives an automatic host reserve back while the host is short) */
static PyObject *Allocator_cancel_prepin(AllocatorObject *self, PyObject *unused) {
  (void)unused;
  msv_allocator *a = allocator_of(self);
  if (!a) return NULL;
  msv_host_prepin_cancel(a);
  Py_RETURN_NONE;
}

/* prepin_host(nbytes): page-lock host chunks for the offload engine now, not on the first sleep */
static PyObject *Allocator_prepin_host(AllocatorObject *self, PyObject *args) {
  long long n;
  if (!PyArg_ParseTuple(args, "L", &n)) return NULL;
  msv_allocator *a = allocator_of(self);
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
  msv_allocator *a = allocator_of(self);
  if (!a) return NULL;
  uint64_t base;
  char tag[64];
  if (msv_lookup(a, p, size, &base, tag, sizeof tag)) return raise_last();
  return Py_BuildValue("(Ks)", (unsigned long long)base, tag);
}

static PyObject *Allocator_install_torch_hook(AllocatorObject *self, PyObject *unused) {
  (void)unused;
  msv_allocator *a = allocator_of(self);
  if (!a) return NULL;
  msv_hook_install(a);
  Py_RETURN_NONE;
}

static PyObject *Allocator_info(AllocatorObject *self, PyObject *unused) {
  (void)unused;
  msv_allocator *a = allocator_of(self);
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
    {"stage_file", (PyCFunction)Allocator_stage_file, METH_VARARGS,
     "stage_file(fd, offset, length, threads) -> capsule: file bytes in device memory of their own"},
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
    {"new_stream", (PyCFunction)Allocator_new_stream, METH_NOARGS, "a device stream of the caller's own, never destroyed"},
    {"set_checksum", (PyCFunction)Allocator_set_checksum, METH_VARARGS, "set_checksum(on)"},
    {"set_host_reserve", (PyCFunction)Allocator_set_host_reserve, METH_VARARGS, "set_host_reserve(bytes)"},
    {"cancel_prepin", (PyCFunction)Allocator_cancel_prepin, METH_NOARGS,
     "cancel_prepin(): a running prepin stops before its next chunk; later ones do nothing"},
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

int add_allocator_type(PyObject *m) {
  PyObject *t = PyType_FromSpec(&Allocator_spec);
  if (!t || PyModule_AddObject(m, "Allocator", t)) {
    Py_XDECREF(t);
    return -1;
  }
  return 0;
}
