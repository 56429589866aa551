/* What the allocator's own files share and nothing else sees: the allocation table's rows, the
 * per-tag arenas, the allocator itself, the helpers they all use, and each file's functions for the
 * others. The public interface is msv.h; the backends and the Python binding never include this.
 *
 * One mutex (mu) guards the table and every arena. Transitions hold it for their whole run, so no
 * allocation, free or block copy can observe a half-slept tag; a second transition fails fast with
 * MSV_E_BUSY (begin_transition). */
#ifndef MSV_ALLOCATOR_INTERNAL_H
#define MSV_ALLOCATOR_INTERNAL_H

#include <stdlib.h>
#include <time.h>

#include "msv.h"

/* One physical mapping of an arena: [base + off, +size), backed by `handle` while `mapped`. */
typedef struct {
  uint64_t off, size, handle;
  int mapped;
} extent;

/* A free range of an arena, by offset; the list is sorted and neighbours are merged. */
typedef struct {
  uint64_t off, size;
} frange;

typedef struct {
  char tag[64];
  uint64_t base, va_size, frontier;
  extent *ext;
  size_t n_ext, cap_ext;
  frange *fr;
  size_t n_fr, cap_fr;
  int state;
  size_t allocated, n_allocs, discarded;
  /* host backup while OFFLOADED */
  msv_hchunk *chunks;
  msv_copy_item *pieces; /* dst = host (ON_DISK: the offset in the file), src = device */
  size_t n_pieces, offloaded;
  /* the disk tier (disk.c): the backup's file while ON_DISK, and one a sleep wrote but has not yet
   * committed (phase 1 writes, phase 2 commits, a failure closes it: nothing else changed) */
  int disk_fd, pend_fd;
  uint64_t disk_len, pend_len;
} arena;

/* A row of the allocation table (sorted by addr): a pool allocation or a host buffer. */
typedef struct {
  uint64_t addr, size, rsize;
  int arena; /* -1 for a host buffer */
  uint64_t sum;
  int has_sum;       /* sum was taken at the last sleep: verify it on wake */
  msv_hchunk *chunk; /* host buffer */
} entry;

struct msv_allocator {
  msv_config cfg;
  msv_backend *b;
  msv_hostpool hp;
  pthread_mutex_t mu, transition;
  arena **arenas;
  size_t n_arenas;
  entry *tab;
  size_t n_tab, cap_tab;
  msv_counters ctr;
  int refs; /* the owner plus one per live tensor; destroyed at zero */
};

static inline double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline int grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return MSV_OK;
  size_t nc = *cap ? *cap * 2 : 16;
  while (nc < need) nc *= 2;
  void *q = realloc(*p, nc * elem);
  if (!q) return msv_fail(MSV_E_OOM, "out of host memory for allocator bookkeeping");
  *p = q;
  *cap = nc;
  return MSV_OK;
}

static inline uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* Take both locks for a sleep or wake, or fail at once if another one runs. */
static inline int begin_transition(msv_allocator *a) {
  if (pthread_mutex_trylock(&a->transition) != 0) return msv_fail(MSV_E_BUSY, "a sleep or wake is already running");
  pthread_mutex_lock(&a->mu);
  return MSV_OK;
}

static inline void end_transition(msv_allocator *a) {
  pthread_mutex_unlock(&a->mu);
  pthread_mutex_unlock(&a->transition);
}

/* ---- table.c: the allocation table (caller holds mu) ---- */
entry *tab_find_exact(msv_allocator *a, uint64_t addr);
/* The row that holds all of [addr, addr+size), or NULL. */
entry *tab_find_containing(msv_allocator *a, uint64_t addr, uint64_t size);
int tab_insert(msv_allocator *a, entry e);
void tab_remove(msv_allocator *a, entry *e);

/* ---- arena.c: per-tag arenas (caller holds mu) ---- */
int check_tag(const char *tag);
/* Index of the arena of `tag`, or -1. */
int find_arena(msv_allocator *a, const char *tag);
/* The arena of `tag`, reserved on first use (*created says so). */
int get_arena(msv_allocator *a, const char *tag, int *idx, int *created);
/* Offset of `rsize` fresh bytes in an awake arena, mapping more at its tail when no free range fits. */
int arena_carve(msv_allocator *a, arena *ar, uint64_t rsize, uint64_t *off);
int free_insert(arena *ar, uint64_t off, uint64_t size);
size_t mapped_bytes(const arena *ar);
void trim_tail(msv_allocator *a, arena *ar);
/* Drop every mapped extent, keeping the range; stops at the first failure. */
int unmap_all(msv_allocator *a, arena *ar);
/* Unmap what is mapped, give the range back and free the arena (its backup must be gone). */
void arena_destroy(msv_allocator *a, arena *ar);

