// experts/experts_cuda_kernels.cuh: device side of the reference grouped expert MLP (experts_cuda.cu
// is the host side: checks, workspace, launches): the kernels' parameters and steps 2 to 5 below; the
// schedule kernels (step 1) are in experts_schedule_kernels.cuh. Included by experts_cuda.cu only.
//
// Pipeline of one apply(), all stream-ordered, no host sync:
//   1. schedule   (1 CTA)  per-expert row counts read on the device (ExpertMajor: recv_count;
//                          Flat: a histogram of topk_idx, then a scatter that groups the (row, k)
//                          pairs by expert), and a tile list: (expert, first row, rows <= kTileRows).
//   2. gate_up    (GEMM)   h = silu(x W_gate^T) * (x W_up^T), fp32 accumulation, weights dequantized
//                          to fp32 on load (as the CPU does once up front), h stored fp32, rounded to
//                          bf16 values for bf16/mxfp4 experts. expert_gemm_epi_kernel (objects with
//                          biases or another activation): h = act([g, u] + b13), experts_epilogue.cuh.
//   3. quantize_h          fp8_block experts only: h -> FP8 e4m3 1x128 and back, the CPU's
//                          quantize_fp8_row + dequantize_fp8_row bit for bit (same scale rule).
//   4. down       (GEMM)   y = h W_down^T (+ b2 in the epi kernel), fp32 accumulation, rounded to bf16 once.
//   5. combine    (Flat)   out[n] = sum over valid k, in column order, of w[n,k] * y[pair(n,k)], fp32
//                          (separate multiply and add, as the CPU), rounded to bf16 once.
//
// The GEMMs are plain SIMT tiles (kSimtRows x kTileCols outputs per CTA, a list tile in passes, kTileK-deep shared-memory
// stages, 4 x 4 outputs per thread, register prefetch of the next stage): a reference, not the fast
// path. Every output row depends only on its own input row, and each row's fp32 sums run in a fixed
// order, so results do not depend on how rows are grouped into tiles.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "epx/dtype.h"
#include "epx/experts.h"
#include "experts/experts_cuda_types.h"
#include "experts/experts_epilogue.cuh"

