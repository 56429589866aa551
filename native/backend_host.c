/* The host backend: the allocator's semantics on CPU memory, for machines without a GPU.
 *
 * A virtual range is reserved PROT_NONE; "physical memory" is a memfd mapped over part of it with
 * MAP_FIXED|MAP_SHARED, and dropping it maps PROT_NONE back and closes the fd, which returns the
 * pages to the kernel. Addresses therefore survive sleep and wake exactly as with cuMemMap, and a
 * touch of a slept range faults. `capacity` plays the device's memory size so out-of-memory paths
 * run on CPU-only machines. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "msv.h"

typedef struct {
  size_t capacity;
  size_t used;
  pthread_mutex_t mu;
} host_impl;

static int h_reserve(msv_backend *b, size_t size, uint64_t *addr) {
  size_t g = b->granularity;
  void *p = mmap(NULL, size + g, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return msv_fail(MSV_E_OOM, "host: cannot reserve %zu bytes of address space: %s", size, strerror(errno));
  uintptr_t start = (uintptr_t)p, aligned = (start + g - 1) / g * g;
  if (aligned > start) munmap(p, aligned - start);
  size_t tail = (start + size + g) - (aligned + size);
  if (tail) munmap((void *)(aligned + size), tail);
  *addr = aligned;
  return MSV_OK;
}

static int h_free_va(msv_backend *b, uint64_t addr, size_t size) {
  (void)b;
  munmap((void *)(uintptr_t)addr, size);
  return MSV_OK;
}

static int h_map(msv_backend *b, uint64_t addr, size_t size, uint64_t *handle) {
  host_impl *h = (host_impl *)b->impl;
  pthread_mutex_lock(&h->mu);
  if (h->used + size > h->capacity) {
    size_t used = h->used;
    pthread_mutex_unlock(&h->mu);
    return msv_fail(MSV_E_OOM, "host device out of memory: %zu bytes requested, %zu of %zu in use", size, used,
                    h->capacity);
  }
  h->used += size;
  pthread_mutex_unlock(&h->mu);
  int fd = memfd_create("memsvc", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    int e = errno;
    if (fd >= 0) close(fd);
    pthread_mutex_lock(&h->mu);
    h->used -= size;
    pthread_mutex_unlock(&h->mu);
    return msv_fail(MSV_E_OOM, "host: memfd of %zu bytes failed: %s", size, strerror(e));
  }
  void *p = mmap((void *)(uintptr_t)addr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(fd);
    pthread_mutex_lock(&h->mu);
    h->used -= size;
    pthread_mutex_unlock(&h->mu);
    return msv_fail(MSV_E_BACKEND, "host: mapping %zu bytes failed: %s", size, strerror(e));
  }
  *handle = (uint64_t)fd;
  return MSV_OK;
}

static int h_unmap(msv_backend *b, uint64_t addr, size_t size, uint64_t handle) {
  host_impl *h = (host_impl *)b->impl;
  void *p = mmap((void *)(uintptr_t)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) return msv_fail(MSV_E_BACKEND, "host: unmapping %zu bytes failed: %s", size, strerror(errno));
  close((int)handle);
  pthread_mutex_lock(&h->mu);
  h->used -= size;
  pthread_mutex_unlock(&h->mu);
  return MSV_OK;
}

static int h_mem_info(msv_backend *b, size_t *free_bytes, size_t *total_bytes) {
  host_impl *h = (host_impl *)b->impl;
  pthread_mutex_lock(&h->mu);
  *free_bytes = h->capacity - h->used;
  *total_bytes = h->capacity;
  pthread_mutex_unlock(&h->mu);
  return MSV_OK;
}

static int h_host_register(msv_backend *b, void *p, size_t size, uint64_t *alias) {
  (void)b, (void)size;
  *alias = (uint64_t)(uintptr_t)p;
  return MSV_OK;
}

static int h_host_unregister(msv_backend *b, void *p) {
  (void)b, (void)p;
  return MSV_OK;
}

/* Every method is a memcpy here: the host has one copy engine, the CPU. */
static int h_copy(msv_backend *b, const msv_copy_item *items, size_t n, int method, uint64_t stream) {
  (void)b, (void)method, (void)stream;
  msv_memcpy_parallel(items, n);
  return MSV_OK;
}

static int h_sync(msv_backend *b, uint64_t stream) {
  (void)b, (void)stream;
  return MSV_OK;
}

static int h_quiesce(msv_backend *b) { return h_sync(b, 0); } /* host copies end before they return */

/* Host copies finish before copy returns: every fence is already passed. */
static int h_fence(msv_backend *b, uint64_t stream, uint64_t *out) {
  (void)b, (void)stream;
  *out = 0;
  return MSV_OK;
}
static int h_new_stream(msv_backend *b, uint64_t *out) {
  (void)b, (void)out;
  return msv_fail(MSV_E_UNAVAILABLE, "the host backend has no device streams");
}
static int h_fence_wait(msv_backend *b, uint64_t fence) {
  (void)b, (void)fence;
  return MSV_OK;
}
static void h_fence_release(msv_backend *b, uint64_t fence) { (void)b, (void)fence; }

static int h_checksum(msv_backend *b, const msv_sum_item *items, size_t n, uint64_t *out, size_t nslots) {
  (void)b;
  for (size_t i = 0; i < n; i++) {
    if (items[i].slot >= nslots) return msv_fail(MSV_E_INVALID, "checksum slot out of range");
    out[items[i].slot] += msv_checksum_cpu((const void *)(uintptr_t)items[i].ptr, items[i].size, items[i].word_base);
  }
  return MSV_OK;
}

static int h_has_method(msv_backend *b, int method) {
  (void)b;
  return method >= MSV_COPY_AUTO && method <= MSV_COPY_KERNEL;
}

static void h_destroy(msv_backend *b) {
  host_impl *h = (host_impl *)b->impl;
  pthread_mutex_destroy(&h->mu);
  free(h);
  free(b);
}

int msv_backend_host_create(int device, size_t capacity, size_t granularity, msv_backend **out) {
  long page = sysconf(_SC_PAGESIZE);
  if (granularity == 0) granularity = 2u << 20;
  if (granularity % (size_t)page) return msv_fail(MSV_E_INVALID, "granularity %zu is not a multiple of the page size", granularity);
  if (capacity == 0) return msv_fail(MSV_E_INVALID, "host backend capacity must be > 0");
  msv_backend *b = calloc(1, sizeof *b);
  host_impl *h = calloc(1, sizeof *h);
  if (!b || !h) {
    free(b), free(h);
    return msv_fail(MSV_E_OOM, "out of host memory");
  }
  h->capacity = capacity;
  pthread_mutex_init(&h->mu, NULL);
  b->kind = MSV_BACKEND_HOST;
  b->name = "host";
  b->device = device;
  b->granularity = granularity;
  b->reserve = h_reserve;
  b->free_va = h_free_va;
  b->map = h_map;
  b->unmap = h_unmap;
  b->mem_info = h_mem_info;
  b->host_register = h_host_register;
  b->host_unregister = h_host_unregister;
  b->copy = h_copy;
  b->sync = h_sync;
  b->quiesce = h_quiesce;
  b->fence = h_fence;
  b->new_stream = h_new_stream;
  b->fence_wait = h_fence_wait;
  b->fence_release = h_fence_release;
  b->checksum = h_checksum;
  b->has_method = h_has_method;
  b->destroy = h_destroy;
  b->impl = h;
  *out = b;
  return MSV_OK;
}
