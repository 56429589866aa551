/* Validated block copies between live allocations and host buffers of one allocator.
 *
 * copy_blocks takes arbitrary (src, dst, size) items and checks each end against the allocation
 * table; copy_block_ids, the SwapBlocks fast path, takes block ids of two block-major pools and
 * checks them against the pools' bounds. Either way nothing moves if any item is bad, and the
 * table's mutex is held across check and copy so no allocation goes away or falls asleep between
 * them. A fenced copy returns once enqueued; sleep, free and destroy wait for the allocator's stream
 * before memory goes. */
#include <string.h>

#include "allocator_internal.h"

/* LSD radix sort by destination, 11 bits a pass: the overlap check of an 8192-block swap costs
 * tens of microseconds instead of a millisecond of qsort callbacks, and a pass costs O(n) plus a
 * 2048-entry histogram. Passes whose digit is the same for every item are skipped. */
#define RADIX_BITS 11
#define RADIX (1u << RADIX_BITS)
static int sort_by_dst(msv_copy_item *v, size_t n) {
  msv_copy_item *tmp = malloc(n * sizeof *tmp);
  size_t *count = malloc(RADIX * sizeof *count);
  if (!tmp || !count) {
    free(tmp), free(count);
    return msv_fail(MSV_E_OOM, "out of host memory");
  }
  for (int shift = 0; shift < 64; shift += RADIX_BITS) {
    memset(count, 0, RADIX * sizeof *count);
    for (size_t i = 0; i < n; i++) count[(v[i].dst >> shift) & (RADIX - 1)]++;
    if (count[(v[0].dst >> shift) & (RADIX - 1)] == n) continue;
    size_t sum = 0;
    for (size_t d = 0; d < RADIX; d++) {
      size_t c = count[d];
      count[d] = sum;
      sum += c;
    }
    for (size_t i = 0; i < n; i++) tmp[count[(v[i].dst >> shift) & (RADIX - 1)]++] = v[i];
    memcpy(v, tmp, n * sizeof *v);
  }
  free(tmp), free(count);
  return MSV_OK;
}

/* `*hint` remembers the allocation the previous item hit: the blocks of one swap nearly always lie
 * in one pool, so most checks skip the table search. */
static int check_range(msv_allocator *a, size_t i, const char *what, uint64_t p, uint64_t s, entry **hint) {
  if (p + s < p) return msv_fail(MSV_E_INVALID, "item %zu: %s range overflows", i, what);
  entry *e = *hint;
  if (!e || p < e->addr || s > e->size || p - e->addr > e->size - s) e = tab_find_containing(a, p, s);
  *hint = e;
  if (!e)
    return msv_fail(MSV_E_INVALID, "item %zu: %s [0x%llx, +%llu) is not inside one live allocation or host buffer", i, what,
                    (unsigned long long)p, (unsigned long long)s);
  if (e->arena >= 0 && a->arenas[e->arena]->state != MSV_TAG_AWAKE)
    return msv_fail(MSV_E_STATE, "item %zu: %s is in tag '%s', which is asleep", i, what, a->arenas[e->arena]->tag);
  return MSV_OK;
}

/* An empty batch moves nothing, so it needs no kernel. */
static int check_method(msv_allocator *a, int method, size_t n) {
  if (method < MSV_COPY_AUTO || method > MSV_COPY_KERNEL) return msv_fail(MSV_E_INVALID, "unknown copy method %d", method);
  if (n && method == MSV_COPY_KERNEL && !a->b->has_method(a->b, MSV_COPY_KERNEL))
    return msv_fail(MSV_E_UNAVAILABLE,
                    "copy method 'kernel' is not available here (needs the cuda backend, a build with nvcc, and "
                    "host memory the device can address)");
  return MSV_OK;
}

/* Copy checked items (caller holds a->mu). Without a fence: wait for them and record the checks/copy
 * split. With one: return once they are enqueued, *fence marking their end (the counters describe
 * waited copies only). Whatever fails, what was enqueued finishes before the caller hears of it. */
