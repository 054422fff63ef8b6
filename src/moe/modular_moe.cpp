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
// wire). Separate: column K = -1 (no traffic); the shared expert runs here on x and g(t) * its
// output is added to the finalized rows (a second bf16 rounding; the fused path rounds once).
// Gate: fuse when M = max over ranks of this chunk's tokens <= fhmoe_max_tokens. M comes from the
// gathered T, so every rank takes the same path and the collectives line up.
#include <algorithm>
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/moe.h"
#include "moe/moe_internal.h"
#ifdef EPX_WITH_CUDA
#include "moe/moe_cuda.h"
#endif

namespace epx {

struct ModularMoE::Impl {
  std::shared_ptr<const MoEWeights> weights;
  std::shared_ptr<Group> group;
  std::unique_ptr<PrepareFinalize> prepare_finalize;
  std::unique_ptr<Experts> experts;
  SharedExpertMode shared_mode = SharedExpertMode::auto_gate;
  int64_t chunk_size = 0;        // 0 = unchunked
  int64_t capacity = 0;          // num_max_dispatch_tokens_per_rank
  int64_t fhmoe_max_tokens = 0;
  int num_experts = 0;           // E
  int top_k = 0;                 // K (routed columns)
  bool has_shared = false;
  PathCounters counters;

  Device device;                 // the group's: where x, routing and out live
  std::vector<std::shared_ptr<const ExpertWeights>> shared_only;  // CUDA separate path: {weights->shared}

  // Scratch reused across calls (on `device`).
  Tensor expert_out;             // bf16 storage for Experts::apply, grown on demand
  std::vector<float> x_float, shared_y;
  Tensor route_idx, route_wts, gate;  // [n, K+1] routing of the chunk, g [n] (CUDA)
  Tensor logits, router_idx, router_wts;  // forward(): router logits [T, E] and its top-k [T, K]

#ifdef EPX_WITH_CUDA
  // CUDA only: the router's tensors uploaded once, the cuBLAS handle, the separate shared expert.
  Tensor router_weight_dev, correction_bias_dev, shared_gate_dev;
  std::unique_ptr<moe_cuda::Blas> blas;
  std::unique_ptr<Experts> shared_experts;  // one expert (the shared one), Flat, created on first use
  Tensor x_f32, shared_idx, shared_wts, shared_out;
#endif

  void run_chunk(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights, const TensorView& out,
                 int64_t begin, int64_t end, bool fused, Stream stream);
  TensorView expert_out_like(const TensorView& recv_x);
  /// Grows `t` (1-D storage of `dtype` on `device`) to at least `numel` elements; returns a view of `dims`.
  TensorView scratch(Tensor& t, DType dtype, const std::vector<int64_t>& dims);
  /// Routing of rows [begin, end) with the shared column: idx/wts [n, K(+1)] and gate [n] (CPU or CUDA).
  void route_columns(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights, int64_t begin,
                     int64_t end, bool fused, Stream stream, TensorView& idx, TensorView& wts, TensorView& g,
                     std::vector<float>& gate_host);
  /// out_chunk += g * shared(x_chunk): the separate shared expert (CPU or CUDA).
  void add_separate_shared(const TensorView& x_chunk, const TensorView& out_chunk, const TensorView& g,
                           const std::vector<float>& gate_host, Stream stream);
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
  require_arg(kCtorOp, "weights", "null", weights != nullptr, "must be set");
  require_arg(kCtorOp, "group", "null", group != nullptr, "must be set");
  const MoEConfig& mc = weights->config;
  validate_router_config(mc.router);
  m.weights = weights;
  m.group = group;
  m.num_experts = mc.router.num_experts;
  m.top_k = mc.router.top_k;
  m.has_shared = mc.num_shared_experts > 0;
  m.shared_mode = options.shared_mode;
  if (m.has_shared) require_arg(kCtorOp, "weights.shared", "null", weights->shared != nullptr, "must be set: the model has a shared expert");

