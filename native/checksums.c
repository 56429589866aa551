/* Per-allocation checksums of a tag's host backup.
 *
 * With checksums on, sleep sums every allocation of an OFFLOAD tag before copying it out; wake sums
 * it again once restored and compares, so a corrupted host copy fails the wake with the allocation
 * named (MSV_E_INTEGRITY, with tag, address and size as error detail) instead of going unnoticed. A
 * sum describes only the copy it was taken for: it is checked once, and cleared whenever that copy
 * goes. The caller holds the allocator's mutex. */
#include "allocator_internal.h"

/* The sums of arena `idx`'s allocations, in table order (one per row of the arena). */
int checksum_arena(msv_allocator *a, int idx, uint64_t **sums_out, size_t *n_out) {
  size_t n = 0;
  for (size_t i = 0; i < a->n_tab; i++)
    if (a->tab[i].arena == idx) n++;
  msv_sum_item *items = malloc((n ? n : 1) * sizeof *items);
  uint64_t *sums = calloc(n ? n : 1, sizeof *sums);
  if (!items || !sums) {
    free(items), free(sums);
    return msv_fail(MSV_E_OOM, "out of host memory for checksums");
  }
  size_t k = 0;
  for (size_t i = 0; i < a->n_tab; i++)
    if (a->tab[i].arena == idx) items[k] = (msv_sum_item){a->tab[i].addr, a->tab[i].size, 0, k}, k++;
  int rc = a->b->checksum(a->b, items, n, sums, n);
  free(items);
  if (rc) {
    free(sums);
    return rc;
  }
  *sums_out = sums;
  *n_out = n;
  return MSV_OK;
}

/* The sleep that took `sums` dropped the tag: they now describe its backup, to be checked on wake. */
void keep_sums(msv_allocator *a, int idx, const uint64_t *sums) {
  size_t k = 0;
  for (size_t t = 0; t < a->n_tab; t++)
    if (a->tab[t].arena == idx) a->tab[t].sum = sums[k++], a->tab[t].has_sum = 1;
}

/* After a wake restored arena `idx`: check what was summed at sleep (even if checksums are off now).
 * Every kept sum is used up; the first mismatch is the error, and matching bytes count as verified. */
int verify_sums(msv_allocator *a, int idx) {
  int any_sum = 0;
  for (size_t t = 0; t < a->n_tab; t++) any_sum |= a->tab[t].arena == idx && a->tab[t].has_sum;
  if (!any_sum) return MSV_OK;
  const char *tag = a->arenas[idx]->tag;
  uint64_t *sums = NULL;
  size_t ns = 0;
  int rc = checksum_arena(a, idx, &sums, &ns);
  if (rc) return rc;
  size_t s = 0;
  for (size_t t = 0; t < a->n_tab; t++) {
    entry *e = &a->tab[t];
    if (e->arena != idx) continue;
    if (!e->has_sum) {
      s++;
      continue;
    }
    e->has_sum = 0;
    if (sums[s] != e->sum && !rc)
      rc = msv_fail_integrity(tag, e->addr, e->size,
                              "tag '%s': allocation 0x%llx (%llu bytes) failed its checksum on wake "
                              "(0x%016llx != 0x%016llx)",
                              tag, (unsigned long long)e->addr, (unsigned long long)e->size,
                              (unsigned long long)sums[s], (unsigned long long)e->sum);
    else if (sums[s] == e->sum)
      a->ctr.bytes_verified += e->size;
    s++;
  }
  free(sums);
  return rc;
}

void clear_sums(msv_allocator *a, arena *ar) {
  for (size_t t = 0; t < a->n_tab; t++)
    if (a->tab[t].arena >= 0 && a->arenas[a->tab[t].arena] == ar) a->tab[t].has_sum = 0;
}
