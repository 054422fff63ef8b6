// experts/experts_cuda_test.cpp: the CUDA reference experts (make_experts_cuda) against the CPU
// experts (make_experts_cpu) on the same fresh random inputs: every weight format, both layouts,
// bf16 and fp8 inputs, DeepSeek-V3 and V4-Pro expert shapes, the FP8 tensor-core and prefill paths, expert
// biases and activations (gpt-oss, DeepSeek-V4's clamp) on every path, experts without tokens, NaN-poisoned
// padding and unused slots, duplicates, and full-layer timing. The MXFP4 paths: experts_mxfp4_cuda_test.cpp;
// errors, deferred errors and graph capture: experts_errors_cuda_test.cpp; the cases: experts_cuda_testing.h.
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

// ---- correctness ------------------------------------------------------------------------------

TEST(ExpertsCuda, SmallShapesEveryFormatEveryLayout) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  uint64_t seed = 900;
  for (WeightFormat f : {WeightFormat::bf16, WeightFormat::fp8_block, WeightFormat::mxfp4}) {
    const auto experts = same_format(f, 4, 256, 256, seed += 10);
    auto cpu = make_experts_cpu(experts);
    auto gpu = make_experts_cuda(experts, 0);
    for (DType xt : {DType::bf16, DType::fp8_e4m3}) {
      SCOPED_TRACE(fmt_name(experts));
      const double tol = tolerance(xt, experts);
      const EmResult em = run_expert_major(*cpu, *gpu, {0, 1, 300, 77}, 300, xt, ++seed, tol);
      const double fl = run_flat(*cpu, *gpu, 200, 6, xt, ++seed, {.tol = tol});
      const double fl64 =
          run_flat(*cpu, *gpu, 37, 3, xt, ++seed, {.masked = 0.5, .duplicates = true, .int64_idx = true, .tol = tol});
      const double co = run_contiguous(*cpu, *gpu, {0, 1, 300, 77}, 5, xt, ++seed, tol);
      std::printf("[ rel_l2 ] %-10s x=%-8s expert_major %.2e flat %.2e flat(int64) %.2e contiguous %.2e\n",
                  weight_format_name(f).data(), dtype_name(xt).data(), em.max_rel_l2, fl, fl64, co);
    }
  }
}

TEST(ExpertsCuda, RowCountsFromOneToAFewHundred) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  const auto experts = same_format(WeightFormat::fp8_block, 6, 384, 128, 31);
  auto cpu = make_experts_cpu(experts);
  auto gpu = make_experts_cuda(experts, 0);
  // Tile edges: 1, 31, 32, 33, 64, 257 rows; one expert without tokens.
  const double tol = tolerance(DType::fp8_e4m3, experts);
  run_expert_major(*cpu, *gpu, {1, 31, 32, 33, 0, 257}, 257, DType::fp8_e4m3, 32, tol);
  run_expert_major(*cpu, *gpu, {64, 0, 0, 0, 0, 1}, 64, DType::bf16, 33);
  for (int64_t n : {1, 2, 5, 64, 333}) run_flat(*cpu, *gpu, n, 8, DType::fp8_e4m3, 40 + n, {.tol = tol});
  run_flat(*cpu, *gpu, 0, 8, DType::bf16, 50);  // N = 0
}

TEST(ExpertsCuda, OddShapesBf16) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // Hidden and intermediate multiples of 8 but not of 32/128: partial K and column tiles.
  for (auto [H, I] : {std::pair<int64_t, int64_t>{264, 40}, {8, 8}, {520, 200}}) {
    const auto experts = same_format(WeightFormat::bf16, 3, H, I, 70 + H);
    auto cpu = make_experts_cpu(experts);
    auto gpu = make_experts_cuda(experts, 0);
    run_expert_major(*cpu, *gpu, {5, 0, 33}, 40, DType::bf16, 71 + H);
    run_flat(*cpu, *gpu, 45, 4, DType::bf16, 72 + H);
  }
}

TEST(ExpertsCuda, MixedFormatsAndWidths) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // FHMoE: experts of different formats and intermediate sizes behind one Experts.
  const int64_t H = 256;
  std::vector<std::shared_ptr<const ExpertWeights>> experts = {
      ExpertWeights::random(WeightFormat::bf16, H, 128, 81), ExpertWeights::random(WeightFormat::fp8_block, H, 256, 82),
      ExpertWeights::random(WeightFormat::mxfp4, H, 64, 83), ExpertWeights::random(WeightFormat::mxfp4, H, 96, 84)};
  auto cpu = make_experts_cpu(experts);
  auto gpu = make_experts_cuda(experts, 0);
  for (DType xt : {DType::bf16, DType::fp8_e4m3}) {
    const double tol = tolerance(xt, experts);
    run_expert_major(*cpu, *gpu, {7, 40, 0, 65}, 70, xt, 85, tol);
    run_contiguous(*cpu, *gpu, {7, 40, 0, 65}, 3, xt, 87, tol);
    run_contiguous(*cpu, *gpu, {7, 40, 0, 65}, 0, xt, 88, tol, /*head=*/5);  // the [L + 1] form
    run_flat(*cpu, *gpu, 150, 5, xt, 86, {.masked = 0.2, .duplicates = true, .int64_idx = xt == DType::bf16, .tol = tol});
  }
}

