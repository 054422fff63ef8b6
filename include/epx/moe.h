// epx/moe.h: model configurations (presets), MoE layer weights, ModularMoE and the no-EP reference.
//
// ModularMoE (vLLM modular-kernel shape):  router -> prepare (quantize + dispatch) -> experts ->
// finalize (combine), plus the shared expert, either separate (computed on the local tokens and
// added) or fused (FHMoE: appended as route id E with weight 1.0, or the shared gate value where the
// model has one, so the routed launch processes K+1 columns). The capability gate fuses when the
// chunk's M = max over ranks of tokens <= Config::fhmoe_max_tokens (max, so every rank decides alike).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epx/config.h"
#include "epx/dispatch.h"
#include "epx/experts.h"
#include "epx/group.h"
#include "epx/routing.h"

namespace epx {

/// One MoE layer's shape and router, from a model's public config.json.
struct MoEConfig {
  std::string name;
  int64_t hidden = 0;               ///< H (hidden_size)
  int64_t intermediate = 0;         ///< I (moe_intermediate_size)
  RouterConfig router;              ///< num_experts, top_k, scoring, groups, scaling
  int num_shared_experts = 0;       ///< 0 or 1 here (DeepSeek n_shared_experts=1 -> width I)
  int64_t shared_intermediate = 0;  ///< width of the shared expert MLP
  bool shared_gate = false;         ///< Qwen2-MoE/Qwen1.5-MoE: shared output scaled by sigmoid(x . g)
  WeightFormat routed_format = WeightFormat::bf16;
  WeightFormat shared_format = WeightFormat::bf16;
};

/// deepseek-v3, deepseek-v4-pro, qwen3-30b-a3b, mixtral-8x7b, qwen1.5-moe-a2.7b, and each with "-mini".
std::vector<std::string> preset_names();
/// Throws InvalidArgument listing the known presets.
MoEConfig preset(const std::string& name);

/// All weights of one MoE layer (global: every expert). CPU-resident.
struct MoEWeights {
  MoEConfig config;
  Tensor router_weight;                 ///< [E, H] fp32 (mlp.gate.weight)
  Tensor correction_bias;               ///< [E] fp32 (e_score_correction_bias) when the router uses it
  /// [E] fp32 logit bias (gpt-oss mlp.router.bias: logits = x W^T + b before the top-k), or undefined.
  /// Computed by the CPU router and, on CUDA, added to the cuBLAS logits in fp32 before the top-k.
  Tensor router_bias;
  std::vector<std::shared_ptr<const ExpertWeights>> experts;  ///< [E]
  std::shared_ptr<const ExpertWeights> shared;                ///< null without a shared expert
  Tensor shared_gate_weight;            ///< [H] fp32 when config.shared_gate
  /// Random weights only: 0 = every expert its own values (default); P > 0 = expert e holds the
  /// values of expert e mod P (one host object shared by e, e + P, ...), so a full-size preset
  /// builds P experts instead of E / R per rank (DeepSeek-V4-Pro: 192 x 66 M values took 41 s per
  /// rank; P = 16: ~3 s). For benchmarks: the GPU layer still uploads one copy per expert (same
  /// bytes moved, no cache reuse), the kernels' speed does not depend on the values, and the
  /// reference uses the same pooled experts.
  int expert_pool = 0;

