// experts/experts_fp8_prefill.cuh: what the two FP8 prefill GEMM files share
// (experts_fp8_prefill_cuda.cu: cp.async loads; experts_fp8_prefill_tma_cuda.cu: TMA loads): the
// CTA tile and its shared-memory layout, and the consumer warpgroups'
// work on one K block (wgmmas and the block-scale promotion, kblock) and on one work item's end
// (gate_up: silu(g) * u and the FP8 1x128 requantization of h; down: bf16 out; epilogue).
//
// CTA tile: 256 weight rows (gate_up: the gate and up rows of 128 h columns; down: 256 output
// columns) x 128 tokens x 128 K per stage; two consumer warpgroups (thread ids 128..383), warpgroup c
// with tokens 64 c .. 64 c + 63 in wgmma's A and the weight rows in B (DeepGEMM's orientation),
// 2 x 64 fp32 accumulators and a 64-float temporary per thread (m64n128k32 wgmmas). Promotion after
// every 128-deep K block: acc += tmp * (w_scale * x_scale) (DeepSeek-V3's recipe; DeepGEMM's order).
// Weights in wgmma's A, consumer turn orders and consumers that pipeline m64n64 batches (wait_group 1, A from
// shared memory or in registers) measured slower and are not kept (bench/NOTES.md, 'FP8 prefill GEMM, the
// consumer side').
#pragma once

#include <cstdint>
#include <type_traits>

#include "epx/dtype.h"
#include "experts/experts_fp8_cuda.h"
#include "experts/experts_fp8_wgmma.cuh"

