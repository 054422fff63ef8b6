// moe/modular_moe.cpp: the EP MoE layer on one rank (vLLM's modular-kernel shape).
//
//   forward(x) -> router_logits_cpu + route -> forward_routed:
//     once per call   all_gather of T (DP metadata; also carries "my arguments are bad" as -1, so
//                     every rank throws together instead of peers hanging in the next collective)
//     per DP chunk    build [n, K+1] routing (column K = shared route) -> prepare -> Experts::apply
//                     -> finalize (-> separate shared expert, added)
// Talks only to interfaces: make_prepare_finalize (dispatch.h) and make_experts_cpu /
// make_experts_cuda (experts.h).
//
// Device: the group's. On CUDA every tensor of forward() lives on the group's GPU; the router GEMM
// (cuBLAS), the routing columns, the shared gate and the separate shared expert's add run there
// (moe_cuda.h), the shared expert itself runs as a one-expert Flat make_experts_cuda, and the only
// host traffic is the DP metadata (T per rank, all_gather through the group). Weights stay
// CPU-resident in MoEWeights; the CUDA experts upload this rank's copies once, at construction.
// Routing values on CUDA are not range-checked on the host (that would need a copy back); the
// backends and the CUDA experts treat an out-of-range id as their contracts say.
//
// Shared expert (FHMoE): the backend is created with top_k = K+1 and shared_route = true whenever
// the model has a shared expert, so one backend serves both paths and the capability gate can pick
// per chunk. Fused: column K = E (the source rank's shared replica, local expert L-1 there) with
// weight g(t) = 1 or sigmoid(x . gate); the shared expert then sees the dispatched x (FP8 on an fp8
// wire). Separate: column K = -1 (no traffic); the shared expert runs here on x~, x quantized to FP8
// 1x128 as the wire does (fp8 wire; else x), and g(t) * its output joins the combine's fp32 sum
// (FinalizeArgs::addend) before its one rounding, as on the fused path (the hierarchical ll / ht
// add it to the cross-node fp32 sum of node partials that arrive rounded: dispatch/hier/hier.h). On CUDA x~ goes to a one-expert ExpertMajor
// layout [1, n, H] (contiguous, M = n), so an fp8_block shared expert runs on the same FP8
// tensor-core GEMMs as the fused one and the two paths differ only in where g(t) * y joins the sum.
// Gate: fuse when M = max over ranks of this chunk's tokens <= fhmoe_max_tokens (the sharded gate
// for a DP-sharded layer). M comes from the gathered T, so every rank takes the same path and the
// collectives line up. Local shared slot (CUDA, ExpertMajor slots of one node: ll): a fused chunk
// with M > Config::fhmoe_local_shared_tokens keeps column K = -1 too and writes x~ into rows
// [0, n) of slot L-1 itself (its own [L] counts for the experts; the backend's recv_count, which the
// combine reads, stays 0 there), so the rank's own rows skip the dispatch and the combine; the
// grouped launch runs them with the routed experts, and g(t) * y is added after the combine (the
// separate path's rounding).
// DP-sharded shared expert (backends with Capabilities::gathers_all_tokens, R > 1): local expert
// L-1 is rank r's slice of the shared expert's intermediate dimension instead of a replica; on a
// fused chunk column K stays -1, and after the routed experts the slice runs on every gathered row
// (the dispatched x) and g(t) * its output is added to the partials, which finalize sums over ranks
// (reduce-scatter / all-reduce): each slice once, so the shared expert once. g of remote rows comes
// from one all_gatherv sized by the DP metadata (only for models with a shared gate).
// Whole-layer CUDA graph: the same code with static DP metadata (T_max on every rank, one chunk),
// no host collective, and the valid row count on the device (DispatchArgs::num_tokens).
#include <algorithm>
#include <chrono>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/moe.h"
#include "epx/quant.h"
#include "moe/moe_internal.h"
#ifdef EPX_WITH_CUDA
#include "moe/moe_cuda.h"
#endif

namespace epx {

DPMetadata DPMetadata::from_tokens(std::vector<int64_t> tokens, int64_t chunk) {
  constexpr std::string_view op = "DPMetadata::from_tokens";
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  require_arg(op, "chunk_size", chunk, chunk >= 0, "must be >= 0 (0 = unchunked)");
  DPMetadata d;
  d.tokens_per_rank = std::move(tokens);
  d.cumulative.assign(d.tokens_per_rank.size() + 1, 0);
  for (size_t r = 0; r < d.tokens_per_rank.size(); ++r) {
    const int64_t t = d.tokens_per_rank[r];
    // The exclusive prefix sums are row offsets into the gathered rows: they must fit in int64.
    if (t < 0 || t > kMax - d.cumulative[r]) {
      throw InvalidArgument(arg_message(op, "tokens_per_rank[" + std::to_string(r) + "]", t,
                                        t < 0 ? std::string("must be >= 0")
                                              : "must keep the sum over ranks <= INT64_MAX (the ranks before it sum to " +
                                                    std::to_string(d.cumulative[r]) + ")"));
    }
    d.cumulative[r + 1] = d.cumulative[r] + t;
    d.max_tokens = std::max(d.max_tokens, t);
  }
  d.chunk_size = chunk > 0 ? chunk : std::max<int64_t>(d.max_tokens, 1);
  // ceil(max_tokens / chunk_size) without forming max_tokens + chunk_size - 1 (which overflows near INT64_MAX).
  d.num_chunks = std::max<int64_t>(1, d.max_tokens / d.chunk_size + (d.max_tokens % d.chunk_size != 0 ? 1 : 0));
  return d;
}

int64_t DPMetadata::chunk_tokens(int64_t chunk, int rank) const {
  constexpr std::string_view op = "DPMetadata::chunk_tokens";
  if (chunk < 0 || chunk >= num_chunks)
    throw InvalidArgument(arg_message(op, "chunk", chunk, "must be in [0, num_chunks = " + std::to_string(num_chunks) + ")"));
  if (rank < 0 || static_cast<size_t>(rank) >= tokens_per_rank.size())
    throw InvalidArgument(arg_message(op, "rank", rank, "must be in [0, R = " + std::to_string(tokens_per_rank.size()) + ")"));
  // chunk < num_chunks = ceil(max_tokens / chunk_size), so chunk * chunk_size <= max_tokens: no overflow.
  return std::clamp<int64_t>(tokens_per_rank[static_cast<size_t>(rank)] - chunk * chunk_size, 0, chunk_size);
}

std::vector<int64_t> DPMetadata::chunk_counts(int64_t chunk) const {
  std::vector<int64_t> c(tokens_per_rank.size());
  for (size_t r = 0; r < c.size(); ++r) c[r] = chunk_tokens(chunk, static_cast<int>(r));
  return c;
}

int64_t DPMetadata::chunk_max(int64_t chunk) const {
  int64_t m = 0;
  for (size_t r = 0; r < tokens_per_rank.size(); ++r) m = std::max(m, chunk_tokens(chunk, static_cast<int>(r)));
  return m;
}

struct ModularMoE::Impl {
  std::shared_ptr<const MoEWeights> weights;
  std::shared_ptr<Group> group;
  std::unique_ptr<PrepareFinalize> prepare_finalize;
  std::unique_ptr<Experts> experts;
  SharedExpertMode shared_mode = SharedExpertMode::auto_gate;
  int64_t chunk_size = 0;        // 0 = unchunked
  int64_t capacity = 0;          // num_max_dispatch_tokens_per_rank
  int64_t padded_block = 0;      // gathering backend in its padded form (use_worst_case_sizing): rows per rank's block
  int64_t fhmoe_max_tokens = 0;
  bool mixed_formats = false;  // the shared expert's weight format differs from the routed experts' (heterogeneous FHMoE)
  int num_experts = 0;           // E
  int top_k = 0;                 // K (routed columns)
  bool wire_fp8 = false;         // dispatch_dtype fp8: the separate shared expert sees x quantized the same way
  bool wire_ue8m0 = false;
  bool has_shared = false;
  bool sharded = false;          // the shared expert runs DP-sharded on fused chunks (local expert L-1 = shard)
  /// ht with DispatchConfig::expert_contiguous: the experts run on prepare's expert-contiguous rows
  /// (ActivationLayout::Contiguous with its [L + 1] offsets) and finalize weights them (FinalizeArgs::topk_weights).
  bool contiguous = false;
  int shard_slot = -1;           // L-1
  int64_t local_shared_tokens = -1;  // fused chunks of M > this: shared rows into slot L-1 by hand; -1 never (Config::fhmoe_local_shared_tokens)
  PathCounters counters;
  DPMetadata dp;                 // of the last forward call

