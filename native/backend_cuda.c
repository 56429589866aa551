/* The cuda backend: CUDA virtual memory management on the device's primary context.
 *
 * Why the VMM API and not cudaMalloc: cuMemAddressReserve gives a virtual range we own, and
 * cuMemUnmap + cuMemRelease drop the physical pages while the range (and every tensor address in
 * it) stays valid, so a woken model needs no pointer fix-ups and captured CUDA graphs still replay.
 *
 * Why dlopen + cuGetProcAddress: the extension must build and import on machines with no driver,
 * and it must not pin a CUDA runtime version. Each entry point is asked for at an explicit API
 * version, so a newer driver never hands us an ABI-changed symbol (cuMemcpyBatchAsync lost its
 * failIdx argument in 13.0). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_driver.h"
#include "msv.h"

#ifdef MSV_HAVE_KERNELS
#include "kernels_fatbin.h"
#endif

/* ---- the driver, loaded once per process ---- */
static struct {
  int loaded, version;
  char error[256];
  PFN_cuInit Init;
  PFN_cuDriverGetVersion DriverGetVersion;
  PFN_cuGetErrorString GetErrorString;
  PFN_cuDeviceGet DeviceGet;
  PFN_cuDeviceGetCount DeviceGetCount;
  PFN_cuDeviceGetAttribute DeviceGetAttribute;
  PFN_cuDevicePrimaryCtxRetain PrimaryCtxRetain;
  PFN_cuDevicePrimaryCtxRelease PrimaryCtxRelease;
  PFN_cuCtxSetCurrent CtxSetCurrent;
  PFN_cuMemGetInfo MemGetInfo;
  PFN_cuMemAddressReserve MemAddressReserve;
  PFN_cuMemAddressFree MemAddressFree;
  PFN_cuMemCreate MemCreate;
  PFN_cuMemRelease MemRelease;
  PFN_cuMemMap MemMap;
  PFN_cuMemUnmap MemUnmap;
  PFN_cuMemSetAccess MemSetAccess;
  PFN_cuMemGetAllocationGranularity MemGetAllocationGranularity;
  PFN_cuMemHostRegister MemHostRegister;
  PFN_cuMemHostUnregister MemHostUnregister;
  PFN_cuMemHostGetDevicePointer MemHostGetDevicePointer;
  PFN_cuMemAlloc MemAlloc;
  PFN_cuMemFree MemFree;
  PFN_cuMemsetD8Async MemsetD8Async;
  PFN_cuMemcpyAsync MemcpyAsync;
  PFN_cuMemcpyHtoDAsync MemcpyHtoDAsync;
  PFN_cuMemcpyDtoH MemcpyDtoH;
  PFN_cuStreamCreate StreamCreate;
  PFN_cuStreamDestroy StreamDestroy;
  PFN_cuStreamSynchronize StreamSynchronize;
  PFN_cuCtxSynchronize CtxSynchronize;
  PFN_cuEventCreate EventCreate;
  PFN_cuEventRecord EventRecord;
  PFN_cuEventSynchronize EventSynchronize;
  PFN_cuEventDestroy EventDestroy;
  PFN_cuModuleLoadData ModuleLoadData;
  PFN_cuModuleGetFunction ModuleGetFunction;
  PFN_cuLaunchKernel LaunchKernel;
  PFN_cuMemcpyBatchAsync_v13 BatchV13;
  PFN_cuMemcpyBatchAsync_v12 BatchV12;
} D;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void load_driver(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(D.error, sizeof D.error, "libcuda.so.1 not found (%s)", dlerror());
    return;
  }
  PFN_cuGetProcAddress_v2 gpa = (PFN_cuGetProcAddress_v2)dlsym(lib, "cuGetProcAddress_v2");
  if (!gpa) {
    snprintf(D.error, sizeof D.error, "driver too old: no cuGetProcAddress_v2 (CUDA >= 12.0 needed)");
    return;
  }
