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
// Here: DPMetadata, construction, forward / forward_routed and the chunk loop; the shared expert's separate,
// local-slot and DP-sharded paths: modular_moe_shared.cpp; the whole-layer CUDA graph: modular_moe_graph.cpp;
// the state they share: modular_moe_impl.h.
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
#include "moe/modular_moe_impl.h"
#ifdef EPX_WITH_CUDA
#include "moe/moe_cuda.h"
#endif

namespace epx {

using moe_detail::check_routing_on;
using moe_detail::check_rows;
using moe_detail::kFwdOp;
using moe_detail::no_cuda;

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

namespace {

constexpr std::string_view kCtorOp = "ModularMoE";

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

}  // namespace epx