static int run_copy(msv_allocator *a, const msv_copy_item *items, size_t n, int method, uint64_t stream,
                    double checks_seconds, uint64_t *fence) {
  double t = now_s();
  int rc = a->b->copy(a->b, items, n, method, stream);
  if (!rc && fence) rc = a->b->fence(a->b, stream, fence);
  if (rc) {
    a->b->sync(a->b, stream);
    return rc;
  }
  if (fence) return MSV_OK;
  rc = a->b->sync(a->b, stream);
  if (!rc) {
    a->ctr.last_copy_validate_seconds = checks_seconds;
    a->ctr.last_copy_seconds = now_s() - t;
  }
  return rc;
}

int msv_copy_blocks(msv_allocator *a, const uint64_t *src, const uint64_t *dst, const uint64_t *sizes, size_t n,
                    int method, uint64_t stream) {
  int rc = check_method(a, method, n);
  if (rc || n == 0) return rc;
  msv_copy_item *items = malloc(n * sizeof *items);
  if (!items) return msv_fail(MSV_E_OOM, "out of host memory for %zu copy items", n);
  double t0 = now_s();
  pthread_mutex_lock(&a->mu);
  entry *src_hint = NULL, *dst_hint = NULL;
  uint64_t src_lo = UINT64_MAX, src_hi = 0, dst_lo = UINT64_MAX, dst_hi = 0;
  for (size_t i = 0; i < n && !rc; i++) {
    if (sizes[i] == 0) rc = msv_fail(MSV_E_INVALID, "item %zu: size must be > 0", i);
    if (!rc) rc = check_range(a, i, "source", src[i], sizes[i], &src_hint);
    if (!rc) rc = check_range(a, i, "destination", dst[i], sizes[i], &dst_hint);
    items[i] = (msv_copy_item){dst[i], src[i], sizes[i]};
    if (src[i] < src_lo) src_lo = src[i];
    if (src[i] + sizes[i] > src_hi) src_hi = src[i] + sizes[i];
    if (dst[i] < dst_lo) dst_lo = dst[i];
    if (dst[i] + sizes[i] > dst_hi) dst_hi = dst[i] + sizes[i];
  }
  int may_overlap = src_lo < dst_hi && dst_lo < src_hi; /* else no source can touch a destination */
  if (!rc) {
    msv_copy_item *sorted = malloc(n * sizeof *sorted);
    if (!sorted) rc = msv_fail(MSV_E_OOM, "out of host memory");
    else {
      memcpy(sorted, items, n * sizeof *items);
      rc = sort_by_dst(sorted, n);
      for (size_t i = 1; i < n && !rc; i++)
        if (sorted[i - 1].dst + sorted[i - 1].size > sorted[i].dst)
          rc = msv_fail(MSV_E_INVALID, "destinations overlap at 0x%llx", (unsigned long long)sorted[i].dst);
      /* a source may not overlap any destination: the copies run in parallel, in no set order */
      for (size_t i = 0; i < n && !rc && may_overlap; i++) {
        size_t lo = 0, hi = n; /* first destination ending after the source starts */
        while (lo < hi) {
          size_t mid = (lo + hi) / 2;
          if (sorted[mid].dst + sorted[mid].size <= src[i]) lo = mid + 1;
          else hi = mid;
        }
        if (lo < n && sorted[lo].dst < src[i] + sizes[i])
          rc = msv_fail(MSV_E_INVALID, "item %zu: source overlaps a destination at 0x%llx", i,
                        (unsigned long long)sorted[lo].dst);
      }
      free(sorted);
    }
  }
  double t1 = now_s();
  if (!rc) rc = run_copy(a, items, n, method, stream, t1 - t0, NULL);
  pthread_mutex_unlock(&a->mu);
  free(items);
  return rc;
}