namespace epx::experts_cuda::pf {

using wg::kBK;

constexpr int kPfThreads = 384;
constexpr int kBN = kFp8PrefillRows;            // 128 tokens
constexpr int kWRows = kFp8TileWeightRows;      // 256 weight rows
constexpr int kSub = 64 * kBK;                  // one m64 sub-tile of 64 rows (8 KiB)
constexpr int kABytes = kWRows * kBK;           // 32 KiB
constexpr int kBBytes = kBN * kBK;              // 16 KiB
constexpr int kStageBytes = kABytes + kBBytes;  // 48 KiB (multiple of 1024: swizzle atoms)
constexpr int kScaleFloats = 4 + kBN;           // per stage: 4 weight sub-tile scales + 128 token scales
constexpr int kHStride = kBK + 16;              // gate_up staging: FP8 h bytes per token, padded
constexpr int kOutStride = kWRows + 8;          // down staging: bf16 per token, padded
constexpr int kFrag = kBN / 2;                  // accumulator floats per thread per m64n128
/// Arrivals that complete a stage's `empty` barrier in the FP8 prefill kernels (TMA and cp.async): every consumer
/// thread arrives after its own last read of the stage. (Lane 0 of each warp arriving
/// after __syncwarp, count 8, gives the same order through bar.warp.sync, but compute-sanitizer racecheck does not
/// follow it and reports every consumer read against the producer's refill; with per-thread arrivals it reports
/// none.)
constexpr int kEmptyArrivals = kPfThreads - 128;  // the two consumer warpgroups

/// Shared-memory layout of the gate_up (kGateUp) or down kernel; base 1024-byte aligned.
template <bool kGateUp>
struct Layout {
  static constexpr int kStages = kGateUp ? 4 : 3;  // down's 66 KiB staging leaves room for 3
  static constexpr int kScaleOff = kStages * kStageBytes;
  // full[kStages], empty[kStages], done (completed once at the start: a wait on it never blocks)
  static constexpr int kBarOff = kScaleOff + kStages * kScaleFloats * 4;
  static constexpr int kDoneOff = kBarOff + 2 * kStages * 8;
  static constexpr int kRowsOff = kDoneOff + 8;  // producer: [kBN] B row byte offsets
  static constexpr int kOutOff = (kRowsOff + kBN * 8 + 127) / 128 * 128;
  static constexpr int kOutBytes = kGateUp ? kBN * kHStride : kBN * kOutStride * 2;
  static constexpr int kSmemBytes = kOutOff + kOutBytes + 1024;  // + alignment of the base
};
static_assert(Layout<true>::kSmemBytes <= 227 * 1024 && Layout<false>::kSmemBytes <= 227 * 1024, "fits an SM");
static_assert((kScaleFloats * 4) % 16 == 0, "stage scale blocks stay 16-byte aligned");

static_assert(kHStride % 16 == 0 && (kOutStride * 2) % 16 == 0, "staged rows start 16-byte aligned (bulk copies)");

#ifdef EPX_FP8_WGMMA

/// The consumer thread's coordinates: ct = threadIdx.x - 128, its warpgroup cwg (0, 1), warp
/// (0..7), warp in the warpgroup, lane.
struct Who {
  int ct, cwg, warp, warp_in_wg, lane;
  __device__ __forceinline__ Who() {
    ct = static_cast<int>(threadIdx.x) - 128;
    cwg = ct >> 7;
    warp = ct >> 5;
    warp_in_wg = warp & 3;
    lane = ct & 31;
  }
};

/// clock (32-bit SM cycle counter; volatile with a memory clobber, so it keeps its place among the
/// other asm statements and memory accesses).
__device__ __forceinline__ uint32_t clock32() {
  uint32_t t;
  asm volatile("mov.u32 %0, %%clock;\n" : "=r"(t)::"memory");
  return t;
}
using cuda::dev::globaltimer_ordered;  // %globaltimer, keeping its place like clock32
/// 1, which the compiler cannot see through (a branch on it stays a branch).
__device__ __forceinline__ uint32_t opaque_one() {
  uint32_t v;
  asm volatile("mov.u32 %0, 1;\n" : "=r"(v));
  return v;
}

/// The debug stamps of the stamped prefill kernels (set_fp8_prefill_debug, experts_fp8_cuda.h;
/// the bench's --stamps): Stamps<false> compiles to nothing (the library's kernels). Stamps<true>
/// writes the clock at phase boundary i of the current K block to rec[i] (rec: this warp's words
/// of the K block in the debug buffer, null when the block is outside the recorded window or the
/// thread is not the recording lane) and carries the ablation flags (kPfDbg*).
template <bool kOn>
struct Stamps {
  __device__ __forceinline__ void at(int) const {}
  __device__ __forceinline__ bool no_promote() const { return false; }
};
template <>
struct Stamps<true> {
  uint32_t* rec = nullptr;
  uint32_t flags = 0;
  __device__ __forceinline__ void at(int i) const {
    const uint32_t t = clock32();
    if (rec != nullptr) rec[i] = t;
  }
  __device__ __forceinline__ bool no_promote() const { return (flags & kPfDbgNoPromote) != 0; }
};

/// One K block of this consumer warpgroup in the cp.async kernels: the stage's weight tile at a_s (256 rows),
/// token tile at b_s (128 rows), scales sc (4 weight sub-tile scales, then 128 token scales). The 4 scale products
/// are read first; A (the warpgroup's 64 tokens) is loaded into registers once per K block (ldmatrix, 16
/// registers), so the wgmmas read only B from shared memory (32 instead of 48 KiB per warpgroup and block). Two
/// batches of 4 m64n128k32 wgmmas into `tmp` (B: 128 weight rows, batch 0 the gate rows / output columns 0-127,
/// batch 1 the up rows / 128-255), each waited for (wait_group 0) and promoted into acc[sub]; a thread's
/// accumulators belong to 2 tokens (rows r, r + 8), so the promotion needs 2 scale products. `release()` (the
/// stage's `empty` arrive) runs right after the second batch's wait, before its promotion, so the producer can
/// refill the stage meanwhile.
/// Stamped (kDbg, Stamps<true>): boundaries 2 (scales read, A loads issued), 3 / 6 (batch 0 / 1
/// committed), 4 / 7 (waited for), 8 (released), 5 / 9 (promoted); an ablation flag may skip the
/// promotions (timing only: wrong results).
template <bool kDbg = false, class Release>
__device__ __forceinline__ void kblock(const Who& w, uint32_t a_s, uint32_t b_s, const float* sc, float (&acc)[2][kFrag],
                                       float (&tmp)[kFrag], Release release, const Stamps<kDbg>& st = Stamps<kDbg>{}) {
  using namespace wg;
  const int r = w.cwg * 64 + 16 * w.warp_in_wg + (w.lane >> 2);  // tokens r (i & 2 == 0), r + 8
  float sp[2][2];  // [weight block][token]: w_scale * x_scale
  const float x0 = sc[4 + r], x1 = sc[4 + r + 8], w0 = sc[0], w1 = sc[2];
  sp[0][0] = w0 * x0, sp[0][1] = w0 * x1, sp[1][0] = w1 * x0, sp[1][1] = w1 * x1;
  uint32_t afr[kBK / 32][4];
  {
    // Lane l gives the row address of matrix l / 8: rows 16 warp + (l % 8) + 8 ((l / 8) & 1) of the
    // warpgroup's 64 tokens, 16-byte chunk 2 k + (l / 16) of the 128-byte (swizzled) row.
    const int m = w.lane >> 3, row = w.cwg * 64 + 16 * w.warp_in_wg + (w.lane & 7) + 8 * (m & 1);
#pragma unroll
    for (int k = 0; k < kBK / 32; ++k) ldmatrix_x4(afr[k], b_s + swz(row, 2 * k + (m >> 1)));
  }
  st.at(2);
#pragma unroll
  for (int sub = 0; sub < 2; ++sub) {
    const uint64_t db = smem_desc(a_s + 2 * sub * kSub);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBK / 32; ++k) Wgmma<kBN>::mma_rs(tmp, afr[k], db + 2 * k, k);
    wgmma_commit();
    st.at(3 + 3 * sub);
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kFrag; ++i) fence_operand(tmp[i]);
    st.at(4 + 3 * sub);
    if (sub == 1) {
      release();
      st.at(8);
    }
    if (!st.no_promote()) {
#pragma unroll
      for (int i = 0; i < kFrag; ++i) acc[sub][i] = fmaf(tmp[i], (i & 2) ? sp[sub][1] : sp[sub][0], acc[sub][i]);
    }
    if constexpr (kDbg) {
#pragma unroll
      for (int i = 0; i < kFrag; ++i) fence_operand(acc[sub][i]);  // the promotion is issued before the stamp
    }
    st.at(sub == 0 ? 5 : 9);
  }
}

