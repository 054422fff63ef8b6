// src/experts/experts_weights.cpp: ExpertWeights (format conversion, deterministic random weights,
// the lazily built fp32 copies the CPU path multiplies with) and the WeightFormat names.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "epx/error.h"
#include "epx/experts.h"
#include "epx/quant.h"

namespace epx {

std::string_view weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::bf16: return "bf16";
    case WeightFormat::fp8_block: return "fp8_block";
    case WeightFormat::mxfp4: return "mxfp4";
  }
  return "?";
}

WeightFormat parse_weight_format(std::string_view name) {
  if (name == "bf16") return WeightFormat::bf16;
  if (name == "fp8_block" || name == "fp8") return WeightFormat::fp8_block;
  if (name == "mxfp4") return WeightFormat::mxfp4;
  throw InvalidArgument(arg_message("parse_weight_format", "name", std::string(name), "must be one of bf16, fp8_block, mxfp4"));
}

namespace {

constexpr std::string_view kFromFloat = "ExpertWeights::from_float";

/// splitmix64 (Steele, Lea, Flood 2014): a counter-based generator, so element i of a weight
/// depends only on (seed, stream, i): the values do not depend on the thread count or the
/// standard library (std::normal_distribution's algorithm is implementation-defined).
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// dst[j] ~ N(0, stddev^2) for j in [0, n), element j being global element first + j of the
/// stream `key`. Box-Muller on pairs: pair p (elements 2p, 2p+1) uses one 64-bit draw.
void fill_normal(float* dst, int64_t first, int64_t n, uint64_t key, float stddev) {
  constexpr float kTwoPi = 6.283185307179586f;
  constexpr float k2m24 = 1.0f / 16777216.0f;
  const int64_t end = first + n;
  for (int64_t i = first & ~int64_t{1}; i < end; i += 2) {
    const uint64_t h = splitmix64(key ^ splitmix64(static_cast<uint64_t>(i >> 1)));
    const float u1 = (static_cast<float>(h >> 40) + 0.5f) * k2m24;  // (0, 1): log never sees 0
    const float u2 = static_cast<float>(h & 0xffffffu) * k2m24;
    const float r = stddev * std::sqrt(-2.0f * std::log(u1));
    if (i >= first) dst[i - first] = r * std::cos(kTwoPi * u2);
    if (i + 1 < end) dst[i + 1 - first] = r * std::sin(kTwoPi * u2);
  }
}

/// Asks Linux for transparent huge pages on a large fresh buffer before its first touch. Page
/// faults dominate building full-size weights on the CPU (Qwen1.5-MoE: 2.2 GB of fp32 caches):
/// first touch of 656 MB took 2.2-2.9 s with 4 KiB pages and 1.3-1.6 s with MADV_HUGEPAGE on the
/// 2-core dev VM (THP mode "madvise"). Advisory only: any failure leaves ordinary pages.
void advise_huge_pages(const Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t k2MiB = uintptr_t{2} << 20;
  if (t.nbytes() < static_cast<int64_t>(4 * k2MiB)) return;
  const uintptr_t p = reinterpret_cast<uintptr_t>(t.data());
  const uintptr_t begin = (p + k2MiB - 1) & ~(k2MiB - 1), end = (p + static_cast<uintptr_t>(t.nbytes())) & ~(k2MiB - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

Tensor empty_large(std::vector<int64_t> shape, DType dtype) {
  Tensor t = Tensor::empty(std::move(shape), dtype);
  advise_huge_pages(t);
  return t;
}

void check_float_weight(std::string_view arg, const TensorView& t, int64_t rows, int64_t cols) {
  check_device(kFromFloat, arg, t, Device::cpu());
  check_dtype(kFromFloat, arg, t, {DType::fp32, DType::bf16});
  check_shape(kFromFloat, arg, t, {rows, cols});
  check_contiguous(kFromFloat, arg, t);
}

void check_format_dims(std::string_view op, WeightFormat format, int64_t hidden, int64_t inter) {
  require_arg(op, "hidden", hidden, hidden > 0, "must be > 0");
  require_arg(op, "intermediate", inter, inter > 0, "must be > 0");
  const std::string fmt(weight_format_name(format));
  if (format == WeightFormat::fp8_block) {
    require_arg(op, "hidden", hidden, hidden % kFp8GroupSize == 0, "must be a multiple of 128 for " + fmt);
    require_arg(op, "intermediate", inter, inter % kFp8GroupSize == 0, "must be a multiple of 128 for " + fmt);
  } else if (format == WeightFormat::mxfp4) {
    require_arg(op, "hidden", hidden, hidden % kMxfp4BlockSize == 0, "must be a multiple of 32 for " + fmt);
    require_arg(op, "intermediate", inter, inter % kMxfp4BlockSize == 0, "must be a multiple of 32 for " + fmt);
  }
}

/// Storage of one [rows, cols] matrix in `format` (see ExpertWeights in experts.h).
void allocate_matrix(WeightFormat format, int64_t rows, int64_t cols, Tensor& q, Tensor& scale) {
  switch (format) {
    case WeightFormat::bf16:
      q = empty_large({rows, cols}, DType::bf16);
      scale = Tensor();
      return;
    case WeightFormat::fp8_block:
      q = empty_large({rows, cols}, DType::fp8_e4m3);
      scale = Tensor::empty({rows / kFp8GroupSize, cols / kFp8GroupSize}, DType::fp32);
      return;
    case WeightFormat::mxfp4:
      q = empty_large({rows, cols / 2}, DType::fp4_e2m1x2);
      scale = Tensor::empty({rows, cols / kMxfp4BlockSize}, DType::e8m0);
      return;
  }
}

/// Quantizes rows [row0, row0 + w.rows) of a matrix into its storage q/scale. row0 is a multiple
/// of 128 (fp8_block blocks never straddle two calls).
void quantize_rows(WeightFormat format, const TensorView& w, int64_t row0, const Tensor& q, const Tensor& scale) {
  const int64_t rows = w.size(0), cols = w.size(1);
  switch (format) {
    case WeightFormat::bf16: {
      uint16_t* dst = q.ptr<uint16_t>() + row0 * cols;
      if (w.dtype == DType::bf16) {
        std::copy_n(w.ptr<const uint16_t>(), rows * cols, dst);
      } else {
        const float* src = w.ptr<const float>();
        for (int64_t i = 0; i < rows * cols; ++i) dst[i] = float_to_bf16_bits(src[i]);
      }
      return;
    }
    case WeightFormat::fp8_block: {
      EPX_ASSERT(row0 % kFp8GroupSize == 0, "row0=", row0);
      const int64_t block_cols = cols / kFp8GroupSize;
      TensorView qv(q.ptr<uint8_t>() + row0 * cols, DType::fp8_e4m3, {rows, cols});
      TensorView sv(scale.ptr<float>() + row0 / kFp8GroupSize * block_cols, DType::fp32,
                    {(rows + kFp8GroupSize - 1) / kFp8GroupSize, block_cols});
      quantize_fp8_block_weight(w, qv, sv);
      return;
    }
    case WeightFormat::mxfp4: {
      TensorView qv(q.ptr<uint8_t>() + row0 * cols / 2, DType::fp4_e2m1x2, {rows, cols / 2});
      TensorView sv(scale.ptr<uint8_t>() + row0 * (cols / kMxfp4BlockSize), DType::e8m0, {rows, cols / kMxfp4BlockSize});
      mxfp4_pack(w, qv, sv);
      return;
    }
  }
}

/// Fills the storage of a [rows, cols] matrix with quantized N(0, stddev^2) values of stream
/// (seed, stream). Generated in 128-row chunks into a small scratch (no full fp32 temporary to
/// page in), chunks spread over the cores; element i's value depends only on (seed, stream, i).
void fill_random_matrix(WeightFormat format, int64_t rows, int64_t cols, uint64_t seed, uint64_t stream, float stddev,
                        const Tensor& q, const Tensor& scale) {
  const uint64_t key = splitmix64(seed ^ splitmix64(stream));
  constexpr int64_t kChunkRows = kFp8GroupSize;
  const int64_t num_chunks = (rows + kChunkRows - 1) / kChunkRows;
  const int64_t min_values_per_thread = int64_t{1} << 20;
  const int64_t num_threads = std::clamp<int64_t>(rows * cols / min_values_per_thread, 1,
                                                  std::min<int64_t>(num_chunks, std::max(1u, std::thread::hardware_concurrency())));
  auto work = [&](int64_t first_chunk) {
    std::vector<float> scratch(static_cast<size_t>(kChunkRows * cols));
    for (int64_t c = first_chunk; c < num_chunks; c += num_threads) {
      const int64_t r0 = c * kChunkRows, m = std::min(kChunkRows, rows - r0);
      fill_normal(scratch.data(), r0 * cols, m * cols, key, stddev);
      quantize_rows(format, TensorView(scratch.data(), DType::fp32, {m, cols}), r0, q, scale);
    }
  };
  if (num_threads == 1) {
    work(0);
    return;
  }
  std::vector<std::exception_ptr> errors(static_cast<size_t>(num_threads));
  std::vector<std::thread> threads;
  for (int64_t t = 0; t < num_threads; ++t)
    threads.emplace_back([&, t] {
      try {
        work(t);
      } catch (...) {
        errors[t] = std::current_exception();  // rethrown on the calling thread below
      }
    });
  for (auto& th : threads) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

/// Inverse of the quantization into out [rows, cols] fp32.
void dequantize_matrix(WeightFormat format, const Tensor& q, const Tensor& scale, const Tensor& out) {
  switch (format) {
    case WeightFormat::bf16: {
      const uint16_t* src = q.ptr<const uint16_t>();
      float* dst = out.ptr<float>();
      for (int64_t i = 0; i < out.numel(); ++i) dst[i] = bf16_bits_to_float(src[i]);
      return;
    }
    case WeightFormat::fp8_block: dequantize_fp8_block_weight(q, scale, out); return;
    case WeightFormat::mxfp4: mxfp4_unpack(q, scale, out); return;
  }
}

}  // namespace

std::shared_ptr<ExpertWeights> ExpertWeights::from_float(WeightFormat format, const TensorView& gate_up,
                                                         const TensorView& down) {
  require_arg(kFromFloat, "gate_up.ndim", gate_up.ndim, gate_up.ndim == 2, "must be 2 ([2I, H])");
  require_arg(kFromFloat, "down.ndim", down.ndim, down.ndim == 2, "must be 2 ([H, I])");
  const int64_t hidden = gate_up.size(1), two_i = gate_up.size(0);
  require_arg(kFromFloat, "gate_up.shape[0]", two_i, two_i > 0 && two_i % 2 == 0, "must be 2I with I > 0");
  check_format_dims(kFromFloat, format, hidden, two_i / 2);
  check_float_weight("gate_up", gate_up, two_i, hidden);
  check_float_weight("down", down, hidden, two_i / 2);
  auto w = std::make_shared<ExpertWeights>();
  w->format = format;
  w->hidden = hidden;
  w->intermediate = two_i / 2;
  allocate_matrix(format, two_i, hidden, w->w13, w->w13_scale);
  allocate_matrix(format, hidden, two_i / 2, w->w2, w->w2_scale);
  quantize_rows(format, gate_up, 0, w->w13, w->w13_scale);
  quantize_rows(format, down, 0, w->w2, w->w2_scale);
  return w;
}

std::shared_ptr<ExpertWeights> ExpertWeights::random(WeightFormat format, int64_t hidden, int64_t intermediate,
                                                     uint64_t seed) {
  check_format_dims("ExpertWeights::random", format, hidden, intermediate);
  auto w = std::make_shared<ExpertWeights>();
  w->format = format;
  w->hidden = hidden;
  w->intermediate = intermediate;
  allocate_matrix(format, 2 * intermediate, hidden, w->w13, w->w13_scale);
  allocate_matrix(format, hidden, intermediate, w->w2, w->w2_scale);
  // N(0, 1/fan_in) keeps activations O(1) through each projection (LeCun init).
  fill_random_matrix(format, 2 * intermediate, hidden, seed, 1, 1.0f / std::sqrt(static_cast<float>(hidden)), w->w13,
                     w->w13_scale);
  fill_random_matrix(format, hidden, intermediate, seed, 2, 1.0f / std::sqrt(static_cast<float>(intermediate)), w->w2,
                     w->w2_scale);
  return w;
}

std::string expert_activation_name(const ExpertActivation& a) {
  auto num = [](float v) {
    std::ostringstream o;
    o << v;
    return o.str();
  };
  if (a.kind == ExpertActivation::Kind::gpt_oss_glu) return "gpt_oss_glu(alpha=" + num(a.alpha) + ", limit=" + num(a.limit) + ")";
  return a.is_plain_silu() ? "silu_glu" : "silu_glu(limit=" + num(a.limit) + ")";
}

void ExpertWeights::check_extras(std::string_view op, const std::string& what) const {
  auto check_bias = [&](const Tensor& b, const char* name, int64_t n) {
    if (!b.defined()) return;
    const std::string arg = what + "." + name;
    check_device(op, arg, b, Device::cpu());
    check_dtype(op, arg, b, {DType::fp32});
    check_shape(op, arg, b, {n});
    check_contiguous(op, arg, b);
  };
  check_bias(b13, "b13", 2 * intermediate);
  check_bias(b2, "b2", hidden);
  const ExpertActivation& a = activation;
  require_arg(op, what + ".activation.limit", a.limit, a.limit > 0, "must be > 0 (the clamp bound; +inf = none)");
  if (a.kind == ExpertActivation::Kind::gpt_oss_glu) {
    require_arg(op, what + ".activation.limit", a.limit, std::isfinite(a.limit), "must be finite for gpt_oss_glu (swiglu_limit)");
    require_arg(op, what + ".activation.alpha", a.alpha, std::isfinite(a.alpha), "must be finite");
  }
}

int64_t intermediate_granularity(WeightFormat f) {
  switch (f) {
    case WeightFormat::bf16: return 8;
    case WeightFormat::fp8_block: return kFp8GroupSize;
    case WeightFormat::mxfp4: return kMxfp4BlockSize;
  }
  return 1;
}

namespace {
/// Rows [r0, r1) of `src` (2-D, any dtype) appended to `dst` at row `dst_row`.
void copy_rows(const Tensor& src, int64_t r0, int64_t r1, Tensor& dst, int64_t dst_row) {
  const int64_t row_bytes = src.size(1) * dtype_size(src.dtype());
  if (r1 > r0)
    std::memcpy(static_cast<char*>(dst.data()) + dst_row * row_bytes, static_cast<const char*>(src.data()) + r0 * row_bytes,
                static_cast<size_t>((r1 - r0) * row_bytes));
}
/// Columns [c0, c1) of every row of `src` (2-D, storage elements) into `dst` [rows, c1 - c0].
Tensor copy_cols(const Tensor& src, int64_t c0, int64_t c1) {
  Tensor dst = Tensor::empty({src.size(0), c1 - c0}, src.dtype());
  const int64_t es = dtype_size(src.dtype()), src_row = src.size(1) * es, dst_row = (c1 - c0) * es;
  for (int64_t r = 0; r < src.size(0); ++r)
    std::memcpy(static_cast<char*>(dst.data()) + r * dst_row, static_cast<const char*>(src.data()) + r * src_row + c0 * es,
                static_cast<size_t>(dst_row));
  return dst;
}
}  // namespace

std::shared_ptr<ExpertWeights> ExpertWeights::slice_intermediate(int64_t begin, int64_t end) const {
  constexpr std::string_view kOp = "ExpertWeights::slice_intermediate";
  const int64_t I = intermediate, g = intermediate_granularity(format);
  const std::string rule = "must be a multiple of " + std::to_string(g) + " (" + std::string(weight_format_name(format)) + ")";
  require_arg(kOp, "begin", begin, begin >= 0 && begin < I, "must be in [0, intermediate = " + std::to_string(I) + ")");
  require_arg(kOp, "end", end, end > begin && end <= I, "must be in (begin = " + std::to_string(begin) + ", intermediate = " + std::to_string(I) + "]");
  require_arg(kOp, "begin", begin, begin % g == 0, rule);
  require_arg(kOp, "end", end, end % g == 0 || end == I, rule + " or equal intermediate = " + std::to_string(I));
  auto w = std::make_shared<ExpertWeights>();
  w->format = format;
  w->hidden = hidden;
  w->intermediate = end - begin;
  const int64_t n = end - begin;
  // w13 [2I, *]: gate rows then up rows. Scale rows are per 128 rows (fp8_block) or per row (mxfp4).
  w->w13 = Tensor::empty({2 * n, w13.size(1)}, w13.dtype());
  copy_rows(w13, begin, end, w->w13, 0);
  copy_rows(w13, I + begin, I + end, w->w13, n);
  w->activation = activation;
  if (b13.defined()) {  // gate bias [begin, end), up bias [I + begin, I + end)
    w->b13 = Tensor::empty({2 * n}, DType::fp32);
    std::memcpy(w->b13.ptr<float>(), b13.ptr<const float>() + begin, static_cast<size_t>(n) * 4);
    std::memcpy(w->b13.ptr<float>() + n, b13.ptr<const float>() + I + begin, static_cast<size_t>(n) * 4);
  }
  if (b2.defined() && begin == 0) w->b2 = b2;  // added once: the slices sum to the expert
  // w2 [H, I] (mxfp4: [H, I/2] packed pairs): columns of the slice.
  switch (format) {
    case WeightFormat::bf16:
      w->w2 = copy_cols(w2, begin, end);
      break;
    case WeightFormat::fp8_block: {
      const int64_t sb = begin / g, se = (end + g - 1) / g, sI = w13_scale.size(0) / 2;
      w->w13_scale = Tensor::empty({2 * (se - sb), w13_scale.size(1)}, DType::fp32);
      copy_rows(w13_scale, sb, se, w->w13_scale, 0);
      copy_rows(w13_scale, sI + sb, sI + se, w->w13_scale, se - sb);
      w->w2 = copy_cols(w2, begin, end);
      w->w2_scale = copy_cols(w2_scale, sb, se);
      break;
    }
    case WeightFormat::mxfp4: {
      w->w13_scale = Tensor::empty({2 * n, w13_scale.size(1)}, w13_scale.dtype());
      copy_rows(w13_scale, begin, end, w->w13_scale, 0);
      copy_rows(w13_scale, I + begin, I + end, w->w13_scale, n);
      w->w2 = copy_cols(w2, begin / 2, end / 2);
      w->w2_scale = copy_cols(w2_scale, begin / g, (end + g - 1) / g);
      break;
    }
  }
  return w;
}

void ExpertWeights::build_f32() const {
  EPX_ASSERT(w13.defined() && w2.defined() && hidden > 0 && intermediate > 0, "hidden=", hidden, " intermediate=", intermediate);
  w13_f32_ = empty_large({2 * intermediate, hidden}, DType::fp32);
  w2_f32_ = empty_large({hidden, intermediate}, DType::fp32);
  dequantize_matrix(format, w13, w13_scale, w13_f32_);
  dequantize_matrix(format, w2, w2_scale, w2_f32_);
}

const float* ExpertWeights::w13_f32() const {
  std::call_once(f32_once_, [this] { build_f32(); });
  return w13_f32_.ptr<const float>();
}

const float* ExpertWeights::w2_f32() const {
  std::call_once(f32_once_, [this] { build_f32(); });
  return w2_f32_.ptr<const float>();
}

}  // namespace epx
