// moe/modular_moe_impl.h: ModularMoE's state (ModularMoE::Impl) and the argument checks its parts share:
// modular_moe.cpp (construction, forward, the chunk loop), modular_moe_shared.cpp (the separate shared expert,
// the local shared slot, the DP-sharded shared expert) and modular_moe_graph.cpp (the whole-layer CUDA graph).
// Internal to the layer.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "epx/error.h"
#include "epx/moe.h"
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

namespace moe_detail {

inline constexpr std::string_view kFwdOp = "ModularMoE.forward";

inline void check_rows(std::string_view op, std::string_view arg, const TensorView& t, int64_t rows, int64_t hidden, Device device) {
  check_device(op, arg, t, device);
  check_dtype(op, arg, t, {DType::bf16});
  check_shape(op, arg, t, {rows, hidden});
  check_contiguous(op, arg, t);
}

/// Routing [T, K] on `device`: on the CPU the full check (values included, moe_internal.h); on CUDA
/// device, dtype, shape and layout only (the values stay on the device).
inline void check_routing_on(Device device, std::string_view op, const TensorView& topk_idx, const TensorView& topk_weights,
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

[[noreturn]] inline void no_cuda(std::string_view what) {
  throw Unsupported(std::string(kFwdOp) + ": " + std::string(what) + ": this build has no CUDA (configure with EPX_CUDA=ON)");
}

}  // namespace moe_detail

}  // namespace epx
