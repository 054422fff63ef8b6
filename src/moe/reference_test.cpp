// Tests of MoEWeights::random, router_logits_cpu and moe_reference_cpu against a per-token model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "epx/error.h"
#include "epx/moe.h"
#include "epx/quant.h"
#include "test_util.h"

using namespace epx;

namespace {

// Per-token, per-column model of the layer, written without grouping: the reference must match it.
// The shared expert sees the same x~ as the routed ones on both paths; separate, it is added to the
// routed sum rounded to bf16 (the layer's finalized rows).
Tensor naive_layer(const MoEWeights& w, const Tensor& x, const Tensor& idx, const Tensor& wts, DType dispatch,
                   bool shared_fused) {
  const int64_t T = x.size(0), H = w.config.hidden, K = idx.size(1);
  Tensor out = Tensor::empty({T, H}, DType::bf16);
  std::vector<float> xr(H), xs(H), y(H), acc(H);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) xr[h] = xs[h] = bf16_bits_to_float(x.ptr<uint16_t>()[t * H + h]);
    if (dispatch == DType::fp8_e4m3) {
      std::vector<uint8_t> q(H);
      std::vector<float> s(H / 128);
      quantize_fp8_row(xr.data(), H, q.data(), s.data(), 128, false);
      dequantize_fp8_row(q.data(), s.data(), H, xr.data(), 128);
      xs = xr;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const int e = idx.ptr<int32_t>()[t * K + k];
      if (e < 0) continue;
      expert_mlp_cpu(*w.experts[e], xr.data(), 1, y.data());
      for (int64_t h = 0; h < H; ++h) acc[h] += wts.ptr<float>()[t * K + k] * y[h];
    }
    if (w.shared) {
      float g = 1.0f;
      if (w.config.shared_gate) {
        float dot = 0;
        for (int64_t h = 0; h < H; ++h) dot += bf16_bits_to_float(x.ptr<uint16_t>()[t * H + h]) * w.shared_gate_weight.ptr<float>()[h];
        g = 1.0f / (1.0f + std::exp(-dot));
      }
      expert_mlp_cpu(*w.shared, xs.data(), 1, y.data());
      if (!shared_fused)
        for (int64_t h = 0; h < H; ++h) acc[h] = bf16_bits_to_float(float_to_bf16_bits(acc[h]));
      for (int64_t h = 0; h < H; ++h) acc[h] += g * y[h];
    }
    for (int64_t h = 0; h < H; ++h) out.ptr<uint16_t>()[t * H + h] = float_to_bf16_bits(acc[h]);
  }
  return out;
}

// The preset with E cut to `num_experts` (groups kept valid): same formats and shared expert, but
// cheap to build (a full deepseek-v3-mini is 256 FP8 experts, seconds of setup).
MoEConfig shrink(MoEConfig c, int num_experts) {
  c.router.num_experts = num_experts;
  c.router.top_k = std::min(c.router.top_k, num_experts);
  if (num_experts % c.router.n_group != 0) c.router.n_group = c.router.topk_group = 1;
  return c;
}

Tensor reference(const MoEWeights& w, const Tensor& x, const Tensor& idx, const Tensor& wts, ReferenceOptions opt = {}) {
  Tensor out = Tensor::empty({x.size(0), w.config.hidden}, DType::bf16);
  test::poison(out);
  moe_reference_cpu(w, x, idx, wts, out, opt);
  return out;
}

}  // namespace

