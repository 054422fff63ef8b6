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
/// Flag words [3][R] (uint64 epochs) in each rank's buffer, word (f, s) written by source s:
/// counts published (layout), dispatch rows stored, and combine done: s has finished reading its own
/// `back` block for that combine epoch, so its peers may overwrite it (the next combine's sends).
enum Flag : int { kFlagCounts = 0, kFlagDispatch = 1, kFlagCombineDone = 2 };

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
__device__ __forceinline__ void st_release_gpu(int32_t* p, int32_t v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int32_t ld_acquire_gpu(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
/// Programmatic dependent launch (sm_90): let the dependent grid (the dispatch kernel) be scheduled /
/// wait until the grids this one depends on have completed and their memory is visible. No-ops
/// without such a launch.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
/// Asks the TMA unit to bring `bytes` (a multiple of 16, 16-byte aligned) at `src` into L2; no-op before sm_90.
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
#endif
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

/// Index of this warp with consecutive indices in different CTAs (warp w of CTA b -> w * gridDim + b):
/// work dealt round-robin by this index spreads over every SM of the budget, not over the first CTAs.
__device__ __forceinline__ int64_t spread_warp_index() {
  return static_cast<int64_t>(threadIdx.x >> 5) * gridDim.x + blockIdx.x;
}


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
  HtState& st = state_of(p);
  int32_t* expert_counts = arr<int32_t>(p, p.a.expert_counts);
  int32_t* cached_idx = arr<int32_t>(p, p.a.cached_idx);
  int32_t* send_pos = arr<int32_t>(p, p.a.send_pos);
  int32_t* send_tok = arr<int32_t>(p, p.a.send_tok);
  uint8_t* in_rank = arr<uint8_t>(p, p.a.is_token_in_rank);

  __shared__ int s_warp[32];
  __shared__ unsigned long long s_bad;
  __shared__ int s_rows[kHtMaxRanks];
  __shared__ int s_valid, s_fail, s_differs, s_contig, s_bad_tokens, s_bad_tokens_value;
  __shared__ int64_t s_T;
  __shared__ uint64_t s_epoch;
  extern __shared__ int s_counts[];  // [R * Lmax], then the slots' copy [R, R + 2 + Lmax] (step 5)

  if (threadIdx.x == 0) {
    // The dispatch kernel (programmatic dependent launch) may start once this CTA has passed
    // pdl_launch_dependents below; it polls layout_ready, so clear it first.
    st.layout_ready = 0;
    for (int i = 0; i < kTlCount; ++i)
      st.timeline[i] = (i == kTlDispatchStart || i == kTlCombineStart || i == kTlDispatchReady) ? ~0ull : 0ull;
    st.timeline[kTlLayoutStart] = globaltimer_ns();
    __threadfence();
    s_epoch = st.epoch_dispatch + 1;
    s_bad = ULLONG_MAX;
    s_valid = 0;
    s_fail = 0;
    s_contig = 0;
    // T: the device token count when given (0 <= value <= x.shape[0], else a bad argument: nothing moves).
    int64_t t_now = p.num_tokens;
    s_bad_tokens = 0;
    s_bad_tokens_value = 0;
    if (p.num_tokens_dev) {
      const int32_t v = *p.num_tokens_dev;
      s_bad_tokens = v < 0 || v > p.num_tokens;
      s_bad_tokens_value = v;
      t_now = s_bad_tokens ? 0 : v;
    }
    s_T = t_now;
    st.num_tokens = static_cast<int32_t>(t_now);
    s_differs = !(st.cache_valid && st.cache_tokens == t_now) || p.local_status != 0 || s_bad_tokens;
  }
  __syncthreads();
  pdl_launch_dependents();
  const int64_t T = s_T;
  const uint64_t epoch = s_epoch;
  const uint64_t deadline = globaltimer_ns() + p.timeout_ns;

  // 1. Same routing as the cached layout? (ids are compared as the cache stores them: int32)
  if (!s_differs) {
    bool differs = false;
    if (!p.idx_is_i64 && reinterpret_cast<uintptr_t>(p.topk_idx) % 16 == 0 && (T * K) % 4 == 0) {
      // int32 ids, 16-byte vectors: 8 loads per thread at ht-v3 (32 K ids), all in flight at once.
      const int4* a = reinterpret_cast<const int4*>(p.topk_idx);
      const int4* b = reinterpret_cast<const int4*>(cached_idx);
#pragma unroll 8
      for (int64_t i = threadIdx.x; i < T * K / 4; i += blockDim.x) {
        const int4 x = a[i], y = b[i];
        differs |= x.x != y.x || x.y != y.y || x.z != y.z || x.w != y.w;
      }
    } else {
#pragma unroll 8
      for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x) differs |= load_id(p.topk_idx, p.idx_is_i64, i) != cached_idx[i];
    }
    if (__syncthreads_or(differs) && threadIdx.x == 0) s_differs = 1;
    __syncthreads();
  }
  const bool hit = !s_differs;
  int32_t status = s_bad_tokens ? 1 : p.local_status;

  // 2. Validate and plan (DedupCpu::plan), unless cached.
  if (!hit && status == 0) {
    for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x) {
      const int64_t v = load_id(p.topk_idx, p.idx_is_i64, i);
      if (!l.placement.valid_id(v, i % K, K)) atomicMin(&s_bad, static_cast<unsigned long long>(i));
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
          if (goes) send_tok[d * l.capacity + base + before] = static_cast<int32_t>(t);
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
  if (threadIdx.x == 0) st.timeline[kTlLayoutPlanned] = globaltimer_ns();

  // 3. Publish this rank's slot to every rank (itself included), then the counts flag.
  for (int d = 0; d < R; ++d) {
    int32_t* slot = reinterpret_cast<int32_t*>(p.peers[d] + l.slot_offset(epoch, me));
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
    st.timeline[kTlLayoutPublished] = globaltimer_ns();
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
      __threadfence();
      st_release_gpu(&st.layout_ready, 1);
      __threadfence_system();
      *reinterpret_cast<volatile uint64_t*>(&p.record->layout_epoch) = epoch;
    }
    return;
  }
  if (threadIdx.x == 0) st.timeline[kTlLayoutCountsSeen] = globaltimer_ns();

  // 5. Derive: count matrix, rank prefix matrix, offsets, N_recv, aligned per-expert counts, from a
  // copy of the R slots in shared memory (one parallel load instead of thread 0's chain of loads).
  const int32_t* my_slots = reinterpret_cast<const int32_t*>(p.peers[me] + l.slot_offset(epoch, 0));
  const int slot_words = R + 2 + Lmax;
  int* s_slots = s_counts + R * Lmax;  // [R, slot_words]
  for (int i = threadIdx.x; i < R * slot_words; i += blockDim.x) s_slots[i] = my_slots[(i / slot_words) * (l.slot_bytes / 4) + i % slot_words];
  __syncthreads();
  auto slot_word = [&](int s, int i) { return s_slots[s * slot_words + i]; };
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
    atomicAdd(&s_contig, recv_count[e]);
  }
  __syncthreads();
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
    st.epoch_dispatch = epoch;
    st.timeline[kTlLayoutEnd] = globaltimer_ns();
    // Everything the dispatch kernel reads is in place: release it (gpu scope), then the host record
    // (host-mapped writes and their system fence, off the dispatch's critical path).
    __threadfence();
    st_release_gpu(&st.layout_ready, 1);
    HtHostRecord* rec = p.record;
    // The bad-argument details are written only by a bad layout, and stay until the next bad one (bad_epoch
    // below): a later good layout must not erase a verdict the host has not read yet (worst-case mode reads
    // it after a later launch, or after graph replays).
    if (any_bad) {
      rec->bad_num_tokens = s_bad_tokens;
      rec->bad_num_tokens_value = s_bad_tokens_value;
      rec->bad_rank = bad_rank;
      rec->bad_index = s_bad == ULLONG_MAX ? -1 : static_cast<int64_t>(s_bad);
    }
    rec->num_recv = off;
    rec->any_bad = any_bad;
    rec->cache_hit = hit;
    rec->valid_selections = any_bad ? 0 : st.valid_selections;
    rec->dedup_rows = any_bad ? 0 : st.dedup_rows;
    rec->rows_to_self = any_bad ? 0 : st.rows_to[me];
    rec->rows_from_others = any_bad ? 0 : off - slot_word(me, me);
    rec->contig_rows = s_contig;
    st.timeline[kTlLayoutRecord] = globaltimer_ns();
    __threadfence_system();
    if (any_bad) *reinterpret_cast<volatile uint64_t*>(&rec->bad_epoch) = epoch;
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

