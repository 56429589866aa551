/* The Allocator's transitions: sleep([(tag, action), ...]) and wake(tags=None). Action codes pass
 * through unchecked; msv_sleep alone decides which exist. Both run without the GIL, holding the tag
 * strings alive meanwhile. */
#include "py_internal.h"

static int parse_tags(PyObject *seq, const char ***tags, Py_ssize_t *n) {
  *n = PySequence_Size(seq);
  if (*n < 0) return -1;
  *tags = calloc((size_t)(*n ? *n : 1), sizeof(char *));
  if (!*tags) {
    raise_no_memory("the tag list");
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
PyObject *Allocator_sleep(AllocatorObject *self, PyObject *args) {
  PyObject *pairs;
  if (!PyArg_ParseTuple(args, "O", &pairs)) return NULL;
  msv_allocator *a = allocator_of(self);
  if (!a) return NULL;
  Py_ssize_t n = PySequence_Size(pairs);
  if (n < 0) return NULL;
  PyObject *keep = PyList_New(0); /* keeps tag strings alive while the GIL is released */
  const char **tags = calloc((size_t)(n ? n : 1), sizeof(char *));
  int *actions = calloc((size_t)(n ? n : 1), sizeof(int));
  PyObject *ret = NULL;
  if (!keep || !tags || !actions) {
    raise_no_memory("the sleep request");
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

PyObject *Allocator_wake(AllocatorObject *self, PyObject *args) {
  PyObject *seq = Py_None;
  if (!PyArg_ParseTuple(args, "|O", &seq)) return NULL;
  msv_allocator *a = allocator_of(self);
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
