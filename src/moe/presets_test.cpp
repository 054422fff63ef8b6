// Tests of the model presets: values from the public configs, minis keep the routing.
#include <gtest/gtest.h>

#include <string>

#include "epx/error.h"
#include "epx/moe.h"

using namespace epx;

TEST(Presets, NamesComeInFullAndMiniPairsAndAllValidate) {
  const auto names = preset_names();
  ASSERT_EQ(names.size(), 10u);
  for (const std::string& n : names) {
    MoEConfig c = preset(n);
    EXPECT_EQ(c.name, n);
    EXPECT_NO_THROW(validate_router_config(c.router)) << n;
    if (n.ends_with("-mini")) {
      MoEConfig full = preset(n.substr(0, n.size() - 5));
      EXPECT_EQ(c.hidden, 256);
      EXPECT_EQ(c.intermediate, 128);
      EXPECT_EQ(c.router.num_experts, full.router.num_experts) << n;
      EXPECT_EQ(c.router.top_k, full.router.top_k) << n;
      EXPECT_EQ(c.router.n_group, full.router.n_group) << n;
      EXPECT_EQ(c.router.topk_group, full.router.topk_group) << n;
      EXPECT_EQ(c.router.routed_scaling_factor, full.router.routed_scaling_factor) << n;
      EXPECT_EQ(c.router.scoring, full.router.scoring) << n;
      EXPECT_EQ(c.router.renormalize, full.router.renormalize) << n;
      EXPECT_EQ(c.router.use_correction_bias, full.router.use_correction_bias) << n;
      EXPECT_EQ(c.routed_format, full.routed_format) << n;
      EXPECT_EQ(c.shared_format, full.shared_format) << n;
      EXPECT_EQ(c.num_shared_experts, full.num_shared_experts) << n;
      EXPECT_EQ(c.shared_gate, full.shared_gate) << n;
    }
  }
}

TEST(Presets, ValuesFromTheModelConfigs) {
  MoEConfig ds = preset("deepseek-v3");
  EXPECT_EQ(ds.hidden, 7168);
  EXPECT_EQ(ds.intermediate, 2048);
  EXPECT_EQ(ds.router.num_experts, 256);
  EXPECT_EQ(ds.router.top_k, 8);
  EXPECT_EQ(ds.router.n_group, 8);
  EXPECT_EQ(ds.router.topk_group, 4);
  EXPECT_FLOAT_EQ(ds.router.routed_scaling_factor, 2.5f);
  EXPECT_EQ(ds.router.scoring, ScoringFunc::sigmoid);
  EXPECT_TRUE(ds.router.use_correction_bias);
  EXPECT_EQ(ds.shared_intermediate, 2048);
  EXPECT_EQ(ds.routed_format, WeightFormat::fp8_block);

  MoEConfig v4 = preset("deepseek-v4-pro");
  EXPECT_EQ(v4.router.num_experts, 384);
  EXPECT_EQ(v4.router.top_k, 6);
  EXPECT_EQ(v4.intermediate, 3072);
  EXPECT_EQ(v4.routed_format, WeightFormat::mxfp4);
  EXPECT_EQ(v4.shared_format, WeightFormat::fp8_block);

  MoEConfig q3 = preset("qwen3-30b-a3b");
  EXPECT_EQ(q3.router.num_experts, 128);
  EXPECT_TRUE(q3.router.renormalize);
  EXPECT_EQ(q3.num_shared_experts, 0);

  MoEConfig mx = preset("mixtral-8x7b");
  EXPECT_EQ(mx.intermediate, 14336);
  EXPECT_EQ(mx.router.top_k, 2);

  MoEConfig q15 = preset("qwen1.5-moe-a2.7b");
  EXPECT_EQ(q15.router.num_experts, 60);
  EXPECT_FALSE(q15.router.renormalize);
  EXPECT_EQ(q15.shared_intermediate, 5632);
  EXPECT_TRUE(q15.shared_gate);
  EXPECT_EQ(preset("qwen1.5-moe-a2.7b-mini").shared_intermediate, 256);
  EXPECT_EQ(preset("deepseek-v3-mini").shared_intermediate, 128);
}

TEST(Presets, UnknownNameListsTheKnownOnes) {
  try {
    preset("llama-moe");
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("llama-moe"), std::string::npos) << m;
    for (const std::string& n : preset_names()) EXPECT_NE(m.find(n), std::string::npos) << m;
  }
}
