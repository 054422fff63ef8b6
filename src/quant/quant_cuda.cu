// quant/quant_cuda.cu: FP8 1 x group_size per-token-group quantization on CUDA (DeepSeek-V3 tech
// report §3.3; the DeepGEMM / DeepEP activation layout), bit-identical to quant_cpu.cpp.
//
// One warp per group: pass 1 reduces amax over the group (4 elements per lane per step, vector
// loads), pass 2 reloads (L1 hits) and converts. Every rounding step is the CPU's: fmaxf-based amax
// (order-free), IEEE division for the scale and for x / scale (no fast math), UE8M0 rounding from the
// bits, and cvt.rn.satfinite.e4m3x2 for the code, which is RNE with saturation like
// float_to_fp8_e4m3_bits (epx/dtype.h) for every non-NaN input.
#include <cuda_fp8.h>

#include <string>

#include "cuda/check.h"
#include "epx/cuda.h"
#include "epx/dtype.h"
#include "epx/error.h"
#include "quant/quant_cuda.h"

namespace epx::quant {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr float kAmaxFloor = 1e-4f;  // quant_cpu.cpp: an all-zero group gets a layout-independent scale

struct QuantParams {
  const void* x;
  int64_t x_row_stride;  // elements
  uint8_t* q;
  int64_t q_row_stride;
  float* scales;
  int64_t scales_row_stride;
  int64_t num_groups;    // T * groups_per_row
  int groups_per_row;
  int group_size;
  bool ue8m0;
};

__device__ __forceinline__ float round_up_pow2(float s) {
  uint32_t u = __float_as_uint(s);
  if (u & 0x007fffffu) u = (u & 0xff800000u) + 0x00800000u;
  return __uint_as_float(u);
}

__device__ __forceinline__ void load4(const float* p, float v[4]) {
  const float4 f = *reinterpret_cast<const float4*>(p);
  v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
}
__device__ __forceinline__ void load4(const uint16_t* p, float v[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  v[0] = __uint_as_float(u.x << 16), v[1] = __uint_as_float(u.x & 0xffff0000u);
  v[2] = __uint_as_float(u.y << 16), v[3] = __uint_as_float(u.y & 0xffff0000u);
}
__device__ __forceinline__ float load1(const float* p) { return *p; }
__device__ __forceinline__ float load1(const uint16_t* p) { return __uint_as_float(static_cast<uint32_t>(*p) << 16); }

__device__ __forceinline__ uint32_t fp8x2(float a, float b) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) quantize_kernel(QuantParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + (threadIdx.x >> 5); g < p.num_groups; g += warps) {
    const int64_t t = g / p.groups_per_row;
    const int64_t gi = g - t * p.groups_per_row;
    const T* xg = static_cast<const T*>(p.x) + t * p.x_row_stride + gi * p.group_size;
    uint8_t* qg = p.q + t * p.q_row_stride + gi * p.group_size;

    float amax = 0.0f;
    if constexpr (kVec) {
      for (int c = lane * 4; c < p.group_size; c += 128) {
        float v[4];
        load4(xg + c, v);
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
      }
    } else {
      for (int c = lane; c < p.group_size; c += 32) amax = fmaxf(amax, fabsf(load1(xg + c)));
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));

    float scale = __fdiv_rn(fmaxf(amax, kAmaxFloor), kFp8E4m3Max);
    if (p.ue8m0 && isfinite(scale)) scale = round_up_pow2(scale);
    if (lane == 0) p.scales[t * p.scales_row_stride + gi] = scale;

    if constexpr (kVec) {
      for (int c = lane * 4; c < p.group_size; c += 128) {
        float v[4];
        load4(xg + c, v);
        const uint32_t lo = fp8x2(__fdiv_rn(v[0], scale), __fdiv_rn(v[1], scale));
        const uint32_t hi = fp8x2(__fdiv_rn(v[2], scale), __fdiv_rn(v[3], scale));
        *reinterpret_cast<uint32_t*>(qg + c) = lo | (hi << 16);
      }
    } else {
      for (int c = lane; c < p.group_size; c += 32) {
        const float y = __fdiv_rn(load1(xg + c), scale);
        qg[c] = static_cast<uint8_t>(fp8x2(y, 0.0f) & 0xffu);
      }
    }
  }
}

struct DequantParams {
  const uint8_t* q;
  int64_t q_row_stride;
  const float* scales;
  int64_t scales_row_stride;
  void* out;
  int64_t out_row_stride;
  int64_t num_tokens, hidden;
  int group_size;
};

template <class T>
__device__ __forceinline__ void store1(T* p, float v);
template <>
__device__ __forceinline__ void store1<float>(float* p, float v) { *p = v; }
template <>
__device__ __forceinline__ void store1<uint16_t>(uint16_t* p, float v) { *p = float_to_bf16_bits(v); }

template <class T>
__global__ void dequantize_kernel(DequantParams p) {
  const int64_t n = p.num_tokens * p.hidden;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / p.hidden, h = i - t * p.hidden;
    const float v = fp8_e4m3_bits_to_float(p.q[t * p.q_row_stride + h]) * p.scales[t * p.scales_row_stride + h / p.group_size];
    store1(static_cast<T*>(p.out) + t * p.out_row_stride + h, v);
  }
}

