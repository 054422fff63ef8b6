// src/quant/quant_cpu.cpp: CPU implementations of include/epx/quant.h (the reference the CUDA
// kernels are checked against).
//
// FP8 activations  : DeepSeek-V3 tech report §3.3; DeepEP/DeepGEMM per-token-group 1 x 128 layout.
// FP8 weights      : DeepSeek-V3 checkpoints, 128 x 128 blocks with `weight_scale_inv`.
// MXFP4            : OCP Microscaling Formats (MX) spec v1.0 (scale = floor(log2 amax) - emax_elem).
// Element conversions come from epx/dtype.h only, so the CPU and CUDA sides round alike. The
// per-token-group functions hand CUDA tensors to their twins in quant_cuda.h (EPX_CUDA builds).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/quant.h"
#ifdef EPX_WITH_CUDA
#include "quant/quant_cuda.h"
#endif

namespace epx {
namespace {

/// Smallest amax a scale is derived from: an all-zero group/block gets scale 1e-4/448, so its
/// codes are exact zeros and the scale does not depend on where the group sits (BEHAVIOUR.md).
constexpr float kAmaxFloor = 1e-4f;

/// e8m0 code given to an MXFP4 block whose elements are all zero: 2^0 = 1.0. Any scale encodes
/// zero exactly; 1.0 is chosen because it is layout independent and stays a normal number in
/// every consumer (e8m0 0x00 = 2^-127 is a float denormal and becomes 0 in kernels that build
/// the scale by shifting the byte into a bf16 exponent).
constexpr uint8_t kMxfp4ZeroBlockScale = 127;

/// 2^ceil(log2(s)) for a positive, finite, normal s, exactly (from the bits, not from log2f).
float round_up_pow2(float s) {
  uint32_t u = f32_bits(s);
  if (u & 0x007fffffu) u = (u & 0xff800000u) + 0x00800000u;
  return bits_f32(u);
}

float load_f32(const TensorView& t, int64_t i) {
  return t.dtype == DType::bf16 ? bf16_bits_to_float(t.ptr<const uint16_t>()[i]) : t.ptr<const float>()[i];
}

void check_cpu_matrix(std::string_view op, std::string_view arg, const TensorView& t, std::initializer_list<DType> dtypes) {
  if (t.device.is_cuda())
    throw Unsupported(arg_message(op, std::string(arg) + ".device", t.device.str(), "this function runs on the CPU only"));
  check_dtype(op, arg, t, dtypes);
  require_arg(op, std::string(arg) + ".ndim", t.ndim, t.ndim == 2, "must be 2");
  check_contiguous(op, arg, t);
}

/// True when the per-token-group call goes to the CUDA twin (quant_cuda.h), which validates its
/// own arguments (including that all tensors share one device).
bool route_to_cuda(std::string_view op, std::initializer_list<const TensorView*> tensors) {
  bool any_cuda = false;
  for (const TensorView* t : tensors) any_cuda = any_cuda || t->device.is_cuda();
#ifndef EPX_WITH_CUDA
  if (any_cuda) throw Unsupported(std::string(op) + ": device = cuda: this build has no CUDA runtime (configure with EPX_CUDA=ON)");
#endif
  (void)op;
  return any_cuda;
}

void check_group_size(std::string_view op, int64_t hidden, int group_size) {
  require_arg(op, "group_size", group_size, group_size > 0, "must be > 0");
  require_arg(op, "x.shape[1]", hidden, hidden % group_size == 0,
              "must be a multiple of group_size = " + std::to_string(group_size));
}

}  // namespace

// ---- FP8 per-token-group (activations) -----------------------------------------------------------

void quantize_fp8_row(const float* x, int64_t hidden, uint8_t* q, float* scales, int group_size, bool ue8m0) {
  const int64_t num_groups = hidden / group_size;
  for (int64_t g = 0; g < num_groups; ++g) {
    const float* xg = x + g * group_size;
    float amax = 0.0f;
    for (int i = 0; i < group_size; ++i) amax = std::max(amax, std::fabs(xg[i]));
    float scale = std::max(amax, kAmaxFloor) / kFp8E4m3Max;
    if (ue8m0 && std::isfinite(scale)) scale = round_up_pow2(scale);
    scales[g] = scale;
    uint8_t* qg = q + g * group_size;
    for (int i = 0; i < group_size; ++i) qg[i] = float_to_fp8_e4m3_bits(xg[i] / scale);
  }
}

void dequantize_fp8_row(const uint8_t* q, const float* scales, int64_t hidden, float* out, int group_size) {
  for (int64_t i = 0; i < hidden; ++i) out[i] = fp8_e4m3_bits_to_float(q[i]) * scales[i / group_size];
}

void quantize_fp8_per_token_group(const TensorView& x, const TensorView& q, const TensorView& scales, int group_size,
                                  bool ue8m0, Stream stream) {
  constexpr std::string_view op = "quantize_fp8_per_token_group";
  if (route_to_cuda(op, {&x, &q, &scales})) {
#ifdef EPX_WITH_CUDA
    quant::quantize_fp8_per_token_group_cuda(x, q, scales, group_size, ue8m0, stream);
#endif
    return;
  }
  check_cpu_matrix(op, "x", x, {DType::bf16, DType::fp32});
  check_cpu_matrix(op, "q", q, {DType::fp8_e4m3});
  check_cpu_matrix(op, "scales", scales, {DType::fp32});
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  check_group_size(op, hidden, group_size);
  check_shape(op, "q", q, {num_tokens, hidden});
  check_shape(op, "scales", scales, {num_tokens, hidden / group_size});
  std::vector<float> row(static_cast<size_t>(hidden));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* src = nullptr;
    if (x.dtype == DType::fp32) {
      src = x.ptr<const float>() + t * hidden;
    } else {
      const uint16_t* xb = x.ptr<const uint16_t>() + t * hidden;
      for (int64_t i = 0; i < hidden; ++i) row[i] = bf16_bits_to_float(xb[i]);
      src = row.data();
    }
    quantize_fp8_row(src, hidden, q.ptr<uint8_t>() + t * hidden, scales.ptr<float>() + t * (hidden / group_size),
                     group_size, ue8m0);
  }
}

