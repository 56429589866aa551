/* OFFLOAD: every live byte of a tag copied into page-locked host chunks chained on its arena, laid
 * out as backup.c plans (`pieces` says where each run of the device range went). Wake cuts the pieces
 * per extent to copy them back (backup.c), and the backup is dropped once restored or given up. */
#include <stdio.h>
#include <string.h>

#include "allocator_internal.h"

/* The offload pipeline: three stages run at once: a faulting thread maps and pre-faults chunk i+2, a pinning thread
 * registers chunk i+1, and the caller copies into chunk i. Chunks reused from the pool skip both. */
typedef struct {
  msv_hostpool *hp;
  size_t nchunks, chunk_bytes, total;
  msv_hchunk **staged, **ready;
  size_t n_staged, n_ready;
  int failed, stop;
  int err_code;
  char err[512];
  pthread_mutex_t mu;
  pthread_cond_t cv;
} producer;

static void producer_fail(producer *p, int rc) {
  pthread_mutex_lock(&p->mu);
  if (!p->failed) {
    p->failed = 1;
    p->err_code = rc;
    snprintf(p->err, sizeof p->err, "%s", msv_last_error());
  }
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
}

static void *fault_stage(void *arg) {
  producer *p = (producer *)arg;
  for (size_t i = 0; i < p->nchunks; i++) {
    pthread_mutex_lock(&p->mu);
    int stop = p->stop || p->failed;
    pthread_mutex_unlock(&p->mu);
    if (stop) break;
    size_t want = p->total - i * p->chunk_bytes < p->chunk_bytes ? p->total - i * p->chunk_bytes : p->chunk_bytes;
    msv_hchunk *c = NULL;
    int rc = msv_hostpool_take(p->hp, want, &c);
    if (rc) {
      producer_fail(p, rc);
      break;
    }
    pthread_mutex_lock(&p->mu);
    p->staged[p->n_staged++] = c;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
  }
  return NULL;
}

static void *pin_stage(void *arg) {
  producer *p = (producer *)arg;
  for (size_t i = 0; i < p->nchunks; i++) {
    pthread_mutex_lock(&p->mu);
    while (p->n_staged <= i && !p->failed && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
    msv_hchunk *c = p->n_staged > i ? p->staged[i] : NULL;
    pthread_mutex_unlock(&p->mu);
    if (!c) break;
    int rc = c->registered ? MSV_OK : msv_hostpool_register(p->hp, c);
    pthread_mutex_lock(&p->mu);
    if (rc) {
      p->staged[i] = NULL; /* freed by msv_hostpool_register */
      pthread_mutex_unlock(&p->mu);
      producer_fail(p, rc);
      break;
    }
    p->ready[p->n_ready++] = c;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
  }
  return NULL;
}

static void *produce(void *arg) { /* both stages on one thread: the fallback when threads fail */
  producer *p = (producer *)arg;
  fault_stage(p);
  pin_stage(p);
  return NULL;
}

/* Copy every live byte of arena `idx` to host chunks. On failure nothing is kept. */
int offload_arena(msv_allocator *a, int idx) {
  arena *ar = a->arenas[idx];
  msv_copy_item *pieces = NULL;
  size_t n_pieces = 0;
  uint64_t total = 0, data = 0;
  int rc = plan_backup(a, idx, a->hp.chunk_bytes, &pieces, &n_pieces, &total, &data);
  if (rc || total == 0) return rc;
  producer p;
  memset(&p, 0, sizeof p);
  p.hp = &a->hp;
  p.chunk_bytes = a->hp.chunk_bytes;
  p.total = total;
  p.nchunks = (total + p.chunk_bytes - 1) / p.chunk_bytes;
  p.ready = calloc(p.nchunks, sizeof *p.ready);
  p.staged = calloc(p.nchunks, sizeof *p.staged);
  if (!p.ready || !p.staged) {
    free(p.ready), free(p.staged), free(pieces);
    return msv_fail(MSV_E_OOM, "out of host memory");
  }
  pthread_mutex_init(&p.mu, NULL);
  pthread_cond_init(&p.cv, NULL);
  pthread_t fault_tid, pin_tid;
  int faulting = pthread_create(&fault_tid, NULL, fault_stage, &p) == 0;
  int pinning = faulting && pthread_create(&pin_tid, NULL, pin_stage, &p) == 0;
  if (!faulting) produce(&p);
  else if (!pinning) pin_stage(&p);

  size_t pi = 0;
  for (size_t ci = 0; ci < p.nchunks && !rc; ci++) {
    pthread_mutex_lock(&p.mu);
    while (p.n_ready <= ci && !p.failed) pthread_cond_wait(&p.cv, &p.mu);
    if (p.n_ready <= ci) rc = msv_fail(p.err_code, "%s", p.err);
    pthread_mutex_unlock(&p.mu);
    if (rc) break;
    msv_hchunk *c = p.ready[ci];
    uint64_t lo = ci * p.chunk_bytes, hi = lo + p.chunk_bytes;
    size_t first = pi;
    for (; pi < n_pieces && pieces[pi].dst < hi; pi++) pieces[pi].dst = (uint64_t)(uintptr_t)(c->ptr + (pieces[pi].dst - lo));
    rc = a->b->copy(a->b, &pieces[first], pi - first, MSV_COPY_LOOP, 0);
  }
  if (!rc) rc = a->b->sync(a->b, 0);
  else a->b->sync(a->b, 0);
  pthread_mutex_lock(&p.mu);
  p.stop = 1;
  pthread_cond_broadcast(&p.cv);
  pthread_mutex_unlock(&p.mu);
  if (faulting) pthread_join(fault_tid, NULL);
  if (pinning) pthread_join(pin_tid, NULL);
  /* chain the chunks (in order) onto the arena, or give them all back on failure */
  for (size_t i = p.n_ready; i-- > 0;) {
    if (rc) {
      msv_hostpool_put(&a->hp, p.ready[i]);
    } else {
      p.ready[i]->next = ar->chunks;
      ar->chunks = p.ready[i];
    }
  }
  for (size_t i = p.n_ready; i < p.n_staged; i++) /* faulted but never pinned (a failure upstream) */
    if (p.staged[i]) msv_hostpool_put(&a->hp, p.staged[i]);
  pthread_mutex_destroy(&p.mu);
  pthread_cond_destroy(&p.cv);
  free(p.ready), free(p.staged);
  if (rc) {
    free(pieces);
    return rc;
  }
  ar->pieces = pieces;
  ar->n_pieces = n_pieces;
  ar->offloaded = data; /* bytes of tensor data; the copy also carries alignment padding */
  return MSV_OK;
}