  require_arg(kCtorOp, "options.chunk_size", options.chunk_size, options.chunk_size >= 0, "must be >= 0 (0 = Config::moe_chunk_size)");
  m.chunk_size = options.chunk_size > 0 ? options.chunk_size : std::max(0, config.moe_chunk_size);
  m.fhmoe_max_tokens = options.fhmoe_max_tokens >= 0 ? options.fhmoe_max_tokens : config.fhmoe_max_tokens;
  m.capacity = dispatch_cfg.num_max_dispatch_tokens_per_rank;
  // Capacity 0 = no limit (dynamic backends; static ones such as ll reject 0 when created).
  require_arg(kCtorOp, "dispatch_cfg.num_max_dispatch_tokens_per_rank", m.capacity, m.capacity >= 0, "must be >= 0 (0 = no limit)");
  if (m.chunk_size > 0 && m.capacity > 0) {
    require_arg(kCtorOp, "dispatch_cfg.num_max_dispatch_tokens_per_rank", m.capacity, m.capacity >= m.chunk_size,
                "must be >= chunk_size = " + std::to_string(m.chunk_size) + " (every chunk is one dispatch)");
  }

  // Local experts: this rank's routed range, then the shared replica (local id L-1, route id E).
  const int R = group->size(), rank = group->rank();
  const ExpertRange range = expert_range(m.num_experts, R, rank);
  std::vector<std::shared_ptr<const ExpertWeights>> local;
  for (int e = range.begin; e < range.end; ++e) {
    const bool built = static_cast<size_t>(e) < weights->experts.size() && weights->experts[e];
    require_arg(kCtorOp, "weights.experts[" + std::to_string(e) + "]", "null", built,
                "must be built: rank " + std::to_string(rank) + " holds experts [" + std::to_string(range.begin) + ", " +
                    std::to_string(range.end) + ")");
    local.push_back(weights->experts[e]);
  }
  if (m.has_shared) local.push_back(weights->shared);
  // A rank with no routed expert (E < R) and no shared replica still takes part in every collective;
  // it gets an Experts object only when it has something to run.
  m.device = group->device();
  if (m.device.is_cuda()) {
#ifdef EPX_WITH_CUDA
    m.router_weight_dev = weights->router_weight.to(m.device);
    if (weights->correction_bias.defined()) m.correction_bias_dev = weights->correction_bias.to(m.device);
    if (weights->shared_gate_weight.defined()) m.shared_gate_dev = weights->shared_gate_weight.to(m.device);
    m.blas = std::make_unique<moe_cuda::Blas>(m.device.index);
    if (m.has_shared) m.shared_only = {weights->shared};
#else
    no_cuda("group device = " + m.device.str());
#endif
  }