  Device device;                 // the group's: where x, routing and out live
  std::vector<std::shared_ptr<const ExpertWeights>> shared_only;  // CUDA separate path: {weights->shared}

  // Scratch reused across calls (on `device`).
  Tensor expert_out;             // storage for Experts::apply (bf16, or fp32 Flat partials), grown on demand
  DType flat_partial = DType::bf16;  // expert_out of the Flat layout: fp32 with DispatchConfig::flat_combine partial_fp32
  bool combine_addend = false;   // the backend takes FinalizeArgs::addend: the separate shared expert joins its fp32 sum
  Tensor shared_addend;          // [n, H] fp32 g * shared(x~) of a separate chunk (combine_addend)
  std::vector<float> x_float, shared_y;
  Tensor route_idx, route_wts, gate;  // [n, K+1] routing of the chunk, g [n] (CUDA)
  Tensor logits, router_idx, router_wts;  // forward(): router logits [T, E] and its top-k [T, K]

#ifdef EPX_WITH_CUDA
  // CUDA only: the router's tensors uploaded once, the cuBLAS handle, the separate shared expert.
  Tensor router_weight_dev, correction_bias_dev, router_bias_dev, shared_gate_dev;
  std::unique_ptr<moe_cuda::Blas> blas;
  std::unique_ptr<Experts> shared_experts;  // one expert (the shared one; ExpertMajor on an fp8 wire, else Flat), created on first use
  Tensor x_f32, shared_idx, shared_wts, shared_out;
  Tensor shared_xq, shared_xs, shared_count;  // separate path, fp8 wire: x~ [1, n, H] FP8, scales, recv_count [1]
  Tensor gate_all;                           // [N] g of the gathered rows (sharded, shared gate)
  Tensor gate_pad;                           // [C] this rank's g in its padded block (padded form)
  Tensor local_counts;                       // [L] recv_count with slot L-1 = the chunk's rows (local_shared)
  std::unique_ptr<moe_cuda::Graph> graph;    // the whole-layer graph, once captured
#endif
  std::vector<float> gate_all_host;          // CPU: [N] g of the gathered rows (sharded)
  Tensor shared_idx_any, shared_wts_any;     // [N, 1] route of the shard over the gathered rows
  Tensor shard_out;                          // [N, H] bf16: the shard's output (sharded)
  int64_t graph_max_tokens = 0;              // T_max of the captured graph
  Config experts_config;                     // the layer's Config, for experts built later (separate shared expert)
  // Phase timing (ModularMoEOptions::time_phases): kPhaseMarks marks per chunk, reset per eager call.
  static constexpr int kPhaseMarks = 5;
  bool time_phases = false;
  bool capturing = false;                    // inside capture_graph (its warm-up included): no marks
  std::vector<std::chrono::steady_clock::time_point> host_marks;  // CPU
#ifdef EPX_WITH_CUDA
  std::unique_ptr<moe_cuda::PhaseEvents> phase_events;             // CUDA
#endif
  void reset_phases() {
    host_marks.clear();
#ifdef EPX_WITH_CUDA
    if (phase_events) phase_events->reset();
#endif
  }
  void mark_phase(Stream stream) {
    if (!time_phases || capturing) return;
#ifdef EPX_WITH_CUDA
    if (device.is_cuda()) {
      if (!phase_events) phase_events = std::make_unique<moe_cuda::PhaseEvents>(device.index, kPhaseMarks);
      phase_events->mark(stream);
      return;
    }
#endif
    (void)stream;
    host_marks.push_back(std::chrono::steady_clock::now());
  }
  bool graph_fused = false;                  // the captured graph's shared path

  /// The chunk loop of one call over `dp` (eager: from the gathered T; graph: static). `num_tokens`
  /// (graph only) goes to the backend as DispatchArgs::num_tokens.
  void run_chunks(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights, const TensorView& out,
                  const TensorView& num_tokens, Stream stream);
  /// Router on x [T, H] into scratch: topk_idx [T, K] int32, topk_weights [T, K] fp32.
  void route_rows(const TensorView& x, Stream stream, TensorView& topk_idx, TensorView& topk_weights);
  /// The gathered rows' expert partials += g * shard(x): the DP-sharded shared expert (chunk `c`).
  void add_sharded_shared(const PrepareResult& prepared, const TensorView& expert_view, const TensorView& g,
                          const std::vector<float>& gate_host, int64_t c, Stream stream);