namespace epx::experts_cuda {

constexpr int kSimtRows = 32;   ///< rows (tokens) per SIMT GEMM pass (a tile is done in passes)
constexpr int kTileCols = 64;   ///< output columns per GEMM tile (gate_up: 32 gate + 32 up, interleaved)
constexpr int kTileK = 32;      ///< reduction depth per shared-memory stage (one MXFP4 block)
constexpr int kGemmThreads = 128;
constexpr int kScheduleThreads = 1024;
constexpr int kMaxLocalExperts = 2048;  ///< bounds the schedule kernel's shared memory (5 int arrays of L: 40 KiB)
constexpr int kFp8Group = 128;

/// Error codes the schedule kernels leave in the host-mapped ErrorRecord.
enum ErrorCode : int32_t { kNoError = 0, kBadTopkIdx = 1, kBadRecvCount = 2, kBadExpertOffsets = 3 };

/// Host-mapped record of the first bad input a schedule kernel saw; the host raises it.
struct ErrorRecord {
  int32_t code;
  int32_t row;
  int32_t col;
  int32_t pad;
  int64_t value;
};

enum class ActKind : int { bf16, fp8, f32 };

struct ScheduleParams {
  int num_local;          ///< L
  int64_t cap;            ///< ExpertMajor: rows per expert in x
  const int32_t* recv_count;  ///< ExpertMajor [L]
  const int32_t* expert_offsets;  ///< Contiguous: ExpertsInput::expert_offsets; else null
  bool offsets_lead;      ///< Contiguous: expert_offsets is [L + 1] (starts, then the end), else [L] (cumulative ends)
  int64_t num_rows;       ///< Contiguous: N, the rows of x
  const void* topk_idx;   ///< Flat [N, K] int32 | int64
  bool idx_int64;
  int64_t num_pairs;      ///< Flat: N * K
  int top_k;              ///< Flat: K
  int32_t* pair_row;      ///< Flat out [N*K]: token of each grouped pair
  int32_t* slot;          ///< Flat out [N*K]: grouped position of (n, k), -1 = not on this rank
  Tile* tiles;            ///< out [max tiles]
  int32_t* num_tiles;     ///< out [2]: [0] tiles, [1] tiles of the small section (big_rows > 0)
  /// 0: every expert in tiles of kTileRows rows. > 0: experts with more than kTileRows rows are
  /// tiled by big_rows rows after all the others' tiles (the FP8 prefill kernels' section,
  /// Fp8GemmParams::num_small); num_tiles[1] = first tile of that section.
  int32_t big_rows;
  /// big_rows > 0 only: the section is used only when the experts with more than kTileRows rows
  /// need at least this many big tiles in all (else every expert is tiled by kTileRows and
  /// num_tiles[1] = num_tiles[0]: the prefill launches find no tile). <= 1: always.
  int32_t big_min_tiles;
  /// big_rows > 0 only: the order of the section's tiles for the 2-CTA cluster kernels (Fp8GemmParams::prefill_cluster),
  /// which pair tile-list entries 2 j, 2 j + 1 (experts_fp8_prefill_tma_cuda.cu, work_pair). false: every expert's
  /// tiles in expert order (an expert with an odd tile count shifts every later pair onto two experts until the next
  /// odd one). true: order_big_tiles_for_pairs below, so that every pair but those of the odd experts' last tiles is
  /// one expert's. The tiles are the same either way (only their positions differ): same results.
  bool pair_big;
  ErrorRecord* error;     ///< host-mapped
};

struct GemmParams {
  const ExpertDesc* experts;
  const Tile* tiles;
  const int32_t* num_tiles;
  const void* a;          ///< gate_up: x rows (bf16 | fp8); down: h fp32
  const float* a_scales;  ///< fp8 x: [rows, H/128]
  const int32_t* gather;  ///< gate_up, Flat: row space -> x row; null = identity
  int64_t a_stride;       ///< elements per A row
  int64_t a_scales_stride;
  int64_t hidden;         ///< H
  float* h;               ///< [row space, h_stride] fp32 (gate_up output, down input)
  int64_t h_stride;
  uint16_t* out;          ///< down: bf16 [row space, H]
};

struct QuantizeHParams {
  const ExpertDesc* experts;
  const Tile* tiles;
  const int32_t* num_tiles;
  float* h;
  int64_t h_stride;
};

struct CombineParams {
  const uint16_t* pair_out;  ///< [N*K, H] bf16
  const int32_t* slot;       ///< [N*K]
  const float* topk_weights; ///< [N, K]
  uint16_t* out;             ///< [N, H] bf16, or null when out_f32 is given
  float* out_f32;            ///< [N, H] fp32 (the weighted sum unrounded), or null
  int64_t num_tokens, hidden;
  int top_k;
};

// ---- small device helpers ---------------------------------------------------------------------

__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

/// Two fp8 e4m3 codes (low byte first) -> floats; exact (every e4m3 value is an fp16 value).
__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t two_codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_codes & 0xffffu), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

/// e2m1 code (low 4 bits) -> float, exact: {0, .5, 1, 1.5, 2, 3, 4, 6} with sign.
__device__ __forceinline__ float fp4_to_float(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const uint32_t mag = e == 0 ? (m ? 0x3f000000u : 0u) : (((e + 126u) << 23) | (m << 22));
  return __uint_as_float(mag | ((code & 8u) << 28));
}

// ---- GEMM stage loaders -------------------------------------------------------------------------

constexpr int kAStride = kSimtRows + 4;  // As[k][m]: +4 keeps float4 rows 16-byte aligned
constexpr int kBStride = kTileCols + 4;  // Bs[k][n]

