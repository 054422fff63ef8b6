// experts/experts_errors_cuda_test.cpp: the CUDA experts' errors and graphs: bad arguments, a TMA prefill
// launch without weight maps, the per-device cluster count, bad device indices skipped and reported by the
// next apply (deferred errors), and graph capture after warm-up. Cases: experts_cuda_testing.h.
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

// ---- errors, graphs ---------------------------------------------------------------------------

TEST(ExpertsCuda, RejectsBadArguments) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  const auto experts = same_format(WeightFormat::bf16, 2, 256, 64, 500);
  auto gpu = make_experts_cuda(experts, 0);
  EXPECT_THROW(make_experts_cuda({}, 0), InvalidArgument);
  EXPECT_THROW(make_experts_cuda(experts, cuda::device_count()), InvalidArgument);
  EXPECT_THROW(make_experts_cuda({ExpertWeights::random(WeightFormat::bf16, 12, 8, 1)}, 0), InvalidArgument);  // H % 8
  Tensor x_cpu = Tensor::empty({2, 4, 256}, DType::bf16), recv_cpu = Tensor::zeros({2}, DType::int32);
  Tensor x = to_dev(x_cpu), recv = to_dev(recv_cpu), out = Tensor::empty({2, 4, 256}, DType::bf16, kDev);
  EXPECT_THROW(gpu->apply({ActivationLayout::ExpertMajor, x_cpu, {}, recv, {}, {}}, out), InvalidArgument);  // CPU x
  Tensor out_bad = Tensor::empty({2, 5, 256}, DType::bf16, kDev);
  EXPECT_THROW(gpu->apply({ActivationLayout::ExpertMajor, x, {}, recv, {}, {}}, out_bad), InvalidArgument);  // shape
  Tensor x8 = Tensor::empty({2, 4, 256}, DType::fp8_e4m3, kDev);
  EXPECT_THROW(gpu->apply({ActivationLayout::ExpertMajor, x8, {}, recv, {}, {}}, out), InvalidArgument);  // no scales
  // Scales with bf16 x are refused by name, every layout (as on the CPU).
  Tensor xs = Tensor::zeros({2, 4, 2}, DType::fp32, kDev);
  const std::string m = test::invalid_argument_message([&] { gpu->apply({ActivationLayout::ExpertMajor, x, xs, recv, {}, {}}, out); });
  EXPECT_NE(m.find("x_scales"), std::string::npos) << m;
  EXPECT_NE(m.find("must be empty for x.dtype = bf16"), std::string::npos) << m;
  Tensor xf = Tensor::empty({8, 256}, DType::bf16, kDev), xfs = Tensor::zeros({8, 2}, DType::fp32, kDev);
  Tensor outf = Tensor::empty({8, 256}, DType::bf16, kDev), offs = to_dev(Tensor::zeros({2}, DType::int32));
  ExpertsInput ic{ActivationLayout::Contiguous, xf, xfs, {}, {}, {}};
  ic.expert_offsets = offs;
  EXPECT_THROW(gpu->apply(ic, outf), InvalidArgument);
  EXPECT_NO_THROW(gpu->apply({ActivationLayout::ExpertMajor, x, {}, recv, {}, {}}, out));  // all counts 0: still usable
}

