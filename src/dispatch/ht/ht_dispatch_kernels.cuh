// dispatch/ht/ht_dispatch_kernels.cuh: the ht dispatch kernel (rows, FP8 quantization, metadata, the
// handshake) and the expert-contiguous layout kernels (device helpers: ht_device.cuh).
#pragma once

#include "dispatch/ht/ht_device.cuh"

namespace epx::dispatch::ht {

// ---- dispatch rows --------------------------------------------------------------------------------

__device__ __forceinline__ uint4 load8(const uint16_t* src, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint4*>(src);
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = static_cast<uint32_t>(src[2 * j]) | (static_cast<uint32_t>(src[2 * j + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ float round_up_pow2(float s) {
  uint32_t u = __float_as_uint(s);
  if (u & 0x007fffffu) u = (u & 0xff800000u) + 0x00800000u;
  return __uint_as_float(u);
}
__device__ __forceinline__ float div_rn(float x, float scale, float r) {
  const float q0 = __fmul_rn(x, r);
  const float rem = __fmaf_rn(-q0, scale, x);
  return __fmaf_rn(rem, r, q0);
}
__device__ __forceinline__ uint32_t fp8x2(float a, float b) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}
/// 8 bf16 (one uint4) -> 8 fp8 codes (one uint2).
__device__ __forceinline__ uint2 quant8(uint4 v, float scale, float r) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t c[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) c[j] = fp8x2(div_rn(lo_f(w[j]), scale, r), div_rn(hi_f(w[j]), scale, r));
  return make_uint2(c[0] | (c[1] << 16), c[2] | (c[3] << 16));
}
__device__ __forceinline__ float amax8(uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float a = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) a = fmaxf(a, fmaxf(fabsf(lo_f(w[j])), fabsf(hi_f(w[j]))));
  return a;
}

/// The destinations of one token: n rows, their x row (payload bytes) and scales row (fp8) on that rank.
struct Dests {
  int n = 0;
  uint8_t* x[kHtMaxRanks];
  float* scales[kHtMaxRanks];
};

/// fp8 row of one token to every destination: a lane owns 16 elements of a 1x128 group (two uint4 of
/// bf16 -> one uint4 of codes); 8 lanes per group, 4 groups per warp step, U steps (4U groups, 2U
/// 16-byte loads per lane) loaded before any is converted. U = 7 covers H = 7168 (56 groups) in two
/// full rounds of loads; U = 4 needs four, the last one half empty (HtParams::fp8_unroll). kFull: x is
/// 16-byte aligned and the row a whole number of rounds (G % 4U == 0): vector loads only and no bounds
/// checks, which keeps the 7-step version within 128 registers.
template <int U, bool kFull>
__device__ __forceinline__ void dispatch_fp8_row(const HtParams& p, const uint16_t* src, const Dests& ds, int lane) {
  const int G = static_cast<int>(p.l.hidden / 128);
  const int sub = lane & 7;
  // Scales of groups `lane` and `lane + 32`, gathered by shuffles and stored once per row and
  // destination as one coalesced run of G floats (G <= 64), instead of G / 4 stores of 16 bytes
  // from 4 lanes each (small NVLink writes). Larger G: each group's lane 0 stores its own.
  const bool gather_scales = G <= 64;
  float sc0 = 0.0f, sc1 = 0.0f;
  for (int g0 = 0; g0 < G; g0 += 4 * U) {
    uint4 a[U], b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int g = g0 + 4 * u + (lane >> 3);
      a[u] = make_uint4(0, 0, 0, 0);
      b[u] = make_uint4(0, 0, 0, 0);
      if (kFull || g < G) {
        const uint16_t* s = src + g * 128 + sub * 16;
        a[u] = load8(s, kFull || p.x_aligned16);
        b[u] = load8(s + 8, kFull || p.x_aligned16);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int g = g0 + 4 * u + (lane >> 3);
      float amax = fmaxf(amax8(a[u]), amax8(b[u]));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      float scale = __fdiv_rn(fmaxf(amax, kAmaxFloor), kFp8E4m3Max);
      if (p.l.use_ue8m0 && isfinite(scale)) scale = round_up_pow2(scale);
      const float r = __frcp_rn(scale);
      const uint2 qa = quant8(a[u], scale, r), qb = quant8(b[u], scale, r);
      const uint4 q = make_uint4(qa.x, qa.y, qb.x, qb.y);
      // Groups gb .. gb + 3 were done by lanes 0, 8, 16, 24 (+ sub); group lane (or lane + 32)
      // sits in lane (lane & 3) * 8 when it is one of them (gb is a multiple of 4).
      const int gb = g0 + 4 * u;
      const float sh = __shfl_sync(0xffffffffu, scale, (lane & 3) * 8);
      if (lane >= gb && lane < gb + 4) sc0 = sh;
      if (lane + 32 >= gb && lane + 32 < gb + 4) sc1 = sh;
      if (kFull || g < G) {
        for (int j = 0; j < ds.n; ++j) {
          *reinterpret_cast<uint4*>(ds.x[j] + g * 128 + sub * 16) = q;
          if (!gather_scales && sub == 0) ds.scales[j][g] = scale;
        }
      }
    }
  }
  if (gather_scales)
    for (int j = 0; j < ds.n; ++j) {
      if (lane < G) ds.scales[j][lane] = sc0;
      if (lane + 32 < G) ds.scales[j][lane + 32] = sc1;
    }
}

__device__ __forceinline__ void dispatch_token(const HtParams& p, int64_t t, const Dests& ds, int lane) {
  const HtLayout& l = p.l;
  const int64_t H = l.hidden;
  const uint16_t* src = p.x + t * H;
  if (!l.use_fp8) {
    // bf16: 16-byte chunks, U per lane in flight (4 KiB per warp), stored to every destination.
    const int64_t n16 = H / 8;
    constexpr int U = 8;
    for (int64_t base = 0; base < n16; base += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = base + u * 32 + lane;
        if (i < n16) v[u] = load8(src + i * 8, p.x_aligned16);
      }
      for (int j = 0; j < ds.n; ++j) {
        uint4* dst = reinterpret_cast<uint4*>(ds.x[j]);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t i = base + u * 32 + lane;
          if (i < n16) dst[i] = v[u];
        }
      }
    }
  } else {
    if (p.fp8_unroll == 7 && p.x_aligned16 && l.groups() % 28 == 0) dispatch_fp8_row<7, true>(p, src, ds, lane);
    else dispatch_fp8_row<4, false>(p, src, ds, lane);
  }
  // The metadata (topk_idx, topk_weights, src_idx) goes out separately, coalesced: dispatch_metadata.
}