/// One stage of the A operand (kSimtRows x kTileK), prefetched to registers, then stored to
/// shared memory transposed as fp32 (fp8 x dequantized: code * scale, as dequantize_fp8_row).
template <ActKind kA>
struct AStage {
  static constexpr int kLoads = kA == ActKind::f32 ? 2 : 1;
  uint4 raw[kLoads];
  float scale;

  __device__ __forceinline__ void load(const GemmParams& p, const int64_t* rows, int64_t k0, int64_t K) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int s = 0; s < kLoads; ++s) {
      raw[s] = make_uint4(0, 0, 0, 0);
      if constexpr (kA == ActKind::f32) {
        const int i = tid + s * kGemmThreads, m = i >> 3;
        const int64_t k = k0 + (i & 7) * 4, row = rows[m];
        if (row >= 0 && k < K) raw[s] = *reinterpret_cast<const uint4*>(static_cast<const float*>(p.a) + row * p.a_stride + k);
      } else {
        const int m = tid >> 2;
        const int64_t k = k0 + (tid & 3) * 8, row = rows[m];
        scale = 0.0f;
        if (row >= 0 && k < K) {
          if constexpr (kA == ActKind::bf16) {
            raw[s] = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.a) + row * p.a_stride + k);
          } else {
            const uint2 q = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(p.a) + row * p.a_stride + k);
            raw[s].x = q.x, raw[s].y = q.y;
            scale = p.a_scales[row * p.a_scales_stride + k / kFp8Group];
          }
        }
      }
    }
  }

  __device__ __forceinline__ void store(float (*As)[kAStride]) const {
    const int tid = threadIdx.x;
    if constexpr (kA == ActKind::f32) {
#pragma unroll
      for (int s = 0; s < kLoads; ++s) {
        const int i = tid + s * kGemmThreads, m = i >> 3, kk = (i & 7) * 4;
        As[kk + 0][m] = __uint_as_float(raw[s].x);
        As[kk + 1][m] = __uint_as_float(raw[s].y);
        As[kk + 2][m] = __uint_as_float(raw[s].z);
        As[kk + 3][m] = __uint_as_float(raw[s].w);
      }
    } else {
      const int m = tid >> 2, kk = (tid & 3) * 8;
      float v[8];
      if constexpr (kA == ActKind::bf16) {
        const uint32_t w[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) v[2 * j] = bf16_lo(w[j]), v[2 * j + 1] = bf16_hi(w[j]);
      } else {
        const uint32_t w[2] = {raw[0].x, raw[0].y};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float2 lo = fp8x2_to_float2(w[j]), hi = fp8x2_to_float2(w[j] >> 16);
          v[4 * j + 0] = __fmul_rn(lo.x, scale);
          v[4 * j + 1] = __fmul_rn(lo.y, scale);
          v[4 * j + 2] = __fmul_rn(hi.x, scale);
          v[4 * j + 3] = __fmul_rn(hi.y, scale);
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) As[kk + j][m] = v[j];
    }
  }
};

/// One stage of the weight operand (kTileCols rows of W x kTileK), dequantized to fp32 on store
/// exactly as the CPU's dequantized copy (code * scale in fp32). gate_up interleaves the columns:
/// tile column 2c is gate row i0 + c, column 2c + 1 is up row I + i0 + c, so each thread's four
/// columns hold two (gate, up) pairs.
template <WeightFormat kW, bool kGateUp>
struct BStage {
  static constexpr int kLoads = kW == WeightFormat::bf16 ? 2 : 1;
  uint4 raw[kLoads];
  float scale;

  /// Row of W behind tile column n (or -1 when outside the matrix).
  __device__ __forceinline__ static int64_t weight_row(int n, int64_t col0, int64_t inter, int64_t hidden) {
    if constexpr (kGateUp) {
      const int64_t i = col0 / 2 + (n >> 1);
      return i < inter ? ((n & 1) ? inter + i : i) : -1;
    } else {
      const int64_t r = col0 + n;
      return r < hidden ? r : -1;
    }
  }