TEST(MoEWeights, ExpertDependsOnlyOnSeedAndIndex) {
  const MoEConfig cfg = preset("deepseek-v3-mini");
  auto all = MoEWeights::random(cfg, 7, 0, 8);
  auto part = MoEWeights::random(cfg, 7, 3, 6);
  ASSERT_EQ(part->experts.size(), 256u);
  EXPECT_EQ(part->experts[2], nullptr);
  EXPECT_EQ(part->experts[6], nullptr);
  for (int e = 3; e < 6; ++e) {
    ASSERT_NE(part->experts[e], nullptr);
    EXPECT_EQ(std::memcmp(all->experts[e]->w13.data(), part->experts[e]->w13.data(), all->experts[e]->w13.nbytes()), 0);
    EXPECT_EQ(std::memcmp(all->experts[e]->w2.data(), part->experts[e]->w2.data(), all->experts[e]->w2.nbytes()), 0);
  }
  EXPECT_NE(std::memcmp(all->experts[3]->w13.data(), all->experts[4]->w13.data(), all->experts[3]->w13.nbytes()), 0);
  EXPECT_EQ(std::memcmp(all->router_weight.data(), part->router_weight.data(), all->router_weight.nbytes()), 0);
  EXPECT_EQ(std::memcmp(all->correction_bias.data(), part->correction_bias.data(), all->correction_bias.nbytes()), 0);
  EXPECT_EQ(all->experts[0]->format, WeightFormat::fp8_block);
  ASSERT_NE(all->shared, nullptr);
  EXPECT_EQ(all->shared->intermediate, 128);
  auto other = MoEWeights::random(cfg, 8, 3, 4);
  EXPECT_NE(std::memcmp(all->experts[3]->w13.data(), other->experts[3]->w13.data(), all->experts[3]->w13.nbytes()), 0);
  EXPECT_THROW(MoEWeights::random(cfg, 7, 5, 300), InvalidArgument);
  EXPECT_THROW(MoEWeights::random(cfg, 7, 6, 5), InvalidArgument);
}

TEST(MoEWeights, ExpertPoolSharesValuesModuloP) {
  const MoEConfig cfg = preset("deepseek-v3-mini");
  auto distinct = MoEWeights::random(cfg, 7, 0, 4);
  auto pooled = MoEWeights::random(cfg, 7, 2, 12, 4);  // experts 2..11 from keys 2, 3, 0, 1, ...
  EXPECT_EQ(pooled->expert_pool, 4);
  EXPECT_EQ(pooled->experts[1], nullptr);
  EXPECT_EQ(pooled->experts[12], nullptr);
  for (int e = 2; e < 12; ++e) {
    ASSERT_NE(pooled->experts[e], nullptr) << e;
    const ExpertWeights& want = *distinct->experts[e % 4];
    EXPECT_EQ(std::memcmp(want.w13.data(), pooled->experts[e]->w13.data(), want.w13.nbytes()), 0) << e;
    EXPECT_EQ(std::memcmp(want.w2_scale.data(), pooled->experts[e]->w2_scale.data(), want.w2_scale.nbytes()), 0) << e;
  }
  EXPECT_EQ(pooled->experts[2], pooled->experts[6]);  // one host object per key
  EXPECT_NE(pooled->experts[2], pooled->experts[3]);
  // Experts added later (the reference's other ranks) take the same pooled values, reusing built keys.
  pooled->add_random_experts(7, {0, 1, 13});
  EXPECT_EQ(pooled->experts[0], pooled->experts[4]);
  EXPECT_EQ(pooled->experts[13], pooled->experts[5]);
  EXPECT_EQ(std::memcmp(distinct->experts[1]->w13.data(), pooled->experts[1]->w13.data(), distinct->experts[1]->w13.nbytes()), 0);
  EXPECT_THROW(MoEWeights::random(cfg, 7, 0, 1, -1), InvalidArgument);
  EXPECT_THROW(MoEWeights::random(cfg, 7, 0, 1, 257), InvalidArgument);
}

TEST(MoEWeights, RouterIsNonDegenerateAndBiasSmall) {
  auto w = MoEWeights::random(preset("qwen3-30b-a3b-mini"), 1, 0, 0);  // the router alone
  EXPECT_EQ(w->shared, nullptr);
  EXPECT_FALSE(w->correction_bias.defined());
  Tensor x = test::random_bf16(64, 256, 3);
  Tensor logits = Tensor::empty({64, 128}, DType::fp32);
  router_logits_cpu(*w, x, logits);
  Tensor idx = Tensor::empty({64, 8}, DType::int32), wts = Tensor::empty({64, 8}, DType::fp32);
  route(w->config.router, logits, {}, idx, wts);
  std::vector<int> used(128, 0);
  for (int i = 0; i < 64 * 8; ++i) used[idx.ptr<int32_t>()[i]] = 1;
  int distinct = 0;
  for (int u : used) distinct += u;
  EXPECT_GT(distinct, 64) << "routing collapses onto few experts";
  auto ds = MoEWeights::random(preset("deepseek-v3-mini"), 1, 0, 0);
  for (int e = 0; e < 256; ++e) EXPECT_LE(std::fabs(ds->correction_bias.ptr<float>()[e]), 0.05f);
}