  void run_chunk(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights, const TensorView& out,
                 int64_t begin, int64_t end, bool fused, int64_t c, const TensorView& num_tokens, Stream stream);
  TensorView expert_out_like(const TensorView& recv_x);
  /// Grows `t` (1-D storage of `dtype` on `device`) to at least `numel` elements; returns a view of `dims`.
  TensorView scratch(Tensor& t, DType dtype, const std::vector<int64_t>& dims);
  /// Routing of rows [begin, end) with the shared column: idx/wts [n, K(+1)] and gate [n] (CPU or CUDA).
  /// idx is int32 on the CPU (values checked), topk_idx's dtype on CUDA (values checked by the dispatch).
  void route_columns(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights, int64_t begin,
                     int64_t end, bool fused, Stream stream, TensorView& idx, TensorView& wts, TensorView& g,
                     std::vector<float>& gate_host);
  /// The experts' input of a fused chunk with the local shared slot (CUDA, ExpertMajor): x_chunk
  /// quantized as the wire does (or copied, bf16 wire) into rows [0, n) of slot L-1 of the
  /// prepared buffers, and recv_count with slot L-1 = n (or the graph's device count `num_tokens`)
  /// in the layer's own [L] counts (the backend's recv_count, which its combine reads, stays 0 there).
  ExpertsInput local_shared_input(const PrepareResult& prepared, const TensorView& x_chunk, const TensorView& num_tokens,
                                  Stream stream);
  /// out_chunk += g * shared(x_chunk): the separate shared expert (CPU or CUDA); out_chunk fp32 (the
  /// combine's FinalizeArgs::addend) is overwritten with g * shared(x_chunk) instead. `num_tokens`
  /// (whole-layer graph only): the valid rows' count on the device; rows past it are not computed.
  void add_separate_shared(const TensorView& x_chunk, const TensorView& out_chunk, const TensorView& g,
                           const std::vector<float>& gate_host, const TensorView& num_tokens, Stream stream);
};

namespace {

constexpr std::string_view kCtorOp = "ModularMoE";
constexpr std::string_view kFwdOp = "ModularMoE.forward";

void check_rows(std::string_view op, std::string_view arg, const TensorView& t, int64_t rows, int64_t hidden, Device device) {
  check_device(op, arg, t, device);
  check_dtype(op, arg, t, {DType::bf16});
  check_shape(op, arg, t, {rows, hidden});
  check_contiguous(op, arg, t);
}

/// Routing [T, K] on `device`: on the CPU the full check (values included, moe_internal.h); on CUDA
/// device, dtype, shape and layout only (the values stay on the device).
void check_routing_on(Device device, std::string_view op, const TensorView& topk_idx, const TensorView& topk_weights,
                      int64_t T, int num_experts) {
  if (device.is_cpu()) {
    moe_detail::check_routing(op, topk_idx, topk_weights, T, num_experts);
    return;
  }
  check_device(op, "topk_idx", topk_idx, device);
  check_dtype(op, "topk_idx", topk_idx, {DType::int32, DType::int64});
  check_shape(op, "topk_idx", topk_idx, {T, -1});
  check_contiguous(op, "topk_idx", topk_idx);
  check_device(op, "topk_weights", topk_weights, device);
  check_dtype(op, "topk_weights", topk_weights, {DType::fp32});
  check_shape(op, "topk_weights", topk_weights, {T, topk_idx.shape[1]});
  check_contiguous(op, "topk_weights", topk_weights);
}

[[noreturn, maybe_unused]] void no_cuda(std::string_view what) {
  throw Unsupported(std::string(kFwdOp) + ": " + std::string(what) + ": this build has no CUDA (configure with EPX_CUDA=ON)");
}

}  // namespace

ModularMoE::ModularMoE(std::shared_ptr<const MoEWeights> weights, std::shared_ptr<Group> group, const std::string& backend,
                       DispatchConfig dispatch_cfg, const Config& config, ModularMoEOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  require_arg(kCtorOp, "group", "null", group != nullptr, "must be set");
  const int R = group->size(), rank = group->rank();
  std::vector<std::shared_ptr<const ExpertWeights>> local;
  // This rank's own arguments (weights and its experts, options, capacity; on CUDA the router's upload) are
  // checked before the first collective. A failure on one rank is gathered, so every rank throws here (that rank
  // its own error, the others naming it) instead of that rank alone while its peers wait in the backend's
  // collective creation until timeout_s.
  std::exception_ptr local_error;
  int64_t routed_code = 0;  // 1 + WeightFormat of this rank's routed experts (0: it holds none); gathered below
  try {
    require_arg(kCtorOp, "weights", "null", weights != nullptr, "must be set");
    const MoEConfig& mc = weights->config;
    validate_router_config(mc.router);
    m.weights = weights;
    m.group = group;
    m.num_experts = mc.router.num_experts;
    m.top_k = mc.router.top_k;
    m.has_shared = mc.num_shared_experts > 0;
    m.wire_fp8 = dispatch_cfg.dispatch_dtype == DType::fp8_e4m3;
    m.wire_ue8m0 = dispatch_cfg.use_ue8m0;
    m.shared_mode = options.shared_mode;
    m.time_phases = options.time_phases;
    m.experts_config = config;
    if (m.has_shared)
      require_arg(kCtorOp, "weights.shared", "null", weights->shared != nullptr, "must be set: the model has a shared expert");

    require_arg(kCtorOp, "options.chunk_size", options.chunk_size, options.chunk_size >= 0, "must be >= 0 (0 = Config::moe_chunk_size)");
    m.chunk_size = options.chunk_size > 0 ? options.chunk_size : std::max(0, config.moe_chunk_size);
    require_arg(kCtorOp, "options.fhmoe_max_tokens", options.fhmoe_max_tokens, options.fhmoe_max_tokens >= -1,
                "must be >= 0 (fuse the shared expert when M <= it) or -1 (= Config::fhmoe_max_tokens)");
    m.fhmoe_max_tokens = options.fhmoe_max_tokens >= 0 ? options.fhmoe_max_tokens : config.fhmoe_max_tokens;  // sharded: below
    m.capacity = dispatch_cfg.num_max_dispatch_tokens_per_rank;
    // Capacity 0 = no limit (dynamic backends; static ones such as ll reject 0 when created).
    require_arg(kCtorOp, "dispatch_cfg.num_max_dispatch_tokens_per_rank", m.capacity, m.capacity >= 0, "must be >= 0 (0 = no limit)");
    if (m.chunk_size > 0 && m.capacity > 0) {
      require_arg(kCtorOp, "dispatch_cfg.num_max_dispatch_tokens_per_rank", m.capacity, m.capacity >= m.chunk_size,
                  "must be >= chunk_size = " + std::to_string(m.chunk_size) + " (every chunk is one dispatch)");
    }

    // Local experts: this rank's routed range, then the shared replica or shard (local id L-1, route id E).
    const ExpertRange range = expert_range(m.num_experts, R, rank);
    for (int e = range.begin; e < range.end; ++e) {
      const bool built = static_cast<size_t>(e) < weights->experts.size() && weights->experts[e];
      require_arg(kCtorOp, "weights.experts[" + std::to_string(e) + "]", "null", built,
                  "must be built: rank " + std::to_string(rank) + " holds experts [" + std::to_string(range.begin) + ", " +
                      std::to_string(range.end) + ")");
      local.push_back(weights->experts[e]);
      if (routed_code == 0) routed_code = 1 + static_cast<int64_t>(weights->experts[e]->format);
    }
    // A rank with no routed expert (E < R) and no shared replica still takes part in every collective;
    // it gets an Experts object only when it has something to run.
    m.device = group->device();
    if (m.device.is_cuda()) {
#ifdef EPX_WITH_CUDA
      m.router_weight_dev = weights->router_weight.to(m.device);
      if (weights->router_bias.defined()) {  // gpt-oss mlp.router.bias: joins the fp32 logits before the top-k
        require_arg(kCtorOp, "weights.router_bias", weights->router_bias.view().describe(),
                    weights->router_bias.dtype() == DType::fp32 && weights->router_bias.numel() == weights->config.router.num_experts,
                    "must be [E] fp32");
        m.router_bias_dev = weights->router_bias.to(m.device);
      }
      if (weights->correction_bias.defined()) m.correction_bias_dev = weights->correction_bias.to(m.device);
      if (weights->shared_gate_weight.defined()) m.shared_gate_dev = weights->shared_gate_weight.to(m.device);
      m.blas = std::make_unique<moe_cuda::Blas>(m.device.index);
      if (m.has_shared) m.shared_only = {weights->shared};
#else
      no_cuda("group device = " + m.device.str());
#endif
    }
  } catch (...) {
    local_error = std::current_exception();
  }
  // One all-gather says which ranks rejected their arguments (-1) and, otherwise, the format of their routed experts
  // (routed_code), so every rank takes the same gate below.
  const std::vector<int64_t> gathered = group->all_gather_i64(local_error ? -1 : routed_code);
  if (local_error) std::rethrow_exception(local_error);
  for (int r = 0; r < R; ++r)
    if (gathered[static_cast<size_t>(r)] < 0)
      throw InvalidArgument(std::string(kCtorOp) + ": rank " + std::to_string(r) +
                            " rejected its arguments: every rank stops (see that rank's error)");
  const MoEConfig& mc = weights->config;

  dispatch_cfg.hidden = mc.hidden;
  dispatch_cfg.num_experts = m.num_experts;
  dispatch_cfg.top_k = m.top_k + (m.has_shared ? 1 : 0);
  dispatch_cfg.shared_route = m.has_shared;
  m.prepare_finalize = make_prepare_finalize(backend, group, dispatch_cfg, config);  // ll / ht launch settings from the layer's Config
  m.prepare_finalize->defer_device_errors();  // reported by forward_routed's all-gather of T, on every rank at once
  const Capabilities& caps = m.prepare_finalize->capabilities();

  // DP-sharded shared expert: whole blocks of the weight format split as evenly as possible; only
  // when every rank gets at least one (deterministic from the config, so every rank decides alike).
  if (m.has_shared) {
    const ExpertWeights& sw = *weights->shared;
    const int64_t g = intermediate_granularity(sw.format), blocks = (sw.intermediate + g - 1) / g;
    m.sharded = options.shard_shared_expert && R > 1 && caps.gathers_all_tokens && blocks >= R;
    if (m.sharded) {
      const int64_t base = blocks / R, extra = blocks % R;
      const int64_t b0 = rank * base + std::min<int64_t>(rank, extra), b1 = b0 + base + (rank < extra ? 1 : 0);
      local.push_back(sw.slice_intermediate(b0 * g, std::min(b1 * g, sw.intermediate)));
    } else {
      local.push_back(weights->shared);
    }
    m.shard_slot = static_cast<int>(local.size()) - 1;
    // The local shared slot: ExpertMajor slots of one node on CUDA (the layout's contract: rows
    // [0, recv_count[l]) of slot l; slot L-1 receives nothing when column K is -1).
    const bool slots = !m.sharded && m.device.is_cuda() && caps.layout == ActivationLayout::ExpertMajor && !caps.hierarchical;
    m.local_shared_tokens = slots ? config.fhmoe_local_shared_tokens : -1;
    if (m.sharded && options.fhmoe_max_tokens < 0) m.fhmoe_max_tokens = config.fhmoe_max_tokens_sharded;
    // Heterogeneous FHMoE (the shared expert's format differs from the routed experts' on the lowest rank holding
    // any, e.g. V4-Pro's FP8 shared + MXFP4 routed): its own gate, Config::fhmoe_max_tokens_mixed (bench/NOTES.md).
    int64_t routed = 0;
    for (int64_t g : gathered)
      if (g > 0) {
        routed = g;
        break;
      }
    m.mixed_formats = routed > 0 && routed != 1 + static_cast<int64_t>(sw.format);
    if (!m.sharded && m.mixed_formats && options.fhmoe_max_tokens < 0) m.fhmoe_max_tokens = config.fhmoe_max_tokens_mixed;
  }
  // After the backend (collective, and where an unsupported one stops): the CUDA experts upload
  // this rank's weights, which is not worth doing for a backend that cannot run. A factory's Experts must
  // fit the slots it is handed (one per local expert, the model's hidden). A failure here (a misfit, or
  // building throws) is folded into the collective composition check below, so every rank throws at
  // construction instead of this rank alone while its peers wait in the next collective until timeout_s.
  std::exception_ptr build_error;
  if (!local.empty()) {
    const int64_t slots = static_cast<int64_t>(local.size());
    try {
      if (options.make_experts) {
        m.experts = options.make_experts(std::move(local), m.device);
        require_arg(kCtorOp, "options.make_experts", "a null Experts", m.experts != nullptr, "must return an Experts object");
        require_arg(kCtorOp, "options.make_experts", "an Experts of num_local_experts = " + std::to_string(m.experts->num_local_experts()),
                    m.experts->num_local_experts() == slots,
                    "must equal the " + std::to_string(slots) + " local experts it was given (rank " + std::to_string(rank) + ")");
        require_arg(kCtorOp, "options.make_experts", "an Experts of hidden = " + std::to_string(m.experts->hidden()),
                    m.experts->hidden() == mc.hidden, "must equal the model's hidden = " + std::to_string(mc.hidden));
      } else {
        m.experts = m.device.is_cpu() ? make_experts_cpu(std::move(local)) : make_experts_cuda(std::move(local), m.device.index, config);
      }
    } catch (...) {
      build_error = std::current_exception();
      m.experts.reset();
    }
  }
  // Composition check, collective so every rank throws the same sentence: the experts must take the
  // backend's activation layout (Flat for the gathered/deduplicated backends, ExpertMajor for ll).
  m.flat_partial = dispatch_cfg.flat_combine == FlatCombine::partial_fp32 ? DType::fp32 : DType::bf16;
  m.combine_addend = caps.combine_addend;
  // The padded form of naive / allgather_reducescatter: rank r's gathered rows start at r * C.
  if (caps.gathers_all_tokens && dispatch_cfg.use_worst_case_sizing) m.padded_block = dispatch_cfg.num_max_dispatch_tokens_per_rank;
  m.contiguous = dispatch_cfg.expert_contiguous;  // (make_prepare_finalize refused it for every backend but ht)
  const ActivationLayout layout = m.contiguous ? ActivationLayout::Contiguous : caps.layout;
  const int64_t fit = build_error ? 3 : !m.experts ? 2 : m.experts->supports(layout) ? 1 : 0;
  const std::vector<int64_t> fits = group->all_gather_i64(fit);
  if (build_error) std::rethrow_exception(build_error);
  for (int r = 0; r < R; ++r)
    if (fits[static_cast<size_t>(r)] == 3)
      throw InvalidArgument(std::string(kCtorOp) + ": rank " + std::to_string(r) +
                            " could not build experts that fit its local slots: every rank stops (see that rank's error)");
  for (int r = 0; r < R; ++r) {
    if (fits[static_cast<size_t>(r)] != 0) continue;
    std::string takes;
    if (m.experts) {
      for (ActivationLayout l : {ActivationLayout::Flat, ActivationLayout::ExpertMajor, ActivationLayout::Contiguous})
        if (m.experts->supports(l)) takes += (takes.empty() ? "" : ", ") + std::string(layout_name(l));
    }
    throw Unsupported(arg_message(kCtorOp, "backend", backend,
                                  "its activation layout " + std::string(layout_name(layout)) + " is not one the experts of rank " +
                                      std::to_string(r) + " take" + (takes.empty() ? "" : " (" + takes + ")") +
                                      ": compose it with experts that support " + std::string(layout_name(layout)) +
                                      ", or pick a backend whose layout the experts take"));
  }
  // Chunking and the gate decide how many collectives run; ranks must agree on them.
  group->check_agreement(std::string(kCtorOp), {{"chunk_size", m.chunk_size},
                                                {"fhmoe_max_tokens", m.fhmoe_max_tokens},
                                                {"shared_mode", static_cast<int64_t>(m.shared_mode)},
                                                {"shared_sharded", m.sharded}},
                         [](size_t field, int64_t v) -> std::string {  // the modes' names, as the CLI and Python spell them
                           static const char* const modes[] = {"separate", "fused", "auto"};
                           return field == 2 && v >= 0 && v <= 2 ? modes[v] : "";
                         });
  m.counters.backend = backend;
}

ModularMoE::~ModularMoE() = default;

const PathCounters& ModularMoE::counters() const { return impl_->counters; }

PhaseTimes ModularMoE::last_phase_times() {
  Impl& m = *impl_;
  PhaseTimes t;
  std::vector<double> us(Impl::kPhaseMarks - 1, 0.0);
#ifdef EPX_WITH_CUDA
  if (m.device.is_cuda()) {
    if (m.phase_events) us = m.phase_events->elapsed_us(t.chunks);
  } else
#endif
  {
    t.chunks = static_cast<int64_t>(m.host_marks.size() / Impl::kPhaseMarks);
    for (int64_t c = 0; c < t.chunks; ++c)
      for (int k = 0; k + 1 < Impl::kPhaseMarks; ++k) {
        const size_t i = static_cast<size_t>(c * Impl::kPhaseMarks + k);
        us[static_cast<size_t>(k)] += std::chrono::duration<double, std::micro>(m.host_marks[i + 1] - m.host_marks[i]).count();
      }
  }
  t.prepare_us = us[0];
  t.experts_us = us[1];
  t.finalize_us = us[2];
  t.shared_us = us[3];
  return t;
}
const DPMetadata& ModularMoE::dp_metadata() const { return impl_->dp; }
bool ModularMoE::shared_expert_sharded() const { return impl_->sharded; }
int64_t ModularMoE::fhmoe_max_tokens() const { return impl_->fhmoe_max_tokens; }
int64_t ModularMoE::shared_local_slot_tokens() const { return impl_->local_shared_tokens; }

void ModularMoE::Impl::route_rows(const TensorView& x, Stream stream, TensorView& topk_idx, TensorView& topk_weights) {
  const MoEWeights& w = *weights;
  const int64_t T = x.shape[0];
  // Scratch reused across calls: no allocation (on CUDA: no cudaMalloc) per forward.
  const TensorView logits = scratch(this->logits, DType::fp32, {T, num_experts});
  topk_idx = scratch(router_idx, DType::int32, {T, top_k});
  topk_weights = scratch(router_wts, DType::fp32, {T, top_k});
  if (device.is_cpu()) {
    router_logits_cpu(w, x, logits);
    route(w.config.router, logits, w.correction_bias.view(), topk_idx, topk_weights, stream);
  } else {
#ifdef EPX_WITH_CUDA
    const TensorView xf = scratch(x_f32, DType::fp32, {T, w.config.hidden});
    moe_cuda::router_logits(*blas, router_weight_dev, x, xf, logits, stream, router_bias_dev.view());
    route(w.config.router, logits, correction_bias_dev.view(), topk_idx, topk_weights, stream);
#else
    no_cuda("x on " + device.str());
#endif
  }
}

void ModularMoE::forward(const TensorView& x, const TensorView& out, Stream stream) {
  Impl& m = *impl_;
  const MoEWeights& w = *m.weights;
  // A local argument error still joins the T all_gather inside forward_routed (as -1) so peers
  // do not hang; here x is only read if its shape is right.
  bool ok = true;
  try {
    check_rows(kFwdOp, "x", x, -1, w.config.hidden, m.device);
  } catch (const InvalidArgument&) {
    ok = false;
  }
  if (!ok) {
    forward_routed(x, TensorView(), TensorView(), out, stream);  // throws on every rank
    return;
  }
  TensorView topk_idx, topk_weights;
  m.route_rows(x, stream, topk_idx, topk_weights);
  forward_routed(x, topk_idx, topk_weights, out, stream);
}

void ModularMoE::forward_routed(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                                const TensorView& out, Stream stream) {
  Impl& m = *impl_;
  const int64_t H = m.weights->config.hidden;
  // Check locally, then agree: the gathered T is -1 for a rank whose arguments are bad.
  std::string local_error;
  int64_t T = 0;
  try {
    check_rows(kFwdOp, "x", x, -1, H, m.device);
    T = x.shape[0];
    // The column count first: routes that already carry the FHMoE shared column (K+1) are named as such.
    if (topk_idx.ndim == 2)
      require_arg(kFwdOp, "topk_idx.shape[1]", topk_idx.shape[1], topk_idx.shape[1] == m.top_k,
                  "must equal top_k = " + std::to_string(m.top_k) +
                      (m.has_shared ? ": the routed columns only (the shared route, id num_experts = " + std::to_string(m.num_experts) +
                                          ", is appended here as column " + std::to_string(m.top_k) + ")"
                                    : std::string()));
    check_routing_on(m.device, kFwdOp, topk_idx, topk_weights, T, m.num_experts);
    check_rows(kFwdOp, "out", out, T, H, m.device);
    // A bad id of an earlier call that the backend found on the device (ll: no host sync) stops every
    // rank here, through the all-gather below, instead of this rank's next prepare alone.
    if (auto e = m.prepare_finalize->take_device_error()) throw InvalidArgument(*e);
  } catch (const InvalidArgument& e) {
    local_error = e.what();
  }
  // The DP metadata: one all_gather of T per call, reused by everything below.
  std::vector<int64_t> tokens = m.group->all_gather_i64(local_error.empty() ? T : -1);
  if (!local_error.empty()) throw InvalidArgument(local_error);
  for (size_t r = 0; r < tokens.size(); ++r) {
    if (tokens[r] < 0) {
      throw InvalidArgument(std::string(kFwdOp) + ": rank " + std::to_string(r) +
                            " rejected its arguments: every rank stops (see that rank's error)");
    }
  }
  DPMetadata dp = DPMetadata::from_tokens(std::move(tokens), m.chunk_size);
  // Capacity is checked on the gathered sizes, so every rank raises it before anyone dispatches.
  if (m.chunk_size == 0 && m.capacity > 0 && dp.max_tokens > m.capacity) {
    throw InvalidArgument(arg_message(kFwdOp, "max_r num_tokens", dp.max_tokens,
                                      "must be <= num_max_dispatch_tokens_per_rank = " + std::to_string(m.capacity) +
                                          " when unchunked (set chunk_size or raise the capacity)"));
  }
  m.dp = std::move(dp);
  m.reset_phases();
  m.run_chunks(x, topk_idx, topk_weights, out, TensorView(), stream);
}

void ModularMoE::Impl::run_chunks(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                                  const TensorView& out, const TensorView& num_tokens, Stream stream) {
  const int rank = group->rank();
  const int64_t T = dp.tokens_per_rank[static_cast<size_t>(rank)];
  ++counters.calls;
  for (int64_t c = 0; c < dp.num_chunks; ++c) {
    const int64_t chunk_max = dp.chunk_max(c);  // M: the largest chunk over ranks
    bool fused = false;
    if (has_shared) {
      fused = shared_mode == SharedExpertMode::fused ||
              (shared_mode == SharedExpertMode::auto_gate && chunk_max <= fhmoe_max_tokens);
      ++(fused ? counters.shared_fused : counters.shared_separate);
      if (fused && sharded) ++counters.shared_sharded;
    }
    const int64_t begin = std::min(T, c * dp.chunk_size), end = begin + dp.chunk_tokens(c, rank);
    ++counters.chunks;
    if (begin == end) ++counters.idle_chunks;
    run_chunk(x, topk_idx, topk_weights, out, begin, end, fused, c, num_tokens, stream);
  }
}

TensorView ModularMoE::Impl::scratch(Tensor& t, DType dtype, const std::vector<int64_t>& dims) {
  TensorView v(nullptr, dtype, dims, device);
  // 1/8 headroom: eager steps vary their received rows by a few %, and each new maximum would
  // otherwise cost a cudaFree (a device sync) and a cudaMalloc inside the timed layer.
  if (!t.defined() || t.dtype() != dtype || t.numel() < v.numel())
    t = Tensor::empty({std::max<int64_t>(v.numel() + v.numel() / 8, 1)}, dtype, device);
  v.data = t.data();
  return v;
}

TensorView ModularMoE::Impl::expert_out_like(const TensorView& recv_x) {
  // Flat rows are each rank's weighted partials: fp32 (one rounding, in the combine) or bf16 (partial_bf16).
  const DType dtype = recv_x.ndim == 2 ? flat_partial : DType::bf16;
  return scratch(expert_out, dtype, std::vector<int64_t>(recv_x.shape.begin(), recv_x.shape.begin() + recv_x.ndim));
}

void ModularMoE::Impl::route_columns(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                                     int64_t begin, int64_t end, bool fused, Stream stream, TensorView& idx, TensorView& wts,
                                     TensorView& g, std::vector<float>& gate_host) {
  const MoEWeights& w = *weights;
  const int64_t n = end - begin, H = w.config.hidden, K = top_k;
  const int64_t cols = K + (has_shared ? 1 : 0);
  wts = scratch(route_wts, DType::fp32, {n, cols});
  if (device.is_cuda()) {
#ifdef EPX_WITH_CUDA
    // The caller's dtype: the values are only checked by the dispatch on the device, so an int64 id
    // must reach it unnarrowed (2^32 + 3 would otherwise pass as expert 3). The CPU checked them all
    // (check_routing_on), so its int32 copy below is exact.
    idx = scratch(route_idx, topk_idx.dtype == DType::int64 ? DType::int64 : DType::int32, {n, cols});
    g = scratch(gate, DType::fp32, {n});
    moe_cuda::RouteColumnsParams p;
    p.topk_idx = topk_idx.slice_rows(begin, end);
    p.topk_weights = topk_weights.slice_rows(begin, end);
    p.x = x.slice_rows(begin, end);
    p.shared_gate_weight = shared_gate_dev.defined() ? shared_gate_dev.ptr<const float>() : nullptr;
    p.has_shared = has_shared;
    p.fused = fused;
    p.num_experts = num_experts;
    moe_cuda::build_route_columns(p, idx, wts, g, stream);
    return;
#else
    no_cuda("x on " + device.str());
#endif
  }
  idx = scratch(route_idx, DType::int32, {n, cols});
  const uint16_t* xb = n > 0 ? x.ptr<const uint16_t>() + begin * H : nullptr;
  gate_host.assign(static_cast<size_t>(has_shared ? n : 0), 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      idx.ptr<int32_t>()[t * cols + k] = static_cast<int32_t>(moe_detail::load_index(topk_idx, (begin + t) * K + k));
      wts.ptr<float>()[t * cols + k] = topk_weights.ptr<const float>()[(begin + t) * K + k];
    }
    if (has_shared) {
      gate_host[t] = moe_detail::shared_gate_value(w, xb + t * H);
      idx.ptr<int32_t>()[t * cols + K] = fused ? num_experts : -1;
      wts.ptr<float>()[t * cols + K] = fused ? gate_host[t] : 0.0f;
    }
  }
}

