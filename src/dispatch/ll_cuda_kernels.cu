// dispatch/ll_cuda_kernels.cu: the LL dispatch and combine kernels (one kernel per phase, all
// blocks resident, warps on 512-element chunks of a row, 16-byte loads and stores straight into the
// peers' symmetric buffers through their LSA pointers). Protocol: ll_cuda.h; layout: ll_layout.h.
//
// Memory ordering (NCCL-DEVICE-API.md §3): payload stores are weak; each block ends its send part
// with __syncthreads() and then one thread per destination issues st.release.sys on the block's own
// flag word there (cumulative release, as NCCL's own barrier does). Receivers poll with
// ld.acquire.sys, one flag per thread (wait_all_flags), __syncthreads(), then read the payload with
// ordinary (coherent) loads, never ld.global.nc.
// Arithmetic matches the CPU reference bit for bit: the FP8 1x128 quantization of quant_cpu.cpp
// (fmaxf amax, IEEE divisions, UE8M0 from the bits, RNE + saturation) and the combine's
// acc = acc + w * y in fp32 with separate roundings (__fmul_rn / __fadd_rn: no FMA contraction).
#include <cuda_fp8.h>

#include "cuda/check.h"
#include "dispatch/ll_cuda_kernels.h"
#include "epx/dtype.h"
#include "epx/error.h"