TEST(ExpertsCuda, DeepSeekV3ExpertShapes) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // DeepSeek-V3: hidden 7168, moe_intermediate 2048, FP8 128x128 block weights, FP8 dispatch.
  const auto experts = same_format(WeightFormat::fp8_block, 3, 7168, 2048, 300);
  auto cpu = make_experts_cpu(experts);
  auto gpu = make_experts_cuda(experts, 0);
  for (DType xt : {DType::fp8_e4m3, DType::bf16}) {
    const double tol = tolerance(xt, experts);
    const EmResult em = run_expert_major(*cpu, *gpu, {0, 1, 45}, 48, xt, 301, tol);
    const double fl = run_flat(*cpu, *gpu, 40, 8, xt, 302, {.masked = 0.5, .duplicates = true, .tol = tol});
    std::printf("[ rel_l2 ] deepseek-v3 experts x=%-8s expert_major %.2e flat %.2e\n", dtype_name(xt).data(), em.max_rel_l2, fl);
  }
}

TEST(ExpertsCuda, DeepSeekV4ProExpertShapes) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // DeepSeek-V4-Pro: hidden 7168, expert width 3072, MXFP4 routed experts; FP8 shared expert.
  std::vector<std::shared_ptr<const ExpertWeights>> experts = same_format(WeightFormat::mxfp4, 2, 7168, 3072, 400);
  experts.push_back(ExpertWeights::random(WeightFormat::fp8_block, 7168, 3072, 402));
  auto cpu = make_experts_cpu(experts);
  auto gpu = make_experts_cuda(experts, 0);
  for (DType xt : {DType::fp8_e4m3, DType::bf16}) {
    const double tol = tolerance(xt, experts);
    const EmResult em = run_expert_major(*cpu, *gpu, {17, 40, 1}, 40, xt, 403, tol);
    const double fl = run_flat(*cpu, *gpu, 24, 6, xt, 404, {.masked = 0.4, .duplicates = true, .tol = tol});
    const double co = run_contiguous(*cpu, *gpu, {3, 8, 1}, 2, xt, 405, tol);  // the MXFP4 decode path's row counts
    std::printf("[ rel_l2 ] deepseek-v4-pro experts x=%-8s expert_major %.2e flat %.2e contiguous %.2e\n", dtype_name(xt).data(),
                em.max_rel_l2, fl, co);
  }
}

