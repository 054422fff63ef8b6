// experts/mxfp4_bits.h: the bit-level conversions of the MXFP4 decode path (decode_item in
// experts_mxfp4_kernels.cuh), host- and device-callable so the CPU tests check them exhaustively
// (experts_test.cpp, Mxfp4DecodeBits). Formats: epx/dtype.h (OCP MX v1.0 e2m1 / e8m0, OCP FP8 e4m3).
#pragma once

#include <cstdint>

#include "epx/dtype.h"

namespace epx::experts_cuda {

/// e4m3 bytes of the 4 even e2m1 nibbles of w (nibble 2 j -> byte j): bits ((c & 7) << 2) | ((c & 8) << 4)
/// encode e2m1(c) * 2^-6 exactly for all 16 codes (code 1 = 0.5 * 2^-6 is the e4m3 denormal 4 * 2^-9).
EPX_HOST_DEVICE uint32_t e2m1_even_e4m3(uint32_t w) { return ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u); }
/// e4m3 bytes of the 4 odd e2m1 nibbles of w (nibble 2 j + 1 -> byte j), the same encoding.
EPX_HOST_DEVICE uint32_t e2m1_odd_e4m3(uint32_t w) { return ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u); }
/// True when any byte of s is 0x00 or 0xFF (all 8 bits equal): the e8m0 codes 2^-127 (a float
/// denormal) and NaN, which the plain exponent-field conversion gets wrong.
EPX_HOST_DEVICE bool e8m0_special(uint32_t s) {
  const uint32_t z = (s ^ (s >> 1)) & 0x7F7F7F7Fu;  // bits 0..6 of each byte: zero iff the byte is 00 / FF
  return ((z - 0x01010101u) & 0x80808080u) != 0;
}
/// 2^(e - 127) of e8m0 byte b (0..3) of word s: the plain exponent field (exact for 1..254) unless
/// `special` (e8m0_special(s)), then exact for every byte (0 -> 2^-127, 255 -> NaN), as e8m0_bits_to_float.
EPX_HOST_DEVICE float e8m0_of(uint32_t s, int b, bool special) {
  if (!special) return bits_f32((b < 3 ? s << (23 - 8 * b) : s >> 1) & 0x7F800000u);
  const uint32_t e = (s >> (8 * b)) & 0xFFu;
  return bits_f32(e == 0 ? 0x00400000u : (e == 255 ? 0x7fc00000u : e << 23));
}

}  // namespace epx::experts_cuda