/* ---- backup.c: a tag's backup, in host chunks or in a file ---- */
/* Where offload_arena and the disk tier put a tag's live bytes: the coalesced runs of its
 * allocations, cut into pieces whose dst is an offset in [0, *total) of the backup, where chunk i of
 * `chunk_bytes` starts at i * chunk_bytes (a piece never crosses a chunk). *data counts tensor
 * bytes (the pieces also carry alignment padding). NULL pieces and *total 0 when nothing lives. */
int plan_backup(msv_allocator *a, int idx, uint64_t chunk_bytes, msv_copy_item **pieces, size_t *n_pieces,
                uint64_t *total, uint64_t *data);
size_t backup_in_extent(const arena *ar, const extent *x, size_t *pi, msv_copy_item *out);
void drop_backup(msv_allocator *a, arena *ar);

/* ---- offload.c: a tag's host backup ---- */
int offload_arena(msv_allocator *a, int idx);

/* ---- disk.c: the disk tier (the caller holds mu) ---- */
/* Phase 1 of a sleep to disk: write the tag's backup to a new file (pend_fd): from device memory
 * through a few page-locked staging chunks when the tag is awake (the pieces are then planned here,
 * dst = file offsets), or from its host chunks when it is OFFLOADED (a demotion). Nothing else
 * changes; on failure the file is gone. */
int disk_write(msv_allocator *a, int idx);
/* Phase 2: the written file is the backup now (host chunks of a demotion go back to the pool). */
void disk_commit(msv_allocator *a, arena *ar);
/* Forget a pending file (a sleep failed). */
void disk_abandon(arena *ar);
/* Wake, once every extent of the ON_DISK tag is mapped: stream the file into device memory through
 * staging chunks. On failure the file is intact (the tag stays ON_DISK). */
int disk_restore(msv_allocator *a, arena *ar);
/* Close the backup's file (restored, demoted, or destroyed); it was unlinked when made. */
void disk_drop(msv_allocator *a, arena *ar);

/* ---- filestream.c: files into device memory through page-locked staging chunks ---- */
#define IO_PIECE (16ull << 20) /* one pread/pwrite; the pieces of a chunk go to several threads */
#define RING 3                 /* staging chunks: one being filled, one in flight, one spare */
typedef struct {
  msv_hchunk *slot[RING];
  uint64_t fence[RING];
} ring;
/* All n bytes at off, through short counts and signals; an errno (EIO: the file ended first), or 0. */
int io_all(int fd, int writing, char *p, uint64_t n, uint64_t off);
/* Chunk ci's staging slot, once the copy last marked on it is done (the slot taken on first use). */
int ring_slot(msv_allocator *a, ring *r, size_t ci, msv_hchunk **out);
/* Mark chunk ci's slot busy until the copies enqueued so far on the backend's stream are done. */
int ring_mark(msv_allocator *a, ring *r, size_t ci);
/* Wait for the copies, give the slots back to the host pool. */
void ring_done(msv_allocator *a, ring *r);
/* What of chunk ci (of cb bytes) of a range of `total` bytes is read or written: its bytes, rounded up
 * to `align` (O_DIRECT's, or 1). */
uint64_t chunk_io_len(uint64_t total, uint64_t cb, size_t ci, uint64_t align);
/* Called on stream_file's thread with chunk ci read into host; done with it when it returns. */
typedef int (*chunk_put)(msv_allocator *a, size_t ci, char *host, void *ctx);
/* Read [base, base + total) of fd with `threads` readers, chunk by chunk of the host pool's chunk size
 * (each chunk's length rounded up to `align`, for O_DIRECT), handing each chunk to put in order. A
 * failed read returns MSV_E_BACKEND with its errno in *io_errno and no message set (the caller says
 * what the file was); put's failure is returned as it is. */
int stream_file(msv_allocator *a, int fd, uint64_t base, uint64_t total, uint64_t align, int threads,
                chunk_put put, void *ctx, int *io_errno);

/* ---- checksums.c: the per-allocation sums of a backup ---- */
int checksum_arena(msv_allocator *a, int idx, uint64_t **sums_out, size_t *n_out);
void keep_sums(msv_allocator *a, int idx, const uint64_t *sums);
int verify_sums(msv_allocator *a, int idx);
void clear_sums(msv_allocator *a, arena *ar);

#endif