TEST(ExpertsCuda, TmaPrefillLaunchWithoutWeightMapsThrows) {
  // The TMA prefill kernels load every weight tile through Fp8GemmParams::w_maps (they have no cp.async weight
  // path): a launch without them is an error
  // naming the field, before any CUDA call (no GPU needed). apply never does this: without maps it runs the
  // cp.async kernels (a stub map pointer here would be launched, so only the null case is checked).
  experts_cuda::Fp8GemmParams p{};
  for (const bool gate_up : {true, false}) {
    try {
      if (gate_up) experts_cuda::launch_fp8_prefill_tma_gate_up(p, 1, nullptr);
      else experts_cuda::launch_fp8_prefill_tma_down(p, 1, nullptr);
      ADD_FAILURE() << "launched without weight maps";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("w_maps is null"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(gate_up ? "launch_fp8_prefill_tma_gate_up" : "launch_fp8_prefill_tma_down"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(ExpertsCuda, Fp8PrefillClusterCountCachedPerDevice) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  if (!experts_cuda::fp8_tensor_cores_available(0)) GTEST_SKIP() << "needs the sm_90a FP8 tensor cores on device 0";
  // fp8_tensor_cores_available(0) measured device 0's 2-CTA cluster counts (cudaOccupancyMaxActiveClusters, cached per
  // device ordinal, not one figure per process). Every thread
  // with device 0 current reads the same figures; an H200 fits 66 clusters of either kernel.
  const int gate_up = experts_cuda::fp8_prefill_tma_max_clusters(true), down = experts_cuda::fp8_prefill_tma_max_clusters(false);
  EXPECT_GT(gate_up, 0);
  EXPECT_GT(down, 0);
  std::printf("[ clusters ] device 0: gate_up %d, down %d\n", gate_up, down);
  std::vector<std::thread> threads;
  std::vector<int> differ(8, 0);
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      if (cudaSetDevice(0) != cudaSuccess) {
        differ[t] = -1;
        return;
      }
      for (int i = 0; i < 1000; ++i)
        differ[t] += experts_cuda::fp8_prefill_tma_max_clusters(i % 2 == 0) != (i % 2 == 0 ? gate_up : down);
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 8; ++t) EXPECT_EQ(differ[t], 0) << "thread " << t << " (-1: cudaSetDevice failed)";
}

TEST(ExpertsCuda, BadDeviceIndicesAreSkippedAndReportedByTheNextApply) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  const int64_t H = 128;
  const auto experts = same_format(WeightFormat::bf16, 2, H, 64, 600);
  auto gpu = make_experts_cuda(experts, 0);
  Tensor x = to_dev(test::random_bf16(3, H, 601));
  Tensor idx_h = Tensor::empty({3, 2}, DType::int32), w_h = Tensor::empty({3, 2}, DType::fp32);
  const int32_t idx_vals[] = {0, 1, 2, -1, 1, -7};  // 2 and -7 are bad for L = 2
  for (int i = 0; i < 6; ++i) idx_h.ptr<int32_t>()[i] = idx_vals[i], w_h.ptr<float>()[i] = 0.5f;
  Tensor idx = to_dev(idx_h), w = to_dev(w_h), out = Tensor::empty({3, H}, DType::bf16, kDev);
  gpu->apply({ActivationLayout::Flat, x, {}, {}, idx, w}, out);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // The bad entries contributed nothing: row 1 (only bad or -1) is zero.
  const Tensor oh = out.to(Device::cpu());
  for (int64_t i = 0; i < H; ++i) ASSERT_EQ(oh.ptr<uint16_t>()[H + i], 0) << i;
  try {
    gpu->apply({ActivationLayout::Flat, x, {}, {}, idx, w}, out);
    ADD_FAILURE() << "expected InvalidArgument for topk_idx out of range";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("topk_idx["), std::string::npos) << e.what();
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // that failed call launched nothing; drain the first
  // recv_count above cap, clamped and reported.
  Tensor recv_h = Tensor::empty({2}, DType::int32);
  recv_h.ptr<int32_t>()[0] = 9, recv_h.ptr<int32_t>()[1] = 1;
  Tensor xe = to_dev(test::random_bf16(2 * 4, H, 602)), recv = to_dev(recv_h), oute = Tensor::empty({2, 4, H}, DType::bf16, kDev);
  TensorView xe3 = xe.view();
  xe3.ndim = 3, xe3.shape = {2, 4, H, 0}, xe3.strides = {4 * H, H, 1, 0};
  // Either apply may throw the pending topk_idx error first; the recv_count one must follow.
  bool saw_recv = false;
  for (int attempt = 0; attempt < 3 && !saw_recv; ++attempt) {
    try {
      gpu->apply({ActivationLayout::ExpertMajor, xe3, {}, recv, {}, {}}, oute);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    } catch (const InvalidArgument& e) {
      saw_recv = std::string(e.what()).find("recv_count[0]") != std::string::npos;
    }
  }
  EXPECT_TRUE(saw_recv);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // Contiguous: decreasing expert_offsets make that apply write nothing (a clamped reading could give
  // two experts the same rows), and the next apply names the entry.
  Tensor offs_h = Tensor::empty({2}, DType::int32);
  offs_h.ptr<int32_t>()[0] = 3, offs_h.ptr<int32_t>()[1] = 2;
  Tensor offs = to_dev(offs_h), outc = Tensor::empty({3, H}, DType::bf16, kDev);
  poison_dev(outc);
  ExpertsInput ic;
  ic.layout = ActivationLayout::Contiguous;
  ic.x = x, ic.expert_offsets = offs;
  gpu->apply(ic, outc);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor och = outc.to(Device::cpu());
  for (int64_t i = 0; i < 3 * H; ++i) ASSERT_EQ(och.ptr<uint16_t>()[i], 0xFFFFu) << "written: " << i;
  try {
    gpu->apply(ic, outc);
    ADD_FAILURE() << "expected InvalidArgument for expert_offsets[1] < expert_offsets[0]";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("expert_offsets[1]"), std::string::npos) << e.what();
  }
  offs_h.ptr<int32_t>()[1] = 4;  // past N = 3
  copy(offs, offs_h);
  gpu->apply(ic, outc);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_THROW(gpu->apply(ic, outc), InvalidArgument);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // The [L + 1] form: a first start past N, named by its index.
  Tensor offs3_h = Tensor::empty({3}, DType::int32);
  offs3_h.ptr<int32_t>()[0] = 4, offs3_h.ptr<int32_t>()[1] = 4, offs3_h.ptr<int32_t>()[2] = 4;
  Tensor offs3 = to_dev(offs3_h);
  ic.expert_offsets = offs3;
  gpu->apply(ic, outc);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  try {
    gpu->apply(ic, outc);
    ADD_FAILURE() << "expected InvalidArgument for expert_offsets[0] > N";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("expert_offsets[0]"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Tensor offs64 = Tensor::zeros({2}, DType::int64, kDev);
  ic.expert_offsets = offs64;
  EXPECT_THROW(gpu->apply(ic, outc), InvalidArgument);  // int32 only, refused on the host
}

TEST(ExpertsCuda, GraphCaptureAfterWarmUp) {
  if (gpus() < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus();
  const int64_t H = 256, cap = 48;
  const auto experts = same_format(WeightFormat::mxfp4, 3, H, 128, 700);
  auto cpu = make_experts_cpu(experts);
  auto gpu = make_experts_cuda(experts, 0);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Stream s{stream};

  Tensor x = to_dev(test::random_bf16(3 * cap, H, 701));
  TensorView x3 = x.view();
  x3.ndim = 3, x3.shape = {3, cap, H, 0}, x3.strides = {cap * H, H, 1, 0};
  Tensor recv = Tensor::zeros({3}, DType::int32, kDev), out = Tensor::empty({3, cap, H}, DType::bf16, kDev);
  const ExpertsInput in{ActivationLayout::ExpertMajor, x3, {}, recv, {}, {}};

  // Before any eager call the workspace must grow, which capture forbids.
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_THROW(gpu->apply(in, out, s), Unsupported);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  if (graph) cudaGraphDestroy(graph);

  gpu->apply(in, out, s);  // warm-up
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  gpu->apply(in, out, s);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  // Replays with new counts written on the device: the graph reads them there.
  const Tensor x_h = x.to(Device::cpu());
  for (const std::vector<int32_t>& counts : {std::vector<int32_t>{3, 0, 48}, std::vector<int32_t>{1, 47, 2}}) {
    Tensor recv_h = Tensor::empty({3}, DType::int32);
    std::copy(counts.begin(), counts.end(), recv_h.ptr<int32_t>());
    ASSERT_EQ(cudaMemcpyAsync(recv.data(), recv_h.data(), 12, cudaMemcpyHostToDevice, stream), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(out.data(), 0xFF, static_cast<size_t>(out.nbytes()), stream), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    Tensor ref = Tensor::empty({3, cap, H}, DType::bf16);
    test::poison(ref);
    TensorView xh3 = x_h.view();
    xh3.ndim = 3, xh3.shape = {3, cap, H, 0}, xh3.strides = {cap * H, H, 1, 0};
    cpu->apply({ActivationLayout::ExpertMajor, xh3, {}, recv_h, {}, {}}, ref);
    const Tensor oh = out.to(Device::cpu());
    for (int64_t l = 0; l < 3; ++l) {
      if (counts[l] == 0) continue;
      EXPECT_LE(test::rel_l2_error(rows_2d(oh, H, l * cap, l * cap + counts[l]), rows_2d(ref, H, l * cap, l * cap + counts[l])),
                kMaxRelL2)
          << "replay counts " << counts[0] << "," << counts[1] << "," << counts[2] << " expert " << l;
      const uint16_t* pad = oh.ptr<const uint16_t>() + (l * cap + counts[l]) * H;
      EXPECT_TRUE(std::all_of(pad, pad + (cap - counts[l]) * H, [](uint16_t v) { return v == 0xFFFFu; })) << "expert " << l;
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

#endif

}  // namespace
}  // namespace epx
