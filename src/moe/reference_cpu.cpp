// moe/reference_cpu.cpp: the single-rank, no-EP oracle of one MoE layer (moe.h) and the CPU router
// logits GEMM.
//
// Speed: tokens are grouped per expert, one expert_mlp_cpu call per expert with all its rows, so
// every expert's weights are streamed once per token block instead of once per token. Per-(token,
// column) expert outputs are kept (bf16, exact since expert outputs are bf16-rounded) so the sum
// can run in column order as the contract says. The block is capped at kMaxSlotElements so a
// full-size DeepSeek-V3 batch stays at a few hundred MB.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/topk_message.h"
#include "epx/error.h"
#include "epx/moe.h"
#include "epx/quant.h"
#include "moe/moe_internal.h"

namespace epx {
namespace moe_detail {

float shared_gate_value(const MoEWeights& w, const uint16_t* x_row) {
  if (!w.config.shared_gate) return 1.0f;
  const float* g = w.shared_gate_weight.ptr<const float>();
  float dot = 0.0f;
  for (int64_t h = 0; h < w.config.hidden; ++h) dot += bf16_bits_to_float(x_row[h]) * g[h];
  return 1.0f / (1.0f + std::exp(-dot));
}

void bf16_to_float(const uint16_t* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = bf16_bits_to_float(src[i]);
}

void fp8_round_trip_row(float* row, int64_t hidden, bool ue8m0) {
  std::vector<uint8_t> q(static_cast<size_t>(hidden));
  std::vector<float> scales(static_cast<size_t>(hidden / kFp8GroupSize));
  quantize_fp8_row(row, hidden, q.data(), scales.data(), kFp8GroupSize, ue8m0);
  dequantize_fp8_row(q.data(), scales.data(), hidden, row, kFp8GroupSize);
}

void check_routing(std::string_view op, const TensorView& topk_idx, const TensorView& topk_weights, int64_t num_tokens,
                   int num_experts) {
  check_device(op, "topk_idx", topk_idx, Device::cpu());
  check_dtype(op, "topk_idx", topk_idx, {DType::int32, DType::int64});
  check_shape(op, "topk_idx", topk_idx, {num_tokens, -1});
  check_contiguous(op, "topk_idx", topk_idx);
  const int64_t K = topk_idx.shape[1];
  check_device(op, "topk_weights", topk_weights, Device::cpu());
  check_dtype(op, "topk_weights", topk_weights, {DType::fp32});
  check_shape(op, "topk_weights", topk_weights, {num_tokens, K});
  check_contiguous(op, "topk_weights", topk_weights);
  for (int64_t i = 0; i < num_tokens * K; ++i) {
    const int64_t e = load_index(topk_idx, i);
    if (e < -1 || e >= num_experts) {
      throw InvalidArgument(arg_message(op, detail::topk_elem("topk_idx", i / K, i % K), e, detail::topk_id_rule(num_experts)));
    }
  }
}

}  // namespace moe_detail

namespace {

constexpr int64_t kMaxSlotElements = int64_t{1} << 26;  // bf16 outputs kept per block: 128 MiB

void check_x(std::string_view op, const MoEWeights& w, const TensorView& x) {
  check_device(op, "x", x, Device::cpu());
  check_dtype(op, "x", x, {DType::bf16});
  check_shape(op, "x", x, {-1, w.config.hidden});
  check_contiguous(op, "x", x);
}

}  // namespace

void router_logits_cpu(const MoEWeights& w, const TensorView& x, const TensorView& logits) {
  constexpr std::string_view op = "router_logits_cpu";
  check_x(op, w, x);
  const int64_t T = x.shape[0], H = w.config.hidden, E = w.config.router.num_experts;
  check_device(op, "logits", logits, Device::cpu());
  check_dtype(op, "logits", logits, {DType::fp32});
  check_shape(op, "logits", logits, {T, E});
  check_contiguous(op, "logits", logits);
  require_arg(op, "w.router_weight", w.router_weight.view().describe(),
              w.router_weight.dtype() == DType::fp32 && w.router_weight.numel() == E * H, "must be [E, H] fp32");
  if (T == 0) return;
  std::vector<float> xf(static_cast<size_t>(T * H));
  moe_detail::bf16_to_float(x.ptr<const uint16_t>(), T * H, xf.data());
  // logits [T, E] = x [T, H] . router_weight [E, H]^T, fp32 accumulation.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(T), static_cast<int>(E), static_cast<int>(H), 1.0f,
              xf.data(), static_cast<int>(H), w.router_weight.ptr<const float>(), static_cast<int>(H), 0.0f,
              logits.ptr<float>(), static_cast<int>(E));
  if (w.router_bias.defined()) {
    require_arg(op, "w.router_bias", w.router_bias.view().describe(),
                w.router_bias.dtype() == DType::fp32 && w.router_bias.numel() == E && w.router_bias.device().is_cpu(),
                "must be [E] fp32 on the CPU");
    const float* b = w.router_bias.ptr<const float>();
    float* l = logits.ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) l[t * E + e] += b[e];  // F.linear(x, W, b): the bias joins the fp32 logits
  }
}

