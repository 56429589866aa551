/* CPU-side data movement and checksums, used by the host backend and by the cuda backend's
 * CPU fallbacks. The checksum is position-dependent (a swapped pair of words changes it) and a
 * plain sum, so the GPU kernel in kernels.cu can reduce it in any order and get the same value. */
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "msv.h"

#define MSV_GOLDEN 0x9E3779B97F4A7C15ull

static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t msv_checksum_cpu(const void *p, size_t size, uint64_t word_base) {
  const unsigned char *b = (const unsigned char *)p;
  size_t nw = size / 8;
  uint64_t s = 0;
  for (size_t i = 0; i < nw; i++) {
    uint64_t w;
    memcpy(&w, b + i * 8, 8);
    s += mix64(w ^ ((word_base + i) * MSV_GOLDEN));
  }
  size_t tail = size - nw * 8;
  if (tail) {
    uint64_t w = 0;
    memcpy(&w, b + nw * 8, tail);
    s += mix64(w ^ ((word_base + nw) * MSV_GOLDEN));
  }
  return s;
}

/* ---- threaded memcpy: split the byte total evenly over a few threads ---- */
typedef struct {
  const msv_copy_item *items;
  size_t n;
  uint64_t begin, end; /* byte range of the concatenated items this worker moves */
} copy_job;

static void *copy_worker(void *arg) {
  copy_job *j = (copy_job *)arg;
  uint64_t pos = 0;
  for (size_t i = 0; i < j->n && pos < j->end; i++) {
    uint64_t s = j->items[i].size, lo = pos, hi = pos + s;
    pos = hi;
    if (hi <= j->begin) continue;
    uint64_t a = lo < j->begin ? j->begin - lo : 0;
    uint64_t e = hi > j->end ? j->end - lo : s;
    memcpy((void *)(uintptr_t)(j->items[i].dst + a), (const void *)(uintptr_t)(j->items[i].src + a), e - a);
  }
  return NULL;
}

void msv_memcpy_parallel(const msv_copy_item *items, size_t n) {
  uint64_t total = 0;
  for (size_t i = 0; i < n; i++) total += items[i].size;
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  int threads = (int)(total / (64ull << 20)); /* one thread per 64 MiB, at most 8 */
  if (threads > 8) threads = 8;
  if (threads > ncpu) threads = (int)ncpu;
  if (threads < 2) {
    copy_job j = {items, n, 0, total};
    copy_worker(&j);
    return;
  }
  pthread_t tid[8];
  copy_job jobs[8];
  int started[8] = {0};
  for (int t = 0; t < threads; t++) {
    jobs[t] = (copy_job){items, n, total * t / threads, total * (t + 1) / threads};
    started[t] = pthread_create(&tid[t], NULL, copy_worker, &jobs[t]) == 0;
    if (!started[t]) copy_worker(&jobs[t]);
  }
  for (int t = 0; t < threads; t++) {
    if (started[t]) pthread_join(tid[t], NULL);
  }
}
