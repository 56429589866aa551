/* Files into device memory through a ring of page-locked staging chunks: a disk-tier wake reading its
 * backup back (disk.c), and checkpoint staging, which copies a safetensors shard into device memory of
 * its own while the worker is still importing torch (worker/staging.py); the loader then copies each
 * tensor from there, device to device, instead of reading the file after the import.
 *
 * Readers take the file's 16 MiB pieces in order across chunk boundaries (a drive kept busy needs its
 * queue full at every chunk's end), each into its chunk's staging slot once the calling thread has
 * handed the slot's last chunk on (its copy is done). The reads release nothing to Python: the caller
 * runs without the GIL. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "allocator_internal.h"

int io_all(int fd, int writing, char *p, uint64_t n, uint64_t off) {
  while (n) {
    ssize_t r = writing ? pwrite(fd, p, n, (off_t)off) : pread(fd, p, n, (off_t)off);
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return writing ? ENOSPC : EIO; /* a read past the end: the file was cut short */
    p += r, n -= (uint64_t)r, off += (uint64_t)r;
  }
  return 0;
}

/* ---- the staging ring ---- */

int ring_slot(msv_allocator *a, ring *r, size_t ci, msv_hchunk **out) {
  int s = (int)(ci % RING);
  if (r->fence[s]) { /* its last copy must be done before the slot is reused */
    int rc = a->b->fence_wait(a->b, r->fence[s]);
    r->fence[s] = 0;
    if (rc) return rc;
  }
  if (!r->slot[s]) {
    int rc = msv_hostpool_get(&a->hp, a->hp.chunk_bytes, &r->slot[s]);
    if (rc) return rc;
  }
  *out = r->slot[s];
  return MSV_OK;
}

int ring_mark(msv_allocator *a, ring *r, size_t ci) { return a->b->fence(a->b, 0, &r->fence[ci % RING]); }

void ring_done(msv_allocator *a, ring *r) {
  a->b->sync(a->b, 0);
  for (int s = 0; s < RING; s++) {
    if (r->fence[s]) a->b->fence_release(a->b, r->fence[s]);
    if (r->slot[s]) msv_hostpool_put(&a->hp, r->slot[s]);
  }
  msv_hostpool_trim_async(&a->hp);
}

/* ---- a file streamed in ---- */

typedef struct {
  int fd;
  uint64_t base, total, cb, align;
  size_t nchunks, next; /* next: the next piece to take, counted over the whole range */
  size_t free_upto;     /* chunks below this may be read (their slot is free) */
  size_t *left;         /* pieces of each chunk not yet read */
  char *slot[RING];
  int err, stop;
  pthread_mutex_t mu;
  pthread_cond_t cv;
} stream_job;

uint64_t chunk_io_len(uint64_t total, uint64_t cb, size_t ci, uint64_t align) {
  uint64_t room = total - ci * cb < cb ? total - ci * cb : cb;
  return round_up(room, align);
}

static uint64_t chunk_len(const stream_job *j, size_t ci) { return chunk_io_len(j->total, j->cb, ci, j->align); }

static size_t chunk_pieces(const stream_job *j, size_t ci) { return (chunk_len(j, ci) + IO_PIECE - 1) / IO_PIECE; }

static void *stream_reader(void *arg) {
  stream_job *j = (stream_job *)arg;
  size_t per = (j->cb + IO_PIECE - 1) / IO_PIECE; /* pieces of a full chunk */
  pthread_mutex_lock(&j->mu);
  for (;;) {
    while (!j->err && !j->stop && j->next / per < j->nchunks && j->next / per >= j->free_upto)
      pthread_cond_wait(&j->cv, &j->mu);
    size_t ci = j->next / per, k = j->next % per; /* after the wait: others took pieces meanwhile */
    if (j->err || j->stop || ci >= j->nchunks) break;
    if (k >= chunk_pieces(j, ci)) { /* past the last chunk's end */
      j->next = (ci + 1) * per;
      continue;
    }
    j->next++;
    char *buf = j->slot[ci % RING];
    pthread_mutex_unlock(&j->mu);
    uint64_t len = chunk_len(j, ci), at = k * IO_PIECE;
    uint64_t n = len - at < IO_PIECE ? len - at : IO_PIECE;
    int e = io_all(j->fd, 0, buf + at, n, j->base + ci * j->cb + at);
    pthread_mutex_lock(&j->mu);
    if (e && !j->err) j->err = e;
    if (!e && --j->left[ci] == 0) pthread_cond_broadcast(&j->cv);
    if (e) pthread_cond_broadcast(&j->cv);
  }
  pthread_mutex_unlock(&j->mu);
  return NULL;
}

