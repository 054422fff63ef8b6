// routing/routing_cuda.h: the CUDA twin of route() (epx/routing.h, reference routing_cpu.cpp).
//
// Same recipes and the same arithmetic in the same order as the CPU router: the sums that feed a
// normalisation run sequentially in expert (or k) order, divisions are IEEE, no fused multiply-add.
// The one difference is exp(): the CPU calls glibc's expf, the kernel rounds a double-precision exp
// to float (the correctly rounded value), and glibc's expf differs from that by one ulp for about
// 6 in 10^4 arguments. Weights therefore agree to about 1e-7 relative, and a selection can differ
// only where two candidates' scores are within an ulp of each other. Free of CUDA headers.
#pragma once

#include "epx/routing.h"

namespace epx::routing {

/// route() on CUDA tensors: logits [T, E] fp32 or bf16 (any strides), correction_bias [E] fp32 (only
/// with cfg.use_correction_bias), topk_idx [T, K] int32 or int64, topk_weights [T, K] fp32, all on
/// one CUDA device. Stream-ordered on `stream`. Throws InvalidArgument like route(); Unsupported
/// when E is too large for one warp's shared memory (E > 3072).
void route_cuda(const RouterConfig& cfg, const TensorView& logits, const TensorView& correction_bias,
                const TensorView& topk_idx, const TensorView& topk_weights, Stream stream);

}  // namespace epx::routing
