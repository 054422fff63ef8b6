// experts/expert_activation_test.cpp: the expert activations and biases on the CPU experts
// (gpt-oss's clamped SwiGLU with gate_up / down biases, DeepSeek-V4's clamped SiLU), each against
// the formula written out here element by element in double, with the rounding points of
// epx/experts.h; slices of an expert with biases summing to it; make_experts_cuda naming a bad bias
// or activation before any device work (the CUDA results: experts_cuda_test).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/experts.h"
#include "epx/quant.h"
#include "test_util.h"

namespace epx {
namespace {

Tensor random_vec(int64_t n, uint64_t seed, float scale) {
  Tensor t = test::random_f32(1, n, seed, scale);
  Tensor v = Tensor::empty({n}, DType::fp32);
  std::memcpy(v.data(), t.data(), static_cast<size_t>(n) * 4);
  return v;
}

/// An expert with random bf16 weights, biases and `act`.
std::shared_ptr<ExpertWeights> biased_expert(int64_t H, int64_t I, uint64_t seed, const ExpertActivation& act, bool biases = true) {
  auto w = ExpertWeights::random(WeightFormat::bf16, H, I, seed);
  w->activation = act;
  if (biases) {
    w->b13 = random_vec(2 * I, seed + 1, 0.5f);
    w->b2 = random_vec(H, seed + 2, 0.25f);
  }
  return w;
}

/// y = expert(x) from the formula of epx/experts.h, in double, h and y rounded to bf16 where the
/// header says. `clamped` counts the gate and up values the limit changed.
std::vector<float> formula(const ExpertWeights& w, const std::vector<float>& x, int64_t M, int64_t* clamped) {
  const int64_t H = w.hidden, I = w.intermediate;
  const float* w13 = w.w13_f32();
  const float* w2 = w.w2_f32();
  const ExpertActivation& a = w.activation;
  std::vector<float> y(static_cast<size_t>(M * H));
  std::vector<float> h(static_cast<size_t>(I));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t i = 0; i < I; ++i) {
      double g = 0, u = 0;
      for (int64_t k = 0; k < H; ++k) {
        g += static_cast<double>(x[m * H + k]) * w13[i * H + k];
        u += static_cast<double>(x[m * H + k]) * w13[(I + i) * H + k];
      }
      if (w.b13.defined()) {
        g += w.b13.ptr<const float>()[i];
        u += w.b13.ptr<const float>()[I + i];
      }
      if (std::isfinite(a.limit)) {
        if (g > a.limit || std::abs(u) > a.limit) ++*clamped;
        g = std::min<double>(g, a.limit);
        u = std::clamp<double>(u, -a.limit, a.limit);
      }
      const double v = a.kind == ExpertActivation::Kind::gpt_oss_glu ? (u + 1.0) * g / (1.0 + std::exp(-a.alpha * g))
                                                                      : g / (1.0 + std::exp(-g)) * u;
      h[i] = round_bf16(static_cast<float>(v));
    }
    for (int64_t o = 0; o < H; ++o) {
      double s = w.b2.defined() ? w.b2.ptr<const float>()[o] : 0.0;
      for (int64_t i = 0; i < I; ++i) s += static_cast<double>(h[i]) * w2[o * I + i];
      y[m * H + o] = round_bf16(static_cast<float>(s));
    }
  }
  return y;
}

double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double e = 0, n = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    e += std::pow(static_cast<double>(got[i]) - want[i], 2);
    n += std::pow(static_cast<double>(want[i]), 2);
  }
  return std::sqrt(e / n);
}

/// Elements of `got` more than one bf16 ulp (of the larger magnitude) from `want`. sgemm's fp32 sums
/// and the formula's double ones may round h to neighbouring bf16 values, so a few may differ more.
int64_t beyond_one_ulp(const std::vector<float>& got, const std::vector<float>& want) {
  int64_t n = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float mag = std::max(std::abs(got[i]), std::abs(want[i]));
    const float ulp = mag > 0 ? std::ldexp(1.0f, std::ilogb(mag) - 7) : 0.0f;
    if (std::abs(got[i] - want[i]) > ulp) ++n;
  }
  return n;
}

std::vector<float> inputs(int64_t M, int64_t H, uint64_t seed, float scale) {
  Tensor t = test::random_bf16(M, H, seed, scale);
  std::vector<float> x(static_cast<size_t>(M * H));
  for (int64_t i = 0; i < M * H; ++i) x[i] = bf16_bits_to_float(t.ptr<const uint16_t>()[i]);
  return x;
}

TEST(ExpertActivation, GptOssClampedSwigluWithBiasesIsTheFormula) {
  const int64_t H = 64, I = 48, M = 40;
  const auto w = biased_expert(H, I, 7, ExpertActivation::gpt_oss(1.702f, 7.0f));
  // x scaled so that |gate|, |up| reach past the limit 7 (weights ~ N(0, 1/H): gate ~ N(0, scale^2)).
  const std::vector<float> x = inputs(M, H, 3, 6.0f);
  std::vector<float> y(static_cast<size_t>(M * H));
  expert_mlp_cpu(*w, x.data(), M, y.data());
  int64_t clamped = 0;
  const std::vector<float> want = formula(*w, x, M, &clamped);
  EXPECT_GT(clamped, M * I / 20) << "the inputs must drive gate/up past the limit for the clamp to be tested";
  EXPECT_LE(beyond_one_ulp(y, want), M * H / 200);
  EXPECT_LT(rel_l2(y, want), 2e-3);
  // The same expert with the plain SwiGLU is far from it: the activation is really applied.
  auto plain = std::make_shared<ExpertWeights>();
  plain->format = w->format;
  plain->hidden = H;
  plain->intermediate = I;
  plain->w13 = w->w13;
  plain->w2 = w->w2;
  plain->b13 = w->b13;
  plain->b2 = w->b2;
  std::vector<float> y_plain(y.size());
  expert_mlp_cpu(*plain, x.data(), M, y_plain.data());
  EXPECT_GT(beyond_one_ulp(y_plain, want), M * H / 2);
}