  /// Deterministic random weights from `seed`. Expert e depends only on (seed, e) (with
  /// `expert_pool` P > 0: on (seed, e mod P)), so every rank can build just its own experts
  /// ([expert_begin, expert_end); default all). expert_pool < 0 or > E throws InvalidArgument.
  static std::shared_ptr<MoEWeights> random(const MoEConfig& cfg, uint64_t seed, int expert_begin = 0, int expert_end = -1,
                                            int expert_pool = 0);
  /// Builds experts[e] for every e in `expert_ids` still null, exactly as random(config, seed,
  /// ..., expert_pool) does (in parallel; ids outside [0, E) throw InvalidArgument). For a rank
  /// that validates a few tokens against the reference and needs some other ranks' experts too.
  void add_random_experts(uint64_t seed, const std::vector<int>& expert_ids);
};

enum class SharedExpertMode : uint8_t { separate, fused, auto_gate };

struct PathCounters {
  std::string backend;
  int64_t calls = 0;            ///< forward calls (graph replays included)
  int64_t chunks = 0;           ///< prepare/finalize rounds (DP chunks), idle ones included
  int64_t idle_chunks = 0;      ///< chunks in which this rank had 0 tokens (eager calls only: under
                                ///< graph replay the token count lives on the device)
  int64_t shared_fused = 0;     ///< chunks whose shared expert ran fused (FHMoE), sharded ones included
  int64_t shared_separate = 0;  ///< chunks whose shared expert ran separately
  int64_t shared_sharded = 0;   ///< of shared_fused: chunks where it ran DP-sharded on the gathered tokens
  int64_t graph_replays = 0;    ///< forward calls that were replays of the whole-layer CUDA graph
};

/// Builds the Experts for a rank's local experts (index = local expert id) on `device`: a way to
/// compose ModularMoE with any experts implementation. The default is make_experts_cpu on a CPU
/// group and make_experts_cuda on a CUDA group.
using ExpertsFactory =
    std::function<std::unique_ptr<Experts>(std::vector<std::shared_ptr<const ExpertWeights>> local_experts, Device device)>;

struct ModularMoEOptions {
  SharedExpertMode shared_mode = SharedExpertMode::auto_gate;
  int chunk_size = 0;           ///< DP chunk (tokens per call per rank); 0 = Config::moe_chunk_size / unchunked
  /// -1 = Config::fhmoe_max_tokens, or Config::fhmoe_max_tokens_sharded when the layer runs the
  /// shared expert DP-sharded on fused chunks (shared_expert_sharded()); >= 0 overrides both.
  int fhmoe_max_tokens = -1;
  /// DP-shard the shared expert when the backend gathers every rank's tokens
  /// (Capabilities::gathers_all_tokens: naive, allgather_reducescatter) and R > 1: rank r holds
  /// columns [I_r) of its intermediate dimension (whole blocks of the weight format, sizes differ by
  /// at most one block; used only when every rank gets at least one block) and adds its partial
  /// for every gathered row before the reduce-scatter, which sums the shards: the shared output is
  /// counted once, never R times. Applies to chunks that take the fused path (same numerics as
  /// FHMoE: the shared expert sees the dispatched x); separate chunks run the whole expert locally.
  bool shard_shared_expert = true;
  ExpertsFactory make_experts{};  ///< empty = make_experts_cpu / make_experts_cuda by the group's device
  /// Time the phases of every eager forward call (see ModularMoE::last_phase_times): on CUDA five
  /// events per chunk recorded on the call's stream (no host sync inside the call); on CPU host
  /// clocks. Off under graph capture and replay.
  bool time_phases = false;
};

/// Device time of the phases of the last eager forward call, summed over its chunks, in
/// microseconds (CUDA: cudaEventElapsedTime between events recorded on the call's stream; CPU:
/// steady_clock). The phases of one chunk, in stream order:
///   prepare  = quantize + dispatch (PrepareFinalize::prepare)
///   experts  = the grouped expert MLPs (Experts::apply), the DP-sharded shared expert included
///   finalize = combine (PrepareFinalize::finalize)
///   shared   = the separate shared expert (0 on the fused path)
/// The router and the routing columns are outside these phases.
struct PhaseTimes {
  int64_t chunks = 0;  ///< chunks timed; 0 when timing is off or the last call was a graph replay
  double prepare_us = 0, experts_us = 0, finalize_us = 0, shared_us = 0;
};

/// Data-parallel metadata of one forward call, computed once from one all_gather of T and reused by
/// the capacity check, the chunk plan, the capability gate and the DP-sharded shared expert (whose
/// gathered rows are rank r's at [cumulative_c[r], cumulative_c[r+1]) of chunk c).
struct DPMetadata {
  std::vector<int64_t> tokens_per_rank;  ///< [R] T_r of this call
  std::vector<int64_t> cumulative;       ///< [R + 1] exclusive prefix sums of tokens_per_rank
  int64_t max_tokens = 0;                ///< max_r T_r
  int64_t chunk_size = 1;                ///< tokens per chunk per rank (max_tokens when unchunked; >= 1)
  int64_t num_chunks = 1;                ///< ceil(max_tokens / chunk_size), at least 1 (idle calls still meet)

