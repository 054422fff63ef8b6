// experts/experts_mxfp4_cuda_test.cpp: the CUDA MXFP4 experts against the CPU experts on the same fresh
// random inputs: the mixed tensor-core GEMMs (row counts 1 to 8192, wide scale spreads), the decode path (row
// counts, scale spreads), and E8M0 extremes and NaN on every path. Cases: experts_cuda_testing.h.
// Outputs are poisoned (NaN) before every GPU run, so an unwritten valid element fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "epx/config.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/experts.h"
#include "epx/quant.h"
#include "test_util.h"

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "experts/experts_fp8_cuda.h"
#include "experts/experts_cuda_testing.h"
#endif

namespace epx {
namespace {

#ifdef EPX_WITH_CUDA

// ---- MXFP4 -----------------------------------------------------------------------------------

TEST(ExpertsCuda, Mxfp4TensorCoreRowCountsOneTo8192) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // MXFP4 experts with FP8 x take the mixed sm_90a GEMMs (experts_mxfp4_cuda.cu), here beside the
  // FP8 shared expert in the same launches (FHMoE, DeepSeek-V4-Pro shapes: H 7168, I 3072): total
  // rows 1, 10, 128, 1005 (ExpertMajor, experts without tokens among them) and 8192 (Flat).
  std::vector<std::shared_ptr<const ExpertWeights>> experts = same_format(WeightFormat::mxfp4, 3, 7168, 3072, 520);
  experts.push_back(ExpertWeights::random(WeightFormat::fp8_block, 7168, 3072, 524));
  auto cpu = make_experts_cpu(experts);
  auto gpu = make_experts_cuda(experts, 0);
  const double tol = tolerance(DType::fp8_e4m3, experts);
  const std::vector<std::vector<int32_t>> cases = {{0, 1, 0, 0}, {7, 0, 0, 3}, {16, 17, 95, 0}, {0, 1000, 0, 5}};
  uint64_t seed = 530;
  for (const auto& counts : cases) {
    const int64_t cap = *std::max_element(counts.begin(), counts.end()) + 3;
    const EmResult em = run_expert_major(*cpu, *gpu, counts, cap, DType::fp8_e4m3, ++seed, tol);
    std::printf("[ rel_l2 ] mxfp4 tensor cores deepseek-v4-pro expert_major counts %d,%d,%d,%d: %.2e\n", counts[0], counts[1],
                counts[2], counts[3], em.max_rel_l2);
  }
  const double fl = run_flat(*cpu, *gpu, 4096, 2, DType::fp8_e4m3, ++seed, {.masked = 0.0, .duplicates = false, .tol = tol});
  std::printf("[ rel_l2 ] mxfp4 tensor cores deepseek-v4-pro flat 8192 rows: %.2e\n", fl);
  // MXFP4 experts alone (no fp8_block expert): the MXFP4 tolerance.
  const std::vector<std::shared_ptr<const ExpertWeights>> routed(experts.begin(), experts.end() - 1);
  auto cpu_r = make_experts_cpu(routed);
  auto gpu_r = make_experts_cuda(routed, 0);
  const EmResult em = run_expert_major(*cpu_r, *gpu_r, {33, 0, 2}, 40, DType::fp8_e4m3, ++seed, kMaxRelL2);
  const double fr = run_flat(*cpu_r, *gpu_r, 300, 6, DType::fp8_e4m3, ++seed, {.masked = 0.2, .duplicates = true, .tol = kMaxRelL2});
  std::printf("[ rel_l2 ] mxfp4 tensor cores routed only expert_major %.2e flat %.2e\n", em.max_rel_l2, fr);
}

TEST(ExpertsCuda, Mxfp4TensorCoreWideScaleSpread) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // The gate_up expansion writes e2m1 * 2^(e_group - e_max + 6) as e4m3: groups 2^4, 2^12 and 2^17
  // below their row's largest take the table path, the exact fp32 path and the rounded one.
  const int64_t H = 512, I = 256;
  std::mt19937_64 rng(540);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Tensor gu = Tensor::empty({2 * I, H}, DType::fp32), dn = Tensor::empty({H, I}, DType::fp32);
  const float spread[4] = {1.0f, std::ldexp(1.0f, -4), std::ldexp(1.0f, -12), std::ldexp(1.0f, -17)};
  for (int64_t r = 0; r < 2 * I; ++r)
    for (int64_t c = 0; c < H; ++c) gu.ptr<float>()[r * H + c] = nd(rng) * spread[((c / 32) + r) % 4] / 16.0f;
  for (int64_t i = 0; i < H * I; ++i) dn.ptr<float>()[i] = nd(rng) / 16.0f;
  std::vector<std::shared_ptr<const ExpertWeights>> experts = {ExpertWeights::from_float(WeightFormat::mxfp4, gu, dn),
                                                               ExpertWeights::random(WeightFormat::mxfp4, H, I, 541)};
  auto cpu = make_experts_cpu(experts);
  auto gpu = make_experts_cuda(experts, 0);
  const EmResult em = run_expert_major(*cpu, *gpu, {20, 3}, 20, DType::fp8_e4m3, 542, kMaxRelL2);
  std::printf("[ rel_l2 ] mxfp4 tensor cores wide scale spread: %.2e\n", em.max_rel_l2);
}