void ModularMoE::Impl::add_separate_shared(const TensorView& x_chunk, const TensorView& out_chunk, const TensorView& g,
                                           const std::vector<float>& gate_host, const TensorView& num_tokens, Stream stream) {
  const MoEWeights& w = *weights;
  const int64_t n = x_chunk.shape[0], H = w.config.hidden;
  if (device.is_cuda()) {
#ifdef EPX_WITH_CUDA
    // The shared expert as a one-expert layer; g is applied in the add (in fp32, as the CPU does),
    // so there is one rounding of out + g * y.
    if (!shared_experts) shared_experts = make_experts_cuda(shared_only, device.index, experts_config);
    if (wire_fp8) {
      // x~: FP8 1x128 as the wire quantizes it, as a one-expert ExpertMajor layout [1, n, H] with
      // recv_count = n (contiguous rows, M = n): fp8_block weights take the FP8 tensor-core GEMMs
      // (the 64-row decode kernels, or the prefill kernels when n fills a wave of 128-row tiles).
      TensorView xq = scratch(shared_xq, DType::fp8_e4m3, {1, n, H});
      TensorView xs = scratch(shared_xs, DType::fp32, {1, n, H / kFp8GroupSize});
      quantize_fp8_per_token_group(x_chunk, TensorView(xq.data, DType::fp8_e4m3, {n, H}, device),
                                   TensorView(xs.data, DType::fp32, {n, H / kFp8GroupSize}, device), kFp8GroupSize, wire_ue8m0,
                                   stream);
      ExpertsInput in;
      in.layout = ActivationLayout::ExpertMajor;
      in.x = xq;
      in.x_scales = xs;
      // Under the whole-layer graph the chunk is all T_max rows of the static buffers and the
      // valid count lives on the device: it is the recv_count, so only the valid rows are computed
      // (and added), as on the fused path, where only they are dispatched.
      if (num_tokens.defined()) {
        in.recv_count = num_tokens;
      } else {
        in.recv_count = scratch(shared_count, DType::int32, {1});
        moe_cuda::fill_i32(in.recv_count, static_cast<int32_t>(n), stream);
      }
      const TensorView y = scratch(shared_out, DType::bf16, {1, n, H});
      shared_experts->apply(in, y, stream);
      if (out_chunk.dtype == DType::fp32) moe_cuda::zero_async(out_chunk, stream);  // the addend: 0 + g * y
      moe_cuda::add_shared(out_chunk, TensorView(y.data, DType::bf16, {n, H}, device), g, stream, num_tokens);
      return;
    }
    ExpertsInput in;
    in.layout = ActivationLayout::Flat;
    in.x = x_chunk;
    in.topk_idx = scratch(shared_idx, DType::int32, {n, 1});
    in.topk_weights = scratch(shared_wts, DType::fp32, {n, 1});
    moe_cuda::fill_single_route(in.topk_idx, in.topk_weights, stream);
    const TensorView y = scratch(shared_out, DType::bf16, {n, H});
    shared_experts->apply(in, y, stream);
    if (out_chunk.dtype == DType::fp32) moe_cuda::zero_async(out_chunk, stream);  // the addend: 0 + g * y
    moe_cuda::add_shared(out_chunk, y, g, stream);
    return;
#else
    no_cuda("x on " + device.str());
#endif
  }
  (void)num_tokens;  // a CUDA graph only
  x_float.resize(static_cast<size_t>(n * H));
  shared_y.resize(static_cast<size_t>(n * H));
  moe_detail::bf16_to_float(x_chunk.ptr<const uint16_t>(), n * H, x_float.data());
  if (wire_fp8)  // x~: the wire's FP8 round trip, as the fused path sees it
    for (int64_t t = 0; t < n; ++t) moe_detail::fp8_round_trip_row(x_float.data() + t * H, H, wire_ue8m0);
  expert_mlp_cpu(*w.shared, x_float.data(), n, shared_y.data());
  if (out_chunk.dtype == DType::fp32) {  // the combine's addend: g * y, joined before its one rounding
    float* a = out_chunk.ptr<float>();
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < H; ++h) a[t * H + h] = gate_host[t] * shared_y[t * H + h];
    return;
  }
  uint16_t* o = out_chunk.ptr<uint16_t>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < H; ++h)
      o[t * H + h] = float_to_bf16_bits(bf16_bits_to_float(o[t * H + h]) + gate_host[t] * shared_y[t * H + h]);
}

