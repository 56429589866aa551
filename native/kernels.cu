// Device kernels of the cuda backend, compiled to a fatbin at build time and loaded with
// cuModuleLoadData, so the extension itself never links the CUDA runtime.
//
// msv_copy_tiles: one thread block per tile of at most 64 KiB. Host memory is reached through
// UVA (registered with DEVICEMAP), so a gather of thousands of small KV blocks is one launch
// instead of thousands of copy-engine descriptors.
// msv_checksum_tiles: the position-dependent sum of hostcopy.c's msv_checksum_cpu, reduced in any
// order (addition commutes), so the CPU and the GPU agree bit for bit.
#include <stdint.h>

struct CopyTile {
  unsigned long long dst, src, size;
};
struct SumTile {
  unsigned long long ptr, size, word_base, slot;
};

extern "C" __global__ void __launch_bounds__(256) msv_copy_tiles(const CopyTile* __restrict__ tiles,
                                                                  unsigned long long n) {
  for (unsigned long long t = blockIdx.x; t < n; t += gridDim.x) {
    const CopyTile tl = tiles[t];
    if (((tl.dst | tl.src | tl.size) & 15ull) == 0) {
      const uint4* __restrict__ s = reinterpret_cast<const uint4*>(tl.src);
      uint4* __restrict__ d = reinterpret_cast<uint4*>(tl.dst);
      const unsigned long long nv = tl.size >> 4, bd = blockDim.x;
      unsigned long long i = threadIdx.x;
      // Four independent 16-byte loads in flight per thread before the first store.
      for (; i + 3 * bd < nv; i += 4 * bd) {
        uint4 a = s[i], b = s[i + bd], c = s[i + 2 * bd], e = s[i + 3 * bd];
        d[i] = a;
        d[i + bd] = b;
        d[i + 2 * bd] = c;
        d[i + 3 * bd] = e;
      }
      for (; i < nv; i += bd) d[i] = s[i];
    } else {
      const unsigned char* s = reinterpret_cast<const unsigned char*>(tl.src);
      unsigned char* d = reinterpret_cast<unsigned char*>(tl.dst);
      for (unsigned long long i = threadIdx.x; i < tl.size; i += blockDim.x) d[i] = s[i];
    }
  }
}

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

extern "C" __global__ void __launch_bounds__(256) msv_checksum_tiles(const SumTile* __restrict__ tiles,
                                                                      unsigned long long n,
                                                                      unsigned long long* __restrict__ out) {
  __shared__ unsigned long long warp_sums[8];
  const unsigned long long G = 0x9E3779B97F4A7C15ull;
  for (unsigned long long t = blockIdx.x; t < n; t += gridDim.x) {
    const SumTile tl = tiles[t];
    const unsigned long long nw = tl.size >> 3;
    unsigned long long acc = 0;
    if ((tl.ptr & 7ull) == 0) {
      const unsigned long long* w = reinterpret_cast<const unsigned long long*>(tl.ptr);
      for (unsigned long long i = threadIdx.x; i < nw; i += blockDim.x) acc += mix64(w[i] ^ ((tl.word_base + i) * G));
    } else {
      const unsigned char* p = reinterpret_cast<const unsigned char*>(tl.ptr);
      for (unsigned long long i = threadIdx.x; i < nw; i += blockDim.x) {
        unsigned long long v = 0;
        for (int k = 7; k >= 0; k--) v = (v << 8) | p[i * 8 + k];
        acc += mix64(v ^ ((tl.word_base + i) * G));
      }
    }
    const unsigned long long tail = tl.size & 7ull;
    if (tail && threadIdx.x == 0) {
      const unsigned char* p = reinterpret_cast<const unsigned char*>(tl.ptr) + nw * 8;
      unsigned long long v = 0;
      for (int k = (int)tail - 1; k >= 0; k--) v = (v << 8) | p[k];
      acc += mix64(v ^ ((tl.word_base + nw) * G));
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long s = 0;
      for (int k = 0; k < (int)(blockDim.x >> 5); k++) s += warp_sums[k];
      atomicAdd(out + tl.slot, s);
    }
    __syncthreads();
  }
}
