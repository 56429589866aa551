/* The subset of the CUDA driver API that memsvc uses, declared here so the extension builds on
 * machines with no CUDA toolkit. Layouts follow the driver ABI (CUDA 12.x/13.x); where a toolkit's
 * cuda.h is present, tests/native/test_cuda_driver_abi.py checks every type's size, every struct's size and
 * member offsets, and every constant declared here against it.
 * Every entry point is resolved at run time through cuGetProcAddress with an explicit version. */
#ifndef MSV_CUDA_DRIVER_H
#define MSV_CUDA_DRIVER_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUevent_st *CUevent;
typedef uint64_t cuuint64_t;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED 712

#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_MEMHOSTREGISTER_PORTABLE 0x01
#define CU_MEMHOSTREGISTER_DEVICEMAP 0x02
#define CU_GET_PROC_ADDRESS_DEFAULT 0
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM 91

typedef enum { CU_MEM_HANDLE_TYPE_NONE = 0 } CUmemAllocationHandleType;
typedef enum { CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3 } CUmemAccess_flags;
typedef enum { CU_MEM_LOCATION_TYPE_INVALID = 0, CU_MEM_LOCATION_TYPE_DEVICE = 1 } CUmemLocationType;
typedef enum { CU_MEM_ALLOCATION_TYPE_PINNED = 1 } CUmemAllocationType;
typedef enum { CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1 } CUmemAllocationGranularity_flags;
typedef enum { CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1 } CUmemcpySrcAccessOrder;

typedef struct {
  CUmemLocationType type;
  int id;
} CUmemLocation;

typedef struct {
  CUmemAllocationType type;
  CUmemAllocationHandleType requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct {
  CUmemLocation location;
  CUmemAccess_flags flags;
} CUmemAccessDesc;

typedef struct {
  CUmemcpySrcAccessOrder srcAccessOrder;
  CUmemLocation srcLocHint;
  CUmemLocation dstLocHint;
  unsigned int flags;
} CUmemcpyAttributes;

/* cuGetProcAddress_v2 (CUDA >= 12.0): the only symbol taken with dlsym. */
typedef CUresult (*PFN_cuGetProcAddress_v2)(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                            int *symbolStatus);

typedef CUresult (*PFN_cuInit)(unsigned int);
typedef CUresult (*PFN_cuDriverGetVersion)(int *);
typedef CUresult (*PFN_cuGetErrorString)(CUresult, const char **);
typedef CUresult (*PFN_cuDeviceGet)(CUdevice *, int);
typedef CUresult (*PFN_cuDeviceGetCount)(int *);
typedef CUresult (*PFN_cuDeviceGetAttribute)(int *, int, CUdevice);
typedef CUresult (*PFN_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
typedef CUresult (*PFN_cuDevicePrimaryCtxRelease)(CUdevice);
typedef CUresult (*PFN_cuCtxSetCurrent)(CUcontext);
typedef CUresult (*PFN_cuMemGetInfo)(size_t *, size_t *);
typedef CUresult (*PFN_cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*PFN_cuMemAddressFree)(CUdeviceptr, size_t);
typedef CUresult (*PFN_cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                                    unsigned long long);
typedef CUresult (*PFN_cuMemRelease)(CUmemGenericAllocationHandle);
typedef CUresult (*PFN_cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*PFN_cuMemUnmap)(CUdeviceptr, size_t);
typedef CUresult (*PFN_cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*PFN_cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *,
                                                      CUmemAllocationGranularity_flags);
typedef CUresult (*PFN_cuMemHostRegister)(void *, size_t, unsigned int);
typedef CUresult (*PFN_cuMemHostUnregister)(void *);
typedef CUresult (*PFN_cuMemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned int);
typedef CUresult (*PFN_cuMemAlloc)(CUdeviceptr *, size_t);
typedef CUresult (*PFN_cuMemFree)(CUdeviceptr);
typedef CUresult (*PFN_cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
typedef CUresult (*PFN_cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
typedef CUresult (*PFN_cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
typedef CUresult (*PFN_cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
typedef CUresult (*PFN_cuStreamCreate)(CUstream *, unsigned int);
typedef CUresult (*PFN_cuStreamDestroy)(CUstream);
typedef CUresult (*PFN_cuStreamSynchronize)(CUstream);
typedef CUresult (*PFN_cuCtxSynchronize)(void);
typedef CUresult (*PFN_cuEventCreate)(CUevent *, unsigned int);
typedef CUresult (*PFN_cuEventRecord)(CUevent, CUstream);
typedef CUresult (*PFN_cuEventSynchronize)(CUevent);
typedef CUresult (*PFN_cuEventDestroy)(CUevent);
typedef CUresult (*PFN_cuModuleLoadData)(CUmodule *, const void *);
typedef CUresult (*PFN_cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
typedef CUresult (*PFN_cuLaunchKernel)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                                       unsigned int, unsigned int, unsigned int, CUstream, void **, void **);
/* CUDA 13.0 form (no failIdx) and CUDA 12.8 form (with failIdx). */
typedef CUresult (*PFN_cuMemcpyBatchAsync_v13)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *,
                                               size_t *, size_t, CUstream);
typedef CUresult (*PFN_cuMemcpyBatchAsync_v12)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *,
                                               size_t *, size_t, size_t *, CUstream);

#endif