TEST(ExpertsCuda, Mxfp4DecodePathRowCounts) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // Experts with <= 16 rows take the mma.sync decode path of the mixed kernels (experts_mxfp4_kernels.cuh:
  // <= 8 rows decode_item_bulk, TMA boxes through per-warp slots of 4 windows and a per-item token
  // buffer; 9..16 rows decode_item_ring, a per-warp cp.async ring with 2 n-tiles; one mma per 32-K scale
  // block), more the BN 64 wgmma path; all in one launch beside the FP8 shared expert. Row counts 0, 1,
  // 7, 8, 9, 16 per expert; DeepSeek-V4-Pro (H 7168, I 3072) and V3 widths (I 2048), ExpertMajor and Flat.
  std::vector<std::shared_ptr<const ExpertWeights>> experts = same_format(WeightFormat::mxfp4, 4, 7168, 3072, 560);
  experts.push_back(ExpertWeights::random(WeightFormat::mxfp4, 7168, 2048, 565));
  experts.push_back(ExpertWeights::random(WeightFormat::fp8_block, 7168, 3072, 566));
  auto cpu = make_experts_cpu(experts);
  auto gpu = make_experts_cuda(experts, 0);
  const double tol = tolerance(DType::fp8_e4m3, experts);
  // The cases and their CPU references are built once.
  uint64_t seed = 570;
  std::vector<EmCase> cases;
  for (const std::vector<int32_t>& counts : {std::vector<int32_t>{1, 7, 8, 0, 8, 9}, {9, 16, 0, 1, 7, 3}, {8, 8, 8, 8, 8, 0}})
    cases.push_back(expert_major_case(*cpu, counts, 19, DType::fp8_e4m3, ++seed));
  for (const EmCase& c : cases) {
    const EmResult em = check_expert_major(*gpu, c, tol);
    std::printf("[ rel_l2 ] mxfp4 decode path v4-pro/v3 expert_major counts %d,%d,%d,%d,%d,%d: %.2e\n", c.counts[0], c.counts[1],
                c.counts[2], c.counts[3], c.counts[4], c.counts[5], em.max_rel_l2);
    std::fflush(stdout);
  }
  const double fl = run_flat(*cpu, *gpu, 20, 2, DType::fp8_e4m3, ++seed, {.masked = 0.2, .duplicates = true, .tol = tol});
  std::printf("[ rel_l2 ] mxfp4 decode path v4-pro/v3 flat 20 tokens top-2: %.2e\n", fl);
  // MXFP4 experts alone: the MXFP4 tolerance.
  const std::vector<std::shared_ptr<const ExpertWeights>> routed(experts.begin(), experts.end() - 1);
  auto cpu_r = make_experts_cpu(routed);
  auto gpu_r = make_experts_cuda(routed, 0);
  const EmResult em = run_expert_major(*cpu_r, *gpu_r, {8, 1, 0, 5, 8}, 8, DType::fp8_e4m3, 577, kMaxRelL2);
  std::printf("[ rel_l2 ] mxfp4 decode path routed only expert_major %.2e\n", em.max_rel_l2);
}

