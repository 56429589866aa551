/* msv_wake: bring sleeping tags back at the addresses they had. Phases 1 and 2 run pipelined per
 * extent (map it, then enqueue its share of the host backup); phase 3 verifies the restored bytes
 * against the sums taken at sleep and releases the backups. A map or copy that fails puts every
 * named tag back to sleep with its backup intact, so a later wake can succeed. */
#include <stdio.h>

#include "allocator_internal.h"

/* Map the dropped extents of one sleeping tag again at the same offsets and sizes (so a free after
 * the wake can still return a trailing extent to the device), and enqueue each extent's share of
 * the host backup as soon as that extent is mapped: the copy engine fills extent k while the host
 * maps extent k+1, so the mapping (cuMemCreate + cuMemMap + cuMemSetAccess per extent, ~165 of them
 * for 16 GB) hides behind the copy instead of running before the first byte moves. Copies are only
 * enqueued; the caller syncs. Each extent is marked mapped the moment it is, so after a failure
 * unmap_all drops exactly what is there. Time spent in map calls is added to *map_seconds. */
static int wake_arena(msv_allocator *a, arena *ar, double *map_seconds) {
  int restore = ar->state == MSV_TAG_OFFLOADED && ar->n_pieces;
  /* one list, refilled per extent: a piece yields at most one item per extent */
  msv_copy_item *items = restore ? malloc(ar->n_pieces * sizeof *items) : NULL;
  if (restore && !items) return msv_fail(MSV_E_OOM, "out of host memory for the copy list of tag '%s'", ar->tag);
  size_t pi = 0;
  int rc = MSV_OK;
  for (size_t k = 0; k < ar->n_ext && !rc; k++) {
    extent *x = &ar->ext[k];
    if (!x->mapped) { /* one a failed sleep could not drop is still mapped: it only needs its bytes back */
      double t = now_s();
      rc = a->b->map(a->b, ar->base + x->off, x->size, &x->handle);
      *map_seconds += now_s() - t;
      if (rc) break;
      x->mapped = 1;
    }
    size_t n = restore ? backup_in_extent(ar, x, &pi, items) : 0;
    /* the backend reads the items during the call (cuMemcpyAsync takes its arguments by value), so
     * the list can be refilled for the next extent while this copy is still in flight */
    if (n) rc = a->b->copy(a->b, items, n, MSV_COPY_LOOP, 0);
  }
  free(items);
  return rc;
}

/* A wake failed part-way: wait for the copies in flight, then drop every extent of every tag named
 * in the call, so each stays asleep with its host backup intact and a later wake starts afresh.
 * The caller sees the error that stopped the wake, not one from this clean-up. */
static int back_to_sleep(msv_allocator *a, const int *idx, size_t k, int rc) {
  char why[512];
  snprintf(why, sizeof why, "%s", msv_last_error());
  a->b->sync(a->b, 0);
  for (size_t q = 0; q < k; q++) unmap_all(a, a->arenas[idx[q]]);
  return msv_fail(rc, "%s", why);
}

/* The end of the last live allocation of arena `idx` (0 if none). */
static uint64_t live_end(msv_allocator *a, int idx) {
  uint64_t end = 0;
  for (size_t t = 0; t < a->n_tab; t++) {
    entry *e = &a->tab[t];
    if (e->arena == idx && e->addr - a->arenas[idx]->base + e->rsize > end) end = e->addr - a->arenas[idx]->base + e->rsize;
  }
  return end;
}

/* Before a wake: forget trailing extents that no live allocation reaches any more (freed while the
 * tag slept), so the wake maps only what is used. The free list is clipped to the new frontier. */
