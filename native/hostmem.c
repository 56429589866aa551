/* The offload engine's host side: page-locked chunks, made fast and reused.
 *
 * Why not cudaHostAlloc/pin_memory per tensor at sleep time: on the H200 host that pins at
 * 1.3-1.9 GB/s, 30x slower than the copy it serves. Here a chunk is plain anonymous memory
 * (transparent huge pages where the kernel allows), pre-faulted by several threads at once, then
 * registered with the driver, and a producer thread prepares chunk i+1 while the copy engine
 * fills chunk i. Chunks freed on wake go back to a pool that keeps up to `reserve_bytes` for the
 * next sleep (host RAM held vs. sleep speed, the operator's choice). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "msv.h"

#define HUGE_2M (2ull << 20)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int msv_hostpool_init(msv_hostpool *hp, msv_backend *b, size_t chunk_bytes, size_t reserve_bytes, int threads,
                      int huge_pages) {
  memset(hp, 0, sizeof *hp);
  hp->backend = b;
  hp->chunk_bytes = chunk_bytes ? (chunk_bytes + HUGE_2M - 1) / HUGE_2M * HUGE_2M : (256ull << 20);
  hp->reserve_bytes = reserve_bytes;
  if (threads <= 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    threads = n > 16 ? 16 : (int)n;
  }
  hp->prefault_threads = threads < 1 ? 1 : threads;
  hp->huge_pages = huge_pages;
  pthread_mutex_init(&hp->mu, NULL);
  pthread_cond_init(&hp->cv, NULL);
  return MSV_OK;
}

static void *reaper_main(void *arg) {
  msv_hostpool *hp = (msv_hostpool *)arg;
  pthread_mutex_lock(&hp->mu);
  for (;;) {
    while (!hp->reap_pending && !hp->stopping) pthread_cond_wait(&hp->cv, &hp->mu);
    if (hp->stopping) break;
    hp->reap_pending = 0;
    pthread_mutex_unlock(&hp->mu);
    msv_hostpool_trim(hp);
    pthread_mutex_lock(&hp->mu);
  }
  pthread_mutex_unlock(&hp->mu);
  return NULL;
}

void msv_hostpool_trim_async(msv_hostpool *hp) {
  pthread_mutex_lock(&hp->mu);
  if (!hp->reaper_started && !hp->stopping) hp->reaper_started = pthread_create(&hp->reaper, NULL, reaper_main, hp) == 0;
  int async = hp->reaper_started;
  if (async) {
    hp->reap_pending = 1;
    pthread_cond_signal(&hp->cv);
  }
  pthread_mutex_unlock(&hp->mu);
  if (!async) msv_hostpool_trim(hp);
}

typedef struct {
  char *p;
  size_t len;
} fault_job;

static void *fault_worker(void *arg) {
  fault_job *j = (fault_job *)arg;
  long page = sysconf(_SC_PAGESIZE);
  for (size_t off = 0; off < j->len; off += (size_t)page) j->p[off] = 0;
  return NULL;
}

/* Touch every page with several threads: first touch runs ~7 GB/s per thread on the H200 host. */
static void prefault(char *p, size_t len, int threads) {
  if (threads > 16) threads = 16;
  if (len < (64ull << 20) || threads < 2) {
    fault_job j = {p, len};
    fault_worker(&j);
    return;
  }
  pthread_t tid[16];
  fault_job jobs[16];
  int ok[16] = {0};
  size_t step = (len / (size_t)threads + HUGE_2M - 1) / HUGE_2M * HUGE_2M;
  for (int t = 0; t < threads; t++) {
    size_t lo = step * (size_t)t, hi = lo + step > len ? len : lo + step;
    jobs[t] = (fault_job){p + lo, hi > lo ? hi - lo : 0};
    ok[t] = pthread_create(&tid[t], NULL, fault_worker, &jobs[t]) == 0;
    if (!ok[t]) fault_worker(&jobs[t]);
  }
  for (int t = 0; t < threads; t++)
    if (ok[t]) pthread_join(tid[t], NULL);
}

/* Map a fresh chunk, 2 MiB aligned so transparent huge pages can back all of it (a 2 MiB fault
 * zeroes in one go, and pinning 16 GB is 8192 pages instead of 4 million), and pre-fault it with
 * several threads. Not yet registered: msv_hostpool_register does that, so a caller can pipeline
 * faulting chunk i+1 with pinning chunk i. */