TEST(ExpertsCuda, Fp8TensorCoreRowCountsOneTo8192) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // fp8_block experts with FP8 x take the sm_90a wgmma GEMMs (N=16 tiles up to 16 rows, N=64
  // up to 64; experts with more rows: the prefill kernels' 128-row tiles, N=128): DeepSeek-V3
  // shapes, total rows 1, 7, 128, 258, 1000 (ExpertMajor, experts without tokens among them; 64 /
  // 65 / 129 rows straddle the tile boundaries, small and prefill tiles in one call) and 200 /
  // 8192 (Flat, contiguous rows grouped by expert on the device; 200 pairs: ~67 per expert).
  // The same cases with the prefill kernels off (EPX_EXPERTS_FP8_PREFILL=0: every tile on the 64-row kernels), and with the
  // cp.async prefill kernels (the fallback where a TMA map cannot be encoded: set_fp8_prefill_refuse_weight_maps);
  // the default's 2-CTA clusters see pairs of one expert's tiles, an odd tile count, a pair of two experts' tiles.
  // Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit checks that the default is bit-identical to the fallback.
  // These take the prefill section for any expert with > 64 rows (EPX_EXPERTS_FP8_PREFILL_MIN_TILES
  // = 1); "gated" is the default, which takes it only when the big tiles fill one wave (here only
  // the 8192-row cases, e.g. Flat: 3 x 22 tiles against ceil(132 / 16) = 9; 1000 rows are 8 tiles: 64-row kernels).
  // Every variant runs every case, the 8192-row Contiguous one included.
  const auto experts = same_format(WeightFormat::fp8_block, 3, 7168, 2048, 500);
  auto cpu = make_experts_cpu(experts);
  auto gpu_gated = make_experts_cuda(experts, 0);
  std::unique_ptr<Experts> gpu, gpu_small, gpu_cpasync;
  {
    const test::ScopedEnv min_tiles("EPX_EXPERTS_FP8_PREFILL_MIN_TILES", "1");
    gpu = make_experts_cuda(experts, 0);
    experts_cuda::set_fp8_prefill_refuse_weight_maps(true);
    gpu_cpasync = make_experts_cuda(experts, 0);
    experts_cuda::set_fp8_prefill_refuse_weight_maps(false);
    const test::ScopedEnv mode("EPX_EXPERTS_FP8_PREFILL", "0");
    gpu_small = make_experts_cuda(experts, 0);
  }
  const double tol = kMaxRelL2Fp8TensorCores;
  // The cases, each with its own fresh random rows, and their CPU references are built once and every variant is
  // checked against them (each check copies the inputs to the device and poisons the outputs first): at 8192 rows
  // the reference costs seconds, which per variant made this test take ~112 s on an H200.
  const DType x8 = DType::fp8_e4m3;
  const FlatOptions all_local{.masked = 0.0, .duplicates = false, .tol = tol};
  uint64_t seed = 501;
  std::vector<EmCase> em_cases;
  for (const std::vector<int32_t>& counts : {std::vector<int32_t>{0, 1, 0}, {7, 0, 0}, {16, 17, 95}, {64, 65, 129}, {0, 1000, 0}})
    em_cases.push_back(expert_major_case(*cpu, counts, *std::max_element(counts.begin(), counts.end()) + 3, x8, ++seed));
  const FlatCase flat_8192 = flat_case(*cpu, 4096, 2, x8, ++seed, all_local);
  // Contiguous: 8192 rows whose expert boundaries fall inside 128-row tiles (TMA boxes that run into the next
  // expert's rows and past N), and a small mix with leading rows (the [L + 1] offsets).
  const ContigCase contig_8192 = contiguous_case(*cpu, {2900, 0, 5292}, 7, x8, ++seed);
  const ContigCase contig_195 = contiguous_case(*cpu, {65, 1, 129}, 0, x8, ++seed, /*head=*/3);
  const FlatCase flat_200 = flat_case(*cpu, 100, 2, x8, ++seed, all_local);
  const std::pair<Experts*, const char*> variants[] = {{gpu.get(), ""},
                                                       {gpu_cpasync.get(), " (prefill cp.async loads: no TMA maps)"},
                                                       {gpu_small.get(), " (no prefill kernels)"},
                                                       {gpu_gated.get(), " (prefill gated: one wave)"}};
  for (const auto& [g, variant] : variants) {
    SCOPED_TRACE(std::string("variant") + (*variant ? variant : " (default kernels, prefill min tiles 1)"));
    for (const EmCase& c : em_cases) {
      const EmResult em = check_expert_major(*g, c, tol);
      std::printf("[ rel_l2 ] fp8 tensor cores%s deepseek-v3 expert_major counts %d,%d,%d: %.2e\n", variant, c.counts[0],
                  c.counts[1], c.counts[2], em.max_rel_l2);
      std::fflush(stdout);  // a run cut by a timeout keeps the verdicts so far
    }
    const double fl = check_flat(*g, flat_8192, tol);
    std::printf("[ rel_l2 ] fp8 tensor cores%s deepseek-v3 flat 8192 rows: %.2e\n", variant, fl);
    const double co = check_contiguous(*g, contig_8192, tol), co2 = check_contiguous(*g, contig_195, tol);
    std::printf("[ rel_l2 ] fp8 tensor cores%s deepseek-v3 contiguous 8192 / 195 rows: %.2e / %.2e\n", variant, co, co2);
    const double f2 = check_flat(*g, flat_200, tol);
    std::printf("[ rel_l2 ] fp8 tensor cores%s deepseek-v3 flat 200 rows: %.2e\n", variant, f2);
    std::fflush(stdout);
  }
}