namespace epx::dispatch {
namespace {

constexpr float kFp8Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;  // quant_cpu.cpp

__device__ __forceinline__ unsigned long long ld_acquire_sys(const void* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys_u64(void* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys_u64(void* p, unsigned long long v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long ld_relaxed_sys_u64(const void* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_relaxed_sys_u32(const void* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_sys_u32(void* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
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
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ int32_t ld32(const void* p) {  // coherent 4-byte load (see ld16)
  int32_t v;
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
/// Tests only (LlCommon::debug_block0_delay_ns): the block waits `ns` of globaltimer. Block-wide.
__device__ __noinline__ void debug_block_delay(long long ns) {
  if (threadIdx.x == 0) {
    const unsigned long long t0 = globaltimer();
    while (static_cast<long long>(globaltimer() - t0) < ns) __nanosleep(1000);
  }
  __syncthreads();
}
// Coherent 16-byte load of data a peer wrote (after an acquire): a plain weak load, never .nc.
__device__ __forceinline__ uint4 ld16(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st16(void* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }
// ll.combine_wait = data (ll_cuda.h): volatile 16-byte loads / stores of partial rows; every 32-bit
// word is single-copy atomic, and a word equal to kLlPoison means "not arrived".
constexpr uint32_t kLlPoison = 0xffffffffu;
__device__ __forceinline__ uint4 ldv16(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void stv16(void* p, const uint4& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ bool poisoned(const uint4& v) { return v.x == kLlPoison || v.y == kLlPoison || v.z == kLlPoison || v.w == kLlPoison; }
/// NaN -> the canonical 0x7fffffff (what the GPU's own arithmetic returns), so no partial word (fp32,
/// or a pair of bf16 of canonical NaNs, 0x7fff) is ever kLlPoison.
__device__ __forceinline__ float canon_nan(float a) { return a != a ? __uint_as_float(0x7fffffffu) : a; }
__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

/// a / b and a % b in 32-bit unsigned arithmetic (a few instructions instead of a 64-bit division
/// sequence): work-item indices are < 2^31 (LlCuda checks R x max_T x ceil(H / 256) at create).
__device__ __forceinline__ int udiv(int64_t a, int b) { return static_cast<int>(static_cast<uint32_t>(a) / static_cast<uint32_t>(b)); }
__device__ __forceinline__ int umod(int64_t a, int b) { return static_cast<int>(static_cast<uint32_t>(a) % static_cast<uint32_t>(b)); }

__device__ __forceinline__ unsigned lanemask_of(int i) { return (1u << i) - 1u; }  // bits below i, i < 32

__device__ __forceinline__ unsigned long long ld_volatile_u64(const void* p) {
  unsigned long long v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
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

// ---- dispatch ----------------------------------------------------------------------------------

/// Chunks per run so that `rows` x runs covers about `warps` warps: in [1, kMax].
__device__ __forceinline__ int chunks_per_run(int nch, int64_t rows, int64_t warps, int kMax) {
  int64_t cpr = (rows * nch + warps - 1) / (warps > 0 ? warps : 1);
  cpr = cpr < 1 ? 1 : cpr > kMax ? kMax : cpr;
  return static_cast<int>(cpr < nch ? cpr : nch);
}


// kMaxThreads: 1024 (64 registers per thread, a few spilled) or 512 (128 registers); the launch picks
// the smallest that holds the block.
// kMessage: the message expansion with chunk signals (LlCommon::expand_message, ll_cuda.h); false: the
// expert expansion with block signals, the fallback where the message expansion's bitmaps do not fit in
// shared memory. The other's code is compiled out (a smaller kernel: its instructions are fetched cold on
// every SM at every launch).
template <bool kFp8, int kMaxThreads, bool kMessage>
__global__ void __launch_bounds__(kMaxThreads, 1) ll_dispatch_kernel(const __grid_constant__ LlDispatchParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks, K = lay.top_k, max_t = lay.max_tokens, rank = c.rank;
  const int64_t H = lay.hidden;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const int nchunks = static_cast<int>((H + kLlChunkElems - 1) / kLlChunkElems);
  __shared__ unsigned long long s_call_send, s_call_recv;
  __shared__ int s_T, s_total;
  __shared__ int s_count[kLlMaxRanks], s_n[kLlMaxRanks], s_bad[kLlMaxRanks], s_mp[kLlMaxRanks + 1];
  // The message expansion, send part: s_bm[id][w] bit i = token 32 w + i selects id; s_pre[id][w] =
  // tokens before 32 w that select id; s_tot[id] = all tokens that select it.
  constexpr bool by_message = kMessage;
  const int NI = lay.num_ids, Wm = (max_t + 31) / 32;
  uint32_t* s_bm = reinterpret_cast<uint32_t*>(smem) + max_t + static_cast<int64_t>(max_t) * R;  // after s_mask, s_slot
  int32_t* s_pre = reinterpret_cast<int32_t*>(s_bm + static_cast<int64_t>(NI) * Wm);
  int32_t* s_tot = s_pre + static_cast<int64_t>(NI) * Wm;
  // The front (bench/NOTES.md, 'LL dispatch front'): every load the send part needs first goes out before
  // anything waits on one: thread 0's call counters and T (three independent loads), the ids of every
  // row that may be read (rows < min(x.shape[0], max_T), so before T is known), one lane per (token,
  // column) with G lanes per token (K rounded up to a power of two), and the warp's first item.
  // Masks, per-id bitmaps and destinations are then computed lane-parallel (the token's mask ORed over
  // its G lanes with shuffles); rows >= T are masked out after the barrier that publishes T, and their
  // ids are never reported. One dependent round trip and two barriers before the slot scan.
  __shared__ unsigned long long tr_ns0, tr_clk0;  // block 0's start (trace_clk; shared: no registers held)
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    tr_ns0 = globaltimer();
    tr_clk0 = clock64();
    c.state->trace[0] = tr_ns0;
  }
  trace_max(c, 8);
  unsigned long long ctr_send = 0, ctr_recv = 0;
  int32_t dev_T = 0;
  if (threadIdx.x == 0) {
    ctr_send = ld_volatile_u64(&c.state->dispatch_send_blocks);
    ctr_recv = ld_volatile_u64(&c.state->dispatch_recv_blocks);
    if (p.send && p.num_tokens) dev_T = ld32(p.num_tokens);
  }
  int G = 1;
  while (G < K) G <<= 1;  // K <= 32
  const int gk = static_cast<int>(threadIdx.x) & (G - 1), tpp = static_cast<int>(blockDim.x) / G;
  const int rows = p.send ? static_cast<int>(p.x_rows < max_t ? p.x_rows : max_t) : 0;
  constexpr int kIdPasses = 4;  // passes of tpp tokens whose ids are loaded up front
  int64_t idv[kIdPasses];
#pragma unroll
  for (int i = 0; i < kIdPasses; ++i) {
    const int t = i * tpp + static_cast<int>(threadIdx.x) / G;
    idv[i] = t < rows && gk < K ? load_id(p, static_cast<int64_t>(t) * K + gk) : -1;
  }
  const int64_t first_item = static_cast<int64_t>(blockIdx.x) * W + warp;
  uint4 pre_v0 = make_uint4(0, 0, 0, 0), pre_v1 = make_uint4(0, 0, 0, 0);
  int64_t pre_k = -1;
  float pre_w = 0.0f;
  if (p.send && first_item < p.x_rows * nchunks) {
    const int t = udiv(first_item, nchunks), ch = umod(first_item, nchunks);
    const int64_t h0 = static_cast<int64_t>(ch) * kLlChunkElems + lane * 16;
    const uint16_t* xr = p.x + static_cast<int64_t>(t) * H;
    if (h0 < H) pre_v0 = __ldg(reinterpret_cast<const uint4*>(xr + h0));
    if (h0 + 8 < H) pre_v1 = __ldg(reinterpret_cast<const uint4*>(xr + h0 + 8));
    if (ch == 0 && lane < K) {
      pre_k = load_id(p, static_cast<int64_t>(t) * K + lane);
      pre_w = p.topk_weights[static_cast<int64_t>(t) * K + lane];
    }
  }
  const unsigned long long rt_start = load_round_trip(&c.state->combine_recv_blocks);
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(smem);          // [max_t]
  int32_t* s_slot = reinterpret_cast<int32_t*>(s_mask + max_t);  // [max_t][R]
  if (p.send && by_message) {
    for (int i = threadIdx.x; i < NI * Wm; i += blockDim.x) s_bm[i] = 0;
    __syncthreads();  // zeroed before the atomicOr below
  }
  int bad_t = -1, bad_k = 0;
  int64_t bad_id = 0;
  auto mask_pass = [&](int t, int64_t id) {  // block-uniform call (shuffles over the whole warp)
    const bool mine = t < rows && gk < K;
    if (mine && !c.placement.valid_id(id, gk, K)) {
      if (bad_t < 0) bad_t = t, bad_k = gk, bad_id = id;
      id = -1;  // treated as -1
    }
    const int d = mine ? c.placement.dest_rank(static_cast<int32_t>(id), rank) : -1;
    uint32_t bit = d >= 0 ? 1u << d : 0u;
    for (int o = 1; o < G; o <<= 1) bit |= __shfl_xor_sync(0xffffffffu, bit, o);
    if (t < rows && gk == 0) s_mask[t] = bit;
    if (by_message && mine && id >= 0) atomicOr(&s_bm[id * Wm + (t >> 5)], 1u << (t & 31));  // duplicates: the same bit
  };
#pragma unroll
  for (int i = 0; i < kIdPasses; ++i)
    if (i * tpp < rows) mask_pass(i * tpp + static_cast<int>(threadIdx.x) / G, idv[i]);
  for (int i = kIdPasses; i * tpp < rows; ++i) {
    const int t = i * tpp + static_cast<int>(threadIdx.x) / G;
    mask_pass(t, t < rows && gk < K ? load_id(p, static_cast<int64_t>(t) * K + gk) : -1);
  }
  if (threadIdx.x == 0) {
    s_call_send = div_blocks(ctr_send, gridDim.x);
    s_call_recv = div_blocks(ctr_recv, gridDim.x);
    int64_t T = p.num_tokens ? static_cast<int64_t>(dev_T) : p.x_rows;
    if (T < 0 || T > p.x_rows || T > max_t) {
      if (p.send && blockIdx.x == 0) report(c, LlErrorReport::bad_num_tokens, -1, LlErrorReport::dispatch, T, p.x_rows);
      T = 0;  // send nothing: the peers still get their signals, nothing hangs
    }
    s_T = static_cast<int>(T);
  }
  if (kMessage && threadIdx.x < kLlMaxRanks) s_bad[threadIdx.x] = 0;  // chunk signals: no barrier of its own
  __syncthreads();
  trace_at(c, kTrDispT);
  trace_at(c, kTrDispMasks);  // the masks are done at the same barrier now
  if (threadIdx.x == blockDim.x - 1 && blockIdx.x == 0) c.state->trace[kTrDispLoadStart] = tr_ns0 + rt_start;
  trace_clk(c, kTrDispMasksCyc, tr_ns0, tr_clk0);

  if (p.send) {
    const int T = s_T;
    const int parity = static_cast<int>(s_call_send & 1);
    if (bad_t >= 0 && bad_t < T && blockIdx.x == 0)
      report(c, LlErrorReport::bad_topk_id, -1, LlErrorReport::dispatch, bad_id, static_cast<int64_t>(bad_t) * K + bad_k);
    if (by_message) {  // per id, the running count of its tokens (< T) by 32-token word
      const int WT = (T + 31) / 32;
      const uint32_t last_bits = (T & 31) ? (1u << (T & 31)) - 1u : 0xffffffffu;
      for (int id = threadIdx.x; id < NI; id += blockDim.x) {
        int running = 0;
        for (int w = 0; w < WT; ++w) {
          s_pre[id * Wm + w] = running;
          running += __popc(s_bm[id * Wm + w] & (w == WT - 1 ? last_bits : 0xffffffffu));
        }
        s_tot[id] = running;
      }
    }
    // Slot of token t at destination d = tokens before t that go to d (source token order).
    for (int d = warp; d < R; d += W) {
      int running = 0;
      for (int t0 = 0; t0 < T; t0 += 32) {
        const int t = t0 + lane;
        const bool bit = t < T && ((s_mask[t] >> d) & 1u);
        const unsigned b = __ballot_sync(0xffffffffu, bit);
        if (bit) s_slot[t * R + d] = running + __popc(b & lanemask_lt());
        running += __popc(b);
      }
      if (lane == 0) s_count[d] = running;
    }
    __syncthreads();
    trace_at(c, kTrDispScanned);
    constexpr bool chunk_sig = kMessage;
    const bool debug_delay = chunk_sig && blockIdx.x == 0 && c.debug_block0_delay_ns > 0;  // tests only (block-uniform)
    if (debug_delay) debug_block_delay(c.debug_block0_delay_ns);
    if (chunk_sig && blockIdx.x == 0) {  // chunk signals: the tagged counts and slot tokens first, ahead of the payload
      const uint32_t tag = count_tag(s_call_send), tmask = c.debug_token_tag_mask;
      for (int t = threadIdx.x; t < T; t += blockDim.x) {  // message slot -> source token, per destination
        const uint32_t mt = s_mask[t];
        for (int d = 0; d < R; ++d)
          if ((mt >> d) & 1u)
            st_relaxed_sys_u64(c.peers[d] + lay.slot_token_offset(parity, rank, s_slot[t * R + d]), slot_token_word(s_call_send, static_cast<uint32_t>(t), tmask));
      }
      for (int d = threadIdx.x; d < R; d += blockDim.x) {  // the scrubbed slot, where no message fills it (slot_token_word)
        const int j = ll_scrub_slot(s_call_send, max_t);
        if (j >= s_count[d]) st_relaxed_sys_u64(c.peers[d] + lay.slot_token_offset(parity, rank, j), slot_token_word(s_call_send, kLlNoToken, tmask));
      }
      for (int d = 0; d < R; ++d) {
        const int Ld = c.placement.num_local(d);
        for (int l = threadIdx.x; l < Ld; l += blockDim.x) {
          const int id = c.placement.shared_route && l == Ld - 1 ? c.placement.num_experts : c.placement.range_begin(d) + l;
          const int n = c.placement.local_index(id, rank, d) == l ? s_tot[id] : 0;
          st_relaxed_sys_u32(c.peers[d] + lay.expert_count_offset(parity, rank, l), tag << 30 | static_cast<uint32_t>(n));
        }
      }
      for (int d = threadIdx.x; d < R; d += blockDim.x)
        st_relaxed_sys_u64(c.peers[d] + lay.dispatch_count_offset(parity, rank), static_cast<unsigned long long>(tag) << 32 | static_cast<uint32_t>(s_count[d]));
    }
    if (debug_delay) debug_block_delay(c.debug_block0_delay_ns);

    const int64_t items = static_cast<int64_t>(T) * nchunks;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * W + warp; item < items; item += static_cast<int64_t>(gridDim.x) * W) {
      const int t = udiv(item, nchunks), ch = umod(item, nchunks);
      const uint32_t m = s_mask[t];
      const int64_t h0 = static_cast<int64_t>(ch) * kLlChunkElems + lane * 16;
      const bool ok0 = h0 < H, ok1 = h0 + 8 < H;
      const uint16_t* xr = p.x + static_cast<int64_t>(t) * H;
      const bool pre = item == first_item;  // loaded before T
      uint4 v0 = pre_v0, v1 = pre_v1;
      if (!pre && ok0) v0 = __ldg(reinterpret_cast<const uint4*>(xr + h0));
      if (!pre && ok1) v1 = __ldg(reinterpret_cast<const uint4*>(xr + h0 + 8));
      // Header, ids and the combine's copy of the routing: the chunk-0 warp of each token.
      int32_t my_id = -1, my_first = -1, my_u = -1;
      float my_w = 0.0f;
      if (ch == 0) {
        if (lane < K) {
          const int64_t id = pre ? pre_k : load_id(p, static_cast<int64_t>(t) * K + lane);
          my_id = c.placement.valid_id(id, lane, K) ? static_cast<int32_t>(id) : -1;
          my_w = pre ? pre_w : p.topk_weights[static_cast<int64_t>(t) * K + lane];
        }
        my_first = my_id >= 0 ? lane : -1;
        for (int k = 0; k < K; ++k) {
          const int32_t other = __shfl_sync(0xffffffffu, my_id, k);
          if (k < lane && my_first == lane && other == my_id) my_first = k;
        }
        if (!lay.partial() && lane < K) {
          p.first_col[static_cast<int64_t>(t) * K + lane] = my_first;
          p.weights[static_cast<int64_t>(t) * K + lane] = my_w;
        }
        if (lay.partial() && lane == 0) p.dest_mask[t] = m;
        if (by_message && my_id >= 0)  // this token's rank among the source's tokens selecting my_id
          my_u = s_pre[my_id * Wm + (t >> 5)] + __popc(s_bm[my_id * Wm + (t >> 5)] & lanemask_of(t & 31));
      }
      uint4 q = make_uint4(0, 0, 0, 0);
      float scale = 0.0f;
      if constexpr (kFp8) {
        float f[16];
        bf16x8_to_float(v0, f);
        bf16x8_to_float(v1, f + 8);
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i]));
        // 8 lanes x 16 elements = one 1x128 group.
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
        scale = __fdiv_rn(fmaxf(amax, kAmaxFloor), kFp8Max);
        if (p.ue8m0 && isfinite(scale)) scale = round_up_pow2(scale);
        // f / scale, the quotients of quant_cpu.cpp's IEEE division: one correctly rounded reciprocal
        // and two fma corrections per element (fp8_quotients_rn), __fdiv_rn itself where that is not
        // proven equal (a non-finite scale or element).
        float qv[16];
        bool finite = isfinite(scale);
#pragma unroll
        for (int i = 0; i < 16; ++i) finite = finite && isfinite(f[i]);
        if (finite) {
          const float y = __frcp_rn(scale);
#pragma unroll
          for (int i = 0; i < 16; ++i) qv[i] = quotient_rn(f[i], scale, y);
        } else {
#pragma unroll
          for (int i = 0; i < 16; ++i) qv[i] = __fdiv_rn(f[i], scale);
        }
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = fp8x2(qv[4 * i], qv[4 * i + 1]) | (fp8x2(qv[4 * i + 2], qv[4 * i + 3]) << 16);
        q = make_uint4(w[0], w[1], w[2], w[3]);
      }
      for (int d = 0; d < R; ++d) {
        if (!((m >> d) & 1u)) continue;
        uint8_t* msg = c.peers[d] + lay.dispatch_msg_offset(parity, rank, s_slot[t * R + d]);
        if constexpr (kFp8) {
          if (ok0) {
            st16(msg + lay.msg_payload_offset() + h0, q);
            if ((lane & 7) == 0) *reinterpret_cast<float*>(msg + lay.msg_scales_offset() + h0 / 128 * 4) = scale;
          }
        } else {
          if (ok0) st16(msg + lay.msg_payload_offset() + 2 * h0, v0);
          if (ok1) st16(msg + lay.msg_payload_offset() + 2 * (h0 + 8), v1);
        }
        if (ch == 0) {
          if (lane == 0) st16(msg, make_uint4(static_cast<uint32_t>(t), 0, 0, 0));
          if (lane < K) *reinterpret_cast<int32_t*>(msg + lay.msg_topk_offset() + 4 * lane) = my_id;
          if (lay.partial() && lane < K) *reinterpret_cast<float*>(msg + lay.msg_weights_offset() + 4 * lane) = my_w;
          if (by_message && lane < K) *reinterpret_cast<int32_t*>(msg + lay.msg_slots_offset() + 4 * lane) = my_u;
        }
      }
    }
    if (warp == 0) trace_at(c, kTrDispWarp0Items);
    if (warp == 0) trace_clk(c, kTrDispWarp0ItemsCyc, tr_ns0, tr_clk0);
    __syncthreads();
    trace_max(c, kTrDispItems);
    if (blockIdx.x == 0 && threadIdx.x == 0) c.state->num_tokens = T;
    // The block that stores the counts after its payload: block 0 (the expert expansion; with the message
    // expansion block 0 stored them tagged ahead of the payload).
    const bool counter = chunk_sig ? false : blockIdx.x == 0;
    if (by_message && counter) {  // tokens per (destination, local expert) for the receivers' slot bases
      for (int d = 0; d < R; ++d) {
        const int Ld = c.placement.num_local(d);
        for (int l = threadIdx.x; l < Ld; l += blockDim.x) {
          const int id = c.placement.shared_route && l == Ld - 1 ? c.placement.num_experts : c.placement.range_begin(d) + l;
          const int n = c.placement.local_index(id, rank, d) == l ? s_tot[id] : 0;
          *reinterpret_cast<int32_t*>(c.peers[d] + lay.expert_count_offset(parity, rank, l)) = n;
        }
      }
      __syncthreads();
    }
    trace_at(c, kTrDispCounts);
    // chunk signals: the block's last warp releases the flags and takes no receive work, so the other
    // warps go on to the counts and their expansion items while its release waits for the acknowledgements.
    const bool rel_warp = chunk_sig && W > 1;
    if (rel_warp ? warp == W - 1 && lane < R : threadIdx.x < R) {  // flags after all the block's stores (cumulative release)
      const int d = rel_warp ? lane : static_cast<int>(threadIdx.x);
      if (counter) st_relaxed_sys_u64(c.peers[d] + lay.dispatch_count_offset(parity, rank), static_cast<unsigned long long>(s_count[d]));
      st_release_sys_u64(c.peers[d] + lay.dispatch_flag_offset(rank, blockIdx.x), s_call_send + 1);
    }
    if (threadIdx.x == 0) atomicAdd(&c.state->dispatch_send_blocks, 1ull);
    trace_max(c, 1);
  }

  if (p.recv) {
    const unsigned long long call = s_call_recv;
    const int parity = static_cast<int>(call & 1);
    constexpr bool chunk_sig = kMessage;  // chunk signals: per-item waits on the send blocks' flags
    // chunk signals: warps [0, Wr) receive (the last one released the flags, the chunk signals above;
    // their barrier is the named barrier 1); s_bad was cleared at the front.
    const bool split = chunk_sig && W > 1;
    const int Wr = split ? W - 1 : W, nthr = 32 * Wr;
    auto recv_barrier = [&] {
      if (split) asm volatile("bar.sync 1, %0;" ::"r"(nthr) : "memory");
      else __syncthreads();
    };
    if (!chunk_sig) {
      if (threadIdx.x < R) s_bad[threadIdx.x] = 0;
      __syncthreads();
    }
    if (!chunk_sig) wait_all_flags(
        c, [&](int s) { return c.local + lay.dispatch_flag_offset(s, 0); }, call + 1, LlErrorReport::dispatch, call, s_bad,
        [&](int s) {  // block 0's flag of s was released after the count
          if constexpr (!by_message) {  // (the message expansion loads the counts after the wait, with the rest)
            long long n = static_cast<long long>(ld_relaxed_sys_u64(c.local + lay.dispatch_count_offset(parity, s)));
            if (n < 0 || n > max_t) n = 0;
            s_n[s] = static_cast<int>(n);
          }
        });
    if (!chunk_sig) __syncthreads();
    if constexpr (!by_message) {
      if (threadIdx.x == 0) {  // timed-out sources count 0; s_mp: prefix of the message counts
        s_mp[0] = 0;
        for (int s = 0; s < R; ++s) {
          if (s_bad[s]) s_n[s] = 0;
          s_mp[s + 1] = s_mp[s] + s_n[s];
        }
      }
      __syncthreads();
    }
    trace_at(c, 2);
    trace_max(c, 10);
    if constexpr (by_message) {
    if (warp < Wr) {  // chunk signals: the releasing warp skips the receive work
      const int L = c.num_local;
      const int64_t cap = static_cast<int64_t>(R) * max_t, gpr = H / 128;
      // (message, 512-element chunk) items over the whole grid: the chunk is loaded once and stored
      // into the slot of each local expert the message selects (its first column naming it). The
      // warp's first item is loaded before the slot bases (its loads overlap the counts' round trip).
      // Runs: (message, run of up to kRunD consecutive chunks) items, so one round covers
      // more of the grid's work (ll-v3: 256 messages x 7 runs of 2 chunks on 2112 warps).
      constexpr int kRunD = 2;
      struct Item {
        int s = 0, j = 0, ch = 0;  // ch: the run's first chunk
        int32_t id = -1, u = -1, hdr = 0;
        float wk = 0.0f, sc[kRunD] = {};
        uint4 a[kRunD] = {}, b2[kRunD] = {};
      };
      // Items over the capacity R x max_T: a warp knows its first item's message before
      // the counts, so its loads, the message counts and the slot-base counts are one round trip after
      // the wait; items of slots j >= the source's count are skipped (their speculative loads unused).
      const int64_t gwarps = static_cast<int64_t>(gridDim.x) * Wr;
      const int cprd = chunks_per_run(nchunks, cap, gwarps, kRunD);
      const int runsd = (nchunks + cprd - 1) / cprd;
      auto load_item = [&](int64_t item, Item& m) {  // all loads of the item at once (one round trip)
        const int flat = udiv(item, runsd);  // = s max_T + j
        m.ch = umod(item, runsd) * cprd;
        m.s = udiv(flat, max_t);
        m.j = flat - m.s * max_t;
        const uint8_t* msg = c.local + lay.dispatch_msg_offset(parity, m.s, m.j);
        m.id = -1, m.u = -1, m.hdr = 0, m.wk = 0.0f;
        if (lane < K) {
          m.id = ld32(msg + lay.msg_topk_offset() + 4 * lane);
          m.u = ld32(msg + lay.msg_slots_offset() + 4 * lane);
          if (lay.partial() && m.ch == 0) m.wk = __int_as_float(ld32(msg + lay.msg_weights_offset() + 4 * lane));
        }
        if (m.ch == 0 && lane == 0) m.hdr = ld32(msg);
#pragma unroll
        for (int i = 0; i < kRunD; ++i) {
          const int64_t h0 = static_cast<int64_t>(m.ch + i) * kLlChunkElems + lane * 16;
          if (i >= cprd || m.ch + i >= nchunks) break;
          if constexpr (kFp8) {
            if (h0 < H) m.a[i] = ld16(msg + lay.msg_payload_offset() + h0);
            if (h0 < H && (lane & 7) == 0) m.sc[i] = __int_as_float(ld32(msg + lay.msg_scales_offset() + h0 / 128 * 4));
          } else {
            if (h0 < H) m.a[i] = ld16(msg + lay.msg_payload_offset() + 2 * h0);
            if (h0 + 8 < H) m.b2[i] = ld16(msg + lay.msg_payload_offset() + 2 * (h0 + 8));
          }
        }
      };
      const int64_t items = cap * runsd;
      const int64_t first_recv = static_cast<int64_t>(blockIdx.x) * Wr + warp;
      Item m;
      if (!chunk_sig && first_recv < items) load_item(first_recv, m);
      unsigned long long first_tok = 0;  // chunk signals: the first item's slot-token word, loaded before the counts' round trip
      if (chunk_sig && lane == 0 && first_recv < items) {
        const int flat = udiv(first_recv, runsd), s = udiv(flat, max_t);
        first_tok = ld_relaxed_sys_u64(c.local + lay.slot_token_offset(parity, s, flat - s * max_t));
      }
      if (threadIdx.x == blockDim.x - 1 && blockIdx.x == 0)
        c.state->trace[kTrDispLoadWaited] = tr_ns0 + load_round_trip(c.local + lay.dispatch_count_offset(parity, rank));
      // The message counts (block 0's flag of s was released after them; timed-out sources count 0).
      auto msg_count_of = [&](int s) {
        long long n = static_cast<long long>(ld_relaxed_sys_u64(c.local + lay.dispatch_count_offset(parity, s)));
        return s_bad[s] || n < 0 || n > max_t ? 0 : static_cast<int>(n);
      };
      int32_t* s_base = reinterpret_cast<int32_t*>(smem);  // [L][R]
      if (chunk_sig) {
        // chunk signals: the senders stored their tagged counts before their payload, so they are
        // normally here already: the message counts (s_n) and the slot bases, each word polled until it
        // carries call n's tag (timed-out sources count 0); block 0 writes recv_count and layout_range.
        const uint32_t tag = count_tag(call);
        for (int s = threadIdx.x; s < R; s += nthr) {
          const void* f = c.local + lay.dispatch_count_offset(parity, s);
          unsigned long long v = ld_relaxed_sys_u64(f);
          const bool ok = poll_word(
              c, [&] { return ld_relaxed_sys_u64(f); }, [&](unsigned long long x) { return (x >> 32) == tag; }, s, LlErrorReport::dispatch, call,
              s_bad, v);
          const long long n = ok ? static_cast<long long>(v & 0xffffffffull) : 0;
          s_n[s] = n > max_t ? 0 : static_cast<int>(n);
          if (lay.partial() && blockIdx.x == 0) p.msg_count[s] = s_n[s];
        }
        for (int l = threadIdx.x; l < L; l += nthr) {
          int running = 0;
          for (int s0 = 0; s0 < R; s0 += 8) {  // 8 sources' counts loaded at once
            uint32_t w[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) w[i] = s0 + i < R ? ld_relaxed_sys_u32(c.local + lay.expert_count_offset(parity, s0 + i, l)) : 0u;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              const int s = s0 + i;
              if (s >= R) break;
              const void* f = c.local + lay.expert_count_offset(parity, s, l);
              unsigned long long v = w[i];
              const bool ok = poll_word(
                  c, [&] { return static_cast<unsigned long long>(ld_relaxed_sys_u32(f)); }, [&](unsigned long long x) { return (x >> 30) == tag; }, s,
                  LlErrorReport::dispatch, call, s_bad, v);
              int cnt = ok ? static_cast<int>(v & 0x3fffffffull) : 0;
              if (cnt > max_t) cnt = 0;
              s_base[l * R + s] = running;
              if (blockIdx.x == 0) p.layout_range[static_cast<int64_t>(l) * R + s] = (static_cast<int64_t>(running) << 32) | cnt;
              running += cnt;
            }
          }
          if (blockIdx.x == 0) p.recv_count[l] = running;
        }
      } else {
      if (threadIdx.x < R) {
        const int n = msg_count_of(threadIdx.x);
        s_n[threadIdx.x] = n;
        if (lay.partial() && blockIdx.x == 0) p.msg_count[threadIdx.x] = n;
      }
      // Slot bases: s_base[l][s] = tokens of sources < s for local expert l (the senders' counts,
      // released with their flags); block 0 also writes recv_count and layout_range.
      for (int l = threadIdx.x; l < L; l += blockDim.x) {
        int running = 0;
        for (int s0 = 0; s0 < R; s0 += 8) {  // 8 sources' counts loaded at once
          int n[8], nm[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) n[i] = s0 + i < R ? ld32(c.local + lay.expert_count_offset(parity, s0 + i, l)) : 0;
#pragma unroll
          for (int i = 0; i < 8; ++i) nm[i] = s0 + i < R ? msg_count_of(s0 + i) : 0;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int s = s0 + i;
            if (s >= R) break;
            const int cnt = n[i] < 0 || n[i] > nm[i] ? 0 : n[i];
            s_base[l * R + s] = running;
            if (blockIdx.x == 0) p.layout_range[static_cast<int64_t>(l) * R + s] = (static_cast<int64_t>(running) << 32) | cnt;
            running += cnt;
          }
        }
        if (blockIdx.x == 0) p.recv_count[l] = running;
      }
      }
      recv_barrier();
      trace_at(c, kTrDispBases);
      trace_clk(c, kTrDispBasesCyc, tr_ns0, tr_clk0);
      for (int64_t item = first_recv; item < items; item += gwarps) {
        if (chunk_sig) {
          const int flat = udiv(item, runsd), s = udiv(flat, max_t), j = flat - s * max_t;
          if (j >= s_n[s]) continue;  // beyond the messages s sent (warp-uniform)
          // The source token t of slot j (tagged, stored before the payload) names the send blocks of
          // the message's chunks (the sender's item t * nchunks + c runs on block (item / W_s) % B_s);
          // lane 0 then waits for the flag of chunk 0's block (header, ids, slot ranks), lane 1 + i for
          // chunk ch + i's (acquire), and the warp barrier orders every lane's loads after them.
          const int ch0 = umod(item, runsd) * cprd, fc = lane == 0 ? 0 : ch0 + lane - 1;
          bool ok = true;
          int tok = 0;
          if (lane == 0) {
            const void* f = c.local + lay.slot_token_offset(parity, s, j);
            unsigned long long v = item == first_recv ? first_tok : ld_relaxed_sys_u64(f);
            ok = poll_word(
                c, [&] { return ld_relaxed_sys_u64(f); }, [&](unsigned long long x) { return slot_token_current(x, call, c.debug_token_tag_mask); }, s,
                LlErrorReport::dispatch, call, s_bad, v);
            const uint32_t t32 = static_cast<uint32_t>(v & 0xffffffffull);
            if (t32 >= static_cast<uint32_t>(max_t)) ok = false;  // malformed (or kLlNoToken): the message is dropped
            tok = ok ? static_cast<int>(t32) : 0;
          }
          tok = __shfl_sync(0xffffffffu, tok, 0);
          ok = __shfl_sync(0xffffffffu, ok, 0);
          if (ok && lane <= cprd && fc < nchunks) {
            const int ws = c.src_warps[s] > 0 ? c.src_warps[s] : 1, bs = c.src_blocks[s] > 0 ? c.src_blocks[s] : 1;
            const int b = udiv(static_cast<int64_t>(tok) * nchunks + fc, ws) % bs;
            const void* f = c.local + lay.dispatch_flag_offset(s, b);
            unsigned long long v = ld_acquire_sys(f);
            ok = poll_word(
                c, [&] { return ld_acquire_sys(f); }, [&](unsigned long long x) { return x >= call + 1; }, s, LlErrorReport::dispatch, call, s_bad,
                v);
          }
          ok = __all_sync(0xffffffffu, ok);
          __syncwarp();
          if (!ok) continue;  // timed out (reported): the message is dropped
          load_item(item, m);
        } else if (item != first_recv) {
          const int flat = udiv(item, runsd), s = udiv(flat, max_t);
          if (flat - s * max_t >= s_n[s]) continue;  // beyond the messages s sent (warp-uniform)
          load_item(item, m);
        } else if (m.j >= s_n[m.s]) {
          continue;
        }
        const int s = m.s, ch = m.ch;
        int l = m.id >= 0 ? c.placement.local_index(m.id, s, rank) : -1;
        int slot = l >= 0 ? s_base[l * R + s] + m.u : -1;
        if (l >= 0 && (m.u < 0 || slot >= cap)) l = -1, slot = -1;  // a malformed message: dropped, never out of bounds
        bool first = true;  // no earlier column names the same id
        for (int k = 0; k < K; ++k) {
          const int32_t other = __shfl_sync(0xffffffffu, m.id, k);
          if (k < lane && other == m.id) first = false;
        }
        const int32_t hdr = __shfl_sync(0xffffffffu, m.hdr, 0);
        if (ch == 0 && lay.partial()) {  // the handle's per-message rows (duplicates share the row)
          const int64_t mi = static_cast<int64_t>(s) * max_t + m.j;
          if (lane < K) {
            p.msg_rows[mi * K + lane] = l >= 0 ? static_cast<int32_t>(l * cap + slot) : -1;
            p.msg_weights[mi * K + lane] = m.wk;
          }
          if (lane == 0) p.msg_src_token[mi] = hdr;
        }
        unsigned sel = __ballot_sync(0xffffffffu, lane < K && l >= 0 && first);
        while (sel) {
          const int k = __ffs(sel) - 1;
          sel &= sel - 1;
          const int lk = __shfl_sync(0xffffffffu, l, k), sk = __shfl_sync(0xffffffffu, slot, k);
          const int64_t row = static_cast<int64_t>(lk) * cap + sk;
#pragma unroll
          for (int i = 0; i < kRunD; ++i) {
            const int64_t h0 = static_cast<int64_t>(ch + i) * kLlChunkElems + lane * 16;
            if (i >= cprd || ch + i >= nchunks) break;
            if constexpr (kFp8) {
              if (h0 < H) st16(p.out_x + row * H + h0, m.a[i]);
              if (h0 < H && (lane & 7) == 0) p.out_scales[row * gpr + h0 / 128] = m.sc[i];
            } else {
              if (h0 < H) st16(p.out_x + (row * H + h0) * 2, m.a[i]);
              if (h0 + 8 < H) st16(p.out_x + (row * H + h0 + 8) * 2, m.b2[i]);
            }
          }
          if (ch == 0 && lane == 0) {
            p.src_rank[row] = s;
            p.src_token[row] = hdr;
            p.topk_column[row] = k;
          }
        }
      }
    }
    } else {
      const int CPS = (max_t + 31) / 32, Q = R * CPS;
      const int64_t cap = static_cast<int64_t>(R) * max_t;  // slots per expert
      int16_t* s_loc = reinterpret_cast<int16_t*>(smem);                                    // [R * max_t * K]
      uint32_t* s_qmask = reinterpret_cast<uint32_t*>(smem + ll_align_up(2 * cap * K, 16)); // [Q]
      int32_t* s_qbase = reinterpret_cast<int32_t*>(s_qmask + Q);                           // [Q]
      int32_t* s_info = s_qbase + Q;                                                        // [R * max_t]
      int8_t* s_sel = reinterpret_cast<int8_t*>(s_info + cap);                              // [Q * 32]
      const int64_t gpr = H / 128;  // scale groups per row (fp8)
      // 0. Every block: the local expert index of every column of every message, into shared memory
      //    (16-byte id loads, one round trip for R * max_t * K / 4 <= blockDim ids vectors).
      if (blockIdx.x < c.num_local) {
        const int nvec = (K + 3) / 4, per_src = max_t * nvec;
        for (int v = threadIdx.x; v < R * per_src; v += blockDim.x) {
          const int s = v / per_src, r = v - s * per_src, j = r / nvec, i = r - j * nvec;
          if (j >= s_n[s]) continue;
          const uint4 q = ld16(c.local + lay.dispatch_msg_offset(parity, s, j) + lay.msg_topk_offset() + 16 * i);
          const int32_t w4[4] = {static_cast<int32_t>(q.x), static_cast<int32_t>(q.y), static_cast<int32_t>(q.z), static_cast<int32_t>(q.w)};
          int16_t* dst = s_loc + (static_cast<int64_t>(s) * max_t + j) * K + 4 * i;
#pragma unroll
          for (int u = 0; u < 4; ++u)
            if (4 * i + u < K) dst[u] = static_cast<int16_t>(c.placement.local_index(w4[u], s, rank));
        }
      }
      if (lay.partial() && blockIdx.x == 0 && threadIdx.x < R) p.msg_count[threadIdx.x] = s_n[threadIdx.x];
      __syncthreads();
      for (int l = blockIdx.x; l < c.num_local; l += gridDim.x) {
        // 1. Which messages select l (first column naming it), 32 messages per ballot, from shared memory.
        for (int qi = warp; qi < Q; qi += W) {
          const int s = qi / CPS, j = (qi % CPS) * 32 + lane;
          int sel = -1;
          if (j < s_n[s]) {
            const int16_t* loc = s_loc + (static_cast<int64_t>(s) * max_t + j) * K;
            for (int k = 0; k < K; ++k)
              if (loc[k] == l) {
                sel = k;
                break;
              }
          }
          const unsigned b = __ballot_sync(0xffffffffu, sel >= 0);
          if (lane == 0) s_qmask[qi] = b;
          s_sel[qi * 32 + lane] = static_cast<int8_t>(sel);
        }
        __syncthreads();
        // 2. Exclusive scan of the ballot counts: slots in (source rank, source token) order.
        if (warp == 0) {
          int running = 0;
          for (int q0 = 0; q0 < Q; q0 += 32) {
            const int qi = q0 + lane;
            const int cnt = qi < Q ? __popc(s_qmask[qi]) : 0;
            int incl = cnt;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
              const int v = __shfl_up_sync(0xffffffffu, incl, o);
              if (lane >= o) incl += v;
            }
            if (qi < Q) s_qbase[qi] = running + incl - cnt;
            running += __shfl_sync(0xffffffffu, incl, 31);
          }
          if (lane == 0) s_total = running;
        }
        __syncthreads();
        for (int qi = warp; qi < Q; qi += W) {
          const unsigned b = s_qmask[qi];
          if ((b >> lane) & 1u) s_info[s_qbase[qi] + __popc(b & lanemask_lt())] = (qi * 32 + lane) | (static_cast<int>(s_sel[qi * 32 + lane]) << 24);
        }
        const int total = s_total;
        if (threadIdx.x < R) {
          const int s = threadIdx.x;
          const int begin = s_qbase[s * CPS], end = s + 1 < R ? s_qbase[(s + 1) * CPS] : total;
          p.layout_range[static_cast<int64_t>(l) * R + s] = (static_cast<int64_t>(begin) << 32) | static_cast<int64_t>(end - begin);
        }
        if (threadIdx.x == 0) p.recv_count[l] = total;
        __syncthreads();
        if (lay.partial()) {
          // The handle's per-message rows: every column naming l (duplicates too) -> l's slot.
          for (int slot = threadIdx.x; slot < total; slot += blockDim.x) {
            const int code = s_info[slot] & 0xffffff;
            const int s = code / (CPS * 32), j = code % (CPS * 32);
            const int64_t mi = static_cast<int64_t>(s) * max_t + j;
            for (int k = 0; k < K; ++k)
              if (s_loc[mi * K + k] == l) p.msg_rows[mi * K + k] = static_cast<int32_t>(l * cap + slot);
          }
          if (l == 0) {  // one block writes the rest: -1 rows, weights, source tokens
            const int nvec = (K + 3) / 4;
            for (int v = threadIdx.x; v < R * max_t; v += blockDim.x) {
              const int s = v / max_t, j = v - s * max_t;
              if (j >= s_n[s]) continue;
              const uint8_t* msg = c.local + lay.dispatch_msg_offset(parity, s, j);
              uint4 wv[8];
              ld16_batch(msg + lay.msg_weights_offset(), nvec, wv);
              const int32_t src_token = static_cast<int32_t>(ld16(msg).x);
              p.msg_src_token[v] = src_token;
#pragma unroll
              for (int k = 0; k < kLlMaxTopK; ++k) {  // unrolled: wv stays in registers
                if (k >= K) break;
                p.msg_weights[static_cast<int64_t>(v) * K + k] = __int_as_float(word_of(wv, k));
                if (s_loc[static_cast<int64_t>(v) * K + k] < 0) p.msg_rows[static_cast<int64_t>(v) * K + k] = -1;
              }
            }
          }
        }
        // 3. Copy every selected message into its slot: (slot, chunk) items, kInFlight per warp with
        //    all their loads issued before the stores.
        constexpr int kInFlight = kFp8 ? 4 : 2;
        const int copy_items = total * nchunks;
        for (int base = warp; base < copy_items; base += kInFlight * W) {
          uint4 a[kInFlight], b2[kInFlight];
          float sc[kInFlight];
#pragma unroll
          for (int u = 0; u < kInFlight; ++u) {
            const int item = base + u * W;
            if (item >= copy_items) continue;
            const int slot = item / nchunks, ch = item - slot * nchunks;
            const int code = s_info[slot] & 0xffffff;
            const uint8_t* msg = c.local + lay.dispatch_msg_offset(parity, code / (CPS * 32), code % (CPS * 32));
            const int64_t h0 = static_cast<int64_t>(ch) * kLlChunkElems + lane * 16;
            if constexpr (kFp8) {
              if (h0 < H) a[u] = ld16(msg + lay.msg_payload_offset() + h0);
              if (h0 < H && (lane & 7) == 0) sc[u] = *reinterpret_cast<const float*>(msg + lay.msg_scales_offset() + h0 / 128 * 4);
            } else {
              if (h0 < H) a[u] = ld16(msg + lay.msg_payload_offset() + 2 * h0);
              if (h0 + 8 < H) b2[u] = ld16(msg + lay.msg_payload_offset() + 2 * (h0 + 8));
            }
          }
#pragma unroll
          for (int u = 0; u < kInFlight; ++u) {
            const int item = base + u * W;
            if (item >= copy_items) continue;
            const int slot = item / nchunks, ch = item - slot * nchunks;
            const int info = s_info[slot];
            const int code = info & 0xffffff, sel = info >> 24;
            const int s = code / (CPS * 32), j = code % (CPS * 32);
            const int64_t row = static_cast<int64_t>(l) * cap + slot;
            const int64_t h0 = static_cast<int64_t>(ch) * kLlChunkElems + lane * 16;
            if constexpr (kFp8) {
              if (h0 < H) st16(p.out_x + row * H + h0, a[u]);
              if (h0 < H && (lane & 7) == 0) p.out_scales[row * gpr + h0 / 128] = sc[u];
            } else {
              if (h0 < H) st16(p.out_x + (row * H + h0) * 2, a[u]);
              if (h0 + 8 < H) st16(p.out_x + (row * H + h0 + 8) * 2, b2[u]);
            }
            if (ch == 0 && lane == 0) {
              p.src_rank[row] = s;
              p.src_token[row] = static_cast<int32_t>(ld16(c.local + lay.dispatch_msg_offset(parity, s, j)).x);
              p.topk_column[row] = sel;
            }
          }
        }
        __syncthreads();  // shared arrays are reused for the next expert
      }
    }
    if (threadIdx.x == 0) atomicAdd(&c.state->dispatch_recv_blocks, 1ull);
    __syncthreads();  // the whole block is done
    trace_max(c, kTrDispDone);
  }
}

// ---- combine -----------------------------------------------------------------------------------

/// Partial modes, one lane's 8 elements of a partial row: fp32 (two 16-byte vectors) or bf16 (one).
template <bool kF32>
__device__ __forceinline__ void load_partial(const uint8_t* row, int64_t h, float (&v)[8]) {
  if constexpr (kF32) {
    const uint4 a = ld16(row + 4 * h), b = ld16(row + 4 * h + 16);
    const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __uint_as_float(w[i]);
  } else {
    bf16x8_to_float(ld16(row + 2 * h), v);
  }
}

/// Partial combine send: items are (message slot, run of cpr consecutive 256-element
/// chunks) over the capacity R x max_T; a warp loads its message's routing, the source's message
/// count and the call number in one round trip, then kG local rows x cpr chunks of loads in flight
/// per round trip, sums them in column order in fp32 (the arithmetic of gather_columns: acc + w_k *
/// y_k, separate roundings, column order), and stores the run's partial row to the source: fp32 rows
/// as whole 128-byte lines per warp instruction (the halves of two lanes' 8 elements exchanged by
/// shuffles; weak stores, or volatile with kData; bench/NOTES.md, 'LL combine, where the first ~6 us go').
template <int kG, int kRun, bool kData>
__device__ __forceinline__ void combine_send_runs(const LlCombineParams& p, int W, int warp, int lane, bool* gave_up) {
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks, K = lay.top_k, max_t = lay.max_tokens, rank = c.rank;
  const int64_t H = lay.hidden;
  const bool f32 = lay.combine == 1;
  if (c.num_local == 0) return;  // no local experts: nothing to send
  const int nch = static_cast<int>((H + 255) / 256);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * W, nmsg = static_cast<int64_t>(R) * max_t;
  const int cpr = chunks_per_run(nch, nmsg, warps, kRun);
  const int runs = (nch + cpr - 1) / cpr;
  const int64_t items = nmsg * runs;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * W + warp; item < items; item += warps) {
    const int64_t mi = udiv(item, runs);  // = s max_T + j
    const int run = static_cast<int>(item - mi * runs);
    const int s = udiv(mi, max_t), j = static_cast<int>(mi - static_cast<int64_t>(s) * max_t);
    int32_t my_row = -1, v0 = 0;
    float my_w = 0.0f;
    unsigned long long ctr = 0;
    if (lane < K) {  // every load of the item's routing at once
      my_row = p.msg_rows[mi * K + lane];
      my_w = p.msg_weights[mi * K + lane];
    }
    if (lane == K) v0 = p.msg_count[s];
    if (lane == K + 1) v0 = p.msg_src_token[mi];
    if (lane == 0) ctr = *reinterpret_cast<const volatile unsigned long long*>(&c.state->combine_send_blocks);
    // ll.combine_wait = data: how many combine receives destination s has finished (its word here).
    const int kd = K + 2 < 32 ? K + 2 : 31;
    unsigned long long done = ~0ull;
    if (kData && s != rank && lane == kd) done = ld_acquire_sys(c.local + lay.combine_flag_offset(s, 0));
    const int kc = K < 32 ? K : 0, kt = K + 1 < 32 ? K + 1 : 0;  // K = 31 / 32: lanes reused below
    int cnt = __shfl_sync(0xffffffffu, v0, kc), t = __shfl_sync(0xffffffffu, v0, kt);
    if (K >= 31) {  // no spare lanes: plain loads (K <= 32)
      cnt = p.msg_count[s];
      t = p.msg_src_token[mi];
    }
    if (j >= cnt) continue;  // beyond the messages s sent (warp-uniform)
    ctr = __shfl_sync(0xffffffffu, ctr, 0);
    const unsigned long long call = div_blocks(ctr, gridDim.x);
    const int parity = static_cast<int>(call & 1);
    if (kData && s != rank) {  // call n overwrites the region that s read in its receive n - 2
      if (lane == kd && done + 1 < call && !*gave_up) {
        const unsigned long long t0 = globaltimer();
        const void* f = c.local + lay.combine_flag_offset(s, 0);
        while ((done = ld_acquire_sys(f)) + 1 < call) {
          if (static_cast<long long>(globaltimer() - t0) > c.timeout_ns) {
            report(c, LlErrorReport::timeout, s, LlErrorReport::combine, static_cast<long long>(call), static_cast<long long>(done));
            *gave_up = true;
            break;
          }
        }
      }
      if (__any_sync(0xffffffffu, *gave_up)) *gave_up = true;  // warp-uniform (the receive part's polls read it)
    }
    float acc[kRun][8];
#pragma unroll
    for (int i = 0; i < kRun; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[i][e] = 0.0f;
    const int64_t hbase = static_cast<int64_t>(run) * cpr * 256 + lane * 8;
    unsigned live = __ballot_sync(0xffffffffu, my_row >= 0);
    while (live) {  // kG columns per round trip, in column order
      uint4 y[kG][kRun];
      int f[kG];
      float w[kG];
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        const int k = live ? __ffs(live) - 1 : 0;
        f[g] = __shfl_sync(0xffffffffu, my_row, k);
        w[g] = __shfl_sync(0xffffffffu, my_w, k);
        if (!live) f[g] = -1;
        live &= live - 1;
#pragma unroll
        for (int i = 0; i < kRun; ++i) {
          const int64_t h = hbase + i * 256;
          y[g][i] = make_uint4(0, 0, 0, 0);
          if (f[g] >= 0 && i < cpr && h < H) y[g][i] = __ldg(reinterpret_cast<const uint4*>(p.expert_out + static_cast<int64_t>(f[g]) * H + h));
        }
      }
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        if (f[g] < 0) continue;  // select, not multiply: a -1 column adds nothing
#pragma unroll
        for (int i = 0; i < kRun; ++i) {
          float yf[8];
          bf16x8_to_float(y[g][i], yf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[i][e] = __fadd_rn(acc[i][e], __fmul_rn(w[g], yf[e]));
        }
      }
    }
    const bool stamp0 = item == static_cast<int64_t>(blockIdx.x) * W + warp && warp == 0;  // block 0 via trace_at
    if (stamp0 && __float_as_uint(acc[0][0]) != 0x7fc00001u) trace_at(c, kTrCombLoaded0);  // after the sums (data-dependent)
    uint8_t* dst = c.peers[s] + lay.combine_partial_offset(parity, t, rank);
#pragma unroll
    for (int i = 0; i < kRun; ++i) {
      const int64_t h = hbase + i * 256;
      if (i >= cpr) continue;  // warp-uniform
      if constexpr (kData) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][e] = canon_nan(acc[i][e]);
      }
      {
        if (f32) {
          // Whole lines per instruction (512 contiguous bytes): the chunk's elements [4 lane, +4), then
          // [128 + 4 lane, +4), i.e. half (lane & 1) of lane (lane >> 1)'s eight and of lane 16 + (lane >> 1)'s.
          // H % 8 == 0: a group of 4 is valid exactly when its source lane's h is.
          const int64_t hc = hbase - lane * 8 + i * 256;  // the chunk's first element
          float lo[8], hi[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            lo[e] = __shfl_sync(0xffffffffu, acc[i][e], lane >> 1);
            hi[e] = __shfl_sync(0xffffffffu, acc[i][e], 16 + (lane >> 1));
          }
          const bool odd = lane & 1;
          const int64_t ha = hc + 4 * lane, hb2 = hc + 128 + 4 * lane;
          const uint4 va = odd ? make_uint4(__float_as_uint(lo[4]), __float_as_uint(lo[5]), __float_as_uint(lo[6]), __float_as_uint(lo[7]))
                               : make_uint4(__float_as_uint(lo[0]), __float_as_uint(lo[1]), __float_as_uint(lo[2]), __float_as_uint(lo[3]));
          const uint4 vb = odd ? make_uint4(__float_as_uint(hi[4]), __float_as_uint(hi[5]), __float_as_uint(hi[6]), __float_as_uint(hi[7]))
                               : make_uint4(__float_as_uint(hi[0]), __float_as_uint(hi[1]), __float_as_uint(hi[2]), __float_as_uint(hi[3]));
          if constexpr (kData) {
            if (ha < H) stv16(dst + 4 * ha, va);
            if (hb2 < H) stv16(dst + 4 * hb2, vb);
          } else {
            if (ha < H) st16(dst + 4 * ha, va);
            if (hb2 < H) st16(dst + 4 * hb2, vb);
          }
          continue;
        }
      }
      if (h >= H) continue;
      {  // bf16 partial rows
        uint32_t o[4];
#pragma unroll
        for (int e = 0; e < 4; ++e)
          o[e] = static_cast<uint32_t>(float_to_bf16_bits(acc[i][2 * e])) | (static_cast<uint32_t>(float_to_bf16_bits(acc[i][2 * e + 1])) << 16);
        if constexpr (kData) stv16(dst + 2 * h, make_uint4(o[0], o[1], o[2], o[3]));
        else st16(dst + 2 * h, make_uint4(o[0], o[1], o[2], o[3]));
      }
    }
    if (stamp0) {
      asm volatile("" ::: "memory");  // after the stores are issued
      trace_at(c, kTrCombStored0);
    }
  }
}

/// The token's addend (FinalizeArgs::addend) joins 8 fp32 sums at column h before their rounding
/// (LlCpu::finalize: after the ranks' partials or the columns); addend_row null: nothing.
__device__ __forceinline__ void add_addend8(float* acc, const float* addend_row, int64_t h) {
  if (!addend_row) return;
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], addend_row[h + e]);
}

