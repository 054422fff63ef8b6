// routing/routing_cpu.cpp: the CPU router (the reference every device router must match bit for bit
// in its selection, see routing.h).
//
// Two recipes, both with one deterministic order "higher score first, then lower id":
//   softmax (Mixtral modeling_mixtral.py, Qwen2/3-MoE modeling_qwen*_moe.py):
//     p = softmax(logits) in fp32; topk_idx = top-K of p; weights = p (or p / sum of the top-K
//     when renormalize, HF norm_topk_prob=True); times routed_scaling_factor (1 for these models).
//   sigmoid "noaux_tc" (DeepSeek-V3 modeling_deepseek.py MoEGate):
//     s = sigmoid(logits); b = s + e_score_correction_bias (selection only);
//     group score = sum of the top-2 b in each of n_group contiguous groups; keep topk_group groups;
//     topk_idx = top-K of b among the kept groups' experts (the other groups at -inf, DeepSeek's
//     reference code; transformers fills them with 0.0, which differs only when the kept groups hold
//     fewer than K positive b: docs/checkpoint.md, routing_test's GroupMasking cases);
//     weights = s of the selected (unbiased), / their sum when renormalize, * routed_scaling_factor.
// Group-limited selection applies the same way to softmax probabilities when n_group > 1.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "epx/error.h"
#include "epx/routing.h"

#ifdef EPX_WITH_CUDA
#include "routing/routing_cuda.h"
#endif

namespace epx {
namespace {

constexpr const char* kOp = "route";

// NaN scores sort below every number, so a NaN logit can never win over a real one and the order
// stays a strict weak ordering (std::sort is undefined otherwise).
inline float order_key(float v) { return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v; }

// "a before b": higher key first, then the lower id (the deterministic tie rule of routing.h).
inline bool ranks_before(float key_a, int id_a, float key_b, int id_b) {
  return key_a > key_b || (key_a == key_b && id_a < id_b);
}

float load_logit(const TensorView& logits, int64_t t, int64_t e) {
  const int64_t off = t * logits.strides[0] + e * logits.strides[1];
  if (logits.dtype == DType::fp32) return logits.ptr<float>()[off];
  return bf16_bits_to_float(logits.ptr<uint16_t>()[off]);
}

// Per-thread scratch of one token's routing (sized E).
struct Scratch {
  std::vector<float> score;      // s or p: what the weights come from
  std::vector<float> select;     // b: what selection ranks (s + bias, or p)
  std::vector<float> group_score;
  std::vector<int> order;        // candidate ids
  std::vector<char> eligible;    // per expert: in a kept group
};

// Writes token t's K selections into idx_out/w_out (already ordered by selection score).
void route_token(const RouterConfig& cfg, const TensorView& logits, const float* bias, int64_t t, Scratch& s,
                 int* idx_out, float* w_out) {
  const int E = cfg.num_experts, K = cfg.top_k;
  for (int e = 0; e < E; ++e) s.score[e] = load_logit(logits, t, e);
  if (cfg.scoring == ScoringFunc::softmax) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int e = 0; e < E; ++e) mx = std::max(mx, s.score[e]);
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) {
      s.score[e] = std::exp(s.score[e] - mx);
      sum += s.score[e];
    }
    const float inv = 1.0f / sum;
    for (int e = 0; e < E; ++e) {
      s.score[e] *= inv;
      s.select[e] = s.score[e];
    }
  } else {
    for (int e = 0; e < E; ++e) {
      s.score[e] = 1.0f / (1.0f + std::exp(-s.score[e]));
      s.select[e] = s.score[e] + (bias ? bias[e] : 0.0f);
    }
  }

  // Group-limited selection: keep the topk_group groups with the best sum of their top-2 scores.
  const int G = cfg.n_group;
  const int per_group = E / G;
  if (G > 1 && cfg.topk_group < G) {
    const int top_n = std::min(2, per_group);
    for (int g = 0; g < G; ++g) {
      float best[2] = {-std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
      for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
        const float v = order_key(s.select[e]);
        if (v > best[0]) {
          best[1] = best[0];
          best[0] = v;
        } else if (v > best[1]) {
          best[1] = v;
        }
      }
      s.group_score[g] = top_n == 2 ? best[0] + best[1] : best[0];
    }
    s.order.resize(G);
    for (int g = 0; g < G; ++g) s.order[g] = g;
    std::partial_sort(s.order.begin(), s.order.begin() + cfg.topk_group, s.order.end(), [&](int a, int b) {
      return ranks_before(order_key(s.group_score[a]), a, order_key(s.group_score[b]), b);
    });
    std::fill(s.eligible.begin(), s.eligible.end(), 0);
    for (int i = 0; i < cfg.topk_group; ++i) {
      const int g = s.order[i];
      std::fill(s.eligible.begin() + g * per_group, s.eligible.begin() + (g + 1) * per_group, 1);
    }
    s.order.clear();
    for (int e = 0; e < E; ++e)
      if (s.eligible[e]) s.order.push_back(e);
  } else {
    s.order.resize(E);
    for (int e = 0; e < E; ++e) s.order[e] = e;
  }

  std::partial_sort(s.order.begin(), s.order.begin() + K, s.order.end(), [&](int a, int b) {
    return ranks_before(order_key(s.select[a]), a, order_key(s.select[b]), b);
  });
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) sum += s.score[s.order[k]];
  // DeepSeek adds 1e-20 to the denominator; it only matters when every selected score is 0.
  const float norm = cfg.renormalize ? 1.0f / (sum + 1e-20f) : 1.0f;
  for (int k = 0; k < K; ++k) {
    idx_out[k] = s.order[k];
    w_out[k] = s.score[s.order[k]] * norm * cfg.routed_scaling_factor;
  }
}

}  // namespace

