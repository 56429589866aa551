/* The Allocator's numbers: tag_stats() (per tag: state, bytes, extents), counters() (transitions,
 * copies, the host staging pool) and mem_info() (the device's free and total bytes). With
 * nonblocking=True the first two raise TransitionInProgress rather than wait out a sleep or wake:
 * status RPCs must answer during transitions. */
#include "py_internal.h"

const char *tag_state_name(int s) {
  return s == MSV_TAG_AWAKE ? "awake" : s == MSV_TAG_OFFLOADED ? "offloaded" : s == MSV_TAG_ON_DISK ? "on_disk" : "discarded";
}

PyObject *Allocator_tag_stats(AllocatorObject *self, PyObject *args) {
  int nonblocking = 0;
  if (!PyArg_ParseTuple(args, "|p", &nonblocking)) return NULL;
  msv_allocator *a = allocator_of(self);
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
    return raise_no_memory("tag statistics");
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
    PyObject *d = Py_BuildValue("{s:s,s:s,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "tag", st[i].tag, "state",
                                tag_state_name(st[i].state), "base", (unsigned long long)st[i].base, "mapped_bytes",
                                (unsigned long long)st[i].mapped_bytes, "layout_bytes",
                                (unsigned long long)st[i].layout_bytes, "allocated_bytes",
                                (unsigned long long)st[i].allocated_bytes, "offloaded_bytes",
                                (unsigned long long)st[i].offloaded_bytes, "disk_bytes",
                                (unsigned long long)st[i].disk_bytes, "discarded_bytes",
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

PyObject *Allocator_counters(AllocatorObject *self, PyObject *args) {
  int nonblocking = 0;
  if (!PyArg_ParseTuple(args, "|p", &nonblocking)) return NULL;
  msv_allocator *a = allocator_of(self);
  if (!a) return NULL;
  msv_counters c;
  int rc;
  msv_retain(a);
  Py_BEGIN_ALLOW_THREADS rc = msv_get_counters(a, &c, nonblocking);
  Py_END_ALLOW_THREADS msv_release(a);
  if (rc) return raise_last();
  return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:d,s:d,s:d,s:d,s:K,s:K,s:K,s:K,s:d,s:d,s:d,s:d,s:K,s:K,s:K,s:d,s:d}",
                       "bytes_offloaded",
                       c.bytes_offloaded, "bytes_restored", c.bytes_restored, "bytes_verified", c.bytes_verified,
                       "sleeps", c.sleeps, "wakes", c.wakes, "last_sleep_seconds", c.last_sleep_seconds,
                       "last_wake_seconds", c.last_wake_seconds, "last_sleep_unmap_seconds",
                       c.last_sleep_unmap_seconds, "last_wake_map_seconds", c.last_wake_map_seconds,
                       "host_chunks_created", c.host_chunks_created, "host_chunks_reused",
                       c.host_chunks_reused, "host_held_bytes", (unsigned long long)c.host_held_bytes,
                       "host_reserve_bytes", (unsigned long long)c.host_reserve_bytes, "host_prefault_seconds",
                       c.host_prefault_seconds, "host_register_seconds", c.host_register_seconds,
                       "last_copy_validate_seconds", c.last_copy_validate_seconds, "last_copy_seconds",
                       c.last_copy_seconds, "bytes_to_disk", c.bytes_to_disk, "bytes_from_disk", c.bytes_from_disk,
                       "disk_held_bytes", (unsigned long long)c.disk_held_bytes, "last_disk_write_seconds",
                       c.last_disk_write_seconds, "last_disk_read_seconds", c.last_disk_read_seconds);
}

PyObject *Allocator_mem_info(AllocatorObject *self, PyObject *unused) {
  (void)unused;
  msv_allocator *a = allocator_of(self);
  if (!a) return NULL;
  msv_backend *b = msv_get_backend(a);
  size_t f = 0, t = 0;
  if (b->mem_info(b, &f, &t)) return raise_last();
  return Py_BuildValue("(KK)", (unsigned long long)f, (unsigned long long)t);
}