TEST(ExpertsCuda, Fp8PrefillTmaLoadsMatchCpAsyncLoadsBitForBit) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // The default TMA prefill kernels (experts_fp8_prefill_tma_cuda.cu) fill the same swizzled shared-memory tiles
  // as the cp.async ones (experts_fp8_prefill_cuda.cu, the fallback where a weight's TMA map cannot be encoded:
  // set_fp8_prefill_refuse_weight_maps) and run the same products and promotions, so the outputs must agree byte
  // for byte: ExpertMajor (TMA for weights and tokens; an expert without tokens, 129 / 300 rows: partial 128-row
  // tiles whose TMA boxes run into NaN padding rows) and Flat (the token rows first permuted into row-space order,
  // one TMA box per tile), DeepSeek-V3 widths beside a V4-Pro-width expert (I 3072: h_stride > I). The default
  // runs 2-CTA clusters that share the weight tile by multicast, the prefill section ordered for the pairs
  // (ScheduleParams::pair_big: each expert's tiles in pairs, the last tiles of two odd-count experts paired with
  // each other, an odd one out last). Tile counts (128 rows) and the pairs they give:
  //   ExpertMajor 129, 0, 300, 200 (2, 0, 3, 2): (e0, e0), (e3, e3), (e2, e2), (e2, none);
  //   ExpertMajor and Contiguous 100, 300, 200, 290 (1, 3, 2, 3): (e0, e1's last), (e1, e1), (e2, e2), (e3, e3), (e3, none);
  //   Contiguous and Flat 120, 250, 256, 380 (1, 2, 2, 3): (e0, e3's last: two experts of different I), (e3, e3),
  //     (e1, e1), (e2, e2);
  //   Flat 600 tokens top-2 with 10 % masked, random routing (~270 rows per expert).
  std::vector<std::shared_ptr<const ExpertWeights>> experts = same_format(WeightFormat::fp8_block, 3, 7168, 2048, 540);
  experts.push_back(ExpertWeights::random(WeightFormat::fp8_block, 7168, 3072, 544));
  const int64_t L = 4, H = 7168;
  std::unique_ptr<Experts> cpa, dflt;
  {
    const test::ScopedEnv min_tiles("EPX_EXPERTS_FP8_PREFILL_MIN_TILES", "1");  // the prefill section for these few big tiles
    experts_cuda::set_fp8_prefill_refuse_weight_maps(true);
    cpa = make_experts_cuda(experts, 0);
    experts_cuda::set_fp8_prefill_refuse_weight_maps(false);
    dflt = make_experts_cuda(experts, 0);
  }
  auto same_bytes = [](const Tensor& a, const Tensor& b) {
    const Tensor ah = a.to(Device::cpu()), bh = b.to(Device::cpu());
    return std::memcmp(ah.data(), bh.data(), static_cast<size_t>(ah.nbytes())) == 0;
  };
  // One input per case; `keep` holds its device tensors, `out_shape` the output's.
  struct Case {
    std::string name;
    ExpertsInput in;
    std::vector<int64_t> out_shape;
    std::vector<Tensor> keep;
    Tensor ref;
  };
  std::vector<Case> cases;
  auto expert_major = [&](const std::string& name, const std::vector<int32_t>& counts, uint64_t seed) {
    const int64_t cap = *std::max_element(counts.begin(), counts.end());
    const Rows rows = random_rows(cap * L, H, DType::fp8_e4m3, seed);
    Tensor x = Tensor::empty({L, cap, H}, DType::fp8_e4m3), scales = Tensor::empty({L, cap, H / kFp8GroupSize}, DType::fp32);
    test::poison(x);
    test::poison(scales);
    Tensor recv = Tensor::empty({L}, DType::int32);
    for (int64_t l = 0, src = 0; l < L; ++l) {
      recv.ptr<int32_t>()[l] = counts[l];
      for (int64_t j = 0; j < counts[l]; ++j) place_row(rows, src++, x, scales, l * cap + j, H);
    }
    Case c{name, {}, {L, cap, H}, {to_dev(x), to_dev(scales), to_dev(recv)}, {}};
    c.in = {ActivationLayout::ExpertMajor, c.keep[0], c.keep[1], c.keep[2], {}, {}};
    cases.push_back(std::move(c));
  };
  auto contiguous = [&](const std::string& name, const std::vector<int32_t>& counts, uint64_t seed) {
    int64_t total = 0;
    for (int32_t n : counts) total += n;
    const int64_t N = total + 5;  // 5 rows of no expert at the end (left unwritten: their poison compares)
    const Rows rows = random_rows(N, H, DType::fp8_e4m3, seed);
    Tensor offs = Tensor::empty({L}, DType::int32);
    for (int64_t l = 0, e = 0; l < L; ++l) offs.ptr<int32_t>()[l] = static_cast<int32_t>(e += counts[l]);
    Case c{name, {}, {N, H}, {to_dev(rows.x), to_dev(rows.scales), to_dev(offs)}, {}};
    c.in.layout = ActivationLayout::Contiguous;
    c.in.x = c.keep[0], c.in.x_scales = c.keep[1], c.in.expert_offsets = c.keep[2];
    cases.push_back(std::move(c));
  };
  auto flat = [&](const std::string& name, const Tensor& idx, const Tensor& weights, uint64_t seed) {
    const int64_t N = idx.size(0);
    const Rows rows = random_rows(N, H, DType::fp8_e4m3, seed);
    Case c{name, {}, {N, H}, {to_dev(rows.x), to_dev(rows.scales), to_dev(idx), to_dev(weights)}, {}};
    c.in = {ActivationLayout::Flat, c.keep[0], c.keep[1], {}, c.keep[2], c.keep[3]};
    cases.push_back(std::move(c));
  };
  expert_major("expert_major 129,0,300,200", {129, 0, 300, 200}, 545);
  expert_major("expert_major 100,300,200,290", {100, 300, 200, 290}, 548);
  contiguous("contiguous 100,300,200,290", {100, 300, 200, 290}, 549);
  contiguous("contiguous 120,250,256,380", {120, 250, 256, 380}, 550);
  {
    const int K = 2;
    Tensor idx, weights;
    test::random_routing(600, K, static_cast<int>(L), 546, {.masked_fraction = 0.1, .allow_duplicates = false}, idx, weights);
    for (int64_t i = 0; i < idx.numel(); ++i)
      if (idx.ptr<int32_t>()[i] < 0) weights.ptr<float>()[i] = 0.0f;
    flat("flat 600 x 2 random", idx, weights, 547);
    // 120, 250, 256, 380 (pair) rows per expert: labels in expert order, token n gets labels n and n + N (never one
    // expert twice: expert 2's labels are tokens 370.. in the first half and ..122 in the second).
    const std::vector<int32_t> counts = {120, 250, 256, 380};
    std::vector<int32_t> labels;
    for (int32_t l = 0; l < L; ++l) labels.insert(labels.end(), counts[l], l);
    const int64_t N = static_cast<int64_t>(labels.size()) / K;
    Tensor idx2 = Tensor::empty({N, K}, DType::int32), w2 = Tensor::empty({N, K}, DType::fp32);
    std::mt19937 rng(551);
    std::uniform_real_distribution<float> u(0.05f, 1.0f);
    for (int64_t n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k) idx2.ptr<int32_t>()[n * K + k] = labels[n + k * N], w2.ptr<float>()[n * K + k] = u(rng);
    flat("flat 120,250,256,380", idx2, w2, 552);
  }
  // Reference outputs of the cp.async loads; each comparison is printed as it completes (a hang
  // in one variant leaves the earlier verdicts in the log).
  for (Case& c : cases) {
    c.ref = Tensor::empty(c.out_shape, DType::bf16, kDev);
    poison_dev(c.ref);
    cpa->apply(c.in, c.ref);
  }
  for (auto* g : {dflt.get()}) {
    const char* name = "default (TMA, 2-CTA clusters)";
    for (const Case& c : cases) {
      Tensor o = Tensor::empty(c.out_shape, DType::bf16, kDev);
      poison_dev(o);
      g->apply(c.in, o);
      const bool same = same_bytes(o, c.ref);
      std::printf("[ bits ] %s vs cp.async loads, %s: %s\n", name, c.name.c_str(), same ? "identical" : "DIFFER");
      std::fflush(stdout);
      EXPECT_TRUE(same) << name << " " << c.name << " output differs from the cp.async loads'";
    }
  }
}

