/* memsvc native core: one C interface over two backends (cuda, host).
 *
 * Everything here is plain C with no Python: the allocation table, arenas, sleep/wake and the
 * batched copy live below the interpreter so torch's allocator hook (pluggable.c) never calls
 * back into Python, and so long copies run with the GIL released. */
#ifndef MSV_H
#define MSV_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* ---- errors: a code plus a thread-local message (and, for some, detail) ---- */
enum {
  MSV_OK = 0,
  MSV_E_INVALID = 1,     /* bad argument */
  MSV_E_NOT_FOUND = 2,   /* unknown tag / pointer */
  MSV_E_STATE = 3,       /* wrong state (sleep twice, alloc while asleep) */
  MSV_E_OOM = 4,         /* device or host memory exhausted */
  MSV_E_BUSY = 5,        /* a transition is already running */
  MSV_E_INTEGRITY = 6,   /* checksum mismatch */
  MSV_E_UNAVAILABLE = 7, /* backend/driver not usable here */
  MSV_E_BACKEND = 8,     /* driver or OS call failed */
};
int msv_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *msv_last_error(void);
int msv_last_error_code(void);
/* Which allocation an error is about, as data: the binding hands it to Python as the exception's
 * metadata, so callers act on it without parsing the message. */
typedef struct {
  char tag[64];
  uint64_t addr, size;
} msv_error_detail;
/* MSV_E_INTEGRITY about allocation [addr, +size) of `tag`: the message, plus the detail. */
int msv_fail_integrity(const char *tag, uint64_t addr, uint64_t size, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* The detail of the last error, or NULL when it has none (msv_fail clears it). */
const msv_error_detail *msv_last_error_detail(void);

/* ---- backends ---- */
enum { MSV_BACKEND_HOST = 0, MSV_BACKEND_CUDA = 1 };
enum { MSV_COPY_AUTO = 0, MSV_COPY_LOOP = 1, MSV_COPY_BATCH = 2, MSV_COPY_KERNEL = 3 };

/* One block copy; addresses are as the CPU/driver sees them (UVA on cuda). */
typedef struct {
  uint64_t dst, src, size;
} msv_copy_item;

/* One span to checksum: bytes [ptr, ptr+size) are words word_base.. of allocation `slot`. */
typedef struct {
  uint64_t ptr, size, word_base, slot;
} msv_sum_item;

typedef struct msv_backend msv_backend;
struct msv_backend {
  int kind;
  const char *name;
  int device;
  size_t granularity;
  /* virtual ranges */
  int (*reserve)(msv_backend *, size_t size, uint64_t *addr);
  int (*free_va)(msv_backend *, uint64_t addr, size_t size);
  /* physical memory: map [addr, addr+size) (fresh, contents undefined), or drop it keeping the range */
  int (*map)(msv_backend *, uint64_t addr, size_t size, uint64_t *handle);
  int (*unmap)(msv_backend *, uint64_t addr, size_t size, uint64_t handle);
  int (*mem_info)(msv_backend *, size_t *free_bytes, size_t *total_bytes);
  /* page-locked host memory: register already-faulted memory; returns the device alias of p */
  int (*host_register)(msv_backend *, void *p, size_t size, uint64_t *dev_alias);
  int (*host_unregister)(msv_backend *, void *p);
  /* copies: enqueue on `stream` (0 = the backend's own stream); sync waits for the stream */
  int (*copy)(msv_backend *, const msv_copy_item *items, size_t n, int method, uint64_t stream);
  int (*sync)(msv_backend *, uint64_t stream);
  /* wait for all work on the device, every stream (torch's too): before a freed tensor's memory is
   * unmapped, since kernels launched on it may still be running */
  int (*quiesce)(msv_backend *);
  /* fences: a mark on `stream` after the work enqueued so far (0 = nothing left to wait for);
   * fence_wait waits for it and frees it, fence_release frees it without waiting */
  int (*fence)(msv_backend *, uint64_t stream, uint64_t *out);
  int (*fence_wait)(msv_backend *, uint64_t fence);
  void (*fence_release)(msv_backend *, uint64_t fence);
  /* a stream of the caller's own (non-blocking, never destroyed; see msv_new_stream) */
  int (*new_stream)(msv_backend *, uint64_t *out);
  /* per-slot checksums of resident memory; out[slot] is summed into (caller zeroes it) */
  int (*checksum)(msv_backend *, const msv_sum_item *items, size_t n, uint64_t *out, size_t nslots);
  int (*has_method)(msv_backend *, int method);
  void (*destroy)(msv_backend *);
  void *impl;
};

int msv_backend_host_create(int device, size_t capacity, size_t granularity, msv_backend **out);
int msv_backend_cuda_create(int device, msv_backend **out);
int msv_cuda_available(int *device_count);

/* CPU checksum, shared by the host backend and tests: sum of mix(word_i ^ (i * golden)). */
uint64_t msv_checksum_cpu(const void *p, size_t size, uint64_t word_base);
/* Threaded memcpy for large host copies. */
void msv_memcpy_parallel(const msv_copy_item *items, size_t n);

/* ---- host staging memory (the offload engine's pinned chunks) ---- */
typedef struct msv_hchunk {
  char *ptr;
  size_t size;
  uint64_t dev_alias;
  int registered;
  struct msv_hchunk *next;
} msv_hchunk;

typedef struct {
  msv_backend *backend;
  pthread_mutex_t mu;
  msv_hchunk *free_list; /* registered chunks kept between cycles */
  size_t free_bytes;
  size_t reserve_bytes;  /* keep at most this many bytes of free chunks */
  size_t chunk_bytes;    /* size of a fresh chunk */
  size_t held_bytes;     /* all chunks, in use or free */
  int prefault_threads;
  int huge_pages; /* madvise(MADV_HUGEPAGE) fresh chunks */
  uint64_t chunks_created, chunks_reused;
  double register_seconds, prefault_seconds;
  /* the reaper unpins and unmaps chunks beyond the reserve off the caller's path */
  pthread_t reaper;
  pthread_cond_t cv;
  int reaper_started, reap_pending, stopping;
  int prepin_cancel; /* a running prepin stops before its next chunk */
} msv_hostpool;

int msv_hostpool_init(msv_hostpool *hp, msv_backend *b, size_t chunk_bytes, size_t reserve_bytes, int threads,
                      int huge_pages);
/* A registered chunk of at least min_size: a reused one, or a fresh one mapped and registered. */
int msv_hostpool_get(msv_hostpool *hp, size_t min_size, msv_hchunk **out);
/* The two halves, for pipelining: take (reuse, or map + pre-fault; maybe unregistered) then register. */
int msv_hostpool_take(msv_hostpool *hp, size_t min_size, msv_hchunk **out);
int msv_hostpool_register(msv_hostpool *hp, msv_hchunk *c);
void msv_hostpool_put(msv_hostpool *hp, msv_hchunk *c);
/* Have at least `bytes` of registered chunks free, in offload-sized chunks, and raise the reserve to
 * `bytes` so trimming keeps them. Stops early once the pool grew by `bytes` (a sleep beside it made
 * chunks too) or when cancelled; on failure keeps what it pinned. */
int msv_hostpool_prepin(msv_hostpool *hp, size_t bytes);
/* A running prepin stops before its next chunk (close does this). */
void msv_hostpool_prepin_cancel(msv_hostpool *hp);
void msv_hostpool_trim(msv_hostpool *hp);
/* Ask the reaper thread to trim (wake returns without waiting for cuMemHostUnregister). */
void msv_hostpool_trim_async(msv_hostpool *hp);
void msv_hostpool_destroy(msv_hostpool *hp);

/* ---- the allocator ---- */
/* The proto's TagAction numbers (protos/memsvc/v1/common.proto; 0 is unspecified, never valid).
 * msv_sleep_rule (sleep.c) is the one place that decides which codes exist and what each does. */
enum { MSV_ACTION_OFFLOAD = 1, MSV_ACTION_DISCARD = 2, MSV_ACTION_KEEP = 3, MSV_ACTION_OFFLOAD_DISK = 4 };
enum { MSV_ACTIONS = 5 };
/* ON_DISK: the tag's backup is in a file under the offload directory (disk.c), not in host memory. */
enum { MSV_TAG_AWAKE = 0, MSV_TAG_OFFLOADED = 1, MSV_TAG_DISCARDED = 2, MSV_TAG_ON_DISK = 3 };
enum { MSV_TAG_STATES = 4 };
/* The sleep rule: the state a tag in `state` is in after a sleep with `action`; the same state when
 * the sleep leaves it (KEEP); MSV_SLEEP_REFUSED when a sleep refuses (the tag is asleep already and
 * the action would not move it further down), or for a code that is no action. The Python side's
 * copy (memsvc/vocabulary.py's SLEEP_RULES, for the manager, which has no native layer) is held to
 * this one by a test. */
enum { MSV_SLEEP_REFUSED = -1 };
int msv_sleep_rule(int state, int action);

typedef struct {
  char tag[64];
  int state;
  uint64_t base;
  size_t mapped_bytes;     /* physical bytes mapped now */
  size_t layout_bytes;     /* bytes mapped while awake (restored on wake) */
  size_t allocated_bytes;  /* live allocation bytes */
  size_t offloaded_bytes;  /* bytes held in host backups (OFFLOADED) */
  size_t disk_bytes;       /* bytes held in the offload file (ON_DISK) */
  size_t discarded_bytes;  /* bytes dropped by the last DISCARD, while asleep */
  size_t n_allocs;
  size_t n_extents;
} msv_tag_stats;

typedef struct {
  uint64_t bytes_offloaded, bytes_restored, bytes_verified, sleeps, wakes;
  double last_sleep_seconds, last_wake_seconds;
  double last_sleep_unmap_seconds; /* of the last sleep: time inside the backend's unmap calls */
  double last_wake_map_seconds;    /* of the last wake: time inside the backend's map calls (overlaps its copies) */
  uint64_t host_chunks_created, host_chunks_reused;
  size_t host_held_bytes, host_reserve_bytes;
  double host_prefault_seconds, host_register_seconds;
  double last_copy_validate_seconds, last_copy_seconds; /* the last copy_blocks: checks, then copy+sync */
  uint64_t bytes_to_disk, bytes_from_disk; /* the disk tier: backups written, and read back on wake */
  size_t disk_held_bytes;                  /* file bytes held now by ON_DISK tags */
  double last_disk_write_seconds, last_disk_read_seconds;
} msv_counters;

typedef struct msv_allocator msv_allocator;

typedef struct {
  int backend;             /* MSV_BACKEND_* */
  int device;
  size_t host_capacity;    /* host backend: simulated device capacity */
  size_t granularity;      /* host backend: mapping granularity (cuda reads the driver's) */
  size_t arena_va_bytes;   /* virtual range reserved per tag */
  size_t host_chunk_bytes; /* offload engine chunk size */
  size_t host_reserve_bytes;
  int checksum;            /* checksum offloaded data at sleep, verify on wake */
  int prefault_threads;
  int no_huge_pages;       /* do not ask for transparent huge pages for host chunks */
  char offload_dir[4096];  /* the disk tier's directory; empty: no disk tier (OFFLOAD_DISK refused) */
} msv_config;

int msv_create(const msv_config *cfg, msv_allocator **out);
void msv_destroy(msv_allocator *a);
/* Reference counting: every tensor handed to torch holds one, so the allocator outlives them. */
void msv_retain(msv_allocator *a);
void msv_release(msv_allocator *a);
msv_backend *msv_get_backend(msv_allocator *a);

int msv_alloc(msv_allocator *a, const char *tag, size_t size, uint64_t *out);
int msv_free(msv_allocator *a, uint64_t addr);
/* actions[i] applies to tags[i]; tags not named are kept. Validates everything before moving a byte. */
int msv_sleep(msv_allocator *a, const char **tags, const int *actions, size_t n);
/* tags == NULL: every sleeping tag. */
int msv_wake(msv_allocator *a, const char **tags, size_t n);
/* nonblocking: fail with MSV_E_BUSY instead of waiting while a transition holds the table. */
int msv_tag_stats_all(msv_allocator *a, msv_tag_stats *out, size_t cap, size_t *n, int nonblocking);
int msv_get_counters(msv_allocator *a, msv_counters *out, int nonblocking);
int msv_set_checksum(msv_allocator *a, int on);
int msv_set_host_reserve(msv_allocator *a, size_t bytes);
/* Pre-pin host memory for the offload engine (msv_hostpool_prepin), so the first sleep skips mapping,
 * faulting and page-locking. Takes neither the table lock nor the transition lock: safe beside sleep,
 * wake and alloc. */
int msv_host_prepin(msv_allocator *a, size_t bytes);
void msv_host_prepin_cancel(msv_allocator *a);

/* Page-locked host buffers for callers (the host KV pool); valid copy_blocks endpoints. */
int msv_host_alloc(msv_allocator *a, size_t size, uint64_t *out);
int msv_host_free(msv_allocator *a, uint64_t addr);

/* Checkpoint staging (filestream.c): [offset, offset + length) of the file fd, read with `threads`
 * readers into device memory of its own (mapped for it, outside every tag and the allocation table),
 * so the model's weights can be copied from there device to device once torch is in. The caller
 * owns the result until msv_unstage, which waits for all device work and unmaps it. */
typedef struct {
  uint64_t addr, size, handle;
} msv_staged;
int msv_stage_file(msv_allocator *a, int fd, uint64_t offset, uint64_t length, int threads, msv_staged *out);
int msv_unstage(msv_allocator *a, const msv_staged *s);

/* Validated batched copy: every range must lie inside one live, resident allocation or host
 * buffer of this allocator; destinations must not overlap. Nothing moves if any item is bad. */
int msv_copy_blocks(msv_allocator *a, const uint64_t *src, const uint64_t *dst, const uint64_t *sizes, size_t n,
                    int method, uint64_t stream);

/* Block copy between two block-major pools: block i of a pool is [base + i*block_bytes, +block_bytes).
 * Ids are checked against each pool's bounds and destinations for duplicates with bitmaps, O(n); the
 * fast path of SwapBlocks. Nothing moves if any id is bad. With `fence` NULL it returns once the copy
 * is done; otherwise once it is enqueued, with *fence to wait on (msv_fence_wait, or drop it with
 * msv_fence_release): the caller overlaps its next request's work with this copy. */
int msv_copy_block_ids(msv_allocator *a, uint64_t src_base, uint64_t dst_base, uint64_t block_bytes,
                       const int64_t *src_ids, const int64_t *dst_ids, size_t n, int method, uint64_t stream,
                       uint64_t *fence);
/* Wait for a fence and free it (a fence of 0 is already done); each fence is waited or released once. */
int msv_fence_wait(msv_allocator *a, uint64_t fence);
void msv_fence_release(msv_allocator *a, uint64_t fence);
/* Wait for every copy enqueued on the allocator's own stream. */
int msv_copies_wait(msv_allocator *a);
/* A new device stream, shared with no one and never destroyed (MSV_E_UNAVAILABLE on the host backend).
 * For CUDA-graph captures: torch keys the cuBLAS workspace a capture embeds by its stream's handle and
 * frees it when any graph captured on that stream is destroyed, so graphs that must outlive others'
 * need a stream of their own, and a destroyed stream's handle could be given out again. */
int msv_new_stream(msv_allocator *a, uint64_t *out);

/* Find the live allocation holding [addr, addr+size): its base and tag; MSV_E_NOT_FOUND if none. */
int msv_lookup(msv_allocator *a, uint64_t addr, size_t size, uint64_t *base, char *tag, size_t tag_cap);

/* ---- the KV cache's block ownership (kvtable.c) ---- */
enum {
  MSV_KV_OK = 0,
  MSV_KV_SRC_RANGE = 1,  /* a source id outside its pool */
  MSV_KV_DST_RANGE = 2,  /* a destination id outside its pool */
  MSV_KV_SRC_TWICE = 3,  /* a source named twice */
  MSV_KV_DST_TWICE = 4,  /* a destination named twice */
  MSV_KV_DST_IN_USE = 5, /* a destination some sequence owns */
  MSV_KV_NO_MEMORY = 6,
};
/* Check a swap of src[i] -> dst[i] against the pools' sizes and the destination pool's owner array
 * (slot per block, < 0 when free). Returns MSV_KV_OK or the first problem, with its index in *bad. */
int msv_kv_check(const int64_t *src, const int64_t *dst, size_t n, int64_t n_src, int64_t n_dst,
                 const int64_t *owner_dst, size_t *bad);
/* After a checked swap's copy: each owned source's slot moves to its destination (owner arrays and
 * the slot's block and pool); *moved counts them. MSV_E_INVALID, changing nothing, if any index lies
 * outside its array. */
int msv_kv_move(const int64_t *src, const int64_t *dst, size_t n, int64_t *owner_src, size_t n_owner_src,
                int64_t *owner_dst, size_t n_owner_dst, int64_t *slot_block, uint8_t *slot_host, size_t n_slots,
                int to_host, size_t *moved);

/* torch hook (pluggable.c) */
void msv_hook_install(msv_allocator *a);
void msv_hook_set_tag(const char *tag);

#endif
