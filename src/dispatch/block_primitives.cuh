// dispatch/block_primitives.cuh: device helpers the dispatch kernels share (flat_kernels.cuh,
// ht/ht_device.cuh): topk id loads of either index width, a CTA-wide byte copy and a CTA-wide
// exclusive prefix sum. Header-only, __forceinline__: nothing here is a kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace epx::dispatch::device {

__device__ __forceinline__ int64_t load_id(const void* idx, bool is_i64, int64_t i) {
  return is_i64 ? static_cast<const int64_t*>(idx)[i] : static_cast<int64_t>(static_cast<const int32_t*>(idx)[i]);
}

/// The CTA copies `bytes` from src to dst with the widest access all three allow (16, 4 or 1 bytes).
__device__ __forceinline__ void block_copy_bytes(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes);
  if ((bits & 15u) == 0) {
    for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else if ((bits & 3u) == 0) {
    for (int64_t i = threadIdx.x; i < bytes / 4; i += blockDim.x)
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
  } else {
    for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
  }
}

/// Exclusive prefix sum of `value` over the CTA (blockDim.x a multiple of 32, at most 1024);
/// `total` gets the CTA's sum. Every thread must call it. s_warp: 32 ints of shared memory, free
/// again once the caller has passed a __syncthreads after the call.
__device__ __forceinline__ int block_exclusive_scan(int value, int* s_warp, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  int x = value;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < num_warps ? s_warp[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < num_warps) s_warp[lane] = w;
  }
  __syncthreads();
  total = s_warp[num_warps - 1];
  return (warp > 0 ? s_warp[warp - 1] : 0) + x - value;
}

}  // namespace epx::dispatch::device
