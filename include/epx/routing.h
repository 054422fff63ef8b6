// epx/routing.h: routers that turn router logits [T, E] into topk_idx [T, K] and topk_weights [T, K].
#pragma once

#include "epx/tensor.h"

namespace epx {

enum class ScoringFunc : uint8_t {
  softmax,  ///< Mixtral, Qwen-MoE: p = softmax(logits); top-k of p
  sigmoid,  ///< DeepSeek-V3 "noaux_tc": s = sigmoid(logits)
};

struct RouterConfig {
  int num_experts = 0;                 ///< E
  int top_k = 0;                       ///< K, 1 <= K <= E
  ScoringFunc scoring = ScoringFunc::softmax;
  /// softmax: divide the top-k probabilities by their sum (Mixtral, Qwen3 norm_topk_prob=True).
  /// sigmoid: divide the selected unbiased scores by their sum (DeepSeek norm_topk_prob=True).
  bool renormalize = false;
  /// Group-limited selection (DeepSeek-V3: n_group=8, topk_group=4). Experts are split into n_group
  /// contiguous groups; a group's score is the sum of its top-2 biased scores; only the topk_group
  /// best groups are eligible. n_group=1 disables it.
  int n_group = 1;
  int topk_group = 1;
  /// Multiplies the final weights (DeepSeek-V3: 2.5).
  float routed_scaling_factor = 1.0f;
  /// sigmoid only: e_score_correction_bias [E] fp32 is added to scores for *selection only*;
  /// weights come from the unbiased scores (DeepSeek-V3 modeling_deepseek.py MoEGate, topk_method="noaux_tc").
  bool use_correction_bias = false;
};

/// Routes T tokens.
///   logits          [T, E] fp32 or bf16 (router output, before any activation)
///   correction_bias [E] fp32, used only when cfg.use_correction_bias (else may be an empty view)
///   topk_idx        [T, K] int32 or int64 (written); sorted by descending selection score
///   topk_weights    [T, K] fp32 (written)
/// Ties: the lower expert id wins (deterministic on every device).
/// All tensors on one device (CPU here; CUDA when built with EPX_CUDA). `stream` is ignored on CPU.
/// Throws InvalidArgument on shape/dtype/config errors (e.g. E % n_group != 0, topk_group > n_group,
/// K > topk_group * E / n_group).
void route(const RouterConfig& cfg, const TensorView& logits, const TensorView& correction_bias,
           const TensorView& topk_idx, const TensorView& topk_weights, Stream stream = {});

/// Validates cfg alone (the checks route() starts with). Throws InvalidArgument.
void validate_router_config(const RouterConfig& cfg);

}  // namespace epx
