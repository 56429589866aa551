/* Native errors as memsvc.errors exceptions, the project's single exception tree: each MSV_E_*
 * code has its class, so the servicers map every failure to a gRPC status in one place. An error
 * about one allocation (a failed checksum) carries its tag, address and size as the exception's
 * metadata; out of host memory is OutOfMemory, never the builtin MemoryError, which clients would
 * see as INTERNAL. */
#include <stdio.h>

#include "py_internal.h"

PyObject *g_err[N_ERRORS];

int load_errors(void) {
  static const char *names[N_ERRORS] = {NULL, "InvalidArgument", "NotFound", "WrongState", "OutOfMemory",
                                        "TransitionInProgress", "IntegrityError", "Unavailable", "BackendError"};
  PyObject *mod = PyImport_ImportModule("memsvc.errors");
  if (!mod) return -1;
  for (int i = 1; i < N_ERRORS; i++) {
    g_err[i] = PyObject_GetAttrString(mod, names[i]);
    if (!g_err[i]) {
      Py_DECREF(mod);
      return -1;
    }
  }
  Py_DECREF(mod);
  return 0;
}

/* cls(message, metadata={"tag": ..., "allocation": "0x...", "allocationBytes": "..."}), raised as is;
 * if that object cannot be built, the class with the message alone. */
static void raise_with_detail(PyObject *cls, const char *message, const msv_error_detail *d) {
  char addr[32], size[32];
  snprintf(addr, sizeof addr, "0x%llx", (unsigned long long)d->addr);
  snprintf(size, sizeof size, "%llu", (unsigned long long)d->size);
  PyObject *args = Py_BuildValue("(s)", message);
  PyObject *kw = Py_BuildValue("{s:{s:s,s:s,s:s}}", "metadata", "tag", d->tag, "allocation", addr, "allocationBytes",
                               size);
  PyObject *exc = args && kw ? PyObject_Call(cls, args, kw) : NULL;
  Py_XDECREF(args);
  Py_XDECREF(kw);
  if (exc) {
    PyErr_SetObject(cls, exc);
    Py_DECREF(exc);
  } else {
    PyErr_Clear();
    PyErr_SetString(cls, message);
  }
}

PyObject *raise_last(void) {
  int code = msv_last_error_code();
  PyObject *cls = (code > 0 && code < N_ERRORS && g_err[code]) ? g_err[code] : g_err[MSV_E_BACKEND];
  const msv_error_detail *d = msv_last_error_detail();
  if (d) raise_with_detail(cls, msv_last_error(), d);
  else PyErr_SetString(cls, msv_last_error());
  return NULL;
}

PyObject *raise_no_memory(const char *what) {
  return PyErr_Format(g_err[MSV_E_OOM], "out of host memory for %s", what);
}