/// The receive items' epilogue: a lane's kRun x 8 fp32 sums (chunk i at column hbase + 256 i of the
/// token's bf16 output row out_row, chunks past cpr or H skipped), plus the token's addend row when
/// given, rounded once to bf16, 16-byte stores.
template <int kRun>
__device__ __forceinline__ void store_bf16_run(uint16_t* out_row, const float (&sums)[kRun][8], int64_t hbase, int cpr, int64_t H,
                                               const float* addend_row) {
#pragma unroll
  for (int i = 0; i < kRun; ++i) {
    const int64_t h = hbase + i * 256;
    if (i >= cpr || h >= H) continue;
    float acc[1][8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[0][e] = sums[i][e];
    add_addend8(acc[0], addend_row, h);
    uint32_t o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      o[e] = static_cast<uint32_t>(float_to_bf16_bits(acc[0][2 * e])) | (static_cast<uint32_t>(float_to_bf16_bits(acc[0][2 * e + 1])) << 16);
    st16(out_row + h, make_uint4(o[0], o[1], o[2], o[3]));
  }
}

/// Partial combine receive (flag): items are (token, run of cpr 256-element chunks); the
/// first item's routing (dest_mask) is loaded before the wait; then the partial rows of every rank
/// in the token's mask, all of the run's loads in flight, are added in rank order in fp32 and
/// rounded once to bf16. Block-wide (the wait). s_bad: the caller's shared [kLlMaxRanks].
template <int kRun>
__device__ __forceinline__ void combine_recv_runs(const LlCombineParams& p, int W, int warp, int lane, const unsigned long long* s_call,
                                                  int* s_bad) {
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks;
  const int64_t H = lay.hidden;
  const bool f32 = lay.combine == 1;
  const int T = *reinterpret_cast<const volatile int32_t*>(&c.state->num_tokens);
  const int nch = static_cast<int>((H + 255) / 256);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * W;
  const int cpr = chunks_per_run(nch, T, warps, kRun);
  const int runs = (nch + cpr - 1) / cpr;
  const int64_t items = p.rejected ? 0 : static_cast<int64_t>(T) * runs;  // rejected: out is not written
  const int64_t first_item = static_cast<int64_t>(blockIdx.x) * W + warp;
  uint32_t mask = first_item < items ? p.dest_mask[udiv(first_item, runs)] : 0u;
  if (threadIdx.x < R) s_bad[threadIdx.x] = 0;
  __syncthreads();  // s_call (thread 0 read it at the kernel's start), s_bad
  const unsigned long long call = *s_call;
  const int parity = static_cast<int>(call & 1);
  wait_all_flags(c, [&](int s) { return c.local + lay.combine_flag_offset(s, 0); }, call + 1, LlErrorReport::combine, call, s_bad, [](int) {});
  __syncthreads();
  trace_at(c, 6);
  trace_max(c, 11);
  const float acc0 = combine_rejected_source(p, s_bad, call) >= 0 ? __uint_as_float(0x7fc00000u) : 0.0f;  // a peer rejected: NaN
  for (int64_t item = first_item; item < items; item += warps) {
    const int t = udiv(item, runs), run = static_cast<int>(item - static_cast<int64_t>(t) * runs);
    if (item != first_item) mask = p.dest_mask[t];
    const int64_t hbase = static_cast<int64_t>(run) * cpr * 256 + lane * 8;
    float acc[kRun][8];
#pragma unroll
    for (int i = 0; i < kRun; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[i][e] = acc0;
    for (int r0 = 0; r0 < R; r0 += 2) {  // 2 ranks x the run's chunks in flight
      float v[2][kRun][8];
#pragma unroll
      for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int i = 0; i < kRun; ++i) {
          const int64_t h = hbase + i * 256;
          if (r0 + q < R && ((mask >> (r0 + q)) & 1u) && i < cpr && h < H) {
            const uint8_t* row = c.local + lay.combine_partial_offset(parity, t, r0 + q);
            if (f32) load_partial<true>(row, h, v[q][i]);
            else load_partial<false>(row, h, v[q][i]);
          }
        }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        if (r0 + q >= R || !((mask >> (r0 + q)) & 1u)) continue;
#pragma unroll
        for (int i = 0; i < kRun; ++i)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[i][e] = __fadd_rn(acc[i][e], v[q][i][e]);
      }
    }
    const bool stamp0 = item == first_item;  // block 0's warp 0 (trace_at): the phases of its first item
    if (stamp0 && __float_as_uint(acc[0][0]) != 0x7fc00001u) trace_at(c, kTrCombRecvLoaded0);  // after the sums (data-dependent)
    store_bf16_run<kRun>(p.out + static_cast<int64_t>(t) * H, acc, hbase, cpr, H, p.addend ? p.addend + static_cast<int64_t>(t) * H : nullptr);
    if (stamp0) {
      asm volatile("" ::: "memory");  // after the stores are issued
      trace_at(c, kTrCombRecvStored0);
    }
  }
  if (threadIdx.x == 0) atomicAdd(&c.state->combine_recv_blocks, 1ull);
}

