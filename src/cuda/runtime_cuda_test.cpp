// src/cuda/runtime_cuda_test.cpp: the CUDA runtime of core (allocator, device count, NCCL version).
#include <gtest/gtest.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/tensor.h"
#include "test_util.h"

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace epx {
namespace {

#ifdef EPX_WITH_CUDA

TEST(CudaRuntime, NcclLibraryMatchesHeaders) {
  EXPECT_TRUE(cuda::built_with_cuda());
  ASSERT_NO_THROW(cuda::ensure_runtime());
  EXPECT_EQ(cuda::nccl_runtime_version(), cuda::nccl_header_version());
  EXPECT_GE(cuda::nccl_header_version(), 22809);
  std::printf("NCCL headers %d, library %d\n", cuda::nccl_header_version(), cuda::nccl_runtime_version());
}

TEST(CudaRuntime, TensorRoundTripThroughDevice) {
  const int gpus = cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus;
  cuda::ensure_runtime();
  const Tensor host = test::random_bf16(37, 1000, /*seed=*/11);
  const Tensor dev = host.to(Device::cuda(gpus - 1));
  EXPECT_EQ(dev.device(), Device::cuda(gpus - 1));
  const Tensor back = dev.to(Device::cpu());
  ASSERT_EQ(back.nbytes(), host.nbytes());
  EXPECT_EQ(std::memcmp(back.data(), host.data(), static_cast<size_t>(host.nbytes())), 0);

  const Tensor z = Tensor::zeros({5, 333}, DType::fp32, Device::cuda(0)).to(Device::cpu());
  for (int64_t i = 0; i < z.numel(); ++i) ASSERT_EQ(z.ptr<float>()[i], 0.0f) << i;

  // Device-to-device copy through epx::copy.
  Tensor dev2 = Tensor::empty({37, 1000}, DType::bf16, Device::cuda(0));
  copy(dev2.view(), dev.view());
  const Tensor back2 = dev2.to(Device::cpu());
  EXPECT_EQ(std::memcmp(back2.data(), host.data(), static_cast<size_t>(host.nbytes())), 0);
}

// Tensor::to, copy and Tensor::zeros on CUDA are complete on return, so a cudaStreamNonBlocking
// stream (which does not wait for the legacy default stream they run on) may read the result at
// once: the last 4 KiB of 1 GiB, read on such a stream right after each call, hold the new bytes.
// (cudaMemcpy device -> device and cudaMemset alone only queue the work: that read would see the old bytes.)
TEST(CudaRuntime, CopiesAndZerosAreCompleteOnReturnForNonBlockingStreams) {
  const int gpus = cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus;
  cuda::ensure_runtime();
  const Device dev = Device::cuda(0);
  // A failed CUDA call stops the test (gtest reports the exception): an ASSERT_EQ in this lambda only
  // returned from the lambda, and the test went on with a null buffer or an unfilled one.
  auto ok = [](cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  };
  ok(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t s = nullptr;
  ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  constexpr int64_t kBytes = int64_t{1} << 30, kTail = 4096;
  void* pinned = nullptr;
  ok(cudaMallocHost(&pinned, kTail), "cudaMallocHost");
  uint8_t* tail = static_cast<uint8_t*>(pinned);
  auto tail_bytes = [&](const Tensor& t) {  // on s, at once
    std::memset(tail, 0xEE, kTail);
    EXPECT_EQ(cudaMemcpyAsync(tail, t.ptr<uint8_t>() + t.nbytes() - kTail, kTail, cudaMemcpyDeviceToHost, s), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    int differ = 0;
    for (int64_t i = 0; i < kTail; ++i) differ += tail[i] != tail[0];
    return differ == 0 ? static_cast<int>(tail[0]) : -1;
  };
  {
    Tensor src = Tensor::empty({kBytes}, DType::uint8, dev), dst = Tensor::empty({kBytes}, DType::uint8, dev);
    ok(cudaMemsetAsync(src.data(), 0x5A, kBytes, s), "fill src");
    ok(cudaMemsetAsync(dst.data(), 0x11, kBytes, s), "fill dst");
    ok(cudaStreamSynchronize(s), "sync fills");
    copy(dst.view(), src.view());  // device -> device
    EXPECT_EQ(tail_bytes(dst), 0x5A) << "copy device -> device";
  }
  {
    Tensor host = Tensor::empty({kBytes / 4}, DType::uint8);  // pageable
    std::memset(host.data(), 0x77, static_cast<size_t>(host.nbytes()));
    EXPECT_EQ(tail_bytes(host.to(dev)), 0x77) << "Tensor::to host -> device";
  }
  {
    // zeros right where a 0x5A buffer was just freed (the allocator tends to hand it back).
    Tensor a = Tensor::empty({kBytes}, DType::uint8, dev);
    ok(cudaMemsetAsync(a.data(), 0x5A, kBytes, s), "fill");
    ok(cudaStreamSynchronize(s), "sync fill");
    a = Tensor();
    const Tensor z = Tensor::zeros({kBytes}, DType::uint8, dev);
    EXPECT_EQ(tail_bytes(z), 0) << "Tensor::zeros";
  }
  ok(cudaFreeHost(tail), "cudaFreeHost");
  ok(cudaStreamDestroy(s), "stream destroy");
}

TEST(CudaRuntime, DeviceCountIsStable) {
  const int first = cuda::device_count();
  EXPECT_GE(first, 0);
  EXPECT_EQ(cuda::device_count(), first);
}

#else

TEST(CudaRuntime, CpuOnlyBuildSaysSo) {
  EXPECT_FALSE(cuda::built_with_cuda());
  EXPECT_EQ(cuda::device_count(), 0);
  EXPECT_THROW(cuda::ensure_runtime(), Unsupported);
  EXPECT_THROW(Tensor::empty({4}, DType::fp32, Device::cuda(0)), Unsupported);
}

#endif

}  // namespace
}  // namespace epx
