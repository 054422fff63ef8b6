// dispatch/ht_kernels.cuh: device code of the ht backend on CUDA (contract and buffer layout:
// ht_cuda.h; launchers: ht_cuda.cu).
//
// Memory order (NCCL-DEVICE-API.md §3): data stores into a peer are weak; each CTA's threads meet
// at __syncthreads, one thread fences at system scope and then publishes with st.release.sys; the
// consumer polls with ld.acquire.sys and meets its CTA at __syncthreads before reading. Peer-written
// data is never read through the non-coherent path. Every poll is bounded by %globaltimer.
//
// Bit-exactness: bf16 rows are copied; fp8 follows quant_cuda.cu (amax with fmaxf, scale =
// max(amax, 1e-4) / 448 with IEEE division, UE8M0 rounding from the bits, cvt.rn.satfinite.e4m3x2)
// except that x / scale is computed as Markstein's correction of x * RN(1/scale):
//   q0 = RN(x * r), rem = fma(-q0, scale, x) (exact), q = RN(q0 + rem * r)
// which equals RN(x / scale) whenever r = RN(1/scale) and nothing under/overflows (|x / scale| <=
// 448 here), at 3 operations instead of an IEEE division per element: the division was the
// bottleneck of an fp8 dispatch on a 24-SM budget. The tests compare every code with the CPU.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "dispatch/block_primitives.cuh"
#include "dispatch/ht_cuda.h"
#include "epx/dtype.h"

namespace epx::dispatch::ht {

constexpr int kLayoutThreads = 1024;
/// Dispatch/combine CTAs: at most 16 warps (ht_warps_per_block <= 16), so up to 128 registers per thread
/// stay available for the bytes a warp keeps in flight (a 1024-thread CTA would cap them at 64 and spill).
constexpr int kMaxThreads = 512;
constexpr float kAmaxFloor = 1e-4f;  // quant_cpu.cpp

enum Op : int32_t { kOpLayout = 0, kOpDispatch = 1, kOpCombine = 2 };
enum Flag : int { kFlagCounts = 0, kFlagDispatch = 1, kFlagCombine = 2 };

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ HtState& state_of(const HtParams& p) { return *reinterpret_cast<HtState*>(p.state); }
template <class T>
__device__ __forceinline__ T* arr(const HtParams& p, int64_t off) {
  return reinterpret_cast<T*>(p.state + off);
}
__device__ __forceinline__ uint64_t* flag_ptr(const HtParams& p, int rank, int f, int s) {
  return reinterpret_cast<uint64_t*>(p.peers[rank] + p.l.off_flags) + p.l.flag_index(f, s);
}

/// Records the first device-side failure (sticky) in the host-mapped record.
__device__ __forceinline__ void report_timeout(const HtParams& p, int peer, int op) {
  if (atomicCAS_system(&p.record->error_code, 0, 1) == 0) {
    p.record->error_peer = peer;
    p.record->error_op = op;
  }
  __threadfence_system();
}

/// Polls flag f of source s in this rank's buffer until >= target; false after the deadline.
__device__ __forceinline__ bool wait_flag(const HtParams& p, int f, int s, uint64_t target, uint64_t deadline) {
  const uint64_t* flag = flag_ptr(p, p.l.rank, f, s);
  while (ld_acquire_sys(flag) < target) {
    if (globaltimer_ns() > deadline) return false;
  }
  return true;
}

using device::load_id;

/// device::block_exclusive_scan (block_primitives.cuh) followed by a __syncthreads, so that s_warp is
/// free again when it returns; every thread calls it.
__device__ __forceinline__ int block_exclusive_scan(int value, int* s_warp, int& total) {
  const int result = device::block_exclusive_scan(value, s_warp, total);
  __syncthreads();
  return result;
}

// ---- layout + count exchange ----------------------------------------------------------------------

__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(HtParams p) {
  const HtLayout& l = p.l;
  const int R = l.num_ranks, K = l.top_k, me = l.rank, Lmax = l.max_local;
  const int64_t T = p.num_tokens;
  HtState& st = state_of(p);
  int32_t* expert_counts = arr<int32_t>(p, p.a.expert_counts);
  int32_t* cached_idx = arr<int32_t>(p, p.a.cached_idx);
  int32_t* send_pos = arr<int32_t>(p, p.a.send_pos);
  uint8_t* in_rank = arr<uint8_t>(p, p.a.is_token_in_rank);

  __shared__ int s_warp[32];
  __shared__ unsigned long long s_bad;
  __shared__ int s_rows[kHtMaxRanks];
  __shared__ int s_valid, s_fail, s_differs;
  __shared__ uint64_t s_epoch;
  extern __shared__ int s_counts[];  // [R * Lmax]

  if (threadIdx.x == 0) {
    for (int i = 0; i < 8; ++i) st.timeline[i] = (i == kTlDispatchStart || i == kTlCombineStart) ? ~0ull : 0ull;
    st.timeline[kTlLayoutStart] = globaltimer_ns();
    s_epoch = st.epoch_dispatch + 1;
    s_bad = ULLONG_MAX;
    s_valid = 0;
    s_fail = 0;
    s_differs = !(st.cache_valid && st.cache_tokens == T) || p.local_status != 0;
  }
  __syncthreads();
  const uint64_t epoch = s_epoch;
  const uint64_t deadline = globaltimer_ns() + p.timeout_ns;

  // 1. Same routing as the cached layout? (ids are compared as the cache stores them: int32)
  if (!s_differs) {
    bool differs = false;
#pragma unroll 8
    for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x) differs |= load_id(p.topk_idx, p.idx_is_i64, i) != cached_idx[i];
    if (__syncthreads_or(differs) && threadIdx.x == 0) s_differs = 1;
    __syncthreads();
  }
  const bool hit = !s_differs;
  int32_t status = p.local_status;

