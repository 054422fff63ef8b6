// The CPU expert MLP against a naive float64 loop written here, and the CPU Experts backend (both
// layouts) against per-row expert_mlp_cpu, on random data with poisoned padding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "epx/error.h"
#include "epx/experts.h"
#include "epx/quant.h"
#include "experts/mxfp4_bits.h"
#include "test_util.h"

using namespace epx;

namespace {

constexpr WeightFormat kFormats[] = {WeightFormat::bf16, WeightFormat::fp8_block, WeightFormat::mxfp4};

/// Naive float64 SwiGLU on the dequantized weights. The intermediate h gets the format's documented
/// rounding (bf16, or FP8 1x128 for fp8_block) so the comparison isolates the GEMM and wiring; the
/// output is not rounded (rel L2 then carries the bf16 rounding of y, about 1e-3).
std::vector<float> reference_mlp(const ExpertWeights& w, const float* x, int64_t rows, bool round_h = true) {
  const int64_t H = w.hidden, I = w.intermediate;
  const float* w13 = w.w13_f32();
  const float* w2 = w.w2_f32();
  std::vector<float> y(static_cast<size_t>(rows * H)), h(static_cast<size_t>(I));
  std::vector<uint8_t> hq(static_cast<size_t>(I));
  std::vector<float> hs(static_cast<size_t>(I / 128 + 1));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * H;
    for (int64_t i = 0; i < I; ++i) {
      double g = 0, u = 0;
      for (int64_t k = 0; k < H; ++k) {
        g += static_cast<double>(xr[k]) * w13[i * H + k];
        u += static_cast<double>(xr[k]) * w13[(I + i) * H + k];
      }
      h[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * u);
    }
    if (!round_h) {
      // h stays as computed (float64 rounded to fp32 once)
    } else if (w.format == WeightFormat::fp8_block) {
      quantize_fp8_row(h.data(), I, hq.data(), hs.data(), 128, false);
      dequantize_fp8_row(hq.data(), hs.data(), I, h.data(), 128);
    } else {
      for (float& v : h) v = round_bf16(v);
    }
    for (int64_t j = 0; j < H; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < I; ++i) acc += static_cast<double>(h[i]) * w2[j * I + i];
      y[r * H + j] = static_cast<float>(acc);
    }
  }
  return y;
}

TensorView f32_view(std::vector<float>& v, int64_t rows, int64_t cols) { return TensorView(v.data(), DType::fp32, {rows, cols}); }

bool all_bf16_values(const std::vector<float>& v) {
  for (float f : v)
    if (round_bf16(f) != f) return false;
  return true;
}

/// Three local experts of different formats and widths (the FHMoE case: a shared expert in
/// another format next to the routed ones), all with hidden H.
std::vector<std::shared_ptr<const ExpertWeights>> mixed_experts(int64_t H, uint64_t seed) {
  return {ExpertWeights::random(WeightFormat::bf16, H, 128, seed), ExpertWeights::random(WeightFormat::fp8_block, H, 256, seed + 1),
          ExpertWeights::random(WeightFormat::mxfp4, H, 64, seed + 2)};
}

/// expert_mlp_cpu of one row of bf16 x.
std::vector<float> mlp_row(const ExpertWeights& w, const uint16_t* x_row) {
  std::vector<float> xf(static_cast<size_t>(w.hidden)), y(static_cast<size_t>(w.hidden));
  for (int64_t i = 0; i < w.hidden; ++i) xf[i] = bf16_bits_to_float(x_row[i]);
  expert_mlp_cpu(w, xf.data(), 1, y.data());
  return y;
}

}  // namespace

// ---- weights ---------------------------------------------------------------------------------

TEST(ExpertWeights, Mxfp4DecodeBits) {
  // The MXFP4 decode path's conversions (experts/mxfp4_bits.h), exhaustively: every e2m1 code in
  // every nibble position maps to the e4m3 byte of e2m1 * 2^-6 (exact), and every e8m0 byte in every
  // byte position to e8m0_bits_to_float, with the special-byte check exact (00 and FF only).
  for (uint32_t c = 0; c < 16; ++c) {
    for (int j = 0; j < 4; ++j) {
      const uint32_t even = c << (8 * j), odd = c << (8 * j + 4);
      const float want = std::ldexp(fp4_e2m1_bits_to_float(static_cast<uint8_t>(c)), -6);
      const uint32_t be = experts_cuda::e2m1_even_e4m3(even | (0xFu << (8 * j + 4)));  // the odd neighbour set
      const uint32_t bo = experts_cuda::e2m1_odd_e4m3(odd | (0xFu << (8 * j)));
      EXPECT_EQ(f32_bits(fp8_e4m3_bits_to_float(static_cast<uint8_t>(be >> (8 * j)))), f32_bits(want)) << "even code " << c << " byte " << j;
      EXPECT_EQ(f32_bits(fp8_e4m3_bits_to_float(static_cast<uint8_t>(bo >> (8 * j)))), f32_bits(want)) << "odd code " << c << " byte " << j;
      EXPECT_EQ(be & ~(0xFFu << (8 * j)), experts_cuda::e2m1_even_e4m3(0xFu << (8 * j + 4)) & ~(0xFFu << (8 * j))) << "other bytes";
    }
  }
  for (uint32_t e = 0; e < 256; ++e) {
    for (int b = 0; b < 4; ++b) {
      const uint32_t word = (e << (8 * b)) | (0x7F7F7F7Fu & ~(0xFFu << (8 * b)));  // byte b = e, the others 2^0
      const bool special = experts_cuda::e8m0_special(word);
      EXPECT_EQ(special, e == 0 || e == 255) << "byte " << e << " at " << b;
      const float got = experts_cuda::e8m0_of(word, b, special), want = e8m0_bits_to_float(static_cast<uint8_t>(e));
      if (e == 255) {
        EXPECT_TRUE(std::isnan(got));
      } else {
        EXPECT_EQ(f32_bits(got), f32_bits(want)) << "byte " << e << " at " << b;
      }
      if (!special) {
        EXPECT_EQ(f32_bits(experts_cuda::e8m0_of(word, b, true)), f32_bits(got)) << "fast and exact paths agree";
      }
    }
  }
}

