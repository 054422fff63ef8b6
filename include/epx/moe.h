// epx/moe.h: model configurations (presets), MoE layer weights, ModularMoE and the no-EP reference.
//
// ModularMoE (vLLM modular-kernel shape):  router -> prepare (quantize + dispatch) -> experts ->
// finalize (combine), plus the shared expert, either separate (computed on the local tokens and
// added) or fused (FHMoE: appended as route id E with weight 1.0, or the shared gate value where the
// model has one, so the routed launch processes K+1 columns). The capability gate fuses when the
// chunk's M = max over ranks of tokens <= Config::fhmoe_max_tokens (max, so every rank decides alike).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epx/config.h"
#include "epx/dispatch.h"
#include "epx/experts.h"
#include "epx/group.h"
#include "epx/routing.h"

namespace epx {

/// One MoE layer's shape and router, from a model's public config.json.
struct MoEConfig {
  std::string name;
  int64_t hidden = 0;               ///< H (hidden_size)
  int64_t intermediate = 0;         ///< I (moe_intermediate_size)
  RouterConfig router;              ///< num_experts, top_k, scoring, groups, scaling
  int num_shared_experts = 0;       ///< 0 or 1 here (DeepSeek n_shared_experts=1 -> width I)
  int64_t shared_intermediate = 0;  ///< width of the shared expert MLP
  bool shared_gate = false;         ///< Qwen2-MoE/Qwen1.5-MoE: shared output scaled by sigmoid(x . g)
  WeightFormat routed_format = WeightFormat::bf16;
  WeightFormat shared_format = WeightFormat::bf16;
};

/// deepseek-v3, deepseek-v4-pro, qwen3-30b-a3b, mixtral-8x7b, qwen1.5-moe-a2.7b, and each with "-mini".
std::vector<std::string> preset_names();
/// Throws InvalidArgument listing the known presets.
MoEConfig preset(const std::string& name);

/// All weights of one MoE layer (global: every expert). CPU-resident.
struct MoEWeights {
  MoEConfig config;
  Tensor router_weight;                 ///< [E, H] fp32 (mlp.gate.weight)
  Tensor correction_bias;               ///< [E] fp32 (e_score_correction_bias) when the router uses it
  std::vector<std::shared_ptr<const ExpertWeights>> experts;  ///< [E]
  std::shared_ptr<const ExpertWeights> shared;                ///< null without a shared expert
  Tensor shared_gate_weight;            ///< [H] fp32 when config.shared_gate

  /// Deterministic random weights from `seed`. Expert e depends only on (seed, e), so every rank
  /// can build just its own experts (`only_experts` = [begin, end); default all).
  static std::shared_ptr<MoEWeights> random(const MoEConfig& cfg, uint64_t seed, int expert_begin = 0, int expert_end = -1);
  /// Builds experts[e] for every e in `expert_ids` still null, exactly as random(config, seed) does
  /// (in parallel; ids outside [0, E) throw InvalidArgument). For a rank that validates a few tokens
  /// against the reference and needs some other ranks' experts too.
  void add_random_experts(uint64_t seed, const std::vector<int>& expert_ids);
};

enum class SharedExpertMode : uint8_t { separate, fused, auto_gate };

struct PathCounters {
  std::string backend;
  int64_t calls = 0;            ///< forward calls
  int64_t chunks = 0;           ///< prepare/finalize rounds (DP chunks), idle ones included
  int64_t idle_chunks = 0;      ///< chunks in which this rank had 0 tokens
  int64_t shared_fused = 0;     ///< chunks whose shared expert ran fused (FHMoE)
  int64_t shared_separate = 0;  ///< chunks whose shared expert ran separately
};

struct ModularMoEOptions {
  SharedExpertMode shared_mode = SharedExpertMode::auto_gate;
  int chunk_size = 0;           ///< DP chunk (tokens per call per rank); 0 = Config::moe_chunk_size / unchunked
  int fhmoe_max_tokens = -1;    ///< -1 = Config::fhmoe_max_tokens
};

/// The EP MoE layer on one rank.
class ModularMoE {
 public:
  /// `weights` must hold at least this rank's local experts (and the shared expert if any).
  /// `backend` is a name from backend_names(); dispatch_cfg.hidden/num_experts/top_k are filled
  /// from the model. Collective (creates the backend).
  ModularMoE(std::shared_ptr<const MoEWeights> weights, std::shared_ptr<Group> group, const std::string& backend,
             DispatchConfig dispatch_cfg, const Config& config, ModularMoEOptions options = {});
  ~ModularMoE();

  /// x [T, H] bf16 -> out [T, H] bf16, routing with the layer's router. Collective.
  void forward(const TensorView& x, const TensorView& out, Stream stream = {});
  /// Same with given routing: topk_idx [T, K] int32/int64, topk_weights [T, K] fp32 (e.g. from a trace).
  void forward_routed(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                      const TensorView& out, Stream stream = {});
  const PathCounters& counters() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Router logits [T, E] fp32 = x [T, H] (bf16) . router_weight^T, fp32 accumulation.
void router_logits_cpu(const MoEWeights& w, const TensorView& x, const TensorView& logits);

/// Single-rank, no-EP reference of the whole layer on CPU:
///   out[t] = round_bf16( sum_k w[t,k] * expert_{idx[t,k]}(x~[t]) + g(t) * shared(x~s[t]) )
/// with expert outputs bf16-rounded, the sum in fp32 in column order, one final rounding.
/// x~ = x, or x quantized to FP8 1x128 and back when dispatch_dtype is fp8 (as the wire does);
/// x~s = x~ when the shared expert is fused, else x. g = 1, or sigmoid(x . shared_gate) for Qwen.
struct ReferenceOptions {
  DType dispatch_dtype = DType::bf16;
  bool use_ue8m0 = false;
  bool shared_fused = false;
};
void moe_reference_cpu(const MoEWeights& w, const TensorView& x, const TensorView& topk_idx,
                       const TensorView& topk_weights, const TensorView& out, const ReferenceOptions& opt = {});

}  // namespace epx
