/* The allocation table and per-tag arenas.
 *
 * Each tag owns one reserved virtual range. Physical memory is mapped into it as extents that grow
 * with the arena (at least 1/128 of what is mapped, so small tags cost 2 MiB and large ones waste
 * under 1%), and allocations are carved from it first-fit at 256-byte alignment: small tensors
 * never cost a 2 MiB mapping each. Sleep drops every extent of a tag (after copying live bytes to
 * host for OFFLOAD); wake maps the same range again in a few large extents, so each address
 * comes back unchanged.
 *
 * One mutex guards the table. Transitions hold it for their whole run, so no allocation, free or
 * block copy can observe a half-slept tag; a second transition fails fast with MSV_E_BUSY. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "msv.h"

#define ALIGN 256ull

typedef struct {
  uint64_t off, size, handle;
  int mapped;
} extent;

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
  msv_copy_item *pieces; /* dst = host, src = device */
  size_t n_pieces, offloaded;
} arena;

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

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return MSV_OK;
  size_t nc = *cap ? *cap * 2 : 16;
  while (nc < need) nc *= 2;
  void *q = realloc(*p, nc * elem);
  if (!q) return msv_fail(MSV_E_OOM, "out of host memory for allocator bookkeeping");
  *p = q;
  *cap = nc;
  return MSV_OK;
}

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* ---- table ---- */
static size_t tab_lower(msv_allocator *a, uint64_t addr) { /* first index with tab[i].addr >= addr */
  size_t lo = 0, hi = a->n_tab;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (a->tab[mid].addr < addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static entry *tab_find_exact(msv_allocator *a, uint64_t addr) {
  size_t i = tab_lower(a, addr);
  return i < a->n_tab && a->tab[i].addr == addr ? &a->tab[i] : NULL;
}

static entry *tab_find_containing(msv_allocator *a, uint64_t addr, uint64_t size) {
  size_t i = tab_lower(a, addr + 1);
  if (i == 0) return NULL;
  entry *e = &a->tab[i - 1];
  if (addr < e->addr || size > e->size || addr - e->addr > e->size - size) return NULL;
  return e;
}

static int tab_insert(msv_allocator *a, entry e) {
  int rc = grow((void **)&a->tab, &a->cap_tab, a->n_tab + 1, sizeof(entry));
  if (rc) return rc;
  size_t i = tab_lower(a, e.addr);
  memmove(&a->tab[i + 1], &a->tab[i], (a->n_tab - i) * sizeof(entry));
  a->tab[i] = e;
  a->n_tab++;
  return MSV_OK;
}

static void tab_remove(msv_allocator *a, entry *e) {
  size_t i = (size_t)(e - a->tab);
  memmove(&a->tab[i], &a->tab[i + 1], (a->n_tab - i - 1) * sizeof(entry));
  a->n_tab--;
}

/* ---- arenas ---- */
static int find_arena(msv_allocator *a, const char *tag) {
  for (size_t i = 0; i < a->n_arenas; i++)
    if (strcmp(a->arenas[i]->tag, tag) == 0) return (int)i;
  return -1;
}

static int check_tag(const char *tag) {
  size_t n = strlen(tag);
  if (n == 0 || n >= 64) return msv_fail(MSV_E_INVALID, "tag must be 1 to 63 bytes long, got %zu", n);
  return MSV_OK;
}

static int get_arena(msv_allocator *a, const char *tag, int *idx, int *created) {
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

static int free_insert(arena *ar, uint64_t off, uint64_t size) {
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

static size_t mapped_bytes(const arena *ar) {
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

/* Drop trailing extents that hold no allocation, returning their memory to the device. */
static void trim_tail(msv_allocator *a, arena *ar) {
  int synced = 0;
  while (ar->n_ext && ar->n_fr) {
    extent *x = &ar->ext[ar->n_ext - 1];
    frange *f = &ar->fr[ar->n_fr - 1];
    if (!x->mapped || f->off + f->size != ar->frontier || f->off > x->off) return;
    /* a copy enqueued without waiting (copy_block_ids) may still touch the freed range */
    if (!synced && a->b->sync(a->b, 0)) return;
    synced = 1;
    if (a->b->unmap(a->b, ar->base + x->off, x->size, x->handle)) return;
    ar->frontier = x->off;
    ar->n_ext--;
    f->size = x->off - f->off;
    if (f->size == 0) ar->n_fr--;
  }
}

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

static void clear_sums(msv_allocator *a, arena *ar) {
  for (size_t t = 0; t < a->n_tab; t++)
    if (a->tab[t].arena >= 0 && a->arenas[a->tab[t].arena] == ar) a->tab[t].has_sum = 0;
}

/* The host copy of a tag goes away (restored, demoted, or a failed sleep): so do its checksums,
 * which describe only that copy. */
static void drop_backup(msv_allocator *a, arena *ar) {
  clear_sums(a, ar);
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

void msv_retain(msv_allocator *a) { __atomic_add_fetch(&a->refs, 1, __ATOMIC_ACQ_REL); }

void msv_release(msv_allocator *a) {
  if (a && __atomic_sub_fetch(&a->refs, 1, __ATOMIC_ACQ_REL) == 0) msv_destroy(a);
}

void msv_destroy(msv_allocator *a) {
  if (!a) return;
  a->b->sync(a->b, 0); /* copies still in flight (unwaited or dropped fences) end before memory goes */
  for (size_t i = 0; i < a->n_tab; i++)
    if (a->tab[i].chunk) msv_hostpool_put(&a->hp, a->tab[i].chunk);
  for (size_t i = 0; i < a->n_arenas; i++) {
    arena *ar = a->arenas[i];
    drop_backup(a, ar);
    for (size_t k = 0; k < ar->n_ext; k++)
      if (ar->ext[k].mapped) a->b->unmap(a->b, ar->base + ar->ext[k].off, ar->ext[k].size, ar->ext[k].handle);
    a->b->free_va(a->b, ar->base, ar->va_size);
    free(ar->ext), free(ar->fr), free(ar);
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
    rc = extend(a, ar, len);
    if (rc) goto out;
    if (start < ar->frontier - len) ar->n_fr--; /* the tail range is consumed */
    off = start;
    if (off + rsize < ar->frontier) {
      rc = free_insert(ar, off + rsize, ar->frontier - off - rsize);
      if (rc) goto out;
    }
  }
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
    arena *dead = a->arenas[idx];
    for (size_t k = 0; k < dead->n_ext; k++) a->b->unmap(a->b, dead->base + dead->ext[k].off, dead->ext[k].size, dead->ext[k].handle);
    a->b->free_va(a->b, dead->base, dead->va_size);
    free(dead->ext), free(dead->fr), free(dead);
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

/* ---- checksums ---- */
static int checksum_arena(msv_allocator *a, int idx, uint64_t **sums_out, size_t *n_out) {
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

/* ---- the offload pipeline ----
 * Three stages run at once: a faulting thread maps and pre-faults chunk i+2, a pinning thread
 * registers chunk i+1, and the caller copies into chunk i. Chunks reused from the pool skip both. */
typedef struct {
  msv_hostpool *hp;
  size_t nchunks, chunk_bytes, total;
  msv_hchunk **staged, **ready;
  size_t n_staged, n_ready;
  int failed, stop;
  int err_code;
  char err[512];
  pthread_mutex_t mu;
  pthread_cond_t cv;
} producer;

static void producer_fail(producer *p, int rc) {
  pthread_mutex_lock(&p->mu);
  if (!p->failed) {
    p->failed = 1;
    p->err_code = rc;
    snprintf(p->err, sizeof p->err, "%s", msv_last_error());
  }
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
}

static void *fault_stage(void *arg) {
  producer *p = (producer *)arg;
  for (size_t i = 0; i < p->nchunks; i++) {
    pthread_mutex_lock(&p->mu);
    int stop = p->stop || p->failed;
    pthread_mutex_unlock(&p->mu);
    if (stop) break;
    size_t want = p->total - i * p->chunk_bytes < p->chunk_bytes ? p->total - i * p->chunk_bytes : p->chunk_bytes;
    msv_hchunk *c = NULL;
    int rc = msv_hostpool_take(p->hp, want, &c);
    if (rc) {
      producer_fail(p, rc);
      break;
    }
    pthread_mutex_lock(&p->mu);
    p->staged[p->n_staged++] = c;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
  }
  return NULL;
}

static void *pin_stage(void *arg) {
  producer *p = (producer *)arg;
  for (size_t i = 0; i < p->nchunks; i++) {
    pthread_mutex_lock(&p->mu);
    while (p->n_staged <= i && !p->failed && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
    msv_hchunk *c = p->n_staged > i ? p->staged[i] : NULL;
    pthread_mutex_unlock(&p->mu);
    if (!c) break;
    int rc = c->registered ? MSV_OK : msv_hostpool_register(p->hp, c);
    pthread_mutex_lock(&p->mu);
    if (rc) {
      p->staged[i] = NULL; /* freed by msv_hostpool_register */
      pthread_mutex_unlock(&p->mu);
      producer_fail(p, rc);
      break;
    }
    p->ready[p->n_ready++] = c;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
  }
  return NULL;
}

static void *produce(void *arg) { /* both stages on one thread: the fallback when threads fail */
  producer *p = (producer *)arg;
  fault_stage(p);
  pin_stage(p);
  return NULL;
}

/* Copy every live byte of arena `idx` to host chunks. On failure nothing is kept. */
static int offload_arena(msv_allocator *a, int idx) {
  arena *ar = a->arenas[idx];
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
  if (total == 0) {
    free(runs);
    return MSV_OK;
  }
  producer p;
  memset(&p, 0, sizeof p);
  p.hp = &a->hp;
  p.chunk_bytes = a->hp.chunk_bytes;
  p.total = total;
  p.nchunks = (total + p.chunk_bytes - 1) / p.chunk_bytes;
  p.ready = calloc(p.nchunks, sizeof *p.ready);
  p.staged = calloc(p.nchunks, sizeof *p.staged);
  msv_copy_item *pieces = malloc((n_runs + p.nchunks) * sizeof *pieces);
  if (!p.ready || !p.staged || !pieces) {
    free(p.ready), free(p.staged), free(pieces), free(runs);
    return msv_fail(MSV_E_OOM, "out of host memory");
  }
  pthread_mutex_init(&p.mu, NULL);
  pthread_cond_init(&p.cv, NULL);
  pthread_t fault_tid, pin_tid;
  int faulting = pthread_create(&fault_tid, NULL, fault_stage, &p) == 0;
  int pinning = faulting && pthread_create(&pin_tid, NULL, pin_stage, &p) == 0;
  if (!faulting) produce(&p);
  else if (!pinning) pin_stage(&p);

  size_t n_pieces = 0, run = 0;
  uint64_t run_off = 0;
  int rc = MSV_OK;
  for (size_t ci = 0; ci < p.nchunks && !rc; ci++) {
    pthread_mutex_lock(&p.mu);
    while (p.n_ready <= ci && !p.failed) pthread_cond_wait(&p.cv, &p.mu);
    if (p.n_ready <= ci) rc = msv_fail(p.err_code, "%s", p.err);
    pthread_mutex_unlock(&p.mu);
    if (rc) break;
    msv_hchunk *c = p.ready[ci];
    uint64_t room = total - ci * p.chunk_bytes < p.chunk_bytes ? total - ci * p.chunk_bytes : p.chunk_bytes;
    uint64_t used = 0;
    size_t first = n_pieces;
    while (used < room && run < n_runs) {
      uint64_t left = runs[run].size - run_off, take = left < room - used ? left : room - used;
      pieces[n_pieces++] = (msv_copy_item){(uint64_t)(uintptr_t)(c->ptr + used), runs[run].src + run_off, take};
      used += take;
      run_off += take;
      if (run_off == runs[run].size) run++, run_off = 0;
    }
    rc = a->b->copy(a->b, &pieces[first], n_pieces - first, MSV_COPY_LOOP, 0);
  }
  if (!rc) rc = a->b->sync(a->b, 0);
  else a->b->sync(a->b, 0);
  pthread_mutex_lock(&p.mu);
  p.stop = 1;
  pthread_cond_broadcast(&p.cv);
  pthread_mutex_unlock(&p.mu);
  if (faulting) pthread_join(fault_tid, NULL);
  if (pinning) pthread_join(pin_tid, NULL);
  /* chain the chunks (in order) onto the arena, or give them all back on failure */
  for (size_t i = p.n_ready; i-- > 0;) {
    if (rc) {
      msv_hostpool_put(&a->hp, p.ready[i]);
    } else {
      p.ready[i]->next = ar->chunks;
      ar->chunks = p.ready[i];
    }
  }
  for (size_t i = p.n_ready; i < p.n_staged; i++) /* faulted but never pinned (a failure upstream) */
    if (p.staged[i]) msv_hostpool_put(&a->hp, p.staged[i]);
  pthread_mutex_destroy(&p.mu);
  pthread_cond_destroy(&p.cv);
  free(p.ready), free(p.staged), free(runs);
  if (rc) {
    free(pieces);
    return rc;
  }
  ar->pieces = pieces;
  ar->n_pieces = n_pieces;
  ar->offloaded = data; /* bytes of tensor data; the copy also carries alignment padding */
  return MSV_OK;
}

static int unmap_all(msv_allocator *a, arena *ar) {
  for (size_t k = 0; k < ar->n_ext; k++) {
    extent *x = &ar->ext[k];
    if (!x->mapped) continue;
    int rc = a->b->unmap(a->b, ar->base + x->off, x->size, x->handle);
    if (rc) return rc;
    x->mapped = 0;
  }
  return MSV_OK;
}

/* The parts of a tag's host backup that land in extent x, as copy items (dst = device), cut at the
 * extent's edges: a piece that straddles two extents is copied in two parts, each once its extent
 * is mapped. Extents cover [0, frontier) with no gaps, so nothing past the frontier (a tail freed
 * while the tag slept) is ever copied. *pi is the first piece not wholly below x; pieces and extents
 * are both in address order, so the walk over a whole tag costs O(pieces + extents). Returns the
 * number of items written to out (at most one per piece). */
static size_t backup_in_extent(const arena *ar, const extent *x, size_t *pi, msv_copy_item *out) {
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

/* ---- sleep ---- */
int msv_sleep(msv_allocator *a, const char **tags, const int *actions, size_t n) {
  if (pthread_mutex_trylock(&a->transition) != 0) return msv_fail(MSV_E_BUSY, "a sleep or wake is already running");
  pthread_mutex_lock(&a->mu);
  double t0 = now_s();
  int rc = MSV_OK, *idx = calloc(n ? n : 1, sizeof *idx);
  uint64_t **sums = calloc(n ? n : 1, sizeof *sums);
  if (!idx || !sums) {
    rc = msv_fail(MSV_E_OOM, "out of host memory");
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    if ((rc = check_tag(tags[i]))) goto out;
    if (actions[i] < MSV_ACTION_KEEP || actions[i] > MSV_ACTION_DISCARD) {
      rc = msv_fail(MSV_E_INVALID, "tag '%s': unknown action %d", tags[i], actions[i]);
      goto out;
    }
    idx[i] = find_arena(a, tags[i]);
    if (idx[i] < 0) {
      rc = msv_fail(MSV_E_NOT_FOUND, "unknown tag '%s': nothing was ever allocated under it", tags[i]);
      goto out;
    }
    for (size_t j = 0; j < i; j++)
      if (idx[j] == idx[i]) {
        rc = msv_fail(MSV_E_INVALID, "tag '%s' named twice", tags[i]);
        goto out;
      }
    /* An offloaded tag may be demoted to DISCARD (level 1 -> level 2: frees its host copy). */
    int st = a->arenas[idx[i]]->state;
    int demote = st == MSV_TAG_OFFLOADED && actions[i] == MSV_ACTION_DISCARD;
    if (actions[i] != MSV_ACTION_KEEP && st != MSV_TAG_AWAKE && !demote) {
      rc = msv_fail(MSV_E_STATE, "tag '%s' is already asleep", tags[i]);
      goto out;
    }
  }
  /* Phase 1: copy out everything to keep (device memory untouched until all copies succeed). */
  for (size_t i = 0; i < n && !rc; i++) {
    if (actions[i] != MSV_ACTION_OFFLOAD) continue;
    size_t ns = 0;
    if (a->cfg.checksum && (rc = checksum_arena(a, idx[i], &sums[i], &ns))) break;
    rc = offload_arena(a, idx[i]);
  }
  /* No copy on the allocator's stream may still touch what phase 2 drops: the offloads above waited
   * for their own, but a block copy enqueued without waiting may be in flight (alone, for a sleep
   * that only discards). */
  if (!rc) rc = a->b->sync(a->b, 0);
  if (rc) {
    for (size_t i = 0; i < n; i++)
      if (actions[i] == MSV_ACTION_OFFLOAD) drop_backup(a, a->arenas[idx[i]]);
    msv_hostpool_trim(&a->hp);
    goto out;
  }
  /* Phase 2: drop the physical memory (or, for a demotion, the host copy). */
  double unmap_seconds = 0;
  for (size_t i = 0; i < n; i++) {
    if (actions[i] == MSV_ACTION_KEEP) continue;
    arena *ar = a->arenas[idx[i]];
    if (ar->state == MSV_TAG_OFFLOADED) {
      drop_backup(a, ar);
      ar->state = MSV_TAG_DISCARDED;
      ar->discarded = ar->allocated;
      continue;
    }
    double tu = now_s();
    int urc = unmap_all(a, ar);
    unmap_seconds += now_s() - tu;
    if (urc && !rc) rc = urc;
    /* Nothing dropped: the tag stays awake (its backup is released below). Anything dropped: it
     * is asleep, and wake maps back exactly the extents that are gone. */
    if (urc && mapped_bytes(ar) == ar->frontier) continue;
    ar->state = actions[i] == MSV_ACTION_OFFLOAD ? MSV_TAG_OFFLOADED : MSV_TAG_DISCARDED;
    ar->discarded = actions[i] == MSV_ACTION_DISCARD ? ar->allocated : 0;
    if (actions[i] == MSV_ACTION_OFFLOAD) {
      a->ctr.bytes_offloaded += ar->offloaded;
      if (sums[i]) {
        size_t k = 0;
        for (size_t t = 0; t < a->n_tab; t++)
          if (a->tab[t].arena == idx[i]) a->tab[t].sum = sums[i][k++], a->tab[t].has_sum = 1;
      }
    }
  }
  for (size_t i = 0; i < n; i++) {
    arena *ar = a->arenas[idx[i]];
    if (actions[i] == MSV_ACTION_OFFLOAD && ar->state == MSV_TAG_AWAKE) drop_backup(a, ar);
  }
  msv_hostpool_trim_async(&a->hp);
  a->ctr.sleeps++;
  a->ctr.last_sleep_seconds = now_s() - t0;
  a->ctr.last_sleep_unmap_seconds = unmap_seconds;
out:
  if (sums)
    for (size_t i = 0; i < n; i++) free(sums[i]);
  free(sums), free(idx);
  pthread_mutex_unlock(&a->mu);
  pthread_mutex_unlock(&a->transition);
  return rc;
}

/* ---- wake ---- */
int msv_wake(msv_allocator *a, const char **tags, size_t n) {
  if (pthread_mutex_trylock(&a->transition) != 0) return msv_fail(MSV_E_BUSY, "a sleep or wake is already running");
  pthread_mutex_lock(&a->mu);
  double t0 = now_s();
  int rc = MSV_OK;
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
  if (rc) { /* a map or a copy failed: the backups are intact, so put the tags back to sleep */
    rc = back_to_sleep(a, idx, k, rc);
    goto out;
  }
  /* Phase 3: verify, then release backups. */
  for (size_t q = 0; q < k; q++) {
    arena *ar = a->arenas[idx[q]];
    int was_offloaded = ar->state == MSV_TAG_OFFLOADED;
    int any_sum = 0;
    for (size_t t = 0; t < a->n_tab; t++) any_sum |= a->tab[t].arena == idx[q] && a->tab[t].has_sum;
    if (was_offloaded && any_sum && !rc) { /* verify what was summed at sleep, even if checksums are off now */
      uint64_t *sums = NULL;
      size_t ns = 0;
      int crc = checksum_arena(a, idx[q], &sums, &ns);
      if (crc) rc = crc;
      size_t s = 0;
      for (size_t t = 0; !crc && t < a->n_tab; t++) {
        entry *e = &a->tab[t];
        if (e->arena != idx[q]) continue;
        if (!e->has_sum) {
          s++;
          continue;
        }
        e->has_sum = 0;
        if (sums[s] != e->sum && !rc)
          rc = msv_fail(MSV_E_INTEGRITY,
                        "tag '%s': allocation 0x%llx (%llu bytes) failed its checksum on wake (0x%016llx != 0x%016llx)",
                        ar->tag, (unsigned long long)e->addr, (unsigned long long)e->size,
                        (unsigned long long)sums[s], (unsigned long long)e->sum);
        else if (sums[s] == e->sum)
          a->ctr.bytes_verified += e->size;
        s++;
      }
      free(sums);
    }
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
  pthread_mutex_unlock(&a->mu);
  pthread_mutex_unlock(&a->transition);
  return rc;
}

/* ---- stats ---- */
int msv_tag_stats_all(msv_allocator *a, msv_tag_stats *out, size_t cap, size_t *n, int nonblocking) {
  if (nonblocking) {
    if (pthread_mutex_trylock(&a->mu) != 0) return msv_fail(MSV_E_BUSY, "the allocator is busy with a transition");
  } else {
    pthread_mutex_lock(&a->mu);
  }
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
    s->offloaded_bytes = ar->offloaded;
    s->discarded_bytes = ar->discarded;
    s->n_allocs = ar->n_allocs;
    s->n_extents = ar->n_ext;
  }
  pthread_mutex_unlock(&a->mu);
  return MSV_OK;
}

int msv_get_counters(msv_allocator *a, msv_counters *out, int nonblocking) {
  if (nonblocking) {
    if (pthread_mutex_trylock(&a->mu) != 0) return msv_fail(MSV_E_BUSY, "the allocator is busy with a transition");
  } else {
    pthread_mutex_lock(&a->mu);
  }
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

/* ---- validated batched copy ---- */
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
