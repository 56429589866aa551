/* The disk tier: a sleeping tag's backup in a file under the offload directory instead of host
 * memory, for hosts whose RAM cannot hold every sleeper and for weights with no source to reload
 * them from.
 *
 * The file holds the backup exactly as host chunks would (plan_backup's offsets: chunk i of the
 * pool's chunk size at i * chunk_bytes), so a demotion writes an OFFLOADED tag's chunks as they are,
 * and a sleep or a wake streams the tag through a ring of a few page-locked staging chunks: the copy
 * engine fills (or drains) chunk i+1 while chunk i is written (or read) by several threads at once.
 * Host RAM is then the ring, never the tag. The transition holds the allocator's lock throughout, as
 * every sleep and wake does: for a disk tier that is seconds (7-12 s for 16 GB on the H200 VM's disk),
 * during which an allocation or free on another thread waits. Files are made unlinked (O_TMPFILE, else created and
 * unlinked at once), so nothing is left on disk when the process ends however it ends, and read and
 * written with O_DIRECT where the file system allows it, so the tier neither fills the page cache nor
 * reads back a cached copy. Checksums (checksums.c) are taken from device memory at sleep and checked
 * on device memory after the wake, as for host backups, and with a disk tier always (sleep.c): a bad
 * byte on disk fails the wake. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "allocator_internal.h"

#define DISK_ALIGN 4096u          /* O_DIRECT: offsets, lengths and buffers aligned to this */
#define IO_THREADS 8              /* requests in flight: what an NVMe drive needs to reach its rate */

/* ---- files ---- */

static int disk_error(msv_allocator *a, int err, const char *what) {
  if (err == ENOSPC || err == EDQUOT || err == EFBIG)
    return msv_fail(MSV_E_OOM, "the offload directory %s is full: %s while %s", a->cfg.offload_dir, strerror(err), what);
  return msv_fail(MSV_E_BACKEND, "offload file in %s: %s while %s", a->cfg.offload_dir, strerror(err), what);
}

/* A new unlinked file in the offload directory; *direct says whether it is open with O_DIRECT. */
static int disk_open(msv_allocator *a, int *fd_out, int *direct) {
  const char *dir = a->cfg.offload_dir;
  if (!dir[0]) return msv_fail(MSV_E_STATE, "this worker has no disk tier: start it with an offload directory");
  int fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC | O_DIRECT, 0600);
  *direct = fd >= 0;
  if (fd < 0) fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) { /* no O_TMPFILE here: a named file, unlinked at once */
    char path[4200];
    snprintf(path, sizeof path, "%s/.memsvc-offload-XXXXXX", dir);
    fd = mkostemp(path, O_CLOEXEC);
    if (fd < 0) return disk_error(a, errno, "creating a file");
    unlink(path);
    int fl = fcntl(fd, F_GETFL);
    *direct = fl >= 0 && fcntl(fd, F_SETFL, fl | O_DIRECT) == 0;
  }
  *fd_out = fd;
  return MSV_OK;
}

typedef struct {
  int fd, writing;
  char *buf;
  uint64_t off, len, next;
  int err;
  pthread_mutex_t mu;
} io_job;

static void *io_worker(void *arg) {
  io_job *j = (io_job *)arg;
  for (;;) {
    pthread_mutex_lock(&j->mu);
    uint64_t at = j->next;
    int stop = j->err || at >= j->len;
    if (!stop) j->next += IO_PIECE;
    pthread_mutex_unlock(&j->mu);
    if (stop) break;
    uint64_t n = j->len - at < IO_PIECE ? j->len - at : IO_PIECE;
    int e = io_all(j->fd, j->writing, j->buf + at, n, j->off + at);
    if (e) {
      pthread_mutex_lock(&j->mu);
      if (!j->err) j->err = e;
      pthread_mutex_unlock(&j->mu);
      break;
    }
  }
  return NULL;
}

/* Read or write [buf, +len) at file offset off with up to IO_THREADS requests in flight. */
static int io_parallel(msv_allocator *a, int fd, int writing, char *buf, uint64_t len, uint64_t off) {
  io_job j = {fd, writing, buf, off, len, 0, 0, PTHREAD_MUTEX_INITIALIZER};
  pthread_t tid[IO_THREADS];
  int started = 0;
  uint64_t pieces = (len + IO_PIECE - 1) / IO_PIECE;
  for (int t = 1; t < IO_THREADS && (uint64_t)t < pieces; t++) {
    if (pthread_create(&tid[started], NULL, io_worker, &j) != 0) break; /* fewer threads, same bytes */
    started++;
  }
  io_worker(&j);
  for (int t = 0; t < started; t++) pthread_join(tid[t], NULL);
  pthread_mutex_destroy(&j.mu);
  return j.err ? disk_error(a, j.err, writing ? "writing a sleeping tag's backup" : "reading a backup back") : MSV_OK;
}

