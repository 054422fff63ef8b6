// moe/weights.cpp: deterministic random weights of one MoE layer (MoEWeights::random).
//
// Every tensor is drawn from its own stream key derived from (seed, tag, index), so expert e's
// weights depend only on (seed, e): ranks of an EP group build only their own range and still
// agree with the single-rank reference. Scales (inputs x ~ N(0, 1) per element):
//   router_weight [E, H] ~ N(0, 1/H): logits ~ N(0, 1), spread enough that softmax/sigmoid top-k
//                 picks different experts per token (non-degenerate routing) without saturating;
//   correction_bias [E] ~ U(-0.05, 0.05): comparable to the spread of sigmoid scores near 0.5
//                 (slope 1/4 x logit std 1), so it changes some selections, as a trained bias does;
//   shared_gate_weight [H] ~ N(0, 1/H): sigmoid(x . g) spans roughly (0.1, 0.9);
//   experts: ExpertWeights::random, N(0, 1/fan_in), quantized into the config's formats.
#include <algorithm>
#include <cmath>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "epx/error.h"
#include "epx/moe.h"

namespace epx {
namespace {

constexpr const char* kOp = "MoEWeights::random";

// Stream tags keep the tensors of one seed independent of each other.
enum : uint64_t { kTagRouter = 1, kTagBias = 2, kTagExpert = 3, kTagShared = 4, kTagSharedGate = 5 };

/// splitmix64 (Steele, Lea, Flood 2014): element i of a stream depends only on (key, i), so the
/// values are the same whatever the thread count or the standard library.
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t stream_key(uint64_t seed, uint64_t tag, uint64_t index = 0) {
  return splitmix64(splitmix64(seed ^ splitmix64(tag)) ^ splitmix64(index + 0x51ed27ull));
}

/// Uniform in [0, 1) from draw i of stream `key` (24-bit mantissa).
float uniform01(uint64_t key, uint64_t i) {
  return static_cast<float>(splitmix64(key ^ splitmix64(i)) >> 40) * (1.0f / 16777216.0f);
}

/// dst[0, n) ~ N(0, stddev^2) by Box-Muller.
void fill_normal(float* dst, int64_t n, uint64_t key, float stddev) {
  constexpr float kTwoPi = 6.283185307179586f;
  for (int64_t i = 0; i < n; ++i) {
    const float u1 = uniform01(key, 2 * static_cast<uint64_t>(i)) + 0.5f / 16777216.0f;  // (0, 1)
    const float u2 = uniform01(key, 2 * static_cast<uint64_t>(i) + 1);
    dst[i] = stddev * std::sqrt(-2.0f * std::log(u1)) * std::cos(kTwoPi * u2);
  }
}

void validate_moe_config(const MoEConfig& c) {
  require_arg(kOp, "config.hidden", c.hidden, c.hidden > 0, "must be > 0");
  require_arg(kOp, "config.intermediate", c.intermediate, c.intermediate > 0, "must be > 0");
  validate_router_config(c.router);
  require_arg(kOp, "config.num_shared_experts", c.num_shared_experts,
              c.num_shared_experts == 0 || c.num_shared_experts == 1, "must be 0 or 1");
  if (c.num_shared_experts == 1)
    require_arg(kOp, "config.shared_intermediate", c.shared_intermediate, c.shared_intermediate > 0,
                "must be > 0 with a shared expert");
  require_arg(kOp, "config.shared_gate", c.shared_gate, !c.shared_gate || c.num_shared_experts == 1,
              "needs a shared expert (num_shared_experts = 1)");
}

}  // namespace

std::shared_ptr<MoEWeights> MoEWeights::random(const MoEConfig& cfg, uint64_t seed, int expert_begin, int expert_end,
                                               int expert_pool) {
  validate_moe_config(cfg);
  const int E = cfg.router.num_experts;
  require_arg(kOp, "expert_pool", expert_pool, expert_pool >= 0 && expert_pool <= E,
              "must be in [0, num_experts = " + std::to_string(E) + "] (0 = every expert distinct)");
  const int64_t H = cfg.hidden;
  if (expert_end < 0) expert_end = E;
  require_arg(kOp, "expert_begin", expert_begin, expert_begin >= 0 && expert_begin <= E,
              "must be in [0, num_experts = " + std::to_string(E) + "]");
  require_arg(kOp, "expert_end", expert_end, expert_end >= expert_begin && expert_end <= E,
              "must be in [expert_begin = " + std::to_string(expert_begin) + ", num_experts = " + std::to_string(E) + "]");

  auto w = std::make_shared<MoEWeights>();
  w->config = cfg;
  w->expert_pool = expert_pool;
  w->router_weight = Tensor::empty({E, H}, DType::fp32);
  fill_normal(w->router_weight.ptr<float>(), E * H, stream_key(seed, kTagRouter), 1.0f / std::sqrt(static_cast<float>(H)));
  if (cfg.router.use_correction_bias) {
    w->correction_bias = Tensor::empty({E}, DType::fp32);
    const uint64_t key = stream_key(seed, kTagBias);
    for (int e = 0; e < E; ++e) w->correction_bias.ptr<float>()[e] = 0.1f * uniform01(key, e) - 0.05f;
  }

  w->experts.assign(E, nullptr);
  std::vector<int> ids;
  for (int e = expert_begin; e < expert_end; ++e) ids.push_back(e);
  w->add_random_experts(seed, ids);

  if (cfg.num_shared_experts == 1) {
    w->shared = ExpertWeights::random(cfg.shared_format, H, cfg.shared_intermediate, stream_key(seed, kTagShared));
    if (cfg.shared_gate) {
      w->shared_gate_weight = Tensor::empty({H}, DType::fp32);
      fill_normal(w->shared_gate_weight.ptr<float>(), H, stream_key(seed, kTagSharedGate),
                  1.0f / std::sqrt(static_cast<float>(H)));
    }
  }
  return w;
}

void MoEWeights::add_random_experts(uint64_t seed, const std::vector<int>& expert_ids) {
  const MoEConfig& cfg = config;
  const int E = cfg.router.num_experts;
  if (experts.size() != static_cast<size_t>(E)) experts.resize(static_cast<size_t>(E));
  require_arg("MoEWeights::add_random_experts", "expert_pool", expert_pool, expert_pool >= 0 && expert_pool <= E,
              "must be in [0, num_experts = " + std::to_string(E) + "] (0 = every expert distinct)");
  // Pool key of expert e: e itself, or e mod P. An expert whose key is already built (here or by
  // an earlier call) shares that object; each missing key is built once.
  const auto key_of = [&](int e) { return expert_pool > 0 ? e % expert_pool : e; };
  std::vector<std::shared_ptr<const ExpertWeights>> by_key(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e)
    if (experts[e] && !by_key[key_of(e)]) by_key[key_of(e)] = experts[e];
  std::vector<int> wanted, todo;  // todo: keys to build
  for (int e : expert_ids) {
    require_arg("MoEWeights::add_random_experts", "expert id", e, e >= 0 && e < E, "must be in [0, num_experts = " + std::to_string(E) + ")");
    if (experts[e]) continue;
    wanted.push_back(e);
    const int k = key_of(e);
    if (!by_key[k] && std::find(todo.begin(), todo.end(), k) == todo.end()) todo.push_back(k);
  }
  if (wanted.empty()) return;
  // Experts are independent, so they are built in parallel (full-size presets hold 10^8..10^9 values).
  if (todo.empty()) {
    for (int e : wanted) experts[e] = by_key[key_of(e)];
    return;
  }
  const int num_threads = std::clamp<int>(static_cast<int>(std::thread::hardware_concurrency()), 1, static_cast<int>(todo.size()));
  std::vector<std::exception_ptr> errors(num_threads);
  std::vector<std::shared_ptr<const ExpertWeights>> built(todo.size());
  auto build = [&](int tid) {
    try {
      for (size_t i = static_cast<size_t>(tid); i < todo.size(); i += static_cast<size_t>(num_threads))
        built[i] = ExpertWeights::random(cfg.routed_format, cfg.hidden, cfg.intermediate, stream_key(seed, kTagExpert, todo[i]));
    } catch (...) {
      errors[tid] = std::current_exception();
    }
  };
  if (num_threads == 1) {
    build(0);
  } else {
    std::vector<std::thread> threads;
    for (int t = 0; t < num_threads; ++t) threads.emplace_back(build, t);
    for (auto& th : threads) th.join();
  }
  for (const auto& err : errors)
    if (err) std::rethrow_exception(err);
  for (size_t i = 0; i < todo.size(); ++i) by_key[todo[i]] = built[i];
  for (int e : wanted) experts[e] = by_key[key_of(e)];
}

}  // namespace epx