TEST(ExpertWeights, FormatNamesRoundTrip) {
  for (WeightFormat f : kFormats) EXPECT_EQ(parse_weight_format(weight_format_name(f)), f);
  EXPECT_THROW(parse_weight_format("int4"), InvalidArgument);
  EXPECT_EQ(layout_name(ActivationLayout::ExpertMajor), "expert_major");
  EXPECT_EQ(layout_name(ActivationLayout::Flat), "flat");
}

TEST(ExpertWeights, FromFloatStorageAndDequantizedCache) {
  const int64_t H = 256, I = 128;
  Tensor gate_up = test::random_f32(2 * I, H, 1, 0.0625f), down = test::random_f32(H, I, 2, 0.09f);
  const double max_err[] = {4e-3, 0.04, 0.25};  // bf16, fp8 e4m3 blocks, mxfp4
  for (WeightFormat f : kFormats) {
    auto w = ExpertWeights::from_float(f, gate_up, down);
    EXPECT_EQ(w->hidden, H);
    EXPECT_EQ(w->intermediate, I);
    Tensor w13(Tensor::empty({2 * I, H}, DType::fp32)), w2(Tensor::empty({H, I}, DType::fp32));
    std::memcpy(w13.data(), w->w13_f32(), w13.nbytes());
    std::memcpy(w2.data(), w->w2_f32(), w2.nbytes());
    const double e13 = test::rel_l2_error(w13, gate_up), e2 = test::rel_l2_error(w2, down);
    EXPECT_LT(e13, max_err[static_cast<int>(f)]) << weight_format_name(f);
    EXPECT_LT(e2, max_err[static_cast<int>(f)]) << weight_format_name(f);
    EXPECT_GT(e13, 0.0) << weight_format_name(f);
    switch (f) {
      case WeightFormat::bf16:
        EXPECT_EQ(w->w13.dtype(), DType::bf16);
        EXPECT_FALSE(w->w13_scale.defined());
        for (int64_t i = 0; i < w13.numel(); ++i) ASSERT_EQ(w13.ptr<float>()[i], round_bf16(gate_up.ptr<float>()[i]));
        break;
      case WeightFormat::fp8_block:
        EXPECT_EQ(w->w13.dtype(), DType::fp8_e4m3);
        EXPECT_EQ(w->w13_scale.size(0), 2 * I / 128);
        EXPECT_EQ(w->w13_scale.size(1), H / 128);
        EXPECT_EQ(w->w2_scale.size(0), H / 128);
        EXPECT_EQ(w->w2_scale.size(1), I / 128);
        break;
      case WeightFormat::mxfp4:
        EXPECT_EQ(w->w13.dtype(), DType::fp4_e2m1x2);
        EXPECT_EQ(w->w13.size(1), H / 2);
        EXPECT_EQ(w->w13_scale.dtype(), DType::e8m0);
        EXPECT_EQ(w->w13_scale.size(1), H / 32);
        EXPECT_EQ(w->w2.size(1), I / 2);
        EXPECT_EQ(w->w2_scale.size(1), I / 32);
        break;
    }
    EXPECT_EQ(w->w13_f32(), w->w13_f32());  // built once
  }
}

TEST(ExpertWeights, BadShapesThrow) {
  Tensor gu = test::random_f32(2 * 96, 256, 1), dn = test::random_f32(256, 96, 2);
  EXPECT_NO_THROW(ExpertWeights::from_float(WeightFormat::bf16, gu, dn));
  EXPECT_NO_THROW(ExpertWeights::from_float(WeightFormat::mxfp4, gu, dn));
  EXPECT_THROW(ExpertWeights::from_float(WeightFormat::fp8_block, gu, dn), InvalidArgument);  // I = 96
  Tensor gu48 = test::random_f32(2 * 64, 48, 1), dn48 = test::random_f32(48, 64, 2);
  EXPECT_THROW(ExpertWeights::from_float(WeightFormat::mxfp4, gu48, dn48), InvalidArgument);  // H = 48
  EXPECT_THROW(ExpertWeights::from_float(WeightFormat::bf16, gu, test::random_f32(256, 64, 2)), InvalidArgument);
  EXPECT_THROW(ExpertWeights::from_float(WeightFormat::bf16, test::random_f32(3, 256, 1), dn), InvalidArgument);
  EXPECT_THROW(ExpertWeights::random(WeightFormat::bf16, 0, 64, 1), InvalidArgument);
}