/// Launched right behind the layout kernel (programmatic dependent launch, or plainly): waits for
/// HtState::layout_ready (bounded), meanwhile (HtParams::prefetch_x) asks L2 for this warp's first row of x.
__device__ __forceinline__ bool wait_layout_ready(const HtParams& p) {
  HtState& st = state_of(p);
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    atomicMin(&st.timeline[kTlDispatchStart], globaltimer_ns());
    // The layout kernel's own waits end within timeout_s of its start; twice that bounds this one.
    const uint64_t deadline = globaltimer_ns() + 2 * p.timeout_ns;
    int ok = 1;
    while (ld_acquire_gpu(&st.layout_ready) == 0) {
      if (globaltimer_ns() > deadline) {
        ok = 0;
        break;
      }
    }
    if (!ok) {
      report_timeout(p, p.l.rank, kOpDispatch);
      st.failed = 1;
    } else {
      atomicMin(&st.timeline[kTlDispatchReady], globaltimer_ns());
    }
    s_ok = ok;
  }
  // Meanwhile: this warp's first row of x into L2 (rows < x.shape[0] exist whatever num_tokens says).
  const int64_t t0 = blockIdx.x * static_cast<int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t row_bytes = 2 * p.l.hidden;
  if (p.prefetch_x && (threadIdx.x & 31) == 0 && t0 < p.num_tokens && p.x_aligned16 && row_bytes % 16 == 0 && row_bytes < (1 << 20))
    prefetch_l2(p.x + t0 * p.l.hidden, static_cast<uint32_t>(row_bytes));
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