int msv_hostpool_map(msv_hostpool *hp, size_t size, msv_hchunk **out) {
  size = (size + HUGE_2M - 1) / HUGE_2M * HUGE_2M;
  msv_hchunk *c = calloc(1, sizeof *c);
  if (!c) return msv_fail(MSV_E_OOM, "out of host memory");
  char *raw = mmap(NULL, size + HUGE_2M, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    free(c);
    return msv_fail(MSV_E_OOM, "host memory exhausted: cannot map a %zu-byte offload chunk: %s", size, strerror(errno));
  }
  uintptr_t start = (uintptr_t)raw, aligned = (start + HUGE_2M - 1) / HUGE_2M * HUGE_2M;
  if (aligned > start) munmap(raw, aligned - start);
  if (start + size + HUGE_2M > aligned + size) munmap((char *)(aligned + size), start + size + HUGE_2M - aligned - size);
  char *p = (char *)aligned;
  if (hp->huge_pages) madvise(p, size, MADV_HUGEPAGE);
  double t0 = now_s();
  prefault(p, size, hp->prefault_threads);
  double t1 = now_s();
  c->ptr = p;
  c->size = size;
  pthread_mutex_lock(&hp->mu);
  hp->held_bytes += size;
  hp->chunks_created++;
  hp->prefault_seconds += t1 - t0;
  pthread_mutex_unlock(&hp->mu);
  *out = c;
  return MSV_OK;
}

int msv_hostpool_register(msv_hostpool *hp, msv_hchunk *c) {
  double t0 = now_s();
  int rc = hp->backend->host_register(hp->backend, c->ptr, c->size, &c->dev_alias);
  double t1 = now_s();
  pthread_mutex_lock(&hp->mu);
  hp->register_seconds += t1 - t0;
  if (rc) hp->held_bytes -= c->size;
  pthread_mutex_unlock(&hp->mu);
  if (rc) {
    char why[512];
    size_t size = c->size;
    snprintf(why, sizeof why, "%s", msv_last_error());
    munmap(c->ptr, c->size);
    free(c);
    return msv_fail(MSV_E_OOM, "cannot page-lock %zu bytes of host memory (memlock limit?): %s", size, why);
  }
  c->registered = 1;
  return MSV_OK;
}

static void chunk_destroy(msv_hostpool *hp, msv_hchunk *c) {
  if (c->registered) hp->backend->host_unregister(hp->backend, c->ptr);
  munmap(c->ptr, c->size);
  pthread_mutex_lock(&hp->mu);
  hp->held_bytes -= c->size;
  pthread_mutex_unlock(&hp->mu);
  free(c);
}

int msv_hostpool_take(msv_hostpool *hp, size_t min_size, msv_hchunk **out) {
  pthread_mutex_lock(&hp->mu);
  for (msv_hchunk **pp = &hp->free_list; *pp; pp = &(*pp)->next) {
    if ((*pp)->size >= min_size) {
      msv_hchunk *c = *pp;
      *pp = c->next;
      c->next = NULL;
      hp->free_bytes -= c->size;
      hp->chunks_reused++;
      pthread_mutex_unlock(&hp->mu);
      *out = c;
      return MSV_OK;
    }
  }
  pthread_mutex_unlock(&hp->mu);
  return msv_hostpool_map(hp, min_size, out);
}

int msv_hostpool_get(msv_hostpool *hp, size_t min_size, msv_hchunk **out) {
  int rc = msv_hostpool_take(hp, min_size, out);
  if (!rc && !(*out)->registered) rc = msv_hostpool_register(hp, *out);
  return rc;
}

void msv_hostpool_put(msv_hostpool *hp, msv_hchunk *c) {
  pthread_mutex_lock(&hp->mu);
  c->next = hp->free_list;
  hp->free_list = c;
  hp->free_bytes += c->size;
  pthread_mutex_unlock(&hp->mu);
}

/* Release free chunks beyond the reserve, largest first kept. */
void msv_hostpool_trim(msv_hostpool *hp) {
  for (;;) {
    pthread_mutex_lock(&hp->mu);
    if (hp->free_bytes <= hp->reserve_bytes || !hp->free_list) {
      pthread_mutex_unlock(&hp->mu);
      return;
    }
    msv_hchunk **best = &hp->free_list;
    for (msv_hchunk **pp = &hp->free_list; *pp; pp = &(*pp)->next)
      if ((*pp)->size < (*best)->size) best = pp;
    msv_hchunk *c = *best;
    *best = c->next;
    hp->free_bytes -= c->size;
    pthread_mutex_unlock(&hp->mu);
    chunk_destroy(hp, c);
  }
}