  // 2. Validate and plan (DedupCpu::plan), unless cached.
  if (!hit && status == 0) {
    const int64_t max_id = l.placement.max_id();
    for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x) {
      const int64_t v = load_id(p.topk_idx, p.idx_is_i64, i);
      if (v < -1 || v > max_id) atomicMin(&s_bad, static_cast<unsigned long long>(i));
    }
    __syncthreads();
    if (s_bad != ULLONG_MAX) status = 1;
  }
  if (!hit && status == 0) {
    for (int i = threadIdx.x; i < R * Lmax; i += blockDim.x) s_counts[i] = 0;
    if (threadIdx.x < R) s_rows[threadIdx.x] = 0;
    __syncthreads();
    int valid = 0;
    for (int64_t chunk = 0; chunk < T; chunk += blockDim.x) {
      const int64_t t = chunk + threadIdx.x;
      const bool live = t < T;
      int32_t ids[32];  // K <= 32 checked at create; a larger K takes the reload path below
      unsigned dest_mask = 0;
      if (live) {
        for (int k = 0; k < K; ++k) {
          const int32_t id = static_cast<int32_t>(load_id(p.topk_idx, p.idx_is_i64, t * K + k));
          if (k < 32) ids[k] = id;
          cached_idx[t * K + k] = id;
          if (id < 0) continue;
          ++valid;
          const int d = l.placement.dest_rank(id, me);
          dest_mask |= 1u << d;
          bool first = true;  // a duplicate expert counts its row once
          for (int j = 0; j < k && first; ++j) first = (j < 32 ? ids[j] : cached_idx[t * K + j]) != id;
          if (first) atomicAdd(&s_counts[d * Lmax + l.placement.local_index(id, me, d)], 1);
        }
      }
      for (int d = 0; d < R; ++d) {
        const int goes = live && ((dest_mask >> d) & 1u);
        const int base = s_rows[d];  // read before the scan's barriers; thread 0 updates it after them
        int total = 0;
        const int before = block_exclusive_scan(goes, s_warp, total);
        if (live) {
          send_pos[t * R + d] = goes ? base + before : -1;
          in_rank[t * R + d] = static_cast<uint8_t>(goes);
        }
        if (threadIdx.x == 0) s_rows[d] = base + total;
        __syncthreads();
      }
    }
    atomicAdd(&s_valid, valid);
    __syncthreads();
    for (int i = threadIdx.x; i < R * Lmax; i += blockDim.x) expert_counts[i] = s_counts[i];
    if (threadIdx.x == 0) {
      int dedup = 0;
      for (int d = 0; d < R; ++d) {
        st.rows_to[d] = s_rows[d];
        dedup += s_rows[d];
      }
      st.valid_selections = s_valid;
      st.dedup_rows = dedup;
      st.cache_valid = 1;
      st.cache_tokens = static_cast<int32_t>(T);
    }
  } else if (!hit) {
    // Bad arguments: publish zero rows; the cache no longer describes anything.
    if (threadIdx.x == 0) {
      for (int d = 0; d < R; ++d) st.rows_to[d] = 0;
      st.valid_selections = 0;
      st.dedup_rows = 0;
      st.cache_valid = 0;
    }
    for (int i = threadIdx.x; i < R * Lmax; i += blockDim.x) expert_counts[i] = 0;
  }
  __syncthreads();

  // 3. Publish this rank's slot to every rank (itself included), then the counts flag.
  for (int d = 0; d < R; ++d) {
    int32_t* slot = reinterpret_cast<int32_t*>(p.peers[d] + l.off_slots + me * l.slot_bytes);
    const int n = R + 2 + Lmax;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      int32_t v;
      if (i < R) v = st.rows_to[i];
      else if (i == R) v = status;
      else if (i == R + 1) v = 0;
      else v = expert_counts[d * Lmax + (i - R - 2)];
      slot[i] = v;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int d = 0; d < R; ++d) st_release_sys(flag_ptr(p, d, kFlagCounts, me), epoch);
  }
  // 4. Wait for every source's slot.
  if (threadIdx.x < R && !wait_flag(p, kFlagCounts, threadIdx.x, epoch, deadline)) {
    report_timeout(p, threadIdx.x, kOpLayout);
    s_fail = 1;
  }
  __syncthreads();
  if (s_fail) {
    if (threadIdx.x == 0) {
      st.failed = 1;
      st.epoch_dispatch = epoch;
      __threadfence_system();
      *reinterpret_cast<volatile uint64_t*>(&p.record->layout_epoch) = epoch;
    }
    return;
  }

  // 5. Derive: count matrix, rank prefix matrix, offsets, N_recv, aligned per-expert counts.
  const int32_t* my_slots = reinterpret_cast<const int32_t*>(p.peers[me] + l.off_slots);
  auto slot_word = [&](int s, int i) { return my_slots[s * (l.slot_bytes / 4) + i]; };
  int32_t* recv_count = arr<int32_t>(p, p.a.recv_count);
  const int L = l.placement.num_local(me);
  int any_bad = 0, bad_rank = -1;
  for (int s = 0; s < R; ++s)
    if (slot_word(s, R) != 0 && bad_rank < 0) bad_rank = s;
  any_bad = bad_rank >= 0;
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < R; ++s) sum += slot_word(s, R + 2 + e);
    const int a = p.expert_alignment;
    recv_count[e] = any_bad ? 0 : (sum + a - 1) / a * a;
  }
  if (threadIdx.x == 0) {
    for (int d = 0; d < R; ++d) {
      int acc = 0;
      for (int s = 0; s < R; ++s) {
        const int n = any_bad ? 0 : slot_word(s, d);
        acc += n;
        st.rank_prefix_matrix[s * R + d] = acc;
      }
      int off = 0;
      for (int s = 0; s < me; ++s) off += any_bad ? 0 : slot_word(s, d);
      st.dst_offset[d] = off;
    }
    int off = 0;
    for (int s = 0; s < R; ++s) {
      st.recv_offset[s] = off;
      off += any_bad ? 0 : slot_word(s, me);
    }
    st.recv_offset[R] = off;
    st.num_recv = off;
    st.any_bad = any_bad;
    *arr<int32_t>(p, p.a.num_recv_device) = off;
    HtHostRecord* rec = p.record;
    rec->num_recv = off;
    rec->any_bad = any_bad;
    rec->bad_rank = bad_rank;
    rec->cache_hit = hit;
    rec->bad_index = s_bad == ULLONG_MAX ? -1 : static_cast<int64_t>(s_bad);
    rec->valid_selections = any_bad ? 0 : st.valid_selections;
    rec->dedup_rows = any_bad ? 0 : st.dedup_rows;
    rec->rows_to_self = any_bad ? 0 : st.rows_to[me];
    rec->rows_from_others = any_bad ? 0 : off - slot_word(me, me);
    st.epoch_dispatch = epoch;
    st.timeline[kTlLayoutEnd] = globaltimer_ns();
    __threadfence_system();
    *reinterpret_cast<volatile uint64_t*>(&rec->layout_epoch) = epoch;
  }
}