/// topk_idx (local expert ids of destination d, -1 elsewhere), topk_weights and src_idx of this rank's
/// rows in every destination's block, every thread of the grid on consecutive entries: the rows of a
/// block are consecutive (send_tok), so a warp stores 128 contiguous bytes per instruction instead
/// of three small stores (K ids, K weights, one index) per row and destination.
__device__ __forceinline__ void dispatch_metadata(const HtParams& p) {
  const HtLayout& l = p.l;
  const HtState& st = state_of(p);
  const int K = l.top_k;
  const int32_t* send_tok = arr<int32_t>(p, p.a.send_tok);
  const int32_t* ids = arr<int32_t>(p, p.a.cached_idx);
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int d = 0; d < l.num_ranks; ++d) {
    const int64_t n = st.rows_to[d], off = st.dst_offset[d];
    const int32_t* tok = send_tok + d * l.capacity;
    uint8_t* base = p.peers[d];
    int32_t* idx = reinterpret_cast<int32_t*>(base + l.off_idx) + off * K;
    float* w = reinterpret_cast<float*>(base + l.off_weights) + off * K;
    int32_t* src_idx = reinterpret_cast<int32_t*>(base + l.off_src_idx) + off;
    for (int64_t q = first; q < n * K; q += stride) {
      const int32_t j = static_cast<int32_t>(q / K), k = static_cast<int32_t>(q - static_cast<int64_t>(j) * K);
      const int64_t t = tok[j];
      idx[q] = l.placement.local_index(ids[t * K + k], l.rank, d);
      w[q] = p.topk_weights[t * K + k];
    }
    for (int64_t j = first; j < n; j += stride) src_idx[j] = tok[j];
  }
}

