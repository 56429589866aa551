/* Integer arrays out of Python arguments: C-contiguous buffers read in place (numpy arrays,
 * array('q')), and sequences of ints copied out. An 8192-block swap's ids then cross into C as one
 * buffer, not 8192 Python ints. A bad argument is InvalidArgument naming it. */
#include "py_internal.h"

/* Whether a buffer holds `itemsize`-byte items, native or little-endian, of a format letter in
 * `kinds` ('>' and '!' fall through as bad). */
static int items_are(const Py_buffer *v, Py_ssize_t itemsize, const char *kinds) {
  const char *f = v->format ? v->format : "B";
  if (*f && strchr("@=<", *f)) f++;
  return v->itemsize == itemsize && f[0] && !f[1] && strchr(kinds, f[0]);
}

/* A C-contiguous buffer of `itemsize`-byte items, `kinds` naming the accepted format letters. */
int get_items(PyObject *obj, const char *what, Py_ssize_t itemsize, const char *kinds, int writable,
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

/* Read a sequence (or int64 buffer) of non-negative ints into a fresh array. */
int read_u64s(PyObject *obj, const char *what, uint64_t **out, Py_ssize_t *n) {
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
    if (!*out) return raise_no_memory(what), -1;
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
  if (!*out) return raise_no_memory(what), -1;
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
