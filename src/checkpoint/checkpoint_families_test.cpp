// checkpoint/checkpoint_families_test.cpp: both expert layouts transformers writes (4.x per-expert
// modules, 5.x fused gate_up_proj / down_proj) loading to the same experts for every family; the
// defaults of the transformers configuration classes for keys config.json omits; settings epx
// does not compute refused at load, by name.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "epx/checkpoint.h"
#include "epx/error.h"
#include "epx/moe.h"
#include "test_util.h"

#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace epx {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

fs::path root() {
  static const fs::path r = fs::temp_directory_path() / ("epx_ckpt_families_" + std::to_string(::getpid()));
  return r;
}
class Cleanup : public ::testing::Environment {
 public:
  void TearDown() override { fs::remove_all(root()); }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new Cleanup);

std::string fresh(const std::string& name) {
  const fs::path d = root() / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f);
}
void write_json(const std::string& path, const json& j) {
  std::ofstream f(path);
  f << j.dump(2);
}
/// config.json of `dir` edited by `edit`.
template <class Edit>
void edit_config(const std::string& dir, Edit&& edit) {
  const std::string p = dir + "/config.json";
  json j = read_json(p);
  edit(j);
  write_json(p, j);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.defined() == b.defined() &&
         (!a.defined() || (a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), static_cast<size_t>(a.nbytes())) == 0));
}

struct Family {
  std::string name;
  CheckpointConvention convention;
  MoEConfig config;
};

std::vector<Family> bf16_families() {
  auto small = [](const char* p, int E) {
    MoEConfig c = preset(p);
    c.router.num_experts = E;
    c.routed_format = c.shared_format = WeightFormat::bf16;
    return c;
  };
  MoEConfig ds = small("deepseek-v3-mini", 16);
  ds.router.n_group = 4;
  ds.router.topk_group = 2;
  return {{"deepseek_v3", CheckpointConvention::deepseek, ds},
          {"qwen3_moe", CheckpointConvention::qwen_moe, small("qwen3-30b-a3b-mini", 8)},
          {"qwen2_moe", CheckpointConvention::qwen_moe, small("qwen1.5-moe-a2.7b-mini", 6)},
          {"mixtral", CheckpointConvention::mixtral, small("mixtral-8x7b-mini", 8)}};
}

TEST(CheckpointLayouts, FusedAndPerExpertLoadTheSameExperts) {
  for (const Family& f : bf16_families()) {
    SCOPED_TRACE(f.name);
    auto w = MoEWeights::random(f.config, 5);
    const std::string per = fresh(f.name + "_per"), fused = fresh(f.name + "_fused");
    write_moe_checkpoint(per, *w, {.convention = f.convention, .layer = 2, .router_dtype = "F32"});
    write_moe_checkpoint(fused, *w, {.convention = f.convention, .layer = 2, .router_dtype = "F32", .fused_experts = true});
    const auto ck = Checkpoint::open(fused);
    EXPECT_TRUE(ck->contains("model.layers.2.mlp.experts.gate_up_proj"));
    EXPECT_FALSE(ck->contains("model.layers.2.mlp.experts.0.gate_proj.weight"));
    const MoELayerCheckpoint a = load_moe_layer(per, {.layer = 2}), b = load_moe_layer(*ck, {.layer = 2});
    EXPECT_FALSE(a.info.fused_experts);
    EXPECT_TRUE(b.info.fused_experts);
    EXPECT_EQ(b.info.prefix, "model.layers.2.mlp.") << "transformers 5.x names Mixtral's block mlp too";
    EXPECT_EQ(a.info.convention, b.info.convention);
    ASSERT_EQ(a.weights->experts.size(), w->experts.size());
    for (size_t e = 0; e < w->experts.size(); ++e) {
      EXPECT_TRUE(same_bytes(b.weights->experts[e]->w13, w->experts[e]->w13)) << "expert " << e;
      EXPECT_TRUE(same_bytes(b.weights->experts[e]->w2, w->experts[e]->w2)) << "expert " << e;
      EXPECT_TRUE(same_bytes(a.weights->experts[e]->w13, b.weights->experts[e]->w13)) << "expert " << e;
    }
    EXPECT_TRUE(same_bytes(a.weights->router_weight, b.weights->router_weight));
    EXPECT_EQ(a.weights->shared == nullptr, b.weights->shared == nullptr);
    if (a.weights->shared) {
      EXPECT_TRUE(same_bytes(a.weights->shared->w13, b.weights->shared->w13));
    }
    // A rank loads only its experts from the fused tensors too.
    const MoELayerCheckpoint part = load_moe_layer(*ck, {.layer = 2, .expert_begin = 1, .expert_end = 3, .load_shared = false});
    EXPECT_EQ(part.weights->experts[0], nullptr);
    ASSERT_NE(part.weights->experts[2], nullptr);
    EXPECT_TRUE(same_bytes(part.weights->experts[2]->w2, w->experts[2]->w2));
  }
}