/// Partial combine receive, ll.combine_wait = data (ll_cuda.h): items are (token, run of cpr
/// 256-element chunks) as in combine_recv_runs, but no flag is waited for: every partial row of the
/// item is loaded (volatile), and while a lane's vectors still hold kLlPoison they are loaded again
/// (a row of which nothing arrived yet: only its last vector, to keep the polling traffic small); then
/// the rows are added in rank order in fp32, rounded once to bf16, and the poison is stored back into
/// every vector read (the region is ready for call n + 2). A warp's waits together are bounded by
/// timeout_s (then reported, naming the rank whose row is missing). Block-wide (one __syncthreads).
template <int kRun, bool kF32>
__device__ __forceinline__ void combine_recv_data(const LlCombineParams& p, int W, int warp, int lane, const unsigned long long* s_call,
                                                  bool* gave_up) {
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks;
  const int64_t H = lay.hidden;
  constexpr int kV = kF32 ? 2 : 1, kN = kRun * kV;  // 16-byte vectors per lane and row
  const int T = *reinterpret_cast<const volatile int32_t*>(&c.state->num_tokens);
  const int nch = static_cast<int>((H + 255) / 256);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * W;
  const int cpr = chunks_per_run(nch, T, warps, kRun);
  const int runs = (nch + cpr - 1) / cpr;
  const int64_t items = static_cast<int64_t>(T) * runs;
  const int64_t first_item = static_cast<int64_t>(blockIdx.x) * W + warp;
  uint32_t mask = first_item < items ? p.dest_mask[udiv(first_item, runs)] : 0u;
  __syncthreads();  // s_call (thread 0 read it at the kernel's start)
  const unsigned long long call = *s_call;
  const int parity = static_cast<int>(call & 1);
  trace_at(c, kTrCombWaited0);
  trace_max(c, kTrCombWaitedLast);
  unsigned long long t_wait = 0;  // the warp's first not-ready poll (0: none yet)
  for (int64_t item = first_item; item < items; item += warps) {
    const int t = udiv(item, runs), run = static_cast<int>(item - static_cast<int64_t>(t) * runs);
    if (item != first_item) mask = p.dest_mask[t];
    const int64_t hbase = static_cast<int64_t>(run) * cpr * 256 + lane * 8;
    float acc[kRun][8];
#pragma unroll
    for (int i = 0; i < kRun; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[i][e] = 0.0f;
    unsigned live_n = 0;  // vectors n = i kV + v of this lane inside the row (i < cpr, h < H)
#pragma unroll
    for (int n = 0; n < kN; ++n)
      if (n / kV < cpr && hbase + (n / kV) * 256 < H) live_n |= 1u << n;
    auto vec_at = [&](int r, int n) -> uint8_t* {
      const int64_t h = hbase + (n / kV) * 256;
      return c.local + lay.combine_partial_offset(parity, t, r) + (kF32 ? 4 * h + 16 * (n % kV) : 2 * h);
    };
    for (int r0 = 0; r0 < R; r0 += 2) {  // 2 ranks x the run's vectors in flight
      uint4 raw[2][kN];
      unsigned need[2], pend[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        need[q] = r0 + q < R && ((mask >> (r0 + q)) & 1u) ? live_n : 0u;
#pragma unroll
        for (int n = 0; n < kN; ++n)
          if ((need[q] >> n) & 1u) raw[q][n] = ldv16(vec_at(r0 + q, n));
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        pend[q] = 0;
#pragma unroll
        for (int n = 0; n < kN; ++n)
          if (((need[q] >> n) & 1u) && poisoned(raw[q][n])) pend[q] |= 1u << n;
      }
      // (*gave_up and every branch below are warp-uniform: the votes decide.)
      while (!*gave_up && __any_sync(0xffffffffu, (pend[0] | pend[1]) != 0u)) {
        if (t_wait == 0) t_wait = globaltimer();
        if (__any_sync(0xffffffffu, static_cast<long long>(globaltimer() - t_wait) > c.timeout_ns)) {
          const int miss = pend[0] ? r0 : pend[1] ? r0 + 1 : -1;
          if (miss >= 0) report(c, LlErrorReport::timeout, miss, LlErrorReport::combine, static_cast<long long>(call), t);
          *gave_up = true;  // this warp waits no more (the object is broken: every later call throws)
          break;
        }
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const bool none_yet = pend[q] == need[q];  // nothing of this row yet: poll its last vector only
          const int last = need[q] ? 31 - __clz(need[q]) : 0;
#pragma unroll
          for (int n = 0; n < kN; ++n)
            if (((pend[q] >> n) & 1u) && (!none_yet || n == last)) raw[q][n] = ldv16(vec_at(r0 + q, n));
#pragma unroll
          for (int n = 0; n < kN; ++n)
            if (((pend[q] >> n) & 1u) && !poisoned(raw[q][n])) pend[q] &= ~(1u << n);
        }
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        if (!need[q]) continue;
#pragma unroll
        for (int i = 0; i < kRun; ++i) {
          if (!((need[q] >> (i * kV)) & 1u)) continue;
          float v[8];
          if constexpr (kF32) {
            const uint32_t w[8] = {raw[q][i * kV].x, raw[q][i * kV].y, raw[q][i * kV].z, raw[q][i * kV].w,
                                   raw[q][i * kV + kV - 1].x, raw[q][i * kV + kV - 1].y, raw[q][i * kV + kV - 1].z, raw[q][i * kV + kV - 1].w};
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = __uint_as_float(w[e]);
          } else {
            bf16x8_to_float(raw[q][i * kV], v);
          }
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[i][e] = __fadd_rn(acc[i][e], v[e]);
        }
#pragma unroll
        for (int n = 0; n < kN; ++n)
          if ((need[q] >> n) & 1u) stv16(vec_at(r0 + q, n), make_uint4(kLlPoison, kLlPoison, kLlPoison, kLlPoison));
      }
    }
    store_bf16_run<kRun>(p.out + static_cast<int64_t>(t) * H, acc, hbase, cpr, H, p.addend ? p.addend + static_cast<int64_t>(t) * H : nullptr);
  }
  if (threadIdx.x == 0) atomicAdd(&c.state->combine_recv_blocks, 1ull);
}