/// A consumer thread's loop-invariant shared-memory offsets for the TMA kernels' consumer (lean_item_prefetch),
/// computed once per thread and pinned in registers (an opaque asm result cannot be rematerialized; those
/// kernels give the consumers 232 registers, the producer 40): at the cp.async kernels' 216-register budget ptxas
/// recomputes the swizzled ldmatrix addresses and scale offsets from %tid (and the shared window from
/// SR_CgaCtaId) in every K block, ~35 instructions per warp and block (ncu source counters: 14 % of the consumer
/// warps' samples with the instructions around them; bench/NOTES.md, 'what the hardware counters say').
///   lds: byte offset, inside a stage's 128 x 128-byte token tile, of this lane's ldmatrix row for
///        k-step 0 (warpgroup cwg's tokens); k-step k's is lds ^ (k << 5) (the 128-byte swizzle
///        XORs the 16-byte chunk index 2 k + h with row % 8, and 2 k only touches chunk bits 1-2);
///   sc:  byte offset of this thread's first token scale (token r) in a stage's scale block
///        (token r + 8's is sc + 32).
struct LeanOffsets {
  uint32_t lds, sc;
  __device__ __forceinline__ explicit LeanOffsets(const Who& w) {
    const int m = w.lane >> 3, row = w.cwg * 64 + 16 * w.warp_in_wg + (w.lane & 7) + 8 * (m & 1);
    const int r = w.cwg * 64 + 16 * w.warp_in_wg + (w.lane >> 2);
    lds = wg::swz(row, m >> 1);
    sc = static_cast<uint32_t>((4 + r) * 4);
    asm volatile("" : "+r"(lds), "+r"(sc));
  }
};

__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}

/// The ring position of the next K block: stage (0 .. stages-1) and the parity of its use.
struct RingPos {
  uint32_t stage = 0, phase = 0;
  __device__ __forceinline__ void advance(uint32_t stages) {
    if (++stage == stages) stage = 0, phase ^= 1u;
  }
};

/// One K block's register operands for lean_item_prefetch: A (the warpgroup's 64 tokens,
/// ldmatrix fragments of the 4 k-steps) and the 4 scales (tokens r, r + 8; weight blocks 0, 1).
struct LeanBlock {
  uint32_t afr[kBK / 32][4];
  float x0, x1, w0, w1;
};

/// The shared-space addresses a LeanBlock is loaded from, for the stage whose token tile is at b_s and scale block at
/// sc_s: A's ldmatrix row address of k-step k (a(k)) and the scales x0, x1, w0, w1 (sc[0..3]). One place for
/// lean_load and lean_load_if.
struct LeanAddrs {
  uint32_t la, sc[4];
  __device__ __forceinline__ LeanAddrs(const LeanOffsets& o, uint32_t b_s, uint32_t sc_s)
      : la(b_s + o.lds), sc{sc_s + o.sc, sc_s + o.sc + 32, sc_s, sc_s + 8} {}
  __device__ __forceinline__ uint32_t a(int k) const { return la ^ static_cast<uint32_t>(k << 5); }
};

