// checkpoint/moe_layer.cpp: one MoE layer of a Hugging Face checkpoint -> MoEWeights.
//
// config.json keys and defaults follow the transformers configuration classes of each model
// (DeepseekV3Config, Qwen3MoeConfig / Qwen2MoeConfig, MixtralConfig, GptOssConfig); the tensor
// names are those their modeling files register (docs/checkpoint.md lists them). gpt-oss's MXFP4
// layout follows transformers integrations/mxfp4.py (Mxfp4GptOssExperts, convert_moe_packed_tensors):
// gate_up_proj_blocks [E, 2I, H/32, 16] U8 (two e2m1 per byte, element 2j in the low nibble),
// gate_up_proj_scales [E, 2I, H/32] U8 (e8m0, exponent bias 127), down_proj_* [E, H, I/32, (16)];
// the 2I rows interleave gate and up (modeling_gpt_oss.py: gate, up = gate_up[..., ::2],
// gate_up[..., 1::2]), so checkpoint row 2i is gate row i and row 2i+1 is up row i.
#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "checkpoint/matrix.h"
#include "epx/checkpoint.h"
#include "epx/error.h"
#include "epx/routing.h"

namespace epx {

namespace {

using json = nlohmann::json;
using ckpt::Matrix;
constexpr std::string_view kOp = "checkpoint.load_moe_layer";

std::string quote_name(const std::string& s) { return "\"" + s + "\""; }
std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}
bool one_of(const std::string& v, std::initializer_list<const char*> set) {
  for (const char* s : set)
    if (v == s) return true;
  return false;
}

// ---- config.json --------------------------------------------------------------------------------

struct ConfigReader {
  json j;
  std::string path;

  const json* find(std::initializer_list<const char*> keys, std::string* which = nullptr) const {
    for (const char* k : keys)
      if (j.contains(k) && !j[k].is_null()) {
        if (which) *which = k;
        return &j[k];
      }
    return nullptr;
  }
  static std::string key_list(std::initializer_list<const char*> keys) {
    std::string s;
    for (const char* k : keys) s += (s.empty() ? "" : " / ") + std::string(k);
    return s;
  }
  int64_t integer(std::initializer_list<const char*> keys, std::optional<int64_t> def = std::nullopt) const {
    std::string k;
    const json* v = find(keys, &k);
    if (!v) {
      if (def) return *def;
      throw InvalidArgument(arg_message(kOp, path + " " + key_list(keys), "missing", "required for an MoE layer"));
    }
    if (!v->is_number_integer()) throw InvalidArgument(arg_message(kOp, path + " " + k, v->dump(), "must be an integer"));
    return v->get<int64_t>();
  }
  /// integer() for a count held in an int (experts, top-k, layers): a value past INT_MAX is refused,
  /// never narrowed (n_routed_experts = 2^32 + 32 would otherwise load as 32 experts).
  int int32(std::initializer_list<const char*> keys, std::optional<int64_t> def = std::nullopt) const {
    const int64_t v = integer(keys, def);
    std::string k;
    if (!find(keys, &k)) k = key_list(keys);
    require_arg(kOp, path + " " + k, v, v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(),
                "must fit in a 32-bit int (at most " + std::to_string(std::numeric_limits<int>::max()) + ")");
    return static_cast<int>(v);
  }
  double number(const char* key, double def) const {
    const json* v = find({key});
    if (!v) return def;
    if (!v->is_number()) throw InvalidArgument(arg_message(kOp, path + " " + key, v->dump(), "must be a number"));
    return v->get<double>();
  }
  bool boolean(const char* key, bool def) const {
    const json* v = find({key});
    if (!v) return def;
    if (!v->is_boolean()) throw InvalidArgument(arg_message(kOp, path + " " + key, v->dump(), "must be true or false"));
    return v->get<bool>();
  }
  std::string string(const char* key, const std::string& def) const {
    const json* v = find({key});
    if (!v) return def;
    if (!v->is_string()) throw InvalidArgument(arg_message(kOp, path + " " + key, v->dump(), "must be a string"));
    return v->get<std::string>();
  }
};

ConfigReader read_config(const Checkpoint& ck) {
  ConfigReader c;
  c.path = ck.dir() + "/config.json";
  if (ck.config_json().empty())
    throw InvalidArgument(arg_message(kOp, "config.json", c.path, "must exist: it gives the layer's shape and router"));
  c.j = json::parse(ck.config_json());  // validated by Checkpoint::open
  if (!c.j.is_object()) throw InvalidArgument(arg_message(kOp, c.path, c.j.type_name(), "must be a JSON object"));
  return c;
}

// ---- tensor names -------------------------------------------------------------------------------

enum class Proj { gate, up, down };

struct Names {
  CheckpointConvention conv;
  std::string prefix;  // "model.layers.N.mlp." or "model.layers.N.block_sparse_moe."