TEST(ExpertWeights, RandomIsDeterministicWithFanInVariance) {
  const int64_t H = 512, I = 256;
  auto a = ExpertWeights::random(WeightFormat::bf16, H, I, 42);
  auto b = ExpertWeights::random(WeightFormat::bf16, H, I, 42);
  auto c = ExpertWeights::random(WeightFormat::bf16, H, I, 43);
  EXPECT_EQ(std::memcmp(a->w13.data(), b->w13.data(), a->w13.nbytes()), 0);
  EXPECT_EQ(std::memcmp(a->w2.data(), b->w2.data(), a->w2.nbytes()), 0);
  EXPECT_NE(std::memcmp(a->w13.data(), c->w13.data(), a->w13.nbytes()), 0);
  auto moments = [](const float* p, int64_t n, double& mean, double& var) {
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < n; ++i) {
      s += p[i];
      s2 += static_cast<double>(p[i]) * p[i];
    }
    mean = s / n;
    var = s2 / n - mean * mean;
  };
  double mean, var;
  moments(a->w13_f32(), 2 * I * H, mean, var);
  EXPECT_NEAR(var * H, 1.0, 0.02);
  EXPECT_NEAR(mean, 0.0, 3.0 / std::sqrt(2.0 * I * H) / std::sqrt(H));
  moments(a->w2_f32(), H * I, mean, var);
  EXPECT_NEAR(var * I, 1.0, 0.02);
  // Other formats quantize the same underlying values.
  auto q = ExpertWeights::random(WeightFormat::fp8_block, H, I, 42);
  Tensor x(Tensor::empty({2 * I, H}, DType::fp32)), y(Tensor::empty({2 * I, H}, DType::fp32));
  std::memcpy(x.data(), q->w13_f32(), x.nbytes());
  std::memcpy(y.data(), a->w13_f32(), y.nbytes());
  EXPECT_LT(test::rel_l2_error(x, y), 0.04);
}

TEST(ExpertWeights, DequantizedCacheIsBuiltOnceAcrossThreads) {
  auto w = ExpertWeights::random(WeightFormat::mxfp4, 256, 128, 9);
  std::vector<const float*> seen(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { seen[t] = (t % 2) ? w->w2_f32() : w->w13_f32(); });
  for (auto& th : threads) th.join();
  EXPECT_EQ(seen[0], seen[2]);
  EXPECT_EQ(seen[1], seen[3]);
  EXPECT_EQ(seen[0], w->w13_f32());
  EXPECT_EQ(seen[1], w->w2_f32());
}

// ---- one expert ------------------------------------------------------------------------------

TEST(ExpertMlpCpu, MatchesFloat64ReferenceAllFormats) {
  const int64_t H = 256, I = 256;
  for (WeightFormat f : kFormats) {
    for (int64_t rows : {1, 37, 600}) {  // 600 > the 512-row GEMM block
      auto w = ExpertWeights::random(f, H, I, 100 + rows);
      Tensor x = test::random_f32(rows, H, 200 + rows, 1.0f);
      std::vector<float> y(static_cast<size_t>(rows * H), std::numeric_limits<float>::quiet_NaN());
      expert_mlp_cpu(*w, x.ptr<float>(), rows, y.data());
      std::vector<float> ref = reference_mlp(*w, x.ptr<float>(), rows);
      const double err = test::rel_l2_error(f32_view(y, rows, H), f32_view(ref, rows, H));
      EXPECT_LT(err, 1e-2) << weight_format_name(f) << " rows=" << rows;
      EXPECT_TRUE(all_bf16_values(y)) << "output must hold bf16 values";
    }
  }
}

TEST(ExpertMlpCpu, Fp8BlockQuantizesTheIntermediate) {
  // Against a reference that keeps h unrounded the error is that of e4m3 (~2-3%), far above the
  // 1e-2 the matching reference meets: the documented FP8 intermediate is really applied.
  const int64_t H = 256, I = 256, rows = 64;
  auto w = ExpertWeights::random(WeightFormat::fp8_block, H, I, 5);
  Tensor x = test::random_f32(rows, H, 6);
  std::vector<float> y(static_cast<size_t>(rows * H));
  expert_mlp_cpu(*w, x.ptr<float>(), rows, y.data());
  std::vector<float> ref_fp8 = reference_mlp(*w, x.ptr<float>(), rows);
  std::vector<float> ref_exact = reference_mlp(*w, x.ptr<float>(), rows, /*round_h=*/false);
  EXPECT_LT(test::rel_l2_error(f32_view(y, rows, H), f32_view(ref_fp8, rows, H)), 1e-2);
  EXPECT_GT(test::rel_l2_error(f32_view(y, rows, H), f32_view(ref_exact, rows, H)), 1e-2);
}

TEST(ExpertMlpCpu, ZeroRowsWritesNothing) {
  auto w = ExpertWeights::random(WeightFormat::bf16, 128, 64, 1);
  float sentinel = 123.0f;
  EXPECT_NO_THROW(expert_mlp_cpu(*w, nullptr, 0, &sentinel));
  EXPECT_EQ(sentinel, 123.0f);
  EXPECT_THROW(expert_mlp_cpu(*w, nullptr, -1, &sentinel), InvalidArgument);
}

// ---- Experts: expert-major -------------------------------------------------------------------