ExpertsInput ModularMoE::Impl::local_shared_input(const PrepareResult& prepared, const TensorView& x_chunk,
                                                  const TensorView& num_tokens, Stream stream) {
  ExpertsInput in = prepared.experts_input();
#ifdef EPX_WITH_CUDA
  const int64_t n = x_chunk.shape[0], H = x_chunk.shape[1];
  EPX_ASSERT(prepared.layout == ActivationLayout::ExpertMajor && prepared.x.ndim == 3 && prepared.x.shape[2] == H &&
                 n <= prepared.x.shape[1],
             "local shared slot: prepared x ", prepared.x.describe(), " for ", n, " rows");
  const int64_t L = prepared.x.shape[0], cap = prepared.x.shape[1];
  if (n > 0) {
    if (prepared.x.dtype == DType::fp8_e4m3) {
      const int64_t G = H / kFp8GroupSize;
      quantize_fp8_per_token_group(x_chunk, TensorView(prepared.x.ptr<uint8_t>() + (L - 1) * cap * H, DType::fp8_e4m3, {n, H}, device),
                                   TensorView(prepared.x_scales.ptr<float>() + (L - 1) * cap * G, DType::fp32, {n, G}, device),
                                   kFp8GroupSize, wire_ue8m0, stream);
    } else {
      moe_cuda::copy_async(TensorView(prepared.x.ptr<uint16_t>() + (L - 1) * cap * H, DType::bf16, {n, H}, device), x_chunk, stream);
    }
  }
  in.recv_count = scratch(local_counts, DType::int32, {L});
  moe_cuda::local_shared_counts(prepared.recv_count, in.recv_count, static_cast<int32_t>(n), num_tokens, stream);
#else
  (void)x_chunk, (void)num_tokens, (void)stream;
#endif
  return in;
}