  std::string proj_name(Proj p) const {
    if (conv == CheckpointConvention::mixtral) return p == Proj::gate ? "w1" : p == Proj::up ? "w3" : "w2";
    return p == Proj::gate ? "gate_proj" : p == Proj::up ? "up_proj" : "down_proj";
  }
  std::string expert(int e, Proj p) const { return prefix + "experts." + std::to_string(e) + "." + proj_name(p) + ".weight"; }
  std::string shared(Proj p) const {
    return prefix + (conv == CheckpointConvention::deepseek ? "shared_experts." : "shared_expert.") + proj_name(p) + ".weight";
  }
  std::string router() const { return prefix + (conv == CheckpointConvention::gpt_oss ? "router.weight" : "gate.weight"); }
  std::string router_bias() const { return prefix + "router.bias"; }  // gpt-oss
  std::string correction_bias() const { return prefix + "gate.e_score_correction_bias"; }
  std::string shared_gate() const { return prefix + "shared_expert_gate.weight"; }
  std::string packed(const char* what) const { return prefix + "experts." + what; }  // gpt-oss stacked / 5.x fused tensors
};

// ---- per-family defaults -------------------------------------------------------------------------

/// What a transformers configuration class gives a key config.json omits (DeepseekV3Config,
/// Qwen3MoeConfig, Qwen2MoeConfig, MixtralConfig, GptOssConfig). Unset = required (unknown model_type).
struct FamilyDefaults {
  std::optional<int64_t> hidden, intermediate, num_experts, top_k, n_shared, n_group, topk_group, first_dense, shared_inter;
  std::optional<double> scaling;
  std::optional<bool> norm_topk_prob;
};

FamilyDefaults family_defaults(const std::string& model_type) {
  FamilyDefaults d;
  if (model_type == "deepseek_v3") {  // DeepseekV3Config.__init__
    d.hidden = 7168, d.intermediate = 2048, d.num_experts = 256, d.top_k = 8, d.n_shared = 1, d.n_group = 8, d.topk_group = 4;
    d.first_dense = 3, d.scaling = 2.5, d.norm_topk_prob = true;
  } else if (model_type == "qwen3_moe") {  // Qwen3MoeConfig
    d.hidden = 2048, d.intermediate = 768, d.num_experts = 128, d.top_k = 8, d.norm_topk_prob = false;
  } else if (model_type == "qwen2_moe") {  // Qwen2MoeConfig
    d.hidden = 2048, d.intermediate = 1408, d.num_experts = 60, d.top_k = 4, d.shared_inter = 5632, d.norm_topk_prob = false;
  } else if (model_type == "mixtral") {  // MixtralConfig
    d.hidden = 4096, d.intermediate = 14336, d.num_experts = 8, d.top_k = 2;
  } else if (model_type == "gpt_oss") {  // GptOssConfig
    d.hidden = 2880, d.intermediate = 2880, d.num_experts = 128, d.top_k = 4;
  }
  return d;
}

std::string layer_prefix(CheckpointConvention c, int layer) {
  return "model.layers." + std::to_string(layer) + (c == CheckpointConvention::mixtral ? ".block_sparse_moe." : ".mlp.");
}

/// Mixtral's block is "block_sparse_moe." in 4.x checkpoints and "mlp." in what transformers 5.x
/// writes (conversion_mapping.py renames it); the router tells which one this checkpoint has.
std::string checkpoint_prefix(const Checkpoint& ck, CheckpointConvention c, int layer) {
  if (c == CheckpointConvention::mixtral && !ck.contains(layer_prefix(c, layer) + "gate.weight") &&
      ck.contains(layer_prefix(CheckpointConvention::deepseek, layer) + "gate.weight"))
    return layer_prefix(CheckpointConvention::deepseek, layer);
  return layer_prefix(c, layer);
}

// ---- checked reads -------------------------------------------------------------------------------

struct Reader {
  const Checkpoint& ck;
  std::vector<std::string>* notes;

