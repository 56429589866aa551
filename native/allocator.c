/* The allocator: create and destroy it, allocate and free in a tag's arena, host buffers, lookups,
 * statistics and knobs. The pieces it is built from live beside it: the allocation table (table.c),
 * the arenas (arena.c), a tag's host backup and its checksums (offload.c, checksums.c), the
 * transitions (sleep.c, wake.c), block copies (copies.c) and files streamed into device memory
 * (filestream.c: a disk-tier wake, checkpoint staging); allocator_internal.h holds what they share and
 * how they lock. */
#include <stdio.h>
#include <string.h>

#include "allocator_internal.h"

#define ALIGN 256ull /* of every allocation in an arena */

/* ---- create / destroy ---- */
int msv_create(const msv_config *cfg, msv_allocator **out) {
  msv_backend *b = NULL;
  int rc = cfg->backend == MSV_BACKEND_CUDA ? msv_backend_cuda_create(cfg->device, &b)
                                           : msv_backend_host_create(cfg->device, cfg->host_capacity, cfg->granularity, &b);
  if (rc) return rc;
  msv_allocator *a = calloc(1, sizeof *a);
  if (!a) {
    b->destroy(b);
    return msv_fail(MSV_E_OOM, "out of host memory");
  }
  a->cfg = *cfg;
  if (!a->cfg.arena_va_bytes) a->cfg.arena_va_bytes = 1ull << 40;
  a->cfg.arena_va_bytes = round_up(a->cfg.arena_va_bytes, b->granularity);
  a->b = b;
  pthread_mutex_init(&a->mu, NULL);
  pthread_mutex_init(&a->transition, NULL);
  msv_hostpool_init(&a->hp, b, cfg->host_chunk_bytes, cfg->host_reserve_bytes, cfg->prefault_threads,
                    !cfg->no_huge_pages);
  a->refs = 1;
  *out = a;
  return MSV_OK;
}

void msv_retain(msv_allocator *a) { __atomic_add_fetch(&a->refs, 1, __ATOMIC_ACQ_REL); }

void msv_release(msv_allocator *a) {
  if (a && __atomic_sub_fetch(&a->refs, 1, __ATOMIC_ACQ_REL) == 0) msv_destroy(a);
}

void msv_destroy(msv_allocator *a) {
  if (!a) return;
  a->b->quiesce(a->b); /* copies in flight (unwaited or dropped fences), kernels on any stream: done first */
  for (size_t i = 0; i < a->n_tab; i++)
    if (a->tab[i].chunk) msv_hostpool_put(&a->hp, a->tab[i].chunk);
  for (size_t i = 0; i < a->n_arenas; i++) {
    arena *ar = a->arenas[i];
    drop_backup(a, ar);
    arena_destroy(a, ar);
  }
  msv_hostpool_destroy(&a->hp);
  a->b->destroy(a->b);
  free(a->arenas), free(a->tab);
  pthread_mutex_destroy(&a->mu);
  pthread_mutex_destroy(&a->transition);
  free(a);
}

msv_backend *msv_get_backend(msv_allocator *a) { return a->b; }

/* ---- alloc / free ---- */
int msv_alloc(msv_allocator *a, const char *tag, size_t size, uint64_t *out) {
  if (size == 0) return msv_fail(MSV_E_INVALID, "allocation size must be > 0");
  if (size > (1ull << 50)) return msv_fail(MSV_E_INVALID, "allocation of %zu bytes is larger than any device", size);
  uint64_t rsize = round_up(size, ALIGN);
  pthread_mutex_lock(&a->mu);
  int idx = -1, created = 0, rc = get_arena(a, tag, &idx, &created);
  if (rc) goto out;
  arena *ar = a->arenas[idx];
  if (ar->state != MSV_TAG_AWAKE) {
    rc = msv_fail(MSV_E_STATE, "tag '%s' is asleep: wake it before allocating", tag);
    goto out;
  }
  uint64_t off = 0;
  rc = arena_carve(a, ar, rsize, &off);
  if (rc) goto out;
  rc = tab_insert(a, (entry){ar->base + off, size, rsize, idx, 0, 0, NULL});
  if (rc) {
    free_insert(ar, off, rsize);
    goto out;
  }
  ar->allocated += size;
  ar->n_allocs++;
  *out = ar->base + off;
out:
  if (rc && created && idx == (int)a->n_arenas - 1) { /* a failed first allocation leaves no tag behind */
    arena_destroy(a, a->arenas[idx]);
    a->n_arenas--;
  }
  pthread_mutex_unlock(&a->mu);
  return rc;
}

int msv_free(msv_allocator *a, uint64_t addr) {
  pthread_mutex_lock(&a->mu);
  entry *e = tab_find_exact(a, addr);
  int rc = MSV_OK;
  if (!e || e->arena < 0) {
    rc = msv_fail(MSV_E_NOT_FOUND, "0x%llx is not an allocation of this allocator", (unsigned long long)addr);
    goto out;
  }
  arena *ar = a->arenas[e->arena];
  uint64_t off = e->addr - ar->base, rsize = e->rsize;
  ar->allocated -= e->size;
  ar->n_allocs--;
  tab_remove(a, e);
  rc = free_insert(ar, off, rsize);
  if (!rc && ar->state == MSV_TAG_AWAKE) trim_tail(a, ar);
out:
  pthread_mutex_unlock(&a->mu);
  return rc;
}

