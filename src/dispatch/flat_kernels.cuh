// dispatch/flat_kernels.cuh: device code of the flat CUDA backends (launchers: flat_cuda.cu,
// contract: flat_cuda.h). No templates: dtype and alignment choices are uniform runtime branches,
// so each kernel is compiled once (one arch, lean CI build).
//
// Bit-exactness with the CPU reference: rows are copied, never converted, and the only arithmetic,
// the combine sum, adds the same bf16 values in the same order from 0.0f as
// CpuPrepareFinalize::sum_partials_bf16 and rounds once with the same float_to_bf16_bits (epx/dtype.h).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "dispatch/block_primitives.cuh"
#include "dispatch/flat_cuda.h"
#include "epx/dtype.h"

namespace epx::dispatch::kernels {

constexpr int kPlanThreads = 1024;  // one CTA scans the whole routing: T is a DP chunk, not a batch of millions
constexpr int kRowThreads = 128;    // one CTA per row or token for the copy kernels
constexpr int kCombineThreads = 256;

using device::block_copy_bytes;
using device::block_exclusive_scan;
using device::load_id;

/// One CTA: chunks of blockDim.x tokens; per chunk and destination rank, a CTA-wide scan of "token
/// goes to d" gives each token its row in d's block (token order within a block, as the CPU plan).
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(PlanParams p) {
  extern __shared__ long long s_dest_rows[];  // [R] rows assigned so far per destination
  __shared__ int s_warp[32];
  __shared__ unsigned long long s_bad_index, s_valid;
  const int R = p.placement.num_ranks, K = p.top_k;
  for (int d = threadIdx.x; d < R; d += blockDim.x) s_dest_rows[d] = 0;
  if (threadIdx.x == 0) {
    s_bad_index = ULLONG_MAX;
    s_valid = 0;
  }
  __syncthreads();
  unsigned long long valid = 0;
  for (int64_t chunk = 0; chunk < p.num_tokens; chunk += blockDim.x) {
    const int64_t t = chunk + threadIdx.x;
    const bool live = t < p.num_tokens;
    if (live) {
      for (int k = 0; k < K; ++k) {
        const int64_t v = load_id(p.topk_idx, p.idx_is_i64, t * K + k);
        if (!p.placement.valid_id(v, k, K)) atomicMin(&s_bad_index, static_cast<unsigned long long>(t * K + k));
        else valid += v >= 0;
      }
    }
    for (int d = 0; d < R; ++d) {
      int goes = 0;
      if (live) {
        for (int k = 0; k < K && !goes; ++k) {
          const int64_t v = load_id(p.topk_idx, p.idx_is_i64, t * K + k);  // an invalid id goes nowhere
          goes = v >= 0 && p.placement.valid_id(v, k, K) && p.placement.dest_rank(static_cast<int32_t>(v), p.src_rank) == d;
        }
      }
      int total = 0;
      const int before = block_exclusive_scan(goes, s_warp, total);
      if (live && p.send_pos) p.send_pos[t * R + d] = goes ? static_cast<int32_t>(s_dest_rows[d] + before) : -1;
      __syncthreads();  // every read of s_dest_rows[d] and s_warp is done
      if (threadIdx.x == 0) s_dest_rows[d] += total;
    }
  }
  atomicAdd(&s_valid, valid);
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t* rec = p.record;
    long long dedup = 0;
    for (int d = 0; d < R; ++d) {
      rec[kPlanDestCounts + d] = s_dest_rows[d];
      dedup += s_dest_rows[d];
    }
    rec[kPlanStatus] = 0;
    rec[kPlanBadIndex] = s_bad_index == ULLONG_MAX ? -1 : static_cast<int64_t>(s_bad_index);
    rec[kPlanTokens] = p.num_tokens;
    rec[kPlanValid] = static_cast<int64_t>(s_valid);
    rec[kPlanDedupRows] = dedup;
  }
}

__global__ void __launch_bounds__(kRowThreads) pack_rows_kernel(PackParams p) {
  const RowCodec& c = p.codec;
  const int64_t rb = c.row_bytes();
  const int K = c.top_k;
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    uint8_t* row = p.rows + t * rb;
    if (!c.use_fp8) block_copy_bytes(row, reinterpret_cast<const uint8_t*>(p.x + t * c.hidden), c.payload_bytes());
    int32_t* ids = reinterpret_cast<int32_t*>(row + c.ids_offset());
    float* weights = reinterpret_cast<float*>(row + c.weights_offset());
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      ids[k] = static_cast<int32_t>(load_id(p.topk_idx, p.idx_is_i64, t * K + k));
      weights[k] = p.topk_weights[t * K + k];
    }
    if (threadIdx.x == 0) *reinterpret_cast<int32_t*>(row + c.src_token_offset()) = static_cast<int32_t>(t);
  }
}