static uint64_t pieces_total(const arena *ar) {
  return ar->n_pieces ? ar->pieces[ar->n_pieces - 1].dst + ar->pieces[ar->n_pieces - 1].size : 0;
}

/* The pieces of chunk ci as copy items between the device and `host` (the chunk's staging), clipped
 * to [lo, hi) of device addresses (a wake copies nothing past the frontier). *pi walks the pieces. */
static size_t chunk_items(const msv_copy_item *pieces, size_t n, size_t *pi, uint64_t cb, size_t ci, char *host,
                          int to_host, uint64_t lo, uint64_t hi, msv_copy_item *out) {
  size_t k = 0;
  uint64_t end = (ci + 1) * cb;
  for (; *pi < n && pieces[*pi].dst < end; (*pi)++) {
    const msv_copy_item *p = &pieces[*pi];
    uint64_t s = p->src > lo ? p->src : lo, e = p->src + p->size < hi ? p->src + p->size : hi;
    if (s >= e) continue;
    uint64_t h = (uint64_t)(uintptr_t)(host + (p->dst - ci * cb) + (s - p->src));
    out[k++] = to_host ? (msv_copy_item){h, s, e - s} : (msv_copy_item){s, h, e - s};
  }
  return k;
}

/* ---- sleep: phase 1 writes, phase 2 commits ---- */

/* An awake tag: device -> staging chunk i+1 on the copy engine while chunk i is written. */
static int write_from_device(msv_allocator *a, arena *ar, int fd) {
  uint64_t cb = a->hp.chunk_bytes, total = pieces_total(ar);
  size_t nchunks = (total + cb - 1) / cb;
  msv_copy_item *items = malloc((ar->n_pieces ? ar->n_pieces : 1) * sizeof *items);
  if (!items) return msv_fail(MSV_E_OOM, "out of host memory for the copy list of tag '%s'", ar->tag);
  ring r;
  memset(&r, 0, sizeof r);
  size_t pi = 0;
  msv_hchunk *c = NULL;
  int rc = MSV_OK;
  /* enqueue chunk 0, then per chunk: enqueue the next, wait for this one, write it */
  for (size_t ci = 0; ci <= nchunks && !rc; ci++) {
    if (ci < nchunks) {
      if ((rc = ring_slot(a, &r, ci, &c))) break;
      size_t n = chunk_items(ar->pieces, ar->n_pieces, &pi, cb, ci, c->ptr, 1, 0, UINT64_MAX, items);
      if ((rc = a->b->copy(a->b, items, n, MSV_COPY_LOOP, 0))) break;
      if ((rc = ring_mark(a, &r, ci))) break;
    }
    if (ci == 0) continue;
    size_t w = ci - 1;
    int s = (int)(w % RING);
    if (r.fence[s]) {
      rc = a->b->fence_wait(a->b, r.fence[s]);
      r.fence[s] = 0;
      if (rc) break;
    }
    rc = io_parallel(a, fd, 1, r.slot[s]->ptr, chunk_io_len(total, cb, w, DISK_ALIGN), w * cb);
  }
  ring_done(a, &r);
  free(items);
  return rc;
}

/* An OFFLOADED tag (a demotion): its host chunks, in order, as they are. */
static int write_from_host(msv_allocator *a, arena *ar, int fd) {
  uint64_t cb = a->hp.chunk_bytes, total = 0;
  for (size_t i = 0; i < ar->n_pieces; i++) total += ar->pieces[i].size;
  size_t ci = 0;
  for (msv_hchunk *c = ar->chunks; c && ci * cb < total; c = c->next, ci++) {
    int rc = io_parallel(a, fd, 1, c->ptr, chunk_io_len(total, cb, ci, DISK_ALIGN), ci * cb);
    if (rc) return rc;
  }
  return MSV_OK;
}