#define GET(field, sym, ver)                                                                   \
  do {                                                                                         \
    int st_ = 0;                                                                               \
    if (gpa(sym, (void **)&D.field, ver, CU_GET_PROC_ADDRESS_DEFAULT, &st_) != 0 || !D.field) { \
      snprintf(D.error, sizeof D.error, "driver lacks %s (version %d)", sym, ver);             \
      D.field = NULL;                                                                          \
      return;                                                                                  \
    }                                                                                          \
  } while (0)
  GET(Init, "cuInit", 2000);
  GET(DriverGetVersion, "cuDriverGetVersion", 2020);
  GET(GetErrorString, "cuGetErrorString", 6000);
  GET(DeviceGet, "cuDeviceGet", 2000);
  GET(DeviceGetCount, "cuDeviceGetCount", 2000);
  GET(DeviceGetAttribute, "cuDeviceGetAttribute", 2000);
  GET(PrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 7000);
  GET(PrimaryCtxRelease, "cuDevicePrimaryCtxRelease", 11000);
  GET(CtxSetCurrent, "cuCtxSetCurrent", 4000);
  GET(MemGetInfo, "cuMemGetInfo", 3020);
  GET(MemAddressReserve, "cuMemAddressReserve", 10020);
  GET(MemAddressFree, "cuMemAddressFree", 10020);
  GET(MemCreate, "cuMemCreate", 10020);
  GET(MemRelease, "cuMemRelease", 10020);
  GET(MemMap, "cuMemMap", 10020);
  GET(MemUnmap, "cuMemUnmap", 10020);
  GET(MemSetAccess, "cuMemSetAccess", 10020);
  GET(MemGetAllocationGranularity, "cuMemGetAllocationGranularity", 10020);
  GET(MemHostRegister, "cuMemHostRegister", 6050);
  GET(MemHostUnregister, "cuMemHostUnregister", 4000);
  GET(MemHostGetDevicePointer, "cuMemHostGetDevicePointer", 3020);
  GET(MemAlloc, "cuMemAlloc", 3020);
  GET(MemFree, "cuMemFree", 3020);
  GET(MemsetD8Async, "cuMemsetD8Async", 3020);
  GET(MemcpyAsync, "cuMemcpyAsync", 4000);
  GET(MemcpyHtoDAsync, "cuMemcpyHtoDAsync", 3020);
  GET(MemcpyDtoH, "cuMemcpyDtoH", 3020);
  GET(StreamCreate, "cuStreamCreate", 2000);
  GET(StreamDestroy, "cuStreamDestroy", 4000);
  GET(StreamSynchronize, "cuStreamSynchronize", 2000);
  GET(CtxSynchronize, "cuCtxSynchronize", 2000);
  GET(EventCreate, "cuEventCreate", 2000);
  GET(EventRecord, "cuEventRecord", 2000);
  GET(EventSynchronize, "cuEventSynchronize", 2000);
  GET(EventDestroy, "cuEventDestroy", 4000);
  GET(ModuleLoadData, "cuModuleLoadData", 2000);
  GET(ModuleGetFunction, "cuModuleGetFunction", 2000);
  GET(LaunchKernel, "cuLaunchKernel", 4000);
#undef GET
  if (D.Init(0) != CUDA_SUCCESS) {
    snprintf(D.error, sizeof D.error, "cuInit failed (no usable GPU or driver)");
    return;
  }
  D.DriverGetVersion(&D.version);
  /* The batched copy exists from 12.8; its ABI changed in 13.0. Ask for exactly the form we call. */
  int st = 0;
  if (D.version >= 13000) {
    if (gpa("cuMemcpyBatchAsync", (void **)&D.BatchV13, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &st) != 0) D.BatchV13 = NULL;
  } else if (D.version >= 12080) {
    if (gpa("cuMemcpyBatchAsync", (void **)&D.BatchV12, 12080, CU_GET_PROC_ADDRESS_DEFAULT, &st) != 0) D.BatchV12 = NULL;
  }
  D.loaded = 1;
}

static int drv_fail(CUresult r, const char *what) {
  const char *s = NULL;
  if (D.GetErrorString) D.GetErrorString(r, &s);
  int code = r == CUDA_ERROR_OUT_OF_MEMORY ? MSV_E_OOM : MSV_E_BACKEND;
  return msv_fail(code, "%s failed: %s (CUresult %d)", what, s ? s : "unknown error", r);
}
#define CK(call, what)                 \
  do {                                 \
    CUresult r_ = (call);              \
    if (r_ != CUDA_SUCCESS) return drv_fail(r_, what); \
  } while (0)