/// The prefill kernels (128-row tiles) on a small shape, for the sanitizers (compute-sanitizer racecheck /
/// memcheck runs the Fp8PrefillSmallShapes* filters; natively well under a second each): H 1024, I 256, three
/// experts, against the CPU on both layouts; partial tiles (129, 70 rows; Flat ~90 per expert), an expert without
/// tokens, 8 K blocks per gate_up item against its 4 stages (the ring wraps inside an item); ExpertMajor 70, 300, 129
/// rows (1, 3, 2 tiles: the default's clusters pair expert 0's tile with expert 1's last, the schedule kernel's
/// pair order, ScheduleParams::pair_big); the default kernels, or with `cp_async` the fallback's.
void fp8_prefill_small_shapes(bool cp_async) {
  const auto experts = same_format(WeightFormat::fp8_block, 3, 1024, 256, 560);
  auto cpu = make_experts_cpu(experts);
  const double tol = kMaxRelL2Fp8TensorCores;
  const EmCase em_case = expert_major_case(*cpu, {129, 0, 70}, 130, DType::fp8_e4m3, 561);  // one CPU reference for every mode
  const EmCase em_case2 = expert_major_case(*cpu, {70, 300, 129}, 300, DType::fp8_e4m3, 563);
  const FlatCase flat = flat_case(*cpu, 160, 2, DType::fp8_e4m3, 562, {.masked = 0.1, .duplicates = false});
  {
    const char* mode = cp_async ? "cp.async (no TMA maps)" : "default";
    SCOPED_TRACE(mode);
    std::unique_ptr<Experts> gpu;
    {
      const test::ScopedEnv min_tiles("EPX_EXPERTS_FP8_PREFILL_MIN_TILES", "1");  // the prefill section for these few tiles
      experts_cuda::set_fp8_prefill_refuse_weight_maps(cp_async);
      gpu = make_experts_cuda(experts, 0);
      experts_cuda::set_fp8_prefill_refuse_weight_maps(false);
    }
    const EmResult em = check_expert_major(*gpu, em_case, tol);
    const EmResult em2 = check_expert_major(*gpu, em_case2, tol);
    const double fl = check_flat(*gpu, flat, tol);
    std::printf("[ rel_l2 ] fp8 prefill mode %s small shapes: expert_major %.2e / %.2e flat %.2e\n", mode, em.max_rel_l2,
                em2.max_rel_l2, fl);
  }
}

TEST(ExpertsCuda, Fp8PrefillSmallShapes) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // The default TMA kernels: the Flat gate_up's token rows permuted into row-space order first (one TMA box per
  // tile), 2-CTA clusters sharing the weight tile by multicast (ExpertMajor pairs (e0, e0), (e2, none)).
  fp8_prefill_small_shapes(false);
}

TEST(ExpertsCuda, Fp8PrefillSmallShapesCpAsync) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // The cp.async kernel (experts_fp8_prefill_cuda.cu; the fallback where a TMA map cannot be encoded). Its own
  // test so racecheck / memcheck can take it alone.
  fp8_prefill_small_shapes(true);
}

TEST(ExpertsCuda, Fp8TensorCoreV4ProSharedExpertWidth) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // DeepSeek-V4-Pro's FP8 shared expert width (I 3072) beside a V3-width FP8 expert (I 2048): the
  // tensor-core GEMMs with two intermediate sizes in one launch, both layouts.
  std::vector<std::shared_ptr<const ExpertWeights>> experts = {ExpertWeights::random(WeightFormat::fp8_block, 7168, 3072, 510),
                                                               ExpertWeights::random(WeightFormat::fp8_block, 7168, 2048, 511)};
  auto cpu = make_experts_cpu(experts);
  auto gpu = make_experts_cuda(experts, 0);
  const double tol = kMaxRelL2Fp8TensorCores;
  const EmResult em = run_expert_major(*cpu, *gpu, {70, 9}, 72, DType::fp8_e4m3, 512, tol);
  const double fl = run_flat(*cpu, *gpu, 300, 2, DType::fp8_e4m3, 513, {.masked = 0.3, .duplicates = true, .tol = tol});
  std::printf("[ rel_l2 ] fp8 tensor cores v4-pro width expert_major %.2e flat %.2e\n", em.max_rel_l2, fl);
}