void ModularMoE::Impl::run_chunk(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                                 const TensorView& out, int64_t begin, int64_t end, bool fused, int64_t c,
                                 const TensorView& num_tokens, Stream stream) {
  const int64_t n = end - begin;
  // Routing of the chunk with the shared column appended: [n, K(+1)] int32/int64 / fp32. Sharded, the
  // column stays -1 (no traffic): the shard runs on the gathered rows after the routed experts.
  TensorView idx, wts, g;
  std::vector<float> gate_host;
  // The local shared slot: column K stays -1 too (no traffic); the rows go into slot L-1 below.
  const bool local = has_shared && fused && local_shared_tokens >= 0 && dp.chunk_max(c) > local_shared_tokens;
  route_columns(x, topk_idx, topk_weights, begin, end, fused && !sharded && !local, stream, idx, wts, g, gate_host);

  const TensorView x_chunk = x.slice_rows(begin, end), out_chunk = out.slice_rows(begin, end);
  DispatchArgs args;
  args.x = x_chunk;
  args.topk_idx = idx;
  args.topk_weights = wts;
  args.stream = stream;
  args.num_tokens = num_tokens;
  mark_phase(stream);
  const PrepareResult prepared = prepare_finalize->prepare(args);
  mark_phase(stream);
  // ht's expert-contiguous rows (contiguous): [M, H] unweighted expert rows, weighted by finalize below.
  const TensorView expert_view =
      contiguous ? scratch(expert_out, DType::bf16, {prepared.contiguous.num_rows, prepared.contiguous.x.shape[1]})
                 : expert_out_like(prepared.x);
  if (experts) {
    const ExpertsInput in = contiguous ? prepared.contiguous.experts_input()
                            : local    ? local_shared_input(prepared, x_chunk, num_tokens, stream)
                                       : prepared.experts_input();
    experts->apply(in, expert_view, stream);
  } else {
    // <= 0: ll on CUDA reports -1 (only the device knows its counts).
    EPX_ASSERT(prepared.num_recv_tokens <= 0, "a rank without local experts received ", prepared.num_recv_tokens, " rows");
  }
  if (has_shared && fused && sharded) add_sharded_shared(prepared, expert_view, g, gate_host, c, stream);
  mark_phase(stream);
  FinalizeArgs fin;
  fin.expert_out = expert_view;
  fin.out = out_chunk;
  fin.stream = stream;
  if (contiguous) fin.topk_weights = prepared.topk_weights;
  // The separate shared expert joins the combine's fp32 sum (one rounding) where the backend takes an
  // addend; else it is added to the combined bf16 rows after finalize (a second rounding).
  const bool separate = has_shared && !fused && n > 0;
  if (separate && combine_addend) {
    fin.addend = scratch(shared_addend, DType::fp32, {n, weights->config.hidden});
    add_separate_shared(x_chunk, fin.addend, g, gate_host, num_tokens, stream);
  }
  prepare_finalize->finalize(fin);
  mark_phase(stream);

  if (separate && !combine_addend) add_separate_shared(x_chunk, out_chunk, g, gate_host, num_tokens, stream);
  if (local && n > 0) {  // out += g * y of slot L-1 (the combine saw no route to it)
#ifdef EPX_WITH_CUDA
    const int64_t L = expert_view.shape[0], cap = expert_view.shape[1], H = expert_view.shape[2];
    const TensorView y(expert_view.ptr<uint16_t>() + (L - 1) * cap * H, DType::bf16, {n, H}, device);
    moe_cuda::add_shared(out_chunk, y, g, stream, num_tokens);
#endif
  }
  mark_phase(stream);
}

