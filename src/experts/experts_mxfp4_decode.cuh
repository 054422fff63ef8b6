// experts/experts_mxfp4_decode.cuh: the decode path of the MXFP4 GEMMs: items of <= 16 rows with the
// weights streamed from HBM into registers and mma.sync (the register and shared-memory rings).
// Part of experts_mxfp4_kernels.cuh (include that one).
#pragma once

#include "experts/experts_mxfp4_wgmma_item.cuh"

namespace epx::experts_cuda {
namespace {

#ifdef EPX_MX_WGMMA

// ---- decode path: mxfp4 items of <= 16 rows, weights streamed from HBM into registers, mma.sync ----
//
// (bench/NOTES.md, 'MXFP4 decode on mma.sync'.) A (row tile, weight tile) item of the
// same shape as run_item's (gate_up: the 128 gate and 128 up weight rows of h columns col0..col0+127;
// down: output rows col0..col0+255) on the same 256 threads, but with no shared memory for the
// weights and no wgmma: weights are the A operand of mma.sync (16 weight rows per mma), the <= 16
// tokens the B operand (kNt n-tiles of 8). Canonical layout only ([rows, K/2] e2m1 pairs, low nibble = even K;
// [rows, K/32] e8m0); no second weight copy.
// - Warp w: 32 weight rows (2 m-tiles: gate_up the gate rows of h columns col0 + 16 w .. + 15 and the
//   same up rows, so SiLU(gate) * up needs no exchange; down output rows col0 + 32 w .. + 31), all of K,
//   in windows of 128 K (64 bytes per row).
// - Loads: per window each lane (g = lane / 4, t = lane % 4) copies the 16 bytes of scale block t of rows
//   g and g + 8 of both m-tiles (one warp instruction reads 8 rows x 64 contiguous bytes, L2::256B), those
//   rows' e8m0 words and its token operand (x: 8 bytes per block and the 1x128 scales, h: 16 bytes) into
//   a per-warp cp.async ring in shared memory (decode_item_ring, DecodeRing: kRing - 1 windows in flight
//   per warp without holding registers); 9..16 rows (2 n-tiles). For <= 8 rows the per-lane cp.async issue and
//   the window body add up, so two faster forms take them:
//   decode_item_ring2 (<= 8 rows where decode_item_bulk cannot run) shares the slot among the warp's lanes
//   (fewer, wider copies; the fragment words read directly, no quad transpose);
//   decode_item_bulk (MixedGemmParams::decode flag 2, the default for <= 8 rows where its shapes allow; below)
//   moves the copies to TMA, the fastest (bench/NOTES.md, 'MXFP4 decode, the copies off the lanes').
// - One mma per 32-K scale block: a quad transpose (3 shfl.xor + selects) gives lane t word t of every
//   block b of its rows (8 codes, K = 32 b + 8 t + nibble); the B fragment takes the same K.
//   gate_up: e4m3 bits of code c = ((c & 7) << 2) | ((c & 8) << 4) = e2m1(c) * 2^-6 exactly (the even
//   nibbles of a word give A registers 0/1, the odd ones 2/3; x's bytes permuted alike), m16n8k32 e4m3,
//   then acc += d * (2^(e - 127) * 64 * x_scale): every block's scale exact in fp32.
//   down: bf16 of the codes through the constant e2m1 -> bf16 byte tables (e2m1x8_to_bf16 at scale 1),
//   2 x m16n8k16 bf16 per block, acc += d * 2^(e - 127).
//   e8m0 0 (2^-127) and 255 (NaN) take an exact per-scale conversion (the window's words are checked).
// Registers (ptxas -v): <= 240 with both ring variants and kNt = 1 and 2, no spills (windows buffered in
// registers instead of the ring spill at kNt = 2).

/// mma.sync m16n8k32 e4m3 x e4m3 -> f32, C = 0.
__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}
/// mma.sync m16n8k16 bf16 x bf16 -> f32, d = A B + c.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1, const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
/// The down GEMM's step on the decode path for one 32-K block of 16 weight rows (every decode variant): the rows'
/// codes as exact bf16 (A0: row g, A8: row g + 8, e2m1x8_to_bf16 at scale 1), 2 x m16n8k16 against the token
/// operand q (bf16 h, 32 K: q.x, q.y the first k16, q.z, q.w the second), promoted by the rows' block scales
/// ws0 / ws8 (2^(e - 127)) into acc (rows g, g + 8 x this lane's two tokens, mma.sync's C layout).
__device__ __forceinline__ void down_mma_promote(const uint4& A0, const uint4& A8, const uint4& q, float ws0, float ws8,
                                                 float (&acc)[4]) {
  const float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float d0[4], d[4];
  mma_bf16(d0, A0.x, A8.x, A0.y, A8.y, q.x, q.y, z);
  mma_bf16(d, A0.z, A8.z, A0.w, A8.w, q.z, q.w, d0);
  acc[0] = fmaf(d[0], ws0, acc[0]);
  acc[1] = fmaf(d[1], ws0, acc[1]);
  acc[2] = fmaf(d[2], ws8, acc[2]);
  acc[3] = fmaf(d[3], ws8, acc[3]);
}

/// Within each quad of lanes (t = lane & 3), lane t holds the 4 words of scale block t; returns in
/// n[b] word t of block b (held by lane b): n[b] = m_b[t].
__device__ __forceinline__ void quad_transpose(const uint4& m, int t, uint32_t (&n)[4]) {
  uint32_t p0 = m.x, p1 = m.y, p2 = m.z, p3 = m.w;
  // p[i] = m[i ^ t]
  if (t & 1) { const uint32_t a = p0; p0 = p1; p1 = a; const uint32_t b = p2; p2 = p3; p3 = b; }
  if (t & 2) { const uint32_t a = p0; p0 = p2; p2 = a; const uint32_t b = p1; p1 = p3; p3 = b; }
  // r[i] = word t of block t ^ i (lane t ^ i sent its p[i] = its word (t ^ i) ^ i = t)
  uint32_t r0 = p0, r1 = __shfl_xor_sync(0xffffffffu, p1, 1), r2 = __shfl_xor_sync(0xffffffffu, p2, 2),
           r3 = __shfl_xor_sync(0xffffffffu, p3, 3);
  // n[b] = r[b ^ t]
  if (t & 1) { const uint32_t a = r0; r0 = r1; r1 = a; const uint32_t b = r2; r2 = r3; r3 = b; }
  if (t & 2) { const uint32_t a = r0; r0 = r2; r2 = a; const uint32_t b = r1; r1 = r3; r3 = b; }
  n[0] = r0, n[1] = r1, n[2] = r2, n[3] = r3;
}
// e2m1_even_e4m3, e2m1_odd_e4m3, e8m0_special, e8m0_of: experts/mxfp4_bits.h (checked by the CPU tests).

/// The decode path's stores: gate_up h = bf16(silu(gate) * up) (the CPU's expression, fp32), down
/// out = bf16(acc); acc[mt][nt][i]: rows g + 8 (i >> 1) of m-tile mt, token 8 nt + 2 t + (i & 1).
template <bool kGateUp, int kNt>
__device__ __forceinline__ void decode_epilogue(const MixedGemmParams& p, const Item& it, const float (&acc)[2][kNt][4], int warp,
                                                int g, int t) {
  if constexpr (kGateUp) {
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = 8 * nt + 2 * t + (i & 1);
        if (j < it.num_rows) {
          const float gv = acc[0][nt][i], uv = acc[1][nt][i];
          const float hv = gv / (1.0f + expf(-gv)) * uv;  // silu(g) * u in fp32, the CPU's expression
          const int64_t col = it.col0 + 16 * warp + g + 8 * (i >> 1);
          p.hb[static_cast<int64_t>(it.row0 + j) * p.hb_stride + col] = float_to_bf16_bits(hv);
        }
      }
  } else {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int j = 8 * nt + 2 * t + (i & 1);
          const int64_t col = it.col0 + 32 * warp + 16 * mt + g + 8 * (i >> 1);
          if (j < it.num_rows && col < it.hidden)
            p.out[static_cast<int64_t>(it.row0 + j) * it.hidden + col] = float_to_bf16_bits(acc[mt][nt][i]);
        }
  }
}

