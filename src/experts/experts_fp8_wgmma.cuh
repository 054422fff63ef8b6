// experts/experts_fp8_wgmma.cuh: what the FP8 block-scaled grouped GEMMs share (experts_fp8_cuda.cu:
// the <= 64-row kernel; experts_fp8_prefill_cuda.cu: the warp-specialized 128-row prefill kernel;
// the MXFP4 kernels too): the weight-tile geometry of one work item, and in namespace wg the sm_90a
// primitives of src/cuda (cp.async, mbarriers and TMA: cuda/tma.cuh; wgmma e4m3 and the descriptors
// of 128-byte-swizzled K-major tiles: cuda/wgmma.cuh; named barriers: cuda/primitives.cuh).
#pragma once

#include <cstdint>

#include "cuda/primitives.cuh"
#include "cuda/tma.cuh"
#include "cuda/wgmma.cuh"
#include "experts/experts_fp8_cuda.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EPX_FP8_WGMMA 1
#endif

namespace epx::experts_cuda::wg {

using namespace epx::cuda::sm90;
using cuda::dev::named_bar_sync;

constexpr int kBK = 128;  ///< K per stage = one FP8 scale block = one 128-byte swizzle row

#ifdef EPX_FP8_WGMMA

/// What one work item needs, resolved by every thread.
struct Item {
  const uint8_t* w;        // w13 or w2 (fp8 codes, K-major rows)
  const float* w_scale;    // [rows/128, K/128]
  int64_t K;               // reduction length (multiple of 128)
  int64_t inter;           // I of the expert
  int64_t hidden;          // H
  int32_t row0, num_rows;  // row-space rows of the tile
  int64_t col0;            // gate_up: first h column; down: first output column
};

/// First weight row of m64 sub-tile t (0..3): gate_up gate/gate/up/up halves of 128 h columns;
/// down 4 consecutive 64-row blocks of output columns.
template <bool kGateUp>
__device__ __forceinline__ int64_t sub_row(const Item& it, int t) {
  if constexpr (kGateUp) return (t >= 2 ? it.inter : 0) + it.col0 + (t & 1) * 64;
  else return it.col0 + t * 64;
}
/// Sub-tile t lies inside the weight matrix (gate_up always; down: H % 128 == 0 keeps 64-row
/// blocks whole).
template <bool kGateUp>
__device__ __forceinline__ bool sub_valid(const Item& it, int t) {
  if constexpr (kGateUp) return true;
  else return it.col0 + t * 64 < it.hidden;
}

#endif  // EPX_FP8_WGMMA

}  // namespace epx::experts_cuda::wg
