// experts/experts_cuda_types.h: the device-side work description shared by the CUDA expert
// kernels (experts_cuda_kernels.cuh, the SIMT reference GEMMs) and the sm_90a fp8 tensor-core GEMMs
// (experts_fp8_cuda.cu): the tile list the schedule kernels build and the per-expert weight table.
#pragma once

#include <cstdint>

namespace epx::experts_cuda {

/// Rows (tokens) per tile of the device-side tile list; the fp8 tensor-core GEMM runs a tile as one
/// N=16 or N=64 wgmma column block, the SIMT GEMM in passes of kSimtRows. With
/// ScheduleParams::big_rows > 0 the experts with more rows are tiled by big_rows (128: the FP8
/// prefill kernels' N) after all the others' tiles.
constexpr int kTileRows = 64;

/// One tile of work: rows [row0, row0 + num_rows) of the row space, all of expert `expert`.
/// Row space: ExpertMajor r = l * cap + j (x, h and out rows alike); Flat r = position of a
/// (token, k) pair after grouping by expert (h and the per-pair output rows; x row = gather[r]).
struct Tile {
  int32_t expert;
  int32_t row0;
  int32_t num_rows;
  int32_t pad;
};

/// One local expert's device weights (layouts of ExpertWeights in epx/experts.h).
struct ExpertDesc {
  const void* w13;        ///< [2I, H] bf16 | fp8_e4m3 | packed e2m1 [2I, H/2]
  const void* w13_scale;  ///< fp8: fp32 [2I/128, H/128]; mxfp4: e8m0 [2I, H/32]; bf16: null
  const void* w2;         ///< [H, I] likewise
  const void* w2_scale;   ///< fp8: fp32 [H/128, I/128]; mxfp4: e8m0 [H, I/32]; bf16: null
  int32_t intermediate;   ///< I
  int32_t format;         ///< WeightFormat
};

/// One local expert's biases and activation (ExpertWeights::b13 / b2 / activation), read only by the
/// epilogue kernel variants (the *_epi kernels), launched when some expert of the object has them; the
/// default kernels never see it. Device array [L], next to the ExpertDesc table.
struct ExpertEpi {
  const float* b13;  ///< [2I] fp32 (gate then up), or null
  const float* b2;   ///< [H] fp32, or null
  int32_t kind;      ///< ExpertActivation::Kind (0 silu_glu, 1 gpt_oss_glu)
  float alpha;       ///< gpt_oss_glu's alpha
  float limit;       ///< the clamp bound; +infinity = no clamp
  int32_t pad;
};

}  // namespace epx::experts_cuda
