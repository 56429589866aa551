/* kv_check and kv_move: the KV cache's block ownership (kvtable.c) over the cache's numpy arrays,
 * read and written in place through the buffer protocol. */
#include "py_internal.h"

/* From this many ids the KV passes run without the GIL: the event loop serves other calls meanwhile.
 * Both read each id once and bound-check it where it is used, so another thread changing an array
 * meanwhile costs a wrong answer or an error, never an access out of bounds; the KV cache's own
 * arrays are touched by one thread at a time, under the runner's lock. */
#define KV_NOGIL_MIN 1024

/* kv_check(src, dst, n_src, n_dst, owner_dst) -> (code, index): see msv_kv_check */
PyObject *mod_kv_check(PyObject *m, PyObject *args) {
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
    if (code == MSV_KV_NO_MEMORY) raise_no_memory("the KV check's bitmaps");
    else ret = Py_BuildValue("(in)", code, (Py_ssize_t)bad);
  }
  PyBuffer_Release(&s), PyBuffer_Release(&d), PyBuffer_Release(&o);
  return ret;
}

/* kv_move(src, dst, owner_src, owner_dst, slot_block, slot_host, to_host) -> blocks whose owner moved */
PyObject *mod_kv_move(PyObject *m, PyObject *args) {
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
