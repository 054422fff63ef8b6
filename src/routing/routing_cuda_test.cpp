// routing/routing_cuda_test.cpp: the CUDA router against the CPU router (routing_cpu.cpp) on fresh
// random logits. Indices must be equal; the only tolerated difference is a selection between two
// candidates whose scores lie within float rounding of each other (exp() rounds differently on the
// two sides, routing_cuda.h), and those are counted and must stay rare. Weights: 1e-6 relative.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/routing.h"
#include "test_util.h"

#ifdef EPX_WITH_CUDA
#include "routing/routing_cuda.h"
#endif

namespace epx {
namespace {

#ifdef EPX_WITH_CUDA

struct Case {
  std::string name;
  RouterConfig cfg;
  int64_t T;
  DType logit_dtype;
  DType idx_dtype;
  bool ties;           // logits drawn from a few values, so exact ties are everywhere
  int64_t col_stride;  // logits [T, E] read with stride (non-contiguous) when > 1
};

RouterConfig softmax(int E, int K, bool renorm) {
  RouterConfig c;
  c.num_experts = E;
  c.top_k = K;
  c.scoring = ScoringFunc::softmax;
  c.renormalize = renorm;
  return c;
}
RouterConfig noaux_tc(int E, int K, int n_group, int topk_group, float scale, bool bias) {
  RouterConfig c;
  c.num_experts = E;
  c.top_k = K;
  c.scoring = ScoringFunc::sigmoid;
  c.renormalize = true;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.routed_scaling_factor = scale;
  c.use_correction_bias = bias;
  return c;
}

/// Selection values in double (softmax p, or sigmoid + bias) and group scores, to judge near-ties.
struct Exact {
  std::vector<double> select, group;
};
Exact exact_scores(const RouterConfig& cfg, const float* logits, const float* bias) {
  const int E = cfg.num_experts;
  Exact x;
  x.select.resize(E);
  if (cfg.scoring == ScoringFunc::softmax) {
    double mx = -INFINITY, sum = 0;
    for (int e = 0; e < E; ++e) mx = std::max(mx, static_cast<double>(logits[e]));
    for (int e = 0; e < E; ++e) sum += std::exp(logits[e] - mx);
    for (int e = 0; e < E; ++e) x.select[e] = std::exp(logits[e] - mx) / sum;
  } else {
    for (int e = 0; e < E; ++e) x.select[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[e]))) + (bias ? bias[e] : 0.0);
  }
  const int G = cfg.n_group, per = E / G;
  x.group.assign(G, 0.0);
  for (int g = 0; g < G; ++g) {
    std::vector<double> v(x.select.begin() + g * per, x.select.begin() + (g + 1) * per);
    std::sort(v.rbegin(), v.rend());
    x.group[g] = v[0] + (per >= 2 ? v[1] : 0.0);
  }
  return x;
}

bool near(double a, double b) { return std::fabs(a - b) <= 1e-6 * std::max({std::fabs(a), std::fabs(b), 1e-30}); }