void ModularMoE::Impl::add_sharded_shared(const PrepareResult& prepared, const TensorView& expert_view, const TensorView& g,
                                          const std::vector<float>& gate_host, int64_t c, Stream stream) {
  const MoEWeights& w = *weights;
  const int64_t H = w.config.hidden, N = prepared.x.shape[0];
  const std::vector<int64_t> counts = dp.chunk_counts(c);
  // Gathered rows are every rank's chunk rows in rank order (Capabilities::gathers_all_tokens).
  // Padded form: every rank's block has padded_block rows (its real rows first); the gate travels the same way.
  int64_t total = 0;
  std::vector<int64_t> gate_bytes;
  for (int64_t k : counts) {
    total += padded_block > 0 ? padded_block : k;
    gate_bytes.push_back((padded_block > 0 ? padded_block : k) * static_cast<int64_t>(sizeof(float)));
  }
  EPX_ASSERT(prepared.layout == ActivationLayout::Flat && N == total, "sharded shared expert: gathered rows ", N,
             " but the DP metadata counts ", total);
  const bool gated = w.shared_gate_weight.defined();
  const int64_t n_own = counts[static_cast<size_t>(group->rank())];
  ExpertsInput in;
  in.layout = ActivationLayout::Flat;
  in.x = prepared.x;
  in.x_scales = prepared.x_scales;
  in.topk_idx = scratch(shared_idx_any, DType::int32, {N, 1});
  in.topk_weights = scratch(shared_wts_any, DType::fp32, {N, 1});
  const TensorView y = scratch(shard_out, DType::bf16, {N, H});
  if (device.is_cuda()) {
#ifdef EPX_WITH_CUDA
    moe_cuda::fill_single_route(in.topk_idx, in.topk_weights, stream, shard_slot);
    TensorView g_all = in.topk_weights;  // ones [N] when the model has no shared gate
    if (gated) {
      g_all = scratch(gate_all, DType::fp32, {N});
      const void* g_send = g.data;
      if (padded_block > 0) {  // g [n] into a [C] block (rows past n are padding rows' and not read)
        const TensorView pad = scratch(gate_pad, DType::fp32, {padded_block});
        moe_cuda::zero_async(pad, stream);
        if (n_own > 0) moe_cuda::copy_async(TensorView(pad.data, DType::fp32, {n_own}, device), TensorView(g.data, DType::fp32, {n_own}, device), stream);
        g_send = pad.data;
      }
      group->all_gatherv(g_send, g_all.data, gate_bytes, stream);
    }
    experts->apply(in, y, stream);
    moe_cuda::add_shared(expert_view, y, g_all, stream);
    return;
#else
    no_cuda("x on " + device.str());
#endif
  }
  (void)g;
  for (int64_t t = 0; t < N; ++t) {
    in.topk_idx.ptr<int32_t>()[t] = shard_slot;
    in.topk_weights.ptr<float>()[t] = 1.0f;
  }
  gate_all_host.assign(static_cast<size_t>(N), 1.0f);
  if (gated) {
    std::vector<float> g_send(gate_host.begin(), gate_host.begin() + n_own);
    if (padded_block > 0) g_send.resize(static_cast<size_t>(padded_block), 0.0f);
    group->all_gatherv(g_send.data(), gate_all_host.data(), gate_bytes);
  }
  experts->apply(in, y, stream);
  const uint16_t* yb = y.ptr<const uint16_t>();
  if (expert_view.dtype == DType::fp32) {  // fp32 partials: the shard joins them unrounded
    float* p = expert_view.ptr<float>();
    for (int64_t t = 0; t < N; ++t)
      for (int64_t h = 0; h < H; ++h) p[t * H + h] += gate_all_host[t] * bf16_bits_to_float(yb[t * H + h]);
    return;
  }
  uint16_t* o = expert_view.ptr<uint16_t>();
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < H; ++h)
      o[t * H + h] = float_to_bf16_bits(bf16_bits_to_float(o[t * H + h]) + gate_all_host[t] * bf16_bits_to_float(yb[t * H + h]));
}