  [[noreturn]] void bad(const std::string& name, const std::string& what, const std::string& value, const std::string& rule) const {
    std::string where;
    try {
      where = " (" + ck.file_of(name) + ")";
    } catch (const Error&) {
    }
    throw InvalidArgument(arg_message(kOp, "tensor " + quote_name(name) + where + " " + what, value, rule));
  }
  const SafetensorsTensorInfo& info(const std::string& name) const { return ck.info(name); }
  /// info() after checking dtype in `dtypes` and shape == `shape` (the rule names `why`).
  const SafetensorsTensorInfo& checked(const std::string& name, std::initializer_list<const char*> dtypes,
                                       const std::vector<int64_t>& shape, const std::string& why) const {
    const SafetensorsTensorInfo& t = ck.info(name);
    if (!one_of(t.dtype, dtypes)) {
      std::string list;
      for (const char* d : dtypes) list += (list.empty() ? "" : ", ") + std::string(d);
      bad(name, "dtype", t.dtype, "must be one of " + list + " (" + why + ")");
    }
    if (t.shape != shape) bad(name, "shape", shape_text(t.shape), "must be " + shape_text(shape) + " (" + why + ")");
    return t;
  }
};

/// Element i of a float tensor's bytes (BF16/F16/F32), whatever the alignment.
float float_at(const uint8_t* p, const std::string& dtype, int64_t i) {
  if (dtype == "F32") {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return dtype == "BF16" ? bf16_bits_to_float(h) : fp16_bits_to_float(h);
}

/// [n] floats (BF16/F16/F32) at `p` into bf16 (RNE) or fp32.
void convert_floats(const uint8_t* p, const std::string& dtype, int64_t n, const Tensor& out) {
  if (out.dtype() == DType::bf16 && dtype == "BF16") {
    if (n > 0) std::memcpy(out.data(), p, static_cast<size_t>(2 * n));
  } else if (out.dtype() == DType::fp32 && dtype == "F32") {
    if (n > 0) std::memcpy(out.data(), p, static_cast<size_t>(4 * n));
  } else if (out.dtype() == DType::bf16) {
    uint16_t* o = out.ptr<uint16_t>();
    for (int64_t i = 0; i < n; ++i) o[i] = float_to_bf16_bits(float_at(p, dtype, i));
  } else {
    float* o = out.ptr<float>();
    for (int64_t i = 0; i < n; ++i) o[i] = float_at(p, dtype, i);
  }
}

/// A float tensor of `shape` into fp32 (router, biases, scales).
Tensor read_f32(const Reader& r, const std::string& name, const std::vector<int64_t>& shape, const std::string& why) {
  const SafetensorsTensorInfo& t = r.checked(name, {"F32", "BF16", "F16"}, shape, why);
  Tensor out = Tensor::empty(shape, DType::fp32);
  convert_floats(r.ck.bytes(name).data(), t.dtype, t.numel(), out);
  return out;
}

// ---- formats ----------------------------------------------------------------------------------------

/// Format of a per-expert weight from its dtype and the scale tensor beside it.
WeightFormat detect_format(const Reader& r, const std::string& weight) {
  const SafetensorsTensorInfo& t = r.info(weight);
  if (one_of(t.dtype, {"BF16", "F16", "F32"})) return WeightFormat::bf16;
  if (t.dtype == "F8_E4M3") {
    if (!r.ck.contains(weight + "_scale_inv"))
      r.bad(weight, "dtype", t.dtype, "needs its block scales " + quote_name(weight + "_scale_inv") + ", which the checkpoint lacks");
    return WeightFormat::fp8_block;
  }
  if (one_of(t.dtype, {"U8", "I8"})) {
    if (!r.ck.contains(weight + "_scale"))
      r.bad(weight, "dtype", t.dtype, "is packed fp4 and needs its MX scales " + quote_name(weight + "_scale") + ", which the checkpoint lacks");
    return WeightFormat::mxfp4;
  }
  r.bad(weight, "dtype", t.dtype,
        "must be BF16, F16 or F32 (bf16), F8_E4M3 with _scale_inv (fp8_block) or U8/I8 packed fp4 with _scale (mxfp4)");
}

void require_format_shape(WeightFormat f, int64_t H, int64_t I, const std::string& what) {
  if (f == WeightFormat::fp8_block && (H % ckpt::kFp8Block != 0 || I % ckpt::kFp8Block != 0))
    throw Unsupported(arg_message(kOp, what, "H = " + std::to_string(H) + ", I = " + std::to_string(I),
                                  "fp8_block experts need multiples of 128 (whole 128x128 scale blocks)"));
  if (f == WeightFormat::mxfp4 && (H % ckpt::kMxBlock != 0 || I % ckpt::kMxBlock != 0))
    throw Unsupported(arg_message(kOp, what, "H = " + std::to_string(H) + ", I = " + std::to_string(I),
                                  "mxfp4 experts need multiples of 32 (whole MX blocks)"));
}

/// One per-expert [rows, cols] matrix named `weight` (+ its scales) in format f.
Matrix load_matrix(const Reader& r, const std::string& weight, WeightFormat f, int64_t rows, int64_t cols, const std::string& why,
                   bool* converted) {
  Matrix m;
  if (f == WeightFormat::bf16) {
    const SafetensorsTensorInfo& t = r.checked(weight, {"BF16", "F16", "F32"}, {rows, cols}, why + ", format bf16");
    m.w = Tensor::empty({rows, cols}, DType::bf16);
    convert_floats(r.ck.bytes(weight).data(), t.dtype, rows * cols, m.w);
    if (t.dtype != "BF16") *converted = true;
  } else if (f == WeightFormat::fp8_block) {
    r.checked(weight, {"F8_E4M3"}, {rows, cols}, why + ", format fp8_block");
    m.w = Tensor::empty({rows, cols}, DType::fp8_e4m3);
    const auto b = r.ck.bytes(weight);
    if (!b.empty()) std::memcpy(m.w.data(), b.data(), b.size());
    const int64_t sr = (rows + ckpt::kFp8Block - 1) / ckpt::kFp8Block, sc = (cols + ckpt::kFp8Block - 1) / ckpt::kFp8Block;
    m.scale = read_f32(r, weight + "_scale_inv", {sr, sc}, "one scale per 128x128 block of " + weight);
  } else {
    r.checked(weight, {"U8", "I8"}, {rows, cols / 2}, why + ", format mxfp4: two e2m1 per byte");
    m.w = Tensor::empty({rows, cols / 2}, DType::fp4_e2m1x2);
    const auto b = r.ck.bytes(weight);
    if (!b.empty()) std::memcpy(m.w.data(), b.data(), b.size());
    r.checked(weight + "_scale", {"U8", "F8_E8M0"}, {rows, cols / ckpt::kMxBlock}, "one e8m0 scale per 32 inputs of " + weight);
    m.scale = Tensor::empty({rows, cols / ckpt::kMxBlock}, DType::e8m0);
    const auto sb = r.ck.bytes(weight + "_scale");
    if (!sb.empty()) std::memcpy(m.scale.data(), sb.data(), sb.size());
  }
  return m;
}

std::shared_ptr<ExpertWeights> make_expert(WeightFormat f, int64_t H, int64_t I, const Matrix& w13, const Matrix& w2) {
  auto e = std::make_shared<ExpertWeights>();
  e->format = f;
  e->hidden = H;
  e->intermediate = I;
  e->w13 = w13.w;
  e->w13_scale = w13.scale;
  e->w2 = w2.w;
  e->w2_scale = w2.scale;
  return e;
}

/// gpt-oss stacked tensors: expert e of `name` [E, ...] as bytes.
std::span<const uint8_t> expert_slice(const Reader& r, const std::string& name, int e, int E) {
  const auto b = r.ck.bytes(name);
  const size_t per = b.size() / static_cast<size_t>(E);
  return b.subspan(static_cast<size_t>(e) * per, per);
}

/// gpt-oss MXFP4 expert e: de-interleaves the gate_up rows into [gate; up].
std::shared_ptr<ExpertWeights> load_gpt_oss_mxfp4(const Reader& r, const Names& n, int e, int E, int64_t H, int64_t I) {
  const std::string gub = n.packed("gate_up_proj_blocks"), gus = n.packed("gate_up_proj_scales");
  const std::string db = n.packed("down_proj_blocks"), ds = n.packed("down_proj_scales");
  const std::string why = "[num_local_experts, rows, in/32, 16] of config.json";
  r.checked(gub, {"U8"}, {E, 2 * I, H / 32, 16}, why);
  r.checked(gus, {"U8"}, {E, 2 * I, H / 32}, "[num_local_experts, rows, in/32] of config.json");
  r.checked(db, {"U8"}, {E, H, I / 32, 16}, why);
  r.checked(ds, {"U8"}, {E, H, I / 32}, "[num_local_experts, rows, in/32] of config.json");
  Matrix w13, w2;
  w13.w = Tensor::empty({2 * I, H / 2}, DType::fp4_e2m1x2);
  w13.scale = Tensor::empty({2 * I, H / 32}, DType::e8m0);
  const auto gb = expert_slice(r, gub, e, E), gs = expert_slice(r, gus, e, E);
  const size_t brow = static_cast<size_t>(H / 2), srow = static_cast<size_t>(H / 32);
  for (int64_t i = 0; i < 2 * I; ++i) {
    const int64_t dst = i % 2 == 0 ? i / 2 : I + i / 2;  // checkpoint row 2j = gate j, 2j+1 = up j
    std::memcpy(w13.w.ptr<uint8_t>() + dst * brow, gb.data() + i * brow, brow);
    std::memcpy(w13.scale.ptr<uint8_t>() + dst * srow, gs.data() + i * srow, srow);
  }
  w2.w = Tensor::empty({H, I / 2}, DType::fp4_e2m1x2);
  w2.scale = Tensor::empty({H, I / 32}, DType::e8m0);
  const auto d = expert_slice(r, db, e, E), dsc = expert_slice(r, ds, e, E);
  std::memcpy(w2.w.data(), d.data(), d.size());
  std::memcpy(w2.scale.data(), dsc.data(), dsc.size());
  return make_expert(WeightFormat::mxfp4, H, I, w13, w2);
}

/// gpt-oss dequantized layout (e.g. bf16 re-exports): gate_up_proj [E, H, 2I] (x @ W, gate/up
/// interleaved along 2I), down_proj [E, I, H]; transposed into w13 [2I, H], w2 [H, I].
std::shared_ptr<ExpertWeights> load_gpt_oss_float(const Reader& r, const Names& n, int e, int E, int64_t H, int64_t I, bool* converted) {
  const std::string gu = n.packed("gate_up_proj"), dn = n.packed("down_proj");
  const auto& gt = r.checked(gu, {"BF16", "F16", "F32"}, {E, H, 2 * I}, "[num_local_experts, hidden_size, 2 x intermediate_size]");
  const auto& dt = r.checked(dn, {"BF16", "F16", "F32"}, {E, I, H}, "[num_local_experts, intermediate_size, hidden_size]");
  if (gt.dtype != "BF16" || dt.dtype != "BF16") *converted = true;
  const uint8_t* g = expert_slice(r, gu, e, E).data();
  const uint8_t* d = expert_slice(r, dn, e, E).data();
  Matrix w13, w2;
  w13.w = Tensor::empty({2 * I, H}, DType::bf16);
  w2.w = Tensor::empty({H, I}, DType::bf16);
  uint16_t* a = w13.w.ptr<uint16_t>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t c = 0; c < 2 * I; ++c) {
      const int64_t row = c % 2 == 0 ? c / 2 : I + c / 2;
      a[row * H + h] = float_to_bf16_bits(float_at(g, gt.dtype, h * 2 * I + c));
    }
  uint16_t* b = w2.w.ptr<uint16_t>();
  for (int64_t i = 0; i < I; ++i)
    for (int64_t h = 0; h < H; ++h) b[h * I + i] = float_to_bf16_bits(float_at(d, dt.dtype, i * H + h));
  return make_expert(WeightFormat::bf16, H, I, w13, w2);
}

/// transformers 5.x fused expert e: gate_up_proj [E, 2I, H] (rows [0, I) gate, [I, 2I) up: w13 as
/// is), down_proj [E, H, I] (w2 as is).
std::shared_ptr<ExpertWeights> load_fused(const Reader& r, const Names& n, int e, int E, int64_t H, int64_t I, bool* converted) {
  const std::string gu = n.packed("gate_up_proj"), dn = n.packed("down_proj");
  const auto& gt = r.checked(gu, {"BF16", "F16", "F32"}, {E, 2 * I, H}, "[num_experts, 2 x intermediate, hidden_size]: transformers 5.x fused experts");
  const auto& dt = r.checked(dn, {"BF16", "F16", "F32"}, {E, H, I}, "[num_experts, hidden_size, intermediate]: transformers 5.x fused experts");
  if (gt.dtype != "BF16" || dt.dtype != "BF16") *converted = true;
  Matrix w13, w2;
  w13.w = Tensor::empty({2 * I, H}, DType::bf16);
  w2.w = Tensor::empty({H, I}, DType::bf16);
  convert_floats(expert_slice(r, gu, e, E).data(), gt.dtype, 2 * I * H, w13.w);
  convert_floats(expert_slice(r, dn, e, E).data(), dt.dtype, H * I, w2.w);
  return make_expert(WeightFormat::bf16, H, I, w13, w2);
}

/// gpt-oss expert e's biases (gate_up_proj_bias [E, 2I] interleaved like the weight's columns,
/// down_proj_bias [E, H]) into b13 [gate; up] and b2, fp32, and its activation.
void add_gpt_oss_extras(const Reader& r, const Names& n, int e, int E, int64_t H, int64_t I, const ExpertActivation& act,
                        ExpertWeights& x) {
  x.activation = act;
  const std::string gb = n.packed("gate_up_proj_bias"), db = n.packed("down_proj_bias");
  if (r.ck.contains(gb)) {
    const auto& t = r.checked(gb, {"BF16", "F16", "F32"}, {E, 2 * I}, "[num_local_experts, 2 x intermediate_size]: GptOssExperts.gate_up_proj_bias");
    const uint8_t* p = expert_slice(r, gb, e, E).data();
    x.b13 = Tensor::empty({2 * I}, DType::fp32);
    for (int64_t c = 0; c < 2 * I; ++c) x.b13.ptr<float>()[c % 2 == 0 ? c / 2 : I + c / 2] = float_at(p, t.dtype, c);  // gate = [::2], up = [1::2]
  }
  if (r.ck.contains(db)) {
    const auto& t = r.checked(db, {"BF16", "F16", "F32"}, {E, H}, "[num_local_experts, hidden_size]: GptOssExperts.down_proj_bias");
    const uint8_t* p = expert_slice(r, db, e, E).data();
    x.b2 = Tensor::empty({H}, DType::fp32);
    for (int64_t h = 0; h < H; ++h) x.b2.ptr<float>()[h] = float_at(p, t.dtype, h);
  }
}

CheckpointConvention convention_of(const std::string& model_type, const Checkpoint& ck, int layer) {
  if (model_type.rfind("deepseek", 0) == 0) return CheckpointConvention::deepseek;
  if (model_type == "qwen3_moe" || model_type == "qwen2_moe") return CheckpointConvention::qwen_moe;
  if (model_type == "mixtral") return CheckpointConvention::mixtral;
  if (model_type == "gpt_oss") return CheckpointConvention::gpt_oss;
  // Unknown model_type: recognise the layer by its router's name.
  if (ck.contains(layer_prefix(CheckpointConvention::mixtral, layer) + "gate.weight")) return CheckpointConvention::mixtral;
  const std::string mlp = layer_prefix(CheckpointConvention::deepseek, layer);
  if (ck.contains(mlp + "router.weight")) return CheckpointConvention::gpt_oss;
  if (ck.contains(mlp + "shared_expert_gate.weight") || ck.contains(mlp + "shared_expert.gate_proj.weight")) return CheckpointConvention::qwen_moe;
  if (ck.contains(mlp + "gate.weight")) return CheckpointConvention::deepseek;
  throw InvalidArgument(arg_message(kOp, "model_type", model_type.empty() ? "(absent)" : model_type,
                                    "unknown, and layer " + std::to_string(layer) + " has no router tensor (" + mlp + "gate.weight, " + mlp +
                                        "router.weight or " + layer_prefix(CheckpointConvention::mixtral, layer) +
                                        "gate.weight); known model types: deepseek_v3, deepseek_v4, qwen3_moe, qwen2_moe, mixtral, gpt_oss"));
}

}  // namespace