TEST(ExpertsCpu, ExpertMajorMatchesPerRowAndLeavesPaddingAlone) {
  const int64_t H = 256, cap = 40;
  for (bool mixed : {false, true}) {
    for (WeightFormat f : kFormats) {
      if (mixed && f != WeightFormat::bf16) continue;
      auto local = mixed ? mixed_experts(H, 70) : std::vector<std::shared_ptr<const ExpertWeights>>{
                                                      ExpertWeights::random(f, H, 128, 1), ExpertWeights::random(f, H, 128, 2),
                                                      ExpertWeights::random(f, H, 128, 3)};
      auto experts = make_experts_cpu(local);
      EXPECT_EQ(experts->num_local_experts(), 3);
      EXPECT_EQ(experts->hidden(), H);
      EXPECT_TRUE(experts->supports(ActivationLayout::ExpertMajor));
      const int32_t counts[3] = {17, 0, 40};
      Tensor x = test::random_bf16(3 * cap, H, 8);
      TensorView xv(x.data(), DType::bf16, {3, cap, H});
      for (int l = 0; l < 3; ++l)  // NaN in every padding row
        test::poison(TensorView(x.ptr<uint16_t>() + (l * cap + counts[l]) * H, DType::bf16, {cap - counts[l], H}));
      Tensor rc = Tensor::empty({3}, DType::int32);
      std::memcpy(rc.data(), counts, sizeof(counts));
      Tensor out = Tensor::empty({3, cap, H}, DType::bf16);
      std::memset(out.data(), 0xab, out.nbytes());  // sentinel: must survive in padding rows
      ExpertsInput in;
      in.layout = ActivationLayout::ExpertMajor;
      in.x = xv;
      in.recv_count = rc;
      experts->apply(in, out);
      for (int l = 0; l < 3; ++l) {
        for (int64_t j = 0; j < cap; ++j) {
          const uint16_t* o = out.ptr<uint16_t>() + (l * cap + j) * H;
          if (j >= counts[l]) {
            for (int64_t i = 0; i < H; ++i) ASSERT_EQ(o[i], 0xabab) << "padding row written: l=" << l << " j=" << j;
            continue;
          }
          std::vector<float> want = mlp_row(*local[l], x.ptr<uint16_t>() + (l * cap + j) * H);
          std::vector<float> got(static_cast<size_t>(H));
          for (int64_t i = 0; i < H; ++i) got[i] = bf16_bits_to_float(o[i]);
          ASSERT_LT(test::rel_l2_error(f32_view(got, 1, H), f32_view(want, 1, H)), 1e-2) << "l=" << l << " j=" << j;
        }
        // The batched rows also match the float64 reference.
        if (counts[l] == 0) continue;
        std::vector<float> xf(static_cast<size_t>(counts[l] * H)), got(xf.size());
        for (int64_t i = 0; i < counts[l] * H; ++i) {
          xf[i] = bf16_bits_to_float(x.ptr<uint16_t>()[l * cap * H + i]);
          got[i] = bf16_bits_to_float(out.ptr<uint16_t>()[l * cap * H + i]);
        }
        std::vector<float> ref = reference_mlp(*local[l], xf.data(), counts[l]);
        EXPECT_LT(test::rel_l2_error(f32_view(got, counts[l], H), f32_view(ref, counts[l], H)), 1e-2);
      }
    }
  }
}

TEST(ExpertsCpu, ExpertMajorFp8InputEqualsDequantizedBf16Path) {
  const int64_t H = 256, cap = 24;
  auto local = mixed_experts(H, 90);
  auto experts = make_experts_cpu(local);
  Tensor x = test::random_bf16(3 * cap, H, 4, 2.0f);
  Tensor q = Tensor::empty({3 * cap, H}, DType::fp8_e4m3), s = Tensor::empty({3 * cap, H / 128}, DType::fp32);
  quantize_fp8_per_token_group(x, q, s);
  Tensor deq32 = Tensor::empty({3 * cap, H}, DType::fp32);  // fp8 * scale need not be a bf16 value
  dequantize_fp8_per_token_group(q, s, deq32);
  const int32_t counts[3] = {24, 5, 0};
  Tensor rc = Tensor::empty({3}, DType::int32);
  std::memcpy(rc.data(), counts, sizeof(counts));
  Tensor out = Tensor::empty({3, cap, H}, DType::bf16);
  test::poison(out);
  ExpertsInput in;
  in.layout = ActivationLayout::ExpertMajor;
  in.x = TensorView(q.data(), DType::fp8_e4m3, {3, cap, H});
  in.x_scales = TensorView(s.data(), DType::fp32, {3, cap, H / 128});
  in.recv_count = rc;
  experts->apply(in, out);
  for (int l = 0; l < 3; ++l) {
    if (counts[l] == 0) continue;
    std::vector<float> y(static_cast<size_t>(counts[l] * H));
    expert_mlp_cpu(*local[l], deq32.ptr<float>() + l * cap * H, counts[l], y.data());  // same batch: bit-exact
    for (int64_t i = 0; i < counts[l] * H; ++i)
      ASSERT_EQ(out.ptr<uint16_t>()[l * cap * H + i], float_to_bf16_bits(y[i])) << "l=" << l << " i=" << i;
  }
  in.x_scales = TensorView();  // fp8 without scales
  EXPECT_THROW(experts->apply(in, out), InvalidArgument);
}