/* ---- block-id copies: the SwapBlocks fast path ---- */
static int pool_blocks(msv_allocator *a, const char *what, uint64_t base, uint64_t block_bytes, entry **out,
                       uint64_t *nblocks) {
  entry *e = tab_find_containing(a, base, block_bytes);
  if (!e)
    return msv_fail(MSV_E_INVALID, "%s pool 0x%llx: no live allocation or host buffer holds one block there", what,
                    (unsigned long long)base);
  if (e->arena >= 0 && a->arenas[e->arena]->state != MSV_TAG_AWAKE)
    return msv_fail(MSV_E_STATE, "%s pool is in tag '%s', which is asleep", what, a->arenas[e->arena]->tag);
  *out = e;
  *nblocks = (e->addr + e->size - base) / block_bytes;
  return MSV_OK;
}

int msv_copy_block_ids(msv_allocator *a, uint64_t src_base, uint64_t dst_base, uint64_t block_bytes,
                       const int64_t *src_ids, const int64_t *dst_ids, size_t n, int method, uint64_t stream,
                       uint64_t *fence) {
  if (fence) *fence = 0;
  int rc = check_method(a, method, n);
  if (rc) return rc;
  if (block_bytes == 0) return msv_fail(MSV_E_INVALID, "block size must be > 0");
  if (n == 0) return MSV_OK;
  msv_copy_item *items = malloc(n * sizeof *items);
  if (!items) return msv_fail(MSV_E_OOM, "out of host memory for %zu copy items", n);
  double t0 = now_s();
  pthread_mutex_lock(&a->mu);
  entry *es = NULL, *ed = NULL;
  uint64_t ns = 0, nd = 0;
  uint8_t *dst_seen = NULL;
  rc = pool_blocks(a, "source", src_base, block_bytes, &es, &ns);
  if (!rc) rc = pool_blocks(a, "destination", dst_base, block_bytes, &ed, &nd);
  if (!rc && es == ed && src_base != dst_base)
    rc = msv_fail(MSV_E_INVALID, "source and destination pools overlap: use copy_blocks for this case");
  if (!rc && !(dst_seen = calloc((nd + 7) / 8, 1))) rc = msv_fail(MSV_E_OOM, "out of host memory");
  for (size_t i = 0; i < n && !rc; i++) {
    int64_t s = src_ids[i], d = dst_ids[i];
    if (s < 0 || (uint64_t)s >= ns)
      rc = msv_fail(MSV_E_INVALID, "item %zu: source block %lld is outside the pool of %llu blocks", i, (long long)s,
                    (unsigned long long)ns);
    else if (d < 0 || (uint64_t)d >= nd)
      rc = msv_fail(MSV_E_INVALID, "item %zu: destination block %lld is outside the pool of %llu blocks", i,
                    (long long)d, (unsigned long long)nd);
    else if (dst_seen[d / 8] & (1u << (d % 8)))
      rc = msv_fail(MSV_E_INVALID, "item %zu: destination block %lld appears twice", i, (long long)d);
    else {
      dst_seen[d / 8] |= (uint8_t)(1u << (d % 8));
      items[i] = (msv_copy_item){dst_base + (uint64_t)d * block_bytes, src_base + (uint64_t)s * block_bytes, block_bytes};
    }
  }
  /* one pool to itself: no block may be both a source and a destination */
  for (size_t i = 0; i < n && !rc && es == ed; i++)
    if (dst_seen[src_ids[i] / 8] & (1u << (src_ids[i] % 8)))
      rc = msv_fail(MSV_E_INVALID, "item %zu: block %lld is both a source and a destination", i, (long long)src_ids[i]);
  free(dst_seen);
  double t1 = now_s();
  if (!rc) rc = run_copy(a, items, n, method, stream, t1 - t0, fence);
  pthread_mutex_unlock(&a->mu);
  free(items);
  return rc;
}

int msv_fence_wait(msv_allocator *a, uint64_t fence) { return fence ? a->b->fence_wait(a->b, fence) : MSV_OK; }

void msv_fence_release(msv_allocator *a, uint64_t fence) {
  if (fence) a->b->fence_release(a->b, fence);
}

int msv_copies_wait(msv_allocator *a) { return a->b->sync(a->b, 0); }

int msv_new_stream(msv_allocator *a, uint64_t *out) { return a->b->new_stream(a->b, out); }
