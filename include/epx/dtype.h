// epx/dtype.h: element types and their exact conversions (host and device).
//
// Sources of the bit layouts:
//   bf16      : IEEE-754 binary32 truncated to its top 16 bits; float->bf16 is round-to-nearest-even
//               (as __float2bfloat16_rn in CUDA's cuda_bf16.h).
//   fp16      : IEEE-754 binary16, round-to-nearest-even (as __float2half_rn).
//   fp8_e4m3  : OCP 8-bit FP spec v1.0 "E4M3" (a.k.a. e4m3fn): bias 7, no infinities, NaN = S.1111.111,
//               max normal 448. float->fp8 is round-to-nearest-even and *saturating* (values beyond
//               +-448, including +-inf, become +-448; NaN stays NaN), i.e. CUDA's
//               __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3).
//   e8m0      : OCP Microscaling (MX) spec v1.0 scale type: 2^(bits-127), 0xFF = NaN, no sign, no zero.
//   fp4_e2m1  : OCP MX spec v1.0 FP4 element: bias 1, values {0, .5, 1, 1.5, 2, 3, 4, 6} with a sign
//               bit; no inf/NaN; float->fp4 is round-to-nearest-even, saturating to +-6.
//               Packed two per byte, element 2i in the low nibble (the layout of MX checkpoints
//               such as gpt-oss and of torch.float4_e2m1fn_x2).
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

#if defined(__CUDACC__)
#define EPX_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define EPX_HOST_DEVICE inline
#endif

namespace epx {

enum class DType : uint8_t {
  fp32,
  bf16,
  fp16,
  fp8_e4m3,
  e8m0,       // one byte, power-of-two scale
  fp4_e2m1x2, // two fp4 e2m1 values packed per byte; shapes count bytes (H/2 per row)
  int32,
  int64,
  uint8,
};

/// Bytes per element (fp4_e2m1x2: per packed pair).
constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::fp32: case DType::int32: return 4;
    case DType::bf16: case DType::fp16: return 2;
    case DType::fp8_e4m3: case DType::e8m0: case DType::fp4_e2m1x2: case DType::uint8: return 1;
    case DType::int64: return 8;
  }
  return 0;
}
std::string_view dtype_name(DType t);
/// Parses "bf16", "fp8_e4m3" (also "fp8"), ...; throws InvalidArgument naming the accepted names.
DType parse_dtype(std::string_view name);

EPX_HOST_DEVICE uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
EPX_HOST_DEVICE float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Round-to-nearest-even of the low `shift` bits of `full`; returns full >> shift rounded.
EPX_HOST_DEVICE uint32_t rne_shift(uint32_t full, int shift) {
  if (shift <= 0) return full;
  if (shift >= 32) return 0;
  uint32_t q = full >> shift;
  uint32_t rem = full & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return q;
}

// ---- bf16 ------------------------------------------------------------------------------------
EPX_HOST_DEVICE uint16_t float_to_bf16_bits(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
EPX_HOST_DEVICE float bf16_bits_to_float(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }
/// Rounds a float to the nearest bf16 value (RNE), returned as float.
EPX_HOST_DEVICE float round_bf16(float f) { return bf16_bits_to_float(float_to_bf16_bits(f)); }

// ---- fp16 ------------------------------------------------------------------------------------
EPX_HOST_DEVICE uint16_t float_to_fp16_bits(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  int e = static_cast<int>(a >> 23) - 127;
  if (e >= -14) {
    uint32_t m = rne_shift(a & 0x7fffffu, 13);  // may carry into the exponent, which is correct
    return static_cast<uint16_t>(sign | (((static_cast<uint32_t>(e + 15) << 10) + m)));
  }
  uint32_t full = (a & 0x7fffffu) | 0x800000u;
  if (a < 0x00800000u) return sign;  // float denormals are far below fp16's smallest subnormal
  return static_cast<uint16_t>(sign | rne_shift(full, -e - 1));
}
EPX_HOST_DEVICE float fp16_bits_to_float(uint16_t h) {
  uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    float v = static_cast<float>(m) * (1.0f / 16777216.0f);  // m * 2^-24, exact
    return sign ? -v : v;
  }
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// ---- fp8 e4m3 (OCP, saturating) ---------------------------------------------------------------
constexpr float kFp8E4m3Max = 448.0f;
EPX_HOST_DEVICE uint8_t float_to_fp8_e4m3_bits(float f) {
  uint32_t u = f32_bits(f);
  uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;      // NaN
  if (a >= 0x43e00000u) return sign | 0x7eu;     // |f| >= 448 (incl. inf): saturate to 448
  int e = static_cast<int>(a >> 23) - 127;
  if (e >= -6) {
    uint32_t m = rne_shift(a & 0x7fffffu, 20);   // carry into the exponent is correct
    return static_cast<uint8_t>(sign | ((static_cast<uint32_t>(e + 7) << 3) + m));
  }
  if (a < 0x00800000u) return sign;
  uint32_t full = (a & 0x7fffffu) | 0x800000u;   // value = full * 2^(e-23); units of 2^-9
  return static_cast<uint8_t>(sign | rne_shift(full, 14 - e));
}
EPX_HOST_DEVICE float fp8_e4m3_bits_to_float(uint8_t b) {
  uint32_t sign = (static_cast<uint32_t>(b) & 0x80u) << 24;
  uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
  if (e == 0xfu && m == 7u) return bits_f32(0x7fc00000u | sign);
  if (e == 0) {
    float v = static_cast<float>(m) * (1.0f / 512.0f);
    return sign ? -v : v;
  }
  return bits_f32(sign | ((e + 120u) << 23) | (m << 20));
}

// ---- e8m0 (MX scale) -------------------------------------------------------------------------
EPX_HOST_DEVICE float e8m0_bits_to_float(uint8_t b) {
  if (b == 0xffu) return bits_f32(0x7fc00000u);
  if (b == 0) return bits_f32(0x00400000u);  // 2^-127 is a float denormal
  return bits_f32(static_cast<uint32_t>(b) << 23);
}
/// e8m0 bits for 2^exp, exp clamped to the representable [-127, 127].
EPX_HOST_DEVICE uint8_t e8m0_from_exponent(int exp) {
  int b = exp + 127;
  return static_cast<uint8_t>(b < 0 ? 0 : (b > 254 ? 254 : b));
}

// ---- fp4 e2m1 (MX element) -------------------------------------------------------------------
EPX_HOST_DEVICE float fp4_e2m1_bits_to_float(uint8_t nibble) {
  constexpr float kVals[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float v = kVals[nibble & 7u];
  return (nibble & 8u) ? -v : v;
}
/// Round-to-nearest-even onto the e2m1 grid, saturating at +-6; NaN maps to +-6 (no NaN in e2m1).
EPX_HOST_DEVICE uint8_t float_to_fp4_e2m1_bits(float f) {
  uint32_t u = f32_bits(f);
  uint8_t sign = (u >> 31) ? 8u : 0u;
  float a = bits_f32(u & 0x7fffffffu);
  if (!(a == a)) return sign | 7u;
  // Midpoints between consecutive codes; at an exact midpoint the even code wins.
  constexpr float kMid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  uint8_t code = 0;
  for (int i = 0; i < 7; ++i) {
    if (a > kMid[i] || (a == kMid[i] && ((i + 1) & 1) == 0)) code = static_cast<uint8_t>(i + 1);
  }
  return sign | code;
}

}  // namespace epx
