// src/experts/experts_cpu.cpp: the CPU expert MLP (BLAS sgemm on the dequantized fp32 weights) and
// the CPU Experts backend for every activation layout. This is the oracle the CUDA grouped GEMM is
// compared with, and what the CPU device runs for the full-size models, so tokens are grouped per
// expert and each group is one pair of sgemm calls (never a per-token GEMV).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#if __has_include(<cblas.h>)
#include <cblas.h>
#else
#error "epx's CPU experts need a CBLAS header (OpenBLAS: libopenblas-dev); CMake's EPX_CBLAS_INCLUDE did not find cblas.h"
#endif

#include "epx/error.h"
#include "epx/experts.h"
#include "epx/quant.h"
#include "experts/contiguous.h"

namespace epx {

std::string_view layout_name(ActivationLayout l) {
  switch (l) {
    case ActivationLayout::ExpertMajor: return "expert_major";
    case ActivationLayout::Flat: return "flat";
    case ActivationLayout::Contiguous: return "contiguous";
  }
  return "?";
}

namespace {

/// [begin, end) rows of every local expert of the Contiguous layout, after checking expert_offsets
/// (ExpertsInput::expert_offsets: `num_offsets` = L cumulative ends, or L + 1 starts then the end; non-decreasing,
/// each in [0, n]).
std::vector<std::pair<int64_t, int64_t>> contiguous_ranges(std::string_view op, const int32_t* offs, int64_t num_offsets,
                                                           int64_t num_local, int64_t n) {
  const bool lead = num_offsets == num_local + 1;  // [L + 1]: a first start, then L ends
  std::vector<std::pair<int64_t, int64_t>> range(static_cast<size_t>(num_local));
  int64_t prev = 0;
  for (int64_t i = 0; i < num_offsets; ++i) {
    const std::string arg = "expert_offsets[" + std::to_string(i) + "]";
    require_arg(op, arg, offs[i], offs[i] >= 0 && offs[i] <= n, "must be in [0, N = " + std::to_string(n) + "] (a row offset)");
    if (i > 0)
      require_arg(op, arg, offs[i], offs[i] >= prev,
                  "must be >= expert_offsets[" + std::to_string(i - 1) + "] = " + std::to_string(prev) +
                      " (the offsets of experts sorted by id never decrease)");
    prev = offs[i];
  }
  for (int64_t l = 0; l < num_local; ++l)
    range[l] = lead ? std::pair<int64_t, int64_t>{offs[l], offs[l + 1]}
                    : std::pair<int64_t, int64_t>{l == 0 ? 0 : offs[l - 1], offs[l]};
  return range;
}

/// Rows per sgemm. Bounds the [rows, 2I] fp32 intermediate (Qwen1.5-MoE shared expert, I = 5632:
/// 512 rows = 23 MiB instead of 180 MiB for 4000 tokens) while keeping sgemm efficient (M >= 512
/// reaches OpenBLAS's large-matrix rate; the weights are re-streamed once per 512 rows).
constexpr int64_t kRowsPerGemm = 512;

/// C[m, n] = A[m, k] . B[n, k]^T, all row-major fp32.
void gemm_abt(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), 1.0f, a, static_cast<blasint>(k), b, static_cast<blasint>(k), 0.0f, c,
              static_cast<blasint>(n));
}