/// reduce_token for exactly two rows (16-byte aligned): both rows' U vectors per lane are loaded
/// before any is summed (2U loads in flight, one memory latency per step instead of two); the sums are
/// the same operations in the same order as the general path (acc = 0.0f, += row 0, += row 1).
template <int U>
__device__ __forceinline__ void reduce_two_rows(const uint4* r0, const uint4* r1, uint4* out, int64_t n16, int lane) {
  for (int64_t base = 0; base < n16; base += 32 * U) {
    uint4 a[U], b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < n16) {
        a[u] = r0[i];
        b[u] = r1[i];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i >= n16) continue;
      const uint32_t wa[4] = {a[u].x, a[u].y, a[u].z, a[u].w}, wb[4] = {b[u].x, b[u].y, b[u].z, b[u].w};
      uint32_t o[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float lo = 0.0f, hi = 0.0f;
        lo += lo_f(wa[q]);
        hi += hi_f(wa[q]);
        lo += lo_f(wb[q]);
        hi += hi_f(wb[q]);
        o[q] = static_cast<uint32_t>(float_to_bf16_bits(lo)) | (static_cast<uint32_t>(float_to_bf16_bits(hi)) << 16);
      }
      out[i] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

/// out[t] = round_bf16(sum over destinations d in rank order that token t went to of partial_d), fp32
/// from 0.0f (DedupCpu::finalize); `rows` in destination-rank order.
__device__ __forceinline__ void reduce_token(const uint16_t* const* rows, int n, uint16_t* out, int64_t H, bool aligned, int lane) {
  if (aligned && n == 2) {  // the common case at 2 ranks (Flat: self + peer; expert-contiguous: both)
    reduce_two_rows<4>(reinterpret_cast<const uint4*>(rows[0]), reinterpret_cast<const uint4*>(rows[1]), reinterpret_cast<uint4*>(out), H / 8, lane);
    return;
  }
  if (aligned) {
    const int64_t n16 = H / 8;
    constexpr int U = 2;
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

/// reduce_token with fp32 partials (flat_combine partial_fp32) and/or an addend: out = round_bf16(sum over
/// the rows in order, fp32 from 0.0f, then + addend), as DedupCpu::finalize; bf16 rows with an addend:
/// the sum is rounded to bf16 before the addend joins (partial_bf16, CpuPrepareFinalize::finish_rows).
/// aligned: every row, addend and out 16-byte aligned and H % 8 == 0 (8 elements per lane and step).
__device__ __forceinline__ void reduce_token_any(const uint16_t* const* rows, int n, bool f32, const float* addend, uint16_t* out,
                                                 int64_t H, bool aligned, int lane) {
  if (aligned) {
    const int64_t n8 = H / 8;
    for (int64_t i = lane; i < n8; i += 32) {
      float acc[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = 0.0f;
      for (int j = 0; j < n; ++j) {
        if (f32) {
          const float4* r = reinterpret_cast<const float4*>(rows[j]) + 2 * i;
          const float4 a = r[0], b = r[1];
          acc[0] += a.x, acc[1] += a.y, acc[2] += a.z, acc[3] += a.w;
          acc[4] += b.x, acc[5] += b.y, acc[6] += b.z, acc[7] += b.w;
        } else {
          const uint4 v = reinterpret_cast<const uint4*>(rows[j])[i];
          const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            acc[2 * q] += lo_f(w[q]);
            acc[2 * q + 1] += hi_f(w[q]);
          }
        }
      }
      if (addend) {
        const float4* a4 = reinterpret_cast<const float4*>(addend) + 2 * i;
        const float4 a = a4[0], b = a4[1];
        const float av[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          if (!f32) acc[q] = bf16_bits_to_float(float_to_bf16_bits(acc[q]));
          acc[q] += av[q];
        }
      }
      uint32_t o[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        o[q] = static_cast<uint32_t>(float_to_bf16_bits(acc[2 * q])) | (static_cast<uint32_t>(float_to_bf16_bits(acc[2 * q + 1])) << 16);
      reinterpret_cast<uint4*>(out)[i] = make_uint4(o[0], o[1], o[2], o[3]);
    }
    return;
  }
  for (int64_t i = lane; i < H; i += 32) {
    float acc = 0.0f;
    for (int j = 0; j < n; ++j) acc += f32 ? reinterpret_cast<const float*>(rows[j])[i] : bf16_bits_to_float(rows[j][i]);
    if (addend) {
      if (!f32) acc = bf16_bits_to_float(float_to_bf16_bits(acc));
      acc += addend[i];
    }
    out[i] = float_to_bf16_bits(acc);
  }
}

/// expert-contiguous: the partial of received row n at vector index i, 8 fp32 values = sum over k in
/// order with pair_row[n,k] >= 0 of w[n,k] * y[pair_row[n,k]] in fp32 from 0.0f (products and sums
/// rounded separately, no contraction: HtCpu); w = 1 unweighted.
__device__ __forceinline__ void partial8_f32(const HtParams& p, int64_t n, int64_t i, float* acc) {
  const int64_t H = p.l.hidden;
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] = 0.0f;
  const int K = p.l.top_k;
  for (int k = 0; k < K; ++k) {
    const int32_t m = p.pair_row[n * K + k];
    if (m < 0) continue;
    const float w = p.combine_weights ? p.combine_weights[n * K + k] : 1.0f;
    const uint4 v = reinterpret_cast<const uint4*>(p.expert_out + m * H)[i];
    const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(w, lo_f(wv[q])));
      acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(w, hi_f(wv[q])));
    }
  }
}

