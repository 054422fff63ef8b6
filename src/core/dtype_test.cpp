// Conversions of epx/dtype.h against known bit patterns (IEEE-754, OCP FP8 v1.0, OCP MX v1.0),
// exhaustive round trips and tie tests between every pair of adjacent codes, and a brute-force
// nearest-code search for fp8 e4m3.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "epx/dtype.h"
#include "epx/error.h"

using namespace epx;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

bool is_bf16_nan(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x007fu) != 0; }
bool is_fp16_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0; }

/// Every positive finite code c with c + 1 also finite: the midpoint of their values must round
/// to the even one of the two, and one float ulp either side to the nearer one.
template <class ToBits, class ToFloat>
void check_ties_between_adjacent_codes(uint32_t last_finite, ToBits to_bits, ToFloat to_float, const char* name) {
  int failures = 0;
  for (uint32_t c = 0; c < last_finite && failures < 10; ++c) {
    const float lo = to_float(c), hi = to_float(c + 1);
    const double mid_exact = (static_cast<double>(lo) + hi) / 2;
    const float mid = static_cast<float>(mid_exact);  // exact: one more significand bit than the narrow type
    ASSERT_EQ(static_cast<double>(mid), mid_exact) << name << " code " << c;
    const uint32_t even = (c & 1u) ? c + 1 : c;
    const uint32_t got_mid = to_bits(mid);
    const uint32_t got_below = to_bits(std::nextafter(mid, 0.0f));
    const uint32_t got_above = to_bits(std::nextafter(mid, kInf));
    if (got_mid != even || got_below != c || got_above != c + 1) {
      ++failures;
      ADD_FAILURE() << name << ": codes " << c << "/" << c + 1 << " midpoint " << mid << " -> " << got_mid
                    << " (want " << even << "), below -> " << got_below << ", above -> " << got_above;
    }
  }
}

/// Nearest finite e4m3 code by exhaustive search; ties to the even code; saturates (the largest
/// finite magnitude 448 is the nearest code for everything beyond it).
uint8_t fp8_brute_force(float f) {
  const double a = std::fabs(static_cast<double>(f));
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    const double d = std::fabs(static_cast<double>(fp8_e4m3_bits_to_float(static_cast<uint8_t>(c))) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(f) ? 0x80 : 0));
}

}  // namespace

// ---- bf16 ------------------------------------------------------------------------------------