/// Rows at most kRowsPerGemm of one expert (num_rows <= kRowsPerGemm), buffers sized by the caller.
void expert_mlp_block(const ExpertWeights& w, const float* x, int64_t num_rows, float* y, std::vector<float>& gate_up,
                      std::vector<float>& h, std::vector<uint8_t>& h_q, std::vector<float>& h_scales) {
  const int64_t hidden = w.hidden, inter = w.intermediate;
  gemm_abt(num_rows, 2 * inter, hidden, x, w.w13_f32(), gate_up.data());
  const float* b13 = w.b13.defined() ? w.b13.ptr<const float>() : nullptr;
  const ExpertActivation act = w.activation;
  const bool clamp = act.limit < std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < num_rows; ++r) {
    float* g = gate_up.data() + r * 2 * inter;
    float* u = g + inter;
    float* hr = h.data() + r * inter;
    if (b13)
      for (int64_t i = 0; i < 2 * inter; ++i) g[i] += b13[i];  // gate_up + gate_up_proj_bias, fp32
    if (clamp)
      for (int64_t i = 0; i < inter; ++i) {  // gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
        g[i] = std::min(g[i], act.limit);
        u[i] = std::clamp(u[i], -act.limit, act.limit);
      }
    if (act.kind == ExpertActivation::Kind::gpt_oss_glu) {
      // glu = gate * sigmoid(gate * alpha); (up + 1) * glu, fp32
      for (int64_t i = 0; i < inter; ++i) hr[i] = (u[i] + 1.0f) * (g[i] / (1.0f + std::exp(-act.alpha * g[i])));
    } else {
      for (int64_t i = 0; i < inter; ++i) hr[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];  // silu(g) * u, fp32
    }
    if (w.format == WeightFormat::fp8_block) {
      // DeepSeek-V3: the down projection consumes h as FP8 1x128 with fp32 scales.
      quantize_fp8_row(hr, inter, h_q.data(), h_scales.data(), kFp8GroupSize, false);
      dequantize_fp8_row(h_q.data(), h_scales.data(), inter, hr, kFp8GroupSize);
    } else {
      for (int64_t i = 0; i < inter; ++i) hr[i] = round_bf16(hr[i]);
    }
  }
  gemm_abt(num_rows, hidden, inter, h.data(), w.w2_f32(), y);
  if (w.b2.defined()) {
    const float* b2 = w.b2.ptr<const float>();
    for (int64_t r = 0; r < num_rows; ++r)
      for (int64_t i = 0; i < hidden; ++i) y[r * hidden + i] += b2[i];  // + down_proj_bias, fp32, before the one rounding
  }
  for (int64_t i = 0; i < num_rows * hidden; ++i) y[i] = round_bf16(y[i]);
}

/// Reads activation row `row` of x (bf16, or fp8 with [.., H/128] fp32 scales) as fp32 into dst[H].
/// `row` indexes the rows of x flattened over its leading dims.
void load_row(const ExpertsInput& in, int64_t hidden, int64_t row, float* dst) {
  if (in.x.dtype == DType::bf16) {
    const uint16_t* src = in.x.ptr<const uint16_t>() + row * hidden;
    for (int64_t i = 0; i < hidden; ++i) dst[i] = bf16_bits_to_float(src[i]);
  } else {
    dequantize_fp8_row(in.x.ptr<const uint8_t>() + row * hidden,
                       in.x_scales.ptr<const float>() + row * (hidden / kFp8GroupSize), hidden, dst, kFp8GroupSize);
  }
}

/// Runs expert `w` on the rows listed in `rows` (flattened row ids of in.x) and hands each output
/// row (fp32 holding bf16 values) to emit(position in `rows`, const float* y_row).
template <class Emit>
void run_expert_on_rows(const ExpertWeights& w, const ExpertsInput& in, const int64_t* rows, int64_t num_rows,
                        std::vector<float>& x_buf, std::vector<float>& y_buf, Emit&& emit) {
  const int64_t hidden = w.hidden;
  for (int64_t r0 = 0; r0 < num_rows; r0 += kRowsPerGemm) {
    const int64_t m = std::min(kRowsPerGemm, num_rows - r0);
    x_buf.resize(static_cast<size_t>(m * hidden));
    y_buf.resize(static_cast<size_t>(m * hidden));
    for (int64_t j = 0; j < m; ++j) load_row(in, hidden, rows[r0 + j], x_buf.data() + j * hidden);
    expert_mlp_cpu(w, x_buf.data(), m, y_buf.data());
    for (int64_t j = 0; j < m; ++j) emit(r0 + j, y_buf.data() + j * hidden);
  }
}

class CpuExperts final : public Experts {
 public:
  explicit CpuExperts(std::vector<std::shared_ptr<const ExpertWeights>> experts) : experts_(std::move(experts)) {
    require_arg("make_experts_cpu", "local_experts.size", experts_.size(), !experts_.empty(), "must be >= 1");
    for (size_t l = 0; l < experts_.size(); ++l) {
      const std::string arg = "local_experts[" + std::to_string(l) + "]";
      require_arg("make_experts_cpu", arg, "null", experts_[l] != nullptr, "must be non-null");
      require_arg("make_experts_cpu", arg + ".hidden", experts_[l]->hidden, experts_[l]->hidden == experts_[0]->hidden,
                  "must equal local_experts[0].hidden = " + std::to_string(experts_[0]->hidden));
      experts_[l]->check_extras("make_experts_cpu", arg);
    }
  }