int disk_write(msv_allocator *a, int idx) {
  arena *ar = a->arenas[idx];
  int direct = 0, fd = -1;
  int rc = disk_open(a, &fd, &direct);
  if (rc) return rc;
  double t0 = now_s();
  uint64_t data = ar->offloaded;
  if (ar->state == MSV_TAG_OFFLOADED) {
    rc = write_from_host(a, ar, fd);
  } else {
    uint64_t total = 0;
    rc = plan_backup(a, idx, a->hp.chunk_bytes, &ar->pieces, &ar->n_pieces, &total, &data);
    if (!rc) rc = write_from_device(a, ar, fd);
  }
  /* Buffered I/O: the data must be on disk (a full disk can show only now) and out of the page cache. */
  if (!rc && !direct && fdatasync(fd) != 0) rc = disk_error(a, errno, "flushing a backup to disk");
  if (!rc && !direct) posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  if (rc) {
    close(fd);
    if (ar->state != MSV_TAG_OFFLOADED) { /* the plan was this call's: the tag stays as it was */
      free(ar->pieces);
      ar->pieces = NULL, ar->n_pieces = 0;
    }
    return rc;
  }
  uint64_t total = 0; /* the pieces fill the backup's offsets without a gap */
  for (size_t i = 0; i < ar->n_pieces; i++) total += ar->pieces[i].size;
  uint64_t cb = a->hp.chunk_bytes;
  ar->pend_fd = fd;
  ar->pend_len = total ? ((total - 1) / cb) * cb + chunk_io_len(total, cb, (total - 1) / cb, DISK_ALIGN) : 0;
  ar->offloaded = data;
  a->ctr.last_disk_write_seconds = now_s() - t0;
  return MSV_OK;
}

void disk_commit(msv_allocator *a, arena *ar) {
  if (ar->chunks) { /* a demotion: the pieces' host addresses become file offsets, the chunks go */
    uint64_t off = 0;
    for (size_t i = 0; i < ar->n_pieces; i++) ar->pieces[i].dst = off, off += ar->pieces[i].size;
    while (ar->chunks) {
      msv_hchunk *c = ar->chunks;
      ar->chunks = c->next;
      c->next = NULL;
      msv_hostpool_put(&a->hp, c);
    }
    msv_hostpool_trim_async(&a->hp);
  }
  ar->disk_fd = ar->pend_fd, ar->disk_len = ar->pend_len;
  ar->pend_fd = -1, ar->pend_len = 0;
  a->ctr.bytes_to_disk += ar->disk_len;
  a->ctr.disk_held_bytes += ar->disk_len;
}

void disk_abandon(arena *ar) {
  if (ar->pend_fd >= 0) close(ar->pend_fd);
  ar->pend_fd = -1, ar->pend_len = 0;
}

/* ---- wake ---- */

typedef struct {
  arena *ar;
  msv_copy_item *items;
  size_t pi;
} restore_ctx;

/* Chunk ci of the backup read: its pieces copied in (nothing past the frontier), then waited for. */
static int restore_chunk(msv_allocator *a, size_t ci, char *host, void *arg) {
  restore_ctx *x = (restore_ctx *)arg;
  arena *ar = x->ar;
  size_t n = chunk_items(ar->pieces, ar->n_pieces, &x->pi, a->hp.chunk_bytes, ci, host, 0, ar->base,
                         ar->base + ar->frontier, x->items);
  int rc = a->b->copy(a->b, x->items, n, MSV_COPY_LOOP, 0);
  return rc ? rc : a->b->sync(a->b, 0); /* a 256 MiB copy: ~5 ms at line rate, while the reads go on */
}

int disk_restore(msv_allocator *a, arena *ar) {
  restore_ctx x = {ar, malloc((ar->n_pieces ? ar->n_pieces : 1) * sizeof(msv_copy_item)), 0};
  if (!x.items) return msv_fail(MSV_E_OOM, "out of host memory for the copy list of tag '%s'", ar->tag);
  double t0 = now_s();
  int err = 0;
  int rc = stream_file(a, ar->disk_fd, 0, pieces_total(ar), DISK_ALIGN, IO_THREADS, restore_chunk, &x, &err);
  free(x.items);
  if (err) return disk_error(a, err, "reading a backup back");
  if (!rc) {
    a->ctr.bytes_from_disk += ar->disk_len;
    a->ctr.last_disk_read_seconds = now_s() - t0;
  }
  return rc;
}

void disk_drop(msv_allocator *a, arena *ar) {
  if (ar->disk_fd < 0) return;
  close(ar->disk_fd);
  a->ctr.disk_held_bytes -= ar->disk_len;
  ar->disk_fd = -1, ar->disk_len = 0;
}
