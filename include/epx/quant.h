// epx/quant.h: FP8 and MXFP4 quantization used by dispatch (activations) and experts (weights).
//
// Activation recipe (DeepSeek-V3 tech report §3.3, DeepGEMM / DeepEP LL layout): per-token-group
// 1 x 128 FP8 e4m3 with one fp32 scale per group: scale = max(amax, 1e-4) / 448, q = sat_rne(x / scale).
// The 1e-4 floor makes an all-zero group quantize to exact zeros with a layout-independent scale
// (BEHAVIOUR.md). With ue8m0 the scale is rounded *up* to a power of two, 2^ceil(log2(scale))
// (DeepGEMM's UE8M0 scales on sm_100; DeepEP round_scale).
// Weight recipe: 128 x 128 blocks, fp32 scale_inv per block = amax_block / 448 (DeepSeek-V3
// checkpoints store it as `weight_scale_inv`; w = q * scale_inv).
// MXFP4 (OCP MX spec v1.0): blocks of 32 along the input dimension; shared scale
// 2^(floor(log2(amax)) - 2) stored as e8m0 (emax of e2m1 is 2); elements e2m1 RNE, saturating.
#pragma once

#include "epx/tensor.h"

namespace epx {

constexpr int kFp8GroupSize = 128;  ///< activation group / weight block edge
constexpr int kMxfp4BlockSize = 32;

/// x [T, H] bf16 or fp32 -> q [T, H] fp8_e4m3, scales [T, H/group_size] fp32.
/// H % group_size == 0. All CPU (or all CUDA with EPX_CUDA). Throws InvalidArgument.
void quantize_fp8_per_token_group(const TensorView& x, const TensorView& q, const TensorView& scales,
                                  int group_size = kFp8GroupSize, bool ue8m0 = false, Stream stream = {});
/// q [T, H] fp8_e4m3, scales [T, H/group] fp32 -> out [T, H] bf16 or fp32 (out = q * scale).
void dequantize_fp8_per_token_group(const TensorView& q, const TensorView& scales, const TensorView& out,
                                    int group_size = kFp8GroupSize, Stream stream = {});

/// Row helpers for kernels' CPU twins: one row of H elements (fp32 in), H % group == 0.
void quantize_fp8_row(const float* x, int64_t hidden, uint8_t* q, float* scales, int group_size, bool ue8m0);
void dequantize_fp8_row(const uint8_t* q, const float* scales, int64_t hidden, float* out, int group_size);

/// w [N, K] fp32 or bf16 -> q [N, K] fp8_e4m3, scale_inv [ceil(N/128), ceil(K/128)] fp32 (CPU).
void quantize_fp8_block_weight(const TensorView& w, const TensorView& q, const TensorView& scale_inv);
/// q [N, K] fp8_e4m3 + scale_inv -> out [N, K] fp32 (CPU).
void dequantize_fp8_block_weight(const TensorView& q, const TensorView& scale_inv, const TensorView& out);

/// w [N, K] fp32 or bf16, K % 32 == 0 -> packed [N, K/2] fp4_e2m1x2 (low nibble = even element),
/// scales [N, K/32] e8m0 (CPU).
void mxfp4_pack(const TensorView& w, const TensorView& packed, const TensorView& scales);
/// packed [N, K/2] + scales [N, K/32] -> out [N, K] fp32 (CPU).
void mxfp4_unpack(const TensorView& packed, const TensorView& scales, const TensorView& out);

}  // namespace epx