  __device__ __forceinline__ void load(const void* w, const void* w_scale, int64_t col0, int64_t k0, int64_t K,
                                       int64_t inter, int64_t hidden) {
    const int tid = threadIdx.x;
    scale = 0.0f;
    if constexpr (kW == WeightFormat::bf16) {
#pragma unroll
      for (int s = 0; s < kLoads; ++s) {
        const int i = tid + s * kGemmThreads;
        const int64_t row = weight_row(i >> 2, col0, inter, hidden), k = k0 + (i & 3) * 8;
        raw[s] = make_uint4(0, 0, 0, 0);
        if (row >= 0 && k < K) raw[s] = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(w) + row * K + k);
      }
    } else if constexpr (kW == WeightFormat::fp8_block) {
      const int64_t row = weight_row(tid >> 1, col0, inter, hidden), k = k0 + (tid & 1) * 16;
      raw[0] = make_uint4(0, 0, 0, 0);
      if (row >= 0 && k < K) {  // K % 128 == 0 for fp8_block
        raw[0] = *reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(w) + row * K + k);
        scale = static_cast<const float*>(w_scale)[(row / kFp8Group) * (K / kFp8Group) + k / kFp8Group];
      }
    } else {  // mxfp4: 16 codes (8 bytes) per thread, one e8m0 scale per 32 inputs
      const int64_t row = weight_row(tid >> 1, col0, inter, hidden), k = k0 + (tid & 1) * 16;
      raw[0] = make_uint4(0, 0, 0, 0);
      if (row >= 0 && k < K) {  // K % 32 == 0 for mxfp4
        const uint2 q = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(w) + (row * K + k) / 2);
        raw[0].x = q.x, raw[0].y = q.y;
        scale = e8m0_bits_to_float(static_cast<const uint8_t*>(w_scale)[row * (K / kMxfp4Block) + k / kMxfp4Block]);
      }
    }
  }

  __device__ __forceinline__ void store(float (*Bs)[kBStride]) const {
    const int tid = threadIdx.x;
    if constexpr (kW == WeightFormat::bf16) {
#pragma unroll
      for (int s = 0; s < kLoads; ++s) {
        const int i = tid + s * kGemmThreads, n = i >> 2, kk = (i & 3) * 8;
        const uint32_t w[4] = {raw[s].x, raw[s].y, raw[s].z, raw[s].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) Bs[kk + 2 * j][n] = bf16_lo(w[j]), Bs[kk + 2 * j + 1][n] = bf16_hi(w[j]);
      }
    } else if constexpr (kW == WeightFormat::fp8_block) {
      const int n = tid >> 1, kk = (tid & 1) * 16;
      const uint32_t w[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 lo = fp8x2_to_float2(w[j]), hi = fp8x2_to_float2(w[j] >> 16);
        Bs[kk + 4 * j + 0][n] = __fmul_rn(lo.x, scale);
        Bs[kk + 4 * j + 1][n] = __fmul_rn(lo.y, scale);
        Bs[kk + 4 * j + 2][n] = __fmul_rn(hi.x, scale);
        Bs[kk + 4 * j + 3][n] = __fmul_rn(hi.y, scale);
      }
    } else {
      const int n = tid >> 1, kk = (tid & 1) * 16;
      const uint32_t w[2] = {raw[0].x, raw[0].y};
#pragma unroll
      for (int j = 0; j < 16; ++j) Bs[kk + j][n] = __fmul_rn(fp4_to_float(w[j >> 3] >> (4 * (j & 7))), scale);
    }
  }

  static constexpr int kMxfp4Block = 32;
};

// ---- GEMM kernel ------------------------------------------------------------------------------

