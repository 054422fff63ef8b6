// dispatch/ll/ll_device.cuh: the device helpers of the LL kernels (ll_cuda_kernels.cu and its phase
// headers): the call tags of the chunk signals, the poison word of ll.combine_wait = data, work-item
// arithmetic, the trace stamps, error reports, the bounded waits on flags and words, the FP8
// quantization and the column gather. Memory-order primitives: cuda/primitives.cuh.
#pragma once

#include <cuda_fp8.h>

#include "cuda/primitives.cuh"
#include "dispatch/ll/ll_cuda_kernels.h"
#include "epx/dtype.h"

namespace epx::dispatch {
namespace {

using namespace epx::cuda::dev;

constexpr float kFp8Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;  // quant_cpu.cpp

/// The chunk signals (message expansion): the tag of call n's count words, 1 + (n / 2) % 2. Every call stores every count
/// word (all destinations, all local experts), so a count word of parity n % 2 holds, before call n's
/// value lands, either zeros (never written: tag 0) or call n - 2's value (the other tag: receive n - 2
/// saw that value, so no older one can be seen after it); a source never runs two calls ahead
/// (ll_cuda.h), so the tag identifies call n's value.
__device__ __forceinline__ uint32_t count_tag(unsigned long long call) { return 1u + static_cast<uint32_t>((call >> 1) & 1u); }
/// The chunk signals (message expansion): the slot-token word of call n, (n + 1 mod 2^32) << 32 | t (t < 2^31, or
/// kLlNoToken). These words are stored only for the slots that carry a message (and one scrubbed slot per
/// call, ll_scrub_slot), so unlike the count words a slot's word can be many calls old: a two-valued
/// tag would let call n - 4's token pass as call n's. Accepted only when its high
/// half equals call n's: a stale word is from a call m < n of the same parity whose word was not
/// rewritten since, and n - m <= 2 max_T < 2^32 because every call rewrites slot ll_scrub_slot(n) (a
/// token or kLlNoToken), which visits every slot of a parity within max_T calls of that parity.
constexpr uint32_t kLlNoToken = 0xffffffffu;
/// (`mask`: LlCommon::debug_token_tag_mask, all ones but in the regression test's self-check.)
__device__ __forceinline__ unsigned long long slot_token_word(unsigned long long call, uint32_t t, uint32_t mask) {
  return ((call + 1) & mask) << 32 | t;
}
__device__ __forceinline__ bool slot_token_current(unsigned long long v, unsigned long long call, uint32_t mask) {
  return (v >> 32) == ((call + 1) & mask);
}
/// The slot whose word call n rewrites at every destination whatever the call sends there.
__device__ __forceinline__ int ll_scrub_slot(unsigned long long call, int max_t) { return static_cast<int>((call >> 1) % static_cast<unsigned>(max_t)); }
/// Tests only (LlCommon::debug_block0_delay_ns): the block waits `ns` of globaltimer. Block-wide.
__device__ __noinline__ void debug_block_delay(long long ns) {
  if (threadIdx.x == 0) {
    const unsigned long long t0 = globaltimer();
    while (static_cast<long long>(globaltimer() - t0) < ns) __nanosleep(1000);
  }
  __syncthreads();
}
// ll.combine_wait = data (ll_cuda.h): volatile 16-byte loads / stores of partial rows; every 32-bit
// word is single-copy atomic, and a word equal to kLlPoison means "not arrived".
constexpr uint32_t kLlPoison = 0xffffffffu;
__device__ __forceinline__ bool poisoned(const uint4& v) { return v.x == kLlPoison || v.y == kLlPoison || v.z == kLlPoison || v.w == kLlPoison; }
/// NaN -> the canonical 0x7fffffff (what the GPU's own arithmetic returns), so no partial word (fp32,
/// or a pair of bf16 of canonical NaNs, 0x7fff) is ever kLlPoison.
__device__ __forceinline__ float canon_nan(float a) { return a != a ? __uint_as_float(0x7fffffffu) : a; }

/// a / b and a % b in 32-bit unsigned arithmetic (a few instructions instead of a 64-bit division
/// sequence): work-item indices are < 2^31 (LlCuda checks R x max_T x ceil(H / 256) at create).
__device__ __forceinline__ int udiv(int64_t a, int b) { return static_cast<int>(static_cast<uint32_t>(a) / static_cast<uint32_t>(b)); }
__device__ __forceinline__ int umod(int64_t a, int b) { return static_cast<int>(static_cast<uint32_t>(a) % static_cast<uint32_t>(b)); }

__device__ __forceinline__ unsigned lanemask_of(int i) { return (1u << i) - 1u; }  // bits below i, i < 32

/// x / b for the call counters (x < 2^50, 0 < b <= 1024): a double-precision quotient and one
/// correction each way, instead of the 64-bit integer division sequence.
__device__ __forceinline__ unsigned long long div_blocks(unsigned long long x, unsigned b) {
  unsigned long long q = static_cast<unsigned long long>(__dmul_rz(static_cast<double>(x), __drcp_rn(static_cast<double>(b))));
  if (q * b > x) --q;
  if ((q + 1) * b <= x) ++q;
  return q;
}

/// Timeline of the last call (LlDeviceState::trace, globaltimer ns): block 0's start, the last
/// block's flag stores (atomicMax), block 0's end of waiting, block 0's end.
__device__ __forceinline__ void trace_at(const LlCommon& c, int slot) {
  if (threadIdx.x == 0 && blockIdx.x == 0) c.state->trace[slot] = globaltimer();
}
__device__ __forceinline__ void trace_max(const LlCommon& c, int slot) {
  if (threadIdx.x == 0) atomicMax(&c.state->trace[slot], globaltimer());
}
/// SM clock cycles since (ns0, clk0) of block 0 thread 0, stored as ns0 + cycles (the diagnostics
/// print slot - start: kilocycles where the other slots print microseconds; their ratio is the clock).
__device__ __forceinline__ void trace_clk(const LlCommon& c, int slot, unsigned long long ns0, unsigned long long clk0) {
  if (threadIdx.x == 0 && blockIdx.x == 0) c.state->trace[slot] = ns0 + (clock64() - clk0);
}
/// Diagnostics (kTrDispLoadStart / kTrDispLoadWaited): the round trip [ns] of one dependent load of `p`
/// by block 0's last thread (0 elsewhere), called after that warp's own loads are out (its warp waits
/// for it); the caller stores it relative to block 0's start stamp.
__device__ __forceinline__ unsigned long long load_round_trip(const void* p) {
  if (threadIdx.x != blockDim.x - 1 || blockIdx.x != 0) return 0;
  const unsigned long long t0 = globaltimer();
  const unsigned long long v = ld_volatile_u64(p);
  if (v == 0x5a5a5a5a5a5a5a5aull) return 1;  // a branch on the value: the next stamp waits for it
  return globaltimer() - t0;
}
/// Up to 8 16-byte loads issued back to back (one round trip), n <= 8.
__device__ __forceinline__ void ld16_batch(const uint8_t* p, int n, uint4 (&v)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (i < n) v[i] = ld16(p + 16 * i);
}
__device__ __forceinline__ int32_t word_of(const uint4 (&v)[8], int k) {
  const uint4 q = v[k >> 2];
  const int r = k & 3;
  return static_cast<int32_t>(r == 0 ? q.x : r == 1 ? q.y : r == 2 ? q.z : q.w);
}

/// First reporter wins; the host reads `kind` last.
__device__ __noinline__ void report(const LlCommon& c, int kind, int peer, int op, long long value, long long index) {
  if (atomicCAS(&c.state->error_claim, 0, 1) != 0) return;
  volatile LlErrorReport* e = c.error;
  e->peer = peer;
  e->op = op;
  e->value = value;
  e->index = index;
  __threadfence_system();
  e->kind = kind;
  __threadfence_system();
}

/// Block-wide: waits until every flag of every source (one 8-byte word per (source s, send block
/// b < src_blocks[s]) at base_of(s) + 8 b) reached `target`, one flag per thread where the block has
/// enough threads, so the wait ends about one round trip after the last flag lands (a warp per
/// source walking its ~B/32 flags in turn took several). Acquire loads, then the caller's
/// __syncthreads() (NCCL-DEVICE-API.md rule 4). s_bad[s] = 1 when a wait on source s timed out
/// (reported, naming s), 2 when its flag carried kLlFlagRejected (combine flags only; compared without
/// the bit); the caller clears s_bad before and syncs after. `on_block0(s)` runs right
/// after the acquire of (s, 0) (the dispatch reads the message count that block 0 released).
template <class BaseOf, class OnBlock0>
__device__ void wait_all_flags(const LlCommon& c, BaseOf base_of, unsigned long long target, int op, unsigned long long call, int* s_bad,
                               OnBlock0 on_block0) {
  const int R = c.lay.num_ranks;
  for (int i = threadIdx.x; i < R * LlLayout::kMaxSignalBlocks; i += blockDim.x) {
    const int s = i / LlLayout::kMaxSignalBlocks, b = i - s * LlLayout::kMaxSignalBlocks;
    if (b >= c.src_blocks[s]) continue;
    const void* f = base_of(s) + 8 * static_cast<int64_t>(b);
    bool timing = false, ok = true;
    unsigned long long start = 0, v;
    while (((v = ld_acquire_sys(f)) & ~kLlFlagRejected) < target) {
      if (!timing) {
        start = globaltimer();
        timing = true;
      } else if (static_cast<long long>(globaltimer() - start) > c.timeout_ns) {
        report(c, LlErrorReport::timeout, s, op, static_cast<long long>(call), static_cast<long long>(ld_relaxed_sys_u64(f)));
        ok = false;
        break;
      }
    }
    if (!ok) {
      s_bad[s] = 1;
      continue;
    }
    if (v & kLlFlagRejected) s_bad[s] = 2;
    if (b == 0) on_block0(s);
  }
}

/// The combine receive, after wait_all_flags and its __syncthreads: the first source whose flags carried
/// kLlFlagRejected (-1: none). This rank's own rejected call (LlCombineParams::rejected) reports nothing:
/// its host already threw. Otherwise thread 0 reports LlErrorReport::peer_rejected (first reporter wins);
/// the caller then writes NaN into out (acc starts at NaN). Block-uniform (shared s_bad; whole warps).
__device__ __forceinline__ int combine_rejected_source(const LlCombineParams& p, const int* s_bad, unsigned long long call) {
  const int l = threadIdx.x & 31;  // R <= 32: one shared load per lane and a ballot
  const unsigned m = __ballot_sync(0xffffffffu, l < p.c.lay.num_ranks && s_bad[l] == 2);
  const int rej = m ? __ffs(m) - 1 : -1;
  if (rej >= 0 && !p.rejected && threadIdx.x == 0) report(p.c, LlErrorReport::peer_rejected, rej, LlErrorReport::combine, static_cast<long long>(call), 0);
  return rej;
}

/// The chunk signals (message expansion): v = load() until ok(v), bounded by timeout_ns (globaltimer). `v` holds a first
/// value already loaded by the caller. On a timeout reports (naming source s), sets s_bad[s] and
/// returns false; so does a wait that finds s_bad[s] set by another thread of the block (one timeout
/// per source and block, not one per waiting warp).
template <class Load, class Ok>
__device__ __forceinline__ bool poll_word(const LlCommon& c, Load load, Ok ok, int s, int op, unsigned long long call, volatile int* s_bad,
                                          unsigned long long& v) {
  if (ok(v)) return true;
  const unsigned long long start = globaltimer();
  while (true) {
    v = load();
    if (ok(v)) return true;
    if (s_bad[s]) return false;
    if (static_cast<long long>(globaltimer() - start) > c.timeout_ns) {
      report(c, LlErrorReport::timeout, s, op, static_cast<long long>(call), static_cast<long long>(v));
      s_bad[s] = 1;
      return false;
    }
  }
}

__device__ __forceinline__ float round_up_pow2(float s) {
  uint32_t u = __float_as_uint(s);
  if (u & 0x007fffffu) u = (u & 0xff800000u) + 0x00800000u;
  return __uint_as_float(u);
}
/// a / b for the FP8 quantization, given y = __frcp_rn(b), finite a and a finite normal b: q0 = a y,
/// then two Markstein corrections r = a - b q (exact by fma), q += r y. The result equals
/// __fdiv_rn(a, b) wherever |a / b| >= 2^-12 (Markstein's theorem: y within half an ulp, q within
/// one); below that the residual can underflow and the last bit may differ, but such quotients
/// convert to the same e4m3 value, a zero of a's sign (checked against IEEE division on 6.3e7 random
/// bf16 inputs and group scales; bench/NOTES.md, 'LL dispatch front, FP8 quotients'). a = -0 keeps its sign (a y).
__device__ __forceinline__ float quotient_rn(float a, float b, float y) {
  const float q0 = __fmul_rn(a, y);
  const float q1 = __fmaf_rn(__fmaf_rn(-q0, b, a), y, q0);
  const float q2 = __fmaf_rn(__fmaf_rn(-q1, b, a), y, q1);
  return a == 0.0f ? q0 : q2;
}
__device__ __forceinline__ uint32_t fp8x2(float a, float b) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ int64_t load_id(const LlDispatchParams& p, int64_t i) {
  return p.idx64 ? static_cast<const int64_t*>(p.topk_idx)[i] : static_cast<const int32_t*>(p.topk_idx)[i];
}

/// The column mode's receive gather: acc += w_k * row_k for the lanes' columns k with my_row >= 0, in
/// column order, fp32 with separate roundings; 4 rows' 16-byte loads in flight per round trip.
/// row_at(r) is the address of this lane's 8 bf16 elements of row r.
template <class RowAt>
__device__ __forceinline__ void gather_columns(int32_t my_row, float my_w, bool ok, RowAt row_at, float (&acc)[8]) {
  unsigned live = __ballot_sync(0xffffffffu, my_row >= 0);
  while (live) {
    uint4 y[4];
    int f[4];
    float w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int k = live ? __ffs(live) - 1 : 0;
      f[j] = __shfl_sync(0xffffffffu, my_row, k);
      w[j] = __shfl_sync(0xffffffffu, my_w, k);
      if (!live) f[j] = -1;
      live &= live - 1;
      y[j] = make_uint4(0, 0, 0, 0);
      if (f[j] >= 0 && ok) y[j] = ld16(row_at(f[j]));
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (f[j] < 0) continue;  // select, not multiply: a -1 column adds nothing
      float yf[8];
      bf16x8_to_float(y[j], yf);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w[j], yf[i]));
    }
  }
}


/// Chunks per run so that `rows` x runs covers about `warps` warps: in [1, kMax].
__device__ __forceinline__ int chunks_per_run(int nch, int64_t rows, int64_t warps, int kMax) {
  int64_t cpr = (rows * nch + warps - 1) / (warps > 0 ? warps : 1);
  cpr = cpr < 1 ? 1 : cpr > kMax ? kMax : cpr;
  return static_cast<int>(cpr < nch ? cpr : nch);
}


}  // namespace
}  // namespace epx::dispatch