std::string_view checkpoint_convention_name(CheckpointConvention c) {
  switch (c) {
    case CheckpointConvention::deepseek: return "deepseek";
    case CheckpointConvention::qwen_moe: return "qwen_moe";
    case CheckpointConvention::mixtral: return "mixtral";
    case CheckpointConvention::gpt_oss: return "gpt_oss";
  }
  return "?";
}

CheckpointConvention parse_checkpoint_convention(std::string_view name) {
  for (auto c : {CheckpointConvention::deepseek, CheckpointConvention::qwen_moe, CheckpointConvention::mixtral, CheckpointConvention::gpt_oss})
    if (checkpoint_convention_name(c) == name) return c;
  throw InvalidArgument(arg_message("checkpoint", "convention", std::string(name), "must be deepseek, qwen_moe, mixtral or gpt_oss"));
}

CheckpointLayerInfo read_moe_layer_info(const Checkpoint& ck, int layer) {
  require_arg(kOp, "layer", layer, layer >= 0, "must be >= 0");
  const ConfigReader c = read_config(ck);
  CheckpointLayerInfo info;
  info.layer = layer;
  info.model_type = c.string("model_type", "");
  info.convention = convention_of(info.model_type, ck, layer);
  info.prefix = checkpoint_prefix(ck, info.convention, layer);
  info.num_hidden_layers = c.int32({"num_hidden_layers"}, 0);
  if (info.num_hidden_layers > 0)
    require_arg(kOp, "layer", layer, layer < info.num_hidden_layers,
                "must be < num_hidden_layers = " + std::to_string(info.num_hidden_layers) + " (" + c.path + ")");
  const CheckpointConvention conv = info.convention;
  const Names n{conv, info.prefix};
  const Reader r{ck, nullptr};

  // Which layers are MoE (the others are dense MLPs with no router).
  if (conv == CheckpointConvention::deepseek) {
    const int64_t first_dense = c.integer({"first_k_dense_replace"}, family_defaults(info.model_type).first_dense.value_or(0)),
                  freq = c.integer({"moe_layer_freq"}, 1);
    require_arg(kOp, "layer", layer, layer >= first_dense && freq > 0 && layer % freq == 0,
                "is a dense layer of this model (first_k_dense_replace = " + std::to_string(first_dense) + ", moe_layer_freq = " +
                    std::to_string(freq) + " in " + c.path + ")");
  } else if (conv == CheckpointConvention::qwen_moe) {
    const int64_t step = c.integer({"decoder_sparse_step"}, 1);
    bool mlp_only = false;
    if (const json* v = c.find({"mlp_only_layers"}); v && v->is_array())
      for (const json& x : *v) mlp_only = mlp_only || (x.is_number_integer() && x.get<int64_t>() == layer);
    require_arg(kOp, "layer", layer, !mlp_only && step > 0 && (layer + 1) % step == 0,
                "is a dense layer of this model (mlp_only_layers / decoder_sparse_step = " + std::to_string(step) + " in " + c.path + ")");
  }

  const FamilyDefaults def = family_defaults(info.model_type);
  MoEConfig& m = info.config;
  m.name = (info.model_type.empty() ? std::string(checkpoint_convention_name(conv)) : info.model_type) + "-layer" + std::to_string(layer);
  m.hidden = c.integer({"hidden_size"}, def.hidden);
  m.intermediate = conv == CheckpointConvention::mixtral || conv == CheckpointConvention::gpt_oss
                       ? c.integer({"intermediate_size"}, def.intermediate)
                       // the class default is moe_intermediate_size's; intermediate_size is the dense layers' width there
                       : (def.intermediate ? c.integer({"moe_intermediate_size"}, def.intermediate)
                                           : c.integer({"moe_intermediate_size", "intermediate_size"}));
  RouterConfig& rc = m.router;
  rc.num_experts = c.int32({"n_routed_experts", "num_experts", "num_local_experts"}, def.num_experts);
  rc.top_k = c.int32({"num_experts_per_tok", "experts_per_token"}, def.top_k);

  // The experts' activation function: SiLU for every family but gpt-oss (whose experts ignore
  // hidden_act). Anything else is refused rather than run as SiLU.
  if (conv != CheckpointConvention::gpt_oss) {
    const std::string act = c.string("hidden_act", "silu");
    if (act != "silu" && act != "swish")
      throw Unsupported(arg_message(kOp, c.path + " hidden_act", act, "must be silu (or its alias swish): the activation epx's experts compute"));
  }
  require_arg(kOp, c.path + " hidden_size", m.hidden, m.hidden > 0, "must be > 0");
  require_arg(kOp, c.path + " intermediate size", m.intermediate, m.intermediate > 0, "must be > 0");
  require_arg(kOp, c.path + " number of experts", rc.num_experts, rc.num_experts > 0, "must be > 0");
  const int E = rc.num_experts;
  const int64_t H = m.hidden, I = m.intermediate;

  const std::string scoring = c.string("scoring_func", "");
  const std::string topk_method = c.string("topk_method", "");
  if (conv == CheckpointConvention::deepseek) {
    if (topk_method == "group_limited_greedy")
      throw Unsupported(arg_message(kOp, c.path + " topk_method", topk_method,
                                    "is DeepSeek-V2's max-per-group selection; epx routes softmax top-k and noaux_tc (top-2-sum groups)"));
    const bool has_bias = ck.contains(n.correction_bias());
    const std::string s = scoring.empty() ? (topk_method == "noaux_tc" || has_bias ? "sigmoid" : "softmax") : scoring;
    if (s != "sigmoid" && s != "softmax")
      throw Unsupported(arg_message(kOp, c.path + " scoring_func", s, "must be sigmoid or softmax (the routers epx has)"));
    rc.scoring = s == "sigmoid" ? ScoringFunc::sigmoid : ScoringFunc::softmax;
    rc.use_correction_bias = topk_method == "noaux_tc" || (topk_method.empty() && has_bias);
    if (rc.use_correction_bias && rc.scoring != ScoringFunc::sigmoid)
      throw Unsupported(arg_message(kOp, c.path + " scoring_func", s, "noaux_tc with e_score_correction_bias needs sigmoid scoring"));
    rc.renormalize = c.boolean("norm_topk_prob", def.norm_topk_prob.value_or(rc.scoring == ScoringFunc::sigmoid));
    rc.routed_scaling_factor = static_cast<float>(c.number("routed_scaling_factor", def.scaling.value_or(1.0)));
    if (topk_method == "greedy") {
      rc.n_group = rc.topk_group = 1;
    } else {
      rc.n_group = c.int32({"n_group"}, def.n_group.value_or(1));
      rc.topk_group = c.int32({"topk_group"}, def.topk_group.value_or(rc.n_group));
    }
    // DeepSeek-V4: hash-routed layers (a token-id table, not a learned top-k) and its clamped SwiGLU.
    if (const json* v = c.find({"mlp_layer_types"}); v && v->is_array() && static_cast<size_t>(layer) < v->size() &&
                                                      (*v)[static_cast<size_t>(layer)] == "hash_moe")
      throw Unsupported(arg_message(kOp, c.path + " mlp_layer_types[" + std::to_string(layer) + "]", "hash_moe",
                                    "is DeepSeek-V4's hash routing (experts chosen by token id); epx routes by the learned gate only"));
    if (c.find({"swiglu_limit"})) {
      const double limit = c.number("swiglu_limit", 0.0);
      require_arg(kOp, c.path + " swiglu_limit", limit, std::isfinite(limit) && limit > 0, "must be a finite number > 0");
      info.activation.limit = static_cast<float>(limit);  // routed experts: silu(min(g, L)) * clamp(u, -L, L)
    }
  } else {
    if (!scoring.empty() && scoring != "softmax")
      throw Unsupported(arg_message(kOp, c.path + " scoring_func", scoring, "must be softmax for " + std::string(checkpoint_convention_name(conv))));
    rc.scoring = ScoringFunc::softmax;
    // Mixtral and gpt-oss renormalise the top-k (gpt-oss: softmax over the top-k logits, the same).
    rc.renormalize = conv == CheckpointConvention::qwen_moe ? c.boolean("norm_topk_prob", def.norm_topk_prob.value_or(false)) : true;
  }
  try {
    validate_router_config(rc);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(std::string(e.what()) + " (router from " + c.path + ")");
  }

  // Shared expert.
  if (conv == CheckpointConvention::deepseek) {
    const int64_t ns = c.integer({"n_shared_experts"}, def.n_shared.value_or(0));
    require_arg(kOp, c.path + " n_shared_experts", ns, ns >= 0, "must be >= 0");
    if (ns > 0) {
      m.num_shared_experts = 1;  // n shared experts of width I act as one of width n * I
      m.shared_intermediate = ns * I;
    }
  } else if (conv == CheckpointConvention::qwen_moe) {
    const int64_t si = c.integer({"shared_expert_intermediate_size"}, def.shared_inter.value_or(0));
    if (si > 0 && (ck.contains(n.shared(Proj::gate)) || info.model_type == "qwen2_moe")) {
      m.num_shared_experts = 1;
      m.shared_intermediate = si;
      m.shared_gate = true;  // Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x)
    }
  }

  // The experts' activation. gpt-oss: GptOssExperts' clamped SwiGLU, alpha 1.702 (a constant of the
  // model code; config.json has no key for it) and limit swiglu_limit (GptOssConfig default 7.0;
  // transformers' GptOssExperts holds 7.0 itself, OpenAI's reference reads swiglu_limit).
  if (conv == CheckpointConvention::gpt_oss) {
    const double limit = c.number("swiglu_limit", 7.0);
    require_arg(kOp, c.path + " swiglu_limit", limit, std::isfinite(limit) && limit > 0, "must be a finite number > 0");
    info.activation = ExpertActivation::gpt_oss(1.702f, static_cast<float>(limit));
  }

  // Formats, from the tensors' dtypes.
  if (conv == CheckpointConvention::gpt_oss) {
    m.routed_format = ck.contains(n.packed("gate_up_proj_blocks")) ? WeightFormat::mxfp4 : WeightFormat::bf16;
    if (m.routed_format == WeightFormat::bf16 && !ck.contains(n.packed("gate_up_proj")))
      r.bad(n.packed("gate_up_proj_blocks"), "presence", "missing", "a gpt-oss layer needs experts.gate_up_proj_blocks (MXFP4) or experts.gate_up_proj");
  } else if (ck.contains(n.packed("gate_up_proj"))) {
    // transformers 5.x fused experts: gate_up_proj [E, 2I, H] (gate rows then up rows per expert, the
    // 4.x gate/up weights concatenated), down_proj [E, H, I]. Float only: a quantized fused tensor is refused.
    info.fused_experts = true;
    for (const char* t : {"gate_up_proj", "down_proj"}) {
      const SafetensorsTensorInfo& ti = r.info(n.packed(t));
      if (!one_of(ti.dtype, {"BF16", "F16", "F32"}))
        throw Unsupported(arg_message(kOp, "tensor " + quote_name(n.packed(t)) + " dtype", ti.dtype,
                                      "must be BF16, F16 or F32: epx reads fused (transformers 5.x) experts unquantized only"));
    }
    m.routed_format = WeightFormat::bf16;
  } else {
    m.routed_format = detect_format(r, n.expert(0, Proj::gate));
  }
  if (m.num_shared_experts > 0) m.shared_format = detect_format(r, n.shared(Proj::gate));
  require_format_shape(m.routed_format, H, I, c.path + " routed experts");
  if (m.num_shared_experts > 0) require_format_shape(m.shared_format, H, m.shared_intermediate, c.path + " shared expert");
  if (m.routed_format == WeightFormat::fp8_block || m.shared_format == WeightFormat::fp8_block) {
    if (const json* q = c.find({"quantization_config"}); q && q->is_object() && q->contains("weight_block_size")) {
      const json& b = (*q)["weight_block_size"];
      if (!(b.is_array() && b.size() == 2 && b[0] == 128 && b[1] == 128))
        throw Unsupported(arg_message(kOp, c.path + " quantization_config.weight_block_size", b.dump(), "must be [128, 128] (epx's fp8_block)"));
    }
  }
  // The router must be there (a clear error naming it, rather than a dense layer run as MoE).
  r.checked(n.router(), {"BF16", "F32", "F16"}, {E, H}, "[num_experts, hidden_size] of config.json");
  return info;
}