// ---- dispatch rows --------------------------------------------------------------------------------

__device__ __forceinline__ uint4 load8(const uint16_t* src, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint4*>(src);
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = static_cast<uint32_t>(src[2 * j]) | (static_cast<uint32_t>(src[2 * j + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ float lo_f(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
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

/// Stores to every destination of one token: `num_dest` (base of x region on that rank, row).
struct Dests {
  int n = 0;
  int rank[kHtMaxRanks];
  int64_t row[kHtMaxRanks];
};

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
        uint4* dst = reinterpret_cast<uint4*>(p.peers[ds.rank[j]] + l.off_x + ds.row[j] * 2 * H);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t i = base + u * 32 + lane;
          if (i < n16) dst[i] = v[u];
        }
      }
    }
  } else {
    // fp8: a lane owns 16 elements of a 1x128 group (two uint4 of bf16 -> one uint4 of codes); 8 lanes
    // per group, 4 groups per warp step, U steps loaded before any is converted (bytes in flight).
    const int64_t G = H / 128;
    const int sub = lane & 7;
    constexpr int U = 4;
    for (int64_t g0 = 0; g0 < G; g0 += 4 * U) {
      uint4 a[U], b[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t g = g0 + 4 * u + (lane >> 3);
        a[u] = make_uint4(0, 0, 0, 0);
        b[u] = make_uint4(0, 0, 0, 0);
        if (g < G) {
          const uint16_t* s = src + g * 128 + sub * 16;
          a[u] = load8(s, p.x_aligned16);
          b[u] = load8(s + 8, p.x_aligned16);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t g = g0 + 4 * u + (lane >> 3);
        float amax = fmaxf(amax8(a[u]), amax8(b[u]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        float scale = __fdiv_rn(fmaxf(amax, kAmaxFloor), kFp8E4m3Max);
        if (l.use_ue8m0 && isfinite(scale)) scale = round_up_pow2(scale);
        const float r = __frcp_rn(scale);
        const uint2 qa = quant8(a[u], scale, r), qb = quant8(b[u], scale, r);
        const uint4 q = make_uint4(qa.x, qa.y, qb.x, qb.y);
        if (g < G) {
          for (int j = 0; j < ds.n; ++j) {
            uint8_t* base = p.peers[ds.rank[j]];
            *reinterpret_cast<uint4*>(base + l.off_x + ds.row[j] * H + g * 128 + sub * 16) = q;
            if (sub == 0) reinterpret_cast<float*>(base + l.off_scales)[ds.row[j] * G + g] = scale;
          }
        }
      }
    }
  }
  // Metadata: local expert ids for each destination, weights, source token.
  const int K = l.top_k;
  const int32_t* ids = arr<int32_t>(p, p.a.cached_idx) + t * K;
  for (int j = 0; j < ds.n; ++j) {
    uint8_t* base = p.peers[ds.rank[j]];
    const int64_t row = ds.row[j];
    for (int k = lane; k < K; k += 32) {
      reinterpret_cast<int32_t*>(base + l.off_idx)[row * K + k] = l.placement.local_index(ids[k], l.rank, ds.rank[j]);
      reinterpret_cast<float*>(base + l.off_weights)[row * K + k] = p.topk_weights[t * K + k];
    }
    if (lane == 0) reinterpret_cast<int32_t*>(base + l.off_src_idx)[row] = static_cast<int32_t>(t);
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
    state_of(p).timeline[kTlDispatchArrive] = globaltimer_ns();
    *ticket = 0;
    __threadfence_system();
    for (int d = 0; d < R; ++d) st_release_sys(flag_ptr(p, d, f, me), epoch);
  }
  const uint64_t deadline = globaltimer_ns() + p.timeout_ns;
  if (threadIdx.x < R && !wait_flag(p, f, threadIdx.x, epoch, deadline)) {
    report_timeout(p, threadIdx.x, op);
    state_of(p).failed = 1;
  }
  __syncthreads();
  if (threadIdx.x == 0) state_of(p).timeline[kTlDispatchEnd] = globaltimer_ns();
}

__global__ void __launch_bounds__(kMaxThreads) dispatch_kernel(HtParams p) {
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
  if (threadIdx.x == 0) atomicMin(&state_of(p).timeline[kTlDispatchStart], globaltimer_ns());
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
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5); t < p.num_tokens; t += warps) {
    Dests ds;
    for (int d = 0; d < R; ++d) {
      const int32_t pos = send_pos[t * R + d];
      if (pos >= 0) {
        ds.rank[ds.n] = d;
        ds.row[ds.n] = st.dst_offset[d] + pos;
        ++ds.n;
      }
    }
    if (ds.n) dispatch_token(p, t, ds, lane);
  }
  finish_and_handshake(p, &state_of(p).ticket_dispatch, kFlagDispatch, epoch, kOpDispatch);
}

// ---- combine --------------------------------------------------------------------------------------

/// One warp copies one bf16 row (16-byte vectors, U per lane in flight, when both ends allow).
__device__ __forceinline__ void copy_row_bf16(uint16_t* dst, const uint16_t* src, int64_t H, bool aligned, int lane) {
  if (aligned) {
    const int64_t n16 = H / 8;
    constexpr int U = 8;
    for (int64_t base = 0; base < n16; base += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = base + u * 32 + lane;
        if (i < n16) v[u] = reinterpret_cast<const uint4*>(src)[i];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = base + u * 32 + lane;
        if (i < n16) reinterpret_cast<uint4*>(dst)[i] = v[u];
      }
    }
  } else {
    for (int64_t i = lane; i < H; i += 32) dst[i] = src[i];
  }
}