// kData: ll.combine_wait = data with a partial mode (LlCommon::combine_data; its own register
// allocation, so the flag protocol's kernel keeps its spill-free budget).
template <int kMaxThreads, bool kData>
__global__ void __launch_bounds__(kMaxThreads, 1) ll_combine_kernel(const __grid_constant__ LlCombineParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks, K = lay.top_k, max_t = lay.max_tokens, rank = c.rank, L = c.num_local;
  const int64_t H = lay.hidden, cap = static_cast<int64_t>(R) * max_t;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const bool partial = lay.partial(), f32 = lay.combine == 1;
  __shared__ unsigned long long s_call_send, s_call_recv;
  __shared__ int s_bad[kLlMaxRanks];
  __shared__ unsigned long long tr_ns0, tr_clk0;  // block 0's start (trace_clk; shared: no registers held)
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    tr_ns0 = globaltimer();
    tr_clk0 = clock64();
    c.state->trace[4] = tr_ns0;
  }
  trace_max(c, 9);
  // Partial modes: the send part's warps take runs and read the call number themselves with their
  // first item's routing (one round trip less); s_call_send is read by the flags only, after a sync.
  constexpr bool data = kData;  // ll.combine_wait = data (partial modes)
  const bool run_send = partial;
  bool gave_up = false;  // ll.combine_wait = data: this thread's waits timed out
  if (threadIdx.x == 0) {  // both loads out before either division waits
    const unsigned long long cs = ld_volatile_u64(&c.state->combine_send_blocks), cr = ld_volatile_u64(&c.state->combine_recv_blocks);
    s_call_send = div_blocks(cs, gridDim.x);
    s_call_recv = div_blocks(cr, gridDim.x);
    // ll.combine_wait = data: tell every peer how many combine receives this rank has finished (all
    // of them before this kernel, stream order), so its sends may reuse those regions.
    if (data && p.send && blockIdx.x == 0)
      for (int d = 0; d < R; ++d)
        if (d != rank) st_release_sys_u64(c.peers[d] + lay.combine_flag_offset(rank, 0), s_call_recv);
  }
  if (!(p.send && run_send)) __syncthreads();

  if (!kData && p.send && p.rejected) {  // this rank refused its finalize arguments: no rows, marked flags
    if (run_send) __syncthreads();  // s_call_send (the sync above was skipped)
    const unsigned long long flag = (s_call_send + 1) | kLlFlagRejected;
    if (threadIdx.x < R) st_release_sys_u64(c.peers[threadIdx.x] + lay.combine_flag_offset(rank, blockIdx.x), flag);
    if (threadIdx.x == 0) atomicAdd(&c.state->combine_send_blocks, 1ull);
  } else if (p.send && run_send) {
    combine_send_runs<kMaxThreads <= 512 ? 4 : 2, kMaxThreads <= 512 ? 4 : 2, kData>(p, W, warp, lane, &gave_up);
    __syncthreads();
    trace_max(c, kTrCombItems);
    if constexpr (data) {  // no flags: the rows are the signal; the counter numbers the calls
      if (threadIdx.x == 0) atomicAdd(&c.state->combine_send_blocks, 1ull);
    } else {
      if (threadIdx.x < R) st_release_sys_u64(c.peers[threadIdx.x] + lay.combine_flag_offset(rank, blockIdx.x), s_call_send + 1);
      if (threadIdx.x == 0) atomicAdd(&c.state->combine_send_blocks, 1ull);
    }
    trace_max(c, 5);
  } else if (!kData && p.send) {  // column mode
    const int parity = static_cast<int>(s_call_send & 1);
    // Items are (slot, chunk), a slot of some local expert (prefix over recv_count[L]).
    const int G = L;
    int32_t* s_pref = reinterpret_cast<int32_t*>(smem);  // [G + 1]
    // All threads load the counts at once (one memory latency), then warp 0 scans in shared memory.
    for (int g = threadIdx.x; g < G; g += blockDim.x) s_pref[g] = p.recv_count[g];
    __syncthreads();
    if (warp == 0) {
      int running = 0;
      for (int g0 = 0; g0 < G; g0 += 32) {
        const int g = g0 + lane;
        const int cnt = g < G ? s_pref[g] : 0;
        int incl = cnt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += v;
        }
        if (g < G) s_pref[g] = running + incl - cnt;
        running += __shfl_sync(0xffffffffu, incl, 31);
      }
      if (lane == 0) s_pref[G] = running;
    }
    __syncthreads();
    trace_at(c, kTrCombCounts);
    // (slot, 1024-element chunk) items: 4 independent 16-byte loads per lane, then 4 stores.
    const int nch = static_cast<int>((H + 1023) / 1024);
    const int64_t items = static_cast<int64_t>(s_pref[L]) * nch;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * W + warp; item < items; item += static_cast<int64_t>(gridDim.x) * W) {
      const int flat = static_cast<int>(item / nch), ch = static_cast<int>(item % nch);
      int lo = 0, hi = L;  // largest l with s_pref[l] <= flat
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (s_pref[mid] <= flat) lo = mid;
        else hi = mid;
      }
      const int64_t row = static_cast<int64_t>(lo) * cap + (flat - s_pref[lo]);
      const int s = p.src_rank[row], t = p.src_token[row], k = p.topk_column[row];
      const uint16_t* src = p.expert_out + row * H;
      uint8_t* dst = c.peers[s] + lay.combine_row_offset(parity, t, k);
      uint4 v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t h = static_cast<int64_t>(ch) * 1024 + i * 256 + lane * 8;
        if (h < H) v[i] = __ldg(reinterpret_cast<const uint4*>(src + h));
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t h = static_cast<int64_t>(ch) * 1024 + i * 256 + lane * 8;
        if (h < H) st16(dst + 2 * h, v[i]);
      }
    }
    __syncthreads();
    trace_max(c, kTrCombItems);
    if (threadIdx.x < R) st_release_sys_u64(c.peers[threadIdx.x] + lay.combine_flag_offset(rank, blockIdx.x), s_call_send + 1);
    if (threadIdx.x == 0) atomicAdd(&c.state->combine_send_blocks, 1ull);
    trace_max(c, 5);
  }

  if constexpr (kData) {
    if (p.recv) {
      if (f32) combine_recv_data<2, true>(p, W, warp, lane, &s_call_recv, &gave_up);
      else combine_recv_data<2, false>(p, W, warp, lane, &s_call_recv, &gave_up);
      __syncthreads();
      trace_at(c, kTrCombReduced0);
      trace_clk(c, kTrCombReducedCyc, tr_ns0, tr_clk0);
      trace_max(c, 7);
    }
    return;
  }
  if (p.recv && partial) {
    combine_recv_runs<2>(p, W, warp, lane, &s_call_recv, s_bad);
    __syncthreads();
    trace_at(c, kTrCombReduced0);
    trace_clk(c, kTrCombReducedCyc, tr_ns0, tr_clk0);
    trace_max(c, 7);
  } else if (p.recv) {  // column mode
    if (threadIdx.x < R) s_bad[threadIdx.x] = 0;
    __syncthreads();  // s_call_recv (read before a sync that the send part may have skipped)
    const unsigned long long call = s_call_recv;
    const int parity = static_cast<int>(call & 1);
    // This rank's own routing (written by its dispatch, an earlier kernel) is loaded before the wait
    // on the peers, for the warp's first item: its latency hides behind the wait.
    const int T = *reinterpret_cast<const volatile int32_t*>(&c.state->num_tokens);
    const int nch = static_cast<int>((H + 255) / 256);
    const int64_t items = p.rejected ? 0 : static_cast<int64_t>(T) * nch;  // rejected: out is not written
    const int64_t first_item = static_cast<int64_t>(blockIdx.x) * W + warp;
    int32_t my_first = -1;
    float my_w = 0.0f;
    auto load_routing = [&](int t) {
      if (lane < K) {
        my_first = p.first_col[static_cast<int64_t>(t) * K + lane];
        my_w = p.weights[static_cast<int64_t>(t) * K + lane];
      }
    };
    if (first_item < items) load_routing(static_cast<int>(first_item / nch));
    wait_all_flags(c, [&](int s) { return c.local + lay.combine_flag_offset(s, 0); }, call + 1, LlErrorReport::combine, call, s_bad, [](int) {});
    __syncthreads();
    trace_at(c, 6);
    trace_max(c, 11);
    const float acc0 = combine_rejected_source(p, s_bad, call) >= 0 ? __uint_as_float(0x7fc00000u) : 0.0f;  // a peer rejected: NaN
    // (token, 256-element chunk) items: a lane owns 8 elements; 4 rows are loaded at once, then added
    // in column order.
    for (int64_t item = first_item; item < items; item += static_cast<int64_t>(gridDim.x) * W) {
      const int t = static_cast<int>(item / nch), ch = static_cast<int>(item % nch);
      if (item != first_item) load_routing(t);
      const int64_t h = static_cast<int64_t>(ch) * 256 + lane * 8;
      const bool ok = h < H;
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = acc0;
      // valid columns, 4 at a time in column order
      gather_columns(my_first, my_w, ok, [&](int f) { return c.local + lay.combine_row_offset(parity, t, f) + 2 * h; }, acc);
      if (ok) add_addend8(acc, p.addend ? p.addend + static_cast<int64_t>(t) * H : nullptr, h);
      uint32_t o[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        o[i] = static_cast<uint32_t>(float_to_bf16_bits(acc[2 * i])) | (static_cast<uint32_t>(float_to_bf16_bits(acc[2 * i + 1])) << 16);
      if (ok) st16(p.out + static_cast<int64_t>(t) * H + h, make_uint4(o[0], o[1], o[2], o[3]));
    }
    if (threadIdx.x == 0) atomicAdd(&c.state->combine_recv_blocks, 1ull);
    __syncthreads();
    trace_at(c, kTrCombReduced0);
    trace_clk(c, kTrCombReducedCyc, tr_ns0, tr_clk0);
    trace_max(c, 7);
  }
}