/// What every decode-path variant resolves first: the lane's coordinates (g = lane / 4, t = lane % 4),
/// the item's 128-K windows, and the warp's weight rows: m-tile mt (16 rows) starts at rbase + roff[mt];
/// gate_up the gate rows of h columns col0 + 16 warp .. + 15 and the same up rows (rbase + inter), down
/// the output rows col0 + 32 warp .. + 31, clamped into the tensor past H (those results are never stored).
template <bool kGateUp>
struct DecodeSetup {
  int warp, lane, g, t, nwin;
  const int32_t* rows;  // rows[j]: x row (gate_up) / h row (down) of token j of the tile (kRowsOff)
  int64_t row_bytes, srow_bytes, rbase, roff[2];
  __device__ __forceinline__ DecodeSetup(const Item& it, const uint8_t* smem) {
    warp = static_cast<int>(threadIdx.x >> 5);
    lane = static_cast<int>(threadIdx.x & 31);
    g = lane >> 2;
    t = lane & 3;
    nwin = static_cast<int>(it.K / 128);
    rows = reinterpret_cast<const int32_t*>(smem + kRowsOff);
    row_bytes = it.K / 2;
    srow_bytes = it.K / 32;
    roff[0] = 0;
    if constexpr (kGateUp) {
      rbase = it.col0 + 16 * warp;
      roff[1] = it.inter;
    } else {
      const int64_t r_first = it.col0 + 32 * warp;
      rbase = r_first < it.hidden ? r_first : 0;
      roff[1] = r_first + 16 < it.hidden ? 16 : 0;
    }
  }
};