// ---- biases and activations (gpt-oss, DeepSeek-V4's clamp) -------------------------------------

Tensor random_vec(int64_t n, uint64_t seed, float scale) {
  Tensor t = test::random_f32(1, n, seed, scale), v = Tensor::empty({n}, DType::fp32);
  std::memcpy(v.data(), t.data(), static_cast<size_t>(n) * 4);
  return v;
}

/// The median of |x W13^T| over a few random bf16 rows of expert w: a clamp limit that this bound clamps about half
/// of the gate and up values at (so both sides of every clamp are exercised whatever the weights' scale).
float median_abs_gate_up(const ExpertWeights& w, uint64_t seed) {
  const int64_t H = w.hidden, I2 = 2 * w.intermediate, rows = 4;
  const Tensor x = test::random_bf16(rows, H, seed);
  const float* a = w.w13_f32();
  std::vector<float> v;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < I2; ++o) {
      float acc = 0;
      for (int64_t k = 0; k < H; ++k) acc += bf16_bits_to_float(x.ptr<const uint16_t>()[r * H + k]) * a[o * H + k];
      v.push_back(std::fabs(acc));
    }
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

/// L experts of format f (the weights of same_format(f, L, H, I, seed)) with `act` and, when `biases`, random b13 / b2
/// of the scale of the gate_up values (bias_scale 0: zeros). act.limit <= 0 means: the median |gate_up| of expert 0.
std::vector<std::shared_ptr<const ExpertWeights>> with_extras(WeightFormat f, int L, int64_t H, int64_t I, uint64_t seed,
                                                              ExpertActivation act, bool biases, float bias_scale = 1.0f) {
  std::vector<std::shared_ptr<const ExpertWeights>> out;
  float scale = 0;
  for (int l = 0; l < L; ++l) {
    auto w = ExpertWeights::random(f, H, I, seed + l);
    if (l == 0) {
      scale = median_abs_gate_up(*w, seed + 100);
      if (act.limit <= 0) act.limit = scale;
    }
    w->activation = act;
    if (biases) {
      w->b13 = bias_scale > 0 ? random_vec(2 * I, seed + 200 + l, bias_scale * scale) : Tensor::zeros({2 * I}, DType::fp32);
      w->b2 = bias_scale > 0 ? random_vec(H, seed + 300 + l, 0.05f * bias_scale) : Tensor::zeros({H}, DType::fp32);
    }
    out.push_back(w);
  }
  return out;
}

std::vector<std::shared_ptr<const ExpertWeights>> plain_copies(const std::vector<std::shared_ptr<const ExpertWeights>>& experts) {
  std::vector<std::shared_ptr<const ExpertWeights>> out;
  for (const auto& e : experts) {
    auto w = std::make_shared<ExpertWeights>();  // the same weight tensors, no biases, plain silu_glu
    w->format = e->format, w->hidden = e->hidden, w->intermediate = e->intermediate;
    w->w13 = e->w13, w->w13_scale = e->w13_scale, w->w2 = e->w2, w->w2_scale = e->w2_scale;
    out.push_back(w);
  }
  return out;
}

Config simt_config() {
  Config c;
  c.experts_simt = 1;
  return c;
}

TEST(ExpertsCuda, BiasesAndActivationsEveryPathAgainstTheCpu) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // Experts with b13 / b2 and each activation (silu_glu with biases, silu_glu clamped (DeepSeek-V4), gpt_oss_glu),
  // every format, bf16 and FP8 x, every layout, on the default paths (fp8_block + FP8 x: the FP8 tensor cores, their
  // 128-row tiles on the 64-row kernels; mxfp4 + FP8 x: the mixed tensor-core kernels) and on the SIMT kernels, each
  // against the CPU experts. The limit clamps about half of the gate / up values. A negative control checks that the
  // CPU output without the biases and activation is far outside the tolerance, so the passes say the GPU computed them.
  const std::pair<ExpertActivation, bool> acts[] = {{ExpertActivation::silu(), true},
                                                    {ExpertActivation{ExpertActivation::Kind::silu_glu, 1.702f, 0.0f}, false},
                                                    {ExpertActivation::gpt_oss(1.702f, 0.0f), true}};
  uint64_t seed = 4100;
  for (WeightFormat f : {WeightFormat::bf16, WeightFormat::fp8_block, WeightFormat::mxfp4})
    for (const auto& [act, biases] : acts) {
      const auto experts = with_extras(f, 4, 256, 256, seed += 10, act, biases);
      SCOPED_TRACE(fmt_name(experts) + expert_activation_name(experts[0]->activation) + (biases ? " biases" : ""));
      auto cpu = make_experts_cpu(experts);
      auto cpu_plain = make_experts_cpu(plain_copies(experts));
      for (DType xt : {DType::bf16, DType::fp8_e4m3}) {
        const double tol = tolerance(xt, experts);
        const FlatCase fc = flat_case(*cpu, 150, 4, xt, ++seed, {.tol = tol});
        const FlatCase fp = flat_case(*cpu_plain, 150, 4, xt, seed, {.tol = tol});
        const double control = test::rel_l2_error(fc.ref, fp.ref);
        EXPECT_GT(control, 10 * tol) << "the biases / activation barely change the output: the test could not fail";
        for (int simt : {0, 1}) {
          SCOPED_TRACE(simt ? "simt" : "default paths");
          auto gpu = simt ? make_experts_cuda(experts, 0, simt_config()) : make_experts_cuda(experts, 0);
          const EmResult em = run_expert_major(*cpu, *gpu, {0, 1, 100, 17}, 100, xt, seed + 1, tol);
          const double fl = check_flat(*gpu, fc, tol);
          const double co = run_contiguous(*cpu, *gpu, {3, 0, 130, 16}, 4, xt, seed + 2, tol);
          std::printf("[ rel_l2 ] %-9s %-34s x=%-8s %s expert_major %.2e flat %.2e contiguous %.2e (control %.2e)\n",
                      weight_format_name(f).data(), expert_activation_name(experts[0]->activation).c_str(),
                      dtype_name(xt).data(), simt ? "simt   " : "default", em.max_rel_l2, fl, co, control);
        }
      }
    }
}

