// tools/epx/moe_checkpoint.cpp: `epx moe --checkpoint DIR --layer N [--hidden FILE]` (see the header).
#include "moe_checkpoint.h"

#include <cstring>
#include <iostream>

#include "epx/checkpoint.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "epx/trace.h"
#include "validators.h"

namespace epx::cli {

namespace {
constexpr std::string_view kOp = "epx moe";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// "[d0, d1, ...]": a file's tensor shape as the errors print it.
std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// [N, H] bf16 rows of a .npy file.
Tensor hidden_from_npy(const std::string& path, int64_t H) {
  const NpyArray a = read_npy(path);
  require_arg(kOp, "--hidden " + path + " shape", shape_text(a.shape), a.shape.size() >= 2 && a.shape.back() == H,
              "must be [N, H] or [B, S, H] with H = hidden_size = " + std::to_string(H));
  require_arg(kOp, "--hidden " + path + " dtype", a.descr, a.descr == "<f4" || a.descr == "<u2", "must be <f4 (float32) or <u2 (bf16 bits)");
  const int64_t n = a.numel();
  Tensor x = Tensor::empty({n / H, H}, DType::bf16);
  uint16_t* o = x.ptr<uint16_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (a.descr == "<u2") {
      std::memcpy(&o[i], &a.data[static_cast<size_t>(i * 2)], 2);
    } else {
      float f;
      std::memcpy(&f, &a.data[static_cast<size_t>(i * 4)], 4);
      o[i] = float_to_bf16_bits(f);
    }
  }
  return x;
}

/// [N, H] bf16 rows of one tensor of a safetensors file.
Tensor hidden_from_safetensors(const std::string& path, std::string name, int64_t H) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  if (name.empty()) {
    const std::vector<std::string> names = f.names();
    if (names.size() == 1) name = names[0];
    else if (f.contains("hidden_states")) name = "hidden_states";
    else
      throw InvalidArgument(arg_message(kOp, "--hidden", path, "holds " + std::to_string(names.size()) +
                                                                    " tensors and none is named hidden_states; name one as FILE:TENSOR"));
  }
  const SafetensorsTensorInfo& t = f.info(name);
  require_arg(kOp, "--hidden " + path + ":" + name + " shape", shape_text(t.shape), t.shape.size() >= 2 && t.shape.back() == H,
              "must be [N, H] or [B, S, H] with H = hidden_size = " + std::to_string(H));
  require_arg(kOp, "--hidden " + path + ":" + name + " dtype", t.dtype, t.dtype == "F32" || t.dtype == "F16" || t.dtype == "BF16",
              "must be F32, F16 or BF16");
  const int64_t n = t.numel();
  Tensor x = Tensor::empty({n / H, H}, DType::bf16);
  const auto b = f.bytes(name);
  uint16_t* o = x.ptr<uint16_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (t.dtype == "BF16") {
      std::memcpy(&o[i], b.data() + 2 * i, 2);
    } else if (t.dtype == "F16") {
      uint16_t h;
      std::memcpy(&h, b.data() + 2 * i, 2);
      o[i] = float_to_bf16_bits(fp16_bits_to_float(h));
    } else {
      float v;
      std::memcpy(&v, b.data() + 4 * i, 4);
      o[i] = float_to_bf16_bits(v);
    }
  }
  return x;
}

MoELayerLoadOptions load_options(const MoeOptions& o) {
  MoELayerLoadOptions l;
  l.layer = o.layer;
  return l;
}
}  // namespace

void add_checkpoint_flags(CLI::App& m, MoeOptions& o) {
  m.add_option("--checkpoint", o.checkpoint,
               "Run layer --layer of this Hugging Face checkpoint (config.json + safetensors, sharded or not; DeepSeek-V3/V4, "
               "Qwen2/3-MoE, Mixtral, gpt-oss naming; docs/checkpoint.md) with its real router and weights instead of a preset; "
               "each rank loads only its own experts. --routing then defaults to router");
  m.add_option("--layer", o.layer, "N: the decoder layer of --checkpoint to run (an MoE layer)")->check(non_negative_number());
  m.add_option("--hidden", o.hidden,
               "Hidden states FILE[:TENSOR] (.npy <f4/<u2-bf16, or safetensors F32/F16/BF16) of shape [N, H]: split over the "
               "ranks in order, the same tokens every step (instead of random N(0, 1) ones; not with --tokens-per-rank or --trace)");
}