TEST(RouterLogits, MatchesADotProduct) {
  auto w = MoEWeights::random(preset("mixtral-8x7b-mini"), 5);
  Tensor x = test::random_bf16(9, 256, 4);
  Tensor logits = Tensor::empty({9, 8}, DType::fp32);
  router_logits_cpu(*w, x, logits);
  for (int t = 0; t < 9; ++t)
    for (int e = 0; e < 8; ++e) {
      double dot = 0;
      for (int h = 0; h < 256; ++h) dot += double(bf16_bits_to_float(x.ptr<uint16_t>()[t * 256 + h])) * w->router_weight.ptr<float>()[e * 256 + h];
      EXPECT_NEAR(logits.ptr<float>()[t * 8 + e], dot, 1e-4 * (1 + std::fabs(dot)));
    }
  Tensor bad = Tensor::empty({9, 7}, DType::fp32);
  EXPECT_THROW(router_logits_cpu(*w, x, bad), InvalidArgument);
}

TEST(MoEReference, MatchesPerTokenModelWithMaskAndDuplicates) {
  for (const char* name : {"qwen1.5-moe-a2.7b-mini", "deepseek-v3-mini", "deepseek-v4-pro-mini", "mixtral-8x7b-mini"}) {
    const MoEConfig cfg = shrink(preset(name), 16);
    auto w = MoEWeights::random(cfg, 11);
    const int E = cfg.router.num_experts, K = cfg.router.top_k;
    Tensor x = test::random_bf16(37, cfg.hidden, 12);
    Tensor idx, wts;
    test::random_routing(37, K, E, 13, {.masked_fraction = 0.2, .allow_duplicates = true}, idx, wts);
    for (DType d : {DType::bf16, DType::fp8_e4m3}) {
      for (bool fused : {false, true}) {
        Tensor got = reference(*w, x, idx, wts, {.dispatch_dtype = d, .shared_fused = fused, .two_roundings = !fused});  // the model rounds the separate path twice
        Tensor want = naive_layer(*w, x, idx, wts, d, fused);
        // Grouping changes the GEMM's M, so fp32 sums may differ in the last bit; with fp8_block
        // experts that can flip an FP8 rounding of h (a 1/16 step), hence the looser bound there.
        const double tol = cfg.routed_format == WeightFormat::fp8_block ? 5e-3 : 1e-3;
        EXPECT_LE(test::rel_l2_error(got, want), tol) << name << " " << dtype_name(d) << " fused=" << fused;
      }
    }
  }
}

TEST(MoEReference, MaskedTokensGetOnlyTheSharedExpertAndDuplicatesAdd) {
  const MoEConfig cfg = preset("mixtral-8x7b-mini");
  auto w = MoEWeights::random(cfg, 2);
  Tensor x = test::random_bf16(4, 256, 1);
  Tensor idx = Tensor::empty({4, 2}, DType::int32), wts = Tensor::empty({4, 2}, DType::fp32);
  Tensor idx1 = Tensor::empty({4, 2}, DType::int32), wts1 = Tensor::empty({4, 2}, DType::fp32);
  for (int i = 0; i < 8; ++i) {
    idx.ptr<int32_t>()[i] = -1;
    wts.ptr<float>()[i] = NAN;  // a masked column's weight is never read
  }
  Tensor zero = reference(*w, x, idx, wts);
  for (int i = 0; i < 4 * 256; ++i) ASSERT_EQ(zero.ptr<uint16_t>()[i], 0) << i;
  // Same expert twice (0.25 + 0.5) vs once with 0.75.
  for (int t = 0; t < 4; ++t) {
    idx.ptr<int32_t>()[t * 2] = idx.ptr<int32_t>()[t * 2 + 1] = 5;
    wts.ptr<float>()[t * 2] = 0.25f;
    wts.ptr<float>()[t * 2 + 1] = 0.5f;
    idx1.ptr<int32_t>()[t * 2] = 5;
    idx1.ptr<int32_t>()[t * 2 + 1] = -1;
    wts1.ptr<float>()[t * 2] = 0.75f;
    wts1.ptr<float>()[t * 2 + 1] = 0.0f;
  }
  EXPECT_LE(test::rel_l2_error(reference(*w, x, idx, wts), reference(*w, x, idx1, wts1)), 1e-6);
}

