// experts/experts_fp8_prefill.cuh: what the two FP8 prefill GEMM files share
// (experts_fp8_prefill_cuda.cu: cp.async loads; experts_fp8_prefill_tma_cuda.cu: TMA loads and the
// 2-CTA cluster launch): the CTA tile and its shared-memory layout, and the consumer warpgroups'
// work on one K block (wgmmas, the optional turn order, the block-scale promotion) and on one work
// item's end (gate_up: silu(g) * u and the FP8 1x128 requantization of h; down: bf16 out).
//
// CTA tile: 256 weight rows (gate_up: the gate and up rows of 128 h columns; down: 256 output
// columns) x 128 tokens x 128 K per stage; two consumer warpgroups (thread ids 128..383), each with
// 2 x 64 fp32 accumulators and a 64-float temporary per thread (m64n128k32 wgmmas). Promotion after
// every 128-deep K block: acc += tmp * (w_scale * x_scale) (DeepSeek-V3's recipe; DeepGEMM's order).
#pragma once

#include <cstdint>

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

/// Shared-memory layout of the gate_up (kGateUp) or down kernel; base 1024-byte aligned.
template <bool kGateUp>
struct Layout {
  static constexpr int kStages = kGateUp ? 4 : 3;  // down's 66 KiB staging leaves room for 3
  static constexpr int kScaleOff = kStages * kStageBytes;
  static constexpr int kBarOff = kScaleOff + kStages * kScaleFloats * 4;   // full[kStages], empty[kStages]
  static constexpr int kRedOff = kBarOff + 2 * kStages * 8;               // gate_up: [8 warps][128] amax
  static constexpr int kRowsOff = kRedOff + (kGateUp ? 8 * kBN * 4 : 0);  // producer: [kBN] B row byte offsets
  static constexpr int kOutOff = (kRowsOff + kBN * 8 + 127) / 128 * 128;
  static constexpr int kOutBytes = kGateUp ? kBN * kHStride : kBN * kOutStride * 2;
  static constexpr int kSmemBytes = kOutOff + kOutBytes + 1024;  // + alignment of the base
};
static_assert(Layout<true>::kSmemBytes <= 227 * 1024 && Layout<false>::kSmemBytes <= 227 * 1024, "fits an SM");
static_assert((kScaleFloats * 4) % 16 == 0, "stage scale blocks stay 16-byte aligned");

#ifdef EPX_FP8_WGMMA

/// Named barriers of the consumer turn order (Fp8GemmParams::prefill_order): kTurn1 "warpgroup 1 may
/// issue its next batch" (warpgroup 0 arrives, 1 syncs), kTurn0 the other way round. (1: the
/// consumers' own barrier, 2: the producer's.)
constexpr int kTurn0 = 3, kTurn1 = 4;

/// Hands the tensor-core turn to the other consumer warpgroup (non-blocking arrive).
__device__ __forceinline__ void pass_turn(int cwg) {
  if (cwg == 0) asm volatile("bar.arrive %0, 256;\n" ::"n"(kTurn1) : "memory");
  else asm volatile("bar.arrive %0, 256;\n" ::"n"(kTurn0) : "memory");
}

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

