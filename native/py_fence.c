/* The Fence type: a copy enqueued by copy_block_ids(wait=False), so the caller can prepare its next
 * request while this one's copy runs. wait() blocks without the GIL and raises the copy's error;
 * a fence dropped unwaited releases its mark without cancelling the copy. */
#include "py_internal.h"

struct FenceObject {
  PyObject_HEAD msv_allocator *a; /* held: the backend outlives every fence */
  uint64_t fence;
  int state; /* FENCE_PENDING, FENCE_WAITING (a thread waits without the GIL), FENCE_DONE */
};
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

int add_fence_type(PyObject *m) {
  g_fence_type = (PyTypeObject *)PyType_FromSpec(&Fence_spec);
  return !g_fence_type || PyModule_AddObject(m, "Fence", Py_NewRef((PyObject *)g_fence_type)) ? -1 : 0;
}

FenceObject *fence_new(void) {
  FenceObject *f = PyObject_New(FenceObject, g_fence_type);
  if (f) f->a = NULL, f->fence = 0, f->state = FENCE_DONE;
  return f;
}

void fence_arm(FenceObject *f, msv_allocator *a, uint64_t fence) {
  f->a = a;
  f->fence = fence;
  f->state = FENCE_PENDING;
}
