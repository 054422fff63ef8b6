// quant/quant_cuda_test.cpp: the CUDA FP8 per-token-group kernels against the CPU reference
// (quant_cpu.cpp), bit for bit, on fresh random inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/quant.h"
#include "test_util.h"

#ifdef EPX_WITH_CUDA
#include "quant/quant_cuda.h"
#endif

namespace epx {
namespace {

#ifdef EPX_WITH_CUDA

/// [T, H] values with a spread of group magnitudes: ordinary, large outliers, tiny (below the 1e-4
/// amax floor) and all-zero groups, so every branch of the scale rule is hit.
Tensor awkward_input(int64_t T, int64_t H, DType dtype, uint64_t seed) {
  Tensor x = test::random_f32(T, H, seed);
  std::mt19937_64 g(seed ^ 0x5eed);
  float* p = x.ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < H; c += 32) {
      const uint64_t kind = g() % 16;
      const float mul = kind == 0 ? 1e3f : kind == 1 ? 1e-6f : kind == 2 ? 0.0f : kind == 3 ? 3e4f : 1.0f;
      for (int64_t i = c; i < std::min(H, c + 32); ++i) p[t * H + i] *= mul;
    }
  }
  if (dtype == DType::fp32) return x;
  Tensor b = Tensor::empty({T, H}, DType::bf16);
  for (int64_t i = 0; i < T * H; ++i) b.ptr<uint16_t>()[i] = float_to_bf16_bits(p[i]);
  return b;
}

struct Case {
  int64_t T, H;
  int group_size;
  DType dtype;
  bool ue8m0;
  int64_t row_pad;    // x row stride = H + row_pad
  int64_t elem_skew;  // x starts this many elements into its allocation (breaks vector alignment)
};

std::string describe(const Case& c) {
  return "T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " group=" + std::to_string(c.group_size) + " " +
         std::string(dtype_name(c.dtype)) + (c.ue8m0 ? " ue8m0" : "") + " pad=" + std::to_string(c.row_pad) +
         " skew=" + std::to_string(c.elem_skew);
}

void run_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  const Tensor x = awkward_input(c.T, c.H, c.dtype, seed);
  const int64_t G = c.H / c.group_size;
  Tensor q_ref = Tensor::empty({c.T, c.H}, DType::fp8_e4m3);
  Tensor s_ref = Tensor::empty({c.T, G}, DType::fp32);
  quantize_fp8_per_token_group(x, q_ref, s_ref, c.group_size, c.ue8m0);

  // Device input with the requested row stride and start offset.
  const int64_t stride = c.H + c.row_pad;
  const Device dev = Device::cuda(0);
  Tensor storage = Tensor::zeros({c.T * stride + c.elem_skew + 1}, c.dtype, dev);
  TensorView xd = x.view();
  xd.device = dev;
  xd.data = static_cast<char*>(storage.data()) + c.elem_skew * dtype_size(c.dtype);
  xd.strides[0] = stride;
  const int64_t es = dtype_size(c.dtype);
  for (int64_t t = 0; t < c.T; ++t) {
    TensorView dst(static_cast<char*>(xd.data) + t * stride * es, c.dtype, {c.H}, dev);
    copy(dst, x.view().row(t));
  }
  Tensor q = Tensor::empty({c.T, c.H}, DType::fp8_e4m3, dev);
  Tensor s = Tensor::empty({c.T, G}, DType::fp32, dev);
  device_allocator(DeviceKind::cuda)->memset(q.data(), 0xFF, q.nbytes());  // NaN codes: unwritten bytes show
  device_allocator(DeviceKind::cuda)->memset(s.data(), 0xFF, s.nbytes());
  quant::quantize_fp8_per_token_group_cuda(xd, q, s, c.group_size, c.ue8m0, {});
  const Tensor qh = q.to(Device::cpu()), sh = s.to(Device::cpu());

  int64_t bad_q = 0, bad_s = 0;
  for (int64_t i = 0; i < c.T * c.H; ++i) bad_q += qh.ptr<uint8_t>()[i] != q_ref.ptr<uint8_t>()[i];
  for (int64_t i = 0; i < c.T * G; ++i)
    bad_s += std::memcmp(sh.ptr<float>() + i, s_ref.ptr<float>() + i, 4) != 0;
  EXPECT_EQ(bad_q, 0) << "fp8 codes differ from the CPU reference";
  EXPECT_EQ(bad_s, 0) << "scales differ from the CPU reference";

  // Dequantization, both output dtypes, against the CPU.
  for (DType out_dtype : {DType::fp32, DType::bf16}) {
    Tensor out_ref = Tensor::empty({c.T, c.H}, out_dtype);
    dequantize_fp8_per_token_group(q_ref, s_ref, out_ref, c.group_size);
    Tensor out = Tensor::empty({c.T, c.H}, out_dtype, dev);
    quant::dequantize_fp8_per_token_group_cuda(q, s, out, c.group_size, {});
    const Tensor oh = out.to(Device::cpu());
    EXPECT_EQ(std::memcmp(oh.data(), out_ref.data(), static_cast<size_t>(out_ref.nbytes())), 0)
        << "dequantize to " << dtype_name(out_dtype);
  }
}