/// One K block of this consumer warpgroup: the stage's weight tile at a_s (256 rows), token tile
/// at b_s (128 rows), scales sc (4 weight sub-tile scales, then 128 token scales). Two batches of
/// 4 m64n128k32 wgmmas into `tmp`, each waited for (wait_group 0) and promoted into acc[sub].
/// kOrder (Fp8GemmParams::prefill_order): 0 = each warpgroup issues whenever its stage is ready;
/// 1..3 = the warpgroups take turns, warpgroup 0 first, handing over 1 = right after issuing, 2 =
/// when the batch has completed, 3 = when its first three wgmmas have completed (a second commit
/// group for the fourth). Same wgmmas into the same temporaries, same promotions: same bits.
/// kSwap (Fp8GemmParams::prefill_swap): tokens in wgmma's A (the warpgroup's 64 tokens), weights
/// in B (128 rows: gate_up all gate or all up rows of the tile's 128 h columns; down 128 output
/// columns), DeepGEMM's orientation: a thread's accumulators belong to 2 tokens (rows r, r + 8)
/// instead of 32, so the promotion needs 2 scale products instead of 32 products and 16 shared
/// loads. Not swapped: A = weight sub-tile 2 sub + cwg (64 rows), B = the 128 tokens.
/// `batches` counts this warpgroup's batches (turn order).
template <int kOrder, bool kSwap>
__device__ __forceinline__ void kblock(const Who& w, uint32_t a_s, uint32_t b_s, const float* sc, float (&acc)[2][kFrag],
                                       float (&tmp)[kFrag], int64_t& batches) {
  using namespace wg;
  const uint64_t db = smem_desc(b_s);
#pragma unroll
  for (int sub = 0; sub < 2; ++sub) {
    const uint64_t da = kSwap ? smem_desc(b_s + w.cwg * kSub) : smem_desc(a_s + (2 * sub + w.cwg) * kSub);
    const uint64_t dbs = kSwap ? smem_desc(a_s + 2 * sub * kSub) : db;
    if constexpr (kOrder != 0) {
      // Wait for the turn: warpgroup 1 for warpgroup 0's batch of this sub-tile, warpgroup 0 for
      // warpgroup 1's previous batch (none before its very first).
      if (w.cwg == 1) named_bar_sync(kTurn1, 256);
      else if (batches > 0) named_bar_sync(kTurn0, 256);
      ++batches;
    }
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBK / 32; ++k) {
      Wgmma<kBN>::mma(tmp, da + 2 * k, dbs + 2 * k, k);
      if constexpr (kOrder == 3)
        if (k == kBK / 32 - 2) wgmma_commit();
    }
    wgmma_commit();
    if constexpr (kOrder == 1) pass_turn(w.cwg);
    if constexpr (kOrder == 3) {
      wgmma_wait<1>();
      pass_turn(w.cwg);
    }
    wgmma_wait<0>();
    if constexpr (kOrder == 2) pass_turn(w.cwg);
#pragma unroll
    for (int i = 0; i < kFrag; ++i) fence_operand(tmp[i]);
    if constexpr (kSwap) {
      // Weight sub-tiles 2 sub and 2 sub + 1 share one 128 x 128 scale block (col0 % 128 == 0).
      const float wsc = sc[2 * sub];
      const int r = w.cwg * 64 + 16 * w.warp_in_wg + (w.lane >> 2);  // tokens r (i & 2 == 0), r + 8
      const float s0 = wsc * sc[4 + r], s1 = wsc * sc[4 + r + 8];
#pragma unroll
      for (int i = 0; i < kFrag; ++i) acc[sub][i] = fmaf(tmp[i], (i & 2) ? s1 : s0, acc[sub][i]);
    } else {
      const float wsc = sc[2 * sub + w.cwg];
#pragma unroll
      for (int i = 0; i < kFrag; i += 2) {
        const int col = 8 * (i >> 2) + 2 * (w.lane & 3);  // columns col, col + 1 for i, i + 1
        const float2 xs = *reinterpret_cast<const float2*>(sc + 4 + col);
        acc[sub][i] = fmaf(tmp[i], wsc * xs.x, acc[sub][i]);
        acc[sub][i + 1] = fmaf(tmp[i + 1], wsc * xs.y, acc[sub][i + 1]);
      }
    }
  }
}

/// After the last K block of the kernel: warpgroup 1's last hand-over has no batch after it;
/// warpgroup 0 consumes it so no arrival is left pending.
template <int kOrder>
__device__ __forceinline__ void turns_end(const Who& w, int64_t batches) {
  if constexpr (kOrder != 0)
    if (w.cwg == 0 && batches > 0) wg::named_bar_sync(kTurn0, 256);
}