// ---- whole-layer CUDA graph ----

std::optional<std::string> ModularMoE::why_no_graph(int64_t max_tokens) const {
  const Impl& m = *impl_;
  const std::string op = "ModularMoE.capture_graph";
  if (!m.device.is_cuda()) return arg_message(op, "device", m.device.str(), "CUDA graphs need a group on a GPU");
#ifndef EPX_WITH_CUDA
  return arg_message(op, "device", m.device.str(), "this build has no CUDA");
#else
  const Capabilities& caps = m.prepare_finalize->capabilities();
  if (!caps.graph_safe) {
    return arg_message(op, "backend", caps.name,
                       "is not graph-safe (Capabilities::graph_safe = false: its prepare/finalize wait on the host for every "
                       "rank's counts); use a graph-safe backend such as ll");
  }
  if (max_tokens < 0) return arg_message(op, "max_tokens", max_tokens, "must be >= 0");
  if (m.chunk_size > 0 && max_tokens > m.chunk_size) {
    return arg_message(op, "chunk_size", m.chunk_size,
                       "splits a batch of max_tokens = " + std::to_string(max_tokens) + " into several dispatches; a graph holds one (chunk_size 0 or >= max_tokens)");
  }
  if (m.capacity > 0 && max_tokens > m.capacity) {
    return arg_message(op, "max_tokens", max_tokens, "must be <= num_max_dispatch_tokens_per_rank = " + std::to_string(m.capacity));
  }
  return std::nullopt;
#endif
}

bool ModularMoE::has_graph() const {
#ifdef EPX_WITH_CUDA
  return impl_->graph && impl_->graph->captured();
#else
  return false;
#endif
}

void ModularMoE::capture_graph(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                               const TensorView& out, const TensorView& num_tokens, Stream stream) {
  Impl& m = *impl_;
  const std::string op = "ModularMoE.capture_graph";
  const int64_t H = m.weights->config.hidden;
  check_rows(op, "x", x, -1, H, m.device);
  const int64_t T_max = x.shape[0];
  if (auto why = why_no_graph(T_max)) throw Unsupported(*why);
#ifndef EPX_WITH_CUDA
  (void)topk_idx, (void)topk_weights, (void)out, (void)num_tokens, (void)stream;
#else
  check_rows(op, "out", out, T_max, H, m.device);
  const bool routed = topk_idx.defined();
  if (routed) check_routing_on(m.device, op, topk_idx, topk_weights, T_max, m.num_experts);
  if (routed) require_arg(op, "topk_idx.shape[1]", topk_idx.shape[1], topk_idx.shape[1] == m.top_k, "must equal top_k = " + std::to_string(m.top_k));
  if (num_tokens.defined()) {
    check_device(op, "num_tokens", num_tokens, m.device);
    check_dtype(op, "num_tokens", num_tokens, {DType::int32});
    check_shape(op, "num_tokens", num_tokens, {1});
  }
  require_arg(op, "stream", "the legacy default stream", stream.handle != nullptr, "must be a created stream (it is captured)");
  require_arg(op, "graph", "already captured", !has_graph(), "capture once per layer");
  m.group->check_agreement(op, {{"max_tokens", T_max}, {"routed", routed}});
  // Static DP metadata: T_max on every rank, one chunk; the valid count is on the device.
  m.dp = DPMetadata::from_tokens(std::vector<int64_t>(static_cast<size_t>(m.group->size()), T_max), 0);
  auto run = [&] {
    TensorView idx = topk_idx, wts = topk_weights;
    if (!routed) m.route_rows(x, stream, idx, wts);
    m.run_chunks(x, idx, wts, out, num_tokens, stream);
  };
  const PathCounters before = m.counters;
  m.capturing = true;
  m.reset_phases();
  struct CaptureFlag {
    bool& f;
    ~CaptureFlag() { f = false; }
  } capture_flag{m.capturing};
  // Warm-up: every workspace reaches its size for this shape (growing inside a capture is illegal).
  run();
  moe_cuda::synchronize(stream, m.device.index);
  m.group->barrier();
  auto graph = std::make_unique<moe_cuda::Graph>();
  graph->begin(stream);
  try {
    run();
    graph->end(stream);
  } catch (...) {
    graph->abort(stream);
    m.counters = before;
    throw;
  }
  m.counters = before;
  m.graph = std::move(graph);
  m.graph_max_tokens = T_max;
  m.graph_fused = m.has_shared && (m.shared_mode == SharedExpertMode::fused ||
                                   (m.shared_mode == SharedExpertMode::auto_gate && T_max <= m.fhmoe_max_tokens));
#endif
}

void ModularMoE::replay_graph(Stream stream) {
  Impl& m = *impl_;
  require_arg("ModularMoE.replay_graph", "graph", "none", has_graph(), "capture_graph() must run first");
#ifdef EPX_WITH_CUDA
  m.reset_phases();
  m.graph->launch(stream);
  ++m.counters.calls;
  ++m.counters.chunks;
  ++m.counters.graph_replays;
  if (m.has_shared) {
    ++(m.graph_fused ? m.counters.shared_fused : m.counters.shared_separate);
    if (m.graph_fused && m.sharded) ++m.counters.shared_sharded;
  }
#else
  (void)stream;
  (void)m;  // CPU-only build: nothing to replay (has_graph() is false there)
#endif
}

}  // namespace epx
