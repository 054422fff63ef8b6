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
  // The tokens that take part: all num_tokens rows, or [0, *num_tokens_dev) when that is in range; none
  // for a record the host rejected (forced_status) or a device count out of range.
  int64_t status = p.forced_status, bad_value = 0, live_tokens = status != 0 ? 0 : p.num_tokens;
  if (status == 0 && p.num_tokens_dev != nullptr) {
    const int64_t v = *p.num_tokens_dev;
    if (v < 0 || v > p.num_tokens) {
      status = kPlanBadNumTokens;
      bad_value = v;
      live_tokens = 0;
    } else {
      live_tokens = v;
    }
  }
  unsigned long long valid = 0;
  for (int64_t chunk = 0; chunk < p.num_tokens; chunk += blockDim.x) {
    const int64_t t = chunk + threadIdx.x;
    const bool live = t < live_tokens;
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
      if (t < p.num_tokens && p.send_pos) p.send_pos[t * R + d] = goes ? static_cast<int32_t>(s_dest_rows[d] + before) : -1;
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
    const int64_t bad_index = s_bad_index == ULLONG_MAX ? -1 : static_cast<int64_t>(s_bad_index);
    if (bad_index >= 0) bad_value = load_id(p.topk_idx, p.idx_is_i64, bad_index);
    rec[kPlanStatus] = status;
    rec[kPlanBadIndex] = bad_index;
    rec[kPlanBadValue] = bad_value;
    rec[kPlanTokens] = live_tokens;
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
  if (p.block_bytes > 0 && blockIdx.x == 0) {  // padded: the plan record heads every destination's block
    for (int i = threadIdx.x; i < p.num_ranks * p.record_fields; i += blockDim.x)
      reinterpret_cast<int64_t*>(p.send + (i / p.record_fields) * p.block_bytes)[i % p.record_fields] = p.record[i % p.record_fields];
  }
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    int64_t block_row = 0;  // first row of destination d's block (compact blocks)
    for (int d = 0; d < p.num_ranks; ++d) {
      const int32_t pos = p.send_pos[t * p.num_ranks + d];
      if (pos >= 0) {
        uint8_t* dst = p.block_bytes > 0 ? p.send + d * p.block_bytes + p.header_bytes + pos * p.row_bytes
                                         : p.send + (block_row + pos) * p.row_bytes;
        block_copy_bytes(dst, p.rows + t * p.row_bytes, p.row_bytes);
      }
      if (p.block_bytes == 0) block_row += p.dest_counts[d];
    }
  }
}

/// The padded form's decode (UnpackParams::rows_per_block > 0): every CTA first reads the R records; a
/// bad one (a rank's host or device rejected its arguments) turns every row into padding, on every rank
/// alike, and CTA 0 says so in call_bad and the host-mapped report.
__global__ void __launch_bounds__(kRowThreads) unpack_padded_kernel(UnpackParams p) {
  __shared__ int s_bad_rank;
  const RowCodec& c = p.codec;
  const int64_t rb = c.row_bytes(), C = p.rows_per_block;
  const int K = c.top_k, R = p.num_src_ranks;
  auto header = [&](int s) { return reinterpret_cast<const int64_t*>(p.rows + s * p.block_bytes); };
  if (threadIdx.x == 0) {
    int bad = -1;
    for (int s = 0; s < R && bad < 0; ++s)
      if (header(s)[kPlanStatus] != 0 || header(s)[kPlanBadIndex] >= 0) bad = s;
    s_bad_rank = bad;
    if (blockIdx.x == 0) {
      *p.call_bad = bad >= 0 ? 1 : 0;
      if (bad >= 0 && p.report != nullptr) {
        volatile PaddedReport* r = p.report;
        const int64_t* h = header(bad);
        r->bad_rank = bad;
        r->status = h[kPlanStatus];
        r->bad_index = h[kPlanBadIndex];
        r->value = h[kPlanBadValue];
        __threadfence_system();
        r->epoch = r->epoch + 1;
        __threadfence_system();
      }
    }
  }
  __syncthreads();
  const bool bad = s_bad_rank >= 0;
  for (int64_t n = blockIdx.x; n < p.num_rows; n += gridDim.x) {
    const int src = static_cast<int>(n / C);
    const int64_t i = n % C;
    const int64_t count = p.dest_counts ? header(src)[kPlanDestCounts + p.dst_rank] : header(src)[kPlanTokens];
    if (bad || i >= count) {  // padding: no expert work, defined bytes
      uint32_t* xw = reinterpret_cast<uint32_t*>(p.x + n * c.payload_bytes());
      for (int64_t j = threadIdx.x; j < c.payload_bytes() / 4; j += blockDim.x) xw[j] = 0u;
      if (c.use_fp8)
        for (int64_t j = threadIdx.x; j < c.scale_bytes() / 4; j += blockDim.x) p.x_scales[n * (c.scale_bytes() / 4) + j] = 0.0f;
      for (int k = threadIdx.x; k < K; k += blockDim.x) {
        p.topk_idx[n * K + k] = -1;
        p.topk_weights[n * K + k] = 0.0f;
      }
      continue;
    }
    const uint8_t* row = p.rows + src * p.block_bytes + p.header_bytes + i * rb;
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
  const bool drop = p.call_bad != nullptr && *p.call_bad != 0;  // padded: that prepare moved nothing
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const int32_t* pos = p.send_pos + t * R;
    if (vec) {  // bf16 partials without addend: 8 per thread and step; H % 8 == 0, 16-byte aligned rows
      for (int64_t i = threadIdx.x * 8; i < H; i += blockDim.x * 8) {
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        int64_t block_row = 0;
        for (int d = 0; d < R; ++d) {
          if (pos[d] >= 0 && !drop) {
            const uint4 v = *reinterpret_cast<const uint4*>(back16 + (block_row + pos[d]) * H + i);
            const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              acc[2 * j] += bf16_bits_to_float(static_cast<uint16_t>(w[j] & 0xffffu));
              acc[2 * j + 1] += bf16_bits_to_float(static_cast<uint16_t>(w[j] >> 16));
            }
          }
          block_row += p.rows_per_block > 0 ? p.rows_per_block : p.dest_counts[d];
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
          if (pos[d] >= 0 && !drop) {
            const int64_t at = (block_row + pos[d]) * H + i;
            acc += p.back_f32 ? back32[at] : bf16_bits_to_float(back16[at]);
          }
          block_row += p.rows_per_block > 0 ? p.rows_per_block : p.dest_counts[d];
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