__global__ void delay_kernel(long long ns) {
  const unsigned long long start = globaltimer();
  while (static_cast<long long>(globaltimer() - start) < ns) __nanosleep(1000);
}

__global__ void stamp_kernel(unsigned long long* dst) { *dst = globaltimer(); }

template <int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads, 1) ll_empty_kernel() {}

}  // namespace

void launch_gpu_stamp(unsigned long long* dst, cudaStream_t stream) {
  stamp_kernel<<<1, 1, 0, stream>>>(dst);
  cuda::check_launch("stamp_kernel");
}

void launch_ll_empty(size_t smem, int blocks, int threads, cudaStream_t stream) {
  // (Above 48 KiB the attribute is set once here: call it eagerly before a capture.)
  if (threads > 512) {
    if (smem > 48 * 1024)
      EPX_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(&ll_empty_kernel<1024>), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    ll_empty_kernel<1024><<<blocks, threads, smem, stream>>>();
  } else {
    if (smem > 48 * 1024)
      EPX_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(&ll_empty_kernel<512>), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    ll_empty_kernel<512><<<blocks, threads, smem, stream>>>();
  }
  cuda::check_launch("ll_empty_kernel");
}

void launch_gpu_delay(long long ns, cudaStream_t stream) {
  delay_kernel<<<1, 32, 0, stream>>>(ns);
  cuda::check_launch("delay_kernel");
}