/// Loads lb from the stage whose token tile is at b_s and scale block at sc_s (after its `full`).
__device__ __forceinline__ void lean_load(const LeanOffsets& o, uint32_t b_s, uint32_t sc_s, LeanBlock& lb) {
  const LeanAddrs ad(o, b_s, sc_s);
#pragma unroll
  for (int k = 0; k < kBK / 32; ++k) wg::ldmatrix_x4(lb.afr[k], ad.a(k));
  lb.x0 = lds_f32(ad.sc[0]), lb.x1 = lds_f32(ad.sc[1]), lb.w0 = lds_f32(ad.sc[2]), lb.w1 = lds_f32(ad.sc[3]);
}

/// lean_load where `on` (warp-uniform), nothing otherwise: the ldmatrix / ld.shared carry the predicate themselves
/// (no branch for ptxas to schedule the promotion around); lb keeps its values where `on` is false. (lean_load is
/// not this with on = true: that form compiles to different SASS, 8 more instructions in the default gate_up
/// kernel with ptxas 13.0.)
__device__ __forceinline__ void lean_load_if(const LeanOffsets& o, uint32_t b_s, uint32_t sc_s, bool on, LeanBlock& lb) {
  const LeanAddrs ad(o, b_s, sc_s);
  const uint32_t p = on ? 1u : 0u;
#pragma unroll
  for (int k = 0; k < kBK / 32; ++k)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n@p ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n}\n"
        : "+r"(lb.afr[k][0]), "+r"(lb.afr[k][1]), "+r"(lb.afr[k][2]), "+r"(lb.afr[k][3])
        : "r"(ad.a(k)), "r"(p)
        : "memory");
  float* v[4] = {&lb.x0, &lb.x1, &lb.w0, &lb.w1};
#pragma unroll
  for (int i = 0; i < 4; ++i)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p ld.shared.f32 %0, [%1];\n}\n" : "+f"(*v[i]) : "r"(ad.sc[i]), "r"(p) : "memory");
}

/// The K loop of one work item for the TMA kernels' consumer: kblock's wgmmas and promotions, every address formed
/// from the stage's base and the pinned LeanOffsets, with the next K block's operands (lean_load, after its `full`
/// wait and `fence`) loaded right after this block's second batch completed and the stage was released, before
/// the second promotion: the ldmatrix / ld.shared latency then runs under those 64 FFMAs instead of in front of the
/// next block's first wgmma (where ncu shows WARPGROUP.ARRIVE waiting for ldmatrix, FMULs for their
/// loads). The products of a block are formed before its operands are replaced. Same products, same
/// order: the same bits as kblock.
/// No branch around the loads (ptxas hoisted the promotion above such a branch, in front of the loads): after
/// an item's last K block the wait is on the `done` barrier (done_bar, completed at the kernel's start) and the
/// loads are predicated off (lean_load_if); the next item starts with its own wait and load.
/// release(s): this thread's release of stage s (the one-CTA kernels: its arrival on the stage's `empty`; the
/// 2-CTA cluster kernels: also its warp's arrival on the other CTA's).
template <class Fence, class Release>
__device__ __forceinline__ void lean_item_prefetch(const LeanOffsets& o, int64_t nk, RingPos& pos, uint32_t stages, uint32_t smem_s,
                                                   uint32_t scale_s, uint32_t full0, uint32_t done_bar, float (&acc)[2][kFrag],
                                                   float (&tmp)[kFrag], Fence fence, Release release) {
  using namespace wg;
  auto stage_a = [&](uint32_t s) { return smem_s + s * kStageBytes; };
  auto stage_sc = [&](uint32_t s) { return scale_s + s * (kScaleFloats * 4); };
  LeanBlock lb;
  mbar_wait(full0 + pos.stage * 8, pos.phase);
  fence();
  lean_load(o, stage_a(pos.stage) + kABytes, stage_sc(pos.stage), lb);
  for (int64_t kb = 0; kb < nk; ++kb) {
    const uint32_t s = pos.stage;
    float sp[2][2];  // [weight block][token]: w_scale * x_scale
    sp[0][0] = lb.w0 * lb.x0, sp[0][1] = lb.w0 * lb.x1, sp[1][0] = lb.w1 * lb.x0, sp[1][1] = lb.w1 * lb.x1;
    pos.advance(stages);
#pragma unroll
    for (int sub = 0; sub < 2; ++sub) {
      const uint64_t db = smem_desc(stage_a(s) + 2 * sub * kSub);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBK / 32; ++k) Wgmma<kBN>::mma_rs(tmp, lb.afr[k], db + 2 * k, k);
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kFrag; ++i) fence_operand(tmp[i]);
      if (sub == 1) {
        release(s);  // every consumer thread releases the stage (kEmptyArrivals)
        const bool more = kb + 1 < nk;
        mbar_wait(more ? full0 + pos.stage * 8 : done_bar, more ? pos.phase : 0u);
        fence();
        // After the item's last K block (!more) nothing is loaded (the next item starts with its own wait and load).
        // Loading anyway would read the just-released stage s, which the producer may already be refilling (values
        // never used, but a real read-write race).
        lean_load_if(o, stage_a(pos.stage) + kABytes, stage_sc(pos.stage), more, lb);
      }
#pragma unroll
      for (int i = 0; i < kFrag; ++i) acc[sub][i] = fmaf(tmp[i], (i & 2) ? sp[sub][1] : sp[sub][0], acc[sub][i]);
    }
  }
}