/* ---- host buffers ---- */
int msv_host_alloc(msv_allocator *a, size_t size, uint64_t *out) {
  if (size == 0) return msv_fail(MSV_E_INVALID, "host buffer size must be > 0");
  msv_hchunk *c = NULL;
  int rc = msv_hostpool_get(&a->hp, size, &c);
  if (rc) return rc;
  pthread_mutex_lock(&a->mu);
  rc = tab_insert(a, (entry){(uint64_t)(uintptr_t)c->ptr, size, c->size, -1, 0, 0, c});
  pthread_mutex_unlock(&a->mu);
  if (rc) msv_hostpool_put(&a->hp, c);
  else *out = (uint64_t)(uintptr_t)c->ptr;
  return rc;
}

int msv_host_free(msv_allocator *a, uint64_t addr) {
  pthread_mutex_lock(&a->mu);
  entry *e = tab_find_exact(a, addr);
  if (!e || e->arena >= 0) {
    pthread_mutex_unlock(&a->mu);
    return msv_fail(MSV_E_NOT_FOUND, "0x%llx is not a host buffer of this allocator", (unsigned long long)addr);
  }
  msv_hchunk *c = e->chunk;
  tab_remove(a, e);
  pthread_mutex_unlock(&a->mu);
  a->b->sync(a->b, 0); /* no copy enqueued without waiting may still write into it once reused or unmapped */
  msv_hostpool_put(&a->hp, c);
  msv_hostpool_trim(&a->hp);
  return MSV_OK;
}

/* ---- stats ---- */
/* Status calls must answer during a transition, which holds the table for its whole run: with
 * `nonblocking` they fail with MSV_E_BUSY instead of waiting. */
static int lock_table(msv_allocator *a, int nonblocking) {
  if (nonblocking) {
    if (pthread_mutex_trylock(&a->mu) != 0) return msv_fail(MSV_E_BUSY, "the allocator is busy with a transition");
  } else {
    pthread_mutex_lock(&a->mu);
  }
  return MSV_OK;
}

int msv_tag_stats_all(msv_allocator *a, msv_tag_stats *out, size_t cap, size_t *n, int nonblocking) {
  int rc = lock_table(a, nonblocking);
  if (rc) return rc;
  *n = a->n_arenas;
  for (size_t i = 0; i < a->n_arenas && i < cap; i++) {
    arena *ar = a->arenas[i];
    msv_tag_stats *s = &out[i];
    memset(s, 0, sizeof *s);
    strcpy(s->tag, ar->tag);
    s->state = ar->state;
    s->base = ar->base;
    s->mapped_bytes = mapped_bytes(ar);
    s->layout_bytes = ar->frontier;
    s->allocated_bytes = ar->allocated;
    s->offloaded_bytes = ar->state == MSV_TAG_OFFLOADED ? ar->offloaded : 0;
    s->disk_bytes = ar->state == MSV_TAG_ON_DISK ? ar->offloaded : 0;
    s->discarded_bytes = ar->discarded;
    s->n_allocs = ar->n_allocs;
    s->n_extents = ar->n_ext;
  }
  pthread_mutex_unlock(&a->mu);
  return MSV_OK;
}

int msv_get_counters(msv_allocator *a, msv_counters *out, int nonblocking) {
  int rc = lock_table(a, nonblocking);
  if (rc) return rc;
  *out = a->ctr;
  pthread_mutex_lock(&a->hp.mu);
  out->host_chunks_created = a->hp.chunks_created;
  out->host_chunks_reused = a->hp.chunks_reused;
  out->host_held_bytes = a->hp.held_bytes;
  out->host_reserve_bytes = a->hp.reserve_bytes;
  out->host_prefault_seconds = a->hp.prefault_seconds;
  out->host_register_seconds = a->hp.register_seconds;
  pthread_mutex_unlock(&a->hp.mu);
  pthread_mutex_unlock(&a->mu);
  return MSV_OK;
}

int msv_set_checksum(msv_allocator *a, int on) {
  pthread_mutex_lock(&a->mu);
  a->cfg.checksum = on;
  pthread_mutex_unlock(&a->mu);
  return MSV_OK;
}

int msv_set_host_reserve(msv_allocator *a, size_t bytes) {
  pthread_mutex_lock(&a->hp.mu);
  a->hp.reserve_bytes = bytes;
  pthread_mutex_unlock(&a->hp.mu);
  msv_hostpool_trim(&a->hp);
  return MSV_OK;
}

/* Only the pool's own lock, taken briefly: the seconds of faulting and pinning hold no allocator lock. */
int msv_host_prepin(msv_allocator *a, size_t bytes) { return msv_hostpool_prepin(&a->hp, bytes); }
void msv_host_prepin_cancel(msv_allocator *a) { msv_hostpool_prepin_cancel(&a->hp); }

int msv_lookup(msv_allocator *a, uint64_t addr, size_t size, uint64_t *base, char *tag, size_t tag_cap) {
  pthread_mutex_lock(&a->mu);
  entry *e = tab_find_containing(a, addr, size ? size : 1);
  int rc = MSV_OK;
  if (!e) rc = msv_fail(MSV_E_NOT_FOUND, "0x%llx is not inside an allocation", (unsigned long long)addr);
  else {
    *base = e->addr;
    snprintf(tag, tag_cap, "%s", e->arena >= 0 ? a->arenas[e->arena]->tag : "");
  }
  pthread_mutex_unlock(&a->mu);
  return rc;
}