/// Shared-memory plan of decode_item_ring: per warp kRing slots of one 128-K window each, every array
/// lane-major (lane i's 16 / 8 / 4 bytes at i * size: conflict-free, and every lane reads back only
/// what it copied itself, so cp.async.wait_group alone orders them).
template <bool kGateUp, int kNt>
struct DecodeRing {
  static constexpr int kCode = 0;                    // [4: mt, row g / g + 8][32][16 B] e2m1 codes
  static constexpr int kScale = kCode + 4 * 32 * 16;  // [4][32][4 B] e8m0 words
  static constexpr int kBBytes = kGateUp ? 8 : 16;    // x bytes / h values of one block per lane
  static constexpr int kB = kScale + 4 * 32 * 4;      // [kNt][4 blocks][32][kBBytes]
  static constexpr int kXs = kB + kNt * 4 * 32 * kBBytes;  // gate_up: [kNt][2][32][4 B] token scales
  static constexpr int kSlot = kXs + (kGateUp ? kNt * 2 * 32 * 4 : 0);
  static constexpr int kRing = (kExtraOff / (8 * kSlot)) < 6 ? (kExtraOff / (8 * kSlot)) : 6;
  static_assert(kRing >= 3, "decode ring depth");
};

/// One mxfp4 item of <= 8 kNt rows on the decode path (see above; the kernels use kNt = 2: 9..16 rows), the windows staged through a per-warp
/// cp.async ring in shared memory (DecodeRing: kRing - 1 windows in flight per warp, ~5 x 2 KB of codes,
/// without holding registers). smem: the CTA's shared memory (rows[] at kRowsOff, the ring below kExtraOff).
/// kDbg (set_mixed_debug): 1 stamps the phases (prologue, load_wait = the ring wait, load_issue = the next
/// window's copies, convert = the window body: conversions + mma + promotion, epilogue); 2 also skips the
/// window body (the load path alone; wrong results, timing only).
template <bool kGateUp, int kNt, int kDbg = 0>
__device__ __forceinline__ void decode_item_ring(const MixedGemmParams& p, const Item& it, uint8_t* smem, Stamps<kDbg>& sp) {
  using R = DecodeRing<kGateUp, kNt>;
  const DecodeSetup<kGateUp> ds(it, smem);
  const int warp = ds.warp, lane = ds.lane, g = ds.g, t = ds.t, nwin = ds.nwin;
  const int32_t* rows = ds.rows;
  const int64_t row_bytes = ds.row_bytes, srow_bytes = ds.srow_bytes, rbase = ds.rbase, roff[2] = {ds.roff[0], ds.roff[1]};
  const uint8_t* codes = it.w;
  const uint8_t* wscale = static_cast<const uint8_t*>(it.w_scale);
  const uint8_t* cb[2];
  const uint8_t* sb[2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    cb[mt] = codes + (rbase + roff[mt] + g) * row_bytes + 16 * t;
    sb[mt] = wscale + (rbase + roff[mt] + g) * srow_bytes;
  }
  const int64_t c8 = 8 * row_bytes, s8 = 8 * srow_bytes;
  const uint8_t* bptr[kNt];
  bool bval[kNt];
  int32_t xsr[kNt][2];
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
    const int j = 8 * nt + g;
    bval[nt] = j < it.num_rows;
    const int32_t r = bval[nt] ? rows[j] : 0;
    if constexpr (kGateUp) bptr[nt] = p.x + static_cast<int64_t>(r) * p.hidden + 8 * t;
    else bptr[nt] = reinterpret_cast<const uint8_t*>(p.hb) + (static_cast<int64_t>(r) * p.hb_stride + 8 * t) * 2;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int jj = 8 * nt + 2 * t + q;
      xsr[nt][q] = kGateUp && jj < it.num_rows ? rows[jj] * static_cast<int32_t>(p.hidden / 128) : -1;
    }
  }
  __syncthreads();  // rows[] read: the next item may rewrite it

  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + warp * R::kRing * R::kSlot;
  const uint8_t* ring = smem + warp * R::kRing * R::kSlot;
  auto issue = [&](int c) {  // window c into slot c % kRing; always one commit group
    if (c < nwin) {
      const uint32_t sl = ring_s + (c % R::kRing) * R::kSlot;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = 2 * mt + h;
          asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(sl + R::kCode + (i * 32 + lane) * 16),
                       "l"(cb[mt] + (h ? c8 : 0) + c * 64) : "memory");
          asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(sl + R::kScale + (i * 32 + lane) * 4),
                       "l"(sb[mt] + (h ? s8 : 0) + c * 4) : "memory");
        }
      }
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const uint32_t dst = sl + R::kB + ((nt * 4 + b) * 32 + lane) * R::kBBytes;
          const uint8_t* src = kGateUp ? bptr[nt] + c * 128 + 32 * b : bptr[nt] + (c * 128 + 32 * b) * 2;
          asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(R::kBBytes),
                       "r"(bval[nt] ? R::kBBytes : 0) : "memory");
        }
        if constexpr (kGateUp) {
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            const bool v = xsr[nt][q] >= 0;
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(sl + R::kXs + ((nt * 2 + q) * 32 + lane) * 4),
                         "l"(p.x_scales + (v ? xsr[nt][q] + c : 0)), "r"(v ? 4 : 0) : "memory");
          }
        }
      }
    }
    cp_async_commit();
  };

  float acc[2][kNt][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

#pragma unroll
  for (int s = 0; s < R::kRing - 1; ++s) issue(s);
  sp.mark(kDbgPrologue);
  for (int c = 0; c < nwin; ++c) {
    cp_async_wait<R::kRing - 2>();  // window c (this lane's own copies)
    sp.mark(kDbgLoadWait);
    issue(c + R::kRing - 1);  // into the slot window c - 1 used (read into registers last iteration)
    sp.mark(kDbgLoadIssue);
    const uint8_t* sl = ring + (c % R::kRing) * R::kSlot;
    uint4 a[4];
    uint32_t s[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[i] = *reinterpret_cast<const uint4*>(sl + R::kCode + (i * 32 + lane) * 16);
      s[i] = *reinterpret_cast<const uint32_t*>(sl + R::kScale + (i * 32 + lane) * 4);
    }
    // e8m0 00 / FF anywhere in the warp's window: the exact scale conversion, decided once per window
    // and warp (a branch per block would cut the window into small basic blocks: no ILP across mmas)
    bool sp_lane = false;
#pragma unroll
    for (int i = 0; i < 4; ++i) sp_lane |= e8m0_special(s[i]);
    float xs[kNt][2];
    if constexpr (kGateUp) {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int q = 0; q < 2; ++q) xs[nt][q] = *reinterpret_cast<const float*>(sl + R::kXs + ((nt * 2 + q) * 32 + lane) * 4) * 64.0f;
    }
    auto window = [&](auto sp_tag) {
      constexpr bool kSp = decltype(sp_tag)::value;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        uint32_t n0[4], n8[4];
        quad_transpose(a[2 * mt], t, n0);
        quad_transpose(a[2 * mt + 1], t, n8);
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const float ws0 = e8m0_of(s[2 * mt], b, kSp), ws8 = e8m0_of(s[2 * mt + 1], b, kSp);
          if constexpr (kGateUp) {
            const uint32_t a0 = e2m1_even_e4m3(n0[b]), a1 = e2m1_even_e4m3(n8[b]);
            const uint32_t a2 = e2m1_odd_e4m3(n0[b]), a3 = e2m1_odd_e4m3(n8[b]);
#pragma unroll
            for (int nt = 0; nt < kNt; ++nt) {
              const uint2 q = *reinterpret_cast<const uint2*>(sl + R::kB + ((nt * 4 + b) * 32 + lane) * 8);
              float d[4];
              mma_e4m3(d, a0, a1, a2, a3, prmt(q.x, q.y, 0x6420u), prmt(q.x, q.y, 0x7531u));
              acc[mt][nt][0] = fmaf(d[0], ws0 * xs[nt][0], acc[mt][nt][0]);
              acc[mt][nt][1] = fmaf(d[1], ws0 * xs[nt][1], acc[mt][nt][1]);
              acc[mt][nt][2] = fmaf(d[2], ws8 * xs[nt][0], acc[mt][nt][2]);
              acc[mt][nt][3] = fmaf(d[3], ws8 * xs[nt][1], acc[mt][nt][3]);
            }
          } else {
            const uint4 A0 = e2m1x8_to_bf16(n0[b], 0x3F3F3F00u, 0x40404040u, 0xC0800000u, 0xC0804000u);
            const uint4 A8 = e2m1x8_to_bf16(n8[b], 0x3F3F3F00u, 0x40404040u, 0xC0800000u, 0xC0804000u);
#pragma unroll
            for (int nt = 0; nt < kNt; ++nt) {
              const uint4 q = *reinterpret_cast<const uint4*>(sl + R::kB + ((nt * 4 + b) * 32 + lane) * 16);
              down_mma_promote(A0, A8, q, ws0, ws8, acc[mt][nt]);
            }
          }
        }
      }
    };
    if constexpr (kDbg == 2) {  // ablation: the load path alone
      if (a[0].x == 0x12345678u && s[0] == 0x9abcdef0u) acc[0][0][0] += 1.0f;  // keeps the shared-memory reads
    } else {
      if (__any_sync(0xffffffffu, sp_lane)) window(std::true_type{});
      else window(std::false_type{});
    }
    sp.mark(kDbgConvert);
  }
  cp_async_wait<0>();  // nothing of this item lands in shared memory after it (the next item's kind may differ)
  decode_epilogue<kGateUp, kNt>(p, it, acc, warp, g, t);
  sp.count(kDbgStages, nwin);
  sp.count(kDbgMxItems, 1);
  sp.mark(kDbgEpilogue);
}

