// experts/identity_cuda.cu: the identity expert on CUDA (one pass over x); see identity.h.
#include "cuda/check.h"
#include "epx/dtype.h"
#include "epx/quant.h"
#include "experts/identity.h"

namespace epx::experts_detail {
namespace {

struct IdentityParams {
  const void* x;
  const float* x_scales;  // fp8 only
  bool fp8;
  int64_t hidden;
  // ExpertMajor
  const int32_t* recv_count;
  int64_t cap;
  // Flat
  const void* topk_idx;
  bool idx64;
  const float* topk_weights;
  int64_t top_k;
  int num_local;
  uint16_t* out;      // bf16 out, or null
  float* out_f32;     // Flat fp32 out (the unrounded partial), or null
};

__device__ __forceinline__ float load_x(const IdentityParams& p, int64_t row, int64_t h) {
  if (p.fp8) {
    const uint8_t q = static_cast<const uint8_t*>(p.x)[row * p.hidden + h];
    return round_bf16(fp8_e4m3_bits_to_float(q) * p.x_scales[row * (p.hidden / kFp8GroupSize) + h / kFp8GroupSize]);
  }
  return bf16_bits_to_float(static_cast<const uint16_t*>(p.x)[row * p.hidden + h]);
}

// grid.x: rows (l * cap + j), threads over h.
__global__ void identity_expert_major_kernel(IdentityParams p) {
  const int64_t row = blockIdx.x;
  const int64_t l = row / p.cap, j = row % p.cap;
  int64_t n = p.recv_count[l];
  n = n < 0 ? 0 : (n > p.cap ? p.cap : n);
  if (j >= n) return;
  for (int64_t h = threadIdx.x; h < p.hidden; h += blockDim.x) p.out[row * p.hidden + h] = float_to_bf16_bits(load_x(p, row, h));
}

__global__ void identity_flat_kernel(IdentityParams p) {
  const int64_t row = blockIdx.x;
  for (int64_t h = threadIdx.x; h < p.hidden; h += blockDim.x) {
    float acc = 0.0f;
    bool loaded = false;
    float y = 0.0f;
    for (int64_t k = 0; k < p.top_k; ++k) {
      const int64_t l = p.idx64 ? static_cast<const int64_t*>(p.topk_idx)[row * p.top_k + k]
                                : static_cast<const int32_t*>(p.topk_idx)[row * p.top_k + k];
      if (l < 0 || l >= p.num_local) continue;
      if (!loaded) y = load_x(p, row, h);
      loaded = true;
      // No fused multiply-add: the CPU twin rounds the product, then the sum (bit-identical outputs).
      acc = __fadd_rn(acc, __fmul_rn(p.topk_weights[row * p.top_k + k], y));
    }
    if (p.out_f32) p.out_f32[row * p.hidden + h] = acc;
    else p.out[row * p.hidden + h] = float_to_bf16_bits(acc);
  }
}

}  // namespace

void identity_apply_cuda(const ExpertsInput& in, const TensorView& out, int num_local_experts, Stream stream) {
  IdentityParams p{};
  p.x = in.x.data;
  p.fp8 = in.x.dtype == DType::fp8_e4m3;
  p.x_scales = p.fp8 ? in.x_scales.ptr<const float>() : nullptr;
  p.hidden = in.x.size(-1);
  p.num_local = num_local_experts;
  p.out = out.dtype == DType::bf16 ? out.ptr<uint16_t>() : nullptr;
  p.out_f32 = out.dtype == DType::fp32 ? out.ptr<float>() : nullptr;
  int64_t rows = 0;
  if (in.layout == ActivationLayout::ExpertMajor) {
    p.recv_count = in.recv_count.ptr<const int32_t>();
    p.cap = in.x.size(1);
    rows = in.x.size(0) * p.cap;
  } else {
    p.topk_idx = in.topk_idx.data;
    p.idx64 = in.topk_idx.dtype == DType::int64;
    p.topk_weights = in.topk_weights.ptr<const float>();
    p.top_k = in.topk_idx.size(1);
    rows = in.x.size(0);
  }
  if (rows == 0 || p.hidden == 0) return;
  cuda::DeviceGuard guard(in.x.device.index);
  const cudaStream_t s = cuda::native(stream);
  if (in.layout == ActivationLayout::ExpertMajor)
    identity_expert_major_kernel<<<static_cast<unsigned>(rows), 256, 0, s>>>(p);
  else
    identity_flat_kernel<<<static_cast<unsigned>(rows), 256, 0, s>>>(p);
  cuda::check_launch("identity_experts");
}

}  // namespace epx::experts_detail