/// out[t] = round_bf16(sum over destinations d in rank order that token t went to of partial_d), fp32
/// from 0.0f (DedupCpu::finalize); `rows` in destination-rank order.
__device__ __forceinline__ void reduce_token(const uint16_t* const* rows, int n, uint16_t* out, int64_t H, bool aligned, int lane) {
  if (aligned) {
    const int64_t n16 = H / 8;
    constexpr int U = 4;
    for (int64_t base = 0; base < n16; base += 32 * U) {
      float acc[U][8];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] = 0.0f;
      for (int j = 0; j < n; ++j) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t i = base + u * 32 + lane;
          if (i < n16) v[u] = reinterpret_cast<const uint4*>(rows[j])[i];
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            acc[u][2 * q] += lo_f(w[q]);
            acc[u][2 * q + 1] += hi_f(w[q]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = base + u * 32 + lane;
        if (i >= n16) continue;
        uint32_t o[4];
#pragma unroll
        for (int q = 0; q < 4; ++q)
          o[q] = static_cast<uint32_t>(float_to_bf16_bits(acc[u][2 * q])) |
                 (static_cast<uint32_t>(float_to_bf16_bits(acc[u][2 * q + 1])) << 16);
        reinterpret_cast<uint4*>(out)[i] = make_uint4(o[0], o[1], o[2], o[3]);
      }
    }
  } else {
    for (int64_t i = lane; i < H; i += 32) {
      float acc = 0.0f;
      for (int j = 0; j < n; ++j) acc += bf16_bits_to_float(rows[j][i]);
      out[i] = float_to_bf16_bits(acc);
    }
  }
}