void validate_router_config(const RouterConfig& cfg) {
  const char* op = "route.config";
  require_arg(op, "num_experts", cfg.num_experts, cfg.num_experts >= 1, "must be >= 1");
  require_arg(op, "top_k", cfg.top_k, cfg.top_k >= 1 && cfg.top_k <= cfg.num_experts,
              "must be in [1, num_experts = " + std::to_string(cfg.num_experts) + "]");
  require_arg(op, "n_group", cfg.n_group, cfg.n_group >= 1 && cfg.num_experts % cfg.n_group == 0,
              "must be >= 1 and divide num_experts = " + std::to_string(cfg.num_experts));
  require_arg(op, "topk_group", cfg.topk_group, cfg.topk_group >= 1 && cfg.topk_group <= cfg.n_group,
              "must be in [1, n_group = " + std::to_string(cfg.n_group) + "]");
  const int eligible = cfg.topk_group * (cfg.num_experts / cfg.n_group);
  require_arg(op, "top_k", cfg.top_k, cfg.top_k <= eligible,
              "must be <= topk_group * num_experts / n_group = " + std::to_string(eligible) +
                  " (experts left after group selection)");
  require_arg(op, "routed_scaling_factor", cfg.routed_scaling_factor,
              std::isfinite(cfg.routed_scaling_factor) && cfg.routed_scaling_factor > 0.0f, "must be finite and > 0");
  require_arg(op, "use_correction_bias", cfg.use_correction_bias,
              !cfg.use_correction_bias || cfg.scoring == ScoringFunc::sigmoid,
              "needs scoring = sigmoid (e_score_correction_bias belongs to DeepSeek noaux_tc)");
}

void route(const RouterConfig& cfg, const TensorView& logits, const TensorView& correction_bias,
           const TensorView& topk_idx, const TensorView& topk_weights, Stream stream) {
  validate_router_config(cfg);
  const int E = cfg.num_experts, K = cfg.top_k;
  check_dtype(kOp, "logits", logits, {DType::fp32, DType::bf16});
  check_shape(kOp, "logits", logits, {-1, E});
  const int64_t T = logits.shape[0];
  check_dtype(kOp, "topk_idx", topk_idx, {DType::int32, DType::int64});
  check_shape(kOp, "topk_idx", topk_idx, {T, K});
  check_dtype(kOp, "topk_weights", topk_weights, {DType::fp32});
  check_shape(kOp, "topk_weights", topk_weights, {T, K});
  if (cfg.use_correction_bias) {
    check_dtype(kOp, "correction_bias", correction_bias, {DType::fp32});
    check_shape(kOp, "correction_bias", correction_bias, {E});
  }
  // One device for all; CUDA tensors go to the CUDA twin (routing_cuda.h) when it is built.
  const std::pair<const char*, const TensorView*> tensors[] = {
      {"topk_idx", &topk_idx}, {"topk_weights", &topk_weights}, {"correction_bias", &correction_bias}};
  check_data(kOp, "logits", logits);
  for (const auto& [name, t] : tensors) {
    if (t == &correction_bias && !cfg.use_correction_bias) continue;
    check_device(kOp, name, *t, logits.device);
    check_data(kOp, name, *t);
  }
  if (logits.device.is_cuda()) {
#ifdef EPX_WITH_CUDA
    routing::route_cuda(cfg, logits, correction_bias, topk_idx, topk_weights, stream);
    return;
#else
    throw Unsupported(arg_message(kOp, "logits.device", logits.device.str(),
                                  "this build routes on the CPU only (configure with EPX_CUDA=ON for the CUDA router)"));
#endif
  }

  std::vector<float> bias;
  if (cfg.use_correction_bias) {
    bias.resize(E);
    for (int e = 0; e < E; ++e) bias[e] = correction_bias.ptr<float>()[e * correction_bias.strides[0]];
  }
  Scratch s;
  s.score.resize(E);
  s.select.resize(E);
  s.group_score.resize(cfg.n_group);
  s.eligible.resize(E);
  s.order.reserve(E);
  std::vector<int> idx(K);
  std::vector<float> w(K);
  for (int64_t t = 0; t < T; ++t) {
    route_token(cfg, logits, bias.empty() ? nullptr : bias.data(), t, s, idx.data(), w.data());
    for (int k = 0; k < K; ++k) {
      const int64_t io = t * topk_idx.strides[0] + k * topk_idx.strides[1];
      if (topk_idx.dtype == DType::int32) topk_idx.ptr<int32_t>()[io] = idx[k];
      else topk_idx.ptr<int64_t>()[io] = idx[k];
      topk_weights.ptr<float>()[t * topk_weights.strides[0] + k * topk_weights.strides[1]] = w[k];
    }
  }
}

}  // namespace epx