/// Shared-memory plan of decode_item_ring2 (<= 8 rows): per warp kRing slots of one 128-K window;
/// row-major pieces shared by the warp's lanes (cp.async.wait_group + __syncwarp), so each lane copies
/// fewer, wider pieces and reads back the words the mma fragments want (no quad transpose).
template <bool kGateUp>
struct DecodeRing2 {
  static constexpr int kRowPitch = 80;                   // 64 code bytes + 16: LDS.32 of word t of block b conflict-free
  static constexpr int kCode = 0;                        // [32 rows: (mt, h, g)][kRowPitch]
  static constexpr int kScale = kCode + 32 * kRowPitch;  // [32 rows][4 B] e8m0 words
  static constexpr int kTokPitch = kGateUp ? 160 : 320;  // x: 128 bytes + 32; h: 256 bytes + 64 (conflict-free reads)
  static constexpr int kB = kScale + 32 * 4;             // [8 tokens][kTokPitch]
  static constexpr int kXs = kB + 8 * kTokPitch;         // gate_up: [8 tokens][4 B]
  static constexpr int kSlot = (kXs + (kGateUp ? 32 : 0) + 127) / 128 * 128;
  static constexpr int kRing = (kExtraOff / (8 * kSlot)) < 6 ? (kExtraOff / (8 * kSlot)) : 6;
  static_assert(kRing >= 3, "decode ring depth");
};

