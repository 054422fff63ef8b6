// experts/experts_cuda_testing.h: what the CUDA experts tests share (experts_cuda_test.cpp,
// experts_mxfp4_cuda_test.cpp, experts_errors_cuda_test.cpp): tolerances, device copies, random rows, and the
// cases (ExpertMajor, Contiguous, Flat) built once with the CPU experts' output as the reference and checked
// against any number of CUDA Experts. Test-only; include after the CUDA headers, inside EPX_WITH_CUDA.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "epx/config.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/experts.h"
#include "epx/quant.h"
#include "test_util.h"

namespace epx {
namespace {

constexpr double kMaxRelL2 = 1e-2;  // METHOD.md, bf16 operands; NaN never passes
/// fp8_block experts fed FP8 x run on the sm_90a tensor cores, whose FP8 accumulation inside each
/// 128-deep K block keeps ~14 mantissa bits (DeepSeek-V3 technical report, section 3.3.2, the
/// reason for the per-128 promotion): h lands ~1e-4 off the CPU's fp32 values, and the FP8 1x128
/// requantization of h then rounds ~1% of its elements to the neighbouring e4m3 value (one step =
/// 6-12 %). Measured on an H200: normwise 2-5e-3 at DeepSeek shapes, up to
/// 1.6e-2 over 5 rows and 3.6e-2 for single rows of the H 384 / I 128 shapes. The bound stays
/// below one e4m3 step (2^-4 = 6.25e-2): an indexing or scale error costs O(1).
constexpr double kMaxRelL2Fp8TensorCores = 5e-2;

/// Tolerance for x of `x_dtype` through `experts`: the FP8 tensor-core one when any expert is
/// fp8_block and x is FP8, else kMaxRelL2.
inline double tolerance(DType x_dtype, const std::vector<std::shared_ptr<const ExpertWeights>>& experts) {
  if (x_dtype != DType::fp8_e4m3) return kMaxRelL2;
  for (const auto& e : experts)
    if (e->format == WeightFormat::fp8_block) return kMaxRelL2Fp8TensorCores;
  return kMaxRelL2;
}

const Device kDev = Device::cuda(0);

inline int gpus() { return cuda::device_count(); }

inline std::vector<int64_t> shape_of(const TensorView& t) { return std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim); }

inline Tensor to_dev(const TensorView& t) {
  Tensor d = Tensor::empty(shape_of(t), t.dtype, kDev);
  if (t.nbytes() > 0) copy(d, t);
  return d;
}

inline void poison_dev(const Tensor& t) {
  if (t.nbytes() > 0) device_allocator(DeviceKind::cuda)->memset(t.data(), 0xFF, t.nbytes());
}

inline TensorView rows_2d(const Tensor& t, int64_t hidden, int64_t begin, int64_t end) {
  TensorView v(static_cast<char*>(t.data()) + begin * hidden * dtype_size(t.dtype()), t.dtype(), {end - begin, hidden});
  return v;
}

/// Compact activation rows: bf16 [rows, H], or fp8 [rows, H] + scales [rows, H/128] quantized on the CPU.
struct Rows {
  Tensor x, scales;
};

inline Rows random_rows(int64_t rows, int64_t hidden, DType dtype, uint64_t seed) {
  Rows r;
  Tensor b = test::random_bf16(std::max<int64_t>(rows, 1), hidden, seed);
  if (dtype == DType::bf16) {
    r.x = b;
    return r;
  }
  r.x = Tensor::empty({std::max<int64_t>(rows, 1), hidden}, DType::fp8_e4m3);
  r.scales = Tensor::empty({std::max<int64_t>(rows, 1), hidden / kFp8GroupSize}, DType::fp32);
  quantize_fp8_per_token_group(b, r.x, r.scales);
  return r;
}

/// Copies compact row `src` of `rows` to row `dst` of x (and its scales).
inline void place_row(const Rows& rows, int64_t src, const Tensor& x, const Tensor& scales, int64_t dst, int64_t hidden) {
  const int64_t xb = hidden * dtype_size(x.dtype());
  std::memcpy(static_cast<char*>(x.data()) + dst * xb, static_cast<const char*>(rows.x.data()) + src * xb, xb);
  if (scales.defined()) {
    const int64_t sb = hidden / kFp8GroupSize * 4;
    std::memcpy(static_cast<char*>(scales.data()) + dst * sb, static_cast<const char*>(rows.scales.data()) + src * sb, sb);
  }
}

inline std::string fmt_name(const std::vector<std::shared_ptr<const ExpertWeights>>& experts) {
  std::string s;
  for (const auto& e : experts) s += std::string(weight_format_name(e->format)) + "/I" + std::to_string(e->intermediate) + " ";
  return s;
}

/// Counts elements of a bf16 view that are not finite.
inline int64_t count_non_finite(const TensorView& t) {
  int64_t bad = 0;
  const uint16_t* p = t.ptr<const uint16_t>();
  for (int64_t i = 0; i < t.numel(); ++i) bad += !std::isfinite(bf16_bits_to_float(p[i]));
  return bad;
}

/// " got/want: ..." for the first row and column of each of a few rows, to read a failure's shape
/// (zeros, a scale factor, a transposition) from the log.
inline std::string sample(const TensorView& got, const TensorView& want, int64_t hidden) {
  std::string s = " got/want:";
  const int64_t rows = got.numel() / hidden;
  for (int64_t r : {int64_t{0}, rows / 2, rows - 1})
    for (int64_t c : {int64_t{0}, int64_t{1}, hidden / 2, hidden - 1}) {
      char buf[64];
      std::snprintf(buf, sizeof buf, " [%lld,%lld] %.4g/%.4g", static_cast<long long>(r), static_cast<long long>(c),
                    bf16_bits_to_float(got.ptr<const uint16_t>()[r * hidden + c]),
                    bf16_bits_to_float(want.ptr<const uint16_t>()[r * hidden + c]));
      s += buf;
    }
  return s;
}

struct EmResult {
  double max_rel_l2 = 0;
};

// A case is built once: its fresh random inputs on the host and the CPU experts' output on them (the reference,
// the expensive part at DeepSeek shapes), then checked against any number of CUDA Experts (variants of one test
// share the case, so the reference is not recomputed per variant). Each check copies the inputs to the device
// anew and NaN-poisons the device output before the run.

/// ExpertMajor case: x [L, cap, H] (dtype x_dtype; rows >= counts[l] NaN-poisoned), scales [L, cap, H/128] fp32
/// for FP8 x, recv_count [L] int32 = counts, and ref [L, cap, H] bf16 = the CPU experts' output (padding rows
/// left poisoned).
struct EmCase {
  std::vector<int32_t> counts;
  int64_t L = 0, H = 0, cap = 0;
  Tensor x, scales, recv, ref;
  std::string trace;
};

inline EmCase expert_major_case(Experts& cpu, const std::vector<int32_t>& counts, int64_t cap, DType x_dtype, uint64_t seed) {
  EmCase c;
  c.counts = counts, c.L = cpu.num_local_experts(), c.H = cpu.hidden(), c.cap = cap;
  const int64_t L = c.L, H = c.H;
  c.trace = "expert_major L=" + std::to_string(L) + " cap=" + std::to_string(cap) + " H=" + std::to_string(H) + " x=" +
            std::string(dtype_name(x_dtype)) + " seed=" + std::to_string(seed);
  SCOPED_TRACE(c.trace);
  int64_t total = 0;
  for (int32_t n : counts) total += n;
  const Rows rows = random_rows(total, H, x_dtype, seed);
  c.x = Tensor::empty({L, cap, H}, x_dtype);
  test::poison(c.x);
  if (x_dtype == DType::fp8_e4m3) {
    c.scales = Tensor::empty({L, cap, H / kFp8GroupSize}, DType::fp32);
    test::poison(c.scales);
  }
  c.recv = Tensor::empty({L}, DType::int32);
  for (int64_t l = 0, src = 0; l < L; ++l) {
    c.recv.ptr<int32_t>()[l] = counts[l];
    for (int64_t j = 0; j < counts[l]; ++j) place_row(rows, src++, c.x, c.scales, l * cap + j, H);
  }
  c.ref = Tensor::empty({L, cap, H}, DType::bf16);
  test::poison(c.ref);
  cpu.apply({ActivationLayout::ExpertMajor, c.x, c.scales, c.recv, {}, {}}, c.ref);
  return c;
}

/// Runs `gpu` on case c (out poisoned first) and checks every expert's valid rows against c.ref (all finite,
/// normwise relative L2 <= tol) and its padding rows unwritten (the poison byte for byte).
inline EmResult check_expert_major(Experts& gpu, const EmCase& c, double tol = kMaxRelL2, Stream stream = {}) {
  SCOPED_TRACE(c.trace);
  const int64_t L = c.L, H = c.H, cap = c.cap;
  const Tensor xd = to_dev(c.x), sd = c.scales.defined() ? to_dev(c.scales) : Tensor(), rd = to_dev(c.recv);
  Tensor out = Tensor::empty({L, cap, H}, DType::bf16, kDev);
  poison_dev(out);
  gpu.apply({ActivationLayout::ExpertMajor, xd, sd, rd, {}, {}}, out, stream);
  const Tensor oh = out.to(Device::cpu());  // synchronous copy: waits for the kernels

  EmResult res;
  for (int64_t l = 0; l < L; ++l) {
    if (c.counts[l] > 0) {
      const TensorView got = rows_2d(oh, H, l * cap, l * cap + c.counts[l]), want = rows_2d(c.ref, H, l * cap, l * cap + c.counts[l]);
      EXPECT_EQ(count_non_finite(got), 0) << "expert " << l << ": valid rows not written or not finite";
      const double e = test::rel_l2_error(got, want);
      EXPECT_LE(e, tol) << "expert " << l << " rows " << c.counts[l] << sample(got, want, H);
      res.max_rel_l2 = std::max(res.max_rel_l2, e);
    }
    // Rows >= recv_count are never written: the poison survives byte for byte.
    const uint16_t* pad = oh.ptr<const uint16_t>() + (l * cap + c.counts[l]) * H;
    int64_t touched = 0;
    for (int64_t i = 0; i < (cap - c.counts[l]) * H; ++i) touched += pad[i] != 0xFFFFu;
    EXPECT_EQ(touched, 0) << "expert " << l << ": padding rows were written";
  }
  return res;
}

/// ExpertMajor: x [L, cap, H] with rows >= counts[l] NaN-poisoned; out poisoned; CPU vs CUDA.
inline EmResult run_expert_major(Experts& cpu, Experts& gpu, const std::vector<int32_t>& counts, int64_t cap, DType x_dtype,
                          uint64_t seed, double tol = kMaxRelL2, Stream stream = {}) {
  return check_expert_major(gpu, expert_major_case(cpu, counts, cap, x_dtype, seed), tol, stream);
}

/// Contiguous case: x [N, H], the experts' rows packed in expert order (counts[l] rows each) after `head` NaN rows
/// and before `tail` NaN rows that belong to no expert; expert_offsets in the [L + 1] form (starts, then the end:
/// ht's ExpertContiguousLayout) when head > 0, else the [L] form (torch's offs); the same rows in ExpertMajor form
/// (xe [L, cap, H], recv = counts; cap = the largest count) for the byte-for-byte comparison; ref [N, H] bf16 = the
/// CPU experts' output.
struct ContigCase {
  std::vector<int32_t> counts;
  int64_t L = 0, H = 0, head = 0, total = 0, cap = 1, N = 0;
  Tensor x, scales, offs, xe, se, recv, ref;
  std::string trace;
};

inline ContigCase contiguous_case(Experts& cpu, const std::vector<int32_t>& counts, int64_t tail, DType x_dtype, uint64_t seed,
                           int64_t head = 0) {
  ContigCase c;
  c.counts = counts, c.L = cpu.num_local_experts(), c.H = cpu.hidden(), c.head = head;
  const int64_t L = c.L, H = c.H;
  c.trace = "contiguous L=" + std::to_string(L) + " head=" + std::to_string(head) + " tail=" + std::to_string(tail) +
            " H=" + std::to_string(H) + " x=" + std::string(dtype_name(x_dtype)) + " seed=" + std::to_string(seed);
  SCOPED_TRACE(c.trace);
  for (int32_t n : counts) c.total += n, c.cap = std::max<int64_t>(c.cap, n);
  const int64_t cap = c.cap, N = c.N = head + c.total + tail;
  const bool lead = head > 0;
  const Rows rows = random_rows(c.total, H, x_dtype, seed);
  c.x = Tensor::empty({N, H}, x_dtype);
  test::poison(c.x);
  if (x_dtype == DType::fp8_e4m3) {
    c.scales = Tensor::empty({N, H / kFp8GroupSize}, DType::fp32);
    test::poison(c.scales);
  }
  c.xe = Tensor::empty({L, cap, H}, x_dtype), c.recv = Tensor::empty({L}, DType::int32);
  test::poison(c.xe);
  if (x_dtype == DType::fp8_e4m3) {
    c.se = Tensor::empty({L, cap, H / kFp8GroupSize}, DType::fp32);
    test::poison(c.se);
  }
  c.offs = Tensor::empty({lead ? L + 1 : L}, DType::int32);
  if (lead) c.offs.ptr<int32_t>()[0] = static_cast<int32_t>(head);
  for (int64_t l = 0, src = 0; l < L; ++l) {
    c.recv.ptr<int32_t>()[l] = counts[l];
    for (int64_t j = 0; j < counts[l]; ++j, ++src) {
      place_row(rows, src, c.x, c.scales, head + src, H);
      place_row(rows, src, c.xe, c.se, l * cap + j, H);
    }
    c.offs.ptr<int32_t>()[lead ? l + 1 : l] = static_cast<int32_t>(head + src);
  }
  c.ref = Tensor::empty({N, H}, DType::bf16);
  test::poison(c.ref);
  ExpertsInput in;
  in.layout = ActivationLayout::Contiguous;
  in.x = c.x, in.x_scales = c.scales, in.expert_offsets = c.offs;
  cpu.apply(in, c.ref);
  return c;
}

/// Runs `gpu` on case c (outputs poisoned first) and checks the experts' rows against c.ref (all finite, normwise
/// relative L2 <= tol), byte for byte against the same rows through ExpertMajor on `gpu` (every output row depends
/// only on its input row and its expert, and both layouts tile an expert's rows from its first row), and the rows
/// outside every expert's range unwritten. Returns the relative L2 error.
inline double check_contiguous(Experts& gpu, const ContigCase& c, double tol = kMaxRelL2) {
  SCOPED_TRACE(c.trace);
  const int64_t L = c.L, H = c.H, head = c.head, total = c.total, cap = c.cap, N = c.N;
  const Tensor xd = to_dev(c.x), sd = c.scales.defined() ? to_dev(c.scales) : Tensor(), od = to_dev(c.offs);
  Tensor out = Tensor::empty({N, H}, DType::bf16, kDev);
  poison_dev(out);
  ExpertsInput ind;
  ind.layout = ActivationLayout::Contiguous;
  ind.x = xd, ind.x_scales = sd, ind.expert_offsets = od;
  gpu.apply(ind, out);
  const Tensor xed = to_dev(c.xe), sed = c.se.defined() ? to_dev(c.se) : Tensor(), rd = to_dev(c.recv);
  Tensor oute = Tensor::empty({L, cap, H}, DType::bf16, kDev);
  poison_dev(oute);
  gpu.apply({ActivationLayout::ExpertMajor, xed, sed, rd, {}, {}}, oute);
  const Tensor oh = out.to(Device::cpu()), oeh = oute.to(Device::cpu());

  double worst = 0;
  if (total > 0) {
    const TensorView got = rows_2d(oh, H, head, head + total), want = rows_2d(c.ref, H, head, head + total);
    EXPECT_EQ(count_non_finite(got), 0) << "expert rows not written or not finite";
    worst = test::rel_l2_error(got, want);
    EXPECT_LE(worst, tol) << sample(got, want, H);
  }
  int64_t differ = 0, touched = 0;
  for (int64_t l = 0, r = head; l < L; ++l)
    for (int64_t j = 0; j < c.counts[l]; ++j, ++r)
      differ += std::memcmp(oh.ptr<const uint16_t>() + r * H, oeh.ptr<const uint16_t>() + (l * cap + j) * H, H * 2) != 0;
  EXPECT_EQ(differ, 0) << "rows that differ from the same rows through expert_major";
  for (int64_t i = 0; i < N * H; ++i)
    touched += (i < head * H || i >= (head + total) * H) && oh.ptr<const uint16_t>()[i] != 0xFFFFu;
  EXPECT_EQ(touched, 0) << "rows outside every expert's range were written";
  return worst;
}

/// Contiguous: builds the case (contiguous_case) and checks `gpu` on it (check_contiguous).
inline double run_contiguous(Experts& cpu, Experts& gpu, const std::vector<int32_t>& counts, int64_t tail, DType x_dtype,
                      uint64_t seed, double tol = kMaxRelL2, int64_t head = 0) {
  return check_contiguous(gpu, contiguous_case(cpu, counts, tail, x_dtype, seed, head), tol);
}

struct FlatOptions {
  double masked = 0.3;
  bool duplicates = true;
  bool int64_idx = false;
  double tol = kMaxRelL2;  ///< normwise and worst-row bound
};

/// Flat case: x [N, H] (+ scales [N, H/128] fp32 for FP8 x), topk_idx [N, K] (int32, or int64 with
/// opt.int64_idx) local or -1, topk_weights [N, K] fp32 NaN at -1, x rows without a local selection NaN;
/// ref [N, H] bf16 = the CPU experts' output.
struct FlatCase {
  int64_t N = 0, H = 0;
  Tensor x, scales, idx, weights, ref;
  std::vector<bool> has_local;
  std::string trace;
};

inline FlatCase flat_case(Experts& cpu, int64_t N, int K, DType x_dtype, uint64_t seed, const FlatOptions& opt = {}) {
  FlatCase c;
  const int64_t L = cpu.num_local_experts(), H = cpu.hidden();
  c.N = N, c.H = H;
  c.trace = "flat L=" + std::to_string(L) + " N=" + std::to_string(N) + " K=" + std::to_string(K) + " H=" + std::to_string(H) +
            " x=" + std::string(dtype_name(x_dtype)) + (opt.int64_idx ? " idx=int64" : "") + " seed=" + std::to_string(seed);
  SCOPED_TRACE(c.trace);
  Tensor idx32;
  test::random_routing(N, K, static_cast<int>(L), seed, {.masked_fraction = opt.masked, .allow_duplicates = opt.duplicates},
                       idx32, c.weights);
  const Rows rows = random_rows(N, H, x_dtype, seed + 1);
  c.x = rows.x, c.scales = rows.scales;
  if (N == 0) {
    c.x = Tensor::empty({0, H}, x_dtype);
    if (x_dtype == DType::fp8_e4m3) c.scales = Tensor::empty({0, H / kFp8GroupSize}, DType::fp32);
  }
  c.has_local.assign(static_cast<size_t>(N), false);
  for (int64_t n = 0; n < N; ++n) {
    for (int k = 0; k < K; ++k) {
      if (idx32.ptr<int32_t>()[n * K + k] >= 0) c.has_local[n] = true;
      else c.weights.ptr<float>()[n * K + k] = std::nanf("");  // must never be read
    }
    if (!c.has_local[n]) {  // such rows must never be read either
      std::memset(static_cast<char*>(c.x.data()) + n * H * dtype_size(x_dtype), 0xFF, H * dtype_size(x_dtype));
      if (c.scales.defined()) std::memset(c.scales.ptr<float>() + n * (H / kFp8GroupSize), 0xFF, H / kFp8GroupSize * 4);
    }
  }
  c.idx = idx32;
  if (opt.int64_idx) {
    c.idx = Tensor::empty({N, K}, DType::int64);
    for (int64_t i = 0; i < N * K; ++i) c.idx.ptr<int64_t>()[i] = idx32.ptr<int32_t>()[i];
  }
  c.ref = Tensor::empty({N, H}, DType::bf16);
  cpu.apply({ActivationLayout::Flat, c.x, c.scales, {}, c.idx, c.weights}, c.ref);
  return c;
}

/// Runs `gpu` on case c (out poisoned first) and checks every row finite, the rows without a local selection exact
/// zeros, and the normwise and worst-row relative L2 against c.ref <= tol. Then again with an fp32 out (the
/// unrounded partial that a Flat combine with flat_combine partial_fp32 takes): every element rounded to bf16
/// equals the bf16 call's, bit for bit. Returns the normwise error.
inline double check_flat(Experts& gpu, const FlatCase& c, double tol = kMaxRelL2) {
  SCOPED_TRACE(c.trace);
  const int64_t N = c.N, H = c.H;
  const Tensor xd = to_dev(c.x), sd = c.scales.defined() ? to_dev(c.scales) : Tensor(), id = to_dev(c.idx), wd = to_dev(c.weights);
  Tensor out = Tensor::empty({N, H}, DType::bf16, kDev);
  poison_dev(out);
  gpu.apply({ActivationLayout::Flat, xd, sd, {}, id, wd}, out);
  const Tensor oh = out.to(Device::cpu());
  if (N == 0) return 0.0;

  EXPECT_EQ(count_non_finite(oh), 0) << "rows not written or not finite";
  int64_t nonzero_empty = 0;
  for (int64_t n = 0; n < N; ++n)
    if (!c.has_local[n])
      for (int64_t i = 0; i < H; ++i) nonzero_empty += oh.ptr<const uint16_t>()[n * H + i] != 0;
  EXPECT_EQ(nonzero_empty, 0) << "rows without a local selection must be exact zeros";
  double worst_row = 0;
  for (int64_t n = 0; n < N; ++n)
    if (c.has_local[n]) worst_row = std::max(worst_row, test::rel_l2_error(rows_2d(oh, H, n, n + 1), rows_2d(c.ref, H, n, n + 1)));
  const double e = test::rel_l2_error(oh, c.ref);
  EXPECT_LE(e, tol) << sample(oh, c.ref, H);
  EXPECT_LE(worst_row, tol) << "worst single row";
  Tensor out32 = Tensor::empty({N, H}, DType::fp32, kDev);
  poison_dev(out32);
  gpu.apply({ActivationLayout::Flat, xd, sd, {}, id, wd}, out32);
  const Tensor o32 = out32.to(Device::cpu());
  int64_t differ = 0, first = -1;
  for (int64_t i = 0; i < N * H; ++i)
    if (float_to_bf16_bits(o32.ptr<const float>()[i]) != oh.ptr<const uint16_t>()[i]) differ += 1, first = first < 0 ? i : first;
  EXPECT_EQ(differ, 0) << "fp32 out rounded differs from the bf16 out, first at element " << first;
  return e;
}

/// Flat: builds the case (flat_case) and checks `gpu` on it (check_flat, opt.tol).
inline double run_flat(Experts& cpu, Experts& gpu, int64_t N, int K, DType x_dtype, uint64_t seed, const FlatOptions& opt = {}) {
  return check_flat(gpu, flat_case(cpu, N, K, x_dtype, seed, opt), opt.tol);
}

inline std::vector<std::shared_ptr<const ExpertWeights>> same_format(WeightFormat f, int L, int64_t H, int64_t I, uint64_t seed) {
  std::vector<std::shared_ptr<const ExpertWeights>> e;
  for (int l = 0; l < L; ++l) e.push_back(ExpertWeights::random(f, H, I, seed + l));
  return e;
}

}  // namespace
}  // namespace epx