TEST(DtypeBf16, KnownBitPatterns) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(-1.5f), 0xbfc0);
  EXPECT_EQ(float_to_bf16_bits(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16_bits(bits_f32(0x3f808000u)), 0x3f80);  // tie 1 + 2^-8 -> even (down)
  EXPECT_EQ(float_to_bf16_bits(bits_f32(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(float_to_bf16_bits(bits_f32(0x3f808001u)), 0x3f81);  // just above a tie
  EXPECT_EQ(float_to_bf16_bits(bits_f32(0x3f807fffu)), 0x3f80);  // just below a tie
  EXPECT_EQ(float_to_bf16_bits(kInf), 0x7f80);
  EXPECT_EQ(float_to_bf16_bits(-kInf), 0xff80);
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);  // overflow rounds to inf
  EXPECT_EQ(float_to_bf16_bits(bits_f32(0x7f7f7fffu)), 0x7f7f);             // largest bf16, below the tie
  EXPECT_EQ(float_to_bf16_bits(bits_f32(0x7f7f8000u)), 0x7f80);             // tie at the top -> even = inf
  EXPECT_EQ(float_to_bf16_bits(bits_f32(0x00000001u)), 0x0000);             // float denormal underflows
  EXPECT_EQ(float_to_bf16_bits(bits_f32(0x00018000u)), 0x0002);             // bf16 denormal tie -> even
  EXPECT_TRUE(is_bf16_nan(float_to_bf16_bits(kNaN)));
  EXPECT_TRUE(is_bf16_nan(float_to_bf16_bits(bits_f32(0x7f800001u))));  // signalling NaN stays NaN, not inf
  EXPECT_TRUE(is_bf16_nan(float_to_bf16_bits(bits_f32(0xff800001u))));
  EXPECT_EQ(float_to_bf16_bits(bits_f32(0xffc00000u)) & 0x8000, 0x8000);  // NaN keeps its sign
  EXPECT_EQ(bf16_bits_to_float(0x3f80), 1.0f);
  EXPECT_EQ(bf16_bits_to_float(0xc040), -3.0f);
  EXPECT_EQ(round_bf16(1.00390625f), 1.0f);  // 1 + 2^-8: tie, to even
}

TEST(DtypeBf16, AllCodesRoundTripAndTiesGoToEven) {
  for (uint32_t c = 0; c < 0x10000u; ++c) {
    const uint16_t b = static_cast<uint16_t>(c);
    if (is_bf16_nan(b)) {
      EXPECT_TRUE(std::isnan(bf16_bits_to_float(b)));
      continue;
    }
    ASSERT_EQ(float_to_bf16_bits(bf16_bits_to_float(b)), b) << std::hex << c;
  }
  check_ties_between_adjacent_codes(
      0x7f7fu, [](float f) { return static_cast<uint32_t>(float_to_bf16_bits(f)); },
      [](uint32_t c) { return bf16_bits_to_float(static_cast<uint16_t>(c)); }, "bf16");
}

// ---- fp16 ------------------------------------------------------------------------------------

TEST(DtypeFp16, KnownBitPatterns) {
  EXPECT_EQ(float_to_fp16_bits(1.0f), 0x3c00);
  EXPECT_EQ(float_to_fp16_bits(-2.0f), 0xc000);
  EXPECT_EQ(float_to_fp16_bits(65504.0f), 0x7bff);         // max finite
  EXPECT_EQ(float_to_fp16_bits(65519.0f), 0x7bff);         // below the tie with 2^16
  EXPECT_EQ(float_to_fp16_bits(65520.0f), 0x7c00);         // tie -> even = inf
  EXPECT_EQ(float_to_fp16_bits(1e6f), 0x7c00);
  EXPECT_EQ(float_to_fp16_bits(-kInf), 0xfc00);
  EXPECT_TRUE(is_fp16_nan(float_to_fp16_bits(kNaN)));
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -14)), 0x0400);  // min normal
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -24)), 0x0001);  // min subnormal
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1023.0f, -24)), 0x03ff);  // max subnormal
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -25)), 0x0000);  // tie 0 / min subnormal -> 0
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(3.0f, -25)), 0x0002);  // tie 1 / 2 -> 2
  EXPECT_EQ(float_to_fp16_bits(-std::ldexp(1.0f, -26)), 0x8000);
  EXPECT_EQ(float_to_fp16_bits(bits_f32(0x00000010u)), 0x0000);  // float denormal
  EXPECT_EQ(float_to_fp16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie -> even
  EXPECT_EQ(float_to_fp16_bits(1.0f + std::ldexp(3.0f, -11)), 0x3c02);      // tie -> even
  EXPECT_EQ(fp16_bits_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(fp16_bits_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(fp16_bits_to_float(0x7c00), kInf);
  EXPECT_TRUE(std::signbit(fp16_bits_to_float(0x8000)));
}

TEST(DtypeFp16, AllCodesRoundTripAndTiesGoToEven) {
  for (uint32_t c = 0; c < 0x10000u; ++c) {
    const uint16_t h = static_cast<uint16_t>(c);
    if (is_fp16_nan(h)) {
      EXPECT_TRUE(std::isnan(fp16_bits_to_float(h)));
      continue;
    }
    ASSERT_EQ(float_to_fp16_bits(fp16_bits_to_float(h)), h) << std::hex << c;
  }
  check_ties_between_adjacent_codes(
      0x7bffu, [](float f) { return static_cast<uint32_t>(float_to_fp16_bits(f)); },
      [](uint32_t c) { return fp16_bits_to_float(static_cast<uint16_t>(c)); }, "fp16");
}

// ---- fp8 e4m3 --------------------------------------------------------------------------------

TEST(DtypeFp8E4m3, KnownBitPatterns) {
  EXPECT_EQ(float_to_fp8_e4m3_bits(1.0f), 0x38);
  EXPECT_EQ(float_to_fp8_e4m3_bits(-2.0f), 0xc0);
  EXPECT_EQ(float_to_fp8_e4m3_bits(448.0f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3_bits(-448.0f), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3_bits(1000.0f), 0x7e);   // saturates
  EXPECT_EQ(float_to_fp8_e4m3_bits(464.0f), 0x7e);    // would be the tie with 480 in a wider format
  EXPECT_EQ(float_to_fp8_e4m3_bits(kInf), 0x7e);      // SATFINITE: inf -> max
  EXPECT_EQ(float_to_fp8_e4m3_bits(-kInf), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3_bits(kNaN), 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3_bits(-kNaN) & 0x7f, 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3_bits(240.0f), 0x77);
  EXPECT_EQ(float_to_fp8_e4m3_bits(256.0f), 0x78);
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::ldexp(1.0f, -6)), 0x08);  // min normal
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::ldexp(7.0f, -9)), 0x07);  // max subnormal
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::ldexp(1.0f, -9)), 0x01);  // min subnormal
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::ldexp(1.0f, -10)), 0x00); // tie 0 / 0x01 -> 0
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::ldexp(3.0f, -10)), 0x02); // tie 0x01 / 0x02 -> 0x02
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::ldexp(1.0f, -11)), 0x00);
  EXPECT_EQ(float_to_fp8_e4m3_bits(-std::ldexp(1.0f, -11)), 0x80);  // signed zero
  EXPECT_EQ(float_to_fp8_e4m3_bits(1.0625f), 0x38);                // tie 1 / 1.125 -> even
  EXPECT_EQ(float_to_fp8_e4m3_bits(1.1875f), 0x3a);                // tie 1.125 / 1.25 -> even
  EXPECT_EQ(fp8_e4m3_bits_to_float(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_bits_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_bits_to_float(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_bits_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_bits_to_float(0xff)));
  EXPECT_EQ(kFp8E4m3Max, 448.0f);
}