/// Bit-exact (up to the sign of zero) equality of two bf16 tensors of the same shape; returns the differing elements.
int64_t count_value_differences(const Tensor& a, const Tensor& b) {
  int64_t d = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const float x = bf16_bits_to_float(a.ptr<const uint16_t>()[i]), y = bf16_bits_to_float(b.ptr<const uint16_t>()[i]);
    d += !(x == y) && !(std::isnan(x) && std::isnan(y));
  }
  return d;
}

TEST(ExpertsCuda, ZeroBiasesMatchTheDefaultKernelsBitForBit) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  // b13 = 0, b2 = 0 and plain silu_glu: the object runs its *_epi kernels, whose results must equal the default
  // kernels' bit for bit (x + 0 is x; the signs of zeros aside) on every path: SIMT, the FP8 tensor cores (the
  // default object with experts.fp8_prefill = 0, as the epi object runs its big tiles), the mixed MXFP4 kernels
  // (tiles of more than 16 rows: the default object's smaller ones take the decode paths, another summation order).
  uint64_t seed = 4300;
  for (WeightFormat f : {WeightFormat::bf16, WeightFormat::fp8_block, WeightFormat::mxfp4})
    for (DType xt : {DType::bf16, DType::fp8_e4m3})
      for (int simt : {0, 1}) {
        const auto zero = with_extras(f, 3, 256, 256, seed += 10, ExpertActivation::silu(), true, 0.0f);
        const auto plain = plain_copies(zero);
        Config c = simt ? simt_config() : Config{};
        c.experts_fp8_prefill = 0;
        auto gpu_epi = make_experts_cuda(zero, 0, simt ? simt_config() : Config{});
        auto gpu_plain = make_experts_cuda(plain, 0, c);
        auto cpu = make_experts_cpu(plain);
        SCOPED_TRACE(fmt_name(zero) + (simt ? " simt" : " default paths") + " x=" + std::string(dtype_name(xt)));
        const EmCase em = expert_major_case(*cpu, {17, 0, 100}, 100, xt, ++seed);
        const Tensor xd = to_dev(em.x), sd = em.scales.defined() ? to_dev(em.scales) : Tensor(), rd = to_dev(em.recv);
        Tensor out[2];
        int i = 0;
        for (Experts* g : {gpu_epi.get(), gpu_plain.get()}) {
          out[i] = Tensor::empty({em.L, em.cap, em.H}, DType::bf16, kDev);
          poison_dev(out[i]);
          g->apply({ActivationLayout::ExpertMajor, xd, sd, rd, {}, {}}, out[i]);
          out[i] = out[i].to(Device::cpu());
          ++i;
        }
        EXPECT_EQ(count_value_differences(out[0], out[1]), 0) << "epi kernels with zero biases differ from the default kernels";
        check_expert_major(*gpu_epi, em, tolerance(xt, zero));
      }
}

// ---- full layers: time and check -----------------------------------------------------------------