/// The end of one work item (both consumer warpgroups, 256 threads; ends with their barrier, so
/// the staging buffer is free for the next item): gate_up writes h = silu(g) * u as FP8 e4m3 with
/// one 1x128 scale per token (hq, hs), down writes bf16 rows of out.
template <bool kGateUp, bool kSwap>
__device__ __forceinline__ void epilogue(const Fp8GemmParams& p, const wg::Item& it, const Who& w, float (&acc)[2][kFrag],
                                         uint8_t* smem) {
  using namespace wg;
  using L = Layout<kGateUp>;
  const int ct = w.ct, cwg = w.cwg, warp = w.warp, warp_in_wg = w.warp_in_wg, lane = w.lane;
  if constexpr (kGateUp && kSwap) {
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
      const uint32_t lo = float_to_fp8_e4m3_bits(__fdiv_rn(acc[0][i], scale));
      const uint32_t hi = float_to_fp8_e4m3_bits(__fdiv_rn(acc[0][i + 1], scale));
      *reinterpret_cast<uint16_t*>(stage + tok * kHStride + col) = static_cast<uint16_t>(lo | (hi << 8));
    }
    if ((lane & 3) == 0) {
      if (r < it.num_rows) p.hs[static_cast<int64_t>(it.row0 + r) * p.hs_stride + it.col0 / kBK] = sc0;
      if (r + 8 < it.num_rows) p.hs[static_cast<int64_t>(it.row0 + r + 8) * p.hs_stride + it.col0 / kBK] = sc1;
    }
    named_bar_sync(1, 256);
    for (int q = ct; q < it.num_rows * 8; q += 256) {
      const int j = q >> 3, c = q & 7;
      *reinterpret_cast<uint4*>(p.hq + static_cast<int64_t>(it.row0 + j) * p.h_stride + it.col0 + c * 16) =
          *reinterpret_cast<const uint4*>(stage + j * kHStride + c * 16);
    }
  } else if constexpr (kGateUp) {
    // h for (h column cwg*64 + row, token col): gate in acc[0], up in acc[1].
    float* red = reinterpret_cast<float*>(smem + L::kRedOff);  // [8 warps][kBN] amax
    uint8_t* stage = smem + L::kOutOff;                         // [kBN][kHStride] FP8 h
    float cmax[kFrag / 2];  // per distinct column: index (i >> 2) * 2 + (i & 1)
#pragma unroll
    for (int j = 0; j < kFrag / 2; ++j) cmax[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < kFrag; ++i) {
      const float g = acc[0][i], u = acc[1][i];
      acc[0][i] = g / (1.0f + expf(-g)) * u;  // silu(g) * u in fp32, the CPU's expression
      const int j = (i >> 2) * 2 + (i & 1);
      cmax[j] = fmaxf(cmax[j], fabsf(acc[0][i]));
    }
#pragma unroll
    for (int j = 0; j < kFrag / 2; ++j) {
#pragma unroll
      for (int m = 4; m < 32; m <<= 1) cmax[j] = fmaxf(cmax[j], __shfl_xor_sync(0xffffffffu, cmax[j], m));
    }
    if (lane < 4) {
#pragma unroll
      for (int j = 0; j < kFrag / 2; ++j) red[warp * kBN + 8 * (j >> 1) + 2 * lane + (j & 1)] = cmax[j];
    }
    named_bar_sync(1, 256);
#pragma unroll
    for (int i = 0; i < kFrag; ++i) {
      const int col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
      float amax = 0.0f;
#pragma unroll
      for (int v = 0; v < 8; ++v) amax = fmaxf(amax, red[v * kBN + col]);
      const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), kFp8E4m3Max);
      const int hrow = cwg * 64 + 16 * warp_in_wg + (lane >> 2) + 8 * ((i >> 1) & 1);
      stage[col * kHStride + hrow] = float_to_fp8_e4m3_bits(__fdiv_rn(acc[0][i], scale));
    }
    if (ct < it.num_rows) {
      float amax = 0.0f;
      for (int v = 0; v < 8; ++v) amax = fmaxf(amax, red[v * kBN + ct]);
      p.hs[static_cast<int64_t>(it.row0 + ct) * p.hs_stride + it.col0 / kBK] = __fdiv_rn(fmaxf(amax, 1e-4f), kFp8E4m3Max);
    }
    named_bar_sync(1, 256);
    for (int q = ct; q < it.num_rows * 8; q += 256) {
      const int j = q >> 3, c = q & 7;
      *reinterpret_cast<uint4*>(p.hq + static_cast<int64_t>(it.row0 + j) * p.h_stride + it.col0 + c * 16) =
          *reinterpret_cast<const uint4*>(stage + j * kHStride + c * 16);
    }
  } else {
    uint16_t* stage = reinterpret_cast<uint16_t*>(smem + L::kOutOff);  // [kBN][kOutStride] bf16
#pragma unroll
    for (int sub = 0; sub < 2; ++sub) {
      if constexpr (kSwap) {
        // (token r or r + 8, output columns 128 sub + col, col + 1): one 4-byte store per pair.
        const int r = cwg * 64 + 16 * warp_in_wg + (lane >> 2);
#pragma unroll
        for (int i = 0; i < kFrag; i += 2) {
          const int col = 128 * sub + 8 * (i >> 2) + 2 * (lane & 3), tok = r + ((i & 2) ? 8 : 0);
          *reinterpret_cast<uint32_t*>(stage + tok * kOutStride + col) =
              static_cast<uint32_t>(float_to_bf16_bits(acc[sub][i])) |
              (static_cast<uint32_t>(float_to_bf16_bits(acc[sub][i + 1])) << 16);
        }
      } else {
        const int t = sub * 2 + cwg;
#pragma unroll
        for (int i = 0; i < kFrag; ++i) {
          const int col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
          const int wrow = t * 64 + 16 * warp_in_wg + (lane >> 2) + 8 * ((i >> 1) & 1);
          stage[col * kOutStride + wrow] = float_to_bf16_bits(acc[sub][i]);
        }
      }
    }
    named_bar_sync(1, 256);
    constexpr int kChunks = kWRows / 8;  // 16-byte chunks per output row
    for (int q = ct; q < it.num_rows * kChunks; q += 256) {
      const int j = q / kChunks, c = q % kChunks;
      const int64_t n = it.col0 + c * 8;
      if (n < p.hidden)
        *reinterpret_cast<uint4*>(p.out + static_cast<int64_t>(it.row0 + j) * p.hidden + n) =
            *reinterpret_cast<const uint4*>(stage + j * kOutStride + c * 8);
    }
  }
  named_bar_sync(1, 256);  // staging (and red) are reused by the next item's epilogue
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