size_t ll_dispatch_smem_bytes(const LlLayout& lay, bool expand_message, int num_local) {
  const size_t R = static_cast<size_t>(lay.num_ranks), max_t = static_cast<size_t>(lay.max_tokens), K = static_cast<size_t>(lay.top_k);
  const size_t NI = static_cast<size_t>(lay.num_ids), Wm = (max_t + 31) / 32;
  const size_t send = 4 * max_t + 4 * max_t * R + (expand_message ? 8 * NI * Wm + 4 * NI : 0);
  const size_t Q = R * ((max_t + 31) / 32);
  const size_t recv = expand_message ? 4 * static_cast<size_t>(num_local) * R
                                     : static_cast<size_t>(ll_align_up(static_cast<int64_t>(2 * R * max_t * K), 16)) + 4 * Q + 4 * Q + 4 * R * max_t + 32 * Q;
  return (send > recv ? send : recv) + 16;
}

size_t ll_combine_smem_bytes(int num_local, int num_ranks) {
  return 4 * (static_cast<size_t>(num_local > num_ranks ? num_local : num_ranks) + 1) + 16;
}

int ll_max_resident_blocks(int threads, size_t dispatch_smem, size_t combine_smem) {
  int dev = 0, sms = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  int worst = 1 << 30;
  auto check = [&](const void* fn, size_t smem) {
    // Never lowered: objects of one process with other layouts / modes keep what they need.
    cudaFuncAttributes attr{};
    EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
    const int want = static_cast<int>(smem) > attr.maxDynamicSharedSizeBytes ? static_cast<int>(smem) : attr.maxDynamicSharedSizeBytes;
    EPX_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, want));
    int n = 0;
    EPX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, smem));
    worst = n < worst ? n : worst;
  };
  if (threads > 512) {
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<true, 1024, true>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<false, 1024, true>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<true, 1024, false>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<false, 1024, false>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_combine_kernel<1024, false>), combine_smem);
    check(reinterpret_cast<const void*>(&ll_combine_kernel<1024, true>), combine_smem);
  } else {
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<true, 512, true>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<false, 512, true>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<true, 512, false>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<false, 512, false>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_combine_kernel<512, false>), combine_smem);
    check(reinterpret_cast<const void*>(&ll_combine_kernel<512, true>), combine_smem);
  }
  return worst * sms;
}