/// Partial row of received row n, 8 bf16 at vector index i (16 bytes): Flat = expert_out[n] as is;
/// expert-contiguous = round_bf16(sum over k in order with pair_row[n,k] >= 0 of w[n,k] * y[pair_row[n,k]])
/// in fp32 from 0.0f (products and sums rounded separately, no contraction: HtCpu); w = 1 unweighted.
__device__ __forceinline__ uint4 partial8(const HtParams& p, int64_t n, int64_t i) {
  const int64_t H = p.l.hidden;
  if (!p.pair_row) return reinterpret_cast<const uint4*>(p.expert_out + n * H)[i];
  float acc[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] = 0.0f;
  const int K = p.l.top_k;
  for (int k = 0; k < K; ++k) {
    const int32_t m = p.pair_row[n * K + k];
    if (m < 0) continue;
    const float w = p.combine_weights ? p.combine_weights[n * K + k] : 1.0f;
    const uint4 v = reinterpret_cast<const uint4*>(p.expert_out + m * H)[i];
    const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(w, lo_f(wv[q])));
      acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(w, hi_f(wv[q])));
    }
  }
  uint32_t o[4];
#pragma unroll
  for (int q = 0; q < 4; ++q)
    o[q] = static_cast<uint32_t>(float_to_bf16_bits(acc[2 * q])) | (static_cast<uint32_t>(float_to_bf16_bits(acc[2 * q + 1])) << 16);
  return make_uint4(o[0], o[1], o[2], o[3]);
}