void dequantize_fp8_per_token_group(const TensorView& q, const TensorView& scales, const TensorView& out, int group_size,
                                    Stream stream) {
  constexpr std::string_view op = "dequantize_fp8_per_token_group";
  if (route_to_cuda(op, {&q, &scales, &out})) {
#ifdef EPX_WITH_CUDA
    quant::dequantize_fp8_per_token_group_cuda(q, scales, out, group_size, stream);
#endif
    return;
  }
  check_cpu_matrix(op, "q", q, {DType::fp8_e4m3});
  check_cpu_matrix(op, "scales", scales, {DType::fp32});
  check_cpu_matrix(op, "out", out, {DType::bf16, DType::fp32});
  const int64_t num_tokens = q.size(0), hidden = q.size(1);
  check_group_size(op, hidden, group_size);
  check_shape(op, "scales", scales, {num_tokens, hidden / group_size});
  check_shape(op, "out", out, {num_tokens, hidden});
  std::vector<float> row(static_cast<size_t>(hidden));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const uint8_t* qt = q.ptr<const uint8_t>() + t * hidden;
    const float* st = scales.ptr<const float>() + t * (hidden / group_size);
    if (out.dtype == DType::fp32) {
      dequantize_fp8_row(qt, st, hidden, out.ptr<float>() + t * hidden, group_size);
    } else {
      dequantize_fp8_row(qt, st, hidden, row.data(), group_size);
      uint16_t* ob = out.ptr<uint16_t>() + t * hidden;
      for (int64_t i = 0; i < hidden; ++i) ob[i] = float_to_bf16_bits(row[i]);
    }
  }
}

// ---- FP8 128 x 128 blocks (weights) ---------------------------------------------------------------

void quantize_fp8_block_weight(const TensorView& w, const TensorView& q, const TensorView& scale_inv) {
  constexpr std::string_view op = "quantize_fp8_block_weight";
  constexpr int64_t kB = kFp8GroupSize;
  check_cpu_matrix(op, "w", w, {DType::fp32, DType::bf16});
  check_cpu_matrix(op, "q", q, {DType::fp8_e4m3});
  check_cpu_matrix(op, "scale_inv", scale_inv, {DType::fp32});
  const int64_t rows = w.size(0), cols = w.size(1);
  const int64_t block_rows = (rows + kB - 1) / kB, block_cols = (cols + kB - 1) / kB;
  check_shape(op, "q", q, {rows, cols});
  check_shape(op, "scale_inv", scale_inv, {block_rows, block_cols});
  uint8_t* qp = q.ptr<uint8_t>();
  for (int64_t br = 0; br < block_rows; ++br) {
    const int64_t r0 = br * kB, r1 = std::min(rows, r0 + kB);
    for (int64_t bc = 0; bc < block_cols; ++bc) {
      const int64_t c0 = bc * kB, c1 = std::min(cols, c0 + kB);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(load_f32(w, r * cols + c)));
      const float s = std::max(amax, kAmaxFloor) / kFp8E4m3Max;
      scale_inv.ptr<float>()[br * block_cols + bc] = s;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) qp[r * cols + c] = float_to_fp8_e4m3_bits(load_f32(w, r * cols + c) / s);
    }
  }
}

