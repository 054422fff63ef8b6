// experts/experts_mxfp4_decode_bulk.cuh: decode_item_bulk, the decode path with its copies made by the
// bulk-copy engine (token operand staged once, weight windows by cp.async.bulk / TMA boxes).
// Part of experts_mxfp4_kernels.cuh (include that one).
#pragma once

#include "experts/experts_mxfp4_decode.cuh"

namespace epx::experts_cuda {
namespace {

#ifdef EPX_MX_WGMMA

// ---- decode_item_bulk: the copies by the bulk-copy engine ----
// (bench/NOTES.md, 'MXFP4 decode, the copies off the lanes'.) The window body of
// decode_item_ring2; what changes is how the operands reach shared memory:
// - the token operand (x: 8 tokens x K bytes and their 1x128 scales; h: 8 x 2K bytes) is staged once per
//   item for the whole CTA, 8 (+ 8) cp.async.bulk issued by warp 0 on one mbarrier (tokens past the tile's
//   rows copy its last row: finite data in columns the epilogue never stores), instead of per warp and
//   window (8 warps x 1 / 2 KB per window from L2 before);
// - each warp streams its 32 weight rows (2 m-tiles of 16) through 2 slots of 4 windows, filled by TMA
//   (cp.async.bulk.tensor.2d on the expert's maps, mxfp4_decode_maps): per slot lane 0 issues 4 code boxes
//   (16 rows x 128 bytes = 2 windows, 128-byte swizzle) and 2 e8m0 boxes (16 rows x 16 bytes = 4 windows)
//   on the slot's mbarrier: 6 requests per warp per 4 windows (one 1-D cp.async.bulk per lane and row would be
//   64 requests per warp per slot, ~7 cycles of the SM's bulk-copy unit each: slower than decode_item_ring2);
// - the 1x128 x scale is applied once per window (d * ws summed over the window's 4 blocks, then * xs);
// (Starting the CTA's next item in the slots freed by an item's last 2 groups measured slower: not done.)
// Lane (g, t) reads word t of block b of rows g, g + 8 from the swizzled box (16-byte chunk c at c ^ g:
// conflict-free), the token rows at K + 32 / 2K + 64 bytes (LDS.64 / LDS.128 conflict-free). Needs the
// maps, K % 512 == 0 (16-byte e8m0 and x-scale pieces), K <= 8192 (gate_up) / 4096 (down) (token buffer)
// and 16-byte aligned token bases (decode_bulk_ok); other items keep decode_item_ring2. Shared memory:
// ring 144 KiB + token buffer <= 66 KiB, below kExtraOff.

/// Shared-memory plan of decode_item_bulk.
template <bool kGateUp>
struct DecodeBulk {
  static constexpr int kWin = 4;                         // 128-K windows per slot
  static constexpr int kBox = 16 * 128;                  // one code box: 16 rows x 128 bytes (2 windows), 128B-swizzled
  static constexpr int kCode = 0;                        // [mt 2][half 2][kBox]
  static constexpr int kScale = 4 * kBox;                // [mt 2][16 rows][16 B] e8m0 (4 windows x 4 blocks)
  static constexpr int kSlot = kScale + 2 * 16 * 16 + 512;  // 9216: slots 1024-byte aligned (the swizzle atom)
  static constexpr int kSlots = 2;
  static constexpr int kTok = 8 * kSlots * kSlot;        // token rows [8][tok_pitch], then x scales [8][K / 32 B]
  static constexpr int kTokPad = kGateUp ? 32 : 64;
  static constexpr int kMaxK = kGateUp ? 8192 : 4096;
  static constexpr int kTokBytesMax = 8 * ((kGateUp ? 1 : 2) * kMaxK + kTokPad) + (kGateUp ? 8 * kMaxK / 32 : 0);
  static_assert(kTok + kTokBytesMax <= kExtraOff, "decode_item_bulk's ring and token buffer below the extras");
  static_assert(kSlot % 1024 == 0, "slot alignment");
};

/// Per-warp state of decode_item_bulk across the items of a CTA: slot fills so far (fill f uses slot f & 1,
/// mbarrier parity (f >> 1) & 1) and token stagings so far (the token mbarrier's parity).
struct BulkState {
  uint32_t fills = 0;
  uint32_t toks = 0;
};

// mbarrier transaction counts, bulk copies and TMA boxes: cuda/tma.cuh (mbar_arrive_expect_tx, bulk_g2s,
// tma_load_2d).

/// True when the item can take decode_item_bulk (MixedGemmParams::decode flag 2, <= 8 rows, the shapes and
/// alignments of the bulk copies). CTA-uniform.
template <bool kGateUp>
__device__ __forceinline__ bool decode_bulk_ok(const MixedGemmParams& p, const Item& it) {
  const uintptr_t tok = kGateUp ? reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.x_scales)
                                : reinterpret_cast<uintptr_t>(p.hb);
  return (p.decode & 2) && p.mx_maps != nullptr && it.num_rows >= 1 && it.num_rows <= 8 && it.K % 512 == 0 &&
         it.K <= DecodeBulk<kGateUp>::kMaxK && (tok & 15) == 0;
}

/// Initialises decode_item_bulk's mbarriers (thread 0; the caller's __syncthreads publishes them).
__device__ __forceinline__ void decode_bulk_init(uint32_t smem_s) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < 17; ++i) mbar_init(smem_s + kBarOff + 8 * i, 1);
    fence_mbarrier_init();
  }
}