/// Two floats as e4m3 codes (RNE, saturating to +-448), lo in bits 0-7 and hi in 8-15: the
/// hardware conversion (PTX cvt.rn.satfinite.e4m3x2.f32, sm_89+), the same codes as epx's
/// float_to_fp8_e4m3_bits for every non-NaN input.
__device__ __forceinline__ uint32_t fp8x2_bits(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}
/// Two floats as bf16 (RNE), lo in bits 0-15: cvt.rn.bf16x2.f32, the same bits as
/// float_to_bf16_bits for every non-NaN input.
__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

/// The end of one work item (both consumer warpgroups, 256 threads; ends with their barrier, so
/// the staging buffer is free for the next item): gate_up writes h = silu(g) * u as FP8 e4m3 with
/// one 1x128 scale per token (hq, hs), down writes bf16 rows of out.
/// The staged rows go out as one bulk copy per token row (cp.async.bulk, issued by the consumer thread
/// of that row), and the consumers move on to the next item while the copy engine reads the staging
/// buffer; the next epilogue waits for those reads before it writes the buffer (and bulk_end, after
/// the last item, for the copies' completion).
template <bool kGateUp>
__device__ __forceinline__ void epilogue(const Fp8GemmParams& p, const wg::Item& it, const Who& w, float (&acc)[2][kFrag],
                                         uint8_t* smem) {
  using namespace wg;
  using L = Layout<kGateUp>;
  const int ct = w.ct, cwg = w.cwg, warp_in_wg = w.warp_in_wg, lane = w.lane;
  // Barrier 1: both consumer warpgroups (2 is the producer's); consumer thread ct < 128 copies row ct.
  const int bar_id = 1, bar_n = 256;
  const bool copier = ct < kBN;
  const int crow = ct;
  if (copier) bulk_wait_read();  // the previous item's row copies have read the staging buffer
  named_bar_sync(bar_id, bar_n);
  if constexpr (kGateUp) {
    // h for (token cwg*64 + row, h column col): gate in acc[0], up in acc[1]; a token's 128 h
    // columns lie in one lane quad (32 per lane).
    uint8_t* stage = smem + L::kOutOff;  // [kBN][kHStride] FP8 h
    const int r = cwg * 64 + 16 * warp_in_wg + (lane >> 2);
    float m0 = 0.0f, m1 = 0.0f;  // amax of tokens r, r + 8
#pragma unroll
    for (int i = 0; i < kFrag; ++i) {
      const float g = acc[0][i], u = acc[1][i];
      acc[0][i] = g / (1.0f + expf(-g)) * u;  // silu(g) * u in fp32, the CPU's expression
      if (i & 2) m1 = fmaxf(m1, fabsf(acc[0][i]));
      else m0 = fmaxf(m0, fabsf(acc[0][i]));
    }
#pragma unroll
    for (int m = 1; m < 4; m <<= 1) {
      m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, m));
      m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, m));
    }
    const float sc0 = __fdiv_rn(fmaxf(m0, 1e-4f), kFp8E4m3Max), sc1 = __fdiv_rn(fmaxf(m1, 1e-4f), kFp8E4m3Max);
