// src/cuda/runtime_cuda_test.cpp: the CUDA runtime of core (allocator, device count, NCCL version).
#include <gtest/gtest.h>

#include <cstring>

#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/tensor.h"
#include "test_util.h"

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