TEST(ExpertsCpu, ExpertMajorZeroTokensAndBadArguments) {
  const int64_t H = 128, cap = 8;
  auto experts = make_experts_cpu({ExpertWeights::random(WeightFormat::bf16, H, 64, 1), ExpertWeights::random(WeightFormat::bf16, H, 64, 2)});
  Tensor x = Tensor::empty({2, cap, H}, DType::bf16);
  test::poison(x);
  Tensor rc = Tensor::zeros({2}, DType::int32);
  Tensor out = Tensor::empty({2, cap, H}, DType::bf16);
  std::memset(out.data(), 0x5a, out.nbytes());
  ExpertsInput in{ActivationLayout::ExpertMajor, x, {}, rc, {}, {}};
  experts->apply(in, out);
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.ptr<uint16_t>()[i], 0x5a5a);
  rc.ptr<int32_t>()[1] = cap + 1;
  EXPECT_THROW(experts->apply(in, out), InvalidArgument);  // recv_count > cap
  rc.ptr<int32_t>()[1] = -1;
  EXPECT_THROW(experts->apply(in, out), InvalidArgument);
  rc.ptr<int32_t>()[1] = 0;
  EXPECT_THROW(experts->apply(in, Tensor::empty({2, cap, H}, DType::fp32)), InvalidArgument);
  EXPECT_THROW(experts->apply(in, Tensor::empty({3, cap, H}, DType::bf16)), InvalidArgument);
  Tensor x3 = Tensor::empty({3, cap, H}, DType::bf16);  // L = 3 != 2 local experts
  EXPECT_THROW(experts->apply({ActivationLayout::ExpertMajor, x3, {}, rc, {}, {}}, out), InvalidArgument);
  EXPECT_THROW(make_experts_cpu({}), InvalidArgument);
  EXPECT_THROW(make_experts_cpu({ExpertWeights::random(WeightFormat::bf16, H, 64, 1), nullptr}), InvalidArgument);
  EXPECT_THROW(make_experts_cpu({ExpertWeights::random(WeightFormat::bf16, H, 64, 1),
                                 ExpertWeights::random(WeightFormat::bf16, 2 * H, 64, 1)}),
               InvalidArgument);
}

// ---- Experts: contiguous ---------------------------------------------------------------------

TEST(ExpertsCpu, ContiguousEqualsExpertMajorRowForRowAndLeavesTheTailAlone) {
  const int64_t H = 256, cap = 40;
  const int32_t counts[3] = {17, 0, 40};
  const int32_t ends[3] = {17, 17, 57};
  const int64_t N = 62;  // 5 tail rows that belong to no expert
  for (bool use_fp8 : {false, true}) {
    auto local = mixed_experts(H, use_fp8 ? 510 : 500);
    auto experts = make_experts_cpu(local);
    EXPECT_TRUE(experts->supports(ActivationLayout::Contiguous));
    // The same rows in both layouts: contiguous row ends[l-1] + j = ExpertMajor row l * cap + j.
    Tensor xc = test::random_bf16(N, H, 31, 2.0f);
    test::poison(TensorView(xc.ptr<uint16_t>() + ends[2] * H, DType::bf16, {N - ends[2], H}));  // NaN tail
    Tensor xe = Tensor::empty({3 * cap, H}, DType::bf16);
    test::poison(xe);
    for (int l = 0, begin = 0; l < 3; begin = ends[l++])
      std::memcpy(xe.ptr<uint16_t>() + l * cap * H, xc.ptr<uint16_t>() + begin * H, static_cast<size_t>(counts[l] * H * 2));
    ExpertsInput ic, ie;
    Tensor qc, sc, qe, se;
    if (use_fp8) {
      qc = Tensor::empty({N, H}, DType::fp8_e4m3), sc = Tensor::empty({N, H / 128}, DType::fp32);
      qe = Tensor::empty({3 * cap, H}, DType::fp8_e4m3), se = Tensor::empty({3 * cap, H / 128}, DType::fp32);
      quantize_fp8_per_token_group(xc, qc, sc);
      quantize_fp8_per_token_group(xe, qe, se);
      ic.x = qc, ic.x_scales = sc;
      ie.x = TensorView(qe.data(), DType::fp8_e4m3, {3, cap, H});
      ie.x_scales = TensorView(se.data(), DType::fp32, {3, cap, H / 128});
    } else {
      ic.x = xc;
      ie.x = TensorView(xe.data(), DType::bf16, {3, cap, H});
    }
    Tensor offs = Tensor::empty({3}, DType::int32), rc = Tensor::empty({3}, DType::int32);
    std::memcpy(offs.data(), ends, sizeof(ends));
    std::memcpy(rc.data(), counts, sizeof(counts));
    ic.layout = ActivationLayout::Contiguous;
    ic.expert_offsets = offs;
    ie.layout = ActivationLayout::ExpertMajor;
    ie.recv_count = rc;
    Tensor oc = Tensor::empty({N, H}, DType::bf16), oe = Tensor::empty({3, cap, H}, DType::bf16);
    std::memset(oc.data(), 0xab, oc.nbytes());  // sentinel: must survive in the tail rows
    test::poison(oe);
    experts->apply(ic, oc);
    experts->apply(ie, oe);
    for (int l = 0, begin = 0; l < 3; begin = ends[l++])
      for (int64_t i = 0; i < counts[l] * H; ++i)  // same rows in the same sgemm batches: the same bits
        ASSERT_EQ(oc.ptr<uint16_t>()[begin * H + i], oe.ptr<uint16_t>()[l * cap * H + i]) << "l=" << l << " i=" << i;
    for (int64_t i = ends[2] * H; i < N * H; ++i) ASSERT_EQ(oc.ptr<uint16_t>()[i], 0xabab) << "tail row written: i=" << i;
    // The [L + 1] form of the same ranges (ht's ExpertContiguousLayout::expert_offsets) gives the same bytes.
    Tensor offs_l1 = Tensor::empty({4}, DType::int32), oc2 = Tensor::empty({N, H}, DType::bf16);
    const int32_t starts[4] = {0, ends[0], ends[1], ends[2]};
    std::memcpy(offs_l1.data(), starts, sizeof(starts));
    std::memset(oc2.data(), 0xab, oc2.nbytes());
    ic.expert_offsets = offs_l1;
    experts->apply(ic, oc2);
    ASSERT_EQ(std::memcmp(oc.data(), oc2.data(), static_cast<size_t>(oc.nbytes())), 0);
    // And against the float64 reference, expert 2's rows.
    std::vector<float> xf(static_cast<size_t>(counts[2] * H)), got(xf.size());
    for (int64_t i = 0; i < counts[2] * H; ++i) {
      xf[i] = use_fp8 ? fp8_e4m3_bits_to_float(qc.ptr<uint8_t>()[ends[1] * H + i]) * sc.ptr<float>()[(ends[1] * H + i) / 128]
                      : bf16_bits_to_float(xc.ptr<uint16_t>()[ends[1] * H + i]);
      got[i] = bf16_bits_to_float(oc.ptr<uint16_t>()[ends[1] * H + i]);
    }
    std::vector<float> ref = reference_mlp(*local[2], xf.data(), counts[2]);
    EXPECT_LT(test::rel_l2_error(f32_view(got, counts[2], H), f32_view(ref, counts[2], H)), 1e-2);
  }
}