int msv_cuda_available(int *count) {
  pthread_once(&g_once, load_driver);
  *count = 0;
  if (!D.loaded) return msv_fail(MSV_E_UNAVAILABLE, "cuda backend unavailable: %s", D.error);
  if (D.DeviceGetCount(count) != CUDA_SUCCESS || *count == 0)
    return msv_fail(MSV_E_UNAVAILABLE, "cuda backend unavailable: no CUDA device");
  return MSV_OK;
}

/* ---- the backend ---- */
/* The copy kernel's descriptor buffers, in a ring: a copy that does not wait for itself leaves its
 * slot busy until `done` fires, and the next copies take the following slots meanwhile. */
#define MSV_KSLOTS 4
typedef struct {
  void *stage; /* page-locked host copy of the descriptors: their upload is a DMA, not a staged copy */
  size_t stage_bytes;
  CUdeviceptr scratch; /* the descriptors on the device, read by the kernel */
  size_t scratch_bytes;
  CUevent done; /* recorded after the launch; NULL before the slot's first use */
} kslot;

typedef struct {
  CUdevice dev;
  CUcontext ctx;
  CUstream stream;
  int sms;
  int host_ptr_is_device_ptr;
  pthread_mutex_t mu; /* guards the buffers below and kernel launch state */
  CUmodule module;
  CUfunction fn_copy, fn_sum;
  int kernels_tried;
  kslot ks[MSV_KSLOTS];
  unsigned kturn;
  CUdeviceptr scratch; /* the checksum kernel's tiles and sums (it waits for itself) */
  size_t scratch_bytes;
} cuda_impl;

#define IMPL(b) ((cuda_impl *)(b)->impl)
static int bind(msv_backend *b) {
  CK(D.CtxSetCurrent(IMPL(b)->ctx), "cuCtxSetCurrent");
  return MSV_OK;
}
static CUstream pick(msv_backend *b, uint64_t stream) { return stream ? (CUstream)(uintptr_t)stream : IMPL(b)->stream; }

static int c_reserve(msv_backend *b, size_t size, uint64_t *addr) {
  int rc = bind(b);
  if (rc) return rc;
  CUdeviceptr p = 0;
  CK(D.MemAddressReserve(&p, size, b->granularity, 0, 0), "cuMemAddressReserve");
  *addr = p;
  return MSV_OK;
}

static int c_free_va(msv_backend *b, uint64_t addr, size_t size) {
  int rc = bind(b);
  if (rc) return rc;
  CK(D.MemAddressFree(addr, size), "cuMemAddressFree");
  return MSV_OK;
}

static int c_map(msv_backend *b, uint64_t addr, size_t size, uint64_t *handle) {
  int rc = bind(b);
  if (rc) return rc;
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = IMPL(b)->dev;
  CUmemGenericAllocationHandle h = 0;
  CUresult r = D.MemCreate(&h, size, &prop, 0);
  if (r != CUDA_SUCCESS) return drv_fail(r, "cuMemCreate");
  r = D.MemMap(addr, size, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    D.MemRelease(h);
    return drv_fail(r, "cuMemMap");
  }
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = D.MemSetAccess(addr, size, &acc, 1);
  if (r != CUDA_SUCCESS) {
    D.MemUnmap(addr, size);
    D.MemRelease(h);
    return drv_fail(r, "cuMemSetAccess");
  }
  *handle = h;
  return MSV_OK;
}

static int c_unmap(msv_backend *b, uint64_t addr, size_t size, uint64_t handle) {
  int rc = bind(b);
  if (rc) return rc;
  CK(D.MemUnmap(addr, size), "cuMemUnmap");
  CK(D.MemRelease(handle), "cuMemRelease");
  return MSV_OK;
}

static int c_mem_info(msv_backend *b, size_t *free_bytes, size_t *total_bytes) {
  int rc = bind(b);
  if (rc) return rc;
  CK(D.MemGetInfo(free_bytes, total_bytes), "cuMemGetInfo");
  return MSV_OK;
}

static int c_host_register(msv_backend *b, void *p, size_t size, uint64_t *alias) {
  int rc = bind(b);
  if (rc) return rc;
  CK(D.MemHostRegister(p, size, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP), "cuMemHostRegister");
  CUdeviceptr d = 0;
  CUresult r = D.MemHostGetDevicePointer(&d, p, 0);
  if (r != CUDA_SUCCESS) {
    D.MemHostUnregister(p);
    return drv_fail(r, "cuMemHostGetDevicePointer");
  }
  *alias = d;
  return MSV_OK;
}