/// One rank's experts of a full layer (every local expert shares one weight set: the upload and
/// the GEMM work are the real ones, the CPU check stays cheap). 256 tokens routed top-K over E
/// experts; this rank holds experts [0, L). Times ExpertMajor (cap = 2 ranks x 256) and Flat.
void full_layer(const char* name, WeightFormat f, int64_t H, int64_t I, int L, int E, int K) {
  const int64_t T = 256, cap = 2 * T;
  const auto w = ExpertWeights::random(f, H, I, 1000);
  std::vector<std::shared_ptr<const ExpertWeights>> experts(static_cast<size_t>(L), w);
  auto cpu = make_experts_cpu(experts);
  const auto t0 = std::chrono::steady_clock::now();
  auto gpu = make_experts_cuda(experts, 0);
  const double upload_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  Tensor idx_g, weights;
  test::random_routing(T, K, E, 1001, {}, idx_g, weights);
  // Flat: local ids or -1.
  Tensor idx = Tensor::empty({T, K}, DType::int32);
  std::vector<int32_t> counts(static_cast<size_t>(L), 0);
  for (int64_t i = 0; i < T * K; ++i) {
    const int32_t e = idx_g.ptr<int32_t>()[i];
    idx.ptr<int32_t>()[i] = e < L ? e : -1;
    if (e < L) ++counts[e];
  }
  int64_t pairs = 0;
  for (int32_t c : counts) pairs += c;

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  auto time_ms = [&](auto&& fn) {
    fn();  // warm-up (workspace)
    std::vector<float> ms;
    for (int r = 0; r < 5; ++r) {
      cudaEventRecord(start, stream);
      fn();
      cudaEventRecord(stop, stream);
      cudaEventSynchronize(stop);
      float v = 0;
      cudaEventElapsedTime(&v, start, stop);
      ms.push_back(v);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };

  // ExpertMajor, fp8 dispatch.
  const Rows rows = random_rows(pairs, H, DType::fp8_e4m3, 1002);
  Tensor x = Tensor::empty({L, cap, H}, DType::fp8_e4m3), scales = Tensor::empty({L, cap, H / kFp8GroupSize}, DType::fp32);
  test::poison(x);
  test::poison(scales);
  Tensor recv = Tensor::empty({L}, DType::int32);
  for (int64_t l = 0, src = 0; l < L; ++l) {
    recv.ptr<int32_t>()[l] = counts[l];
    for (int64_t j = 0; j < counts[l]; ++j) place_row(rows, src++, x, scales, l * cap + j, H);
  }
  const Tensor xd = to_dev(x), sd = to_dev(scales), rd = to_dev(recv);
  Tensor out = Tensor::empty({L, cap, H}, DType::bf16, kDev);
  poison_dev(out);
  const ExpertsInput in_em{ActivationLayout::ExpertMajor, xd, sd, rd, {}, {}};
  const float em_ms = time_ms([&] { gpu->apply(in_em, out, Stream{stream}); });
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const Tensor oh = out.to(Device::cpu());
  Tensor ref = Tensor::empty({L, cap, H}, DType::bf16);
  test::poison(ref);
  cpu->apply({ActivationLayout::ExpertMajor, x, scales, recv, {}, {}}, ref);
  double em_err = 0;
  for (int64_t l = 0; l < L; ++l)
    if (counts[l] > 0)
      em_err = std::max(em_err, test::rel_l2_error(rows_2d(oh, H, l * cap, l * cap + counts[l]),
                                                   rows_2d(ref, H, l * cap, l * cap + counts[l])));
  const double tol = f == WeightFormat::fp8_block ? kMaxRelL2Fp8TensorCores : kMaxRelL2;  // FP8 dispatch
  EXPECT_LE(em_err, tol);

  // Flat, fp8 dispatch: T rows, each with its local selections.
  const Rows frows = random_rows(T, H, DType::fp8_e4m3, 1003);
  const Tensor fxd = to_dev(frows.x), fsd = to_dev(frows.scales), idd = to_dev(idx), wd = to_dev(weights);
  Tensor fout = Tensor::empty({T, H}, DType::bf16, kDev);
  const ExpertsInput in_flat{ActivationLayout::Flat, fxd, fsd, {}, idd, wd};
  const float flat_ms = time_ms([&] { gpu->apply(in_flat, fout, Stream{stream}); });
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  Tensor fref = Tensor::empty({T, H}, DType::bf16);
  cpu->apply({ActivationLayout::Flat, frows.x, frows.scales, {}, idx, weights}, fref);
  const double flat_err = test::rel_l2_error(fout.to(Device::cpu()), fref);
  EXPECT_LE(flat_err, tol);

  const double flop = 2.0 * pairs * 3.0 * static_cast<double>(H) * static_cast<double>(I);
  std::printf("[ timing ] %s: L=%d %s H=%lld I=%lld, %lld tokens top-%d of %d -> %lld local pairs: expert_major %.2f ms "
              "(%.1f TFLOP/s, rel_l2 %.1e), flat %.2f ms (rel_l2 %.1e); weight upload %.1f s\n",
              name, L, weight_format_name(f).data(), static_cast<long long>(H), static_cast<long long>(I),
              static_cast<long long>(T), K, E, static_cast<long long>(pairs), em_ms, flop / (em_ms * 1e-3) / 1e12, em_err,
              flat_ms, flat_err, upload_s);
  EXPECT_LT(em_ms, 500.0f) << "a full layer's experts must take well under a second";
  EXPECT_LT(flat_ms, 500.0f);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
}

TEST(ExpertsCuda, FullLayerDeepSeekV3) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  full_layer("deepseek-v3", WeightFormat::fp8_block, 7168, 2048, 128, 256, 8);
}

TEST(ExpertsCuda, FullLayerDeepSeekV4Pro) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  full_layer("deepseek-v4-pro", WeightFormat::mxfp4, 7168, 3072, 192, 384, 6);
}

#else

TEST(ExpertsCuda, CpuOnlyBuildThrowsUnsupported) {
  const auto w = ExpertWeights::random(WeightFormat::bf16, 64, 32, 1);
  EXPECT_THROW(make_experts_cuda({w}, 0), Unsupported);
}

#endif

}  // namespace
}  // namespace epx