static void drop_dead_tail(msv_allocator *a, int idx) {
  arena *ar = a->arenas[idx];
  uint64_t end = live_end(a, idx);
  while (ar->n_ext && !ar->ext[ar->n_ext - 1].mapped && ar->ext[ar->n_ext - 1].off >= end) ar->n_ext--;
  uint64_t frontier = ar->n_ext ? ar->ext[ar->n_ext - 1].off + ar->ext[ar->n_ext - 1].size : 0;
  while (ar->n_fr && ar->fr[ar->n_fr - 1].off >= frontier) ar->n_fr--;
  if (ar->n_fr && ar->fr[ar->n_fr - 1].off + ar->fr[ar->n_fr - 1].size > frontier)
    ar->fr[ar->n_fr - 1].size = frontier - ar->fr[ar->n_fr - 1].off;
  ar->frontier = frontier;
}

int msv_wake(msv_allocator *a, const char **tags, size_t n) {
  int rc = begin_transition(a);
  if (rc) return rc;
  double t0 = now_s();
  size_t m = tags ? n : a->n_arenas;
  int *idx = calloc(m ? m : 1, sizeof *idx);
  size_t k = 0;
  if (!idx) {
    rc = msv_fail(MSV_E_OOM, "out of host memory");
    goto out;
  }
  if (tags && n == 0) {
    rc = msv_fail(MSV_E_INVALID, "empty tag list: name tags, or pass none to wake every sleeping tag");
    goto out;
  }
  if (tags) {
    for (size_t i = 0; i < n; i++) {
      if ((rc = check_tag(tags[i]))) goto out;
      int j = find_arena(a, tags[i]);
      if (j < 0) {
        rc = msv_fail(MSV_E_NOT_FOUND, "unknown tag '%s': nothing was ever allocated under it", tags[i]);
        goto out;
      }
      if (a->arenas[j]->state == MSV_TAG_AWAKE) {
        rc = msv_fail(MSV_E_STATE, "tag '%s' is not asleep", tags[i]);
        goto out;
      }
      for (size_t q = 0; q < k; q++)
        if (idx[q] == j) {
          rc = msv_fail(MSV_E_INVALID, "tag '%s' named twice", tags[i]);
          goto out;
        }
      idx[k++] = j;
    }
  } else {
    for (size_t j = 0; j < a->n_arenas; j++)
      if (a->arenas[j]->state != MSV_TAG_AWAKE) idx[k++] = (int)j;
    if (k == 0) {
      rc = msv_fail(MSV_E_STATE, "nothing is asleep");
      goto out;
    }
  }
  /* Phases 1 and 2, pipelined per extent: map it, then enqueue its share of the backup. */
  for (size_t q = 0; q < k; q++) drop_dead_tail(a, idx[q]);
  double map_seconds = 0;
  for (size_t q = 0; q < k && !rc; q++) rc = wake_arena(a, a->arenas[idx[q]], &map_seconds);
  if (!rc) rc = a->b->sync(a->b, 0);
  /* A tag on disk streams its file in once its extents are mapped (disk.c). */
  for (size_t q = 0; q < k && !rc; q++)
    if (a->arenas[idx[q]]->state == MSV_TAG_ON_DISK) rc = disk_restore(a, a->arenas[idx[q]]);
  if (rc) { /* a map or a copy failed: the backups are intact, so put the tags back to sleep */
    rc = back_to_sleep(a, idx, k, rc);
    goto out;
  }
  /* Phase 3: verify, then release backups. */
  for (size_t q = 0; q < k; q++) {
    arena *ar = a->arenas[idx[q]];
    int was_offloaded = ar->state == MSV_TAG_OFFLOADED || ar->state == MSV_TAG_ON_DISK;
    if (was_offloaded && !rc) rc = verify_sums(a, idx[q]);
    if (was_offloaded) a->ctr.bytes_restored += ar->offloaded;
    drop_backup(a, ar);
    ar->state = MSV_TAG_AWAKE;
    ar->discarded = 0;
  }
  msv_hostpool_trim_async(&a->hp);
  a->ctr.wakes++;
  a->ctr.last_wake_seconds = now_s() - t0;
  a->ctr.last_wake_map_seconds = map_seconds;
out:
  free(idx);
  end_transition(a);
  return rc;
}