/// One warp stores the partial row of received row n to dst: Flat = a copy (copy_row_bf16, 8 vectors
/// per lane in flight); expert-contiguous = partial8, 2 vectors per lane in flight (it reads K rows
/// per vector, so fewer are needed to cover the latency, and registers stay free).
/// fp32 partials (partial_f32): the row is 2H uint16 words, the expert-contiguous partial stays fp32.
__device__ __forceinline__ void send_partial(const HtParams& p, int64_t n, uint16_t* dst, int lane) {
  const int64_t H = p.l.hidden, ew = p.partial_f32 ? 2 : 1;
  if (!p.pair_row) {
    copy_row_bf16(dst, p.expert_out + n * H * ew, H * ew, p.io_aligned16, lane);
    return;
  }
  const int64_t n16 = H / 8;
  if (p.partial_f32) {
    for (int64_t i = lane; i < n16; i += 32) {
      float acc[8];
      partial8_f32(p, n, i, acc);
      float4* d = reinterpret_cast<float4*>(dst) + 2 * i;
      d[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      d[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
    return;
  }
  constexpr int U = 2;
  for (int64_t base = 0; base < n16; base += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < n16) v[u] = partial8(p, n, i);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < n16) reinterpret_cast<uint4*>(dst)[i] = v[u];
    }
  }
}

/// Combine destinations of one token: which ranks' rows are summed, in rank order.
struct CombineCtx {
  int R, me, nt;             ///< ranks, this rank, targets
  int target_slot[kHtMaxRanks];  ///< slot of rank d among the targets (-1: not a target)
  int64_t C;                 ///< flags per source in chunk_flags
  int chunk_rows;
  uint64_t epoch, deadline;
};