TEST(MoEReference, QwenSharedGateScalesTheSharedExpert) {
  auto w = MoEWeights::random(preset("qwen1.5-moe-a2.7b-mini"), 3, 0, 0);  // routing is all -1
  ASSERT_TRUE(w->shared_gate_weight.defined());
  Tensor x = test::random_bf16(3, 256, 2);
  Tensor idx = Tensor::empty({3, 4}, DType::int32), wts = Tensor::zeros({3, 4}, DType::fp32);
  for (int i = 0; i < 12; ++i) idx.ptr<int32_t>()[i] = -1;
  Tensor got = reference(*w, x, idx, wts);
  std::vector<float> xf(256), y(256);
  for (int t = 0; t < 3; ++t) {
    float dot = 0;
    for (int h = 0; h < 256; ++h) {
      xf[h] = bf16_bits_to_float(x.ptr<uint16_t>()[t * 256 + h]);
      dot += xf[h] * w->shared_gate_weight.ptr<float>()[h];
    }
    const float g = 1.0f / (1.0f + std::exp(-dot));
    EXPECT_GT(g, 0.0f);
    EXPECT_LT(g, 1.0f);
    expert_mlp_cpu(*w->shared, xf.data(), 1, y.data());
    for (int h = 0; h < 256; ++h) ASSERT_EQ(got.ptr<uint16_t>()[t * 256 + h], float_to_bf16_bits(g * y[h])) << t << "," << h;
  }
}

TEST(MoEReference, BadInputsThrowInvalidArgument) {
  const MoEConfig cfg = preset("mixtral-8x7b-mini");
  auto w = MoEWeights::random(cfg, 2);
  Tensor x = test::random_bf16(2, 256, 1);
  Tensor idx = Tensor::zeros({2, 2}, DType::int32), wts = Tensor::zeros({2, 2}, DType::fp32);
  Tensor out = Tensor::empty({2, 256}, DType::bf16);
  idx.ptr<int32_t>()[3] = 8;  // E = 8
  try {
    moe_reference_cpu(*w, x, idx, wts, out);
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("topk_idx[1, 1] = 8: must be -1 (no selection) or an expert id in [0, num_experts = 8)"), std::string::npos) << e.what();
  }
  idx.ptr<int32_t>()[3] = -2;
  EXPECT_THROW(moe_reference_cpu(*w, x, idx, wts, out), InvalidArgument);
  idx.ptr<int32_t>()[3] = 1;
  auto part = MoEWeights::random(cfg, 2, 0, 1);  // expert 1 not built
  EXPECT_THROW(moe_reference_cpu(*part, x, idx, wts, out), InvalidArgument);
  Tensor out_bad = Tensor::empty({3, 256}, DType::bf16);
  EXPECT_THROW(moe_reference_cpu(*w, x, idx, wts, out_bad), InvalidArgument);
  MoEConfig narrow = cfg;
  narrow.hidden = 64;  // fp8 dispatch needs H % 128 == 0
  auto wn = MoEWeights::random(narrow, 2);
  Tensor xn = test::random_bf16(2, 64, 1), outn = Tensor::empty({2, 64}, DType::bf16);
  EXPECT_THROW(moe_reference_cpu(*wn, xn, idx, wts, outn, {.dispatch_dtype = DType::fp8_e4m3}), InvalidArgument);
  EXPECT_NO_THROW(moe_reference_cpu(*wn, xn, idx, wts, outn));
}