TEST(CheckpointLayouts, FusedTensorsWithTheWrongShapeOrAQuantizedDtypeAreNamed) {
  const Family f = bf16_families()[1];
  auto w = MoEWeights::random(f.config, 6);
  const std::string dir = fresh("fused_bad");
  write_moe_checkpoint(dir, *w, {.convention = f.convention, .layer = 0, .fused_experts = true});
  edit_config(dir, [&](json& j) { j["moe_intermediate_size"] = f.config.intermediate * 2; });
  std::string msg = test::invalid_argument_message([&] { load_moe_layer(dir, {.layer = 0}); });
  EXPECT_NE(msg.find("model.layers.0.mlp.experts.gate_up_proj"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fused"), std::string::npos) << msg;

  // An FP8 fused tensor: refused (Unsupported), naming it.
  const int64_t E = 2, I = 128, H = 128;
  std::vector<uint8_t> gu(static_cast<size_t>(E * 2 * I * H)), dn(static_cast<size_t>(E * H * I));
  std::vector<uint16_t> router(static_cast<size_t>(E * H), 0x3f80);
  const std::string q = fresh("fused_fp8");
  write_safetensors(q + "/model.safetensors",
                    {{"model.layers.0.mlp.experts.gate_up_proj", "F8_E4M3", {E, 2 * I, H}, gu.data(), gu.size()},
                     {"model.layers.0.mlp.experts.down_proj", "F8_E4M3", {E, H, I}, dn.data(), dn.size()},
                     {"model.layers.0.mlp.gate.weight", "BF16", {E, H}, router.data(), router.size() * 2}});
  write_json(q + "/config.json", {{"model_type", "qwen3_moe"}, {"hidden_size", H}, {"moe_intermediate_size", I}, {"num_experts", E},
                                  {"num_experts_per_tok", 1}});
  try {
    load_moe_layer(q, {.layer = 0});
    ADD_FAILURE() << "an FP8 fused expert tensor loaded";
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("experts.gate_up_proj"), std::string::npos) << e.what();
  }
}

TEST(CheckpointDefaults, OmittedKeysTakeTheTransformersClassDefaults) {
  // DeepseekV3Config: n_group 8, topk_group 4, routed_scaling_factor 2.5, n_shared_experts 1,
  // norm_topk_prob true, first_k_dense_replace 3; sigmoid + noaux_tc (its router's only scoring).
  MoEConfig ds = preset("deepseek-v3-mini");
  ds.router.num_experts = 16;
  ds.routed_format = ds.shared_format = WeightFormat::bf16;
  ds.shared_intermediate = ds.intermediate;  // one shared expert
  auto w = MoEWeights::random(ds, 8);
  const std::string dir = fresh("ds_defaults");
  write_moe_checkpoint(dir, *w, {.convention = CheckpointConvention::deepseek, .layer = 3});
  edit_config(dir, [](json& j) {
    for (const char* k : {"n_group", "topk_group", "routed_scaling_factor", "n_shared_experts", "norm_topk_prob", "first_k_dense_replace",
                          "scoring_func", "topk_method", "moe_layer_freq"})
      j.erase(k);
  });
  const auto ck = Checkpoint::open(dir);
  const CheckpointLayerInfo info = read_moe_layer_info(*ck, 3);
  EXPECT_EQ(info.config.router.n_group, 8);
  EXPECT_EQ(info.config.router.topk_group, 4);
  EXPECT_EQ(info.config.router.routed_scaling_factor, 2.5f);
  EXPECT_TRUE(info.config.router.renormalize);
  EXPECT_EQ(info.config.router.scoring, ScoringFunc::sigmoid);
  EXPECT_TRUE(info.config.router.use_correction_bias);
  EXPECT_EQ(info.config.num_shared_experts, 1);
  EXPECT_EQ(info.config.shared_intermediate, ds.intermediate);
  std::string msg = test::invalid_argument_message([&] { read_moe_layer_info(*ck, 2); });
  EXPECT_NE(msg.find("first_k_dense_replace = 3"), std::string::npos) << "layer 2 < the default 3 is dense: " << msg;

  // Qwen3MoeConfig: norm_topk_prob false; Qwen2MoeConfig: shared_expert_intermediate_size 5632.
  MoEConfig q3 = preset("qwen3-30b-a3b-mini");
  q3.router.num_experts = 8;
  q3.router.renormalize = true;
  const std::string qd = fresh("q3_defaults");
  write_moe_checkpoint(qd, *MoEWeights::random(q3, 9), {.convention = CheckpointConvention::qwen_moe});
  edit_config(qd, [](json& j) { j.erase("norm_topk_prob"); });
  EXPECT_FALSE(read_moe_layer_info(*Checkpoint::open(qd), 0).config.router.renormalize);

  MoEConfig q2 = preset("qwen1.5-moe-a2.7b-mini");
  q2.router.num_experts = 4;
  const std::string q2d = fresh("q2_defaults");
  write_moe_checkpoint(q2d, *MoEWeights::random(q2, 10), {.convention = CheckpointConvention::qwen_moe});
  edit_config(q2d, [](json& j) { j.erase("shared_expert_intermediate_size"); });
  msg = test::invalid_argument_message([&] { load_moe_layer(q2d, {.layer = 0}); });
  EXPECT_NE(msg.find("shared_expert.gate_proj.weight"), std::string::npos) << "the default width 5632 must be checked against the tensor: " << msg;
  EXPECT_NE(msg.find("5632"), std::string::npos) << msg;

  // MixtralConfig: num_local_experts 8, num_experts_per_tok 2.
  MoEConfig mx = preset("mixtral-8x7b-mini");
  mx.router.num_experts = 8;
  mx.router.top_k = 2;
  const std::string md = fresh("mixtral_defaults");
  write_moe_checkpoint(md, *MoEWeights::random(mx, 12), {.convention = CheckpointConvention::mixtral});
  edit_config(md, [](json& j) {
    j.erase("num_local_experts");
    j.erase("num_experts_per_tok");
  });
  const CheckpointLayerInfo mi = read_moe_layer_info(*Checkpoint::open(md), 0);
  EXPECT_EQ(mi.config.router.num_experts, 8);
  EXPECT_EQ(mi.config.router.top_k, 2);
}

TEST(CheckpointRefusals, SettingsEpxDoesNotComputeAreRefusedByName) {
  MoEConfig q3 = preset("qwen3-30b-a3b-mini");
  q3.router.num_experts = 8;
  auto w = MoEWeights::random(q3, 13);
  auto expect_unsupported = [](const std::string& dir, const std::string& name) {
    try {
      load_moe_layer(dir, {.layer = 0});
      ADD_FAILURE() << name << ": loaded";
    } catch (const Unsupported& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  const std::string a = fresh("gelu");
  write_moe_checkpoint(a, *w, {.convention = CheckpointConvention::qwen_moe});
  edit_config(a, [](json& j) { j["hidden_act"] = "gelu"; });
  expect_unsupported(a, "hidden_act");

  MoEConfig ds = preset("deepseek-v3-mini");
  ds.router.num_experts = 8;
  ds.router.n_group = ds.router.topk_group = 1;
  ds.routed_format = ds.shared_format = WeightFormat::bf16;
  auto dw = MoEWeights::random(ds, 14);
  const std::string b = fresh("sqrtsoftplus");
  write_moe_checkpoint(b, *dw, {.convention = CheckpointConvention::deepseek, .model_type = "deepseek_v4"});
  edit_config(b, [](json& j) { j["scoring_func"] = "sqrtsoftplus"; });
  expect_unsupported(b, "scoring_func");
  edit_config(b, [](json& j) {
    j["scoring_func"] = "sigmoid";
    j["mlp_layer_types"] = {"hash_moe", "moe"};
  });
  expect_unsupported(b, "mlp_layer_types[0]");
  // DeepSeek-V4's swiglu_limit is computed: the routed experts clamp (silu_glu with that limit).
  edit_config(b, [](json& j) {
    j.erase("mlp_layer_types");
    j["swiglu_limit"] = 10.0;
  });
  const MoELayerCheckpoint c = load_moe_layer(b, {.layer = 0});
  EXPECT_EQ(c.info.activation.limit, 10.0f);
  EXPECT_EQ(c.weights->experts[0]->activation.limit, 10.0f);
  EXPECT_TRUE(c.weights->shared->activation.is_plain_silu());
}

}  // namespace
}  // namespace epx