/// kGateUp: h[r, i] = silu(g) * u for i in this CTA's 32 columns (rounded to bf16 values unless
/// the expert is fp8_block); else out[r, n] = bf16(sum_i h[r, i] * W_down[n, i]).
/// Grid: x = column tiles, y = tile slots (loops over the device-side tile list with stride
/// gridDim.y). CTAs skip tiles of experts in other formats (one launch per format present).
template <ActKind kA, WeightFormat kW, bool kGateUp>
__global__ void __launch_bounds__(kGemmThreads, 4) expert_gemm_kernel(GemmParams p) {
  __shared__ __align__(16) float As[kTileK][kAStride];
  __shared__ __align__(16) float Bs[kTileK][kBStride];
  __shared__ int64_t rows[kSimtRows];
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTileCols;  // gate_up: interleaved gate/up columns
  const int num_tiles = *p.num_tiles;

  for (int t = blockIdx.y; t < num_tiles; t += gridDim.y) {
    const Tile list_tile = p.tiles[t];
    for (int pass0 = 0; pass0 < list_tile.num_rows; pass0 += kSimtRows) {  // kSimtRows rows per pass
      const Tile tile{list_tile.expert, list_tile.row0 + pass0, min(kSimtRows, list_tile.num_rows - pass0), 0};
      const ExpertDesc e = p.experts[tile.expert];
      if (e.format != static_cast<int32_t>(kW)) continue;  // CTA-uniform
      const int64_t inter = e.intermediate;
      const int64_t K = kGateUp ? p.hidden : inter;
      if (col0 >= (kGateUp ? 2 * inter : p.hidden)) continue;
      const void* w = kGateUp ? e.w13 : e.w2;
      const void* w_scale = kGateUp ? e.w13_scale : e.w2_scale;

      if (tid < kSimtRows) {
        const int64_t r = tile.row0 + tid;
        rows[tid] = tid >= tile.num_rows ? -1 : (kGateUp && p.gather != nullptr ? p.gather[r] : r);
      }
      __syncthreads();

      float acc[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

      AStage<kA> a;
      BStage<kW, kGateUp> b;
      a.load(p, rows, 0, K);
      b.load(w, w_scale, col0, 0, K, inter, p.hidden);
      for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
        a.store(As);
        b.store(Bs);
        __syncthreads();
        if (k0 + kTileK < K) {
          a.load(p, rows, k0 + kTileK, K);
          b.load(w, w_scale, col0, k0 + kTileK, K, inter, p.hidden);
        }
#pragma unroll
        for (int kk = 0; kk < kTileK; ++kk) {
          const float4 av = *reinterpret_cast<const float4*>(&As[kk][ty * 4]);
          const float4 bv = *reinterpret_cast<const float4*>(&Bs[kk][tx * 4]);
          const float am[4] = {av.x, av.y, av.z, av.w}, bn[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(am[i], bn[j], acc[i][j]);
        }
        __syncthreads();
      }

#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = ty * 4 + i;
        if (m >= tile.num_rows) continue;
        const int64_t r = tile.row0 + m;
        if constexpr (kGateUp) {
          const int64_t col = col0 / 2 + tx * 2;  // h columns col, col + 1 (inter is even)
          if (col >= inter) continue;
          float hv[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float g = acc[i][2 * j], u = acc[i][2 * j + 1];
            hv[j] = g / (1.0f + expf(-g)) * u;  // silu(g) * u in fp32, the CPU's expression
            if constexpr (kW != WeightFormat::fp8_block) hv[j] = round_bf16(hv[j]);
          }
          *reinterpret_cast<float2*>(p.h + r * p.h_stride + col) = make_float2(hv[0], hv[1]);
        } else {
          const int64_t col = col0 + tx * 4;  // hidden % 8 == 0: all four in or all out
          if (col >= p.hidden) continue;
          const uint32_t lo = float_to_bf16_bits(acc[i][0]) | (static_cast<uint32_t>(float_to_bf16_bits(acc[i][1])) << 16);
          const uint32_t hi = float_to_bf16_bits(acc[i][2]) | (static_cast<uint32_t>(float_to_bf16_bits(acc[i][3])) << 16);
          *reinterpret_cast<uint2*>(p.out + r * p.hidden + col) = make_uint2(lo, hi);
        }
      }
    }
  }
}