TEST(DtypeFp8E4m3, AllCodesExceptNaNRoundTrip) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t b = static_cast<uint8_t>(c);
    if ((b & 0x7f) == 0x7f) continue;
    EXPECT_EQ(float_to_fp8_e4m3_bits(fp8_e4m3_bits_to_float(b)), b) << std::hex << c;
  }
  check_ties_between_adjacent_codes(
      0x7eu, [](float f) { return static_cast<uint32_t>(float_to_fp8_e4m3_bits(f)); },
      [](uint32_t c) { return fp8_e4m3_bits_to_float(static_cast<uint8_t>(c)); }, "fp8_e4m3");
}

TEST(DtypeFp8E4m3, MatchesBruteForceNearestEvenSearch) {
  std::mt19937_64 g(20240917);
  std::uniform_int_distribution<int> exponent(-14, 10);          // underflow .. saturation
  std::uniform_int_distribution<uint32_t> mantissa(0, 0x7fffffu);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::uniform_int_distribution<int> code(0, 0x7d);
  int failures = 0;
  for (int i = 0; i < 300000 && failures < 10; ++i) {
    float f;
    if (i % 3 == 0) {
      f = bits_f32(static_cast<uint32_t>(exponent(g) + 127) << 23 | mantissa(g));
    } else if (i % 3 == 1) {
      f = bits_f32(any_bits(g));  // raw bits: huge, tiny and denormal floats
      if (std::isnan(f) || std::isinf(f)) continue;
    } else {
      const int c = code(g);  // an exact midpoint between adjacent codes (the tie cases)
      f = (fp8_e4m3_bits_to_float(static_cast<uint8_t>(c)) + fp8_e4m3_bits_to_float(static_cast<uint8_t>(c + 1))) / 2;
    }
    if (any_bits(g) & 1u) f = -f;
    const uint8_t want = fp8_brute_force(f), got = float_to_fp8_e4m3_bits(f);
    if (want != got) {
      ++failures;
      ADD_FAILURE() << "f = " << f << " (bits " << std::hex << f32_bits(f) << "): got " << int(got) << ", brute force "
                    << int(want);
    }
  }
}

// ---- e8m0 ------------------------------------------------------------------------------------

