// moe/moe_internal.h: helpers shared by the layer (modular_moe.cpp) and its reference
// (reference_cpu.cpp), so both compute the shared gate and the wire's FP8 round trip identically.
#pragma once

#include <cstdint>
#include <string_view>

#include "epx/moe.h"

namespace epx::moe_detail {

/// Shared expert scale of token row x [H] (bf16 bits): sigmoid(x . shared_gate_weight) for models
/// with a shared gate (Qwen2-MoE: sigmoid(shared_expert_gate(x))), else 1. Dot product in fp32,
/// element order, so the layer and the reference get the same float.
float shared_gate_value(const MoEWeights& w, const uint16_t* x_row);

/// rows [n, H] bf16 bits -> dst [n, H] fp32 (exact).
void bf16_to_float(const uint16_t* src, int64_t count, float* dst);

/// In place: quantize one row [H] to FP8 e4m3 1x128 and back (what fp8 dispatch delivers).
void fp8_round_trip_row(float* row, int64_t hidden, bool ue8m0);

/// Reads topk_idx element i (int32 or int64, contiguous).
inline int64_t load_index(const TensorView& idx, int64_t i) {
  return idx.dtype == DType::int32 ? idx.ptr<const int32_t>()[i] : idx.ptr<const int64_t>()[i];
}

/// Checks routing [T, K] (ids in [-1, E), fp32 weights, contiguous CPU) for `op`. Throws
/// InvalidArgument naming the first bad element, e.g. "op: topk_idx[3, 1] = 64: must be -1 (no
/// selection) or an expert id in [0, num_experts = 64)" (core/topk_message.h, as the dispatch says it).
void check_routing(std::string_view op, const TensorView& topk_idx, const TensorView& topk_weights, int64_t num_tokens,
                   int num_experts);

}  // namespace epx::moe_detail