#pragma unroll
    for (int i = 0; i < kFrag; i += 2) {
      const int col = 8 * (i >> 2) + 2 * (lane & 3), tok = r + ((i & 2) ? 8 : 0);
      const float scale = (i & 2) ? sc1 : sc0;
      const uint32_t codes = fp8x2_bits(__fdiv_rn(acc[0][i], scale), __fdiv_rn(acc[0][i + 1], scale));
      *reinterpret_cast<uint16_t*>(stage + tok * kHStride + col) = static_cast<uint16_t>(codes);
    }
    if ((lane & 3) == 0) {
      if (r < it.num_rows) p.hs[static_cast<int64_t>(it.row0 + r) * p.hs_stride + it.col0 / kBK] = sc0;
      if (r + 8 < it.num_rows) p.hs[static_cast<int64_t>(it.row0 + r + 8) * p.hs_stride + it.col0 / kBK] = sc1;
    }
    fence_proxy_async();  // this thread's staging writes, before the copy engine reads them
    named_bar_sync(bar_id, bar_n);
    if (copier && crow < it.num_rows) {
      bulk_store(p.hq + static_cast<int64_t>(it.row0 + crow) * p.h_stride + it.col0,
                 static_cast<uint32_t>(__cvta_generic_to_shared(stage + crow * kHStride)), kBK);
      bulk_commit();
    }
  } else {
    uint16_t* stage = reinterpret_cast<uint16_t*>(smem + L::kOutOff);  // [kBN][kOutStride] bf16
#pragma unroll
    for (int sub = 0; sub < 2; ++sub) {
      // (token r or r + 8, output columns 128 sub + col, col + 1): one 4-byte store per pair.
      const int r = cwg * 64 + 16 * warp_in_wg + (lane >> 2);
#pragma unroll
      for (int i = 0; i < kFrag; i += 2) {
        const int col = 128 * sub + 8 * (i >> 2) + 2 * (lane & 3), tok = r + ((i & 2) ? 8 : 0);
        *reinterpret_cast<uint32_t*>(stage + tok * kOutStride + col) = bf16x2_bits(acc[sub][i], acc[sub][i + 1]);
      }
    }
    fence_proxy_async();
    named_bar_sync(bar_id, bar_n);
    if (copier && crow < it.num_rows) {
      const int64_t ncols = p.hidden - it.col0 < kWRows ? p.hidden - it.col0 : kWRows;  // H % 128 == 0
      bulk_store(p.out + static_cast<int64_t>(it.row0 + crow) * p.hidden + it.col0,
                 static_cast<uint32_t>(__cvta_generic_to_shared(stage + crow * kOutStride)), static_cast<uint32_t>(2 * ncols));
      bulk_commit();
    }
  }
}

/// After a consumer's last epilogue: its row copies completed (before the CTA exits).
__device__ __forceinline__ void bulk_end(const Who& w) {
  if (w.ct < kBN) wg::bulk_wait();
}

/// Weight tile `wt` of tile list entry `tile`, or false when this CTA-uniform item has nothing to do
/// (expert not fp8_block, weight tile past the expert's I or the model's H).
template <bool kGateUp>
__device__ __forceinline__ bool resolve_tile(const Fp8GemmParams& p, int32_t tile_idx, int wt, wg::Item& it, int32_t& expert) {
  const Tile tile = p.tiles[tile_idx];
  expert = tile.expert;
  const ExpertDesc e = p.experts[tile.expert];
  if (e.format != static_cast<int32_t>(WeightFormat::fp8_block)) return false;
  it.row0 = tile.row0;
  it.num_rows = tile.num_rows;
  it.inter = e.intermediate;
  it.hidden = p.hidden;
  if constexpr (kGateUp) {
    if (static_cast<int64_t>(wt) * kBK >= it.inter) return false;
    it.w = static_cast<const uint8_t*>(e.w13);
    it.w_scale = static_cast<const float*>(e.w13_scale);
    it.K = p.hidden;
    it.col0 = static_cast<int64_t>(wt) * kBK;
  } else {
    it.col0 = static_cast<int64_t>(wt) * kWRows;
    if (it.col0 >= p.hidden) return false;
    it.w = static_cast<const uint8_t*>(e.w2);
    it.w_scale = static_cast<const float*>(e.w2_scale);
    it.K = it.inter;
  }
  return true;
}

#endif  // EPX_FP8_WGMMA

}  // namespace epx::experts_cuda::pf
