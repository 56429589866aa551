/* The allocation table: every live pool allocation and host buffer of an allocator, as one array
 * sorted by address. Finding the row that holds a pointer (free, lookup, and both ends of every
 * copy item) is a binary search; the caller holds the allocator's mutex. */
#include <string.h>

#include "allocator_internal.h"

static size_t tab_lower(msv_allocator *a, uint64_t addr) { /* first index with tab[i].addr >= addr */
  size_t lo = 0, hi = a->n_tab;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (a->tab[mid].addr < addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

entry *tab_find_exact(msv_allocator *a, uint64_t addr) {
  size_t i = tab_lower(a, addr);
  return i < a->n_tab && a->tab[i].addr == addr ? &a->tab[i] : NULL;
}

entry *tab_find_containing(msv_allocator *a, uint64_t addr, uint64_t size) {
  size_t i = tab_lower(a, addr + 1);
  if (i == 0) return NULL;
  entry *e = &a->tab[i - 1];
  if (addr < e->addr || size > e->size || addr - e->addr > e->size - size) return NULL;
  return e;
}

int tab_insert(msv_allocator *a, entry e) {
  int rc = grow((void **)&a->tab, &a->cap_tab, a->n_tab + 1, sizeof(entry));
  if (rc) return rc;
  size_t i = tab_lower(a, e.addr);
  memmove(&a->tab[i + 1], &a->tab[i], (a->n_tab - i) * sizeof(entry));
  a->tab[i] = e;
  a->n_tab++;
  return MSV_OK;
}

void tab_remove(msv_allocator *a, entry *e) {
  size_t i = (size_t)(e - a->tab);
  memmove(&a->tab[i], &a->tab[i + 1], (a->n_tab - i - 1) * sizeof(entry));
  a->n_tab--;
}
