/* Per-tag arenas: each tag owns one reserved virtual range.
 *
 * Physical memory is mapped into it as extents that grow with the arena (at least 1/128 of what is
 * mapped, so small tags cost 2 MiB and large ones waste under 1%), and allocations are carved from
 * it first-fit at 256-byte alignment: small tensors never cost a 2 MiB mapping each. Sleep drops
 * every extent of a tag (after copying live bytes to host for OFFLOAD); wake maps the same range
 * again in a few large extents, so each address comes back unchanged. The caller holds the
 * allocator's mutex. */
#include <string.h>

#include "allocator_internal.h"

int find_arena(msv_allocator *a, const char *tag) {
  for (size_t i = 0; i < a->n_arenas; i++)
    if (strcmp(a->arenas[i]->tag, tag) == 0) return (int)i;
  return -1;
}

int check_tag(const char *tag) {
  size_t n = strlen(tag);
  if (n == 0 || n >= 64) return msv_fail(MSV_E_INVALID, "tag must be 1 to 63 bytes long, got %zu", n);
  return MSV_OK;
}

int get_arena(msv_allocator *a, const char *tag, int *idx, int *created) {
  int rc = check_tag(tag);
  if (rc) return rc;
  int i = find_arena(a, tag);
  *created = 0;
  if (i >= 0) {
    *idx = i;
    return MSV_OK;
  }
  arena *ar = calloc(1, sizeof *ar);
  arena **na = realloc(a->arenas, (a->n_arenas + 1) * sizeof *na);
  if (!ar || !na) {
    free(ar);
    if (na) a->arenas = na;
    return msv_fail(MSV_E_OOM, "out of host memory");
  }
  a->arenas = na;
  strcpy(ar->tag, tag);
  ar->disk_fd = ar->pend_fd = -1;
  ar->va_size = a->cfg.arena_va_bytes;
  rc = a->b->reserve(a->b, ar->va_size, &ar->base);
  if (rc) {
    free(ar);
    return rc;
  }
  a->arenas[a->n_arenas] = ar;
  *idx = (int)a->n_arenas++;
  *created = 1; /* only now: a failed reserve leaves nothing to undo */
  return MSV_OK;
}

int free_insert(arena *ar, uint64_t off, uint64_t size) {
  size_t i = 0;
  while (i < ar->n_fr && ar->fr[i].off < off) i++;
  int merge_prev = i > 0 && ar->fr[i - 1].off + ar->fr[i - 1].size == off;
  int merge_next = i < ar->n_fr && off + size == ar->fr[i].off;
  if (merge_prev && merge_next) {
    ar->fr[i - 1].size += size + ar->fr[i].size;
    memmove(&ar->fr[i], &ar->fr[i + 1], (ar->n_fr - i - 1) * sizeof(frange));
    ar->n_fr--;
  } else if (merge_prev) {
    ar->fr[i - 1].size += size;
  } else if (merge_next) {
    ar->fr[i].off = off;
    ar->fr[i].size += size;
  } else {
    int rc = grow((void **)&ar->fr, &ar->cap_fr, ar->n_fr + 1, sizeof(frange));
    if (rc) return rc;
    memmove(&ar->fr[i + 1], &ar->fr[i], (ar->n_fr - i) * sizeof(frange));
    ar->fr[i] = (frange){off, size};
    ar->n_fr++;
  }
  return MSV_OK;
}

size_t mapped_bytes(const arena *ar) {
  size_t m = 0;
  for (size_t i = 0; i < ar->n_ext; i++)
    if (ar->ext[i].mapped) m += ar->ext[i].size;
  return m;
}

/* Map [frontier, frontier+len) as one new extent. */
static int extend(msv_allocator *a, arena *ar, uint64_t len) {
  if (ar->frontier + len > ar->va_size)
    return msv_fail(MSV_E_OOM, "tag '%s': arena address range of %llu bytes exhausted", ar->tag,
                    (unsigned long long)ar->va_size);
  int rc = grow((void **)&ar->ext, &ar->cap_ext, ar->n_ext + 1, sizeof(extent));
  if (rc) return rc;
  uint64_t h = 0;
  rc = a->b->map(a->b, ar->base + ar->frontier, len, &h);
  if (rc) return rc;
  ar->ext[ar->n_ext++] = (extent){ar->frontier, len, h, 1};
  ar->frontier += len;
  return MSV_OK;
}

int arena_carve(msv_allocator *a, arena *ar, uint64_t rsize, uint64_t *out) {
  uint64_t off = UINT64_MAX;
  for (size_t i = 0; i < ar->n_fr; i++) {
    if (ar->fr[i].size >= rsize) {
      off = ar->fr[i].off;
      ar->fr[i].off += rsize;
      ar->fr[i].size -= rsize;
      if (ar->fr[i].size == 0) {
        memmove(&ar->fr[i], &ar->fr[i + 1], (ar->n_fr - i - 1) * sizeof(frange));
        ar->n_fr--;
      }
      break;
    }
  }
  if (off == UINT64_MAX) {
    /* Grow at the tail, reusing a free range that ends at the frontier. */
    uint64_t start = ar->frontier;
    if (ar->n_fr && ar->fr[ar->n_fr - 1].off + ar->fr[ar->n_fr - 1].size == ar->frontier) start = ar->fr[ar->n_fr - 1].off;
    uint64_t need = start + rsize - ar->frontier;
    uint64_t len = need > ar->frontier / 128 ? need : ar->frontier / 128;
    len = round_up(len, a->b->granularity);
    int rc = extend(a, ar, len);
    if (rc) return rc;
    if (start < ar->frontier - len) ar->n_fr--; /* the tail range is consumed */
    off = start;
    if (off + rsize < ar->frontier) {
      rc = free_insert(ar, off + rsize, ar->frontier - off - rsize);
      if (rc) return rc;
    }
  }
  *out = off;
  return MSV_OK;
}

/* Drop trailing extents that hold no allocation, returning their memory to the device. */
void trim_tail(msv_allocator *a, arena *ar) {
  int synced = 0;
  while (ar->n_ext && ar->n_fr) {
    extent *x = &ar->ext[ar->n_ext - 1];
    frange *f = &ar->fr[ar->n_fr - 1];
    if (!x->mapped || f->off + f->size != ar->frontier || f->off > x->off) return;
    /* a copy enqueued without waiting (copy_block_ids), or a kernel still reading the freed tensor on
     * torch's stream, may still touch the range: wait for all of the device's work first */
    if (!synced && a->b->quiesce(a->b)) return;
    synced = 1;
    if (a->b->unmap(a->b, ar->base + x->off, x->size, x->handle)) return;
    ar->frontier = x->off;
    ar->n_ext--;
    f->size = x->off - f->off;
    if (f->size == 0) ar->n_fr--;
  }
}

int unmap_all(msv_allocator *a, arena *ar) {
  for (size_t k = 0; k < ar->n_ext; k++) {
    extent *x = &ar->ext[k];
    if (!x->mapped) continue;
    int rc = a->b->unmap(a->b, ar->base + x->off, x->size, x->handle);
    if (rc) return rc;
    x->mapped = 0;
  }
  return MSV_OK;
}

void arena_destroy(msv_allocator *a, arena *ar) {
  for (size_t k = 0; k < ar->n_ext; k++)
    if (ar->ext[k].mapped) a->b->unmap(a->b, ar->base + ar->ext[k].off, ar->ext[k].size, ar->ext[k].handle);
  a->b->free_va(a->b, ar->base, ar->va_size);
  free(ar->ext), free(ar->fr), free(ar);
}