TEST(ExpertsCpu, ContiguousBadOffsetsAreNamedAndNothingIsWritten) {
  const int64_t H = 128, N = 10;
  auto experts = make_experts_cpu({ExpertWeights::random(WeightFormat::bf16, H, 64, 1), ExpertWeights::random(WeightFormat::bf16, H, 64, 2)});
  Tensor x = test::random_bf16(N, H, 3);
  Tensor offs = Tensor::empty({2}, DType::int32);
  Tensor out = Tensor::empty({N, H}, DType::bf16);
  std::memset(out.data(), 0x5a, out.nbytes());
  ExpertsInput in;
  in.layout = ActivationLayout::Contiguous;
  in.x = x;
  in.expert_offsets = offs;
  auto expect_error = [&](int32_t e0, int32_t e1, const std::string& what) {
    offs.ptr<int32_t>()[0] = e0, offs.ptr<int32_t>()[1] = e1;
    try {
      experts->apply(in, out);
      ADD_FAILURE() << "no error for offsets {" << e0 << ", " << e1 << "}";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.ptr<uint16_t>()[i], 0x5a5a) << "written before the error";
  };
  expect_error(6, 4, "expert_offsets[1]");   // decreasing
  expect_error(-1, 4, "expert_offsets[0]");  // negative
  expect_error(4, 11, "expert_offsets[1]");  // past N
  offs.ptr<int32_t>()[0] = 0, offs.ptr<int32_t>()[1] = 0;  // no rows at all: nothing written
  experts->apply(in, out);
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.ptr<uint16_t>()[i], 0x5a5a);
  Tensor offs64 = Tensor::zeros({2}, DType::int64);
  in.expert_offsets = offs64;  // torch's offs are int32; int64 is refused by name
  EXPECT_THROW(experts->apply(in, out), InvalidArgument);
  // The [L + 1] form (starts, then the end): rows before the first start and after the end stay untouched.
  Tensor offs3 = Tensor::empty({3}, DType::int32);
  const int32_t starts[3] = {2, 5, 9};
  std::memcpy(offs3.data(), starts, sizeof(starts));
  in.expert_offsets = offs3;
  experts->apply(in, out);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t i = 0; i < H; ++i)
      ASSERT_EQ(out.ptr<uint16_t>()[r * H + i] == 0x5a5a, r < 2 || r >= 9) << "row " << r << " i " << i;
  offs3.ptr<int32_t>()[0] = 11;  // a first start past N
  try {
    experts->apply(in, out);
    ADD_FAILURE() << "no error for a first start past N";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("expert_offsets[0]"), std::string::npos) << e.what();
  }
  Tensor offs4 = Tensor::zeros({4}, DType::int32);
  in.expert_offsets = offs4;  // neither L nor L + 1 entries
  EXPECT_THROW(experts->apply(in, out), InvalidArgument);
  in.expert_offsets = TensorView();
  EXPECT_THROW(experts->apply(in, out), InvalidArgument);
  in.expert_offsets = offs;
  in.x = TensorView(x.data(), DType::bf16, {2, 5, H});  // 3-D x
  EXPECT_THROW(experts->apply(in, out), InvalidArgument);
}