TEST(QuantCuda, Fp8PerTokenGroupMatchesCpuBitForBit) {
  const int gpus = cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus;
  cuda::ensure_runtime();
  const Case cases[] = {
      {257, 7168, 128, DType::bf16, false, 0, 0},   // DeepSeek-V3 hidden, odd T
      {257, 7168, 128, DType::bf16, true, 0, 0},    // UE8M0 scales
      {64, 4096, 128, DType::fp32, false, 0, 0},
      {64, 4096, 128, DType::fp32, true, 0, 0},
      {33, 2048, 64, DType::bf16, false, 256, 0},   // strided rows, group 64
      {17, 1536, 32, DType::bf16, true, 0, 1},      // misaligned start: scalar path
      {9, 384, 96, DType::fp32, false, 8, 3},       // group not a multiple of 32, scalar path
      {1, 128, 128, DType::bf16, false, 0, 0},
  };
  uint64_t seed = 20260;
  for (const Case& c : cases) run_case(c, seed++);
}

TEST(QuantCuda, PublicEntryPointTakesCudaTensors) {
  const int gpus = cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus;
  const Device dev = Device::cuda(0);
  const Tensor x = test::random_bf16(48, 1024, /*seed=*/77);
  Tensor q_ref = Tensor::empty({48, 1024}, DType::fp8_e4m3), s_ref = Tensor::empty({48, 8}, DType::fp32);
  quantize_fp8_per_token_group(x, q_ref, s_ref, 128, true);
  const Tensor xd = x.to(dev);
  Tensor q = Tensor::empty({48, 1024}, DType::fp8_e4m3, dev), s = Tensor::empty({48, 8}, DType::fp32, dev);
  quantize_fp8_per_token_group(xd, q, s, 128, true);  // epx/quant.h hands CUDA tensors to quant_cuda.h
  const Tensor qh = q.to(Device::cpu()), sh = s.to(Device::cpu());
  EXPECT_EQ(std::memcmp(qh.data(), q_ref.data(), static_cast<size_t>(q_ref.nbytes())), 0);
  EXPECT_EQ(std::memcmp(sh.data(), s_ref.data(), static_cast<size_t>(s_ref.nbytes())), 0);
  Tensor out = Tensor::empty({48, 1024}, DType::bf16, dev), out_ref = Tensor::empty({48, 1024}, DType::bf16);
  dequantize_fp8_per_token_group(q, s, out, 128);
  dequantize_fp8_per_token_group(q_ref, s_ref, out_ref, 128);
  const Tensor oh = out.to(Device::cpu());
  EXPECT_EQ(std::memcmp(oh.data(), out_ref.data(), static_cast<size_t>(out_ref.nbytes())), 0);
  Tensor q_cpu = Tensor::empty({48, 1024}, DType::fp8_e4m3);  // mixed devices: a clear error
  EXPECT_THROW(quantize_fp8_per_token_group(xd, q_cpu, s, 128, false), InvalidArgument);
}

TEST(QuantCuda, AllZeroGroupGivesZerosAndFloorScale) {
  const int gpus = cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus;
  const Device dev = Device::cuda(0);
  Tensor x = Tensor::zeros({3, 256}, DType::bf16, dev);
  Tensor q = Tensor::empty({3, 256}, DType::fp8_e4m3, dev);
  Tensor s = Tensor::empty({3, 2}, DType::fp32, dev);
  quant::quantize_fp8_per_token_group_cuda(x, q, s, 128, false, {});
  const Tensor qh = q.to(Device::cpu()), sh = s.to(Device::cpu());
  for (int64_t i = 0; i < qh.numel(); ++i) ASSERT_EQ(qh.ptr<uint8_t>()[i], 0) << i;
  for (int64_t i = 0; i < sh.numel(); ++i) ASSERT_EQ(sh.ptr<float>()[i], 1e-4f / 448.0f) << i;
}

TEST(QuantCuda, RejectsBadArguments) {
  const int gpus = cuda::device_count();
  if (gpus < 1) GTEST_SKIP() << "needs 1 GPU, found " << gpus;
  const Device dev = Device::cuda(0);
  Tensor x = Tensor::empty({4, 200}, DType::bf16, dev);
  Tensor q = Tensor::empty({4, 200}, DType::fp8_e4m3, dev);
  Tensor s = Tensor::empty({4, 1}, DType::fp32, dev);
  EXPECT_THROW(quant::quantize_fp8_per_token_group_cuda(x, q, s, 128, false, {}), InvalidArgument);  // 200 % 128
  Tensor xc = Tensor::empty({4, 256}, DType::bf16);
  Tensor q2 = Tensor::empty({4, 256}, DType::fp8_e4m3, dev);
  Tensor s2 = Tensor::empty({4, 2}, DType::fp32, dev);
  EXPECT_THROW(quant::quantize_fp8_per_token_group_cuda(xc, q2, s2, 128, false, {}), InvalidArgument);  // CPU x
  Tensor empty_x = Tensor::empty({0, 256}, DType::bf16, dev);
  Tensor empty_q = Tensor::empty({0, 256}, DType::fp8_e4m3, dev);
  Tensor empty_s = Tensor::empty({0, 2}, DType::fp32, dev);
  EXPECT_NO_THROW(quant::quantize_fp8_per_token_group_cuda(empty_x, empty_q, empty_s, 128, false, {}));  // T = 0
}

#else

TEST(QuantCuda, SkippedInCpuOnlyBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }

#endif

}  // namespace
}  // namespace epx