TEST(ExpertActivation, BiasesAreAddedAndOnlyThere) {
  const int64_t H = 32, I = 16, M = 9;
  const auto w = biased_expert(H, I, 11, ExpertActivation::silu());
  auto nob = biased_expert(H, I, 11, ExpertActivation::silu(), false);
  const std::vector<float> x = inputs(M, H, 5, 1.0f);
  std::vector<float> y(static_cast<size_t>(M * H)), y0(y.size());
  expert_mlp_cpu(*w, x.data(), M, y.data());
  expert_mlp_cpu(*nob, x.data(), M, y0.data());
  int64_t clamped = 0;
  EXPECT_LE(beyond_one_ulp(y, formula(*w, x, M, &clamped)), M * H / 200);
  EXPECT_LE(beyond_one_ulp(y0, formula(*nob, x, M, &clamped)), M * H / 200);
  EXPECT_GT(beyond_one_ulp(y, y0), M * H / 2);
}

TEST(ExpertActivation, DeepSeekV4ClampedSiluIsTheFormula) {
  const int64_t H = 64, I = 32, M = 24;
  ExpertActivation a;
  a.limit = 3.0f;  // small, so the clamp bites at this input scale
  const auto w = biased_expert(H, I, 13, a, false);
  const std::vector<float> x = inputs(M, H, 9, 4.0f);
  std::vector<float> y(static_cast<size_t>(M * H));
  expert_mlp_cpu(*w, x.data(), M, y.data());
  int64_t clamped = 0;
  EXPECT_LE(beyond_one_ulp(y, formula(*w, x, M, &clamped)), M * H / 200);
  EXPECT_GT(clamped, 0);
  EXPECT_EQ(expert_activation_name(a), "silu_glu(limit=3)");
  EXPECT_EQ(expert_activation_name(ExpertActivation::gpt_oss()), "gpt_oss_glu(alpha=1.702, limit=7)");
}

TEST(ExpertActivation, SlicesOfABiasedExpertSumToIt) {
  const int64_t H = 32, I = 64, M = 6;
  const auto w = biased_expert(H, I, 17, ExpertActivation::gpt_oss());
  const auto s0 = w->slice_intermediate(0, 24), s1 = w->slice_intermediate(24, 64);
  EXPECT_EQ(s0->activation, w->activation);
  EXPECT_TRUE(s0->b2.defined());
  EXPECT_FALSE(s1->b2.defined()) << "b2 belongs to one slice only, so the slices sum to the expert";
  ASSERT_TRUE(s1->b13.defined());
  EXPECT_EQ(s1->b13.ptr<const float>()[0], w->b13.ptr<const float>()[24]);
  EXPECT_EQ(s1->b13.ptr<const float>()[40], w->b13.ptr<const float>()[I + 24]);
  const std::vector<float> x = inputs(M, H, 21, 3.0f);
  std::vector<float> y(static_cast<size_t>(M * H)), a(y.size()), b(y.size());
  expert_mlp_cpu(*w, x.data(), M, y.data());
  expert_mlp_cpu(*s0, x.data(), M, a.data());
  expert_mlp_cpu(*s1, x.data(), M, b.data());
  double err = 0, norm = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    err += std::pow(a[i] + b[i] - y[i], 2);
    norm += std::pow(y[i], 2);
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-2);  // three bf16 roundings apart
}

TEST(ExpertActivation, BadBiasOrActivationIsNamed) {
  auto w = biased_expert(32, 16, 23, ExpertActivation::gpt_oss());
  w->b13 = Tensor::empty({16}, DType::fp32);
  std::vector<float> x(32), y(32);
  std::string msg = test::invalid_argument_message([&] { expert_mlp_cpu(*w, x.data(), 1, y.data()); });
  EXPECT_NE(msg.find("w.b13"), std::string::npos) << msg;
  w = biased_expert(32, 16, 23, ExpertActivation::gpt_oss(1.702f, std::numeric_limits<float>::infinity()));
  msg = test::invalid_argument_message([&] { make_experts_cpu({w}); });
  EXPECT_NE(msg.find("local_experts[0].activation.limit"), std::string::npos) << msg;
}

TEST(ExpertActivation, CudaExpertsCheckBiasesByNameBeforeDeviceWork) {
  // make_experts_cuda computes biases and activations (experts_cuda_test: against these CPU experts) and checks
  // them as the CPU experts do, before any device work, so this runs without a GPU (a CPU-only build refuses
  // every call with Unsupported).
  auto plain = ExpertWeights::random(WeightFormat::bf16, 32, 16, 1);
  auto short_b13 = biased_expert(32, 16, 2, ExpertActivation::silu());
  short_b13->b13 = Tensor::empty({16}, DType::fp32);
  auto no_limit = biased_expert(32, 16, 3, ExpertActivation::gpt_oss(1.702f, std::numeric_limits<float>::infinity()), false);
  for (const auto& [w, name] : {std::pair{short_b13, std::string("local_experts[1].b13")},
                                std::pair{no_limit, std::string("local_experts[1].activation.limit")}}) {
#ifdef EPX_WITH_CUDA
    const std::string msg = test::invalid_argument_message([&] { make_experts_cuda({plain, w}, 0); });
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
#else
    EXPECT_THROW(make_experts_cuda({plain, w}, 0), Unsupported);
#endif
  }
}

}  // namespace
}  // namespace epx
