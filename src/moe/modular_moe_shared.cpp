// moe/modular_moe_shared.cpp: ModularMoE's shared expert (FHMoE) off the fused route (the gate and the
// layouts: the file comment of modular_moe.cpp): the separate shared expert (CPU, or a one-expert CUDA
// Experts; g(t) * its output added to the chunk's rows or handed to the combine as FinalizeArgs::addend), the
// local shared slot's experts input (CUDA, ExpertMajor), and the DP-sharded shared expert (its slice on every
// gathered row, g(t) * its output added to the partials).
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

using moe_detail::no_cuda;

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

}  // namespace epx
