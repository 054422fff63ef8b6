// epx/checkpoint.h: safetensors files, Hugging Face checkpoint directories, and one MoE layer's
// weights loaded from them into MoEWeights / ExpertWeights (the types the CPU and CUDA layers take).
//
// The safetensors format (https://github.com/huggingface/safetensors, README "Format" and
// docs/source/index.mdx; the Rust crate's safetensors/src/tensor.rs is the reference validator):
//   bytes [0, 8)        N: unsigned 64-bit little-endian, the header's length in bytes
//   bytes [8, 8 + N)    a UTF-8 JSON object, starting with '{', optionally padded with spaces:
//                         {"__metadata__": {"k": "v", ...},               (optional; strings only)
//                          "<tensor name>": {"dtype": "BF16", "shape": [r, c],
//                                            "data_offsets": [begin, end]}, ...}
//   bytes [8 + N, EOF)  the data section; data_offsets are relative to its start, [begin, end) is
//                       one tensor's row-major little-endian bytes, end - begin = numel * bits / 8.
// The data section must be covered exactly: offsets sorted by begin start at 0, each begins where
// the previous ends (no hole, no overlap), and the last ends at EOF. Keys are unique. N is capped
// at 100,000,000 bytes as in the reference implementation. Shapes may be [] (a scalar) or hold 0.
// Every rule above is checked when a file is opened; a file that breaks one throws
// InvalidArgument naming the file, the tensor and the rule, never reads outside the mapping.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epx/moe.h"
#include "epx/tensor.h"

namespace epx {

// ---- safetensors ----------------------------------------------------------------------------

/// One tensor's header entry.
struct SafetensorsTensorInfo {
  std::string name;
  std::string dtype;            ///< as in the header: "F32", "BF16", "F8_E4M3", "U8", "I64", ...
  std::vector<int64_t> shape;   ///< row-major; [] for a scalar
  uint64_t data_begin = 0;      ///< byte offsets into the data section, [begin, end)
  uint64_t data_end = 0;
  uint64_t nbytes() const { return data_end - data_begin; }
  int64_t numel() const;
};

/// Bits per element of a safetensors dtype name, or 0 when the name is unknown. Known names:
/// BOOL U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 (8), I16 U16 F16 BF16 (16), I32 U32 F32 (32), I64 U64 F64
/// (64), F4 (4: two elements per byte, as torch.float4_e2m1fn_x2 stores them).
int safetensors_dtype_bits(std::string_view dtype);
/// The epx DType a safetensors dtype reads as: F32 fp32, F16 fp16, BF16 bf16, F8_E4M3 fp8_e4m3,
/// F8_E8M0 e8m0, U8 uint8, I32 int32, I64 int64. Throws Unsupported for the other known names
/// (I8, BOOL, F64, ... have no epx DType; read them with SafetensorsFile::bytes).
DType safetensors_to_dtype(std::string_view dtype);
/// The safetensors name an epx DType is written as (fp4_e2m1x2 and uint8 as "U8", e8m0 "F8_E8M0").
std::string_view dtype_to_safetensors(DType dtype);

/// A read-only, memory-mapped safetensors file. Opening validates the whole header (see above);
/// tensor bytes are paged in only when read. Movable, not copyable; thread-safe for reads.
class SafetensorsFile {
 public:
  /// Throws InvalidArgument naming `path` (and the tensor) when the file is missing, unreadable,
  /// shorter than 8 bytes, has a header length beyond the file, bad JSON, a duplicate key, an entry
  /// without dtype/shape/data_offsets, an unknown dtype, a shape whose numel * bits / 8 differs from
  /// end - begin (or overflows), offsets past the data section, overlapping or out-of-order offsets
  /// that leave a hole, or bytes after the last tensor.
  static SafetensorsFile open(const std::string& path);
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const;
  /// Tensor names in the header, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  /// Throws InvalidArgument naming the file and the tensor when it is absent.
  const SafetensorsTensorInfo& info(const std::string& name) const;
  /// The tensor's bytes inside the mapping (valid while this object lives; any alignment).
  std::span<const uint8_t> bytes(const std::string& name) const;
  /// A copy as an epx Tensor of safetensors_to_dtype(dtype) and the header's shape (a scalar
  /// becomes shape [1]; more than 4 dims throws InvalidArgument).
  Tensor read(const std::string& name) const;
  /// "__metadata__" (empty when absent).
  const std::map<std::string, std::string>& metadata() const;
  /// Byte offset of the data section in the file (8 + N).
  uint64_t data_offset() const;