  /// From T per rank and the layer's chunk size (0 = unchunked). InvalidArgument (naming the
  /// argument and value) if chunk_size < 0, a T_r < 0, or the sum of T_r passes INT64_MAX; no
  /// intermediate overflows for any valid input (T_r and chunk_size up to INT64_MAX).
  static DPMetadata from_tokens(std::vector<int64_t> tokens_per_rank, int64_t chunk_size);
  /// Tokens of rank r in chunk c: clamp(T_r - c * chunk_size, 0, chunk_size). InvalidArgument unless
  /// 0 <= c < num_chunks and 0 <= r < R.
  int64_t chunk_tokens(int64_t chunk, int rank) const;
  /// [R] tokens per rank of chunk c, and M = their max (the capability gate's input).
  std::vector<int64_t> chunk_counts(int64_t chunk) const;
  int64_t chunk_max(int64_t chunk) const;
};

/// The EP MoE layer on one rank.
class ModularMoE {
 public:
  /// `weights` must hold at least this rank's local experts (and the shared expert if any).
  /// `backend` is a name from backend_names(); dispatch_cfg.hidden/num_experts/top_k are filled
  /// from the model. Collective (creates the backend). A `config` field outside its rule throws
  /// InvalidArgument on every rank (make_prepare_finalize's check).
  ModularMoE(std::shared_ptr<const MoEWeights> weights, std::shared_ptr<Group> group, const std::string& backend,
             DispatchConfig dispatch_cfg, const Config& config, ModularMoEOptions options = {});
  ~ModularMoE();

  /// x [T, H] bf16 -> out [T, H] bf16, routing with the layer's router. Collective.
  void forward(const TensorView& x, const TensorView& out, Stream stream = {});
  /// Same with given routing: topk_idx [T, K] int32/int64, topk_weights [T, K] fp32 (e.g. from a trace).
  /// An id other than -1 or [0, E) throws InvalidArgument naming topk_idx[t, k], its value and the rule: on
  /// the CPU before anything moves; on CUDA from the backend's check on the device, which sees the ids
  /// as given (int64 is never narrowed), so on every rank for all2allv / ht / naive / allgather_reducescatter,
  /// and for ll and ht with use_worst_case_sizing (no host sync) by the next forward call, on every rank,
  /// also for the hierarchical ll / ht of multi-node groups (PrepareFinalize::take_device_error is folded
  /// into the layer's all-gather of T; the backends' own prepare / finalize leave it to that:
  /// defer_device_errors), that selection dropped (ll; ht worst-case moves nothing in that call) (dispatch.h). With DP chunking,
  /// t counts from the chunk's first row.
  void forward_routed(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                      const TensorView& out, Stream stream = {});
  const PathCounters& counters() const;
  /// Phase times of the last eager forward call (ModularMoEOptions::time_phases). On CUDA this
  /// waits for that call's last event (a host sync). Throws CudaError.
  PhaseTimes last_phase_times();
  /// DP metadata of the last forward call (empty before the first).
  const DPMetadata& dp_metadata() const;
  /// Whether chunks on the fused path run the shared expert DP-sharded (see ModularMoEOptions).
  bool shared_expert_sharded() const;
  /// The capability gate in effect: a chunk fuses when M <= this (auto mode).
  int64_t fhmoe_max_tokens() const;
  /// Fused chunks with M > this put the shared rows into their local slot
  /// (Config::fhmoe_local_shared_tokens; -1 = never: not ll, hierarchical, sharded or not CUDA):
  /// their output then rounds as on the separate path (out + g * y added after the combine).
  int64_t shared_local_slot_tokens() const;

