/* worker._native: the CPython binding of the native core (limited API, abi3; py_internal.h). This
 * file is the module itself: its small functions, its function table, and PyInit, which loads the
 * memsvc.errors classes, adds the Allocator and Fence types and the constants. The other py_*.c
 * files hold the rest, one idea each. */
#include "py_internal.h"

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

/* msv_sleep_rule as a dict {(state, action): state after, or None where a sleep refuses}, over every
 * state and action code: memsvc/vocabulary.py's SLEEP_RULES is held to it (tests/native). */
static PyObject *mod_sleep_rules(PyObject *m, PyObject *unused) {
  (void)m, (void)unused;
  PyObject *out = PyDict_New();
  if (!out) return NULL;
  for (int s = 0; s < MSV_TAG_STATES; s++)
    for (int act = 1; act < MSV_ACTIONS; act++) {
      int after = msv_sleep_rule(s, act);
      PyObject *key = Py_BuildValue("(si)", tag_state_name(s), act);
      PyObject *value = after == MSV_SLEEP_REFUSED ? Py_None : PyUnicode_FromString(tag_state_name(after));
      if (after == MSV_SLEEP_REFUSED) Py_INCREF(value);
      int rc = key && value ? PyDict_SetItem(out, key, value) : -1;
      Py_XDECREF(key);
      Py_XDECREF(value);
      if (rc) {
        Py_DECREF(out);
        return NULL;
      }
    }
  return out;
}

static PyObject *mod_checksum(PyObject *m, PyObject *args) {
  (void)m;
  Py_buffer v;
  if (!PyArg_ParseTuple(args, "y*", &v)) return NULL;
  uint64_t s = msv_checksum_cpu(v.buf, (size_t)v.len, 0);
  PyBuffer_Release(&v);
  return PyLong_FromUnsignedLongLong(s);
}

static PyMethodDef mod_methods[] = {
    {"cuda_device_count", mod_cuda_device_count, METH_NOARGS, "CUDA devices the driver reports (0 without a driver)."},
    {"cuda_unavailable_reason", mod_cuda_unavailable_reason, METH_NOARGS, "why the cuda backend cannot run, or None"},
    {"set_pool_tag", mod_set_pool_tag, METH_VARARGS, "tag for allocations made through the torch hook"},
    {"checksum", mod_checksum, METH_VARARGS, "the offload checksum of a bytes-like object"},
    {"sleep_rules", mod_sleep_rules, METH_NOARGS, "{(tag state, action code): the state after a sleep, or None: refused}"},
    {"kv_check", mod_kv_check, METH_VARARGS, "kv_check(src, dst, n_src, n_dst, owner_dst) -> (code, index)"},
    {"kv_move", mod_kv_move, METH_VARARGS, "kv_move(src, dst, owner_src, owner_dst, slot_block, slot_host, to_host) -> owned blocks moved"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_native", "memsvc native allocator core", -1, mod_methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
  if (load_errors()) return NULL;
  PyObject *m = PyModule_Create(&moddef);
  if (!m) return NULL;
  if (add_allocator_type(m) || add_fence_type(m)) {
    Py_DECREF(m);
    return NULL;
  }
  PyModule_AddIntConstant(m, "BACKEND_HOST", MSV_BACKEND_HOST);
  PyModule_AddIntConstant(m, "BACKEND_CUDA", MSV_BACKEND_CUDA);
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