// x_scales belong to fp8_e4m3 x: given with bf16 x they were silently ignored (a caller who meant FP8 x and passed
// bf16 bits got bf16 results with no word). Every layout refuses them by name; missing for fp8 x, likewise.
TEST(ExpertsCpu, ScalesWithBf16XAreRefusedInEveryLayout) {
  const int64_t H = 128, N = 6;
  auto experts = make_experts_cpu({ExpertWeights::random(WeightFormat::bf16, H, 64, 1), ExpertWeights::random(WeightFormat::bf16, H, 64, 2)});
  Tensor x = test::random_bf16(N, H, 5), scales = Tensor::zeros({N, H / 128}, DType::fp32);
  Tensor out = Tensor::empty({N, H}, DType::bf16);
  Tensor offs = Tensor::zeros({2}, DType::int32), rc = Tensor::zeros({2}, DType::int32);
  offs.ptr<int32_t>()[0] = 2, offs.ptr<int32_t>()[1] = N;
  rc.ptr<int32_t>()[0] = 2, rc.ptr<int32_t>()[1] = 3;
  Tensor idx = Tensor::zeros({N, 1}, DType::int32), wts = Tensor::zeros({N, 1}, DType::fp32);
  auto expect_named = [&](const ExpertsInput& in, const TensorView& o, const char* what) {
    test::poison(out);
    try {
      experts->apply(in, o);
      ADD_FAILURE() << layout_name(in.layout) << ": no error for " << what;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("x_scales"), std::string::npos) << e.what();
    }
    for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.ptr<uint16_t>()[i], 0xffff) << "written before the error";
  };
  ExpertsInput c;
  c.layout = ActivationLayout::Contiguous, c.x = x, c.x_scales = scales, c.expert_offsets = offs;
  expect_named(c, out, "x_scales with bf16 x");
  ExpertsInput f;
  f.layout = ActivationLayout::Flat, f.x = x, f.x_scales = scales, f.topk_idx = idx, f.topk_weights = wts;
  expect_named(f, out, "x_scales with bf16 x");
  ExpertsInput em;
  em.layout = ActivationLayout::ExpertMajor, em.x = TensorView(x.data(), DType::bf16, {2, 3, H});
  em.x_scales = TensorView(scales.data(), DType::fp32, {2, 3, H / 128}), em.recv_count = rc;
  expect_named(em, TensorView(out.data(), DType::bf16, {2, 3, H}), "x_scales with bf16 x");
  // fp8 x without scales: named as missing.
  Tensor q = Tensor::zeros({N, H}, DType::fp8_e4m3);
  c.x = q, c.x_scales = TensorView();
  test::poison(out);
  try {
    experts->apply(c, out);
    ADD_FAILURE() << "no error for fp8 x without x_scales";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("x_scales"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fp8_e4m3 x"), std::string::npos) << e.what();
  }
  // The object is still good: the same call without scales equals a fresh object's.
  c.x = x, c.x_scales = TensorView();
  Tensor o1 = Tensor::empty({N, H}, DType::bf16), o2 = Tensor::empty({N, H}, DType::bf16);
  test::poison(o1), test::poison(o2);
  experts->apply(c, o1);
  make_experts_cpu({ExpertWeights::random(WeightFormat::bf16, H, 64, 1), ExpertWeights::random(WeightFormat::bf16, H, 64, 2)})->apply(c, o2);
  ASSERT_EQ(std::memcmp(o1.data(), o2.data(), static_cast<size_t>(o1.nbytes())), 0);
}

// ---- Experts: flat ---------------------------------------------------------------------------

TEST(ExpertsCpu, FlatWeightedSumMatchesPerRowAndIgnoresMaskedEntries) {
  const int64_t H = 256, N = 60;
  const int K = 4, L = 3;
  for (bool use_fp8 : {false, true}) {
    auto local = mixed_experts(H, use_fp8 ? 300 : 200);
    auto experts = make_experts_cpu(local);
    Tensor idx, wts;
    test::random_routing(N, K, 6, 77 + use_fp8, {.masked_fraction = 0.2, .allow_duplicates = true}, idx, wts);
    int32_t* ip = idx.ptr<int32_t>();
    float* wp = wts.ptr<float>();
    for (int64_t i = 0; i < N * K; ++i) {
      if (ip[i] >= L) ip[i] = -1;  // experts 3..5 live on another rank
      if (ip[i] < 0) wp[i] = std::numeric_limits<float>::quiet_NaN();  // never read
    }
    for (int k = 0; k < K; ++k) ip[5 * K + k] = -1;  // a row without any local selection
    ip[7 * K + 0] = ip[7 * K + 2] = 1;              // a duplicate expert in one row
    wp[7 * K + 0] = 0.25f, wp[7 * K + 2] = 0.5f;
    Tensor x = test::random_bf16(N, H, 12);
    std::vector<bool> has_local(N, false);
    for (int64_t n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k) has_local[n] = has_local[n] || ip[n * K + k] >= 0;
    for (int64_t n = 0; n < N; ++n)  // rows nobody selects are garbage the backend must not read
      if (!has_local[n]) test::poison(x.view().row(n));
    Tensor q = Tensor::empty({N, H}, DType::fp8_e4m3), s = Tensor::empty({N, H / 128}, DType::fp32);
    Tensor x_eff = Tensor::empty({N, H}, DType::fp32);  // what the experts see, as fp32
    if (use_fp8) {
      quantize_fp8_per_token_group(x, q, s);
      dequantize_fp8_per_token_group(q, s, x_eff);
    } else {
      for (int64_t i = 0; i < N * H; ++i) x_eff.ptr<float>()[i] = bf16_bits_to_float(x.ptr<uint16_t>()[i]);
    }
    Tensor out = Tensor::empty({N, H}, DType::bf16);
    test::poison(out);
    ExpertsInput in;
    in.layout = ActivationLayout::Flat;
    in.x = use_fp8 ? q.view() : x.view();
    if (use_fp8) in.x_scales = s;
    in.topk_idx = idx;
    in.topk_weights = wts;
    experts->apply(in, out);
    for (int64_t n = 0; n < N; ++n) {
      const uint16_t* o = out.ptr<uint16_t>() + n * H;
      if (!has_local[n]) {
        for (int64_t i = 0; i < H; ++i) ASSERT_EQ(o[i], 0) << "row without local selection must be +0: n=" << n;
        continue;
      }
      std::vector<float> want(static_cast<size_t>(H), 0.0f), y(static_cast<size_t>(H)), got(static_cast<size_t>(H));
      for (int k = 0; k < K; ++k) {
        if (ip[n * K + k] < 0) continue;
        expert_mlp_cpu(*local[ip[n * K + k]], x_eff.ptr<float>() + n * H, 1, y.data());
        for (int64_t i = 0; i < H; ++i) want[i] += wp[n * K + k] * y[i];
      }
      for (int64_t i = 0; i < H; ++i) got[i] = bf16_bits_to_float(o[i]);
      ASSERT_LT(test::rel_l2_error(f32_view(got, 1, H), f32_view(want, 1, H)), 1e-2) << "n=" << n << " fp8=" << use_fp8;
    }
  }
}

