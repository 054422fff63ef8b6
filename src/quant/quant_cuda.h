// quant/quant_cuda.h: CUDA twins of the FP8 per-token-group functions of epx/quant.h.
//
// Same contract and the same bits as the CPU reference (quant_cpu.cpp): scale = max(amax, 1e-4) /
// 448 (rounded up to a power of two with ue8m0), q = fp8_e4m3(x / scale) saturating RNE; only the
// sign of a NaN code may differ (the hardware conversion writes +NaN). The public functions in
// epx/quant.h validate their arguments and call these for CUDA tensors. Free of CUDA headers.
#pragma once

#include "epx/tensor.h"

namespace epx::quant {

/// x [T, H] bf16 or fp32 (row stride >= H, unit element stride), q [T, H] fp8_e4m3 and scales
/// [T, H / group_size] fp32 (both with row strides), all on one CUDA device; H % group_size == 0.
/// Stream-ordered on `stream`. Throws InvalidArgument for shapes/dtypes/devices that break this.
void quantize_fp8_per_token_group_cuda(const TensorView& x, const TensorView& q, const TensorView& scales, int group_size,
                                       bool ue8m0, Stream stream);

/// q [T, H] fp8_e4m3, scales [T, H / group_size] fp32 -> out [T, H] bf16 or fp32 (out = q * scale,
/// bf16 rounded RNE), on one CUDA device. Stream-ordered.
void dequantize_fp8_per_token_group_cuda(const TensorView& q, const TensorView& scales, const TensorView& out,
                                         int group_size, Stream stream);

}  // namespace epx::quant