void moe_reference_cpu(const MoEWeights& w, const TensorView& x, const TensorView& topk_idx,
                       const TensorView& topk_weights, const TensorView& out, const ReferenceOptions& opt) {
  constexpr std::string_view op = "moe_reference_cpu";
  check_x(op, w, x);
  const int64_t T = x.shape[0], H = w.config.hidden;
  const int E = w.config.router.num_experts;
  moe_detail::check_routing(op, topk_idx, topk_weights, T, E);
  const int64_t K = topk_idx.shape[1];
  check_device(op, "out", out, Device::cpu());
  check_dtype(op, "out", out, {DType::bf16});
  check_shape(op, "out", out, {T, H});
  check_contiguous(op, "out", out);
  const bool use_fp8 = opt.dispatch_dtype == DType::fp8_e4m3;
  require_arg(op, "opt.dispatch_dtype", dtype_name(opt.dispatch_dtype), use_fp8 || opt.dispatch_dtype == DType::bf16,
              "must be bf16 or fp8_e4m3");
  if (use_fp8)
    require_arg(op, "hidden", H, H % kFp8GroupSize == 0, "must be a multiple of 128 for fp8 dispatch (1x128 scales)");
  const bool has_shared = w.config.num_shared_experts > 0;
  if (has_shared) require_arg(op, "w.shared", "null", w.shared != nullptr, "must be set: the model has a shared expert");
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t e = moe_detail::load_index(topk_idx, i);
    if (e >= 0 && (static_cast<size_t>(e) >= w.experts.size() || !w.experts[e])) {
      throw InvalidArgument(arg_message(op, "w.experts[" + std::to_string(e) + "]", "null",
                                        "must be built: topk_idx selects it (MoEWeights::random(cfg, seed) builds all)"));
    }
  }
  if (T == 0) return;

  // x as the experts see it, routed and shared alike: x~ (after the wire's FP8 round trip when
  // dispatch is fp8).
  std::vector<float> x_wire(static_cast<size_t>(T * H));
  moe_detail::bf16_to_float(x.ptr<const uint16_t>(), T * H, x_wire.data());
  if (use_fp8)
    for (int64_t t = 0; t < T; ++t) moe_detail::fp8_round_trip_row(x_wire.data() + t * H, H, opt.use_ue8m0);
  const float* xr = x_wire.data();  // routed input
  const float* xs = x_wire.data();  // shared input

  const int64_t block = std::max<int64_t>(1, kMaxSlotElements / std::max<int64_t>(1, (K + 1) * H));
  std::vector<std::vector<int64_t>> slots(E);  // per expert: (token - t0) * K + k
  std::vector<uint16_t> y_slot;                // [n * K, H] bf16 expert outputs per (token, column)
  std::vector<float> gather, y, acc(static_cast<size_t>(H)), shared_y;
  const float* wt = topk_weights.ptr<const float>();
  uint16_t* o = out.ptr<uint16_t>();
  const uint16_t* xb = x.ptr<const uint16_t>();
  for (int64_t t0 = 0; t0 < T; t0 += block) {
    const int64_t n = std::min(block, T - t0);
    for (auto& s : slots) s.clear();
    for (int64_t t = t0; t < t0 + n; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = moe_detail::load_index(topk_idx, t * K + k);
        if (e >= 0) slots[e].push_back((t - t0) * K + k);
      }
    y_slot.resize(static_cast<size_t>(n * K * H));
    for (int e = 0; e < E; ++e) {
      const auto& s = slots[e];
      if (s.empty()) continue;
      const int64_t m = static_cast<int64_t>(s.size());
      gather.resize(static_cast<size_t>(m * H));
      y.resize(static_cast<size_t>(m * H));
      for (int64_t j = 0; j < m; ++j) std::copy_n(xr + (t0 + s[j] / K) * H, H, gather.data() + j * H);
      expert_mlp_cpu(*w.experts[e], gather.data(), m, y.data());
      for (int64_t j = 0; j < m; ++j)
        for (int64_t h = 0; h < H; ++h) y_slot[s[j] * H + h] = float_to_bf16_bits(y[j * H + h]);
    }
    if (has_shared) {
      shared_y.resize(static_cast<size_t>(n * H));
      expert_mlp_cpu(*w.shared, xs + t0 * H, n, shared_y.data());
    }
    for (int64_t t = t0; t < t0 + n; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        if (moe_detail::load_index(topk_idx, t * K + k) < 0) continue;  // -1: no contribution
        const float wk = wt[t * K + k];
        const uint16_t* ys = y_slot.data() + ((t - t0) * K + k) * H;
        for (int64_t h = 0; h < H; ++h) acc[h] += wk * bf16_bits_to_float(ys[h]);
      }
      if (has_shared) {
        const float g = moe_detail::shared_gate_value(w, xb + t * H);
        const float* sy = shared_y.data() + (t - t0) * H;
        // two_roundings (separate path on a backend without Capabilities::combine_addend): the layer adds
        // g * shared to the finalized (bf16) routed rows
        if (!opt.shared_fused && opt.two_roundings)
          for (int64_t h = 0; h < H; ++h) acc[h] = bf16_bits_to_float(float_to_bf16_bits(acc[h]));
        for (int64_t h = 0; h < H; ++h) acc[h] += g * sy[h];
      }
      for (int64_t h = 0; h < H; ++h) o[t * H + h] = float_to_bf16_bits(acc[h]);
    }
  }
}

}  // namespace epx