/// The last CTA to finish (ticket) publishes flag f to every peer and waits for every peer's.
__device__ __forceinline__ void finish_and_handshake(const HtParams& p, uint32_t* ticket, int f, uint64_t epoch, int op) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    s_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  const int R = p.l.num_ranks, me = p.l.rank;
  if (threadIdx.x == 0) {
    state_of(p).timeline[kTlDispatchArrive] = globaltimer();
    *ticket = 0;
    __threadfence_system();
    for (int d = 0; d < R; ++d) st_release_sys(flag_ptr(p, d, f, me), epoch);
  }
  const uint64_t deadline = globaltimer() + p.timeout_ns;
  if (threadIdx.x < R && !wait_flag(p, f, threadIdx.x, epoch, deadline)) {
    report_timeout(p, threadIdx.x, op);
    state_of(p).failed = 1;
  }
  __syncthreads();
  if (threadIdx.x == 0) state_of(p).timeline[kTlDispatchEnd] = globaltimer();
}

/// Launched right behind the layout kernel (programmatic dependent launch, or plainly): waits for
/// HtState::layout_ready (bounded).
__device__ __forceinline__ bool wait_layout_ready(const HtParams& p) {
  HtState& st = state_of(p);
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    atomicMin(&st.timeline[kTlDispatchStart], globaltimer());
    // The layout kernel's own waits end within timeout_s of its start; twice that bounds this one.
    const uint64_t deadline = globaltimer() + 2 * p.timeout_ns;
    int ok = 1;
    while (ld_acquire_gpu(&st.layout_ready) == 0) {
      if (globaltimer() > deadline) {
        ok = 0;
        break;
      }
    }
    if (!ok) {
      report_timeout(p, p.l.rank, kOpDispatch);
      st.failed = 1;
    } else {
      atomicMin(&st.timeline[kTlDispatchReady], globaltimer());
    }
    s_ok = ok;
  }
  __syncthreads();
  return s_ok != 0;
}

__device__ __forceinline__ void dispatch_body(const HtParams& p) {
  const HtState& st = state_of(p);
  if (st.failed || st.any_bad) {
    // Worst-case mode still gets a well-formed empty result (N_recv = 0 was published).
    if (p.worst_case && !st.failed) {
      int32_t* idx = reinterpret_cast<int32_t*>(p.peers[p.l.rank] + p.l.off_idx);
      for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.l.rows() * p.l.top_k;
           i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        idx[i] = -1;
    }
    return;
  }
  const HtLayout& l = p.l;
  const int R = l.num_ranks;
  const uint64_t epoch = st.epoch_dispatch;
  if (p.worst_case) {  // rows beyond N_recv select nothing
    int32_t* idx = reinterpret_cast<int32_t*>(p.peers[l.rank] + l.off_idx);
    const int64_t begin = static_cast<int64_t>(st.num_recv) * l.top_k, end = l.rows() * l.top_k;
    for (int64_t i = begin + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < end;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
      idx[i] = -1;
  }
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int32_t* send_pos = arr<int32_t>(p, p.a.send_pos);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5); t < st.num_tokens; t += warps) {
    Dests ds;
    for (int d = 0; d < R; ++d) {
      const int32_t pos = send_pos[t * R + d];
      if (pos >= 0) {
        const int64_t row = st.dst_offset[d] + pos;
        ds.x[ds.n] = p.peers[d] + l.off_x + row * l.payload_bytes();
        ds.scales[ds.n] = reinterpret_cast<float*>(p.peers[d] + l.off_scales) + row * l.groups();
        ++ds.n;
      }
    }
    if (ds.n) dispatch_token(p, t, ds, lane);
  }
  dispatch_metadata(p);
  finish_and_handshake(p, &state_of(p).ticket_dispatch, kFlagDispatch, epoch, kOpDispatch);
}

__global__ void __launch_bounds__(kMaxThreads) dispatch_kernel(HtParams p) {
  if (wait_layout_ready(p)) dispatch_body(p);
  // The grid ends after the layout grid (which still writes the host record after layout_ready), so
  // whatever follows in the stream also follows the layout, with or without programmatic launch.
  pdl_wait();
}

// ---- expert-contiguous layout ----------------------------------------------------------------------

constexpr int kContigThreads = 512;