/// Combine. Every warp first sends: chunks of kHtChunkRows received rows from a remote source s ->
/// s's `back` block, then one release of that chunk's flag in s's buffer. Then it reduces a contiguous
/// token range in order; a remote partial's chunk flag is polled once per chunk (ld.acquire.sys,
/// bounded), then the token is reduced. Sending never waits, so no warp waits on work of its own GPU:
/// no co-residency assumption.
/// The last CTA (ticket) advances the combine epoch.
__global__ void __launch_bounds__(kMaxThreads) combine_kernel(HtParams p) {
  HtState& st = state_of(p);
  if (st.failed || st.any_bad) return;
  const HtLayout& l = p.l;
  const int R = l.num_ranks, me = l.rank;
  const int64_t H = l.hidden, C = l.chunks();
  const uint64_t epoch = st.epoch_combine + 1;
  const int lane = threadIdx.x & 31;
  const int64_t W = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t gw = blockIdx.x * static_cast<int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5);
  if (threadIdx.x == 0) atomicMin(&st.timeline[kTlCombineStart], globaltimer_ns());
  // Every warp sends its share first, then reduces (measured at c8ec6b1: splitting the warps into
  // senders and reducers left the reducers 150-380 us behind the last chunk).
  const bool is_sender = true, is_reducer = true;
  const int64_t num_senders = W, num_reducers = W;
  const int64_t my_index = gw;

  if (is_sender) {
    // Work items: (source s != me, chunk c) in source order.
    int64_t item = 0;
    for (int s = 0; s < R; ++s) {
      if (s == me) continue;
      const int64_t count = st.recv_offset[s + 1] - st.recv_offset[s];
      const int64_t chunks = (count + kHtChunkRows - 1) / kHtChunkRows;
      for (int64_t c = 0; c < chunks; ++c, ++item) {
        if (item % num_senders != my_index) continue;
        const int64_t j_end = min(count, (c + 1) * kHtChunkRows);
        for (int64_t j = c * kHtChunkRows; j < j_end; ++j) {
          uint16_t* dst = reinterpret_cast<uint16_t*>(p.peers[s] + l.off_back) + (me * l.capacity + j) * H;
          copy_row_bf16(dst, p.expert_out + (st.recv_offset[s] + j) * H, H, p.io_aligned16, lane);
        }
        __syncwarp();
        if (lane == 0) {
          __threadfence_system();
          st_release_sys(reinterpret_cast<uint64_t*>(p.peers[s] + l.off_chunk_flags) + me * C + c, epoch);
        }
      }
    }
    if (lane == 0) atomicMax(&st.timeline[kTlCombineSent], globaltimer_ns());
  }

  if (is_reducer) {
    const int64_t T = p.num_tokens;
    const int64_t per = (T + num_reducers - 1) / num_reducers;
    const int64_t t_begin = my_index * per, t_end = min(T, t_begin + per);
    const int32_t* send_pos = arr<int32_t>(p, p.a.send_pos);
    const uint16_t* back = reinterpret_cast<const uint16_t*>(p.peers[me] + l.off_back);
    const uint64_t* chunk_flags = reinterpret_cast<const uint64_t*>(p.peers[me] + l.off_chunk_flags);
    const uint64_t deadline = globaltimer_ns() + p.timeout_ns;
    int64_t ready[kHtMaxRanks];
    for (int d = 0; d < R; ++d) ready[d] = -1;
    bool timed_out = false;
    for (int64_t t = t_begin; t < t_end && !timed_out; ++t) {
      const uint16_t* rows[kHtMaxRanks];
      int n = 0;
      for (int d = 0; d < R; ++d) {
        const int32_t pos = send_pos[t * R + d];
        if (pos < 0) continue;
        if (d == me) {
          rows[n++] = p.expert_out + (st.recv_offset[me] + pos) * H;
          continue;
        }
        const int64_t c = pos / kHtChunkRows;
        if (c != ready[d]) {
          int ok = 1;
          if (lane == 0) {
            const uint64_t* flag = chunk_flags + d * C + c;
            while (ld_acquire_sys(flag) < epoch) {
              if (globaltimer_ns() > deadline) {
                ok = 0;
                break;
              }
            }
          }
          ok = __shfl_sync(0xffffffffu, ok, 0);
          __syncwarp();
          if (!ok) {
            if (lane == 0) {
              report_timeout(p, d, kOpCombine);
              st.failed = 1;
            }
            timed_out = true;
            break;
          }
          ready[d] = c;
        }
        rows[n++] = back + (d * l.capacity + pos) * H;
      }
      if (!timed_out) reduce_token(rows, n, p.out + t * H, H, p.io_aligned16, lane);
    }
  }

  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicMax(&st.timeline[kTlCombineEnd], globaltimer_ns());
    __threadfence();
    s_last = atomicAdd(&st.ticket_combine, 1u) == gridDim.x - 1;
    if (s_last) {
      st.ticket_combine = 0;
      st.epoch_combine = epoch;
    }
  }
}

}  // namespace epx::dispatch::ht