TEST(ExpertsCpu, FlatDuplicateExpertAddsTwice) {
  const int64_t H = 128;
  auto experts = make_experts_cpu({ExpertWeights::random(WeightFormat::bf16, H, 64, 5), ExpertWeights::random(WeightFormat::bf16, H, 64, 6)});
  Tensor x = test::random_bf16(2, H, 3);
  std::memcpy(x.ptr<uint16_t>() + H, x.ptr<uint16_t>(), H * 2);  // two identical rows
  const int32_t idx[2][2] = {{1, 1}, {1, -1}};
  const float wts[2][2] = {{0.25f, 0.5f}, {0.75f, 0.0f}};
  Tensor ti = Tensor::empty({2, 2}, DType::int32), tw = Tensor::empty({2, 2}, DType::fp32);
  std::memcpy(ti.data(), idx, sizeof(idx));
  std::memcpy(tw.data(), wts, sizeof(wts));
  Tensor out = Tensor::empty({2, H}, DType::bf16);
  experts->apply({ActivationLayout::Flat, x, {}, {}, ti, tw}, out);
  // 0.25 y + 0.5 y and 0.75 y agree up to the last rounding; dropping a duplicate would give 0.25 y or 0.5 y.
  Tensor row0(Tensor::empty({1, H}, DType::bf16)), row1(Tensor::empty({1, H}, DType::bf16));
  std::memcpy(row0.data(), out.ptr<uint16_t>(), H * 2);
  std::memcpy(row1.data(), out.ptr<uint16_t>() + H, H * 2);
  EXPECT_LT(test::rel_l2_error(row0, row1), 5e-3);
  EXPECT_GT(test::max_rel_error(row1, Tensor::zeros({1, H}, DType::bf16)), 0.0);
}

TEST(ExpertsCpu, FlatInt64IndicesEmptyInputAndBadIndices) {
  const int64_t H = 128;
  auto experts = make_experts_cpu({ExpertWeights::random(WeightFormat::bf16, H, 64, 5), ExpertWeights::random(WeightFormat::mxfp4, H, 64, 6)});
  Tensor x = test::random_bf16(3, H, 9);
  Tensor i32 = Tensor::empty({3, 2}, DType::int32), i64 = Tensor::empty({3, 2}, DType::int64);
  Tensor tw = test::random_f32(3, 2, 4);
  const int32_t v[6] = {0, 1, -1, 1, 0, -1};
  for (int i = 0; i < 6; ++i) i32.ptr<int32_t>()[i] = v[i], i64.ptr<int64_t>()[i] = v[i];
  Tensor o32 = Tensor::empty({3, H}, DType::bf16), o64 = Tensor::empty({3, H}, DType::bf16);
  experts->apply({ActivationLayout::Flat, x, {}, {}, i32, tw}, o32);
  experts->apply({ActivationLayout::Flat, x, {}, {}, i64, tw}, o64);
  EXPECT_EQ(std::memcmp(o32.data(), o64.data(), o32.nbytes()), 0);

  Tensor x0 = Tensor::empty({0, H}, DType::bf16), i0 = Tensor::empty({0, 2}, DType::int32), w0 = Tensor::empty({0, 2}, DType::fp32);
  EXPECT_NO_THROW(experts->apply({ActivationLayout::Flat, x0, {}, {}, i0, w0}, Tensor::empty({0, H}, DType::bf16)));

  for (int32_t bad : {2, 100, -2}) {
    i32.ptr<int32_t>()[3] = bad;
    test::poison(o32);
    try {
      experts->apply({ActivationLayout::Flat, x, {}, {}, i32, tw}, o32);
      FAIL() << "index " << bad << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("topk_idx[1, 1] = " + std::to_string(bad)), std::string::npos) << e.what();
    }
    for (int64_t i = 0; i < o32.numel(); ++i) ASSERT_EQ(o32.ptr<uint16_t>()[i], 0xffff) << "wrote before validating";
  }
  i32.ptr<int32_t>()[3] = 1;
  EXPECT_THROW(experts->apply({ActivationLayout::Flat, x, {}, {}, i32, Tensor::empty({3, 3}, DType::fp32)}, o32), InvalidArgument);
  EXPECT_THROW(experts->apply({ActivationLayout::Flat, test::random_bf16(3, 64, 1), {}, {}, i32, tw}, o32), InvalidArgument);
}
