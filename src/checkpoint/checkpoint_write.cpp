// checkpoint/checkpoint_write.cpp: writes one MoE layer as a checkpoint in a real naming convention
// (the inverse of moe_layer.cpp), for tests and demo inputs. The bytes of every expert tensor are
// the ExpertWeights' own, so a load gives back exactly what was written.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint/matrix.h"
#include "epx/checkpoint.h"
#include "epx/error.h"

namespace epx {

namespace {

using json = nlohmann::json;
using ckpt::Matrix;
constexpr std::string_view kOp = "write_moe_checkpoint";

struct Out {
  std::vector<Tensor> keep;  // owns every buffer an entry points at
  std::vector<SafetensorsEntry> entries;

  void add(const std::string& name, const Tensor& t, const std::string& dtype = {}) {
    keep.push_back(t);
    entries.push_back(SafetensorsEntry::from(name, keep.back(), dtype));
  }
  /// A tensor whose stored shape differs from its epx view (gpt-oss 4-D blocks): same bytes.
  void add_shaped(const std::string& name, const Tensor& t, const std::string& dtype, std::vector<int64_t> shape) {
    keep.push_back(t);
    SafetensorsEntry e;
    e.name = name;
    e.dtype = dtype;
    e.shape = std::move(shape);
    e.data = keep.back().data();
    e.nbytes = static_cast<uint64_t>(keep.back().nbytes());
    entries.push_back(std::move(e));
  }
};

Matrix w13_part(const ExpertWeights& w, bool up) {
  const Matrix all{w.w13, w.w13_scale};
  const int64_t I = w.intermediate;
  return ckpt::rows_of(all, w.format, up ? I : 0, up ? 2 * I : I);
}

/// One per-expert matrix as the convention stores it: "<base>.weight" (+ _scale_inv / _scale).
void add_matrix(Out& out, const std::string& weight, const Matrix& m, WeightFormat f) {
  if (f == WeightFormat::bf16) {
    out.add(weight, m.w);
  } else if (f == WeightFormat::fp8_block) {
    out.add(weight, m.w, "F8_E4M3");
    out.add(weight + "_scale_inv", m.scale, "F32");
  } else {
    out.add(weight, m.w, "U8");
    out.add(weight + "_scale", m.scale, "U8");
  }
}

void add_expert(Out& out, const std::string& base, const char* gate, const char* up, const char* down, const ExpertWeights& w) {
  add_matrix(out, base + gate + ".weight", w13_part(w, false), w.format);
  add_matrix(out, base + up + ".weight", w13_part(w, true), w.format);
  add_matrix(out, base + down + ".weight", Matrix{w.w2, w.w2_scale}, w.format);
}

Tensor f32_as(const Tensor& t, const std::string& dtype) {
  if (dtype == "F32") return t;
  Tensor out = Tensor::empty({t.numel()}, DType::bf16);
  for (int64_t i = 0; i < t.numel(); ++i) out.ptr<uint16_t>()[i] = float_to_bf16_bits(t.ptr<const float>()[i]);
  return out;
}

Tensor reshaped(const Tensor& t, std::vector<int64_t> shape) {
  Tensor out = Tensor::empty(std::move(shape), t.dtype());
  EPX_ASSERT(out.nbytes() == t.nbytes(), "reshape ", t.view().describe());
  if (t.nbytes() > 0) std::memcpy(out.data(), t.data(), static_cast<size_t>(t.nbytes()));
  return out;
}

}  // namespace

void write_moe_checkpoint(const std::string& dir, const MoEWeights& w, const CheckpointWriteOptions& o) {
  const MoEConfig& m = w.config;
  const RouterConfig& rc = m.router;
  const int E = rc.num_experts;
  const int64_t H = m.hidden, I = m.intermediate;
  const CheckpointConvention conv = o.convention;
  const std::string conv_name(checkpoint_convention_name(conv));
  require_arg(kOp, "layer", o.layer, o.layer >= 0, "must be >= 0");
  require_arg(kOp, "num_shards", o.num_shards, o.num_shards >= 1 && o.num_shards <= 99999, "must be in [1, 99999]");
  require_arg(kOp, "router_dtype", o.router_dtype, o.router_dtype == "BF16" || o.router_dtype == "F32", "must be BF16 or F32");
  require_arg(kOp, "weights.experts.size", w.experts.size(), w.experts.size() == static_cast<size_t>(E), "must equal num_experts");
  for (int e = 0; e < E; ++e) require_arg(kOp, "weights.experts[" + std::to_string(e) + "]", "null", w.experts[e] != nullptr, "must be set (write every expert)");
  require_arg(kOp, "weights.router_weight", w.router_weight.view().describe(), w.router_weight.defined() && w.router_weight.numel() == E * H, "must be [E, H] fp32");
  const bool shared = m.num_shared_experts > 0;
  if (shared) require_arg(kOp, "weights.shared", "null", w.shared != nullptr, "must be set: the model has a shared expert");
  if (conv != CheckpointConvention::deepseek) {
    require_arg(kOp, "router.scoring", "sigmoid", rc.scoring == ScoringFunc::softmax, conv_name + " routes with softmax");
    require_arg(kOp, "router.n_group", rc.n_group, rc.n_group == 1, conv_name + " has no expert groups");
    require_arg(kOp, "router.routed_scaling_factor", rc.routed_scaling_factor, rc.routed_scaling_factor == 1.0f, conv_name + " does not scale");
  }
  if (conv == CheckpointConvention::mixtral || conv == CheckpointConvention::gpt_oss) {
    require_arg(kOp, "router.renormalize", rc.renormalize, rc.renormalize, conv_name + " always renormalises the top-k");
    require_arg(kOp, "num_shared_experts", m.num_shared_experts, !shared, conv_name + " has no shared expert");
  }
  if (conv == CheckpointConvention::qwen_moe)
    require_arg(kOp, "shared_gate", m.shared_gate, !shared || m.shared_gate, "a Qwen2-MoE shared expert always has its sigmoid gate");
  if (conv == CheckpointConvention::deepseek) {
    require_arg(kOp, "shared_gate", m.shared_gate, !m.shared_gate, "DeepSeek's shared experts have no gate");
    if (shared)
      require_arg(kOp, "shared_intermediate", m.shared_intermediate, m.shared_intermediate % I == 0,
                  "must be n_shared_experts x moe_intermediate_size = a multiple of " + std::to_string(I));
  }
  if (conv == CheckpointConvention::gpt_oss)
    require_arg(kOp, "routed_format", weight_format_name(m.routed_format), m.routed_format != WeightFormat::fp8_block, "gpt-oss stores mxfp4 or bf16 experts");
  if (conv == CheckpointConvention::mixtral || conv == CheckpointConvention::qwen_moe)
    require_arg(kOp, "routed_format", weight_format_name(m.routed_format), m.routed_format != WeightFormat::mxfp4,
                conv_name + " checkpoints hold bf16 or fp8_block experts");

  if (o.fused_experts) {
    require_arg(kOp, "fused_experts", "true", conv != CheckpointConvention::gpt_oss, "gpt-oss has one stacked layout (set false)");
    require_arg(kOp, "routed_format", weight_format_name(m.routed_format), m.routed_format == WeightFormat::bf16,
                "must be bf16 for fused (transformers 5.x) experts");
  }
  const std::string L = "model.layers." + std::to_string(o.layer) + ".";
  const std::string mlp = L + (conv == CheckpointConvention::mixtral && !o.fused_experts ? "block_sparse_moe." : "mlp.");
  Out out;

  // Router.
  out.add(mlp + (conv == CheckpointConvention::gpt_oss ? "router.weight" : "gate.weight"), reshaped(f32_as(w.router_weight, o.router_dtype), {E, H}));
  if (conv == CheckpointConvention::deepseek && rc.use_correction_bias) out.add(mlp + "gate.e_score_correction_bias", w.correction_bias, "F32");

  // Experts.
  if (conv == CheckpointConvention::gpt_oss) {
    if (m.routed_format == WeightFormat::mxfp4) {
      Tensor gub = Tensor::empty({E, 2 * I, H / 2}, DType::uint8), gus = Tensor::empty({E, 2 * I, H / 32}, DType::uint8);
      Tensor db = Tensor::empty({E, H, I / 2}, DType::uint8), ds = Tensor::empty({E, H, I / 32}, DType::uint8);
      const size_t brow = static_cast<size_t>(H / 2), srow = static_cast<size_t>(H / 32);
      for (int e = 0; e < E; ++e) {
        const ExpertWeights& x = *w.experts[e];
        for (int64_t i = 0; i < 2 * I; ++i) {  // interleave: row 2j = gate j, 2j+1 = up j
          const int64_t src = i % 2 == 0 ? i / 2 : I + i / 2;
          std::memcpy(gub.ptr<uint8_t>() + (e * 2 * I + i) * brow, x.w13.ptr<const uint8_t>() + src * brow, brow);
          std::memcpy(gus.ptr<uint8_t>() + (e * 2 * I + i) * srow, x.w13_scale.ptr<const uint8_t>() + src * srow, srow);
        }
        std::memcpy(db.ptr<uint8_t>() + e * H * (I / 2), x.w2.data(), static_cast<size_t>(x.w2.nbytes()));
        std::memcpy(ds.ptr<uint8_t>() + e * H * (I / 32), x.w2_scale.data(), static_cast<size_t>(x.w2_scale.nbytes()));
      }
      out.add_shaped(mlp + "experts.gate_up_proj_blocks", gub, "U8", {E, 2 * I, H / 32, 16});
      out.add_shaped(mlp + "experts.gate_up_proj_scales", gus, "U8", {E, 2 * I, H / 32});
      out.add_shaped(mlp + "experts.down_proj_blocks", db, "U8", {E, H, I / 32, 16});
      out.add_shaped(mlp + "experts.down_proj_scales", ds, "U8", {E, H, I / 32});
    } else {
      Tensor gu = Tensor::empty({E, H, 2 * I}, DType::bf16), dn = Tensor::empty({E, I, H}, DType::bf16);
      for (int e = 0; e < E; ++e) {
        const ExpertWeights& x = *w.experts[e];
        const uint16_t* a = x.w13.ptr<const uint16_t>();
        const uint16_t* b = x.w2.ptr<const uint16_t>();
        for (int64_t h = 0; h < H; ++h)
          for (int64_t c = 0; c < 2 * I; ++c) gu.ptr<uint16_t>()[(e * H + h) * 2 * I + c] = a[(c % 2 == 0 ? c / 2 : I + c / 2) * H + h];
        for (int64_t i = 0; i < I; ++i)
          for (int64_t h = 0; h < H; ++h) dn.ptr<uint16_t>()[(e * I + i) * H + h] = b[h * I + i];
      }
      out.add(mlp + "experts.gate_up_proj", gu);
      out.add(mlp + "experts.down_proj", dn);
    }
    // Biases in router_dtype (BF16 as the released checkpoints, F32 exact), gate_up interleaved as the weight.
    Tensor gb = Tensor::zeros({E * 2 * I}, DType::fp32), db = Tensor::zeros({E * H}, DType::fp32);
    for (int e = 0; e < E; ++e) {
      const ExpertWeights& x = *w.experts[e];
      if (x.b13.defined())
        for (int64_t c = 0; c < 2 * I; ++c) gb.ptr<float>()[e * 2 * I + c] = x.b13.ptr<const float>()[c % 2 == 0 ? c / 2 : I + c / 2];
      if (x.b2.defined()) std::memcpy(db.ptr<float>() + e * H, x.b2.ptr<const float>(), static_cast<size_t>(H) * 4);
    }
    out.add(mlp + "experts.gate_up_proj_bias", reshaped(f32_as(gb, o.router_dtype), {E, 2 * I}));
    out.add(mlp + "experts.down_proj_bias", reshaped(f32_as(db, o.router_dtype), {E, H}));
    const Tensor rb = w.router_bias.defined() ? w.router_bias : Tensor::zeros({E}, DType::fp32);
    out.add(mlp + "router.bias", reshaped(f32_as(rb, o.router_dtype), {E}));
  } else if (o.fused_experts) {
    Tensor gu = Tensor::empty({E, 2 * I, H}, DType::bf16), dn = Tensor::empty({E, H, I}, DType::bf16);
    for (int e = 0; e < E; ++e) {  // w13 = [gate; up] and w2 are the fused tensors' per-expert slices as they are
      std::memcpy(gu.ptr<uint16_t>() + e * 2 * I * H, w.experts[e]->w13.data(), static_cast<size_t>(2 * I * H * 2));
      std::memcpy(dn.ptr<uint16_t>() + e * H * I, w.experts[e]->w2.data(), static_cast<size_t>(H * I * 2));
    }
    out.add(mlp + "experts.gate_up_proj", gu);
    out.add(mlp + "experts.down_proj", dn);
  } else {
    const bool mix = conv == CheckpointConvention::mixtral;
    for (int e = 0; e < E; ++e)
      add_expert(out, mlp + "experts." + std::to_string(e) + ".", mix ? "w1" : "gate_proj", mix ? "w3" : "up_proj", mix ? "w2" : "down_proj", *w.experts[e]);
  }
  if (shared) {
    add_expert(out, mlp + (conv == CheckpointConvention::deepseek ? "shared_experts." : "shared_expert."), "gate_proj", "up_proj", "down_proj", *w.shared);
    if (m.shared_gate) out.add(mlp + "shared_expert_gate.weight", reshaped(f32_as(w.shared_gate_weight, o.router_dtype), {1, H}));
  }

  // config.json.
  json c;
  c["num_hidden_layers"] = o.layer + 1;
  c["hidden_size"] = H;
  c["num_experts_per_tok"] = rc.top_k;
  c["torch_dtype"] = "bfloat16";
  const bool fp8 = m.routed_format == WeightFormat::fp8_block || (shared && m.shared_format == WeightFormat::fp8_block);
  if (fp8) c["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"}, {"weight_block_size", {128, 128}}};
  std::string model_type = o.model_type;
  switch (conv) {
    case CheckpointConvention::deepseek:
      if (model_type.empty()) model_type = m.routed_format == WeightFormat::mxfp4 ? "deepseek_v4" : "deepseek_v3";
      c["architectures"] = {"DeepseekV3ForCausalLM"};
      c["moe_intermediate_size"] = I;
      c["intermediate_size"] = 4 * I;  // the dense layers' width; must not be read for the MoE layer
      c["n_routed_experts"] = E;
      c["n_group"] = rc.n_group;
      c["topk_group"] = rc.topk_group;
      c["routed_scaling_factor"] = rc.routed_scaling_factor;
      c["scoring_func"] = rc.scoring == ScoringFunc::sigmoid ? "sigmoid" : "softmax";
      c["topk_method"] = rc.use_correction_bias ? "noaux_tc" : "greedy";
      c["norm_topk_prob"] = rc.renormalize;
      c["n_shared_experts"] = shared ? m.shared_intermediate / I : 0;
      c["first_k_dense_replace"] = o.layer;  // the layers before this one are dense, as in DeepSeek-V3 (3)
      c["moe_layer_freq"] = 1;
      if (m.routed_format == WeightFormat::mxfp4) c["expert_dtype"] = "fp4";
      break;
    case CheckpointConvention::qwen_moe:
      if (model_type.empty()) model_type = shared ? "qwen2_moe" : "qwen3_moe";
      c["architectures"] = {shared ? "Qwen2MoeForCausalLM" : "Qwen3MoeForCausalLM"};
      c["moe_intermediate_size"] = I;
      c["intermediate_size"] = 4 * I;
      c["num_experts"] = E;
      c["norm_topk_prob"] = rc.renormalize;
      c["decoder_sparse_step"] = 1;
      c["mlp_only_layers"] = json::array();
      c["shared_expert_intermediate_size"] = shared ? m.shared_intermediate : 0;
      break;
    case CheckpointConvention::mixtral:
      if (model_type.empty()) model_type = "mixtral";
      c["architectures"] = {"MixtralForCausalLM"};
      c["intermediate_size"] = I;
      c["num_local_experts"] = E;
      break;
    case CheckpointConvention::gpt_oss:
      if (model_type.empty()) model_type = "gpt_oss";
      c["architectures"] = {"GptOssForCausalLM"};
      c["intermediate_size"] = I;
      c["num_local_experts"] = E;
      c["experts_per_token"] = rc.top_k;
      c["swiglu_limit"] = w.experts[0]->activation.kind == ExpertActivation::Kind::gpt_oss_glu ? w.experts[0]->activation.limit : 7.0f;
      if (m.routed_format == WeightFormat::mxfp4) c["quantization_config"] = {{"quant_method", "mxfp4"}};
      break;
  }
  c["model_type"] = model_type;

  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir)) throw Error(arg_message(kOp, "dir", dir, "cannot be created"));
  {
    std::ofstream f(fs::path(dir) / "config.json");
    f << c.dump(2) << "\n";
    if (!f) throw Error(arg_message(kOp, "dir", dir, "config.json cannot be written"));
  }
  std::sort(out.entries.begin(), out.entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) { return a.name < b.name; });
  if (o.num_shards == 1) {
    write_safetensors((fs::path(dir) / "model.safetensors").string(), out.entries, {{"format", "pt"}});
    return;
  }
  std::vector<std::vector<SafetensorsEntry>> shards(static_cast<size_t>(o.num_shards));
  json index;
  uint64_t total = 0;
  for (size_t i = 0; i < out.entries.size(); ++i) {
    const size_t s = i % shards.size();
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05d.safetensors", s + 1, o.num_shards);
    index["weight_map"][out.entries[i].name] = name;
    total += out.entries[i].nbytes;
    shards[s].push_back(out.entries[i]);
  }
  index["metadata"] = {{"total_size", total}};
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05d.safetensors", s + 1, o.num_shards);
    write_safetensors((fs::path(dir) / name).string(), shards[s], {{"format", "pt"}});
  }
  std::ofstream f(fs::path(dir) / "model.safetensors.index.json");
  f << index.dump(2) << "\n";
  if (!f) throw Error(arg_message(kOp, "dir", dir, "model.safetensors.index.json cannot be written"));
}

}  // namespace epx