  // ---- whole-layer CUDA graph (decode) ----
  /// nullopt when capture_graph() can capture this layer for batches of up to `max_tokens` rows per
  /// rank; else one sentence why not: a CPU group, a backend that is not graph-safe
  /// (Capabilities::graph_safe: its prepare/finalize sync with the host), DP chunking, or a capacity
  /// below max_tokens.
  std::optional<std::string> why_no_graph(int64_t max_tokens) const;
  /// Captures the whole layer (router when topk_idx is empty, else the given routing; routing
  /// columns; prepare; experts; finalize; shared expert) on `stream` into a CUDA graph this object
  /// keeps, on static buffers that the caller refills before every replay:
  ///   x [T_max, H] bf16, out [T_max, H] bf16, topk_idx [T_max, K] int32/int64 and
  ///   topk_weights [T_max, K] fp32 (or both empty: the layer's router), all on the group's GPU;
  ///   num_tokens [1] int32 on the GPU: the valid rows of this step (0 <= n <= T_max), read by the
  ///   backend on the device (DispatchArgs::num_tokens); rows >= n of out are undefined. Empty:
  ///   every replay takes all T_max rows (for graph-safe backends that take no device count, such
  ///   as ht with DispatchConfig::use_worst_case_sizing).
  /// Every rank passes the same T_max (checked); the DP metadata is static (T_max per rank, one
  /// chunk), so replays need no host collective and ranks may have different n. Runs the layer once
  /// eagerly first (workspaces of the experts and the backend grow on first use, and growing is not
  /// capturable), then captures. Collective. Throws Unsupported with why_no_graph()'s sentence,
  /// InvalidArgument for bad buffers or a legacy-default stream, CudaError if capture fails.
  void capture_graph(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights, const TensorView& out,
                     const TensorView& num_tokens, Stream stream);
  /// Replays the captured layer on `stream` (collective: every rank replays). Counts a call, its
  /// chunk and its shared path. Throws InvalidArgument when nothing was captured.
  void replay_graph(Stream stream);
  bool has_graph() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Router logits [T, E] fp32 = x [T, H] (bf16) . router_weight^T (+ router_bias when defined), fp32 accumulation.
void router_logits_cpu(const MoEWeights& w, const TensorView& x, const TensorView& logits);

/// Single-rank, no-EP reference of the whole layer on CPU:
///   out[t] = round_bf16( sum_k w[t,k] * expert_{idx[t,k]}(x~[t]) + g(t) * shared(x~[t]) )   (one rounding;
///            ModularMoE's fused path, and its separate path on backends with Capabilities::combine_addend)
///   two_roundings, separate path only:
///   out[t] = round_bf16( round_bf16(sum_k w[t,k] * expert_{idx[t,k]}(x~[t])) + g(t) * shared(x~[t]) )
/// with routed expert outputs bf16-rounded, the sum in fp32 in column order. x~ = x, or x quantized
/// to FP8 1x128 and back when dispatch_dtype is fp8 (as the wire does); the shared expert sees x~ on
/// both paths (the layer's separate path quantizes x as the wire does, so an fp8_block shared
/// expert runs on the same FP8 kernels as the fused one). g = 1, or sigmoid(x . shared_gate) for Qwen.
struct ReferenceOptions {
  DType dispatch_dtype = DType::bf16;
  bool use_ue8m0 = false;
  /// The layer's shared path: true = fused; false = separate. Both round once unless two_roundings.
  bool shared_fused = false;
  /// With shared_fused = false: the combined routed rows are rounded to bf16 before g * shared is
  /// added, as ModularMoE's separate path does on a backend without Capabilities::combine_addend
  /// (the hierarchical ll / ht).
  bool two_roundings = false;
};
void moe_reference_cpu(const MoEWeights& w, const TensorView& x, const TensorView& topk_idx,
                       const TensorView& topk_weights, const TensorView& out, const ReferenceOptions& opt = {});

}  // namespace epx