/// CTA e < L: the rows of local expert e in received-row order (a block-wide scan per 512 rows),
/// their pair_row entries, and its padding rows; CTA 0 also writes the offsets and the -1 pairs.
__global__ void __launch_bounds__(kContigThreads) contig_map_kernel(HtParams p) {
  const HtState& st = state_of(p);
  if (st.failed) return;
  const int L = p.num_local, K = p.l.top_k, e = blockIdx.x;
  const int64_t N = st.any_bad ? 0 : st.num_recv;
  const int32_t* recv_count = arr<int32_t>(p, p.a.recv_count);
  const int32_t* idx = reinterpret_cast<const int32_t*>(p.peers[p.l.rank] + p.l.off_idx);
  __shared__ int s_warp[32];
  __shared__ int s_base;
  if (e == 0) {
    const int64_t end = (p.worst_case ? p.l.rows() : N) * K;
    for (int64_t i = threadIdx.x; i < end; i += blockDim.x)
      if (i >= N * K || idx[i] < 0) p.contig_pair_row[i] = -1;
    if (threadIdx.x == 0) {
      int off = 0;
      for (int l = 0; l < L; ++l) {
        p.contig_offsets[l] = off;
        off += recv_count[l];
      }
      p.contig_offsets[L] = off;
    }
  }
  if (e >= L) return;
  if (threadIdx.x == 0) {
    int off = 0;
    for (int l = 0; l < e; ++l) off += recv_count[l];
    s_base = off;
  }
  __syncthreads();
  const int base = s_base;
  int running = 0;
  for (int64_t chunk = 0; chunk < N; chunk += blockDim.x) {
    const int64_t n = chunk + threadIdx.x;
    int first = -1;
    if (n < N)
      for (int k = 0; k < K && first < 0; ++k)
        if (idx[n * K + k] == e) first = k;
    int total = 0;
    const int before = block_exclusive_scan(first >= 0 ? 1 : 0, s_warp, total);
    if (first >= 0) {
      const int pos = base + running + before;
      p.contig_row_expert[pos] = e;
      p.contig_src[pos] = static_cast<int32_t>(n);
      for (int k = first; k < K; ++k)
        if (idx[n * K + k] == e) p.contig_pair_row[n * K + k] = pos;
    }
    running += total;
  }
  for (int j = running + threadIdx.x; j < recv_count[e]; j += blockDim.x) {
    p.contig_row_expert[base + j] = -1;
    p.contig_src[base + j] = -1;
  }
}

/// One warp per contiguous row: copies received row contig_src[i] (payload, and fp8 scales), or zeros
/// a padding row; worst-case mode marks rows [M, contig_cap) with row_expert -1.
__global__ void __launch_bounds__(kMaxThreads) contig_copy_kernel(HtParams p) {
  const HtState& st = state_of(p);
  if (st.failed) return;
  const HtLayout& l = p.l;
  const int64_t M = p.contig_offsets[p.num_local];
  const int lane = threadIdx.x & 31;
  const int64_t W = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t n16 = l.payload_bytes() / 16, G = l.use_fp8 ? l.groups() : 0;
  const uint8_t* x = p.peers[l.rank] + l.off_x;
  const float* scales = reinterpret_cast<const float*>(p.peers[l.rank] + l.off_scales);
  for (int64_t i = spread_warp_index(); i < M; i += W) {
    const int32_t src = p.contig_src[i];
    uint4* dst = reinterpret_cast<uint4*>(p.contig_x + i * l.payload_bytes());
    if (src < 0) {
      for (int64_t v = lane; v < n16; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
      for (int64_t g = lane; g < G; g += 32) p.contig_scales[i * G + g] = 0.0f;
      continue;
    }
    const uint4* s = reinterpret_cast<const uint4*>(x + src * l.payload_bytes());
    constexpr int U = 4;
    for (int64_t base = 0; base < n16; base += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = base + u * 32 + lane;
        if (j < n16) v[u] = s[j];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = base + u * 32 + lane;
        if (j < n16) dst[j] = v[u];
      }
    }
    for (int64_t g = lane; g < G; g += 32) p.contig_scales[i * G + g] = scales[src * G + g];
  }
  if (p.worst_case)
    for (int64_t i = M + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.contig_cap;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
      p.contig_row_expert[i] = -1;
}

}  // namespace epx::dispatch::ht