  int num_local_experts() const override { return static_cast<int>(experts_.size()); }
  int64_t hidden() const override { return experts_[0]->hidden; }
  bool supports(ActivationLayout) const override { return true; }

  void apply(const ExpertsInput& in, const TensorView& out, Stream) override {
    if (in.layout == ActivationLayout::ExpertMajor) apply_expert_major(in, out);
    else if (in.layout == ActivationLayout::Contiguous) apply_contiguous(in, out);
    else apply_flat(in, out);
  }

 private:
  static constexpr std::string_view kOp = "experts_cpu.apply";

  void check_tensor(std::string_view arg, const TensorView& t, std::initializer_list<DType> dtypes,
                    std::initializer_list<int64_t> shape) const {
    check_device(kOp, arg, t, Device::cpu());
    check_dtype(kOp, arg, t, dtypes);
    check_shape(kOp, arg, t, shape);
    check_contiguous(kOp, arg, t);
  }

  /// x bf16 | fp8_e4m3 with leading dims `lead`; fp8 needs x_scales [lead..., H/128] fp32, bf16 takes none (scales
  /// given with bf16 x would be ignored: a caller who meant FP8 x gets bf16 results without a word).
  void check_x(const ExpertsInput& in, std::initializer_list<int64_t> x_shape, std::initializer_list<int64_t> s_shape) const {
    check_tensor("x", in.x, {DType::bf16, DType::fp8_e4m3}, x_shape);
    if (in.x.dtype == DType::fp8_e4m3) {
      require_arg(kOp, "hidden", hidden(), hidden() % kFp8GroupSize == 0, "must be a multiple of 128 for fp8_e4m3 input");
      require_arg(kOp, "x_scales", "empty", in.x_scales.defined(), "must be given for fp8_e4m3 x ([.., H/128] fp32 1x128 scales)");
      check_tensor("x_scales", in.x_scales, {DType::fp32}, s_shape);
    } else {
      require_arg(kOp, "x_scales", "given", !in.x_scales.defined(),
                  "must be empty for x.dtype = bf16 (scales belong to fp8_e4m3 x)");
    }
  }

  void apply_expert_major(const ExpertsInput& in, const TensorView& out) {
    const int64_t num_local = num_local_experts(), h = hidden();
    require_arg(kOp, "x.ndim", in.x.ndim, in.x.ndim == 3, "must be 3 ([L, cap, H]) for the expert_major layout");
    const int64_t cap = in.x.size(1);
    check_x(in, {num_local, cap, h}, {num_local, cap, h / kFp8GroupSize});
    check_tensor("recv_count", in.recv_count, {DType::int32}, {num_local});
    check_tensor("out", out, {DType::bf16}, {num_local, cap, h});
    const int32_t* counts = in.recv_count.ptr<const int32_t>();
    for (int64_t l = 0; l < num_local; ++l)
      require_arg(kOp, "recv_count[" + std::to_string(l) + "]", counts[l], counts[l] >= 0 && counts[l] <= cap,
                  "must be in [0, cap = " + std::to_string(cap) + "]");
    std::vector<int64_t> rows;
    std::vector<float> x_buf, y_buf;
    uint16_t* o = out.ptr<uint16_t>();
    for (int64_t l = 0; l < num_local; ++l) {
      // Only rows [0, recv_count) are read or written: padding (possibly NaN) never enters a GEMM.
      rows.resize(static_cast<size_t>(counts[l]));
      for (int64_t j = 0; j < counts[l]; ++j) rows[j] = l * cap + j;
      run_expert_on_rows(*experts_[l], in, rows.data(), counts[l], x_buf, y_buf, [&](int64_t j, const float* y) {
        uint16_t* dst = o + rows[j] * h;
        for (int64_t i = 0; i < h; ++i) dst[i] = float_to_bf16_bits(y[i]);  // exact: y holds bf16 values
      });
    }
  }