/// decode_item_ring for <= 8 rows with the warp-shared slot layout of DecodeRing2: per window and lane
/// 4 cp.async of codes, 1 of e8m0 words, 2 (x) / 4 (h) of the token operand and 1 of x scales (lanes
/// < 8), against 4 + 4 + 4 + 2; the A fragments read as 16 LDS.32 instead of 4 LDS.128 + 4 quad
/// transposes. The <= 8-row items decode_item_bulk cannot take (Config::experts_mxfp4_tc = 7: all of them).
template <bool kGateUp, int kDbg = 0>
__device__ __forceinline__ void decode_item_ring2(const MixedGemmParams& p, const Item& it, uint8_t* smem, Stamps<kDbg>& sp) {
  using R = DecodeRing2<kGateUp>;
  const DecodeSetup<kGateUp> ds(it, smem);
  const int warp = ds.warp, lane = ds.lane, g = ds.g, t = ds.t, nwin = ds.nwin;
  const int32_t* rows = ds.rows;
  const int64_t row_bytes = ds.row_bytes, srow_bytes = ds.srow_bytes, rbase = ds.rbase, roff[2] = {ds.roff[0], ds.roff[1]};
  const uint8_t* codes = it.w;
  const uint8_t* wscale = static_cast<const uint8_t*>(it.w_scale);
  // code copies: lane (g, t) copies block t of rows (mt, h, g); slot row (mt * 2 + h) * 8 + g
  const uint8_t* cb[2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) cb[mt] = codes + (rbase + roff[mt] + g) * row_bytes + 16 * t;
  const int64_t c8 = 8 * row_bytes;
  // e8m0 copies: lane l copies the word of slot row l = (mt, h, g) = (l >> 4, (l >> 3) & 1, l & 7)
  const uint8_t* sbl = wscale + (rbase + roff[lane >> 4] + 8 * ((lane >> 3) & 1) + (lane & 7)) * srow_bytes;
  // token copies: 16-byte piece q = i * 32 + lane: token q >> 3 (x) / q >> 4 (h), piece q & 7 / q & 15
  constexpr int kBPieces = kGateUp ? 2 : 4;
  const uint8_t* bsrc[kBPieces];
  bool bval[kBPieces];
  uint32_t bdst[kBPieces];
#pragma unroll
  for (int i = 0; i < kBPieces; ++i) {
    const int q = i * 32 + lane;
    const int j = kGateUp ? q >> 3 : q >> 4, k = kGateUp ? q & 7 : q & 15;
    bval[i] = j < it.num_rows;
    const int32_t r = bval[i] ? rows[j] : 0;
    if constexpr (kGateUp) bsrc[i] = p.x + static_cast<int64_t>(r) * p.hidden + 16 * k;
    else bsrc[i] = reinterpret_cast<const uint8_t*>(p.hb) + static_cast<int64_t>(r) * p.hb_stride * 2 + 16 * k;
    bdst[i] = R::kB + j * R::kTokPitch + 16 * k;
  }
  const bool xs_val = kGateUp && lane < it.num_rows;
  const int32_t xs_row = xs_val ? rows[lane] * static_cast<int32_t>(p.hidden / 128) : 0;
  __syncthreads();  // rows[] read: the next item may rewrite it

  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + warp * R::kRing * R::kSlot;
  const uint8_t* ring = smem + warp * R::kRing * R::kSlot;
  auto issue = [&](int c) {  // window c into slot c % kRing; always one commit group
    if (c < nwin) {
      const uint32_t sl = ring_s + (c % R::kRing) * R::kSlot;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(sl + R::kCode + ((mt * 2 + h) * 8 + g) * R::kRowPitch + 16 * t),
                       "l"(cb[mt] + (h ? c8 : 0) + c * 64) : "memory");
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(sl + R::kScale + lane * 4), "l"(sbl + c * 4) : "memory");
#pragma unroll
      for (int i = 0; i < kBPieces; ++i)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(sl + bdst[i]),
                     "l"(bsrc[i] + (kGateUp ? c * 128 : c * 256)), "r"(bval[i] ? 16 : 0) : "memory");
      if (kGateUp && lane < 8)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(sl + R::kXs + lane * 4), "l"(p.x_scales + xs_row + c),
                     "r"(xs_val ? 4 : 0) : "memory");
    }
    cp_async_commit();
  };

  float acc[2][1][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[mt][0][i] = 0.0f;

#pragma unroll
  for (int s = 0; s < R::kRing - 1; ++s) issue(s);
  sp.mark(kDbgPrologue);
  for (int c = 0; c < nwin; ++c) {
    cp_async_wait<R::kRing - 2>();  // window c: this lane's copies
    __syncwarp();                   // ... and the other lanes' (and every lane is done reading window c - 1)
    sp.mark(kDbgLoadWait);
    issue(c + R::kRing - 1);        // into the slot window c - 1 used
    sp.mark(kDbgLoadIssue);
    const uint8_t* sl = ring + (c % R::kRing) * R::kSlot;
    uint32_t s[4];  // e8m0 words of rows (mt, h, g)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = *reinterpret_cast<const uint32_t*>(sl + R::kScale + (i * 8 + g) * 4);
    bool sp_lane = false;
#pragma unroll
    for (int i = 0; i < 4; ++i) sp_lane |= e8m0_special(s[i]);
    float xs[2] = {0.0f, 0.0f};
    if constexpr (kGateUp) {
      const float2 v = *reinterpret_cast<const float2*>(sl + R::kXs + 8 * t);
      xs[0] = v.x * 64.0f;
      xs[1] = v.y * 64.0f;
    }
    auto window = [&](auto sp_tag) {
      constexpr bool kSp = decltype(sp_tag)::value;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const uint8_t* r0 = sl + R::kCode + ((mt * 2) * 8 + g) * R::kRowPitch + 4 * t;
        const uint8_t* r8 = r0 + 8 * R::kRowPitch;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const uint32_t n0 = *reinterpret_cast<const uint32_t*>(r0 + 16 * b);  // word t of block b, row g
          const uint32_t n8 = *reinterpret_cast<const uint32_t*>(r8 + 16 * b);  // row g + 8
          const float ws0 = e8m0_of(s[2 * mt], b, kSp), ws8 = e8m0_of(s[2 * mt + 1], b, kSp);
          if constexpr (kGateUp) {
            const uint2 q = *reinterpret_cast<const uint2*>(sl + R::kB + g * R::kTokPitch + 32 * b + 8 * t);
            float d[4];
            mma_e4m3(d, e2m1_even_e4m3(n0), e2m1_even_e4m3(n8), e2m1_odd_e4m3(n0), e2m1_odd_e4m3(n8), prmt(q.x, q.y, 0x6420u),
                     prmt(q.x, q.y, 0x7531u));
            acc[mt][0][0] = fmaf(d[0], ws0 * xs[0], acc[mt][0][0]);
            acc[mt][0][1] = fmaf(d[1], ws0 * xs[1], acc[mt][0][1]);
            acc[mt][0][2] = fmaf(d[2], ws8 * xs[0], acc[mt][0][2]);
            acc[mt][0][3] = fmaf(d[3], ws8 * xs[1], acc[mt][0][3]);
          } else {
            const uint4 A0 = e2m1x8_to_bf16(n0, 0x3F3F3F00u, 0x40404040u, 0xC0800000u, 0xC0804000u);
            const uint4 A8 = e2m1x8_to_bf16(n8, 0x3F3F3F00u, 0x40404040u, 0xC0800000u, 0xC0804000u);
            const uint4 q = *reinterpret_cast<const uint4*>(sl + R::kB + g * R::kTokPitch + 64 * b + 16 * t);
            down_mma_promote(A0, A8, q, ws0, ws8, acc[mt][0]);
          }
        }
      }
    };
    if constexpr (kDbg == 2) {  // ablation: the load path alone
      if (s[0] == 0x9abcdef0u && *reinterpret_cast<const uint32_t*>(sl) == 0x12345678u) acc[0][0][0] += 1.0f;
    } else {
      if (__any_sync(0xffffffffu, sp_lane)) window(std::true_type{});
      else window(std::false_type{});
    }
    sp.mark(kDbgConvert);
  }
  cp_async_wait<0>();  // nothing of this item lands in shared memory after it
  decode_epilogue<kGateUp, 1>(p, it, acc, warp, g, t);
  sp.count(kDbgStages, nwin);
  sp.count(kDbgMxItems, 1);
  sp.mark(kDbgEpilogue);
}