void finish_checkpoint_options(MoeOptions& o, const CLI::App& m) {
  if (o.checkpoint.empty()) {
    require_arg(kOp, "--layer", o.layer, o.layer < 0, "needs --checkpoint");
    return;
  }
  require_arg(kOp, "--expert-pool", o.expert_pool, o.expert_pool == 0, "applies to random weights only, not with --checkpoint");
  require_arg(kOp, "--preset", o.preset, m.get_option("--preset")->count() == 0,
              "cannot be combined with --checkpoint (the checkpoint's config.json gives the layer)");
  require_arg(kOp, "--layer", "missing", o.layer >= 0, "is required with --checkpoint (the decoder layer to run)");
  if (!o.routing_given) o.routing = "router";
}

MoEConfig workload_model(const MoeOptions& o) {
  if (o.checkpoint.empty()) return preset(o.preset);
  return read_moe_layer_info(*Checkpoint::open(o.checkpoint), o.layer).config;
}

std::shared_ptr<MoEWeights> workload_weights(const MoeOptions& o, const MoEConfig& model) {
  if (o.checkpoint.empty()) return MoEWeights::random(model, o.seed, o.expert_begin, o.expert_end, o.expert_pool);
  MoELayerLoadOptions l = load_options(o);
  l.expert_begin = o.expert_begin;
  l.expert_end = o.expert_end;
  MoELayerCheckpoint c = load_moe_layer(o.checkpoint, l);
  // Rank 0 (or the single CPU process) reports the loader's notes; a probe loads no expert.
  if (o.expert_begin == 0 && o.expert_end != 0)
    for (const std::string& n : c.notes) std::cerr << "epx moe: checkpoint note: " << n << "\n";
  return c.weights;
}

void add_workload_experts(const MoeOptions& o, MoEWeights& w, const std::vector<int>& ids) {
  if (o.checkpoint.empty()) {
    w.add_random_experts(o.seed, ids);
    return;
  }
  std::vector<int> missing;
  for (int e : ids)
    if (e >= 0 && static_cast<size_t>(e) < w.experts.size() && !w.experts[static_cast<size_t>(e)]) missing.push_back(e);
  if (missing.empty()) return;
  MoELayerLoadOptions l = load_options(o);
  l.expert_ids = missing;
  l.load_router = false;
  l.load_shared = false;
  const MoELayerCheckpoint c = load_moe_layer(o.checkpoint, l);
  for (int e : missing) w.experts[static_cast<size_t>(e)] = c.weights->experts[static_cast<size_t>(e)];
}

std::vector<Tensor> workload_hidden(const MoeOptions& o, int64_t H, int R) {
  if (o.hidden.empty()) return {};
  require_arg(kOp, "--hidden", o.hidden, o.trace.empty(), "cannot be combined with --trace (the trace gives the tokens)");
  require_arg(kOp, "--hidden", o.hidden, !o.tokens_given, "cannot be combined with --tokens-per-rank (the file gives N tokens, split over the ranks)");
  std::string path = o.hidden, tensor;
  const size_t colon = o.hidden.rfind(':');
  if (colon != std::string::npos && !ends_with(o.hidden, ".npy") && !ends_with(o.hidden, ".safetensors")) {
    path = o.hidden.substr(0, colon);
    tensor = o.hidden.substr(colon + 1);
  }
  const Tensor all = ends_with(path, ".npy") ? hidden_from_npy(path, H) : hidden_from_safetensors(path, tensor, H);
  const int64_t N = all.size(0);
  std::vector<Tensor> parts;
  for (int r = 0; r < R; ++r) {
    // expert_range's split (sizes differ by at most one), over rows instead of experts.
    const int64_t begin = N * r / R, end = N * (r + 1) / R;
    Tensor x = Tensor::empty({end - begin, H}, DType::bf16);
    if (end > begin) std::memcpy(x.data(), all.ptr<uint16_t>() + begin * H, static_cast<size_t>((end - begin) * H * 2));
    parts.push_back(std::move(x));
  }
  return parts;
}

}  // namespace epx::cli