static int c_host_unregister(msv_backend *b, void *p) {
  int rc = bind(b);
  if (rc) return rc;
  CK(D.MemHostUnregister(p), "cuMemHostUnregister");
  return MSV_OK;
}

static int load_kernels(cuda_impl *c) {
  if (c->kernels_tried) return c->module ? MSV_OK : msv_fail(MSV_E_UNAVAILABLE, "copy kernels failed to load");
  c->kernels_tried = 1;
#ifdef MSV_HAVE_KERNELS
  CK(D.ModuleLoadData(&c->module, msv_kernels_fatbin), "cuModuleLoadData");
  CK(D.ModuleGetFunction(&c->fn_copy, c->module, "msv_copy_tiles"), "cuModuleGetFunction(msv_copy_tiles)");
  CK(D.ModuleGetFunction(&c->fn_sum, c->module, "msv_checksum_tiles"), "cuModuleGetFunction(msv_checksum_tiles)");
  return MSV_OK;
#else
  return msv_fail(MSV_E_UNAVAILABLE, "this build has no CUDA kernels (nvcc was not found at build time)");
#endif
}

/* Grow a page-locked host buffer to at least `bytes` (contents lost). */
static int ensure_stage(void **stage, size_t *have, size_t bytes) {
  if (*have >= bytes) return MSV_OK;
  if (*stage) {
    D.MemHostUnregister(*stage);
    free(*stage);
  }
  *stage = NULL;
  *have = 0;
  size_t want = bytes < (1u << 20) ? (1u << 20) : bytes * 2;
  void *p = NULL;
  if (posix_memalign(&p, 4096, want) != 0) return msv_fail(MSV_E_OOM, "out of host memory for copy descriptors");
  memset(p, 0, want);
  CUresult r = D.MemHostRegister(p, want, CU_MEMHOSTREGISTER_PORTABLE);
  if (r != CUDA_SUCCESS) {
    free(p);
    return drv_fail(r, "cuMemHostRegister(descriptors)");
  }
  *stage = p;
  *have = want;
  return MSV_OK;
}

/* Grow a device buffer to at least `bytes` (contents lost). */
static int ensure_scratch(CUdeviceptr *scratch, size_t *have, size_t bytes) {
  if (*have >= bytes) return MSV_OK;
  if (*scratch) D.MemFree(*scratch);
  *scratch = 0;
  *have = 0;
  size_t want = bytes < (1u << 20) ? (1u << 20) : bytes * 2;
  CK(D.MemAlloc(scratch, want), "cuMemAlloc(scratch)");
  *have = want;
  return MSV_OK;
}

/* Tiles of at most this many bytes: large blocks are spread over many thread blocks. */
#define MSV_TILE_BYTES (64u << 10)

/* Enqueue the gather kernel; it does not wait for itself. The descriptors go in the next ring slot,
 * once that slot's previous copy is done (normally long since). */
