/* A tag's backup, wherever it is (host chunks, offload.c; or a file, disk.c): how its live bytes are
 * laid out, the part of it that lands in one extent, and dropping it. offload.c and disk.c both
 * build on this file and not on each other. */
#include <stdlib.h>

#include "allocator_internal.h"

int plan_backup(msv_allocator *a, int idx, uint64_t chunk_bytes, msv_copy_item **pieces_out, size_t *n_out,
                uint64_t *total_out, uint64_t *data_out) {
  /* runs: coalesced live allocations, in address order */
  msv_copy_item *runs = NULL;
  size_t n_runs = 0, cap_runs = 0;
  uint64_t total = 0, data = 0;
  for (size_t i = 0; i < a->n_tab; i++) {
    entry *e = &a->tab[i];
    if (e->arena != idx) continue;
    data += e->size;
    if (n_runs && runs[n_runs - 1].src + runs[n_runs - 1].size == e->addr) {
      runs[n_runs - 1].size += e->rsize;
    } else {
      int rc = grow((void **)&runs, &cap_runs, n_runs + 1, sizeof *runs);
      if (rc) {
        free(runs);
        return rc;
      }
      runs[n_runs++] = (msv_copy_item){0, e->addr, e->rsize};
    }
    total += e->rsize;
  }
  *pieces_out = NULL, *n_out = 0, *total_out = total, *data_out = data;
  if (total == 0) {
    free(runs);
    return MSV_OK;
  }
  size_t nchunks = (total + chunk_bytes - 1) / chunk_bytes;
  msv_copy_item *pieces = malloc((n_runs + nchunks) * sizeof *pieces);
  if (!pieces) {
    free(runs);
    return msv_fail(MSV_E_OOM, "out of host memory");
  }
  /* walk the runs, cutting one at each chunk boundary */
  size_t n = 0;
  uint64_t off = 0;
  for (size_t r = 0; r < n_runs; r++) {
    uint64_t done = 0;
    while (done < runs[r].size) {
      uint64_t room = chunk_bytes - off % chunk_bytes, left = runs[r].size - done, take = left < room ? left : room;
      pieces[n++] = (msv_copy_item){off, runs[r].src + done, take};
      off += take, done += take;
    }
  }
  free(runs);
  *pieces_out = pieces, *n_out = n;
  return MSV_OK;
}

/* The parts of a tag's host backup that land in extent x, as copy items (dst = device), cut at the
 * extent's edges: a piece that straddles two extents is copied in two parts, each once its extent
 * is mapped. Extents cover [0, frontier) with no gaps, so nothing past the frontier (a tail freed
 * while the tag slept) is ever copied. *pi is the first piece not wholly below x; pieces and extents
 * are both in address order, so the walk over a whole tag costs O(pieces + extents). Returns the
 * number of items written to out (at most one per piece). */
size_t backup_in_extent(const arena *ar, const extent *x, size_t *pi, msv_copy_item *out) {
  uint64_t lo = ar->base + x->off, hi = lo + x->size;
  while (*pi < ar->n_pieces && ar->pieces[*pi].src + ar->pieces[*pi].size <= lo) (*pi)++;
  size_t n = 0;
  for (size_t i = *pi; i < ar->n_pieces && ar->pieces[i].src < hi; i++) {
    const msv_copy_item *p = &ar->pieces[i];
    uint64_t s = p->src > lo ? p->src : lo, e = p->src + p->size < hi ? p->src + p->size : hi;
    out[n++] = (msv_copy_item){s, p->dst + (s - p->src), e - s};
  }
  return n;
}

/* A tag's backup goes away (restored, demoted, or a failed sleep): its host chunks, its file, and
 * its checksums, which describe only that copy. */
void drop_backup(msv_allocator *a, arena *ar) {
  clear_sums(a, ar);
  disk_drop(a, ar);
  disk_abandon(ar);
  while (ar->chunks) {
    msv_hchunk *c = ar->chunks;
    ar->chunks = c->next;
    c->next = NULL;
    msv_hostpool_put(&a->hp, c);
  }
  free(ar->pieces);
  ar->pieces = NULL;
  ar->n_pieces = 0;
  ar->offloaded = 0;
}