void dequantize_fp8_block_weight(const TensorView& q, const TensorView& scale_inv, const TensorView& out) {
  constexpr std::string_view op = "dequantize_fp8_block_weight";
  constexpr int64_t kB = kFp8GroupSize;
  check_cpu_matrix(op, "q", q, {DType::fp8_e4m3});
  check_cpu_matrix(op, "scale_inv", scale_inv, {DType::fp32});
  check_cpu_matrix(op, "out", out, {DType::fp32});
  const int64_t rows = q.size(0), cols = q.size(1);
  const int64_t block_cols = (cols + kB - 1) / kB;
  check_shape(op, "scale_inv", scale_inv, {(rows + kB - 1) / kB, block_cols});
  check_shape(op, "out", out, {rows, cols});
  const uint8_t* qp = q.ptr<const uint8_t>();
  const float* sp = scale_inv.ptr<const float>();
  float* op_out = out.ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = sp + (r / kB) * block_cols;
    for (int64_t c = 0; c < cols; ++c) op_out[r * cols + c] = fp8_e4m3_bits_to_float(qp[r * cols + c]) * srow[c / kB];
  }
}

// ---- MXFP4 (OCP MX v1.0) -------------------------------------------------------------------------

void mxfp4_pack(const TensorView& w, const TensorView& packed, const TensorView& scales) {
  constexpr std::string_view op = "mxfp4_pack";
  check_cpu_matrix(op, "w", w, {DType::fp32, DType::bf16});
  check_cpu_matrix(op, "packed", packed, {DType::fp4_e2m1x2});
  check_cpu_matrix(op, "scales", scales, {DType::e8m0});
  const int64_t rows = w.size(0), cols = w.size(1);
  require_arg(op, "w.shape[1]", cols, cols % kMxfp4BlockSize == 0, "must be a multiple of 32 (the MX block size)");
  check_shape(op, "packed", packed, {rows, cols / 2});
  check_shape(op, "scales", scales, {rows, cols / kMxfp4BlockSize});
  uint8_t* pp = packed.ptr<uint8_t>();
  uint8_t* sp = scales.ptr<uint8_t>();
  float block[kMxfp4BlockSize];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols / kMxfp4BlockSize; ++b) {
      const int64_t c0 = b * kMxfp4BlockSize;
      float amax = 0.0f;
      bool finite = true;
      for (int i = 0; i < kMxfp4BlockSize; ++i) {
        block[i] = load_f32(w, r * cols + c0 + i);
        finite = finite && std::isfinite(block[i]);
        amax = std::max(amax, std::fabs(block[i]));
      }
      uint8_t sbits;
      if (!finite) {
        sbits = 0xffu;  // a non-finite input makes the scale NaN, so the whole block reads back NaN (MX v1.0)
      } else if (amax == 0.0f) {
        sbits = kMxfp4ZeroBlockScale;
      } else {
        // emax of e2m1 is 2 (6 = 1.5 * 2^2); ilogb is floor(log2|x|) exactly, denormals included.
        sbits = e8m0_from_exponent(std::ilogb(amax) - 2);
      }
      sp[r * (cols / kMxfp4BlockSize) + b] = sbits;
      const float scale = e8m0_bits_to_float(sbits);
      uint8_t* dst = pp + (r * cols + c0) / 2;
      for (int i = 0; i < kMxfp4BlockSize; i += 2) {
        const uint8_t lo = finite ? float_to_fp4_e2m1_bits(block[i] / scale) : 0;
        const uint8_t hi = finite ? float_to_fp4_e2m1_bits(block[i + 1] / scale) : 0;
        dst[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
}

void mxfp4_unpack(const TensorView& packed, const TensorView& scales, const TensorView& out) {
  constexpr std::string_view op = "mxfp4_unpack";
  check_cpu_matrix(op, "packed", packed, {DType::fp4_e2m1x2});
  check_cpu_matrix(op, "scales", scales, {DType::e8m0});
  check_cpu_matrix(op, "out", out, {DType::fp32});
  const int64_t rows = out.size(0), cols = out.size(1);
  require_arg(op, "out.shape[1]", cols, cols % kMxfp4BlockSize == 0, "must be a multiple of 32 (the MX block size)");
  check_shape(op, "packed", packed, {rows, cols / 2});
  check_shape(op, "scales", scales, {rows, cols / kMxfp4BlockSize});
  const uint8_t* pp = packed.ptr<const uint8_t>();
  const uint8_t* sp = scales.ptr<const uint8_t>();
  float* o = out.ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += 2) {
      const float scale = e8m0_bits_to_float(sp[r * (cols / kMxfp4BlockSize) + c / kMxfp4BlockSize]);
      const uint8_t byte = pp[(r * cols + c) / 2];
      o[r * cols + c] = fp4_e2m1_bits_to_float(byte & 0x0fu) * scale;
      o[r * cols + c + 1] = fp4_e2m1_bits_to_float(byte >> 4) * scale;
    }
  }
}

}  // namespace epx