/// expert_gemm_kernel with the experts' biases and activations (epi [L]: ExpertEpi, experts_epilogue.cuh):
/// gate_up h[r, i] = act([g, u] + b13), down out[r, n] = bf16(sum_i h[r, i] * W_down[n, i] + b2[n]). A copy of
/// expert_gemm_kernel but for those two expressions (kept apart so that the default kernel's code stays as it is).
template <ActKind kA, WeightFormat kW, bool kGateUp>
__global__ void __launch_bounds__(kGemmThreads, 4) expert_gemm_epi_kernel(GemmParams p, const ExpertEpi* epi) {
  __shared__ __align__(16) float As[kTileK][kAStride];
  __shared__ __align__(16) float Bs[kTileK][kBStride];
  __shared__ int64_t rows[kSimtRows];
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTileCols;  // gate_up: interleaved gate/up columns
  const int num_tiles = *p.num_tiles;

  for (int t = blockIdx.y; t < num_tiles; t += gridDim.y) {
    const Tile list_tile = p.tiles[t];
    for (int pass0 = 0; pass0 < list_tile.num_rows; pass0 += kSimtRows) {  // kSimtRows rows per pass
      const Tile tile{list_tile.expert, list_tile.row0 + pass0, min(kSimtRows, list_tile.num_rows - pass0), 0};
      const ExpertDesc e = p.experts[tile.expert];
      if (e.format != static_cast<int32_t>(kW)) continue;  // CTA-uniform
      const int64_t inter = e.intermediate;
      const int64_t K = kGateUp ? p.hidden : inter;
      if (col0 >= (kGateUp ? 2 * inter : p.hidden)) continue;
      const void* w = kGateUp ? e.w13 : e.w2;
      const void* w_scale = kGateUp ? e.w13_scale : e.w2_scale;

      if (tid < kSimtRows) {
        const int64_t r = tile.row0 + tid;
        rows[tid] = tid >= tile.num_rows ? -1 : (kGateUp && p.gather != nullptr ? p.gather[r] : r);
      }
      __syncthreads();

      float acc[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

      AStage<kA> a;
      BStage<kW, kGateUp> b;
      a.load(p, rows, 0, K);
      b.load(w, w_scale, col0, 0, K, inter, p.hidden);
      for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
        a.store(As);
        b.store(Bs);
        __syncthreads();
        if (k0 + kTileK < K) {
          a.load(p, rows, k0 + kTileK, K);
          b.load(w, w_scale, col0, k0 + kTileK, K, inter, p.hidden);
        }
#pragma unroll
        for (int kk = 0; kk < kTileK; ++kk) {
          const float4 av = *reinterpret_cast<const float4*>(&As[kk][ty * 4]);
          const float4 bv = *reinterpret_cast<const float4*>(&Bs[kk][tx * 4]);
          const float am[4] = {av.x, av.y, av.z, av.w}, bn[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(am[i], bn[j], acc[i][j]);
        }
        __syncthreads();
      }

#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = ty * 4 + i;
        if (m >= tile.num_rows) continue;
        const int64_t r = tile.row0 + m;
        if constexpr (kGateUp) {
          const int64_t col = col0 / 2 + tx * 2;  // h columns col, col + 1 (inter is even)
          if (col >= inter) continue;
          float hv[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float g = acc[i][2 * j], u = acc[i][2 * j + 1];
            hv[j] = expert_glu(epi[tile.expert], g, u, col + j, inter);
            if constexpr (kW != WeightFormat::fp8_block) hv[j] = round_bf16(hv[j]);
          }
          *reinterpret_cast<float2*>(p.h + r * p.h_stride + col) = make_float2(hv[0], hv[1]);
        } else {
          const int64_t col = col0 + tx * 4;  // hidden % 8 == 0: all four in or all out
          if (col >= p.hidden) continue;
          const ExpertEpi ep = epi[tile.expert];
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = expert_out_bias(ep, acc[i][j], col + j);
          const uint32_t lo = float_to_bf16_bits(acc[i][0]) | (static_cast<uint32_t>(float_to_bf16_bits(acc[i][1])) << 16);
          const uint32_t hi = float_to_bf16_bits(acc[i][2]) | (static_cast<uint32_t>(float_to_bf16_bits(acc[i][3])) << 16);
          *reinterpret_cast<uint2*>(p.out + r * p.hidden + col) = make_uint2(lo, hi);
        }
      }
    }
  }
}