/// Reduces token t: its rows from every destination d in rank order; rows from a target d (a rank
/// whose rows travel through `back`) wait for their chunk flag first (bounded). False on timeout.
/// ready[d]: the chunk of source d last seen released (a chunk's flag is polled once per warp).
__device__ __forceinline__ bool reduce_one(const HtParams& p, const CombineCtx& cx, int64_t t, int64_t* ready, int lane) {
  const HtLayout& l = p.l;
  const HtState& st = state_of(p);
  const int64_t H = l.hidden, HW = H * (p.partial_f32 ? 2 : 1);  // HW: a partial row in uint16 words
  const int32_t* send_pos = arr<int32_t>(p, p.a.send_pos);
  const uint16_t* back = reinterpret_cast<const uint16_t*>(p.peers[cx.me] + l.off_back);
  const uint64_t* chunk_flags = reinterpret_cast<const uint64_t*>(p.peers[cx.me] + l.off_chunk_flags);
  const uint16_t* rows[kHtMaxRanks];
  int n = 0;
  for (int d = 0; d < cx.R; ++d) {
    const int32_t pos = send_pos[t * cx.R + d];
    if (pos < 0) continue;
    if (cx.target_slot[d] < 0) {  // Flat, d == me: read in place
      rows[n++] = p.expert_out + (st.recv_offset[cx.me] + pos) * HW;
      continue;
    }
    const int64_t chunk = pos / cx.chunk_rows;
    if (ready[d] == chunk) {
      rows[n++] = back + (d * l.capacity + pos) * HW;
      continue;
    }
    int ok = 1;
    if (lane == 0) {
      const uint64_t* flag = chunk_flags + d * cx.C + chunk;
      while (ld_acquire_sys(flag) < cx.epoch) {
        if (globaltimer_ns() > cx.deadline) {
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
        state_of(p).failed = 1;
      }
      return false;
    }
    ready[d] = chunk;
    rows[n++] = back + (d * l.capacity + pos) * HW;
  }
  if (p.partial_f32 || p.addend)
    reduce_token_any(rows, n, p.partial_f32, p.addend ? p.addend + t * H : nullptr, p.out + t * H, H, p.io_aligned16, lane);
  else
    reduce_token(rows, n, p.out + t * H, H, p.io_aligned16, lane);
  return true;
}

/// Combine (one kernel, every warp does both halves; file comment of ht_cuda.h).
/// Targets: the ranks whose partial rows come back through `back` (every remote rank; this rank too
/// with the expert-contiguous layout, whose partials are computed, not read in place). Items: (chunk
/// c of chunk_rows rows, target slot), item = c * nt + slot; item i's send half stores the partials of
/// received rows [c * chunk_rows, ...) of source `target` into target's back block and releases that
/// chunk's flag there; its reduce half sums this rank's tokens whose first target row lies in the
/// same chunk (send_tok: the inverse of send_pos). Warps are numbered CTA-major (spread_warp_index).
///   mode 0: every warp sends all its items, then reduces all its items (no wait on its own GPU
///           before its sends are out);
///   mode 1 (pipelined; only with one target per token, else mode 0): round k: send item k * W + w,
///           then reduce item (k - 1) * W + w (the peer's warp w sent it one round earlier).
/// Then tokens with no target row (Flat: only this rank, or nowhere) are reduced by contiguous ranges.
/// Waits assume the grid is resident on every rank (grid <= SMs); a wait that expires reports Timeout.
/// The last CTA (ticket) advances the combine epoch.
__global__ void __launch_bounds__(kMaxThreads) combine_kernel(HtParams p) {
  HtState& st = state_of(p);
  if (st.failed || st.any_bad) return;
  const HtLayout& l = p.l;
  const int R = l.num_ranks, me = l.rank;
  const int64_t H = l.hidden;
  const int lane = threadIdx.x & 31;
  const int64_t W = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t wi = spread_warp_index();
  if (threadIdx.x == 0) atomicMin(&st.timeline[kTlCombineStart], globaltimer_ns());
  CombineCtx cx;
  cx.R = R;
  cx.me = me;
  cx.nt = 0;
  const bool contig = p.pair_row != nullptr;
  for (int d = 0; d < R; ++d) cx.target_slot[d] = (d != me || contig) ? cx.nt++ : -1;
  cx.C = l.capacity;  // one flag per row: chunk index < ceil(cap / chunk_rows) <= cap
  cx.chunk_rows = p.chunk_rows;
  cx.epoch = st.epoch_combine + 1;
  cx.deadline = globaltimer_ns() + p.timeout_ns;
  const int32_t* send_pos = arr<int32_t>(p, p.a.send_pos);
  const int32_t* send_tok = arr<int32_t>(p, p.a.send_tok);
  // Before any store into a peer's `back`: that peer has finished reading it in the previous combine
  // (its "combine done" flag, published by its last CTA). One poll per CTA; in the prepare/finalize
  // sequence it passed long ago (the dispatch handshake already orders it), so this costs one load.
  {
    __shared__ int s_fail;
    if (threadIdx.x == 0) s_fail = 0;
    __syncthreads();
    if (threadIdx.x < R && static_cast<int>(threadIdx.x) != me &&
        !wait_flag(p, kFlagCombineDone, threadIdx.x, cx.epoch - 1, cx.deadline)) {
      report_timeout(p, threadIdx.x, kOpCombine);
      st.failed = 1;
      s_fail = 1;
    }
    __syncthreads();
    if (s_fail) return;
  }
  int64_t max_rows = 0;
  for (int d = 0; d < R; ++d)
    if (cx.target_slot[d] >= 0)
      max_rows = max(max_rows, static_cast<int64_t>(max(st.recv_offset[d + 1] - st.recv_offset[d], st.rows_to[d])));
  const int64_t CR = cx.chunk_rows;
  const int64_t items = (max_rows + CR - 1) / CR * cx.nt;
  int target_of_slot[kHtMaxRanks];
  for (int d = 0; d < R; ++d)
    if (cx.target_slot[d] >= 0) target_of_slot[cx.target_slot[d]] = d;

  auto send_item = [&](int64_t i) {
    const int64_t c = i / cx.nt;
    const int s = target_of_slot[i % cx.nt];
    const int64_t count = st.recv_offset[s + 1] - st.recv_offset[s];
    const int64_t j_end = min(count, (c + 1) * CR);
    if (c * CR >= j_end) return;
    const int64_t HW = H * (p.partial_f32 ? 2 : 1);  // a partial row in uint16 words (fp32: two per element)
    if (!p.pair_row) {
      // Flat: the chunk's rows are contiguous on both sides (expert_out rows recv_offset[s] + j, back
      // rows me * cap + j): one copy of (j_end - c * CR) rows keeps every lane's vectors in flight.
      uint16_t* dst = reinterpret_cast<uint16_t*>(p.peers[s] + l.off_back) + (me * l.capacity + c * CR) * HW;
      copy_row_bf16(dst, p.expert_out + (st.recv_offset[s] + c * CR) * HW, (j_end - c * CR) * HW, p.io_aligned16, lane);
    } else {
      for (int64_t j = c * CR; j < j_end; ++j) {
        uint16_t* dst = reinterpret_cast<uint16_t*>(p.peers[s] + l.off_back) + (me * l.capacity + j) * HW;
        send_partial(p, st.recv_offset[s] + j, dst, lane);
      }
    }
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();
      st_release_sys(reinterpret_cast<uint64_t*>(p.peers[s] + l.off_chunk_flags) + me * cx.C + c, cx.epoch);
    }
  };
  bool ok = true;
  int64_t ready[kHtMaxRanks];
  for (int d = 0; d < R; ++d) ready[d] = -1;
  auto reduce_item = [&](int64_t i) {
    const int64_t c = i / cx.nt;
    const int d = target_of_slot[i % cx.nt];
    const int64_t j_end = min(static_cast<int64_t>(st.rows_to[d]), (c + 1) * CR);
    for (int64_t j = c * CR; j < j_end && ok; ++j) {
      const int64_t t = send_tok[d * l.capacity + j];
      int first = -1;  // the token's first target in rank order owns it
      for (int e = 0; e < R && first < 0; ++e)
        if (cx.target_slot[e] >= 0 && send_pos[t * R + e] >= 0) first = e;
      if (first == d) ok = reduce_one(p, cx, t, ready, lane);
    }
  };

  // Pipelined only where every token has at most one target (Flat at 2 ranks): a reduce then waits
  // only for the item of the same index on the peer, sent one round earlier by the peer's same warp.
  // With two targets per token (expert-contiguous: self + peer, or R > 2) a token's second chunk
  // can belong to a later round on the other rank, and two warps could wait on each other: mode 0.
  if (p.combine_mode == 1 && cx.nt == 1) {
    for (int64_t k = 0; ok; ++k) {
      const int64_t i_send = k * W + wi, i_red = (k - 1) * W + wi;
      if (i_send >= items && (k == 0 || i_red >= items)) break;
      if (i_send < items) send_item(i_send);
      if (k >= 1 && i_red < items) reduce_item(i_red);
    }
  } else {
    for (int64_t i = wi; i < items; i += W) send_item(i);
    for (int64_t i = wi; i < items && ok; i += W) reduce_item(i);
  }
  if (lane == 0) atomicMax(&st.timeline[kTlCombineSent], globaltimer_ns());

  // Tokens without a target row: Flat rows that stayed on this rank (or went nowhere: zeros).
  const int64_t T = st.num_tokens;
  const int64_t per = (T + W - 1) / W;
  const int64_t t_begin = wi * per, t_end = min(T, t_begin + per);
  for (int64_t t = t_begin; t < t_end && ok; ++t) {
    bool any = false;
    for (int e = 0; e < R; ++e) any |= cx.target_slot[e] >= 0 && send_pos[t * R + e] >= 0;
    if (!any) ok = reduce_one(p, cx, t, ready, lane);
  }

  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicMax(&st.timeline[kTlCombineEnd], globaltimer_ns());
    __threadfence();
    s_last = atomicAdd(&st.ticket_combine, 1u) == gridDim.x - 1;
    if (s_last) {
      st.ticket_combine = 0;
      st.epoch_combine = cx.epoch;
      // Every CTA has finished reading `back` (the ticket): the peers' next combine may overwrite it.
      __threadfence_system();
      for (int d = 0; d < R; ++d)
        if (d != me) st_release_sys(flag_ptr(p, d, kFlagCombineDone, me), cx.epoch);
    }
  }
}

}  // namespace epx::dispatch::ht