__global__ void __launch_bounds__(kRowThreads) scatter_rows_kernel(ScatterParams p) {
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    int64_t block_row = 0;  // first row of destination d's block
    for (int d = 0; d < p.num_ranks; ++d) {
      const int32_t pos = p.send_pos[t * p.num_ranks + d];
      if (pos >= 0) block_copy_bytes(p.send + (block_row + pos) * p.row_bytes, p.rows + t * p.row_bytes, p.row_bytes);
      block_row += p.dest_counts[d];
    }
  }
}

__global__ void __launch_bounds__(kRowThreads) unpack_rows_kernel(UnpackParams p) {
  const RowCodec& c = p.codec;
  const int64_t rb = c.row_bytes();
  const int K = c.top_k;
  for (int64_t n = blockIdx.x; n < p.num_rows; n += gridDim.x) {
    const uint8_t* row = p.rows + n * rb;
    int src = 0;
    while (src + 1 < p.num_src_ranks && n >= p.src_row_offset[src + 1]) ++src;
    block_copy_bytes(p.x + n * c.payload_bytes(), row, c.payload_bytes());
    if (c.use_fp8)
      block_copy_bytes(reinterpret_cast<uint8_t*>(p.x_scales) + n * c.scale_bytes(), row + c.payload_bytes(), c.scale_bytes());
    const int32_t* ids = reinterpret_cast<const int32_t*>(row + c.ids_offset());
    const float* weights = reinterpret_cast<const float*>(row + c.weights_offset());
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      p.topk_idx[n * K + k] = p.placement.local_index(ids[k], src, p.dst_rank);
      p.topk_weights[n * K + k] = weights[k];
    }
    if (threadIdx.x == 0) {
      // A duplicate expert counts its row once.
      for (int k = 0; k < K; ++k) {
        const int l = p.placement.local_index(ids[k], src, p.dst_rank);
        if (l < 0 || l >= p.num_local) continue;
        bool first = true;
        for (int j = 0; j < k && first; ++j) first = p.placement.local_index(ids[j], src, p.dst_rank) != l;
        if (first) atomicAdd(p.recv_count + l, 1);
      }
    }
  }
}

__global__ void __launch_bounds__(kCombineThreads) combine_rows_kernel(CombineParams p, bool vec) {
  const int64_t H = p.hidden;
  const int R = p.num_ranks;
  const uint16_t* back16 = static_cast<const uint16_t*>(p.back);
  const float* back32 = static_cast<const float*>(p.back);
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const int32_t* pos = p.send_pos + t * R;
    if (vec) {  // bf16 partials without addend: 8 per thread and step; H % 8 == 0, 16-byte aligned rows
      for (int64_t i = threadIdx.x * 8; i < H; i += blockDim.x * 8) {
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        int64_t block_row = 0;
        for (int d = 0; d < R; ++d) {
          if (pos[d] >= 0) {
            const uint4 v = *reinterpret_cast<const uint4*>(back16 + (block_row + pos[d]) * H + i);
            const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              acc[2 * j] += bf16_bits_to_float(static_cast<uint16_t>(w[j] & 0xffffu));
              acc[2 * j + 1] += bf16_bits_to_float(static_cast<uint16_t>(w[j] >> 16));
            }
          }
          block_row += p.dest_counts[d];
        }
        uint32_t o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          o[j] = static_cast<uint32_t>(float_to_bf16_bits(acc[2 * j])) | (static_cast<uint32_t>(float_to_bf16_bits(acc[2 * j + 1])) << 16);
        *reinterpret_cast<uint4*>(p.out + t * H + i) = make_uint4(o[0], o[1], o[2], o[3]);
      }
    } else {
      for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
        float acc = 0.0f;
        int64_t block_row = 0;
        for (int d = 0; d < R; ++d) {
          if (pos[d] >= 0) {
            const int64_t at = (block_row + pos[d]) * H + i;
            acc += p.back_f32 ? back32[at] : bf16_bits_to_float(back16[at]);
          }
          block_row += p.dest_counts[d];
        }
        if (p.addend) {
          if (!p.back_f32) acc = bf16_bits_to_float(float_to_bf16_bits(acc));  // partial_bf16: the sum rounded first
          acc += p.addend[t * H + i];
        }
        p.out[t * H + i] = float_to_bf16_bits(acc);
      }
    }
  }
}

__global__ void __launch_bounds__(kCombineThreads) finish_rows_kernel(FinishParams p) {
  const uint16_t* parts16 = static_cast<const uint16_t*>(p.parts);
  const float* parts32 = static_cast<const float*>(p.parts);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int r = 0; r < p.num_ranks; ++r) {
      const int64_t at = r * p.rank_stride + i;
      acc += p.parts_f32 ? parts32[at] : bf16_bits_to_float(parts16[at]);
    }
    if (p.addend) acc += p.addend[i];
    p.out[i] = float_to_bf16_bits(acc);
  }
}

}  // namespace epx::dispatch::kernels