// ---- FP8 1x128 quantization of h (fp8_block experts) ----------------------------------------------

constexpr int kQuantizeThreads = 256;

/// One warp per (row, 128-group): scale = max(amax, 1e-4) / 448, q = e4m3(h / scale), h = q * scale,
/// each step the CPU's (quantize_fp8_row, dequantize_fp8_row) in IEEE fp32.
__global__ void __launch_bounds__(kQuantizeThreads) quantize_h_kernel(QuantizeHParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int kWarps = kQuantizeThreads / 32;
  const int num_tiles = *p.num_tiles;
  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const Tile tile = p.tiles[t];
    const ExpertDesc e = p.experts[tile.expert];
    if (e.format != static_cast<int32_t>(WeightFormat::fp8_block)) continue;
    const int groups = e.intermediate / kFp8Group;
    for (int item = warp; item < tile.num_rows * groups; item += kWarps) {
      float* hg = p.h + (tile.row0 + item / groups) * p.h_stride + (item % groups) * kFp8Group;
      float4 v = *reinterpret_cast<const float4*>(hg + lane * 4);
      float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
      for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
      const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), kFp8E4m3Max);
      auto qdq = [scale](float x) { return __fmul_rn(fp8_e4m3_bits_to_float(float_to_fp8_e4m3_bits(__fdiv_rn(x, scale))), scale); };
      v = make_float4(qdq(v.x), qdq(v.y), qdq(v.z), qdq(v.w));
      *reinterpret_cast<float4*>(hg + lane * 4) = v;
    }
  }
}

// ---- Flat combine -------------------------------------------------------------------------------

constexpr int kCombineThreads = 128;

/// out[n, :] = bf16(sum over k with slot >= 0, in column order, of w[n, k] * y[slot]) (out_f32: the
/// sum unrounded); invalid columns are skipped (select), so their weights and rows are never read.
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(CombineParams p) {
  for (int64_t n = blockIdx.x; n < p.num_tokens; n += gridDim.x) {
    for (int64_t c = threadIdx.x * 8; c < p.hidden; c += kCombineThreads * 8) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < p.top_k; ++k) {
        const int32_t s = p.slot[n * p.top_k + k];
        if (s < 0) continue;
        const float w = p.topk_weights[n * p.top_k + k];
        const uint4 y = *reinterpret_cast<const uint4*>(p.pair_out + s * p.hidden + c);
        const uint32_t yw[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(w, bf16_lo(yw[j])));
          acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(w, bf16_hi(yw[j])));
        }
      }
      if (p.out_f32) {
        float4* dst = reinterpret_cast<float4*>(p.out_f32 + n * p.hidden + c);
        dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        continue;
      }
      uint32_t o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        o[j] = float_to_bf16_bits(acc[2 * j]) | (static_cast<uint32_t>(float_to_bf16_bits(acc[2 * j + 1])) << 16);
      *reinterpret_cast<uint4*>(p.out + n * p.hidden + c) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

}  // namespace epx::experts_cuda