/* ---- pre-pinning: the first sleep's host work, done ahead of it ----
 * A fresh chunk costs a first touch of every page (the VM faults them in) and cuMemHostRegister;
 * on the sleep path that runs the first sleep at 2.5-30 GB/s instead of the copy's 52. Pre-pinning
 * pays it at start-up, holding the host RAM from then on. One helper thread registers chunk i while
 * the caller maps and faults chunk i+1. */
typedef struct {
  msv_hostpool *hp;
  msv_hchunk *c; /* being registered; NULL when nothing is pending */
  size_t size;   /* c's size, read without touching c (a failed register frees it) */
  pthread_t tid;
  int threaded, rc;
  char err[512]; /* the helper's message: msv_fail's slot is per thread */
} pin_job;

static void *pin_worker(void *arg) {
  pin_job *j = (pin_job *)arg;
  j->rc = msv_hostpool_register(j->hp, j->c);
  if (j->rc) snprintf(j->err, sizeof j->err, "%s", msv_last_error());
  return NULL;
}

static void pin_start(pin_job *j, msv_hchunk *c) {
  j->c = c;
  j->size = c->size;
  j->rc = MSV_OK;
  j->threaded = pthread_create(&j->tid, NULL, pin_worker, j) == 0;
  if (!j->threaded) pin_worker(j); /* no thread to be had: pin in line */
}

/* Wait for the pending chunk; a pinned one joins the free list (a failed one is already released). */
static int pin_finish(pin_job *j) {
  if (!j->c) return MSV_OK;
  if (j->threaded) pthread_join(j->tid, NULL);
  msv_hchunk *c = j->c;
  j->c = NULL;
  j->size = 0;
  if (j->rc) return msv_fail(j->rc, "%s", j->err);
  msv_hostpool_put(j->hp, c);
  return MSV_OK;
}

int msv_hostpool_prepin(msv_hostpool *hp, size_t bytes) {
  if (bytes == 0) return MSV_OK;
  /* No check against the host's RAM here: on the GPU VMs it grows as it is used, so what the kernel
   * reports at start-up is far below what can be had. The caller sizes this, as it sizes a sleep. */
  pthread_mutex_lock(&hp->mu);
  if (hp->reserve_bytes < bytes) hp->reserve_bytes = bytes; /* so a trim keeps what is pinned here */
  size_t held_at_start = hp->held_bytes;
  pthread_mutex_unlock(&hp->mu);
  /* Stop when `bytes` of free chunks are ready, or when the pool has grown by `bytes` since the
   * start, whoever made the chunks: a sleep running beside this takes prepinned chunks and makes
   * its own, and together they must not pin more than the sleep needs. */
  pin_job job = {.hp = hp};
  int rc = MSV_OK;
  for (;;) {
    pthread_mutex_lock(&hp->mu);
    size_t have = hp->free_bytes + job.size;
    size_t grown = hp->held_bytes > held_at_start ? hp->held_bytes - held_at_start : 0;
    int cancel = hp->prepin_cancel || hp->stopping;
    pthread_mutex_unlock(&hp->mu);
    if (have >= bytes || grown >= bytes || cancel) break;
    size_t left = bytes - (have > grown ? have : grown);
    size_t want = left < hp->chunk_bytes ? left : hp->chunk_bytes;
    msv_hchunk *c = NULL;
    rc = msv_hostpool_map(hp, want, &c); /* faults this chunk while the helper pins the last one */
    int prc = pin_finish(&job);
    if (prc) rc = prc; /* the earlier chunk's error comes first */
    if (rc) {
      if (c) chunk_destroy(hp, c); /* faulted but not pinned: not worth the RAM it holds */
      return rc;
    }
    pin_start(&job, c);
  }
  return pin_finish(&job);
}

void msv_hostpool_prepin_cancel(msv_hostpool *hp) {
  pthread_mutex_lock(&hp->mu);
  hp->prepin_cancel = 1;
  pthread_mutex_unlock(&hp->mu);
}

void msv_hostpool_destroy(msv_hostpool *hp) {
  pthread_mutex_lock(&hp->mu);
  hp->stopping = 1;
  hp->reserve_bytes = 0;
  int started = hp->reaper_started;
  pthread_cond_signal(&hp->cv);
  pthread_mutex_unlock(&hp->mu);
  if (started) pthread_join(hp->reaper, NULL);
  msv_hostpool_trim(hp);
  pthread_cond_destroy(&hp->cv);
  pthread_mutex_destroy(&hp->mu);
}