  void apply_contiguous(const ExpertsInput& in, const TensorView& out) {
    const int64_t num_local = num_local_experts(), h = hidden();
    require_arg(kOp, "x.ndim", in.x.ndim, in.x.ndim == 2, "must be 2 ([N, H]) for the contiguous layout");
    const int64_t n = in.x.size(0);
    check_x(in, {n, h}, {n, h / kFp8GroupSize});
    const int64_t num_offsets = experts_detail::contiguous_offsets_count(kOp, in.expert_offsets, num_local);
    check_tensor("expert_offsets", in.expert_offsets, {DType::int32}, {num_offsets});
    check_tensor("out", out, {DType::bf16}, {n, h});
    const auto range = contiguous_ranges(kOp, in.expert_offsets.ptr<const int32_t>(), num_offsets, num_local, n);
    std::vector<int64_t> rows;
    std::vector<float> x_buf, y_buf;
    uint16_t* o = out.ptr<uint16_t>();
    for (int64_t l = 0; l < num_local; ++l) {
      const int64_t count = range[l].second - range[l].first;
      rows.resize(static_cast<size_t>(count));
      for (int64_t j = 0; j < count; ++j) rows[j] = range[l].first + j;
      run_expert_on_rows(*experts_[l], in, rows.data(), count, x_buf, y_buf, [&](int64_t j, const float* y) {
        uint16_t* dst = o + rows[j] * h;
        for (int64_t i = 0; i < h; ++i) dst[i] = float_to_bf16_bits(y[i]);  // exact: y holds bf16 values
      });
    }
  }

  void apply_flat(const ExpertsInput& in, const TensorView& out) {
    const int64_t num_local = num_local_experts(), h = hidden();
    require_arg(kOp, "x.ndim", in.x.ndim, in.x.ndim == 2, "must be 2 ([N, H]) for the flat layout");
    const int64_t n = in.x.size(0);
    check_x(in, {n, h}, {n, h / kFp8GroupSize});
    require_arg(kOp, "topk_idx.ndim", in.topk_idx.ndim, in.topk_idx.ndim == 2, "must be 2 ([N, K])");
    const int64_t k = in.topk_idx.size(1);
    check_tensor("topk_idx", in.topk_idx, {DType::int32, DType::int64}, {n, k});
    check_tensor("topk_weights", in.topk_weights, {DType::fp32}, {n, k});
    check_tensor("out", out, {DType::bf16, DType::fp32}, {n, h});  // fp32: the weighted sum unrounded

    // Validate every index before any work, then bucket the valid (row, k) pairs by expert
    // (counting sort; within an expert, pairs keep row-major order).
    std::vector<int32_t> idx(static_cast<size_t>(n * k));
    for (int64_t i = 0; i < n * k; ++i) {
      const int64_t e = in.topk_idx.dtype == DType::int32 ? in.topk_idx.ptr<const int32_t>()[i]
                                                          : in.topk_idx.ptr<const int64_t>()[i];
      if (e < -1 || e >= num_local)
        throw InvalidArgument(arg_message(kOp, "topk_idx[" + std::to_string(i / k) + ", " + std::to_string(i % k) + "]", e,
                                          "must be -1 (not on this rank) or a local expert index in [0, L = " +
                                              std::to_string(num_local) + ")"));
      idx[i] = static_cast<int32_t>(e);
    }
    std::vector<int64_t> offset(static_cast<size_t>(num_local + 1), 0);
    for (int32_t e : idx)
      if (e >= 0) ++offset[e + 1];
    for (int64_t l = 0; l < num_local; ++l) offset[l + 1] += offset[l];
    const int64_t num_pairs = offset[num_local];
    std::vector<int64_t> pair_row(static_cast<size_t>(num_pairs));  // x row of each sorted pair
    std::vector<int64_t> slot(static_cast<size_t>(n * k), -1);      // (row, k) -> sorted pair
    {
      std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
      for (int64_t i = 0; i < n * k; ++i) {
        if (idx[i] < 0) continue;
        const int64_t p = fill[idx[i]]++;
        pair_row[p] = i / k;
        slot[i] = p;
      }
    }

    // Expert outputs per pair, kept as bf16 bits: they are bf16 values, so this is lossless and
    // halves the buffer (4000 tokens x K = 4 x H = 2048: 64 MiB).
    std::vector<uint16_t> pair_out(static_cast<size_t>(num_pairs * h));
    std::vector<float> x_buf, y_buf;
    for (int64_t l = 0; l < num_local; ++l) {
      const int64_t* rows = pair_row.data() + offset[l];
      run_expert_on_rows(*experts_[l], in, rows, offset[l + 1] - offset[l], x_buf, y_buf, [&](int64_t j, const float* y) {
        uint16_t* dst = pair_out.data() + (offset[l] + j) * h;
        for (int64_t i = 0; i < h; ++i) dst[i] = float_to_bf16_bits(y[i]);
      });
    }

    // Weighted sum in column order, fp32, one rounding. Invalid columns are skipped (select), so
    // neither their weights nor x rows without a local selection are ever read.
    const float* weights = in.topk_weights.ptr<const float>();
    const bool out_f32 = out.dtype == DType::fp32;
    std::vector<float> acc(static_cast<size_t>(h));
    for (int64_t r = 0; r < n; ++r) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < k; ++c) {
        const int64_t p = slot[r * k + c];
        if (p < 0) continue;
        const float wt = weights[r * k + c];
        const uint16_t* y = pair_out.data() + p * h;
        for (int64_t i = 0; i < h; ++i) acc[i] += wt * bf16_bits_to_float(y[i]);
      }
      if (out_f32) {
        std::copy(acc.begin(), acc.end(), out.ptr<float>() + r * h);
      } else {
        uint16_t* dst = out.ptr<uint16_t>() + r * h;
        for (int64_t i = 0; i < h; ++i) dst[i] = float_to_bf16_bits(acc[i]);
      }
    }
  }

  std::vector<std::shared_ptr<const ExpertWeights>> experts_;
};

}  // namespace

