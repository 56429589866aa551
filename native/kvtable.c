/* The KV cache's block ownership, checked and moved in C.
 *
 * worker/model/kv_cache.py keeps, per pool, an owner array (block -> table slot, -1 when free) and,
 * per slot, the block it names and whether that block is in the host pool. A SwapBlocks of 8192
 * blocks is then one pass here before the copy (ids in range, no source or destination twice, every
 * destination free) and one pass after it (each owned source's slot moves to its destination),
 * instead of a dozen numpy passes and their temporaries: on the H200 host those cost a third of the
 * copy itself. No allocator state is touched; the caller holds the cache's lock. */
#include <stdlib.h>

#include "msv.h"

int msv_kv_check(const int64_t *src, const int64_t *dst, size_t n, int64_t n_src, int64_t n_dst,
                 const int64_t *owner_dst, size_t *bad) {
  uint8_t *seen_src = calloc((size_t)(n_src > 0 ? n_src : 1) / 8 + 1, 1);
  uint8_t *seen_dst = calloc((size_t)(n_dst > 0 ? n_dst : 1) / 8 + 1, 1);
  int code = MSV_KV_OK;
  if (!seen_src || !seen_dst) code = MSV_KV_NO_MEMORY;
  for (size_t i = 0; i < n && code == MSV_KV_OK; i++) {
    int64_t s = src[i], d = dst[i];
    if (s < 0 || s >= n_src) code = MSV_KV_SRC_RANGE;
    else if (d < 0 || d >= n_dst) code = MSV_KV_DST_RANGE;
    else if (seen_src[s >> 3] & (1u << (s & 7))) code = MSV_KV_SRC_TWICE;
    else if (seen_dst[d >> 3] & (1u << (d & 7))) code = MSV_KV_DST_TWICE;
    else if (owner_dst[d] >= 0) code = MSV_KV_DST_IN_USE;
    if (code != MSV_KV_OK) {
      *bad = i;
      break;
    }
    seen_src[s >> 3] |= (uint8_t)(1u << (s & 7));
    seen_dst[d >> 3] |= (uint8_t)(1u << (d & 7));
  }
  free(seen_src), free(seen_dst);
  return code;
}

int msv_kv_move(const int64_t *src, const int64_t *dst, size_t n, int64_t *owner_src, size_t n_owner_src,
                int64_t *owner_dst, size_t n_owner_dst, int64_t *slot_block, uint8_t *slot_host, size_t n_slots,
                int to_host, size_t *moved) {
  *moved = 0;
  /* The caller checked the ids; an index out of any array would still be a bug that corrupts memory,
   * so every one is bounds-checked before anything changes. */
  for (size_t i = 0; i < n; i++) {
    if (src[i] < 0 || (uint64_t)src[i] >= n_owner_src || dst[i] < 0 || (uint64_t)dst[i] >= n_owner_dst)
      return msv_fail(MSV_E_INVALID, "kv move: pair %zu names a block outside its owner array", i);
    int64_t slot = owner_src[src[i]];
    if (slot >= 0 && (uint64_t)slot >= n_slots)
      return msv_fail(MSV_E_INVALID, "kv move: block %lld has slot %lld, outside the table", (long long)src[i],
                      (long long)slot);
  }
  /* The second pass checks every index again: these arrays are the caller's, and a thread that
   * changed one between the passes must cost an error, never a write out of bounds. */
  for (size_t i = 0; i < n; i++) {
    int64_t s = src[i], d = dst[i];
    if (s < 0 || (uint64_t)s >= n_owner_src || d < 0 || (uint64_t)d >= n_owner_dst)
      return msv_fail(MSV_E_INVALID, "kv move: pair %zu changed while it was being moved", i);
    int64_t slot = owner_src[s];
    if (slot >= 0 && (uint64_t)slot >= n_slots)
      return msv_fail(MSV_E_INVALID, "kv move: block %lld changed while it was being moved", (long long)s);
    if (slot < 0) continue; /* a free block: its bytes moved, nothing owns them */
    owner_src[s] = -1;
    owner_dst[d] = slot;
    slot_block[slot] = d;
    slot_host[slot] = (uint8_t)(to_host != 0);
    ++*moved;
  }
  return MSV_OK;
}
