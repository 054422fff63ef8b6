// checkpoint/checkpoint_test.cpp: small checkpoints written in each real convention from known
// weights, loaded back tensor by tensor (single file and sharded index), per-rank partial loads,
// shared-expert shards, the MoE layer run from a checkpoint equal to the same layer built in
// memory, and the errors of a wrong dtype, a wrong shape, a missing tensor, a bad index, a
// truncated shard and config.json problems, each naming what is wrong.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <fstream>
#include <nlohmann/json.hpp>

#include "epx/checkpoint.h"
#include "epx/error.h"
#include "epx/moe.h"
#include "test_util.h"

// Designated initializers below leave the other fields at their defaults on purpose; GCC 12 still
// warns about the omitted class-type members (GCC PR 96868, fixed in 13).
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace epx {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

class TempDirs : public ::testing::Environment {
 public:
  static fs::path root() { return fs::temp_directory_path() / ("epx_ckpt_test_" + std::to_string(::getpid())); }
  void TearDown() override { fs::remove_all(root()); }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new TempDirs);

std::string fresh(const std::string& name) {
  const fs::path d = TempDirs::root() / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

struct Model {
  std::string name;
  CheckpointConvention convention;
  MoEConfig config;
};

/// The mini presets (H 256, I 128) with fewer experts so a test writes and loads in milliseconds.
MoEConfig shrink(MoEConfig c, int num_experts) {
  c.router.num_experts = num_experts;
  return c;
}

std::vector<Model> models() {
  std::vector<Model> v;
  v.push_back({"deepseek_v3_fp8", CheckpointConvention::deepseek, shrink(preset("deepseek-v3-mini"), 32)});
  MoEConfig ds_bf16 = shrink(preset("deepseek-v3-mini"), 16);
  ds_bf16.router.n_group = 4;
  ds_bf16.router.topk_group = 2;
  ds_bf16.routed_format = ds_bf16.shared_format = WeightFormat::bf16;
  ds_bf16.shared_intermediate = 256;  // n_shared_experts = 2
  v.push_back({"deepseek_bf16_2shared", CheckpointConvention::deepseek, ds_bf16});
  v.push_back({"deepseek_v4_mxfp4", CheckpointConvention::deepseek, shrink(preset("deepseek-v4-pro-mini"), 12)});
  v.push_back({"qwen3_moe", CheckpointConvention::qwen_moe, shrink(preset("qwen3-30b-a3b-mini"), 16)});
  v.push_back({"qwen2_moe_shared", CheckpointConvention::qwen_moe, shrink(preset("qwen1.5-moe-a2.7b-mini"), 12)});
  MoEConfig qfp8 = shrink(preset("qwen3-30b-a3b-mini"), 8);
  qfp8.routed_format = WeightFormat::fp8_block;  // Qwen3-...-FP8 checkpoints: 128x128 weight_scale_inv
  v.push_back({"qwen3_moe_fp8", CheckpointConvention::qwen_moe, qfp8});
  v.push_back({"mixtral", CheckpointConvention::mixtral, preset("mixtral-8x7b-mini")});
  MoEConfig oss = preset("mixtral-8x7b-mini");
  oss.router.num_experts = 8;
  oss.router.top_k = 4;
  oss.routed_format = WeightFormat::mxfp4;
  v.push_back({"gpt_oss_mxfp4", CheckpointConvention::gpt_oss, oss});
  oss.routed_format = WeightFormat::bf16;
  v.push_back({"gpt_oss_bf16", CheckpointConvention::gpt_oss, oss});
  return v;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.dtype() == b.dtype() && a.numel() == b.numel() && std::memcmp(a.data(), b.data(), static_cast<size_t>(a.nbytes())) == 0;
}

void expect_same_expert(const ExpertWeights& got, const ExpertWeights& want, const std::string& what) {
  EXPECT_EQ(got.format, want.format) << what;
  EXPECT_EQ(got.hidden, want.hidden) << what;
  EXPECT_EQ(got.intermediate, want.intermediate) << what;
  EXPECT_TRUE(same_bytes(got.w13, want.w13)) << what << " w13 " << got.w13.view().describe();
  EXPECT_TRUE(same_bytes(got.w13_scale, want.w13_scale)) << what << " w13_scale";
  EXPECT_TRUE(same_bytes(got.w2, want.w2)) << what << " w2";
  EXPECT_TRUE(same_bytes(got.w2_scale, want.w2_scale)) << what << " w2_scale";
}

void expect_same_config(const MoEConfig& a, const MoEConfig& b, const std::string& what) {
  EXPECT_EQ(a.hidden, b.hidden) << what;
  EXPECT_EQ(a.intermediate, b.intermediate) << what;
  EXPECT_EQ(a.router.num_experts, b.router.num_experts) << what;
  EXPECT_EQ(a.router.top_k, b.router.top_k) << what;
  EXPECT_EQ(a.router.scoring, b.router.scoring) << what;
  EXPECT_EQ(a.router.renormalize, b.router.renormalize) << what;
  EXPECT_EQ(a.router.n_group, b.router.n_group) << what;
  EXPECT_EQ(a.router.topk_group, b.router.topk_group) << what;
  EXPECT_EQ(a.router.routed_scaling_factor, b.router.routed_scaling_factor) << what;
  EXPECT_EQ(a.router.use_correction_bias, b.router.use_correction_bias) << what;
  EXPECT_EQ(a.num_shared_experts, b.num_shared_experts) << what;
  EXPECT_EQ(a.shared_intermediate, b.shared_intermediate) << what;
  EXPECT_EQ(a.shared_gate, b.shared_gate) << what;
  EXPECT_EQ(a.routed_format, b.routed_format) << what;
  if (a.num_shared_experts > 0) {
    EXPECT_EQ(a.shared_format, b.shared_format) << what;
  }
}

/// Every tensor of a full load equals what was written (router exactly: written as F32).
void expect_same_layer(const MoEWeights& got, const MoEWeights& want, const std::string& what) {
  expect_same_config(got.config, want.config, what);
  EXPECT_TRUE(same_bytes(got.router_weight, want.router_weight)) << what << " router_weight";
  EXPECT_TRUE(same_bytes(got.correction_bias, want.correction_bias)) << what << " correction_bias";
  ASSERT_EQ(got.experts.size(), want.experts.size()) << what;
  for (size_t e = 0; e < want.experts.size(); ++e) {
    ASSERT_NE(got.experts[e], nullptr) << what << " expert " << e;
    expect_same_expert(*got.experts[e], *want.experts[e], what + " expert " + std::to_string(e));
  }
  ASSERT_EQ(got.shared == nullptr, want.shared == nullptr) << what;
  if (want.shared) expect_same_expert(*got.shared, *want.shared, what + " shared");
  EXPECT_TRUE(same_bytes(got.shared_gate_weight, want.shared_gate_weight)) << what << " shared_gate_weight";
}

TEST(Checkpoint, EveryConventionRoundTrips) {
  for (const Model& m : models()) {
    SCOPED_TRACE(m.name);
    auto w = MoEWeights::random(m.config, 11);
    for (int shards : {1, 3}) {
      const std::string dir = fresh(m.name + "_" + std::to_string(shards));
      write_moe_checkpoint(dir, *w, {.convention = m.convention, .layer = 3, .num_shards = shards, .router_dtype = "F32"});
      EXPECT_EQ(fs::exists(fs::path(dir) / "model.safetensors.index.json"), shards > 1);
      const MoELayerCheckpoint got = load_moe_layer(dir, {.layer = 3});
      EXPECT_EQ(got.info.convention, m.convention);
      EXPECT_EQ(got.info.layer, 3);
      expect_same_layer(*got.weights, *w, m.name + " shards=" + std::to_string(shards));
      if (m.convention == CheckpointConvention::gpt_oss) {
        // gpt-oss experts carry their clamped SwiGLU and the (written, zero) biases; nothing is left as a note.
        EXPECT_TRUE(got.notes.empty()) << got.notes.front();
        EXPECT_EQ(got.info.activation, ExpertActivation::gpt_oss(1.702f, 7.0f));
        for (const auto& e : got.weights->experts) {
          EXPECT_EQ(e->activation, got.info.activation);
          EXPECT_TRUE(e->b13.defined() && e->b2.defined());
        }
        EXPECT_TRUE(got.weights->router_bias.defined());
      }
    }
  }
}

TEST(Checkpoint, ShardedIndexSpreadsTensorsAndMapsEachToItsFile) {
  auto w = MoEWeights::random(shrink(preset("qwen1.5-moe-a2.7b-mini"), 6), 5);
  const std::string dir = fresh("index");
  write_moe_checkpoint(dir, *w, {.convention = CheckpointConvention::qwen_moe, .num_shards = 4});
  const auto ck = Checkpoint::open(dir);
  std::set<std::string> files;
  for (const std::string& n : ck->names()) files.insert(ck->file_of(n));
  EXPECT_EQ(files.size(), 4u);
  std::ifstream f(fs::path(dir) / "model.safetensors.index.json");
  const json index = json::parse(f);
  EXPECT_EQ(index["weight_map"].size(), ck->names().size());
  EXPECT_EQ(ck->file_of("model.layers.0.mlp.gate.weight"),
            (fs::path(dir) / index["weight_map"]["model.layers.0.mlp.gate.weight"].get<std::string>()).string());
}

TEST(Checkpoint, BF16RouterIsTheRoundedRouter) {
  auto w = MoEWeights::random(shrink(preset("deepseek-v3-mini"), 32), 2);
  const std::string dir = fresh("bf16router");
  write_moe_checkpoint(dir, *w, {.convention = CheckpointConvention::deepseek});
  const auto got = load_moe_layer(dir, {.layer = 0});
  const float* a = got.weights->router_weight.ptr<const float>();
  const float* b = w->router_weight.ptr<const float>();
  for (int64_t i = 0; i < w->router_weight.numel(); ++i) ASSERT_EQ(a[i], round_bf16(b[i])) << i;
  EXPECT_TRUE(same_bytes(got.weights->correction_bias, w->correction_bias));  // F32 in DeepSeek checkpoints
}

TEST(Checkpoint, EachRankLoadsOnlyItsExperts) {
  auto w = MoEWeights::random(shrink(preset("deepseek-v3-mini"), 32), 3);
  const std::string dir = fresh("ranks");
  write_moe_checkpoint(dir, *w, {.convention = CheckpointConvention::deepseek, .num_shards = 2});
  const auto ck = Checkpoint::open(dir);
  const int R = 3;
  for (int r = 0; r < R; ++r) {
    const ExpertRange range = expert_range(32, R, r);
    const auto got = load_moe_layer(*ck, {.layer = 0, .expert_begin = range.begin, .expert_end = range.end});
    for (int e = 0; e < 32; ++e) {
      if (e >= range.begin && e < range.end) {
        ASSERT_NE(got.weights->experts[e], nullptr) << "rank " << r << " expert " << e;
        expect_same_expert(*got.weights->experts[e], *w->experts[e], "expert " + std::to_string(e));
      } else {
        EXPECT_EQ(got.weights->experts[e], nullptr) << "rank " << r << " loaded expert " << e;
      }
    }
    ASSERT_NE(got.weights->shared, nullptr);
  }
  const auto some = load_moe_layer(*ck, {.layer = 0, .expert_ids = {31, 4}, .load_router = false, .load_shared = false});
  EXPECT_NE(some.weights->experts[31], nullptr);
  EXPECT_NE(some.weights->experts[4], nullptr);
  EXPECT_EQ(some.weights->experts[5], nullptr);
  EXPECT_FALSE(some.weights->router_weight.defined());
  EXPECT_EQ(some.weights->shared, nullptr);
  EXPECT_THROW((void)load_moe_layer(*ck, {.layer = 0, .expert_ids = {32}}), InvalidArgument);
  EXPECT_THROW((void)load_moe_layer(*ck, {.layer = 0, .expert_begin = 5, .expert_end = 40}), InvalidArgument);
}

TEST(Checkpoint, SharedExpertShardsSliceTheIntermediateDimension) {
  struct Case { std::string name; CheckpointConvention conv; MoEConfig cfg; int shards; };
  MoEConfig fp8 = shrink(preset("deepseek-v3-mini"), 8);
  fp8.router.n_group = 4;
  fp8.router.topk_group = 4;
  fp8.shared_intermediate = 256;  // two 128-blocks
  MoEConfig q = shrink(preset("qwen1.5-moe-a2.7b-mini"), 4);  // bf16, width 256
  for (const Case& c : {Case{"fp8", CheckpointConvention::deepseek, fp8, 2}, Case{"bf16", CheckpointConvention::qwen_moe, q, 3}}) {
    SCOPED_TRACE(c.name);
    auto w = MoEWeights::random(c.cfg, 9);
    const std::string dir = fresh("shard_" + c.name);
    write_moe_checkpoint(dir, *w, {.convention = c.conv});
    const auto ck = Checkpoint::open(dir);
    const int64_t H = c.cfg.hidden, S = c.cfg.shared_intermediate;
    const float* full13 = w->shared->w13_f32();
    const float* full2 = w->shared->w2_f32();
    int64_t covered = 0;
    std::vector<float> x(static_cast<size_t>(4 * H)), y_full(static_cast<size_t>(4 * H)), y_sum(static_cast<size_t>(4 * H), 0.0f);
    for (size_t i = 0; i < x.size(); ++i) x[i] = round_bf16(std::sin(0.37f * static_cast<float>(i)));
    expert_mlp_cpu(*w->shared, x.data(), 4, y_full.data());
    for (int s = 0; s < c.shards; ++s) {
      const auto got = load_moe_layer(*ck, {.layer = 0, .expert_end = 0, .shared_shard = s, .num_shared_shards = c.shards});
      const ExpertWeights& sh = *got.weights->shared;
      const int64_t i0 = covered, w_s = sh.intermediate;
      {  // exactly the slice ModularMoE's DP-sharded shared expert gives rank s of `shards`
        const int64_t g = intermediate_granularity(sh.format);
        const ExpertRange part = expert_range(static_cast<int>((S + g - 1) / g), c.shards, s);
        EXPECT_EQ(i0, part.begin * g);
        expect_same_expert(sh, *w->shared->slice_intermediate(part.begin * g, std::min<int64_t>(part.end * g, S)), "shard");
      }
      EXPECT_EQ(got.weights->config.shared_intermediate, w_s);
      const float* a = sh.w13_f32();
      const float* b = sh.w2_f32();
      for (int64_t r = 0; r < w_s; ++r)
        for (int64_t h = 0; h < H; ++h) {
          ASSERT_EQ(a[r * H + h], full13[(i0 + r) * H + h]) << "gate row " << r;
          ASSERT_EQ(a[(w_s + r) * H + h], full13[(S + i0 + r) * H + h]) << "up row " << r;
        }
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < w_s; ++i) ASSERT_EQ(b[h * w_s + i], full2[h * S + i0 + i]) << "down col " << i;
      std::vector<float> y(static_cast<size_t>(4 * H));
      expert_mlp_cpu(sh, x.data(), 4, y.data());
      for (size_t i = 0; i < y.size(); ++i) y_sum[i] += y[i];
      covered += w_s;
    }
    EXPECT_EQ(covered, S);
    double num = 0, den = 0;
    for (size_t i = 0; i < y_full.size(); ++i) {
      num += (y_sum[i] - y_full[i]) * (y_sum[i] - y_full[i]);
      den += y_full[i] * y_full[i];
    }
    EXPECT_GT(den, 0.0);
    EXPECT_LT(std::sqrt(num / den), 2e-2) << "the shards' outputs sum to the whole expert's (up to rounding)";
    EXPECT_THROW((void)load_moe_layer(*ck, {.layer = 0, .shared_shard = c.shards, .num_shared_shards = c.shards}), InvalidArgument);
    EXPECT_THROW((void)load_moe_layer(*ck, {.layer = 0, .num_shared_shards = 1000}), InvalidArgument);
  }
}

/// [n] fp32 values of bf16 precision (what a BF16 checkpoint tensor gives back exactly), from `seed`.
Tensor bf16_valued(int64_t n, uint64_t seed, float scale) {
  Tensor t = test::random_f32(1, n, seed, scale), v = Tensor::empty({n}, DType::fp32);
  for (int64_t i = 0; i < n; ++i) v.ptr<float>()[i] = round_bf16(t.ptr<const float>()[i]);
  return v;
}

/// gpt-oss as the model has it: every expert with its clamped SwiGLU and non-zero biases, and a router bias.
void make_gpt_oss(MoEWeights& w, uint64_t seed) {
  const int64_t H = w.config.hidden, I = w.config.intermediate;
  for (size_t e = 0; e < w.experts.size(); ++e) {
    if (!w.experts[e]) continue;
    const ExpertWeights& src = *w.experts[e];
    auto x = std::make_shared<ExpertWeights>();
    x->format = src.format;
    x->hidden = src.hidden;
    x->intermediate = src.intermediate;
    x->w13 = src.w13;
    x->w13_scale = src.w13_scale;
    x->w2 = src.w2;
    x->w2_scale = src.w2_scale;
    x->activation = ExpertActivation::gpt_oss(1.702f, 7.0f);
    x->b13 = bf16_valued(2 * I, seed + 2 * e, 0.5f);
    x->b2 = bf16_valued(H, seed + 2 * e + 1, 0.25f);
    w.experts[e] = x;
  }
  w.router_bias = bf16_valued(w.config.router.num_experts, seed + 999, 0.5f);
}

/// The layer from a checkpoint (each rank loading only its experts) equals, bit for bit, the same
/// layer built from the in-memory weights, on the model's own router.
TEST(Checkpoint, LayerFromCheckpointEqualsInMemoryLayer) {
  for (const Model& m : models()) {
    if (m.name == "gpt_oss_bf16" || m.name == "qwen3_moe_fp8" || m.name == "deepseek_bf16_2shared") continue;  // covered by their twins
    SCOPED_TRACE(m.name);
    auto w = MoEWeights::random(m.config, 21);
    if (m.convention == CheckpointConvention::gpt_oss) make_gpt_oss(*w, 77);  // biases, router bias and the activation round-trip too
    // The checkpoint stores the router in BF16, as real ones do; the in-memory twin uses the same values.
    for (int64_t i = 0; i < w->router_weight.numel(); ++i) w->router_weight.ptr<float>()[i] = round_bf16(w->router_weight.ptr<float>()[i]);
    if (w->shared_gate_weight.defined())
      for (int64_t i = 0; i < w->shared_gate_weight.numel(); ++i)
        w->shared_gate_weight.ptr<float>()[i] = round_bf16(w->shared_gate_weight.ptr<float>()[i]);
    const std::string dir = fresh("layer_" + m.name);
    write_moe_checkpoint(dir, *w, {.convention = m.convention, .layer = 1, .num_shards = 2});
    const auto ck = Checkpoint::open(dir);

    const int R = 2;
    const int64_t T = 24, H = m.config.hidden;
    std::vector<Tensor> x, out_mem, out_ckpt;
    for (int r = 0; r < R; ++r) {
      x.push_back(test::random_bf16(T, H, 100 + r));
      out_mem.push_back(Tensor::empty({T, H}, DType::bf16));
      out_ckpt.push_back(Tensor::empty({T, H}, DType::bf16));
      test::poison(out_mem.back());
      test::poison(out_ckpt.back());
    }
    DispatchConfig dc;
    dc.num_max_dispatch_tokens_per_rank = static_cast<int>(T);
    auto run = [&](bool from_ckpt, std::vector<Tensor>& out) {
      auto groups = make_cpu_groups(R, 30.0);
      run_ranks(groups, [&](int r) {
        std::shared_ptr<const MoEWeights> weights = w;
        if (from_ckpt) {
          const ExpertRange range = expert_range(m.config.router.num_experts, R, r);
          const auto loaded = load_moe_layer(*ck, {.layer = 1, .expert_begin = range.begin, .expert_end = range.end});
          weights = loaded.weights;
        }
        ModularMoE layer(weights, groups[r], "naive", dc, Config{});
        layer.forward(x[r], out[r]);
      });
    };
    run(false, out_mem);
    run(true, out_ckpt);
    double max_abs = 0;
    for (int r = 0; r < R; ++r) {
      ASSERT_EQ(std::memcmp(out_mem[r].data(), out_ckpt[r].data(), static_cast<size_t>(out_mem[r].nbytes())), 0) << "rank " << r;
      for (float v : test::to_float(out_ckpt[r])) max_abs = std::max(max_abs, static_cast<double>(std::fabs(v)));
    }
    EXPECT_GT(max_abs, 0.0) << "a layer that outputs zeros proves nothing";
  }
}

/// The written files follow each convention's documented layout, checked on raw bytes (independent
/// of the loader): DeepSeek/Mixtral per-expert gate/up/down, gpt-oss interleaved MXFP4 rows whose
/// values decode as fp4(nibble) * 2^(scale - 127) with element 2j in the low nibble.
TEST(Checkpoint, WrittenTensorsFollowTheConventionLayouts) {
  {
    auto w = MoEWeights::random(preset("mixtral-8x7b-mini"), 8);
    const std::string dir = fresh("layout_mixtral");
    write_moe_checkpoint(dir, *w, {.convention = CheckpointConvention::mixtral, .layer = 0});
    const auto ck = Checkpoint::open(dir);
    const ExpertWeights& x = *w->experts[5];
    const int64_t I = x.intermediate, H = x.hidden;
    const auto w1 = ck->bytes("model.layers.0.block_sparse_moe.experts.5.w1.weight");  // gate
    const auto w3 = ck->bytes("model.layers.0.block_sparse_moe.experts.5.w3.weight");  // up
    const auto w2 = ck->bytes("model.layers.0.block_sparse_moe.experts.5.w2.weight");  // down
    EXPECT_EQ(std::memcmp(w1.data(), x.w13.data(), static_cast<size_t>(I * H * 2)), 0);
    EXPECT_EQ(std::memcmp(w3.data(), x.w13.ptr<uint8_t>() + I * H * 2, static_cast<size_t>(I * H * 2)), 0);
    EXPECT_EQ(std::memcmp(w2.data(), x.w2.data(), static_cast<size_t>(H * I * 2)), 0);
    EXPECT_EQ(ck->info("model.layers.0.block_sparse_moe.gate.weight").shape, (std::vector<int64_t>{8, H}));
  }
  {
    MoEConfig oss = preset("mixtral-8x7b-mini");
    oss.routed_format = WeightFormat::mxfp4;
    auto w = MoEWeights::random(oss, 8);
    const std::string dir = fresh("layout_oss");
    write_moe_checkpoint(dir, *w, {.convention = CheckpointConvention::gpt_oss, .layer = 0});
    const auto ck = Checkpoint::open(dir);
    const int64_t H = oss.hidden, I = oss.intermediate;
    const auto blocks = ck->bytes("model.layers.0.mlp.experts.gate_up_proj_blocks");  // [E, 2I, H/32, 16]
    const auto scales = ck->bytes("model.layers.0.mlp.experts.gate_up_proj_scales");  // [E, 2I, H/32]
    const int e = 3;
    const float* ref = w->experts[e]->w13_f32();  // [2I, H]: rows [0, I) gate, [I, 2I) up
    for (int64_t row = 0; row < 2 * I; ++row) {
      const int64_t logical = row % 2 == 0 ? row / 2 : I + row / 2;
      for (int64_t h = 0; h < H; ++h) {
        const uint8_t byte = blocks[static_cast<size_t>(((e * 2 * I + row) * (H / 32) + h / 32) * 16 + (h % 32) / 2)];
        const uint8_t nib = h % 2 == 0 ? (byte & 0xF) : (byte >> 4);
        const int exp = static_cast<int>(scales[static_cast<size_t>((e * 2 * I + row) * (H / 32) + h / 32)]) - 127;
        ASSERT_EQ(std::ldexp(fp4_e2m1_bits_to_float(nib), exp), ref[logical * H + h]) << "row " << row << " col " << h;
      }
    }
  }
}

// ---- errors ---------------------------------------------------------------------------------------

/// Rewrites model.safetensors in `dir` with `edit` applied to its entries.
void rewrite(const std::string& dir, const std::function<void(std::vector<SafetensorsEntry>&)>& edit) {
  const std::string path = (fs::path(dir) / "model.safetensors").string();
  std::vector<std::vector<uint8_t>> keep;
  std::vector<SafetensorsEntry> entries;
  {
    const SafetensorsFile f = SafetensorsFile::open(path);
    for (const std::string& n : f.names()) {
      const auto b = f.bytes(n);
      keep.emplace_back(b.begin(), b.end());
      const auto& info = f.info(n);
      entries.push_back({n, info.dtype, info.shape, nullptr, info.nbytes()});
    }
  }
  for (size_t i = 0; i < entries.size(); ++i) entries[i].data = keep[i].data();
  edit(entries);
  write_safetensors(path, entries);
}

void expect_load_error(const std::string& dir, int layer, std::initializer_list<std::string> fragments) {
  try {
    (void)load_moe_layer(dir, {.layer = layer});
    ADD_FAILURE() << "loaded without error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
  }
}

std::string written(const std::string& name, const MoEConfig& cfg, CheckpointConvention conv, int shards = 1) {
  auto w = MoEWeights::random(cfg, 4);
  const std::string dir = fresh(name);
  write_moe_checkpoint(dir, *w, {.convention = conv, .layer = 2, .num_shards = shards});
  return dir;
}

TEST(CheckpointErrors, WrongDtypeWrongShapeMissingTensorNameTheTensor) {
  const MoEConfig cfg = shrink(preset("deepseek-v3-mini"), 32);
  const std::string t = "model.layers.2.mlp.experts.5.up_proj.weight";
  {
    const std::string dir = written("dtype", cfg, CheckpointConvention::deepseek);
    rewrite(dir, [&](auto& es) { for (auto& e : es) if (e.name == t) e.dtype = "U8"; });
    expect_load_error(dir, 2, {"tensor \"" + t + "\"", "model.safetensors", "dtype = U8", "F8_E4M3"});
  }
  {
    const std::string dir = written("shape", cfg, CheckpointConvention::deepseek);
    rewrite(dir, [&](auto& es) { for (auto& e : es) if (e.name == t) e.shape = {256, 128}; });
    expect_load_error(dir, 2, {"tensor \"" + t + "\"", "shape = [256, 128]", "must be [128, 256]"});
  }
  {
    const std::string dir = written("missing", cfg, CheckpointConvention::deepseek);
    const std::string d = "model.layers.2.mlp.experts.7.down_proj.weight_scale_inv";
    rewrite(dir, [&](auto& es) { std::erase_if(es, [&](const SafetensorsEntry& e) { return e.name == d; }); });
    expect_load_error(dir, 2, {"\"" + d + "\"", "not in checkpoint"});
  }
  {
    const std::string dir = written("router_shape", shrink(preset("qwen3-30b-a3b-mini"), 8), CheckpointConvention::qwen_moe);
    const std::string g = "model.layers.2.mlp.gate.weight";
    rewrite(dir, [&](auto& es) { for (auto& e : es) if (e.name == g) e.shape = {256, 8}; });
    expect_load_error(dir, 2, {"tensor \"" + g + "\"", "shape = [256, 8]", "[8, 256]"});
  }
  {  // gpt-oss blocks of the wrong width
    MoEConfig oss = preset("mixtral-8x7b-mini");
    oss.routed_format = WeightFormat::mxfp4;
    const std::string dir = written("oss_shape", oss, CheckpointConvention::gpt_oss);
    const std::string b = "model.layers.2.mlp.experts.down_proj_blocks";
    rewrite(dir, [&](auto& es) { for (auto& e : es) if (e.name == b) e.shape = {8, 256, 8, 8}; });
    expect_load_error(dir, 2, {"tensor \"" + b + "\"", "shape = [8, 256, 8, 8]", "[8, 256, 4, 16]"});
  }
}

TEST(CheckpointErrors, BadIndexAndCorruptShardsNameTheFile) {
  const MoEConfig cfg = shrink(preset("qwen3-30b-a3b-mini"), 8);
  {  // index names a file that is not there
    const std::string dir = written("idx_missing", cfg, CheckpointConvention::qwen_moe, 2);
    fs::remove(fs::path(dir) / "model-00002-of-00002.safetensors");
    expect_load_error(dir, 2, {"model-00002-of-00002.safetensors", "does not exist"});
  }
  {  // index maps a tensor to a shard that lacks it
    const std::string dir = written("idx_wrong", cfg, CheckpointConvention::qwen_moe, 2);
    const fs::path ip = fs::path(dir) / "model.safetensors.index.json";
    json index = json::parse(std::ifstream(ip));
    const std::string g = "model.layers.2.mlp.gate.weight";
    const std::string other = index["weight_map"][g] == "model-00001-of-00002.safetensors" ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
    index["weight_map"][g] = other;
    std::ofstream(ip) << index.dump();
    expect_load_error(dir, 2, {"\"" + g + "\"", other, "does not hold it"});
  }
  {  // index that escapes the directory
    const std::string dir = written("idx_escape", cfg, CheckpointConvention::qwen_moe, 2);
    const fs::path ip = fs::path(dir) / "model.safetensors.index.json";
    json index = json::parse(std::ifstream(ip));
    index["weight_map"]["model.layers.2.mlp.gate.weight"] = "../x.safetensors";
    std::ofstream(ip) << index.dump();
    EXPECT_THROW((void)Checkpoint::open(dir), InvalidArgument);
  }
  {  // bad JSON index
    const std::string dir = written("idx_json", cfg, CheckpointConvention::qwen_moe, 2);
    std::ofstream(fs::path(dir) / "model.safetensors.index.json") << "{\"weight_map\": ";
    EXPECT_THROW((void)Checkpoint::open(dir), InvalidArgument);
  }
  {  // a truncated shard: the error names it
    const std::string dir = written("trunc", cfg, CheckpointConvention::qwen_moe, 2);
    const fs::path shard = fs::path(dir) / "model-00001-of-00002.safetensors";
    fs::resize_file(shard, fs::file_size(shard) - 100);
    expect_load_error(dir, 2, {shard.string(), "truncated"});
  }
  {  // garbage instead of a single-file checkpoint
    const std::string dir = written("garbage", cfg, CheckpointConvention::qwen_moe);
    std::ofstream(fs::path(dir) / "model.safetensors", std::ios::trunc) << "this is not a safetensors file at all";
    EXPECT_THROW((void)Checkpoint::open(dir), InvalidArgument);
  }
  EXPECT_THROW((void)Checkpoint::open(fresh("empty")), InvalidArgument);
  EXPECT_THROW((void)Checkpoint::open("/nonexistent/ckpt"), InvalidArgument);
}

TEST(CheckpointErrors, ConfigProblemsNameTheKey) {
  const MoEConfig cfg = shrink(preset("deepseek-v3-mini"), 32);
  const std::string dir = written("config", cfg, CheckpointConvention::deepseek);
  expect_load_error(dir, 1, {"layer = 1", "dense layer", "first_k_dense_replace = 2"});
  expect_load_error(dir, 3, {"layer = 3", "num_hidden_layers = 3"});
  const fs::path cp = fs::path(dir) / "config.json";
  const json good = json::parse(std::ifstream(cp));
  auto with = [&](const std::function<void(json&)>& f) {
    json c = good;
    f(c);
    std::ofstream(cp, std::ios::trunc) << c.dump();
  };
  // An omitted key takes the family's class default (DeepseekV3Config hidden_size 7168), which the tensors refute;
  // an unknown model_type has no defaults, so the key is required.
  with([](json& c) { c.erase("hidden_size"); });
  expect_load_error(dir, 2, {"model.layers.2.mlp.gate.weight", "must be [32, 7168]"});
  with([](json& c) {
    c.erase("hidden_size");
    c["model_type"] = "some_moe";
  });
  expect_load_error(dir, 2, {"hidden_size = missing"});
  with([](json& c) { c["num_experts_per_tok"] = "eight"; });
  expect_load_error(dir, 2, {"num_experts_per_tok", "must be an integer"});
  // Counts held in an int are refused past INT_MAX, never narrowed (2^32 + 32 loaded as 32 experts).
  with([](json& c) { c["n_routed_experts"] = (int64_t{1} << 32) + 32; });
  expect_load_error(dir, 2, {"n_routed_experts = 4294967328", "must fit in a 32-bit int"});
  with([](json& c) { c["num_experts_per_tok"] = (int64_t{1} << 32) + 8; });
  expect_load_error(dir, 2, {"num_experts_per_tok = 4294967304", "must fit in a 32-bit int"});
  with([](json& c) { c["hidden_size"] = 512; });
  expect_load_error(dir, 2, {"model.layers.2.mlp.gate.weight", "must be [32, 512]"});
  with([](json& c) { c["topk_method"] = "group_limited_greedy"; });
  EXPECT_THROW((void)load_moe_layer(dir, {.layer = 2}), Unsupported);
  with([](json& c) { c["quantization_config"]["weight_block_size"] = {64, 64}; });
  EXPECT_THROW((void)load_moe_layer(dir, {.layer = 2}), Unsupported);
  with([](json& c) { c["n_group"] = 5; });  // 32 experts do not split into 5 groups
  expect_load_error(dir, 2, {"n_group", "config.json"});
  fs::remove(cp);
  expect_load_error(dir, 2, {"config.json", "must exist"});
  std::ofstream(cp) << "{not json";
  EXPECT_THROW((void)Checkpoint::open(dir), InvalidArgument);
}

TEST(CheckpointErrors, WriterRejectsWhatAConventionCannotHold) {
  auto ds = MoEWeights::random(shrink(preset("deepseek-v3-mini"), 32), 1);
  EXPECT_THROW(write_moe_checkpoint(fresh("w1"), *ds, {.convention = CheckpointConvention::mixtral}), InvalidArgument);  // sigmoid router
  auto part = MoEWeights::random(shrink(preset("qwen3-30b-a3b-mini"), 8), 1, 0, 4);
  EXPECT_THROW(write_moe_checkpoint(fresh("w2"), *part, {.convention = CheckpointConvention::qwen_moe}), InvalidArgument);  // experts missing
  auto mx = MoEWeights::random(preset("mixtral-8x7b-mini"), 1);
  EXPECT_THROW(write_moe_checkpoint(fresh("w3"), *mx, {.convention = CheckpointConvention::mixtral, .router_dtype = "F8"}), InvalidArgument);
  EXPECT_EQ(parse_checkpoint_convention("gpt_oss"), CheckpointConvention::gpt_oss);
  EXPECT_THROW((void)parse_checkpoint_convention("llama"), InvalidArgument);
}

}  // namespace
}  // namespace epx