int stream_file(msv_allocator *a, int fd, uint64_t base, uint64_t total, uint64_t align, int threads,
                chunk_put put, void *ctx, int *io_errno) {
  uint64_t cb = a->hp.chunk_bytes;
  size_t nchunks = (total + cb - 1) / cb;
  size_t *left = calloc(nchunks ? nchunks : 1, sizeof *left);
  if (!left) return msv_fail(MSV_E_OOM, "out of host memory for a file's read plan");
  *io_errno = 0;
  ring r;
  memset(&r, 0, sizeof r);
  stream_job j = {fd, base, total, cb, align ? align : 1, nchunks, 0, 0, left, {0}, 0, 0,
                  PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};
  int rc = MSV_OK;
  for (size_t ci = 0; ci < nchunks; ci++) left[ci] = chunk_pieces(&j, ci);
  for (int s = 0; s < RING && (size_t)s < nchunks && !rc; s++) { /* a small file takes fewer slots */
    msv_hchunk *c = NULL;
    if ((rc = ring_slot(a, &r, (size_t)s, &c))) break;
    j.slot[s] = c->ptr;
  }
  pthread_t *tid = calloc(threads > 0 ? (size_t)threads : 1, sizeof *tid);
  int started = 0;
  if (!tid && !rc) rc = msv_fail(MSV_E_OOM, "out of host memory for reader threads");
  if (!rc && nchunks) { /* threads >= 1: the callers' constants, or checked by msv_stage_file */
    j.free_upto = RING;
    for (int t = 0; t < threads; t++) {
      if (pthread_create(&tid[started], NULL, stream_reader, &j) != 0) break; /* fewer readers, same bytes */
      started++;
    }
    if (!started) rc = msv_fail(MSV_E_BACKEND, "cannot start a thread to read a file");
  }
  for (size_t ci = 0; ci < nchunks && !rc; ci++) { /* chunk ci read: hand it on, then free its slot */
    pthread_mutex_lock(&j.mu);
    while (!j.err && left[ci]) pthread_cond_wait(&j.cv, &j.mu);
    int err = j.err;
    pthread_mutex_unlock(&j.mu);
    if (err) {
      *io_errno = err;
      rc = MSV_E_BACKEND;
      break;
    }
    if ((rc = put(a, ci, j.slot[ci % RING], ctx))) break;
    pthread_mutex_lock(&j.mu);
    j.free_upto = ci + 1 + RING;
    pthread_cond_broadcast(&j.cv);
    pthread_mutex_unlock(&j.mu);
  }
  pthread_mutex_lock(&j.mu);
  j.stop = 1;
  pthread_cond_broadcast(&j.cv);
  pthread_mutex_unlock(&j.mu);
  for (int t = 0; t < started; t++) pthread_join(tid[t], NULL);
  pthread_mutex_destroy(&j.mu);
  pthread_cond_destroy(&j.cv);
  ring_done(a, &r);
  free(tid), free(left);
  return rc;
}

/* ---- checkpoint staging ---- */

typedef struct {
  uint64_t dst, len;
} stage_ctx;

static int stage_chunk(msv_allocator *a, size_t ci, char *host, void *arg) {
  stage_ctx *x = (stage_ctx *)arg;
  uint64_t cb = a->hp.chunk_bytes, at = ci * cb;
  msv_copy_item item = {x->dst + at, (uint64_t)(uintptr_t)host, x->len - at < cb ? x->len - at : cb};
  int rc = a->b->copy(a->b, &item, 1, MSV_COPY_LOOP, 0);
  return rc ? rc : a->b->sync(a->b, 0);
}

int msv_stage_file(msv_allocator *a, int fd, uint64_t offset, uint64_t length, int threads, msv_staged *out) {
  if (length == 0) return msv_fail(MSV_E_INVALID, "nothing to stage: the length is 0");
  if (threads < 1) return msv_fail(MSV_E_INVALID, "staging needs at least one reader thread, got %d", threads);
  /* Not under mu: staged memory is in no arena and no table row, and the backends' calls are
   * thread-safe (the driver's; the host backend's own lock). */
  msv_staged s = {0, round_up(length, a->b->granularity), 0};
  int rc = a->b->reserve(a->b, s.size, &s.addr);
  if (rc) return rc;
  if ((rc = a->b->map(a->b, s.addr, s.size, &s.handle))) {
    a->b->free_va(a->b, s.addr, s.size);
    return rc;
  }
  stage_ctx x = {s.addr, length};
  int err = 0;
  rc = stream_file(a, fd, offset, length, 1, threads, stage_chunk, &x, &err);
  if (rc) {
    char why[512]; /* the failure's own message, kept past the unmapping's calls */
    snprintf(why, sizeof why, "%s", err ? strerror(err) : msv_last_error());
    msv_unstage(a, &s); /* nothing else holds it yet */
    if (err)
      return msv_fail(MSV_E_BACKEND, "staging %llu bytes of a file at %llu: %s", (unsigned long long)length,
                      (unsigned long long)offset, err == EIO ? "it ended first, or an I/O error" : why);
    return msv_fail(rc, "%s", why);
  }
  *out = s;
  return MSV_OK;
}

int msv_unstage(msv_allocator *a, const msv_staged *s) {
  /* A copy out of it may still run on any stream; where that cannot be known, the memory stays
   * mapped (a leak, as trim_tail leaves an arena's tail) rather than fault the context. */
  int rc = a->b->quiesce(a->b);
  if (rc) return rc;
  int u = a->b->unmap(a->b, s->addr, s->size, s->handle);
  int f = a->b->free_va(a->b, s->addr, s->size);
  return u ? u : f;
}