TEST(ExpertsCuda, Mxfp4DecodePathScaleSpread) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // The decode path applies each 32-K block's e8m0 scale in fp32 after its mma: blocks 2^20 below,
  // 2^40 above and at e8m0 0 (2^-127, the exact denormal path) beside unit blocks in the same rows
  // and windows, for gate_up and down; <= 8 rows per expert. I = 256 (down K % 512 != 0: decode_item_ring2
  // for down, decode_item_bulk for gate_up) and I = 512 (both GEMMs on decode_item_bulk).
  for (const int64_t I : {256, 512}) {
    const int64_t H = 512;
    std::mt19937_64 rng(I == 256 ? 580 : 590);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    Tensor gu = Tensor::empty({2 * I, H}, DType::fp32), dn = Tensor::empty({H, I}, DType::fp32);
    const float spread[4] = {1.0f, std::ldexp(1.0f, -20), std::ldexp(1.0f, 40), std::ldexp(1.0f, -126)};
    for (int64_t r = 0; r < 2 * I; ++r) {
      // gate rows take 2^40 blocks, up rows not (h = silu(g) u stays inside bf16)
      for (int64_t c = 0; c < H; ++c) {
        const int k = static_cast<int>(((c / 32) + r) % 4);
        const float f = (k == 2 && r >= I) ? 1.0f : spread[k];
        gu.ptr<float>()[r * H + c] = nd(rng) * f / 4.0f;
      }
    }
    for (int64_t r = 0; r < H; ++r)
      for (int64_t c = 0; c < I; ++c) {
        const int k = static_cast<int>(((c / 32) + r) % 4);
        // some down rows entirely at e8m0 0 (every block 2^-126 / 4: codes of 2^-127)
        const float f = r % 16 == 5 ? std::ldexp(1.0f, -126) : (k == 2 ? std::ldexp(1.0f, -30) : spread[k]);
        dn.ptr<float>()[r * I + c] = nd(rng) * f / 4.0f;
      }
    auto w = ExpertWeights::from_float(WeightFormat::mxfp4, gu, dn);
    int64_t zero_scales = 0;
    for (int64_t i = 0; i < w->w2_scale.numel(); ++i) zero_scales += w->w2_scale.ptr<const uint8_t>()[i] == 0;
    for (int64_t i = 0; i < w->w13_scale.numel(); ++i) zero_scales += w->w13_scale.ptr<const uint8_t>()[i] == 0;
    EXPECT_GT(zero_scales, 0) << "the spread must reach e8m0 0";
    std::vector<std::shared_ptr<const ExpertWeights>> experts = {w, ExpertWeights::random(WeightFormat::mxfp4, H, I, 581)};
    auto cpu = make_experts_cpu(experts);
    auto gpu = make_experts_cuda(experts, 0);
    for (const auto& counts : std::vector<std::vector<int32_t>>{{8, 3}, {1, 8}, {7, 0}}) {
      const EmResult em = run_expert_major(*cpu, *gpu, counts, 8, DType::fp8_e4m3, 582 + counts[0], kMaxRelL2);
      std::printf("[ rel_l2 ] mxfp4 decode path scale spread I %lld counts %d,%d: %.2e (e8m0 zero scales %lld)\n",
                  static_cast<long long>(I), counts[0], counts[1], em.max_rel_l2, static_cast<long long>(zero_scales));
    }
  }
}