 private:
  struct Impl;
  explicit SafetensorsFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// One tensor to write: `data` holds exactly numel(shape) * bits(dtype) / 8 bytes.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;            ///< a safetensors dtype name
  std::vector<int64_t> shape;
  const void* data = nullptr;
  uint64_t nbytes = 0;
  /// From a contiguous CPU tensor (its dtype through dtype_to_safetensors unless `dtype` is given).
  static SafetensorsEntry from(std::string name, const TensorView& t, std::string dtype = {});
};

/// Writes a safetensors file: header keys sorted, data in the order given, the header padded with
/// spaces so the data section starts at a multiple of 8 (as the reference writer does).
/// Throws InvalidArgument for a duplicate or empty name, an unknown dtype or a size mismatch;
/// Error when the file cannot be written.
void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// ---- checkpoint directories -------------------------------------------------------------------

/// A Hugging Face checkpoint directory: config.json (optional here) plus either
/// model.safetensors.index.json ({"weight_map": {tensor: file}}, sharded checkpoints), or a single
/// model.safetensors, or else every *.safetensors file in the directory. Files are opened (and
/// validated) on first use, so a rank maps only the shards that hold its tensors.
class Checkpoint {
 public:
  /// Throws InvalidArgument when `dir` is not a directory, config.json or the index is not valid
  /// JSON, the index names a file outside `dir`, or no safetensors file is found.
  static std::shared_ptr<Checkpoint> open(const std::string& dir);
  ~Checkpoint();

  const std::string& dir() const;
  /// config.json as text ("" when absent).
  const std::string& config_json() const;
  /// Every tensor name (index weight_map keys, or the files' headers), sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  /// Throws InvalidArgument naming the tensor and the directory when absent, and naming the shard
  /// too when the index maps it to a file that lacks it or cannot be opened.
  const SafetensorsTensorInfo& info(const std::string& name) const;
  std::span<const uint8_t> bytes(const std::string& name) const;
  Tensor read(const std::string& name) const;
  /// Path of the file holding `name` (opens it).
  std::string file_of(const std::string& name) const;