/// [rows, cols] on a CUDA device, unit stride along the row, dtype one of `dtypes`.
void check_matrix(std::string_view op, std::string_view arg, const TensorView& t, std::initializer_list<DType> dtypes,
                  Device device) {
  check_dtype(op, arg, t, dtypes);
  require_arg(op, std::string(arg) + ".ndim", t.ndim, t.ndim == 2, "must be 2");
  check_device(op, arg, t, device);
  require_arg(op, std::string(arg) + ".strides[1]", t.strides[1], t.strides[1] == 1 || t.shape[1] <= 1, "must be 1");
  require_arg(op, std::string(arg) + ".strides[0]", t.strides[0], t.strides[0] >= t.shape[1] || t.shape[0] <= 1,
              "must be >= shape[1] = " + std::to_string(t.shape[1]));
}

bool aligned(const void* p, int64_t row_stride_bytes, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0 && row_stride_bytes % bytes == 0;
}

unsigned num_blocks(int64_t work_items, int64_t per_block) { return cuda::grid_for(work_items, per_block, 132 * 32); }

}  // namespace

void quantize_fp8_per_token_group_cuda(const TensorView& x, const TensorView& q, const TensorView& scales, int group_size,
                                       bool ue8m0, Stream stream) {
  constexpr std::string_view op = "quantize_fp8_per_token_group";
  cuda::ensure_runtime();
  require_arg(op, "x.device", x.device.str(), x.device.is_cuda(), "must be a CUDA device");
  check_matrix(op, "x", x, {DType::bf16, DType::fp32}, x.device);
  check_matrix(op, "q", q, {DType::fp8_e4m3}, x.device);
  check_matrix(op, "scales", scales, {DType::fp32}, x.device);
  const int64_t num_tokens = x.shape[0], hidden = x.shape[1];
  require_arg(op, "group_size", group_size, group_size > 0, "must be > 0");
  require_arg(op, "x.shape[1]", hidden, hidden % group_size == 0, "must be a multiple of group_size = " + std::to_string(group_size));
  check_shape(op, "q", q, {num_tokens, hidden});
  check_shape(op, "scales", scales, {num_tokens, hidden / group_size});
  if (num_tokens == 0 || hidden == 0) return;

  QuantParams p;
  p.x = x.data;
  p.x_row_stride = x.strides[0];
  p.q = static_cast<uint8_t*>(q.data);
  p.q_row_stride = q.strides[0];
  p.scales = static_cast<float*>(scales.data);
  p.scales_row_stride = scales.strides[0];
  p.groups_per_row = static_cast<int>(hidden / group_size);
  p.num_groups = num_tokens * p.groups_per_row;
  p.group_size = group_size;
  p.ue8m0 = ue8m0;

  const int64_t es = dtype_size(x.dtype);
  const bool vec = group_size % 4 == 0 && aligned(x.data, x.strides[0] * es, 4 * es) && aligned(q.data, q.strides[0], 4);
  const unsigned blocks = num_blocks(p.num_groups, kWarpsPerBlock);
  const cudaStream_t s = cuda::native(stream);
  cuda::DeviceGuard guard(x.device.index);
  constexpr unsigned kThreads = kWarpsPerBlock * 32;
  if (x.dtype == DType::fp32) {
    if (vec) quantize_kernel<float, true><<<blocks, kThreads, 0, s>>>(p);
    else quantize_kernel<float, false><<<blocks, kThreads, 0, s>>>(p);
  } else {
    if (vec) quantize_kernel<uint16_t, true><<<blocks, kThreads, 0, s>>>(p);
    else quantize_kernel<uint16_t, false><<<blocks, kThreads, 0, s>>>(p);
  }
  cuda::check_launch("quantize_kernel");
}

void dequantize_fp8_per_token_group_cuda(const TensorView& q, const TensorView& scales, const TensorView& out,
                                         int group_size, Stream stream) {
  constexpr std::string_view op = "dequantize_fp8_per_token_group";
  cuda::ensure_runtime();
  require_arg(op, "q.device", q.device.str(), q.device.is_cuda(), "must be a CUDA device");
  check_matrix(op, "q", q, {DType::fp8_e4m3}, q.device);
  check_matrix(op, "scales", scales, {DType::fp32}, q.device);
  check_matrix(op, "out", out, {DType::bf16, DType::fp32}, q.device);
  const int64_t num_tokens = q.shape[0], hidden = q.shape[1];
  require_arg(op, "group_size", group_size, group_size > 0, "must be > 0");
  require_arg(op, "q.shape[1]", hidden, hidden % group_size == 0, "must be a multiple of group_size = " + std::to_string(group_size));
  check_shape(op, "scales", scales, {num_tokens, hidden / group_size});
  check_shape(op, "out", out, {num_tokens, hidden});
  if (num_tokens == 0 || hidden == 0) return;

  DequantParams p;
  p.q = static_cast<const uint8_t*>(q.data);
  p.q_row_stride = q.strides[0];
  p.scales = static_cast<const float*>(scales.data);
  p.scales_row_stride = scales.strides[0];
  p.out = out.data;
  p.out_row_stride = out.strides[0];
  p.num_tokens = num_tokens;
  p.hidden = hidden;
  p.group_size = group_size;
  const unsigned blocks = num_blocks(num_tokens * hidden, 256);
  const cudaStream_t s = cuda::native(stream);
  cuda::DeviceGuard guard(q.device.index);
  if (out.dtype == DType::fp32) dequantize_kernel<float><<<blocks, 256, 0, s>>>(p);
  else dequantize_kernel<uint16_t><<<blocks, 256, 0, s>>>(p);
  cuda::check_launch("dequantize_kernel");
}

}  // namespace epx::quant
