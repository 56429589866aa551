/* The hook torch's CUDAPluggableAllocator loads (by this library's path and these two symbol
 * names), so that `with allocator.use_memory_pool(tag):` routes ordinary torch CUDA allocations
 * into our arenas. It runs on torch's allocation path: C only, no Python, no GIL. */
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#include "msv.h"

static msv_allocator *g_hooked;
/* Per thread: torch routes a MemPool per thread, so the tag must follow the thread that entered
 * use_memory_pool (a process-wide tag would send another thread's segments to the wrong pool). */
static __thread char g_tag[64] = "default";
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

void msv_hook_install(msv_allocator *a) {
  pthread_mutex_lock(&g_mu);
  if (g_hooked) msv_release(g_hooked);
  g_hooked = a;
  if (a) msv_retain(a);
  pthread_mutex_unlock(&g_mu);
}

void msv_hook_set_tag(const char *tag) { snprintf(g_tag, sizeof g_tag, "%s", tag); }

__attribute__((visibility("default"))) void *msv_torch_malloc(ssize_t size, int device, void *stream) {
  (void)device, (void)stream;
  pthread_mutex_lock(&g_mu);
  msv_allocator *a = g_hooked;
  pthread_mutex_unlock(&g_mu);
  uint64_t p = 0;
  if (!a || size <= 0 || msv_alloc(a, g_tag, (size_t)size, &p) != MSV_OK) return NULL;
  return (void *)(uintptr_t)p;
}

__attribute__((visibility("default"))) void msv_torch_free(void *ptr, ssize_t size, int device, void *stream) {
  (void)size, (void)device, (void)stream;
  pthread_mutex_lock(&g_mu);
  msv_allocator *a = g_hooked;
  pthread_mutex_unlock(&g_mu);
  if (a && ptr) msv_free(a, (uint64_t)(uintptr_t)ptr);
}