  dispatch_cfg.hidden = mc.hidden;
  dispatch_cfg.num_experts = m.num_experts;
  dispatch_cfg.top_k = m.top_k + (m.has_shared ? 1 : 0);
  dispatch_cfg.shared_route = m.has_shared;
  m.prepare_finalize = make_prepare_finalize(backend, group, dispatch_cfg);
  // After the backend (collective, and where an unsupported one stops): the CUDA experts upload
  // this rank's weights, which is not worth doing for a backend that cannot run.
  if (!local.empty()) m.experts = m.device.is_cpu() ? make_experts_cpu(std::move(local)) : make_experts_cuda(std::move(local), m.device.index);
  // Chunking and the gate decide how many collectives run; ranks must agree on them.
  group->check_agreement(std::string(kCtorOp), {{"chunk_size", m.chunk_size},
                                                {"fhmoe_max_tokens", m.fhmoe_max_tokens},
                                                {"shared_mode", static_cast<int64_t>(m.shared_mode)}});
  const ActivationLayout layout = m.prepare_finalize->capabilities().layout;
  if (m.experts && !m.experts->supports(layout)) {
    throw Unsupported(arg_message(kCtorOp, "backend", backend,
                                  "its layout " + std::string(layout_name(layout)) + " is not supported by the experts"));
  }
  m.counters.backend = backend;
}

ModularMoE::~ModularMoE() = default;

const PathCounters& ModularMoE::counters() const { return impl_->counters; }

void ModularMoE::forward(const TensorView& x, const TensorView& out, Stream stream) {
  Impl& m = *impl_;
  const MoEWeights& w = *m.weights;
  // A local argument error still joins the T all_gather inside forward_routed (as -1) so peers
  // do not hang; here x is only read if its shape is right.
  bool ok = true;
  int64_t T = 0;
  try {
    check_rows(kFwdOp, "x", x, -1, w.config.hidden, m.device);
    T = x.shape[0];
  } catch (const InvalidArgument&) {
    ok = false;
  }
  if (!ok) {
    forward_routed(x, TensorView(), TensorView(), out, stream);  // throws on every rank
    return;
  }
  // Scratch reused across calls: no allocation (on CUDA: no cudaMalloc) per forward.
  const TensorView logits = m.scratch(m.logits, DType::fp32, {T, m.num_experts});
  const TensorView topk_idx = m.scratch(m.router_idx, DType::int32, {T, m.top_k});
  const TensorView topk_weights = m.scratch(m.router_wts, DType::fp32, {T, m.top_k});
  if (m.device.is_cpu()) {
    router_logits_cpu(w, x, logits);
    route(w.config.router, logits, w.correction_bias.view(), topk_idx, topk_weights, stream);
  } else {
#ifdef EPX_WITH_CUDA
    const TensorView x_f32 = m.scratch(m.x_f32, DType::fp32, {T, w.config.hidden});
    moe_cuda::router_logits(*m.blas, m.router_weight_dev, x, x_f32, logits, stream);
    route(w.config.router, logits, m.correction_bias_dev.view(), topk_idx, topk_weights, stream);
#else
    no_cuda("x on " + m.device.str());
#endif
  }
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
    check_routing_on(m.device, kFwdOp, topk_idx, topk_weights, T, m.num_experts);
    require_arg(kFwdOp, "topk_idx.shape[1]", topk_idx.shape[1], topk_idx.shape[1] == m.top_k,
                "must equal top_k = " + std::to_string(m.top_k) + " (the shared column is added here)");
    check_rows(kFwdOp, "out", out, T, H, m.device);
  } catch (const InvalidArgument& e) {
    local_error = e.what();
  }
  const std::vector<int64_t> tokens = m.group->all_gather_i64(local_error.empty() ? T : -1);
  if (!local_error.empty()) throw InvalidArgument(local_error);
  int64_t max_tokens = 0;
  for (size_t r = 0; r < tokens.size(); ++r) {
    if (tokens[r] < 0) {
      throw InvalidArgument(std::string(kFwdOp) + ": rank " + std::to_string(r) +
                            " rejected its arguments: every rank stops (see that rank's error)");
    }
    max_tokens = std::max(max_tokens, tokens[r]);
  }
  // Capacity is checked on the gathered sizes, so every rank raises it before anyone dispatches.
  if (m.chunk_size == 0 && m.capacity > 0 && max_tokens > m.capacity) {
    throw InvalidArgument(arg_message(kFwdOp, "max_r num_tokens", max_tokens,
                                      "must be <= num_max_dispatch_tokens_per_rank = " + std::to_string(m.capacity) +
                                          " when unchunked (set chunk_size or raise the capacity)"));
  }
  const int64_t chunk = m.chunk_size > 0 ? m.chunk_size : std::max<int64_t>(max_tokens, 1);
  const int64_t num_chunks = std::max<int64_t>(1, (max_tokens + chunk - 1) / chunk);
  ++m.counters.calls;
  for (int64_t c = 0; c < num_chunks; ++c) {
    int64_t chunk_max = 0;  // M: the largest chunk over ranks
    for (int64_t t : tokens) chunk_max = std::max(chunk_max, std::clamp<int64_t>(t - c * chunk, 0, chunk));
    bool fused = false;
    if (m.has_shared) {
      fused = m.shared_mode == SharedExpertMode::fused ||
              (m.shared_mode == SharedExpertMode::auto_gate && chunk_max <= m.fhmoe_max_tokens);
      ++(fused ? m.counters.shared_fused : m.counters.shared_separate);
    }
    const int64_t begin = std::min(T, c * chunk), end = std::min(T, begin + chunk);
    ++m.counters.chunks;
    if (begin == end) ++m.counters.idle_chunks;
    m.run_chunk(x, topk_idx, topk_weights, out, begin, end, fused, stream);
  }
}