 private:
  Checkpoint();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- one MoE layer ------------------------------------------------------------------------------

/// Tensor naming conventions (docs/checkpoint.md lists every tensor of each).
enum class CheckpointConvention : uint8_t {
  deepseek,  ///< DeepSeek-V3/V4: mlp.experts.{e}.{gate,up,down}_proj.weight, mlp.gate.weight, shared_experts
  qwen_moe,  ///< Qwen3-MoE / Qwen2-MoE: as DeepSeek; Qwen2 adds mlp.shared_expert(+_gate)
  mixtral,   ///< Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2.weight, block_sparse_moe.gate.weight
  gpt_oss,   ///< gpt-oss: mlp.experts.{gate_up,down}_proj_{blocks,scales}, mlp.router.weight/bias
};
std::string_view checkpoint_convention_name(CheckpointConvention c);  ///< "deepseek", "qwen_moe", ...
CheckpointConvention parse_checkpoint_convention(std::string_view name);  ///< throws InvalidArgument

/// What config.json says about one layer (formats detected from the tensors' dtypes).
struct CheckpointLayerInfo {
  std::string model_type;           ///< config.json model_type ("" when absent)
  CheckpointConvention convention = CheckpointConvention::deepseek;
  int layer = 0;
  int num_hidden_layers = 0;        ///< 0 when config.json lacks it
  MoEConfig config;                 ///< name "<model_type>-layer<N>"
  std::string prefix;               ///< "model.layers.<N>.mlp." (or ".block_sparse_moe.")
  /// The routed experts' activation (gpt-oss: gpt_oss_glu with alpha 1.702 and swiglu_limit;
  /// DeepSeek-V4: silu_glu clamped to swiglu_limit; else plain silu_glu). Every loaded expert carries it.
  ExpertActivation activation;
  /// The routed experts are transformers 5.x fused tensors (P experts.gate_up_proj [E, 2I, H],
  /// P experts.down_proj [E, H, I]) rather than 4.x per-expert modules (gpt-oss: always stacked).
  bool fused_experts = false;
};

struct MoELayerLoadOptions {
  int layer = 0;
  /// Routed experts to load: [expert_begin, expert_end) (expert_range(E, R, rank) for rank's own;
  /// end -1 = all), or exactly `expert_ids` when that is non-empty. Others stay null.
  int expert_begin = 0;
  int expert_end = -1;
  std::vector<int> expert_ids;
  bool load_router = true;          ///< router_weight, correction_bias
  bool load_shared = true;          ///< the shared expert (+ gate) when the model has one
  /// DP shard of the shared expert along its intermediate dimension: shard s of n is
  /// ExpertWeights::slice_intermediate(i0, i1) (rows [i0, i1) of gate and up, columns [i0, i1) of
  /// down), [i0, i1) being part s of the width in whole blocks of intermediate_granularity(format)
  /// (fp8_block 128, mxfp4 32, bf16 8) split by expert_range: the same slice ModularMoE's
  /// DP-sharded shared expert gives rank s of n (ModularMoE itself takes the whole expert and
  /// slices it). The shards' outputs sum to the whole expert's (before rounding).
  int shared_shard = 0;
  int num_shared_shards = 1;
};

/// One layer loaded from a checkpoint.
struct MoELayerCheckpoint {
  CheckpointLayerInfo info;
  std::shared_ptr<MoEWeights> weights;  ///< config = info.config (shared_intermediate = this shard's width)
  /// Conversions made (F32/F16 expert weights rounded to bf16) and tensors the model has that the
  /// checkpoint lacks (a gpt-oss bias, read as 0). One sentence each. Nothing the checkpoint holds
  /// is dropped: a setting epx does not compute is refused at load instead.
  std::vector<std::string> notes;
};

/// Parses config.json for `layer` and inspects the layer's tensors' headers (no weight is read).
/// Keys read: model_type, hidden_size, moe_intermediate_size / intermediate_size, n_routed_experts
/// / num_experts / num_local_experts, num_experts_per_tok / experts_per_token, scoring_func,
/// topk_method, norm_topk_prob, n_group, topk_group, routed_scaling_factor, n_shared_experts,
/// shared_expert_intermediate_size, num_hidden_layers, first_k_dense_replace, moe_layer_freq,
/// decoder_sparse_step, mlp_only_layers, quantization_config.weight_block_size / quant_method.
/// Throws InvalidArgument naming the key or tensor (missing key, dense layer, layer out of range,
/// tensor absent, wrong dtype or shape), Unsupported for a router or format epx does not have
/// (e.g. DeepSeek-V2 group_limited_greedy, FP8 blocks other than 128x128).
CheckpointLayerInfo read_moe_layer_info(const Checkpoint& ckpt, int layer);

/// Loads one layer's router and the selected experts (see MoELayerLoadOptions) into MoEWeights,
/// converting each convention to ExpertWeights (w13 = [gate; up] [2I, H], w2 [H, I]):
///   bf16      : BF16 copied; F16/F32 rounded to bf16 (RNE), with a note;
///   fp8_block : F8_E4M3 weight + F32/BF16 weight_scale_inv [ceil(out/128), ceil(in/128)];
///   mxfp4     : gpt-oss blocks [E, out, in/32, 16] U8 + scales [E, out, in/32] U8 (e8m0), gate/up
///               rows de-interleaved (checkpoint row 2i = gate i, 2i+1 = up i); DeepSeek-style
///               per-expert packed weight [out, in/2] U8/I8 + weight_scale [out, in/32] U8/F8_E8M0.
/// Every tensor's dtype and shape is checked against config.json before it is read. Throws as
/// read_moe_layer_info, plus InvalidArgument for bad options (expert ids, shard index).
MoELayerCheckpoint load_moe_layer(const Checkpoint& ckpt, const MoELayerLoadOptions& options);
MoELayerCheckpoint load_moe_layer(const std::string& dir, const MoELayerLoadOptions& options);

/// Writes `weights` (every expert must be set) as one MoE layer of a checkpoint in `convention`:
/// config.json plus model.safetensors, or with num_shards > 1 model-0000s-of-0000n.safetensors
/// files and model.safetensors.index.json (tensors dealt round-robin in name order). The router is
/// written in `router_dtype` ("BF16" as real checkpoints, or "F32" to keep it exact). Formats must
/// suit the convention: mixtral/qwen_moe bf16; gpt_oss mxfp4 routed, no shared expert; deepseek any
/// (mxfp4 per expert as described in load_moe_layer). Used by the tests and to make demo inputs.
struct CheckpointWriteOptions {
  CheckpointConvention convention = CheckpointConvention::deepseek;
  int layer = 0;
  int num_shards = 1;
  std::string router_dtype = "BF16";
  std::string model_type;  ///< "" = the convention's usual one (deepseek_v3, qwen3_moe / qwen2_moe, mixtral, gpt_oss)
  /// Routed experts as transformers 5.x writes them: P experts.gate_up_proj [E, 2I, H] and
  /// P experts.down_proj [E, H, I] (Mixtral's block named "mlp." as 5.x renames it); bf16 experts
  /// of deepseek / qwen_moe / mixtral only. false: 4.x per-expert modules.
  bool fused_experts = false;
};
void write_moe_checkpoint(const std::string& dir, const MoEWeights& weights, const CheckpointWriteOptions& options);

}  // namespace epx
