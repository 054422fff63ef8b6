// Tests of the CPU router against hand-computed cases and an independent brute-force model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "epx/error.h"
#include "epx/routing.h"
#include "test_util.h"

using namespace epx;

namespace {

struct Routed {
  std::vector<int64_t> idx;
  std::vector<float> w;
};

Routed run(const RouterConfig& cfg, const std::vector<float>& logits, const std::vector<float>& bias = {},
           DType idx_dtype = DType::int32, DType logit_dtype = DType::fp32) {
  const int64_t E = cfg.num_experts, T = static_cast<int64_t>(logits.size()) / E;
  Tensor lg = Tensor::empty({T, E}, logit_dtype);
  for (int64_t i = 0; i < T * E; ++i) {
    if (logit_dtype == DType::fp32) lg.ptr<float>()[i] = logits[i];
    else lg.ptr<uint16_t>()[i] = float_to_bf16_bits(logits[i]);
  }
  Tensor b;
  if (!bias.empty()) {
    b = Tensor::empty({E}, DType::fp32);
    std::copy(bias.begin(), bias.end(), b.ptr<float>());
  }
  Tensor idx = Tensor::empty({T, cfg.top_k}, idx_dtype);
  Tensor w = Tensor::empty({T, cfg.top_k}, DType::fp32);
  route(cfg, lg, b.view(), idx, w);
  Routed r;
  for (int64_t i = 0; i < T * cfg.top_k; ++i) {
    r.idx.push_back(idx_dtype == DType::int32 ? idx.ptr<int32_t>()[i] : idx.ptr<int64_t>()[i]);
    r.w.push_back(w.ptr<float>()[i]);
  }
  return r;
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

RouterConfig softmax_cfg(int E, int K, bool renorm) {
  RouterConfig c;
  c.num_experts = E;
  c.top_k = K;
  c.scoring = ScoringFunc::softmax;
  c.renormalize = renorm;
  return c;
}

RouterConfig sigmoid_cfg(int E, int K, int n_group, int topk_group, float scale, bool bias) {
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

}  // namespace

TEST(RouteSoftmax, HandComputedWithAndWithoutRenormalisation) {
  // p = softmax([1, 2, 3, 0]); top-2 = {2, 1}.
  const std::vector<float> logits = {1, 2, 3, 0};
  double z = std::exp(0.0) + std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  Routed r = run(softmax_cfg(4, 2, false), logits);
  EXPECT_EQ(r.idx, (std::vector<int64_t>{2, 1}));
  EXPECT_NEAR(r.w[0], std::exp(3.0) / z, 1e-6);
  EXPECT_NEAR(r.w[1], std::exp(2.0) / z, 1e-6);
  // Mixtral / Qwen3 norm_topk_prob: divide by the sum of the selected -> 1/(1+e^-1), 1/(1+e).
  Routed n = run(softmax_cfg(4, 2, true), logits);
  EXPECT_EQ(n.idx, (std::vector<int64_t>{2, 1}));
  EXPECT_NEAR(n.w[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(n.w[1], 1.0 / (1.0 + std::exp(1.0)), 1e-6);
}

TEST(RouteSoftmax, TiesGoToTheLowerExpertId) {
  Routed r = run(softmax_cfg(4, 2, false), {1, 1, 1, 1, /*token 1*/ 0, 3, 0, 3});
  EXPECT_EQ(r.idx, (std::vector<int64_t>{0, 1, 1, 3}));
  EXPECT_NEAR(r.w[0], 0.25, 1e-7);
  EXPECT_NEAR(r.w[1], 0.25, 1e-7);
  EXPECT_FLOAT_EQ(r.w[2], r.w[3]);
  Routed all = run(softmax_cfg(4, 4, true), {2, 2, 2, 2});
  EXPECT_EQ(all.idx, (std::vector<int64_t>{0, 1, 2, 3}));
}

TEST(RouteSoftmax, Bf16LogitsAndInt64IndicesAgreeWithFp32) {
  std::mt19937 g(3);
  std::normal_distribution<float> n;
  std::vector<float> logits(7 * 16);
  for (float& v : logits) v = round_bf16(n(g));  // exactly representable in both dtypes
  RouterConfig c = softmax_cfg(16, 4, true);
  Routed a = run(c, logits);
  Routed b = run(c, logits, {}, DType::int64, DType::bf16);
  EXPECT_EQ(a.idx, b.idx);
  EXPECT_EQ(a.w, b.w);
}

TEST(RouteSoftmax, NanLogitNeverWins) {
  Routed r = run(softmax_cfg(3, 1, true), {NAN, 0.0f, 1.0f});
  // softmax of a row holding a NaN is NaN everywhere (as in torch); the ids must still be valid.
  EXPECT_GE(r.idx[0], 0);
  EXPECT_LT(r.idx[0], 3);
  RouterConfig s = sigmoid_cfg(3, 1, 1, 1, 1.0f, false);
  Routed q = run(s, {NAN, 0.0f, 1.0f});
  EXPECT_EQ(q.idx[0], 2);
}

TEST(RouteSigmoid, GroupLimitExcludesTheBestExpertOfAWeakGroup) {
  // 8 experts in 4 groups of 2; group score = sum of its top-2 sigmoid scores:
  //   g0 {5, -5} -> 1.000   g1 {1, 1} -> 1.462   g2 {0.5, 0.5} -> 1.245   g3 {-1, -1} -> 0.538
  // topk_group = 2 keeps g1 and g2, so expert 0 (the single best score, 0.993) is excluded.
  const std::vector<float> logits = {5, -5, 1, 1, 0.5f, 0.5f, -1, -1};
  Routed r = run(sigmoid_cfg(8, 2, 4, 2, 2.5f, false), logits);
  EXPECT_EQ(r.idx, (std::vector<int64_t>{2, 3}));  // tie between 2 and 3: lower id first
  EXPECT_NEAR(r.w[0], 1.25, 1e-6);                 // renormalised (0.5 each) times 2.5
  EXPECT_NEAR(r.w[1], 1.25, 1e-6);
  // Without the group limit, expert 0 wins.
  Routed free = run(sigmoid_cfg(8, 2, 1, 1, 2.5f, false), logits);
  EXPECT_EQ(free.idx, (std::vector<int64_t>{0, 2}));
  EXPECT_NEAR(free.w[0], 2.5 * sigmoid(5) / (sigmoid(5) + sigmoid(1)), 1e-6);
}

TEST(RouteSigmoid, GroupTiesGoToTheLowerGroupId) {
  // Groups 0..3 all score alike; topk_group = 1 keeps group 0, so experts {0, 1} are chosen
  // although expert 7 equals them.
  Routed r = run(sigmoid_cfg(8, 2, 4, 1, 1.0f, false), {1, 0, 0, 1, 1, 0, 0, 1});
  EXPECT_EQ(r.idx, (std::vector<int64_t>{0, 1}));
}

TEST(RouteSigmoid, BiasChangesSelectionButNotWeights) {
  // s = sigmoid([1, 0, 0, 0]); b = s + [0, 0.5, 0, 0] -> expert 1 is selected (1.0 > 0.731);
  // its weight is its unbiased score 0.5 (no renormalisation), not 1.0.
  RouterConfig c = sigmoid_cfg(4, 1, 1, 1, 1.0f, true);
  c.renormalize = false;
  Routed r = run(c, {1, 0, 0, 0}, {0.0f, 0.5f, 0.0f, 0.0f});
  EXPECT_EQ(r.idx[0], 1);
  EXPECT_FLOAT_EQ(r.w[0], 0.5f);
  // K = 2 with renormalisation: weights are s1/(s1+s0) and s0/(s1+s0), scaled by 2.5.
  RouterConfig c2 = sigmoid_cfg(4, 2, 1, 1, 2.5f, true);
  Routed r2 = run(c2, {1, 0, 0, 0}, {0.0f, 0.5f, 0.0f, 0.0f});
  EXPECT_EQ(r2.idx, (std::vector<int64_t>{1, 0}));
  const float s0 = sigmoid(1), s1 = 0.5f;
  EXPECT_NEAR(r2.w[0], 2.5 * s1 / (s0 + s1), 1e-6);
  EXPECT_NEAR(r2.w[1], 2.5 * s0 / (s0 + s1), 1e-6);
  // The bias is ignored when use_correction_bias is off.
  Routed off = run(sigmoid_cfg(4, 1, 1, 1, 1.0f, false), {1, 0, 0, 0});
  EXPECT_EQ(off.idx[0], 0);
}

// Independent model of noaux_tc in double precision with full sorts, for random inputs.
TEST(RouteSigmoid, MatchesBruteForceOnRandomDeepSeekShapes) {
  const int E = 64, K = 6, G = 8, TG = 3, T = 200;
  RouterConfig c = sigmoid_cfg(E, K, G, TG, 2.5f, true);
  std::mt19937 gen(11);
  std::normal_distribution<float> n;
  std::vector<float> logits(T * E), bias(E);
  for (float& v : logits) v = n(gen);
  for (float& v : bias) v = 0.1f * n(gen);
  Routed r = run(c, logits, bias);
  for (int t = 0; t < T; ++t) {
    std::vector<double> s(E), b(E);
    for (int e = 0; e < E; ++e) {
      s[e] = sigmoid(logits[t * E + e]);
      b[e] = static_cast<float>(s[e]) + bias[e];
    }
    std::vector<std::pair<double, int>> groups;
    for (int g = 0; g < G; ++g) {
      std::vector<double> v(b.begin() + g * (E / G), b.begin() + (g + 1) * (E / G));
      std::sort(v.rbegin(), v.rend());
      groups.push_back({-(v[0] + v[1]), g});
    }
    std::sort(groups.begin(), groups.end());
    std::vector<std::pair<double, int>> cand;
    for (int i = 0; i < TG; ++i)
      for (int e = groups[i].second * (E / G); e < (groups[i].second + 1) * (E / G); ++e) cand.push_back({-b[e], e});
    std::sort(cand.begin(), cand.end());
    double sum = 0;
    for (int k = 0; k < K; ++k) sum += s[cand[k].second];
    for (int k = 0; k < K; ++k) {
      ASSERT_EQ(r.idx[t * K + k], cand[k].second) << "token " << t << " column " << k;
      EXPECT_NEAR(r.w[t * K + k], 2.5 * s[cand[k].second] / sum, 1e-5);
    }
  }
}

namespace {

/// transformers' DeepseekV3MoE.route_tokens_to_experts (modeling_deepseek_v3.py), in double: the groups outside
/// the topk_group best are masked with 0.0 (`scores_for_choice.masked_fill(~score_mask.bool(), 0.0)`), then the
/// top-K of all E is taken (ties: the lower id, as torch.topk's order is unspecified). DeepSeek's reference code
/// (inference/model.py Gate) masks them with -inf, which is what epx's router does. Returns the selected ids,
/// sorted ascending (transformers' topk runs with sorted=False), and writes whether the kept groups held
/// fewer than K candidates with a positive selection score.
std::vector<int64_t> transformers_noaux_tc(const RouterConfig& c, const float* logits, const std::vector<float>& bias,
                                           bool* few_positive) {
  const int E = c.num_experts, G = c.n_group, per = E / G;
  std::vector<double> b(E);
  for (int e = 0; e < E; ++e) b[e] = static_cast<double>(1.0f / (1.0f + std::exp(-logits[e])) + bias[e]);
  std::vector<std::pair<double, int>> groups;
  for (int g = 0; g < G; ++g) {
    std::vector<double> v(b.begin() + g * per, b.begin() + (g + 1) * per);
    std::sort(v.rbegin(), v.rend());
    groups.push_back({-(v[0] + v[1]), g});
  }
  std::sort(groups.begin(), groups.end());
  std::vector<char> kept(E, 0);
  for (int i = 0; i < c.topk_group; ++i) std::fill(kept.begin() + groups[i].second * per, kept.begin() + (groups[i].second + 1) * per, 1);
  int positive = 0;
  std::vector<std::pair<double, int>> cand;
  for (int e = 0; e < E; ++e) {
    positive += kept[e] && b[e] > 0;
    cand.push_back({-(kept[e] ? b[e] : 0.0), e});
  }
  *few_positive = positive < c.top_k;
  std::sort(cand.begin(), cand.end());
  std::vector<int64_t> ids;
  for (int k = 0; k < c.top_k; ++k) ids.push_back(cand[k].second);
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<int64_t> sorted_row(const Routed& r, int t, int K) {
  std::vector<int64_t> v(r.idx.begin() + t * K, r.idx.begin() + (t + 1) * K);
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

// epx's group masking is DeepSeek's reference code's (dropped groups at -inf: only kept experts are chosen);
// transformers fills 0.0, so a dropped expert outranks a kept one whose biased score is negative. Constructed:
// 8 experts in 4 groups of 2, topk_group 2, K 4; biased scores g0 {0.5, -0.2}, g1 {0.4, -0.3}, g2 and g3 lower.
// The kept groups g0, g1 hold only 2 < K positive candidates: epx takes all four kept experts, transformers
// experts 0 and 2 and then two of the dropped ones (score 0.0 > -0.2). At K = 2 the kept groups hold enough
// positive candidates and the two agree.
TEST(RouteSigmoid, GroupMaskingIsDeepSeeksMinusInfinityNotTransformersZero) {
  const int E = 8;
  const std::vector<float> target = {0.5f, -0.2f, 0.4f, -0.3f, -0.5f, -0.6f, -0.7f, -0.8f};
  // All logits 0 (sigmoid 0.5): the bias alone sets the biased score b = 0.5 + bias.
  std::vector<float> logits(E, 0.0f), bias(E);
  for (int e = 0; e < E; ++e) bias[e] = target[e] - 0.5f;
  RouterConfig c = sigmoid_cfg(E, 4, 4, 2, 1.0f, true);
  Routed r = run(c, logits, bias);
  EXPECT_EQ(r.idx, (std::vector<int64_t>{0, 2, 1, 3}));  // every kept expert, by biased score
  bool few = false;
  const std::vector<int64_t> hf = transformers_noaux_tc(c, logits.data(), bias, &few);
  EXPECT_TRUE(few);
  EXPECT_EQ(hf, (std::vector<int64_t>{0, 2, 4, 5}));  // two dropped experts (0.0 beats -0.2 and -0.3)
  EXPECT_NE(sorted_row(r, 0, 4), hf);
  // The weights stay the unbiased scores of epx's choice (0.5 each, renormalized over 4).
  for (float w : r.w) EXPECT_FLOAT_EQ(w, 0.25f);

  // K = 2: the kept groups hold 2 positive candidates, enough; both pick {0, 2}.
  RouterConfig c2 = sigmoid_cfg(E, 2, 4, 2, 1.0f, true);
  Routed r2 = run(c2, logits, bias);
  EXPECT_EQ(transformers_noaux_tc(c2, logits.data(), bias, &few), sorted_row(r2, 0, 2));
  EXPECT_FALSE(few);
}

// On random DeepSeek-shaped data the two maskings route identically (every kept biased score is positive); with
// biases pushed negative (about -0.75), the tokens where they differ are exactly those whose kept groups hold fewer than K
// positive candidates.
TEST(RouteSigmoid, GroupMaskingDiffersFromTransformersOnlyWithFewerThanTopKPositiveCandidates) {
  const int E = 64, K = 6, G = 8, TG = 3, T = 2000;
  const RouterConfig c = sigmoid_cfg(E, K, G, TG, 2.5f, true);
  for (const bool negative : {false, true}) {
    SCOPED_TRACE(negative ? "biases around -0.75" : "DeepSeek-like biases (0.1 N(0, 1))");
    std::mt19937 gen(negative ? 23 : 21);
    std::normal_distribution<float> n;
    std::vector<float> logits(T * E), bias(E);
    for (float& v : logits) v = n(gen);
    for (float& v : bias) v = negative ? -0.75f + 0.05f * n(gen) : 0.1f * n(gen);
    Routed r = run(c, logits, bias);
    int differ = 0, few_count = 0;
    for (int t = 0; t < T; ++t) {
      bool few = false;
      const bool same = transformers_noaux_tc(c, logits.data() + t * E, bias, &few) == sorted_row(r, t, K);
      ASSERT_EQ(!same, few) << "token " << t;  // they differ exactly when the kept groups lack K positive candidates
      differ += !same;
      few_count += few;
    }
    if (negative) {
      EXPECT_GT(differ, T / 20);  // the case does occur, and is told apart
      EXPECT_LT(differ, T);
    } else {
      EXPECT_EQ(differ, 0);
    }
    RecordProperty(negative ? "differ_negative_bias" : "differ_deepseek_like", differ);
  }
}

TEST(Route, ZeroTokensIsANoOp) {
  Routed r = run(softmax_cfg(8, 2, true), {});
  EXPECT_TRUE(r.idx.empty());
}

TEST(Route, BadConfigsThrowInvalidArgument) {
  auto bad = [](RouterConfig c) { EXPECT_THROW(validate_router_config(c), InvalidArgument); };
  bad(softmax_cfg(0, 1, true));
  bad(softmax_cfg(8, 0, true));
  bad(softmax_cfg(8, 9, true));
  bad(sigmoid_cfg(10, 2, 4, 2, 1.0f, false));   // 10 % 4 != 0
  bad(sigmoid_cfg(8, 2, 4, 5, 1.0f, false));    // topk_group > n_group
  bad(sigmoid_cfg(8, 2, 4, 0, 1.0f, false));    // topk_group < 1
  bad(sigmoid_cfg(8, 5, 4, 2, 1.0f, false));    // K = 5 > 2 groups x 2 experts
  bad(sigmoid_cfg(8, 2, 1, 1, 0.0f, false));    // scaling must be > 0
  bad(sigmoid_cfg(8, 2, 1, 1, NAN, false));
  RouterConfig sb = softmax_cfg(8, 2, true);
  sb.use_correction_bias = true;                // bias belongs to sigmoid noaux_tc
  bad(sb);
  try {
    validate_router_config(sigmoid_cfg(8, 5, 4, 2, 1.0f, false));
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("top_k = 5"), std::string::npos) << e.what();
  }
}

TEST(Route, BadTensorsThrow) {
  RouterConfig c = softmax_cfg(4, 2, true);
  Tensor lg = Tensor::zeros({3, 4}, DType::fp32);
  Tensor idx = Tensor::empty({3, 2}, DType::int32), w = Tensor::empty({3, 2}, DType::fp32);
  Tensor idx_bad = Tensor::empty({3, 3}, DType::int32), w16 = Tensor::empty({3, 2}, DType::bf16);
  Tensor lg_bad = Tensor::zeros({3, 5}, DType::fp32), lg_i = Tensor::zeros({3, 4}, DType::int32);
  EXPECT_NO_THROW(route(c, lg, {}, idx, w));
  EXPECT_THROW(route(c, lg, {}, idx_bad, w), InvalidArgument);
  EXPECT_THROW(route(c, lg, {}, idx, w16), InvalidArgument);
  EXPECT_THROW(route(c, lg_bad, {}, idx, w), InvalidArgument);
  EXPECT_THROW(route(c, lg_i, {}, idx, w), InvalidArgument);
  RouterConfig s = sigmoid_cfg(4, 2, 1, 1, 1.0f, true);
  EXPECT_THROW(route(s, lg, {}, idx, w), InvalidArgument);  // bias missing
  // Null data with a non-empty shape (an unset pointer): named, never read (this segfaulted).
  const TensorView lg_null(nullptr, DType::fp32, {3, 4}), idx_null(nullptr, DType::int32, {3, 2});
  EXPECT_NE(test::invalid_argument_message([&] { route(c, lg_null, {}, idx, w); }).find("route: logits.data = null"), std::string::npos);
  EXPECT_NE(test::invalid_argument_message([&] { route(c, lg, {}, idx_null, w); }).find("route: topk_idx.data = null"), std::string::npos);
  const TensorView bias_null(nullptr, DType::fp32, {4});
  EXPECT_NE(test::invalid_argument_message([&] { route(s, lg, bias_null, idx, w); }).find("route: correction_bias.data = null"),
            std::string::npos);
}

#ifndef EPX_WITH_CUDA
TEST(Route, CudaTensorsAreUnsupportedInACpuBuild) {
  RouterConfig c = softmax_cfg(4, 2, true);
  float dummy[12] = {};
  int32_t di[6];
  float dw[6];
  TensorView lg(dummy, DType::fp32, {3, 4}, Device::cuda(0));
  TensorView idx(di, DType::int32, {3, 2}, Device::cuda(0)), w(dw, DType::fp32, {3, 2}, Device::cuda(0));
  EXPECT_THROW(route(c, lg, {}, idx, w), Unsupported);
  TensorView idx_cpu(di, DType::int32, {3, 2});  // mixed devices are the caller's error
  EXPECT_THROW(route(c, lg, {}, idx_cpu, w), InvalidArgument);
}
#endif