void run_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.name);
  const RouterConfig& cfg = c.cfg;
  const int E = cfg.num_experts, K = cfg.top_k;
  const int64_t T = c.T;
  std::mt19937_64 g(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  // Host logits as fp32 values that are exactly representable in the tested dtype.
  std::vector<float> lf(static_cast<size_t>(T * E));
  for (auto& v : lf) {
    v = c.ties ? static_cast<float>(static_cast<int>(g() % 5) - 2) * 0.5f : normal(g);
    if (c.logit_dtype == DType::bf16) v = round_bf16(v);
  }
  std::vector<float> bias(E);
  for (auto& b : bias) b = c.ties ? 0.0f : normal(g) * 0.05f;

  const int64_t cs = std::max<int64_t>(1, c.col_stride);
  Tensor lg_cpu = Tensor::empty({T, E}, c.logit_dtype);
  Tensor lg_wide = Tensor::empty({T, E * cs}, c.logit_dtype);  // the device copy's storage (strided view)
  for (int64_t i = 0; i < T * E; ++i) {
    const int64_t t = i / E, e = i % E, w = t * E * cs + e * cs;
    if (c.logit_dtype == DType::fp32) {
      lg_cpu.ptr<float>()[i] = lf[i];
      lg_wide.ptr<float>()[w] = lf[i];
    } else {
      lg_cpu.ptr<uint16_t>()[i] = float_to_bf16_bits(lf[i]);
      lg_wide.ptr<uint16_t>()[w] = float_to_bf16_bits(lf[i]);
    }
  }
  Tensor bias_cpu = Tensor::empty({E}, DType::fp32);
  std::copy(bias.begin(), bias.end(), bias_cpu.ptr<float>());

  Tensor idx_ref = Tensor::empty({T, K}, c.idx_dtype), w_ref = Tensor::empty({T, K}, DType::fp32);
  route(cfg, lg_cpu, cfg.use_correction_bias ? bias_cpu.view() : TensorView(), idx_ref, w_ref);

  const Device dev = Device::cuda(0);
  const Tensor lg_dev_storage = lg_wide.to(dev);
  TensorView lg_dev = lg_dev_storage.view();
  lg_dev.shape[1] = E;
  lg_dev.strides[1] = cs;
  const Tensor bias_dev = bias_cpu.to(dev);
  Tensor idx = Tensor::empty({T, K}, c.idx_dtype, dev), w = Tensor::empty({T, K}, DType::fp32, dev);
  device_allocator(DeviceKind::cuda)->memset(idx.data(), 0xFF, idx.nbytes());
  device_allocator(DeviceKind::cuda)->memset(w.data(), 0xFF, w.nbytes());
  routing::route_cuda(cfg, lg_dev, cfg.use_correction_bias ? bias_dev.view() : TensorView(), idx, w, {});
  const Tensor idx_h = idx.to(Device::cpu()), w_h = w.to(Device::cpu());

  auto id_at = [&](const Tensor& t, int64_t i) -> int64_t {
    return c.idx_dtype == DType::int32 ? t.ptr<int32_t>()[i] : t.ptr<int64_t>()[i];
  };
  int64_t near_ties = 0, hard_mismatch = 0, bad_weights = 0, exact_weights = 0;
  for (int64_t t = 0; t < T; ++t) {
    bool same = true;
    for (int k = 0; k < K; ++k) same = same && id_at(idx_h, t * K + k) == id_at(idx_ref, t * K + k);
    if (!same) {
      const Exact x = exact_scores(cfg, lf.data() + t * E, cfg.use_correction_bias ? bias.data() : nullptr);
      const int per = E / cfg.n_group;
      bool tie = false;
      for (int k = 0; k < K && !tie; ++k) {
        const int64_t a = id_at(idx_h, t * K + k), b = id_at(idx_ref, t * K + k);
        if (a == b) continue;
        if (a < 0 || a >= E) break;
        tie = near(x.select[a], x.select[b]) || near(x.group[a / per], x.group[b / per]);
        break;
      }
      if (tie) ++near_ties;
      else if (++hard_mismatch <= 5) {
        std::string m = "token " + std::to_string(t) + ": cuda [";
        for (int k = 0; k < K; ++k) m += std::to_string(id_at(idx_h, t * K + k)) + " ";
        m += "] cpu [";
        for (int k = 0; k < K; ++k) m += std::to_string(id_at(idx_ref, t * K + k)) + " ";
        ADD_FAILURE() << m << "]";
      }
      continue;
    }
    for (int k = 0; k < K; ++k) {
      const float a = w_h.ptr<float>()[t * K + k], b = w_ref.ptr<float>()[t * K + k];
      exact_weights += a == b;
      if (!(std::fabs(a - b) <= 1e-6f * std::fabs(b))) {
        if (++bad_weights <= 5) ADD_FAILURE() << "token " << t << " k " << k << ": weight " << a << " vs cpu " << b;
      }
    }
  }
  EXPECT_EQ(hard_mismatch, 0);
  EXPECT_EQ(bad_weights, 0);
  EXPECT_LE(near_ties, std::max<int64_t>(1, T / 500)) << "near-tie selection differences should be rare";
  std::printf("  %-34s T=%-5lld near-ties %lld, weights bit-equal %lld/%lld\n", c.name.c_str(),
              static_cast<long long>(T), static_cast<long long>(near_ties), static_cast<long long>(exact_weights),
              static_cast<long long>(T * K));
}