MoELayerCheckpoint load_moe_layer(const Checkpoint& ck, const MoELayerLoadOptions& o) {
  MoELayerCheckpoint out;
  out.info = read_moe_layer_info(ck, o.layer);
  const CheckpointLayerInfo& info = out.info;
  const MoEConfig& m = info.config;
  const int E = m.router.num_experts;
  const int64_t H = m.hidden, I = m.intermediate;
  const Names n{info.convention, info.prefix};
  const Reader r{ck, &out.notes};

  std::vector<int> ids = o.expert_ids;
  if (ids.empty()) {
    const int end = o.expert_end < 0 ? E : o.expert_end;
    require_arg(kOp, "expert_begin", o.expert_begin, o.expert_begin >= 0 && o.expert_begin <= E, "must be in [0, num_experts = " + std::to_string(E) + "]");
    require_arg(kOp, "expert_end", end, end >= o.expert_begin && end <= E, "must be in [expert_begin, num_experts = " + std::to_string(E) + "]");
    for (int e = o.expert_begin; e < end; ++e) ids.push_back(e);
  }
  for (int e : ids) require_arg(kOp, "expert id", e, e >= 0 && e < E, "must be in [0, num_experts = " + std::to_string(E) + ")");

  auto w = std::make_shared<MoEWeights>();
  w->config = m;
  w->experts.assign(static_cast<size_t>(E), nullptr);
  bool converted = false;
  const std::string why_in = "[intermediate, hidden_size] of config.json", why_out = "[hidden_size, intermediate] of config.json";
  for (int e : ids) {
    if (w->experts[static_cast<size_t>(e)]) continue;
    if (info.convention == CheckpointConvention::gpt_oss) {
      auto x = m.routed_format == WeightFormat::mxfp4 ? load_gpt_oss_mxfp4(r, n, e, E, H, I) : load_gpt_oss_float(r, n, e, E, H, I, &converted);
      add_gpt_oss_extras(r, n, e, E, H, I, info.activation, *x);
      w->experts[static_cast<size_t>(e)] = x;
      continue;
    }
    std::shared_ptr<ExpertWeights> x;
    if (info.fused_experts) {
      x = load_fused(r, n, e, E, H, I, &converted);
    } else {
      const Matrix gate = load_matrix(r, n.expert(e, Proj::gate), m.routed_format, I, H, why_in, &converted);
      const Matrix up = load_matrix(r, n.expert(e, Proj::up), m.routed_format, I, H, why_in, &converted);
      const Matrix down = load_matrix(r, n.expert(e, Proj::down), m.routed_format, H, I, why_out, &converted);
      x = make_expert(m.routed_format, H, I, ckpt::stack(gate, up, m.routed_format), down);
    }
    x->activation = info.activation;
    w->experts[static_cast<size_t>(e)] = x;
  }

  if (o.load_router) {
    w->router_weight = read_f32(r, n.router(), {E, H}, "[num_experts, hidden_size] of config.json");
    if (m.router.use_correction_bias) w->correction_bias = read_f32(r, n.correction_bias(), {E}, "[num_experts], noaux_tc routing");
  }

  if (o.load_shared && m.num_shared_experts > 0) {
    const WeightFormat f = m.shared_format;
    const int64_t S = m.shared_intermediate;
    // The split ModularMoE's DP-sharded shared expert uses: whole blocks of the format, the first
    // blocks % n shards one block more, the last block possibly partial (bf16 only).
    const int64_t g = intermediate_granularity(f), num_blocks = (S + g - 1) / g;
    require_arg(kOp, "num_shared_shards", o.num_shared_shards, o.num_shared_shards >= 1 && o.num_shared_shards <= num_blocks,
                "must be in [1, " + std::to_string(num_blocks) + "] (shared width " + std::to_string(S) + " in blocks of " + std::to_string(g) + ")");
    require_arg(kOp, "shared_shard", o.shared_shard, o.shared_shard >= 0 && o.shared_shard < o.num_shared_shards,
                "must be in [0, num_shared_shards = " + std::to_string(o.num_shared_shards) + ")");
    const ExpertRange part = expert_range(static_cast<int>(num_blocks), o.num_shared_shards, o.shared_shard);
    const int64_t i0 = part.begin * g, i1 = std::min<int64_t>(part.end * g, S);
    const std::string why = "shared width " + std::to_string(S) + " of config.json";
    const Matrix gate = load_matrix(r, n.shared(Proj::gate), f, S, H, "[shared intermediate, hidden_size], " + why, &converted);
    const Matrix up = load_matrix(r, n.shared(Proj::up), f, S, H, "[shared intermediate, hidden_size], " + why, &converted);
    const Matrix down = load_matrix(r, n.shared(Proj::down), f, H, S, "[hidden_size, shared intermediate], " + why, &converted);
    w->shared = make_expert(f, H, S, ckpt::stack(gate, up, f), down);
    if (i0 != 0 || i1 != S) w->shared = w->shared->slice_intermediate(i0, i1);
    w->config.shared_intermediate = i1 - i0;
    if (m.shared_gate) {
      const Tensor g = read_f32(r, n.shared_gate(), {1, H}, "[1, hidden_size]: Qwen2-MoE shared_expert_gate");
      w->shared_gate_weight = Tensor::empty({H}, DType::fp32);
      std::memcpy(w->shared_gate_weight.data(), g.data(), static_cast<size_t>(H * 4));
    }
  }

  if (converted) out.notes.push_back("expert weights stored as F16/F32 were rounded to bf16 (round to nearest even)");
  if (info.convention == CheckpointConvention::gpt_oss) {
    // GptOssTopKRouter: logits = F.linear(x, weight, bias). transformers' _init_weights would fill an
    // absent bias with random values; a checkpoint without one is read as bias 0 and says so.
    if (o.load_router) {
      if (ck.contains(n.router_bias())) w->router_bias = read_f32(r, n.router_bias(), {E}, "[num_local_experts]: GptOssTopKRouter.bias");
      else out.notes.push_back(n.router_bias() + " is absent: the router runs without a logit bias");
    }
    for (const char* b : {"gate_up_proj_bias", "down_proj_bias"})
      if (!ck.contains(n.packed(b))) out.notes.push_back(n.packed(b) + " is absent: the experts run without it (bias 0)");
  }
  out.weights = w;
  return out;
}

MoELayerCheckpoint load_moe_layer(const std::string& dir, const MoELayerLoadOptions& options) {
  return load_moe_layer(*Checkpoint::open(dir), options);
}

}  // namespace epx