/// Item `walk` of the persistent grid's walk (items from the end of the tile list: the last local expert, the
/// FHMoE shared expert, first). False when it computes nothing here (a weight tile past its expert's I (gate_up)
/// or H (down), or a format other than fp8_block / mxfp4); else `it`, `tile` and whether it is mxfp4. CTA-uniform.
template <bool kGateUp>
__device__ __forceinline__ bool resolve_item(const MixedGemmParams& p, int64_t num_items, int64_t walk, Item& it, Tile& tile, bool& mx) {
  const int64_t item = num_items - 1 - walk;
  tile = p.tiles[item / p.max_weight_tiles];
  const int wt = static_cast<int>(item % p.max_weight_tiles);
  const ExpertDesc e = p.experts[tile.expert];
  mx = e.format == static_cast<int32_t>(WeightFormat::mxfp4);
  if (!mx && e.format != static_cast<int32_t>(WeightFormat::fp8_block)) return false;
  const int64_t inter = e.intermediate;
  it.expert = tile.expert;
  it.row0 = tile.row0;
  it.num_rows = tile.num_rows;
  it.inter = inter;
  it.hidden = p.hidden;
  if constexpr (kGateUp) {
    if (static_cast<int64_t>(wt) * 128 >= inter) return false;
    it.w = static_cast<const uint8_t*>(e.w13);
    it.w_scale = e.w13_scale;
    it.K = p.hidden;
    it.col0 = static_cast<int64_t>(wt) * 128;
  } else {
    it.col0 = static_cast<int64_t>(wt) * kRows;
    if (it.col0 >= p.hidden) return false;
    it.w = static_cast<const uint8_t*>(e.w2);
    it.w_scale = e.w2_scale;
    it.K = inter;
  }
  return true;
}

#endif  // EPX_MX_WGMMA

}  // namespace
}  // namespace epx::experts_cuda