static int copy_kernel(msv_backend *b, const msv_copy_item *items, size_t n, CUstream st) {
  cuda_impl *c = IMPL(b);
  size_t ntiles = 0;
  for (size_t i = 0; i < n; i++) ntiles += (items[i].size + MSV_TILE_BYTES - 1) / MSV_TILE_BYTES;
  pthread_mutex_lock(&c->mu);
  kslot *k = &c->ks[c->kturn++ % MSV_KSLOTS];
  int rc = load_kernels(c);
  CUresult r = CUDA_SUCCESS;
  if (!rc && k->done && (r = D.EventSynchronize(k->done))) rc = drv_fail(r, "cuEventSynchronize(copy slot)");
  if (!rc && !k->done && (r = D.EventCreate(&k->done, CU_EVENT_DISABLE_TIMING))) rc = drv_fail(r, "cuEventCreate");
  if (!rc) rc = ensure_scratch(&k->scratch, &k->scratch_bytes, ntiles * sizeof(msv_copy_item));
  if (!rc) rc = ensure_stage(&k->stage, &k->stage_bytes, ntiles * sizeof(msv_copy_item));
  if (!rc) {
    msv_copy_item *tiles = (msv_copy_item *)k->stage;
    if (ntiles == n) { /* every block fits one tile: the items are the tiles */
      memcpy(tiles, items, n * sizeof *items);
    } else {
      size_t t = 0;
      for (size_t i = 0; i < n; i++) {
        for (uint64_t off = 0; off < items[i].size; off += MSV_TILE_BYTES) {
          uint64_t len = items[i].size - off < MSV_TILE_BYTES ? items[i].size - off : MSV_TILE_BYTES;
          tiles[t++] = (msv_copy_item){items[i].dst + off, items[i].src + off, len};
        }
      }
    }
    if ((r = D.MemcpyHtoDAsync(k->scratch, tiles, ntiles * sizeof *tiles, st))) rc = drv_fail(r, "cuMemcpyHtoDAsync(tiles)");
  }
  if (!rc) {
    CUdeviceptr tp = k->scratch;
    unsigned long long nt = ntiles;
    void *args[] = {&tp, &nt};
    unsigned grid = (unsigned)(ntiles < (size_t)c->sms * 8 ? ntiles : (size_t)c->sms * 8);
    if ((r = D.LaunchKernel(c->fn_copy, grid, 1, 1, 256, 1, 1, 0, st, args, NULL))) rc = drv_fail(r, "cuLaunchKernel(msv_copy_tiles)");
  }
  /* Recorded on failure too: a partial enqueue (the upload without the launch) still reads the stage. */
  if (k->done && (r = D.EventRecord(k->done, st)) && !rc) rc = drv_fail(r, "cuEventRecord(copy slot)");
  pthread_mutex_unlock(&c->mu);
  return rc;
}

static int copy_batch(msv_backend *b, const msv_copy_item *items, size_t n, CUstream st) {
  (void)b;
  CUdeviceptr *dst = malloc(n * sizeof *dst), *src = malloc(n * sizeof *src);
  size_t *sz = malloc(n * sizeof *sz);
  int rc = MSV_OK;
  if (!dst || !src || !sz) rc = msv_fail(MSV_E_OOM, "out of host memory for a batch of %zu", n);
  for (size_t i = 0; !rc && i < n; i++) dst[i] = items[i].dst, src[i] = items[i].src, sz[i] = items[i].size;
  if (!rc) {
    CUmemcpyAttributes attr;
    memset(&attr, 0, sizeof attr);
    attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    size_t idx = 0, fail = 0;
    CUresult r = D.BatchV13 ? D.BatchV13(dst, src, sz, n, &attr, &idx, 1, st)
                            : D.BatchV12(dst, src, sz, n, &attr, &idx, 1, &fail, st);
    if (r) rc = drv_fail(r, "cuMemcpyBatchAsync");
  }
  free(dst), free(src), free(sz);
  return rc;
}

static int c_has_method(msv_backend *b, int method) {
  cuda_impl *c = IMPL(b);
  switch (method) {
    case MSV_COPY_AUTO:
    case MSV_COPY_LOOP:
      return 1;
    case MSV_COPY_BATCH:
      return D.BatchV13 || D.BatchV12;
    case MSV_COPY_KERNEL: {
      pthread_mutex_lock(&c->mu);
      int ok = c->host_ptr_is_device_ptr && bind(b) == MSV_OK && load_kernels(c) == MSV_OK;
      pthread_mutex_unlock(&c->mu);
      return ok;
    }
  }
  return 0;
}

/* Crossover for `auto`: below this mean block size the UVA kernel wins (many small copies cost
 * the copy engines a descriptor each); at and above it the copy engines win. Measured in
 * bench/bench_allocator.py; see docs/benchmarks.md. */
#define MSV_AUTO_KERNEL_BELOW (1u << 20)

static int c_copy(msv_backend *b, const msv_copy_item *items, size_t n, int method, uint64_t stream) {
  int rc = bind(b);
  if (rc || n == 0) return rc;
  CUstream st = pick(b, stream);
  if (method == MSV_COPY_AUTO) {
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) total += items[i].size;
    int small = total / n < MSV_AUTO_KERNEL_BELOW;
    method = small && c_has_method(b, MSV_COPY_KERNEL) ? MSV_COPY_KERNEL
             : c_has_method(b, MSV_COPY_BATCH)        ? MSV_COPY_BATCH
                                                      : MSV_COPY_LOOP;
  }
  if (method == MSV_COPY_BATCH && !c_has_method(b, MSV_COPY_BATCH)) method = MSV_COPY_LOOP;
  switch (method) {
    case MSV_COPY_KERNEL:
      return copy_kernel(b, items, n, st);
    case MSV_COPY_BATCH:
      return copy_batch(b, items, n, st);
    default:
      for (size_t i = 0; i < n; i++) CK(D.MemcpyAsync(items[i].dst, items[i].src, items[i].size, st), "cuMemcpyAsync");
      return MSV_OK;
  }
}