void launch_ll_dispatch(const LlDispatchParams& p, int blocks, int threads, cudaStream_t stream) {
  const size_t smem = ll_dispatch_smem_bytes(p.c.lay, p.c.expand_message, p.c.num_local);
  const bool fp8 = p.c.lay.use_fp8, msg = p.c.expand_message;
  if (threads > 512) {
    if (fp8 && msg) ll_dispatch_kernel<true, 1024, true><<<blocks, threads, smem, stream>>>(p);
    else if (msg) ll_dispatch_kernel<false, 1024, true><<<blocks, threads, smem, stream>>>(p);
    else if (fp8) ll_dispatch_kernel<true, 1024, false><<<blocks, threads, smem, stream>>>(p);
    else ll_dispatch_kernel<false, 1024, false><<<blocks, threads, smem, stream>>>(p);
  } else {
    if (fp8 && msg) ll_dispatch_kernel<true, 512, true><<<blocks, threads, smem, stream>>>(p);
    else if (msg) ll_dispatch_kernel<false, 512, true><<<blocks, threads, smem, stream>>>(p);
    else if (fp8) ll_dispatch_kernel<true, 512, false><<<blocks, threads, smem, stream>>>(p);
    else ll_dispatch_kernel<false, 512, false><<<blocks, threads, smem, stream>>>(p);
  }
  cuda::check_launch("ll_dispatch_kernel");
}

void launch_ll_combine(const LlCombineParams& p, int blocks, int threads, cudaStream_t stream) {
  const size_t smem = ll_combine_smem_bytes(p.c.num_local, p.c.lay.num_ranks);
  const bool data = p.c.combine_data && p.c.lay.partial();
  if (threads > 512 && data) ll_combine_kernel<1024, true><<<blocks, threads, smem, stream>>>(p);
  else if (threads > 512) ll_combine_kernel<1024, false><<<blocks, threads, smem, stream>>>(p);
  else if (data) ll_combine_kernel<512, true><<<blocks, threads, smem, stream>>>(p);
  else ll_combine_kernel<512, false><<<blocks, threads, smem, stream>>>(p);
  cuda::check_launch("ll_combine_kernel");
}

}  // namespace epx::dispatch
