// moe/presets.cpp: one MoE layer of public models, from their Hugging Face config.json.
//
// Field names in the comments are the config.json keys the value comes from. Each preset has a
// "-mini" twin with the same routing (E, K, groups, scaling, scoring, formats, shared expert and
// gate) but hidden 256 and intermediate 128, so a whole layer step takes milliseconds on a CPU.
// 256 and 128 keep every format's constraints: fp8_block needs multiples of 128, mxfp4 of 32.
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/moe.h"

namespace epx {
namespace {

constexpr int64_t kMiniHidden = 256;
constexpr int64_t kMiniIntermediate = 128;

RouterConfig softmax_router(int num_experts, int top_k, bool renormalize) {
  RouterConfig r;
  r.num_experts = num_experts;
  r.top_k = top_k;
  r.scoring = ScoringFunc::softmax;
  r.renormalize = renormalize;
  return r;
}

RouterConfig noaux_tc_router(int num_experts, int top_k, int n_group, int topk_group, float scaling) {
  RouterConfig r;
  r.num_experts = num_experts;
  r.top_k = top_k;
  r.scoring = ScoringFunc::sigmoid;
  r.renormalize = true;
  r.n_group = n_group;
  r.topk_group = topk_group;
  r.routed_scaling_factor = scaling;
  r.use_correction_bias = true;
  return r;
}

// deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, moe_intermediate_size 2048,
// n_routed_experts 256, num_experts_per_tok 8, scoring_func "sigmoid", topk_method "noaux_tc",
// n_group 8, topk_group 4, routed_scaling_factor 2.5, norm_topk_prob true, n_shared_experts 1
// (shared width = n_shared_experts * moe_intermediate_size), quantization_config
// {quant_method "fp8", fmt "e4m3", weight_block_size [128, 128]} for routed and shared alike.
MoEConfig deepseek_v3() {
  MoEConfig c;
  c.name = "deepseek-v3";
  c.hidden = 7168;
  c.intermediate = 2048;
  c.router = noaux_tc_router(256, 8, 8, 4, 2.5f);
  c.num_shared_experts = 1;
  c.shared_intermediate = 2048;
  c.routed_format = WeightFormat::fp8_block;
  c.shared_format = WeightFormat::fp8_block;
  return c;
}

// DeepSeek-V4-Pro MoE layer: hidden 7168, expert width 3072, 384 routed experts, top-6, one shared
// expert of width 3072; routed experts in MXFP4 and the shared expert in FP8 blocks, the
// heterogeneous case FHMoE fuses. The router values below (sigmoid noaux_tc with
// e_score_correction_bias, n_group 1 / topk_group 1, routed_scaling_factor 2.5, norm_topk_prob)
// are OUR ASSUMPTION, carried over from DeepSeek-V3, until the public config.json states them.
MoEConfig deepseek_v4_pro() {
  MoEConfig c;
  c.name = "deepseek-v4-pro";
  c.hidden = 7168;
  c.intermediate = 3072;
  c.router = noaux_tc_router(384, 6, 1, 1, 2.5f);
  c.num_shared_experts = 1;
  c.shared_intermediate = 3072;
  c.routed_format = WeightFormat::mxfp4;
  c.shared_format = WeightFormat::fp8_block;
  return c;
}

// Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, moe_intermediate_size 768, num_experts 128,
// num_experts_per_tok 8, norm_topk_prob true (softmax, then renormalised); no shared expert;
// torch_dtype bfloat16.
MoEConfig qwen3_30b_a3b() {
  MoEConfig c;
  c.name = "qwen3-30b-a3b";
  c.hidden = 2048;
  c.intermediate = 768;
  c.router = softmax_router(128, 8, true);
  return c;
}

// mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size 4096, intermediate_size 14336,
// num_local_experts 8, num_experts_per_tok 2; modeling_mixtral.py renormalises the top-2 softmax
// probabilities; no shared expert; torch_dtype bfloat16.
MoEConfig mixtral_8x7b() {
  MoEConfig c;
  c.name = "mixtral-8x7b";
  c.hidden = 4096;
  c.intermediate = 14336;
  c.router = softmax_router(8, 2, true);
  return c;
}

// Qwen/Qwen1.5-MoE-A2.7B config.json: hidden_size 2048, moe_intermediate_size 1408, num_experts 60,
// num_experts_per_tok 4, norm_topk_prob false (raw softmax probabilities),
// shared_expert_intermediate_size 5632; modeling_qwen2_moe.py scales the shared expert's output by
// sigmoid(shared_expert_gate(x)), a [1, H] linear. torch_dtype bfloat16.
MoEConfig qwen15_moe_a27b() {
  MoEConfig c;
  c.name = "qwen1.5-moe-a2.7b";
  c.hidden = 2048;
  c.intermediate = 1408;
  c.router = softmax_router(60, 4, false);
  c.num_shared_experts = 1;
  c.shared_intermediate = 5632;
  c.shared_gate = true;
  return c;
}

// The "-mini" twin. Qwen1.5's shared expert is 4x an expert's width in the real model; its mini
// keeps it wider than the routed experts (256) so a shared/routed mix-up shows in tests.
MoEConfig mini(MoEConfig c) {
  c.name += "-mini";
  c.hidden = kMiniHidden;
  c.intermediate = kMiniIntermediate;
  if (c.num_shared_experts > 0) c.shared_intermediate = c.shared_gate ? 2 * kMiniIntermediate : kMiniIntermediate;
  return c;
}

std::vector<MoEConfig> full_presets() {
  return {deepseek_v3(), deepseek_v4_pro(), qwen3_30b_a3b(), mixtral_8x7b(), qwen15_moe_a27b()};
}

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const MoEConfig& c : full_presets()) {
    names.push_back(c.name);
    names.push_back(c.name + "-mini");
  }
  return names;
}

MoEConfig preset(const std::string& name) {
  for (const MoEConfig& c : full_presets()) {
    if (c.name == name) return c;
    if (c.name + "-mini" == name) return mini(c);
  }
  std::string known;
  for (const std::string& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw InvalidArgument(arg_message("preset", "name", name, "unknown preset; known: " + known));
}

}  // namespace epx