static int c_sync(msv_backend *b, uint64_t stream) {
  int rc = bind(b);
  if (rc) return rc;
  CK(D.StreamSynchronize(pick(b, stream)), "cuStreamSynchronize");
  return MSV_OK;
}

static int c_quiesce(msv_backend *b) {
  int rc = bind(b);
  if (rc) return rc;
  CK(D.CtxSynchronize(), "cuCtxSynchronize");
  return MSV_OK;
}

/* A fence is an event recorded on the stream after the copies enqueued so far. */
static int c_fence(msv_backend *b, uint64_t stream, uint64_t *out) {
  int rc = bind(b);
  if (rc) return rc;
  CUevent e = NULL;
  CK(D.EventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  CUresult r = D.EventRecord(e, pick(b, stream));
  if (r) {
    D.EventDestroy(e);
    return drv_fail(r, "cuEventRecord");
  }
  *out = (uint64_t)(uintptr_t)e;
  return MSV_OK;
}

static int c_fence_wait(msv_backend *b, uint64_t fence) {
  CUevent e = (CUevent)(uintptr_t)fence;
  int rc = bind(b);
  CUresult r = rc ? CUDA_SUCCESS : D.EventSynchronize(e);
  D.EventDestroy(e); /* the fence is spent whatever happened */
  if (rc) return rc;
  if (r) return drv_fail(r, "cuEventSynchronize");
  return MSV_OK;
}

/* Dropped unwaited: the driver frees the event once it fires. */
static int c_new_stream(msv_backend *b, uint64_t *out) {
  CUstream s;
  int rc = bind(b);
  if (rc) return rc;
  CK(D.StreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  *out = (uint64_t)(uintptr_t)s;
  return MSV_OK;
}

static void c_fence_release(msv_backend *b, uint64_t fence) {
  if (bind(b) == MSV_OK) D.EventDestroy((CUevent)(uintptr_t)fence);
}

#define MSV_SUM_TILE_BYTES (1u << 20)

static int c_checksum(msv_backend *b, const msv_sum_item *items, size_t n, uint64_t *out, size_t nslots) {
  cuda_impl *c = IMPL(b);
  int rc = bind(b);
  if (rc) return rc;
  size_t ntiles = 0;
  for (size_t i = 0; i < n; i++) ntiles += (items[i].size + MSV_SUM_TILE_BYTES - 1) / MSV_SUM_TILE_BYTES;
  if (ntiles == 0) return MSV_OK;
  msv_sum_item *tiles = malloc(ntiles * sizeof *tiles);
  uint64_t *res = calloc(nslots, sizeof *res);
  if (!tiles || !res) {
    free(tiles), free(res);
    return msv_fail(MSV_E_OOM, "out of host memory for checksums");
  }
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    for (uint64_t off = 0; off < items[i].size; off += MSV_SUM_TILE_BYTES) {
      uint64_t len = items[i].size - off < MSV_SUM_TILE_BYTES ? items[i].size - off : MSV_SUM_TILE_BYTES;
      tiles[k++] = (msv_sum_item){items[i].ptr + off, len, items[i].word_base + off / 8, items[i].slot};
    }
  }
  size_t tbytes = ntiles * sizeof *tiles, obytes = nslots * sizeof(uint64_t);
  pthread_mutex_lock(&c->mu);
  rc = load_kernels(c);
  if (!rc) rc = ensure_scratch(&c->scratch, &c->scratch_bytes, tbytes + obytes + 256);
  CUstream st = c->stream;
  CUdeviceptr tp = c->scratch, op = c->scratch + ((tbytes + 255) / 256) * 256;
  CUresult r = CUDA_SUCCESS;
  if (!rc && (r = D.MemcpyHtoDAsync(tp, tiles, tbytes, st))) rc = drv_fail(r, "cuMemcpyHtoDAsync(sum tiles)");
  if (!rc && (r = D.MemsetD8Async(op, 0, obytes, st))) rc = drv_fail(r, "cuMemsetD8Async");
  if (!rc) {
    unsigned long long nt = ntiles;
    void *args[] = {&tp, &nt, &op};
    unsigned grid = (unsigned)(ntiles < (size_t)c->sms * 4 ? ntiles : (size_t)c->sms * 4);
    if ((r = D.LaunchKernel(c->fn_sum, grid, 1, 1, 256, 1, 1, 0, st, args, NULL))) rc = drv_fail(r, "cuLaunchKernel(msv_checksum_tiles)");
  }
  if (!rc && (r = D.StreamSynchronize(st))) rc = drv_fail(r, "cuStreamSynchronize");
  if (!rc && (r = D.MemcpyDtoH(res, op, obytes))) rc = drv_fail(r, "cuMemcpyDtoH(sums)");
  pthread_mutex_unlock(&c->mu);
  if (!rc)
    for (size_t s = 0; s < nslots; s++) out[s] += res[s];
  free(tiles), free(res);
  return rc;
}

static void c_destroy(msv_backend *b) {
  cuda_impl *c = IMPL(b);
  if (bind(b) == MSV_OK) {
    if (c->stream) D.StreamSynchronize(c->stream);
    for (int i = 0; i < MSV_KSLOTS; i++) {
      kslot *k = &c->ks[i];
      if (k->done) D.EventSynchronize(k->done), D.EventDestroy(k->done);
      if (k->scratch) D.MemFree(k->scratch);
      if (k->stage) {
        D.MemHostUnregister(k->stage);
        free(k->stage);
      }
    }
    if (c->scratch) D.MemFree(c->scratch);
    if (c->stream) D.StreamDestroy(c->stream);
  }
  D.PrimaryCtxRelease(c->dev);
  pthread_mutex_destroy(&c->mu);
  free(c);
  free(b);
}

int msv_backend_cuda_create(int device, msv_backend **out) {
  int count = 0;
  int rc = msv_cuda_available(&count);
  if (rc) return rc;
  if (device < 0 || device >= count) return msv_fail(MSV_E_INVALID, "cuda device %d does not exist (%d present)", device, count);
  msv_backend *b = calloc(1, sizeof *b);
  cuda_impl *c = calloc(1, sizeof *c);
  if (!b || !c) {
    free(b), free(c);
    return msv_fail(MSV_E_OOM, "out of host memory");
  }
  pthread_mutex_init(&c->mu, NULL);
  b->impl = c;
  CUresult r;
  if ((r = D.DeviceGet(&c->dev, device)) || (r = D.PrimaryCtxRetain(&c->ctx, c->dev)) || (r = D.CtxSetCurrent(c->ctx))) {
    free(c), free(b);
    return drv_fail(r, "opening the device's primary context");
  }
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = c->dev;
  size_t gran = 0;
  if ((r = D.MemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) ||
      (r = D.StreamCreate(&c->stream, CU_STREAM_NON_BLOCKING))) {
    D.PrimaryCtxRelease(c->dev);
    free(c), free(b);
    return drv_fail(r, "setting up the cuda backend");
  }
  D.DeviceGetAttribute(&c->sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, c->dev);
  D.DeviceGetAttribute(&c->host_ptr_is_device_ptr, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, c->dev);
  if (c->sms <= 0) c->sms = 1;
  b->kind = MSV_BACKEND_CUDA;
  b->name = "cuda";
  b->device = device;
  b->granularity = gran;
  b->reserve = c_reserve;
  b->free_va = c_free_va;
  b->map = c_map;
  b->unmap = c_unmap;
  b->mem_info = c_mem_info;
  b->host_register = c_host_register;
  b->host_unregister = c_host_unregister;
  b->copy = c_copy;
  b->sync = c_sync;
  b->quiesce = c_quiesce;
  b->fence = c_fence;
  b->fence_wait = c_fence_wait;
  b->fence_release = c_fence_release;
  b->new_stream = c_new_stream;
  b->checksum = c_checksum;
  b->has_method = c_has_method;
  b->destroy = c_destroy;
  *out = b;
  return MSV_OK;
}