TEST(RoutingCuda, MatchesCpuRouter) {
  const int gpus = cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus;
  cuda::ensure_runtime();
  const Case cases[] = {
      {"mixtral softmax E8 K2 renorm", softmax(8, 2, true), 1000, DType::bf16, DType::int32, false, 1},
      {"qwen3 softmax E128 K8 renorm", softmax(128, 8, true), 2000, DType::fp32, DType::int64, false, 1},
      {"softmax E64 K6 no renorm", softmax(64, 6, false), 777, DType::fp32, DType::int32, false, 3},
      {"softmax E64 K6 ties", softmax(64, 6, true), 500, DType::fp32, DType::int32, true, 1},
      {"deepseek-v3 noaux_tc E256 K8 g8/4", noaux_tc(256, 8, 8, 4, 2.5f, true), 2000, DType::fp32, DType::int64, false, 1},
      {"deepseek-v3 noaux_tc bf16 int32", noaux_tc(256, 8, 8, 4, 2.5f, true), 1000, DType::bf16, DType::int32, false, 1},
      {"noaux_tc ties", noaux_tc(256, 8, 8, 4, 2.5f, true), 500, DType::fp32, DType::int32, true, 1},
      {"kimi-k2 sigmoid E384 K8 g1", noaux_tc(384, 8, 1, 1, 2.827f, true), 1000, DType::fp32, DType::int32, false, 1},
      {"sigmoid E16 one expert per group", noaux_tc(16, 4, 16, 6, 1.0f, true), 600, DType::fp32, DType::int32, false, 2},
      {"sigmoid E72 K72 (all experts)", noaux_tc(72, 72, 1, 1, 1.0f, false), 100, DType::fp32, DType::int32, false, 1},
      {"one token", softmax(32, 4, true), 1, DType::fp32, DType::int32, false, 1},
  };
  uint64_t seed = 4242;
  for (const Case& c : cases) run_case(c, seed++);
}

TEST(RoutingCuda, PublicRouteTakesCudaTensors) {
  const int gpus = cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus;
  const Device dev = Device::cuda(0);
  const RouterConfig cfg = noaux_tc(256, 8, 8, 4, 2.5f, true);
  const Tensor logits = test::random_f32(300, 256, /*seed=*/99);
  const Tensor bias = test::random_f32(1, 256, /*seed=*/100, 0.05f);
  TensorView bias_view = bias.view();
  bias_view.ndim = 1;
  bias_view.shape[0] = 256;
  bias_view.strides[0] = 1;
  Tensor idx_ref = Tensor::empty({300, 8}, DType::int64), w_ref = Tensor::empty({300, 8}, DType::fp32);
  route(cfg, logits, bias_view, idx_ref, w_ref);
  const Tensor ld = logits.to(dev), bd = bias.to(dev);
  TensorView bd_view = bd.view();
  bd_view.ndim = 1;
  bd_view.shape[0] = 256;
  bd_view.strides[0] = 1;
  Tensor idx = Tensor::empty({300, 8}, DType::int64, dev), w = Tensor::empty({300, 8}, DType::fp32, dev);
  route(cfg, ld, bd_view, idx, w);  // epx/routing.h hands CUDA tensors to routing_cuda.h
  const Tensor ih = idx.to(Device::cpu()), wh = w.to(Device::cpu());
  int64_t same_idx = 0;
  for (int64_t i = 0; i < 300 * 8; ++i) {
    same_idx += ih.ptr<int64_t>()[i] == idx_ref.ptr<int64_t>()[i];
    EXPECT_NEAR(wh.ptr<float>()[i], w_ref.ptr<float>()[i], 1e-6f * std::fabs(w_ref.ptr<float>()[i])) << i;
  }
  EXPECT_EQ(same_idx, 300 * 8);
}

TEST(RoutingCuda, EmptyBatchAndBadArguments) {
  const int gpus = cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus;
  const Device dev = Device::cuda(0);
  const RouterConfig cfg = softmax(16, 4, true);
  Tensor lg = Tensor::empty({0, 16}, DType::fp32, dev);
  Tensor idx = Tensor::empty({0, 4}, DType::int32, dev), w = Tensor::empty({0, 4}, DType::fp32, dev);
  EXPECT_NO_THROW(routing::route_cuda(cfg, lg, {}, idx, w, {}));
  Tensor lg2 = Tensor::empty({3, 16}, DType::fp32, dev);
  Tensor idx2 = Tensor::empty({3, 5}, DType::int32, dev), w2 = Tensor::empty({3, 4}, DType::fp32, dev);
  EXPECT_THROW(routing::route_cuda(cfg, lg2, {}, idx2, w2, {}), InvalidArgument);
  RouterConfig bad = noaux_tc(30, 4, 4, 2, 1.0f, false);  // 30 % 4 != 0
  EXPECT_THROW(routing::route_cuda(bad, lg2, {}, idx2, w2, {}), InvalidArgument);
}

#else

TEST(RoutingCuda, SkippedInCpuOnlyBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }

#endif

}  // namespace
}  // namespace epx