TEST(DtypeE8m0, ValuesAndExponentClamp) {
  EXPECT_EQ(e8m0_bits_to_float(127), 1.0f);
  EXPECT_EQ(e8m0_bits_to_float(128), 2.0f);
  EXPECT_EQ(e8m0_bits_to_float(125), 0.25f);
  EXPECT_EQ(e8m0_bits_to_float(254), std::ldexp(1.0f, 127));
  EXPECT_EQ(e8m0_bits_to_float(1), std::ldexp(1.0f, -126));
  EXPECT_EQ(e8m0_bits_to_float(0), std::ldexp(1.0f, -127));  // a float denormal, not zero
  EXPECT_TRUE(std::isnan(e8m0_bits_to_float(255)));
  for (int b = 0; b < 255; ++b) {
    EXPECT_EQ(e8m0_bits_to_float(static_cast<uint8_t>(b)), std::ldexp(1.0f, b - 127)) << b;
    EXPECT_EQ(e8m0_from_exponent(b - 127), b);
  }
  EXPECT_EQ(e8m0_from_exponent(-128), 0);
  EXPECT_EQ(e8m0_from_exponent(-1000), 0);
  EXPECT_EQ(e8m0_from_exponent(128), 254);  // never the NaN code
  EXPECT_EQ(e8m0_from_exponent(1000), 254);
}

// ---- fp4 e2m1 --------------------------------------------------------------------------------

TEST(DtypeFp4E2m1, AllSixteenCodesRoundTrip) {
  const float values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (uint8_t c = 0; c < 16; ++c) {
    const float v = fp4_e2m1_bits_to_float(c);
    EXPECT_EQ(std::fabs(v), values[c & 7]) << int(c);
    EXPECT_EQ(std::signbit(v), (c & 8) != 0) << int(c);
    EXPECT_EQ(float_to_fp4_e2m1_bits(v), c) << int(c);
  }
  EXPECT_EQ(fp4_e2m1_bits_to_float(0xf7), 6.0f);  // only the low nibble is read
}

TEST(DtypeFp4E2m1, TiesToEvenAndSaturation) {
  struct Case { float in; uint8_t code; };
  const Case cases[] = {
      {0.25f, 0x0}, {0.75f, 0x2}, {1.25f, 0x2}, {1.75f, 0x4}, {2.5f, 0x4}, {3.5f, 0x6}, {5.0f, 0x6},
      {7.0f, 0x7},  {6.0f, 0x7},  {100.0f, 0x7}, {kInf, 0x7}, {-0.3f, 0x9}, {-0.25f, 0x8}, {0.26f, 0x1},
      {0.74f, 0x1}, {0.76f, 0x2}, {5.01f, 0x7}, {4.99f, 0x6}, {-kInf, 0xf}, {-5.0f, 0xe}, {1e-30f, 0x0},
  };
  for (const Case& c : cases) EXPECT_EQ(float_to_fp4_e2m1_bits(c.in), c.code) << "in = " << c.in;
  EXPECT_EQ(fp4_e2m1_bits_to_float(float_to_fp4_e2m1_bits(1.75f)), 2.0f);
  EXPECT_EQ(fp4_e2m1_bits_to_float(float_to_fp4_e2m1_bits(-0.3f)), -0.5f);
  EXPECT_EQ(float_to_fp4_e2m1_bits(kNaN) & 7, 7);  // no NaN in e2m1: documented to map to +-6
}

// ---- names -----------------------------------------------------------------------------------

TEST(DtypeNames, ParseAndSizes) {
  for (DType t : {DType::fp32, DType::bf16, DType::fp16, DType::fp8_e4m3, DType::e8m0, DType::fp4_e2m1x2, DType::int32,
                  DType::int64, DType::uint8})
    EXPECT_EQ(parse_dtype(dtype_name(t)), t);
  EXPECT_EQ(parse_dtype("fp8"), DType::fp8_e4m3);
  EXPECT_EQ(dtype_size(DType::fp4_e2m1x2), 1);
  EXPECT_EQ(dtype_size(DType::bf16), 2);
  EXPECT_THROW(parse_dtype("fp6"), InvalidArgument);
}
