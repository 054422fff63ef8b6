// tools/epx/moe_run.h: the main job `epx moe`: build a workload (model, weights, per-step inputs),
// run it through ModularMoE over R CPU ranks for each backend, validate every step against the
// single-rank no-EP reference, and report (table + RESULTS.md JSON).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epx/config.h"
#include "epx/moe.h"
#include "epx/tensor.h"

namespace epx::cli {

/// Every flag of `epx moe` (see add_moe_command for the help text of each).
struct MoeOptions {
  std::string preset = "deepseek-v3-mini";
  int ranks = 4;
  std::string backend = "all";
  int64_t tokens_per_rank = 64;
  int steps = 5;
  std::string device = "auto";
  std::string routing = "uniform";  ///< uniform | zipf | router
  double zipf_s = 1.2;
  std::string dispatch_dtype = "bf16";
  std::string shared = "auto";      ///< separate | fused | auto
  int chunk_size = 0;
  uint64_t seed = 1;
  int expert_pool = 0;  ///< --expert-pool P: random expert e holds expert e mod P's values (MoEWeights::expert_pool)
  std::string trace;
  std::string json;
  std::string config;
  int warmup = 1;
  // Which flags the user gave explicitly (a trace fixes ranks, tokens and routing).
  bool ranks_given = false, tokens_given = false, steps_given = false, routing_given = false, shared_given = false;
  // The GPU path (--device cuda, moe_cuda_run.h): validated tokens per rank and step (0 = all), a
  // hidden fault injection (rank to kill after its first step; -1 none), and the experts whose
  // weights build_workload builds ([begin, end); end -1 = all): each GPU rank builds only its own.
  int validate_tokens = 16;
  int debug_kill_rank = -1;
  int expert_begin = 0, expert_end = -1;
  /// "" (plain), "decode" (128 tokens/rank unless given; whole-layer CUDA graph replay where the
  /// backend is graph-safe) or "prefill" (4096 tokens/rank unless given; eager).
  std::string mode;
  bool compare = false;  ///< A/B: every chosen backend x shared expert fused and separate, delta table
  bool expert_contiguous = false;  ///< ht: the experts on prepare's expert-contiguous rows (DispatchConfig::expert_contiguous)
  bool graph = true;     ///< decode: replay a captured graph where possible (--no-graph: eager)
  // --checkpoint DIR --layer N [--hidden FILE] (moe_checkpoint.h): the layer and its weights from a
  // checkpoint instead of the preset, hidden states from a file.
  std::string checkpoint;
  int layer = -1;
  std::string hidden;
};

/// tokens per rank of --mode decode / prefill when --tokens-per-rank is not given.
constexpr int64_t kDecodeTokensPerRank = 128;
constexpr int64_t kPrefillTokensPerRank = 4096;

/// One step's inputs, per rank, plus its reference output on the concatenated tokens.
struct StepInput {
  std::vector<Tensor> x;             ///< [R] of [T_r, H] bf16
  std::vector<Tensor> topk_idx;      ///< [R] of [T_r, K] int32 (undefined with --routing router)
  std::vector<Tensor> topk_weights;  ///< [R] of [T_r, K] fp32 (undefined with --routing router)
  Tensor reference;                  ///< [sum_r T_r, H] bf16, built once by ensure_references
  int64_t num_tokens() const;        ///< sum_r T_r
};

/// Everything a backend run needs; built once, shared by all backends.
struct Workload {
  MoEConfig model;
  NodeLayout nodes;        ///< the group's node layout (CUDA runs; has_nodes)
  bool has_nodes = false;
  std::shared_ptr<MoEWeights> weights;
  Config config;
  std::vector<StepInput> steps;
  int num_ranks = 0;
  bool use_router = false;            ///< forward() with the model's router, else forward_routed()
  std::string routing;                ///< "uniform", "zipf(s=1.2)", "router", "trace <file>"
  std::string trace_source;           ///< Trace::source when replaying a trace
  DType dispatch_dtype = DType::bf16;
  SharedExpertMode shared_mode = SharedExpertMode::auto_gate;
  int chunk_size = 0;                 ///< effective DP chunk (0 = unchunked)
  int64_t capacity = 0;               ///< num_max_dispatch_tokens_per_rank
  int64_t max_tokens_per_rank = 0;    ///< max over steps and ranks of T_r
  int warmup = 0;
  std::string mode;                   ///< "", "decode", "prefill"
  bool use_graph = false;             ///< decode: try whole-layer graph replay (--device cuda)
  bool compare = false;               ///< --compare: results are an A/B (delta table + JSON "compare")
  bool expert_contiguous = false;     ///< --expert-contiguous: ht's layers take DispatchConfig::expert_contiguous
  // Set by the GPU path for the report (empty: the CPU defaults).
  std::string device_name;            ///< e.g. "2 x NVIDIA H200"
  std::string nccl_version;           ///< e.g. "2.28.9"; empty on virtual ranks (their collectives are device copies)
  /// Ranks sharing one GPU (GPU runs): 1 with one process per GPU, R on virtual ranks
  /// (make_virtual_cuda_groups); 0 on CPU ranks (JSON null).
  int ranks_per_gpu = 0;
};

/// Result of one backend over all steps.
struct BackendResult {
  std::string backend;
  std::string status;                 ///< "pass" | "FAIL" | "unsupported" | "error"
  std::string message;                ///< why, for anything but pass
  std::vector<double> step_us;        ///< measured per-step latency (rank 0's view, barrier to barrier)
  double max_rel_error = 0.0;         ///< max over steps of max|out - ref| / max|ref|
  double rel_l2_error = 0.0;          ///< max over steps of ||out - ref||_2 / ||ref||_2
  bool validated = false;             ///< every step was compared with the reference in this run
  PathCounters counters;              ///< rank 0, measured steps only (warm-up excluded)
  int64_t validated_tokens = -1;      ///< tokens compared with the reference over all steps (-1: all)
  SharedExpertMode shared_mode = SharedExpertMode::auto_gate;  ///< the shared-expert mode of this run
  bool graph = false;                 ///< steps were replays of a captured whole-layer CUDA graph
  std::string graph_reason;           ///< why not, when a graph was asked for (decode) and not used
  bool shared_sharded = false;        ///< the layer DP-shards its shared expert (fused chunks)
  int64_t fhmoe_max_tokens = -1;      ///< the layer's gate in effect (ModularMoE::fhmoe_max_tokens); -1 not known
  int64_t shared_local_slot_tokens = -1;  ///< fused chunks of M > this use the local shared slot (separate-path rounding); -1 never
  /// Per eager step: each phase's time (ModularMoE::last_phase_times): CUDA runs the max over
  /// ranks of device time, CPU runs rank 0's host time; empty under graph replay (one launch).
  std::vector<PhaseTimes> phases;
};

/// One run of `epx moe`: (backend, shared-expert mode) pairs in order. Without --compare: each
/// chosen backend with the workload's mode; with --compare and a shared expert: each backend fused,
/// then separate.
struct RunVariant {
  std::string backend;
  SharedExpertMode shared_mode = SharedExpertMode::auto_gate;
};
std::vector<RunVariant> run_variants(const Workload& workload, const std::vector<std::string>& backends, bool compare);
std::string shared_mode_name(SharedExpertMode m);
/// Sum over steps of tokens / sum of step latencies [tokens/s] (0 when nothing ran).
double tokens_per_second(const Workload& workload, const BackendResult& result);
/// Drops the references when `mode` changes what they are (fp8 wire with a shared expert: fused
/// sees the wire's x) so the next ensure_references recomputes them for `mode`.
void set_shared_mode(Workload& workload, SharedExpertMode mode);

/// rel L2 at or below this passes (METHOD: bf16 operands land between 1e-3 and 1e-2; NaN never passes).
constexpr double kRelL2Tolerance = 1e-2;

/// Builds the workload from options. Throws InvalidArgument for inconsistent flags/trace/preset.
Workload build_workload(const MoeOptions& options, const Config& config);
/// Computes each step's reference output (once; later calls return at once).
void ensure_references(Workload& workload);
/// Runs `backend` over all steps and validates. Throws InvalidArgument (bad shapes/flags);
/// other failures (Unsupported, Timeout, CommError, ...) are reported in the result.
BackendResult run_backend(const Workload& workload, const std::string& backend);

/// Linear-interpolated percentile p in [0, 100] of `values` (0 when empty).
double percentile(std::vector<double> values, double p);

// ---- input generators and checks shared with the GPU launcher path (moe_cuda_run.cpp, bench) ----

/// Seed of stream `what` (1 hidden states, 2 expert order, 3 routing) for (step, rank).
uint64_t stream_seed(uint64_t seed, uint64_t what, uint64_t step, uint64_t rank);
/// [T, H] bf16 N(0, 1). Row t depends only on (seed, t): the first n rows equal random_hidden(n, H, seed).
Tensor random_hidden(int64_t T, int64_t H, uint64_t seed);
/// K distinct experts per token from popularity p(perm[i]) ~ 1/(i+1)^s (s = 0: uniform); weights
/// positive, summing to 1. Token t depends only on (seed, t < T) in order.
void synthetic_routing(int64_t T, int K, int E, double zipf_s, const std::vector<int>& perm, uint64_t seed, Tensor& idx,
                       Tensor& wts);
/// Rows of `parts` (each [T_r, cols] of `dtype`) stacked into [sum T_r, cols].
Tensor concat_rows(const std::vector<Tensor>& parts, DType dtype, int64_t cols);
/// Rows `rows` of t [N, cols] as a new contiguous tensor.
Tensor gather_rows(const Tensor& t, const std::vector<int64_t>& rows);
/// Per token of a step's concatenated tokens: did the layer run that token's shared expert fused?
/// Per token of the step (ranks concatenated), the reference path of its chunk: 1 fused (the shared
/// expert through the combine, one rounding), 0 separate (g * y joins the combine's fp32 sum as
/// FinalizeArgs::addend, one rounding), 2 fused in the local shared slot (M > local_slot_tokens >= 0:
/// out + g * y added after the combine, two roundings: ReferenceOptions::two_roundings). fhmoe_max_tokens: the layer's gate (-1 =
/// Config::fhmoe_max_tokens); graph_tokens > 0: a whole-layer graph decided both at capture with
/// M = graph_tokens (T_max), whatever the step's counts.
std::vector<char> fused_per_token(const Workload& workload, const StepInput& step, int64_t fhmoe_max_tokens = -1,
                                  int64_t local_slot_tokens = -1, int64_t graph_tokens = 0);
/// max |out - ref| / max |ref| and ||out - ref|| / ||ref|| of two bf16 tensors (inf with NaN/inf).
void errors_against(const Tensor& out, const Tensor& ref, double* max_rel, double* rel_l2);
/// Compares step `step`'s output with its reference into `res` (max of the errors; the first failing
/// step's message). Returns false when rel L2 > kRelL2Tolerance (or NaN).
bool check_step(const Tensor& out, const Tensor& ref, size_t step, BackendResult& res);

}  // namespace epx::cli
