// moe/modular_moe_graph.cpp: ModularMoE's whole-layer CUDA graph: why_no_graph (the capability gate),
// capture_graph (static DP metadata: T_max on every rank, one chunk, no host collective; the valid row count
// on the device) and replay_graph.
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
