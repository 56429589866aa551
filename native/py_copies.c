/* The Allocator's copy methods: copy_blocks (pointers and sizes) and copy_block_ids (block ids of
 * two pools, the SwapBlocks fast path), which may return a Fence instead of waiting. Ids and
 * pointers arrive as buffers or sequences (py_buffers.c); the copy runs without the GIL. */
#include "py_internal.h"

/* copy_blocks(src_ptrs, dst_ptrs, sizes, method=0, stream=0) */
PyObject *Allocator_copy_blocks(AllocatorObject *self, PyObject *args) {
  PyObject *so, *dobj, *zo;
  int method = MSV_COPY_AUTO;
  unsigned long long stream = 0;
  if (!PyArg_ParseTuple(args, "OOO|iK", &so, &dobj, &zo, &method, &stream)) return NULL;
  msv_allocator *a = allocator_of(self);
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

/* copy_block_ids(src_base, dst_base, block_bytes, src_ids, dst_ids, method=0, stream=0, wait=True)
 * -> None, or with wait=False a Fence once the copy is enqueued */
PyObject *Allocator_copy_block_ids(AllocatorObject *self, PyObject *args) {
  unsigned long long src_base, dst_base, block_bytes, stream = 0;
  PyObject *so, *dobj;
  int method = MSV_COPY_AUTO, wait = 1;
  if (!PyArg_ParseTuple(args, "KKKOO|iKp", &src_base, &dst_base, &block_bytes, &so, &dobj, &method, &stream, &wait))
    return NULL;
  msv_allocator *a = allocator_of(self);
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
  if (!wait && !(fo = fence_new())) goto done;
  int rc;
  uint64_t fence = 0;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_copy_block_ids(a, src_base, dst_base, block_bytes, (const int64_t *)src,
                                                 (const int64_t *)dst, (size_t)ns, method, stream, fo ? &fence : NULL);
  Py_END_ALLOW_THREADS if (rc) {
    msv_release(a);
    raise_last();
  } else if (fo) {
    fence_arm(fo, a, fence); /* with the reference taken above */
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
PyObject *Allocator_copies_wait(AllocatorObject *self, PyObject *unused) {
  (void)unused;
  msv_allocator *a = allocator_of(self);
  if (!a) return NULL;
  int rc;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_copies_wait(a);
  Py_END_ALLOW_THREADS msv_release(a);
  if (rc) return raise_last();
  Py_RETURN_NONE;
}

/* new_stream(): a device stream of the caller's own (msv_new_stream), as its handle */
PyObject *Allocator_new_stream(AllocatorObject *self, PyObject *unused) {
  (void)unused;
  msv_allocator *a = allocator_of(self);
  if (!a) return NULL;
  uint64_t s = 0;
  if (msv_new_stream(a, &s)) return raise_last();
  return PyLong_FromUnsignedLongLong(s);
}

PyObject *Allocator_has_method(AllocatorObject *self, PyObject *args) {
  int m;
  if (!PyArg_ParseTuple(args, "i", &m)) return NULL;
  msv_allocator *a = allocator_of(self);
  if (!a) return NULL;
  msv_backend *b = msv_get_backend(a);
  return PyBool_FromLong(b->has_method(b, m));
}
