// experts/experts_epilogue.cuh: the expert biases and activations (ExpertActivation, epx/experts.h) in
// the CUDA expert kernels' epilogues, the CPU experts' arithmetic (experts_cpu.cpp) in the same order
// and at the same rounding points: [g, u] + b13 in fp32, the clamps, the activation in fp32 (h is then
// rounded or quantized where the down GEMM reads it, as before), y + b2 in fp32 before y's one bf16
// rounding. Only the *_epi kernel variants call these (ExpertEpi, experts_cuda_types.h); the default
// kernels keep their plain silu(g) * u and carry none of it.
#pragma once

#include <cstdint>

#include "experts/experts_cuda_types.h"

namespace epx::experts_cuda {

/// h of one (gate, up) pair of h column i (inter = I of the expert): gate_up + b13, g = min(g, limit),
/// u = clamp(u, -limit, limit) (std::min / std::clamp's comparisons: a NaN passes through), then
/// silu(g) * u or (u + 1) * (g * sigmoid(alpha * g)), each the CPU's expression with IEEE operations.
__device__ __forceinline__ float expert_glu(const ExpertEpi& e, float g, float u, int64_t i, int64_t inter) {
  if (e.b13 != nullptr) {
    g = __fadd_rn(g, e.b13[i]);
    u = __fadd_rn(u, e.b13[inter + i]);
  }
  const float lim = e.limit;
  if (lim < __int_as_float(0x7f800000)) {
    g = lim < g ? lim : g;
    u = u < -lim ? -lim : (lim < u ? lim : u);
  }
  if (e.kind == 1) return __fmul_rn(__fadd_rn(u, 1.0f), __fdiv_rn(g, __fadd_rn(1.0f, expf(__fmul_rn(-e.alpha, g)))));
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

/// y of output column n before its bf16 rounding: + b2[n] in fp32 when the expert has b2.
__device__ __forceinline__ float expert_out_bias(const ExpertEpi& e, float y, int64_t n) {
  return e.b2 != nullptr ? __fadd_rn(y, e.b2[n]) : y;
}

}  // namespace epx::experts_cuda