/// One mxfp4 item of <= 8 rows with bulk copies (see above; decode_bulk_ok holds). The e8m0 00 / FF case is
/// decided once per slot of 4 windows, which then form one basic block (measured level with a decision per
/// window, as decode_item_ring2 makes). kDbg as decode_item_ring.
template <bool kGateUp, int kDbg = 0>
__device__ __forceinline__ void decode_item_bulk(const MixedGemmParams& p, const Item& it, uint8_t* smem, BulkState& st,
                                                 Stamps<kDbg>& sp) {
  using R = DecodeBulk<kGateUp>;
  const DecodeSetup<kGateUp> ds(it, smem);
  const int warp = ds.warp, lane = ds.lane, g = ds.g, t = ds.t, ngrp = ds.nwin / R::kWin;
  const int64_t K = it.K;
  const uint32_t smem_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  // the maps of the item's GEMM (codes, e8m0) and the first rows of the warp's m-tiles
  const Fp8TmaMap* my_maps = p.mx_maps + 4 * it.expert + (kGateUp ? 0 : 2);
  const int32_t my_y[2] = {static_cast<int32_t>(ds.rbase + ds.roff[0]), static_cast<int32_t>(ds.rbase + ds.roff[1])};
  // token copies (warp 0): lane j < 8 token row j, lanes 8..15 (gate_up) its x-scale row
  const uint32_t tok_row = static_cast<uint32_t>(kGateUp ? K : 2 * K), tok_pitch = tok_row + R::kTokPad;
  const uint32_t xs_row = kGateUp ? static_cast<uint32_t>(K / 32) : 0u;  // bytes of one token's x scales
  const uint32_t tok_bytes = 8 * (tok_row + xs_row);
  const uint8_t* tok_src = nullptr;
  if (warp == 0 && lane < (kGateUp ? 16 : 8)) {
    const int j = lane & 7;
    const int64_t r = ds.rows[j < it.num_rows ? j : it.num_rows - 1];
    if constexpr (kGateUp) {
      tok_src = lane < 8 ? p.x + r * p.hidden : reinterpret_cast<const uint8_t*>(p.x_scales + r * (p.hidden / 128));
    } else {
      tok_src = reinterpret_cast<const uint8_t*>(p.hb + r * p.hb_stride);
    }
  }
  __syncthreads();     // rows[] read (the next item may rewrite it); every warp is past the previous item
  fence_proxy_async();  // generic-proxy writes of earlier items (run_item's staging) before the bulk writes
  const uint32_t bar_tok = smem_s + kBarOff + 16 * 8, tok_s = smem_s + R::kTok;
  if (warp == 0) {
    if (lane == 0) mbar_arrive_expect_tx(bar_tok, tok_bytes);
    __syncwarp();
    if (lane < 8) bulk_g2s(tok_s + lane * tok_pitch, tok_src, tok_row, bar_tok);
    else if (kGateUp && lane < 16) bulk_g2s(tok_s + 8 * tok_pitch + (lane - 8) * xs_row, tok_src, xs_row, bar_tok);
  }
  const uint32_t ring_s = smem_s + warp * R::kSlots * R::kSlot;
  const uint8_t* ring = smem + warp * R::kSlots * R::kSlot;
  // group k (windows 4k .. 4k + 3) into slot (fills + k) & 1 (lane 0: 4 code boxes and 2 e8m0 boxes)
  auto issue = [&](int k) {
    if (k >= ngrp) return;  // warp-uniform
    const uint32_t slot = (st.fills + k) & 1, bar = smem_s + kBarOff + 8 * (warp * 2 + slot);
    const uint32_t sl = ring_s + slot * R::kSlot;
    __syncwarp();  // every lane is done reading the slot's previous group
    if (lane == 0) {
      mbar_arrive_expect_tx(bar, 4 * R::kBox + 2 * 16 * 16);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        tma_load_2d(sl + R::kCode + (2 * mt) * R::kBox, my_maps, k * 256, my_y[mt], bar);
        tma_load_2d(sl + R::kCode + (2 * mt + 1) * R::kBox, my_maps, k * 256 + 128, my_y[mt], bar);
        tma_load_2d(sl + R::kScale + mt * 256, my_maps + 1, k * 16, my_y[mt], bar);
      }
    }
  };
  for (int k = 0; k < R::kSlots; ++k) issue(k);
  mbar_wait(bar_tok, st.toks & 1);
  sp.mark(kDbgPrologue);

  const uint8_t* tok = smem + R::kTok;
  const float* xsc = reinterpret_cast<const float*>(smem + R::kTok + 8 * tok_pitch);  // [8][K / 128]
  const int xs_n = static_cast<int>(K / 128);
  float acc[2][1][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[mt][0][i] = 0.0f;

  // window w of the slot at sl: the e8m0 words s[i] of rows (i >> 1, i & 1, g), kSp: one of them 00 / FF
  auto window = [&](const uint8_t* sl, int c, int w, const uint32_t (&s)[4], auto sp_tag) {
    constexpr bool kSp = decltype(sp_tag)::value;
    float xs[2] = {0.0f, 0.0f};  // gate_up: the window's x scales of tokens 2t, 2t + 1 (times 64: e4m3 codes of e2m1 / 64)
    (void)xs;
    if constexpr (kGateUp) {
      xs[0] = xsc[(2 * t) * xs_n + c] * 64.0f;
      xs[1] = xsc[(2 * t + 1) * xs_n + c] * 64.0f;
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      // box (mt, w / 2), rows g and g + 8; 16-byte chunk c = 4 (w & 1) + b lands at c ^ g (128B swizzle)
      const uint8_t* r0 = sl + R::kCode + (2 * mt + (w >> 1)) * R::kBox + g * 128 + 4 * t;
      const uint8_t* r8 = r0 + 8 * 128;
      const int cw = 4 * (w & 1);
      float accw[4];  // gate_up: this window's sum of d * ws, times the window's x scales below
      (void)accw;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int ch = ((cw + b) ^ g) * 16;
        const uint32_t n0 = *reinterpret_cast<const uint32_t*>(r0 + ch);  // word t of block b, row g
        const uint32_t n8 = *reinterpret_cast<const uint32_t*>(r8 + ch);  // row g + 8
        const float ws0 = e8m0_of(s[2 * mt], b, kSp), ws8 = e8m0_of(s[2 * mt + 1], b, kSp);
        if constexpr (kGateUp) {
          const uint2 x = *reinterpret_cast<const uint2*>(tok + g * tok_pitch + c * 128 + 32 * b + 8 * t);
          float d[4];
          mma_e4m3(d, e2m1_even_e4m3(n0), e2m1_even_e4m3(n8), e2m1_odd_e4m3(n0), e2m1_odd_e4m3(n8), prmt(x.x, x.y, 0x6420u),
                   prmt(x.x, x.y, 0x7531u));
          if (b == 0) {
            accw[0] = d[0] * ws0, accw[1] = d[1] * ws0, accw[2] = d[2] * ws8, accw[3] = d[3] * ws8;
          } else {
            accw[0] = fmaf(d[0], ws0, accw[0]);
            accw[1] = fmaf(d[1], ws0, accw[1]);
            accw[2] = fmaf(d[2], ws8, accw[2]);
            accw[3] = fmaf(d[3], ws8, accw[3]);
          }
        } else {
          const uint4 A0 = e2m1x8_to_bf16(n0, 0x3F3F3F00u, 0x40404040u, 0xC0800000u, 0xC0804000u);
          const uint4 A8 = e2m1x8_to_bf16(n8, 0x3F3F3F00u, 0x40404040u, 0xC0800000u, 0xC0804000u);
          const uint4 h = *reinterpret_cast<const uint4*>(tok + g * tok_pitch + c * 256 + 64 * b + 16 * t);
          down_mma_promote(A0, A8, h, ws0, ws8, acc[mt][0]);
        }
      }
      if constexpr (kGateUp) {
        acc[mt][0][0] = fmaf(accw[0], xs[0], acc[mt][0][0]);
        acc[mt][0][1] = fmaf(accw[1], xs[1], acc[mt][0][1]);
        acc[mt][0][2] = fmaf(accw[2], xs[0], acc[mt][0][2]);
        acc[mt][0][3] = fmaf(accw[3], xs[1], acc[mt][0][3]);
      }
    }
  };

  for (int q = 0; q < ngrp; ++q) {
    const uint32_t f = st.fills + q;
    mbar_wait(smem_s + kBarOff + 8 * (warp * 2 + (f & 1)), (f >> 1) & 1);
    sp.mark(kDbgLoadWait);
    const uint8_t* sl = ring + (f & 1) * R::kSlot;
    // e8m0 words of window w, rows (i >> 1, i & 1, g) (4 bytes: its 4 blocks); true when one is 00 / FF
    auto scales = [&](int w, uint32_t (&s)[4]) {
      bool sp_lane = false;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[i] = *reinterpret_cast<const uint32_t*>(sl + R::kScale + (i * 8 + g) * 16 + 4 * w);
        sp_lane |= e8m0_special(s[i]);
      }
      return sp_lane;
    };
    if constexpr (kDbg == 2) {  // ablation: the load path alone
      uint32_t s[4];
      scales(0, s);
      if (s[0] == 0x9abcdef0u && *reinterpret_cast<const uint32_t*>(sl + 4 * lane) == 0x12345678u) acc[0][0][0] += 1.0f;
    } else {  // one decision per slot: its 4 windows unrolled in one basic block
      uint32_t s[R::kWin][4];
      bool sp_lane = false;
#pragma unroll
      for (int w = 0; w < R::kWin; ++w) sp_lane |= scales(w, s[w]);
      if (__any_sync(0xffffffffu, sp_lane)) {
#pragma unroll
        for (int w = 0; w < R::kWin; ++w) window(sl, q * R::kWin + w, w, s[w], std::true_type{});
      } else {
#pragma unroll
        for (int w = 0; w < R::kWin; ++w) window(sl, q * R::kWin + w, w, s[w], std::false_type{});
      }
    }
    sp.mark(kDbgConvert);
    issue(q + R::kSlots);
    sp.mark(kDbgLoadIssue);
  }
  st.fills += ngrp;
  st.toks += 1;
  decode_epilogue<kGateUp, 1>(p, it, acc, warp, g, t);
  sp.count(kDbgStages, ds.nwin);
  sp.count(kDbgMxItems, 1);
  sp.mark(kDbgEpilogue);
}

#endif  // EPX_MX_WGMMA

}  // namespace
}  // namespace epx::experts_cuda