int64_t experts_detail::contiguous_offsets_count(std::string_view op, const TensorView& offsets, int64_t num_local) {
  require_arg(op, "expert_offsets.ndim", offsets.ndim, offsets.ndim == 1, "must be 1 ([L] or [L + 1] int32) for the contiguous layout");
  const int64_t n = offsets.size(0);
  require_arg(op, "expert_offsets.shape[0]", n, n == num_local || n == num_local + 1,
              "must be L = " + std::to_string(num_local) + " (cumulative ends, torch's offs) or L + 1 (starts, then the end)");
  return n;
}

void expert_mlp_cpu(const ExpertWeights& w, const float* x, int64_t num_rows, float* y) {
  constexpr std::string_view op = "expert_mlp_cpu";
  require_arg(op, "num_rows", num_rows, num_rows >= 0, "must be >= 0");
  require_arg(op, "w.hidden", w.hidden, w.hidden > 0, "must be > 0");
  require_arg(op, "w.intermediate", w.intermediate, w.intermediate > 0, "must be > 0");
  if (w.format == WeightFormat::fp8_block)
    require_arg(op, "w.intermediate", w.intermediate, w.intermediate % kFp8GroupSize == 0,
                "must be a multiple of 128 for fp8_block (h is quantized 1x128)");
  w.check_extras(op, "w");
  if (num_rows == 0) return;
  const int64_t m_max = std::min(num_rows, kRowsPerGemm);
  std::vector<float> gate_up(static_cast<size_t>(m_max * 2 * w.intermediate));
  std::vector<float> h(static_cast<size_t>(m_max * w.intermediate));
  std::vector<uint8_t> h_q;
  std::vector<float> h_scales;
  if (w.format == WeightFormat::fp8_block) {
    h_q.resize(static_cast<size_t>(w.intermediate));
    h_scales.resize(static_cast<size_t>(w.intermediate / kFp8GroupSize));
  }
  for (int64_t r0 = 0; r0 < num_rows; r0 += kRowsPerGemm) {
    const int64_t m = std::min(kRowsPerGemm, num_rows - r0);
    expert_mlp_block(w, x + r0 * w.hidden, m, y + r0 * w.hidden, gate_up, h, h_q, h_scales);
  }
}

std::unique_ptr<Experts> make_experts_cpu(std::vector<std::shared_ptr<const ExpertWeights>> local_experts) {
  return std::make_unique<CpuExperts>(std::move(local_experts));
}

}  // namespace epx
