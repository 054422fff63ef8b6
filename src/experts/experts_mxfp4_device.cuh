// experts/experts_mxfp4_device.cuh: what the MXFP4 / mixed-format grouped GEMM paths share (design and
// precision: experts_mxfp4_cuda.cu): the shared-memory plan, the per-kind tile geometry (KT), the wgmma of
// one K step, the work item, the debug stamps, and the e2m1 / e8m0 conversions of the operand tiles.
// Part of experts_mxfp4_kernels.cuh (include that one).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/check.h"
#include "epx/dtype.h"
#include "epx/experts.h"
#include "experts/experts_fp8_cuda.h"
#include "experts/experts_fp8_wgmma.cuh"
#include "experts/experts_mxfp4_cuda.h"
#include "experts/mxfp4_bits.h"

namespace epx::experts_cuda {

// Launchers of the kernels instantiated in the other translation units (dbg: the set_mixed_debug
// buffer, or null), and their shared-memory opt-in (cudaFuncSetAttribute, once per device).
/// experts_mxfp4_debug_cuda.cu: the 256-thread debug kernels of set_mixed_debug mode 1..3.
void mx_debug_launch(bool gate_up, int mode, const MixedGemmParams& p, int grid, cudaStream_t stream, unsigned long long* dbg);
void mx_debug_allow_smem();

namespace {


constexpr int kThreads = 256;
constexpr int kRows = kFp8TileWeightRows;  // 256 weight rows per item
constexpr int kMaxBN = 64;
constexpr int kSubBytes = 64 * 128;        // one m64 sub-tile of the operand (8 KiB)
constexpr int kConvBytes = kRows * 128;    // one expanded operand tile (32 KiB)
constexpr int kScaleFloats = 4 + kMaxBN;   // per stage: 4 fp8 sub-tile scales + BN token scales
constexpr int kMaxStages = 8;
constexpr int kExtraOff = 212 * 1024;      // above every kind's ring (+ conversion tiles)
constexpr int kScaleOff = kExtraOff;
constexpr int kRowScaleOff = kScaleOff + kMaxStages * kScaleFloats * 4;
constexpr int kRowsOff = kRowScaleOff + 2 * kRows * 4;
constexpr int kRedOff = kRowsOff + kMaxBN * 4;
constexpr int kBarOff = kRedOff + 8 * kMaxBN * 4;  // decode_item_bulk's mbarriers: [8 warps][2 slots] + the token one
constexpr int kSmemUsed = kBarOff + 32 * 8;
constexpr int kSmemBytes = kSmemUsed + 1024;  // + alignment of the base to 1024 (swizzle atom)
constexpr int kHStageStride = 128 + 16;       // fp8 gate_up epilogue: FP8 h rows (bytes), padded
constexpr int kHbStageStride = 128 + 8;       // mxfp4 gate_up epilogue: bf16 h rows (elements), padded
constexpr int kOutStageStride = kRows + 8;    // down epilogue: bf16 out rows (elements), padded

/// The four item kinds: (format, GEMM).
enum Kind : int { kFp8GateUp = 0, kFp8Down = 1, kMxGateUp = 2, kMxDown = 3 };

/// Shared-memory plan and shape of each kind. Stage s of the ring starts at s * kStageBytes.
template <int kK>
struct KT {
  static constexpr bool kMx = kK >= kMxGateUp;
  static constexpr bool kGateUp = kK == kFp8GateUp || kK == kMxGateUp;
  static constexpr bool kBf16 = kK == kMxDown;  // bf16 wgmma (k16) instead of e4m3 (k32)
  static constexpr int kKPerStage = kBf16 ? 64 : 128;   // elements of K per stage (128 bytes per operand row)
  static constexpr int kStages = kBf16 ? 7 : 5;
  // fp8: [A 32 KiB | B 8 KiB]; mxfp4: [B 8 KiB | raw codes, rows padded | raw scales 1 KiB]
  // 64 / 32 code bytes per row and stage; + 16 for the row-per-thread reads (conflict-free)
  static constexpr int kRowBytes = kGateUp ? 64 : 32;  // code bytes of one row per stage
  static constexpr int kRawStride = kRowBytes + 16;  // + 16: conflict-free row reads
  static constexpr int kStageBytes = !kMx ? 40 * 1024 : (kGateUp ? 29 * 1024 : 21 * 1024);
  static constexpr int kAOff = 0;                        // fp8: the operand tile itself
  static constexpr int kBOff = kMx ? 0 : 32 * 1024;
  static constexpr int kRawOff = 8 * 1024;
  static constexpr int kRawScaleOff = kRawOff + kRows * kRawStride;
  static constexpr int kConvOff = kStages * kStageBytes;  // mxfp4: two expanded tiles
  static constexpr int kRingEnd = kConvOff + (kMx ? 2 * kConvBytes : 0);
  static_assert(kRingEnd <= kExtraOff, "ring below the extras");
  // raw scale words: one per row
  static constexpr int kRawScaleBytes = kRows * 4;
  static_assert(!kMx || kRawScaleOff + kRawScaleBytes <= kStageBytes, "mxfp4 stage fits");
  static_assert(kStageBytes % 1024 == 0 && kConvOff % 1024 == 0, "swizzled tiles 1024-aligned");
  static_assert(kStages <= kMaxStages, "scale ring");
};
static_assert(kMaxBN * kOutStageStride * 2 <= 5 * 21 * 1024, "epilogue staging fits the ring");
static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EPX_MX_WGMMA 1
#endif

#ifdef EPX_MX_WGMMA

// cp.async, wgmma fences, smem_desc and swz: the sm_90a primitives shared with the FP8 kernels.
using namespace wg;

/// PTX prmt (default mode): byte i of the result = byte (s_i & 7) of {a, b}, or that byte's sign
/// replicated when s_i & 8 (s_i = nibble i of s).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}
/// cp.async with the L2 prefetch-size hint .L2::256B (PTX ISA, cp.async): the L2 fetches the 256-byte
/// block around the source, so a weight row read 64 / 32 bytes per stage comes from DRAM in 256-byte
/// pieces and the next stages of that row hit the L2 (debug mode 3; a hint, results unchanged).
__device__ __forceinline__ void cp_async16_pf256(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4_pf256(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global.L2::256B [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

/// 0x80 in byte i (i < 4) where e2m1 nibble i of w is negative, else 0.
__device__ __forceinline__ uint32_t nibble_signs(uint32_t w) {
  return (prmt(0x80808080u, 0x80808080u, w) & 0x40404040u) << 1;
}

/// The wgmma of one K step: e4m3 (wg::Wgmma) or bf16 (WgmmaBf16), N = BN (cuda/wgmma.cuh).
template <bool kBf16, int BN>
struct Mma {
  __device__ __forceinline__ static void run(float (&d)[BN / 2], uint64_t a, uint64_t b, int acc) {
    if constexpr (kBf16) WgmmaBf16<BN>::mma(d, a, b, acc);
    else Wgmma<BN>::mma(d, a, b, acc);
  }
};

/// What one work item needs, resolved by every thread.
struct Item {
  const uint8_t* w;        // w13 or w2 (fp8 codes or packed e2m1 pairs, K-major rows)
  const void* w_scale;     // fp8: fp32 [rows/128, K/128]; mxfp4: e8m0 [rows, K/32]
  int64_t K;               // reduction length (elements; multiple of 128)
  int64_t inter;           // I of the expert
  int64_t hidden;          // H
  int32_t row0, num_rows;  // row-space rows of the tile
  int64_t col0;            // gate_up: first h column; down: first output column
  int32_t expert;          // local expert (MixedGemmParams::mx_maps)
};

template <bool kGateUp>
__device__ __forceinline__ int64_t sub_row(const Item& it, int t) {
  if constexpr (kGateUp) return (t >= 2 ? it.inter : 0) + it.col0 + (t & 1) * 64;
  else return it.col0 + t * 64;
}
template <bool kGateUp>
__device__ __forceinline__ bool sub_valid(const Item& it, int t) {
  if constexpr (kGateUp) return true;
  else return it.col0 + t * 64 < it.hidden;
}

/// Debug instrumentation (set_mixed_debug; kDbg > 0 instantiations only, never the default kernels):
/// per-warp clock64 sums of each phase of the K loop (MixedDebugPhase), added into the device buffer
/// [gemm][warp][phase] once per CTA by lane 0 of each warp.
template <bool kOn>
struct StampsT {
  __device__ __forceinline__ void start() {}
  __device__ __forceinline__ void mark(int) {}
  __device__ __forceinline__ void count(int, long long) {}
  __device__ __forceinline__ void flush(unsigned long long*, bool) {}
};
template <>
struct StampsT<true> {
  long long v[kMixedDebugPhases];
  long long t;
  __device__ __forceinline__ StampsT() {
#pragma unroll
    for (int i = 0; i < kMixedDebugPhases; ++i) v[i] = 0;
    t = clock64();
  }
  __device__ __forceinline__ void start() { t = clock64(); }
  __device__ __forceinline__ void mark(int ph) {
    const long long n = clock64();
    v[ph] += n - t;
    t = n;
  }
  __device__ __forceinline__ void count(int ph, long long n) { v[ph] += n; }
  __device__ __forceinline__ void flush(unsigned long long* buf, bool gate_up) {
    if (buf == nullptr || (threadIdx.x & 31) != 0) return;
    unsigned long long* b = buf + ((gate_up ? 0 : 1) * kMixedDebugWarps + (threadIdx.x >> 5)) * kMixedDebugPhases;
#pragma unroll
    for (int i = 0; i < kMixedDebugPhases; ++i) atomicAdd(b + i, static_cast<unsigned long long>(v[i]));
  }
};
template <int kDbg>
using Stamps = StampsT<(kDbg > 0)>;

/// e4m3 codes of 8 e2m1 codes (word w, element i = nibble i) through the group table (lo, hi).
__device__ __forceinline__ uint2 e2m1x8_to_e4m3(uint32_t w, uint32_t lo, uint32_t hi) {
  const uint32_t m = w & 0x77777777u;
  return make_uint2(prmt(lo, hi, m) | nibble_signs(w), prmt(lo, hi, m >> 16) | nibble_signs(w >> 16));
}
/// bf16 values of 8 e2m1 codes through the group tables (hi bytes, lo bytes).
__device__ __forceinline__ uint4 e2m1x8_to_bf16(uint32_t w, uint32_t hl, uint32_t hh, uint32_t ll, uint32_t lh) {
  const uint32_t m = w & 0x77777777u;
  const uint32_t h0 = prmt(hl, hh, m) | nibble_signs(w), l0 = prmt(ll, lh, m);
  const uint32_t h1 = prmt(hl, hh, m >> 16) | nibble_signs(w >> 16), l1 = prmt(ll, lh, m >> 16);
  return make_uint4(prmt(l0, h0, 0x5140u), prmt(l0, h0, 0x7362u), prmt(l1, h1, 0x5140u), prmt(l1, h1, 0x7362u));
}

/// gate_up: group g (32 codes, the 16 bytes at `chunk`) of weight row r with group exponent e_g and
/// row exponent E into chunks 2g, 2g + 1 of row r of operand tile `conv` as e4m3 e2m1 * 2^(e_g - E + 6).
__device__ __forceinline__ void expand_gate_up_group(const uint8_t* chunk, int e_g, int E, uint8_t* conv, int r, int g) {
  const uint4 q = *reinterpret_cast<const uint4*>(chunk);
  const int d = e_g - E + 6;  // <= 6
  uint4 o0, o1;
  if (d >= -5) {
    const uint32_t B = static_cast<uint32_t>(6 + d) << 3;  // e4m3 code of 0.5 * 2^d
    const uint32_t lo = (B << 8) | ((B + 8) << 16) | ((B + 12) << 24);
    const uint32_t hi = (B + 16) | ((B + 20) << 8) | ((B + 24) << 16) | ((B + 28) << 24);
    const uint2 a = e2m1x8_to_e4m3(q.x, lo, hi), b = e2m1x8_to_e4m3(q.y, lo, hi);
    const uint2 c = e2m1x8_to_e4m3(q.z, lo, hi), e = e2m1x8_to_e4m3(q.w, lo, hi);
    o0 = make_uint4(a.x, a.y, b.x, b.y);
    o1 = make_uint4(c.x, c.y, e.x, e.y);
  } else {  // a group far below its row's largest: RNE through fp32 (exact down to d = -8)
    const float f = exp2f(static_cast<float>(d));
    uint32_t out[8];
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int wi = 0; wi < 4; ++wi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t v = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t code = (words[wi] >> (16 * half + 4 * j)) & 0xFu;
          v |= static_cast<uint32_t>(float_to_fp8_e4m3_bits(fp4_e2m1_bits_to_float(static_cast<uint8_t>(code)) * f)) << (8 * j);
        }
        out[2 * wi + half] = v;
      }
    }
    o0 = make_uint4(out[0], out[1], out[2], out[3]);
    o1 = make_uint4(out[4], out[5], out[6], out[7]);
  }
  *reinterpret_cast<uint4*>(conv + swz(r, 2 * g)) = o0;
  *reinterpret_cast<uint4*>(conv + swz(r, 2 * g + 1)) = o1;
}

/// down: group g (32 codes at `chunk`, e8m0 exponent e) of weight row r into chunks 4g .. 4g + 3 of
/// row r of operand tile `conv` as bf16 e2m1 * 2^(e - 127).
__device__ __forceinline__ void expand_down_group(const uint8_t* chunk, uint32_t e, uint8_t* conv, int r, int g) {
  const uint4 q = *reinterpret_cast<const uint4*>(chunk);
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  if (e >= 2 && e <= 252) {
    // bf16 of code c: exponent field F = e - 1 (c = 1), e (2, 3), e + 1 (4, 5), e + 2 (6, 7); the
    // mantissa's top bit for c = 3, 5, 7. High byte F >> 1, low byte (F & 1) << 7 | mantissa.
    const uint32_t hl = (((e - 1) >> 1) << 8) | ((e >> 1) << 16) | ((e >> 1) << 24);
    const uint32_t hh = ((e + 1) >> 1) | (((e + 1) >> 1) << 8) | (((e + 2) >> 1) << 16) | (((e + 2) >> 1) << 24);
    const uint32_t b1 = ((e - 1) & 1) << 7, b2 = (e & 1) << 7, b4 = ((e + 1) & 1) << 7;
    const uint32_t ll = (b1 << 8) | (b2 << 16) | ((b2 | 0x40u) << 24);
    const uint32_t lh = b4 | ((b4 | 0x40u) << 8) | (b2 << 16) | ((b2 | 0x40u) << 24);
#pragma unroll
    for (int wi = 0; wi < 4; ++wi)
      *reinterpret_cast<uint4*>(conv + swz(r, 4 * g + wi)) = e2m1x8_to_bf16(words[wi], hl, hh, ll, lh);
  } else {  // extreme scales: RNE through fp32
    const float s = e8m0_bits_to_float(static_cast<uint8_t>(e));
#pragma unroll
    for (int wi = 0; wi < 4; ++wi) {
      uint32_t o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t c0 = (words[wi] >> (8 * j)) & 0xFu, c1 = (words[wi] >> (8 * j + 4)) & 0xFu;
        o[j] = float_to_bf16_bits(fp4_e2m1_bits_to_float(static_cast<uint8_t>(c0)) * s) |
               (static_cast<uint32_t>(float_to_bf16_bits(fp4_e2m1_bits_to_float(static_cast<uint8_t>(c1)) * s)) << 16);
      }
      *reinterpret_cast<uint4*>(conv + swz(r, 4 * g + wi)) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

/// 2^(E - 133) as an fp32 (normal for E >= 7, else a denormal); a NaN scale (255) gives NaN.
__device__ __forceinline__ float row_scale_of(int E) {
  return E == 255 ? __uint_as_float(0x7fc00000u)
                  : (E >= 7 ? __uint_as_float(static_cast<uint32_t>(E - 6) << 23) : __uint_as_float(1u << (E + 16)));
}

/// Expands this thread's share of ring stage `stage` into operand tile `conv` (128B-swizzled, 256
/// rows x 128 bytes); gate_up also writes each row's scale 2^(E-133). 256 threads: row threadIdx.x,
/// every group of it. scale_byte: byte offset of the stage's first e8m0 scale of the thread's row
/// (down only).
template <int kK, int NT>
__device__ __forceinline__ void convert_row(const uint8_t* stage, uint8_t* conv, float* row_scale, const int64_t* scale_byte) {
  using T = KT<kK>;
  const int tid = threadIdx.x;
  {
  const int r = tid;
  const uint8_t* raw = stage + T::kRawOff + r * T::kRawStride;
  const uint32_t scw = *reinterpret_cast<const uint32_t*>(stage + T::kRawScaleOff + r * 4);
  if constexpr (T::kGateUp) {
    const int e0 = scw & 0xFF, e1 = (scw >> 8) & 0xFF, e2 = (scw >> 16) & 0xFF, e3 = scw >> 24;
    const int E = max(max(e0, e1), max(e2, e3));
    row_scale[r] = row_scale_of(E);
#pragma unroll
    for (int g = 0; g < 4; ++g) expand_gate_up_group(raw + g * 16, (scw >> (8 * g)) & 0xFF, E, conv, r, g);
  } else {  // 64 elements = 2 groups; the scale pair sits at byte (scale_byte & 2) of the word
    const uint32_t pair = scw >> (8 * (scale_byte[0] & 2));
#pragma unroll
    for (int g = 0; g < 2; ++g) expand_down_group(raw + g * 16, (pair >> (8 * g)) & 0xFFu, conv, r, g);
  }
  }
}

#endif  // EPX_MX_WGMMA

}  // namespace
}  // namespace epx::experts_cuda