TensorView ModularMoE::Impl::scratch(Tensor& t, DType dtype, const std::vector<int64_t>& dims) {
  TensorView v(nullptr, dtype, dims, device);
  if (!t.defined() || t.dtype() != dtype || t.numel() < v.numel()) t = Tensor::empty({std::max<int64_t>(v.numel(), 1)}, dtype, device);
  v.data = t.data();
  return v;
}

TensorView ModularMoE::Impl::expert_out_like(const TensorView& recv_x) {
  return scratch(expert_out, DType::bf16, std::vector<int64_t>(recv_x.shape.begin(), recv_x.shape.begin() + recv_x.ndim));
}

void ModularMoE::Impl::route_columns(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                                     int64_t begin, int64_t end, bool fused, Stream stream, TensorView& idx, TensorView& wts,
                                     TensorView& g, std::vector<float>& gate_host) {
  const MoEWeights& w = *weights;
  const int64_t n = end - begin, H = w.config.hidden, K = top_k;
  const int64_t cols = K + (has_shared ? 1 : 0);
  idx = scratch(route_idx, DType::int32, {n, cols});
  wts = scratch(route_wts, DType::fp32, {n, cols});
  if (device.is_cuda()) {
#ifdef EPX_WITH_CUDA
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
                                           const std::vector<float>& gate_host, Stream stream) {
  const MoEWeights& w = *weights;
  const int64_t n = x_chunk.shape[0], H = w.config.hidden;
  if (device.is_cuda()) {
#ifdef EPX_WITH_CUDA
    // The shared expert as a one-expert Flat layer with weight 1; g is applied in the add (in fp32,
    // as the CPU does), so there is one rounding of out + g * y.
    if (!shared_experts) shared_experts = make_experts_cuda(shared_only, device.index);
    ExpertsInput in;
    in.layout = ActivationLayout::Flat;
    in.x = x_chunk;
    in.topk_idx = scratch(shared_idx, DType::int32, {n, 1});
    in.topk_weights = scratch(shared_wts, DType::fp32, {n, 1});
    moe_cuda::fill_single_route(in.topk_idx, in.topk_weights, stream);
    const TensorView y = scratch(shared_out, DType::bf16, {n, H});
    shared_experts->apply(in, y, stream);
    moe_cuda::add_shared(out_chunk, y, g, stream);
    return;
#else
    no_cuda("x on " + device.str());
#endif
  }
  x_float.resize(static_cast<size_t>(n * H));
  shared_y.resize(static_cast<size_t>(n * H));
  moe_detail::bf16_to_float(x_chunk.ptr<const uint16_t>(), n * H, x_float.data());
  expert_mlp_cpu(*w.shared, x_float.data(), n, shared_y.data());
  uint16_t* o = out_chunk.ptr<uint16_t>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < H; ++h)
      o[t * H + h] = float_to_bf16_bits(bf16_bits_to_float(o[t * H + h]) + gate_host[t] * shared_y[t * H + h]);
}

void ModularMoE::Impl::run_chunk(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                                 const TensorView& out, int64_t begin, int64_t end, bool fused, Stream stream) {
  const int64_t n = end - begin;
  // Routing of the chunk with the shared column appended: [n, K(+1)] int32 / fp32.
  TensorView idx, wts, g;
  std::vector<float> gate_host;
  route_columns(x, topk_idx, topk_weights, begin, end, fused, stream, idx, wts, g, gate_host);

  const TensorView x_chunk = x.slice_rows(begin, end), out_chunk = out.slice_rows(begin, end);
  DispatchArgs args;
  args.x = x_chunk;
  args.topk_idx = idx;
  args.topk_weights = wts;
  args.stream = stream;
  const PrepareResult prepared = prepare_finalize->prepare(args);
  const TensorView expert_view = expert_out_like(prepared.x);
  if (experts) {
    experts->apply(prepared.experts_input(), expert_view, stream);
  } else {
    EPX_ASSERT(prepared.num_recv_tokens == 0, "a rank without local experts received ", prepared.num_recv_tokens, " rows");
  }
  FinalizeArgs fin;
  fin.expert_out = expert_view;
  fin.out = out_chunk;
  fin.stream = stream;
  prepare_finalize->finalize(fin);

  if (has_shared && !fused && n > 0) add_separate_shared(x_chunk, out_chunk, g, gate_host, stream);
}

}  // namespace epx