TEST(ExpertsCuda, Mxfp4E8m0ExtremesAndNaNEveryPath) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // e8m0 255 (NaN), 254 (2^127) and 0 (2^-127) scales written into random MXFP4 weights, on every
  // path of the mixed kernels: <= 8 rows (decode_item_bulk; I 256: down on decode_item_ring2),
  // 9..16 rows (decode_item_ring) and 40 rows (the BN 64 wgmma path with the weights expanded in
  // shared memory). The CPU reference (dequantized fp32, e8m0_bits_to_float) defines the values:
  //   expert 0: down scales 255 at (row 5, block 1) and (row 300, block 3): output columns 5 and
  //             300 NaN for the expert's tokens; 254 at (row 77, block 0) with that block's codes all
  //             0 but one 0.5 (column 77 ~ 2^126 h, finite: x ~ N(0, 1/16) keeps |h| far below 4);
  //             0 at a few other down blocks;
  //   expert 1: gate_up scale 255 at (gate row 9, block 2): h[:, 9] NaN, so every output element of
  //             its tokens is NaN;
  //   expert 2: gate_up 254 at (up row I + 3, block 1) with one 0.5 code (h[:, 3] ~ 2^126 x[:, 32]:
  //             every output column of its tokens huge and finite), 0 at a few gate_up blocks. x[:, 32]
  //             is kept small in its 1x128 group: decode_item_bulk sums d * 2^(e - 127) over a window
  //             before the x scale, an intermediate ~9x the true value for an x at its group's max,
  //             so a 2^127 block next to a large x overflows there first (a limit, not tested here).
  // Checked: NaN exactly where the reference has NaN; the other elements finite, within kMaxRelL2
  // normwise per expert over the ordinary columns and per extreme column (column 77) separately.
  for (const int64_t I : {256, 512}) {
    const int64_t H = 512, L = 3;
    SCOPED_TRACE("I=" + std::to_string(I));
    std::vector<std::shared_ptr<ExpertWeights>> w;
    for (int l = 0; l < L; ++l) w.push_back(ExpertWeights::random(WeightFormat::mxfp4, H, I, 600 + 10 * I + l));
    const int64_t w2_blocks = I / 32, w13_blocks = H / 32;
    auto set_block = [](const Tensor& codes, const Tensor& scale, int64_t blocks, int64_t row, int64_t b, uint8_t e, bool one_half) {
      scale.ptr<uint8_t>()[row * blocks + b] = e;
      if (one_half) {  // the block's 32 codes: code 1 (0.5) at element 0, the rest 0
        uint8_t* c = codes.ptr<uint8_t>() + row * blocks * 16 + b * 16;
        std::memset(c, 0, 16);
        c[0] = 0x01;
      }
    };
    set_block(w[0]->w2, w[0]->w2_scale, w2_blocks, 5, 1, 255, false);
    set_block(w[0]->w2, w[0]->w2_scale, w2_blocks, 300, 3, 255, false);
    set_block(w[0]->w2, w[0]->w2_scale, w2_blocks, 77, 0, 254, true);
    for (const int64_t r : {11, 12, 200, 511}) set_block(w[0]->w2, w[0]->w2_scale, w2_blocks, r, r % w2_blocks, 0, false);
    set_block(w[1]->w13, w[1]->w13_scale, w13_blocks, 9, 2, 255, false);
    set_block(w[2]->w13, w[2]->w13_scale, w13_blocks, I + 3, 1, 254, true);
    for (const int64_t r : {int64_t{0}, int64_t{40}, I + 100, 2 * I - 1}) set_block(w[2]->w13, w[2]->w13_scale, w13_blocks, r, (r + 5) % w13_blocks, 0, false);
    const std::vector<int64_t> extreme_cols = {77};  // expert 0's huge column

    const std::vector<std::shared_ptr<const ExpertWeights>> experts(w.begin(), w.end());
    auto cpu = make_experts_cpu(experts);
    auto gpu = make_experts_cuda(experts, 0);
    uint64_t seed = 620 + I;
    for (const auto& counts : std::vector<std::vector<int32_t>>{{8, 3, 1}, {12, 16, 9}, {40, 33, 17}, {7, 40, 14}}) {
      SCOPED_TRACE("counts " + std::to_string(counts[0]) + "," + std::to_string(counts[1]) + "," + std::to_string(counts[2]));
      const int64_t cap = 41;
      int64_t total = 0;
      for (int32_t c : counts) total += c;
      Rows rows;
      {
        const Tensor b = test::random_bf16(total, H, ++seed, 0.25f);
        // x[:, 32..33] (what expert 2's 2^127 code meets) small in their 1x128 groups: e4m3 codes ~16,
        // so no path's partial sum (decode_item_bulk: d * 2^127 before the x scale) leaves fp32
        for (int64_t t = 0; t < total; ++t)
          for (int64_t c : {32, 33}) b.ptr<uint16_t>()[t * H + c] = float_to_bf16_bits(t % 2 ? 0.02f : -0.02f);
        rows.x = Tensor::empty({total, H}, DType::fp8_e4m3);
        rows.scales = Tensor::empty({total, H / kFp8GroupSize}, DType::fp32);
        quantize_fp8_per_token_group(b, rows.x, rows.scales);
      }
      Tensor x = Tensor::empty({L, cap, H}, DType::fp8_e4m3), scales = Tensor::empty({L, cap, H / kFp8GroupSize}, DType::fp32);
      test::poison(x);
      test::poison(scales);
      Tensor recv = Tensor::empty({L}, DType::int32);
      for (int64_t l = 0, src = 0; l < L; ++l) {
        recv.ptr<int32_t>()[l] = counts[l];
        for (int64_t j = 0; j < counts[l]; ++j) place_row(rows, src++, x, scales, l * cap + j, H);
      }
      Tensor ref = Tensor::empty({L, cap, H}, DType::bf16);
      test::poison(ref);
      cpu->apply({ActivationLayout::ExpertMajor, x, scales, recv, {}, {}}, ref);
      const Tensor xd = to_dev(x), sd = to_dev(scales), rd = to_dev(recv);
      Tensor out = Tensor::empty({L, cap, H}, DType::bf16, kDev);
      poison_dev(out);
      gpu->apply({ActivationLayout::ExpertMajor, xd, sd, rd, {}, {}}, out);
      const Tensor oh = out.to(Device::cpu());

      for (int64_t l = 0; l < L; ++l) {
        SCOPED_TRACE("expert " + std::to_string(l));
        int64_t nan_ref = 0, nan_mismatch = 0, non_finite_got = 0;
        double num = 0, den = 0, worst_extreme = 0;
        std::vector<double> xnum(extreme_cols.size(), 0.0), xden(extreme_cols.size(), 0.0);
        for (int64_t j = 0; j < counts[l]; ++j)
          for (int64_t c = 0; c < H; ++c) {
            const int64_t i = (l * cap + j) * H + c;
            const double g = bf16_bits_to_float(oh.ptr<const uint16_t>()[i]), r = bf16_bits_to_float(ref.ptr<const uint16_t>()[i]);
            if (std::isnan(r)) {
              ++nan_ref;
              nan_mismatch += !std::isnan(g);
              continue;
            }
            ASSERT_TRUE(std::isfinite(r)) << "the reference must stay finite outside its NaN: row " << j << " col " << c;
            if (!std::isfinite(g)) {
              ++non_finite_got;
              continue;
            }
            const auto xc = std::find(extreme_cols.begin(), extreme_cols.end(), c);
            if (l == 0 && xc != extreme_cols.end()) {
              xnum[xc - extreme_cols.begin()] += (g - r) * (g - r);
              xden[xc - extreme_cols.begin()] += r * r;
            } else {
              num += (g - r) * (g - r);
              den += r * r;
            }
          }
        const int64_t expect_nan = l == 0 ? 2 * counts[l] : (l == 1 ? counts[l] * H : 0);
        EXPECT_EQ(nan_ref, expect_nan) << "the reference's NaN count (the test's construction)";
        EXPECT_EQ(nan_mismatch, 0) << "elements NaN in the reference but not on the GPU";
        EXPECT_EQ(non_finite_got, 0) << "elements finite in the reference but not on the GPU (NaN or inf)";
        const double e = den > 0 ? std::sqrt(num / den) : 0.0;
        if (l != 1 && counts[l] > 0) {
          EXPECT_GT(den, 0.0);
          EXPECT_LE(e, kMaxRelL2) << "ordinary columns";
        }
        for (size_t k = 0; l == 0 && counts[l] > 0 && k < extreme_cols.size(); ++k) {
          const double xe = std::sqrt(xnum[k] / xden[k]);
          worst_extreme = std::max(worst_extreme, xe);
          EXPECT_GT(std::sqrt(xden[k] / counts[l]), 1e30) << "column " << extreme_cols[k] << " must carry the 2^127 block";
          EXPECT_LE(xe, kMaxRelL2) << "extreme column " << extreme_cols[k];
        }
        if (l == 2 && counts[l] > 0) {
          EXPECT_GT(std::sqrt(den / (counts[l] * H)), 1e30) << "expert 2's rows must carry the 2^127 block";
        }
        // Padding rows >= recv_count: never written.
        const uint16_t* pad = oh.ptr<const uint16_t>() + (l * cap + counts[l]) * H;
        int64_t touched = 0;
        for (int64_t i = 0; i < (cap - counts[l]) * H; ++i) touched += pad[i] != 0xFFFFu;
        EXPECT_EQ(touched, 0) << "padding rows were written";
        std::printf("[ rel_l2 ] mxfp4 e8m0 extremes I %lld expert %lld rows %d: NaN %lld (mismatch %lld), ordinary %.2e, extreme %.2e\n",
                    static_cast<long long>(I), static_cast<long long>(l), counts[l], static_cast<long long>(nan_ref),
                    static_cast<long long>(nan_mismatch), e, worst_extreme);
      }
    }
  }
}

#endif

}  // namespace
}  // namespace epx
