// Quantization (epx/quant.h) against values derived independently in the test: scales from amax,
// codes from the element conversions of dtype.h (tested in dtype_test.cpp), round-trip bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "epx/error.h"
#include "epx/quant.h"
#include "test_util.h"

using namespace epx;

namespace {

constexpr float kFloorScale = 1e-4f / 448.0f;  // the scale of an all-zero group or block

bool is_pow2(float s) { return s > 0 && std::isfinite(s) && (f32_bits(s) & 0x007fffffu) == 0; }

/// Per-group checks of a [T, H] FP8 quantization: scale rule, codes, round-trip bound.
void check_fp8_groups(const std::vector<float>& x, const Tensor& q, const Tensor& scales, int64_t T, int64_t H, int gs,
                      bool ue8m0) {
  const int64_t G = H / gs;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      float amax = 0;
      for (int i = 0; i < gs; ++i) amax = std::max(amax, std::fabs(x[t * H + g * gs + i]));
      const float plain = std::max(amax, 1e-4f) / 448.0f;
      const float s = scales.ptr<float>()[t * G + g];
      if (ue8m0) {
        ASSERT_TRUE(is_pow2(s)) << "t=" << t << " g=" << g << " scale=" << s;
        ASSERT_GE(s, plain);
        ASSERT_LT(s, 2 * plain);
      } else {
        ASSERT_EQ(s, plain) << "t=" << t << " g=" << g;
      }
      for (int i = 0; i < gs; ++i) {
        const int64_t j = t * H + g * gs + i;
        const uint8_t code = q.ptr<uint8_t>()[j];
        ASSERT_EQ(code, float_to_fp8_e4m3_bits(x[j] / s)) << "j=" << j;
        const float back = fp8_e4m3_bits_to_float(code) * s;
        // e4m3 keeps 3 mantissa bits: relative error <= 2^-4; below 2^-6 * s the subnormal step 2^-9 * s.
        ASSERT_LE(std::fabs(back - x[j]), std::max(std::fabs(x[j]) * 0.0625f, s * std::ldexp(1.0f, -10)) * 1.0001f)
            << "j=" << j << " x=" << x[j] << " back=" << back;
      }
    }
  }
}

}  // namespace

TEST(QuantFp8Group, ScalesCodesAndRoundTripBf16AndFp32) {
  for (bool ue8m0 : {false, true}) {
    for (DType in_dtype : {DType::bf16, DType::fp32}) {
      const int64_t T = 7, H = 512;
      Tensor x = in_dtype == DType::bf16 ? test::random_bf16(T, H, 11 + ue8m0, 3.0f) : test::random_f32(T, H, 12 + ue8m0, 0.02f);
      Tensor q = Tensor::empty({T, H}, DType::fp8_e4m3), s = Tensor::empty({T, H / 128}, DType::fp32);
      test::poison(q);
      test::poison(s);
      quantize_fp8_per_token_group(x, q, s, 128, ue8m0);
      const std::vector<float> xf = test::to_float(x);
      check_fp8_groups(xf, q, s, T, H, 128, ue8m0);
      if (!ue8m0) {
        // Each group's largest element lands on +-448 (the scale maps amax to the top code).
        for (int64_t t = 0; t < T; ++t)
          for (int64_t g = 0; g < H / 128; ++g) {
            int max_code = 0;
            for (int i = 0; i < 128; ++i) max_code = std::max(max_code, q.ptr<uint8_t>()[t * H + g * 128 + i] & 0x7f);
            EXPECT_EQ(max_code, 0x7e);
          }
      }
      for (DType out_dtype : {DType::fp32, DType::bf16}) {
        Tensor back = Tensor::empty({T, H}, out_dtype);
        test::poison(back);
        dequantize_fp8_per_token_group(q, s, back, 128);
        const double err = test::rel_l2_error(back, x);
        EXPECT_LT(err, 0.04) << "ue8m0=" << ue8m0 << " in=" << dtype_name(in_dtype) << " out=" << dtype_name(out_dtype);
        EXPECT_GT(err, 1e-4) << "an fp8 round trip cannot be this exact on random data";
      }
    }
  }
}

TEST(QuantFp8Group, OtherGroupSizesAndRowHelpersAgree) {
  const int64_t T = 3, H = 192;
  Tensor x = test::random_f32(T, H, 5, 1.0f);
  for (int gs : {32, 64, 192}) {
    Tensor q = Tensor::empty({T, H}, DType::fp8_e4m3), s = Tensor::empty({T, H / gs}, DType::fp32);
    quantize_fp8_per_token_group(x, q, s, gs);
    check_fp8_groups(test::to_float(x), q, s, T, H, gs, false);
    std::vector<uint8_t> rq(H);
    std::vector<float> rs(H / gs), back(H), back_t(H);
    for (int64_t t = 0; t < T; ++t) {
      quantize_fp8_row(x.ptr<float>() + t * H, H, rq.data(), rs.data(), gs, false);
      EXPECT_EQ(std::memcmp(rq.data(), q.ptr<uint8_t>() + t * H, H), 0);
      EXPECT_EQ(std::memcmp(rs.data(), s.ptr<float>() + t * (H / gs), rs.size() * 4), 0);
      dequantize_fp8_row(rq.data(), rs.data(), H, back.data(), gs);
      for (int64_t i = 0; i < H; ++i) EXPECT_EQ(back[i], fp8_e4m3_bits_to_float(rq[i]) * rs[i / gs]);
    }
  }
}

TEST(QuantFp8Group, AllZeroGroupGivesExactZerosAndLayoutIndependentScale) {
  // The same all-zero group, alone, in the middle of a long row, in several rows, bf16 or fp32:
  // its codes are zeros and its scale is always 1e-4/448 (ue8m0: that rounded up to 2^-22).
  for (bool ue8m0 : {false, true}) {
    const float want = ue8m0 ? std::ldexp(1.0f, -22) : kFloorScale;  // 1e-4/448 = 2.23e-7 -> 2^-22
    for (int64_t H : {128, 1024}) {
      for (DType dt : {DType::bf16, DType::fp32}) {
        const int64_t T = 3;
        Tensor x = dt == DType::bf16 ? test::random_bf16(T, H, 3) : test::random_f32(T, H, 3);
        const int64_t zero_group = H / 128 / 2;
        for (int64_t t = 0; t < T; ++t)
          std::memset(static_cast<char*>(x.data()) + (t * H + zero_group * 128) * dtype_size(dt), 0, 128 * dtype_size(dt));
        Tensor q = Tensor::empty({T, H}, DType::fp8_e4m3), s = Tensor::empty({T, H / 128}, DType::fp32);
        test::poison(q);
        quantize_fp8_per_token_group(x, q, s, 128, ue8m0);
        for (int64_t t = 0; t < T; ++t) {
          EXPECT_EQ(s.ptr<float>()[t * (H / 128) + zero_group], want) << "H=" << H << " t=" << t;
          for (int i = 0; i < 128; ++i) ASSERT_EQ(q.ptr<uint8_t>()[t * H + zero_group * 128 + i], 0);
        }
        Tensor back = Tensor::empty({T, H}, DType::fp32);
        dequantize_fp8_per_token_group(q, s, back, 128);
        for (int64_t t = 0; t < T; ++t)
          for (int i = 0; i < 128; ++i) ASSERT_EQ(back.ptr<float>()[t * H + zero_group * 128 + i], 0.0f);
      }
    }
  }
}

TEST(QuantFp8Group, TinyAndZeroRowsAndEmpty) {
  Tensor x = Tensor::zeros({2, 128}, DType::fp32);
  x.ptr<float>()[128] = 1e-6f;  // amax below the 1e-4 floor: scale is the floor, value still encodes
  Tensor q = Tensor::empty({2, 128}, DType::fp8_e4m3), s = Tensor::empty({2, 1}, DType::fp32);
  quantize_fp8_per_token_group(x, q, s);
  EXPECT_EQ(s.ptr<float>()[0], kFloorScale);
  EXPECT_EQ(s.ptr<float>()[1], kFloorScale);
  EXPECT_EQ(q.ptr<uint8_t>()[128], float_to_fp8_e4m3_bits(1e-6f / kFloorScale));
  EXPECT_NE(q.ptr<uint8_t>()[128], 0);
  Tensor e = Tensor::empty({0, 256}, DType::bf16), eq = Tensor::empty({0, 256}, DType::fp8_e4m3);
  Tensor es = Tensor::empty({0, 2}, DType::fp32);
  EXPECT_NO_THROW(quantize_fp8_per_token_group(e, eq, es));
}

TEST(QuantFp8Group, BadArgumentsThrowInvalidArgument) {
  Tensor x = test::random_bf16(4, 256, 1);
  Tensor q = Tensor::empty({4, 256}, DType::fp8_e4m3), s = Tensor::empty({4, 2}, DType::fp32);
  Tensor q_bad = Tensor::empty({4, 128}, DType::fp8_e4m3), s_bad = Tensor::empty({4, 3}, DType::fp32);
  Tensor x_odd = test::random_bf16(4, 200, 1), q_odd = Tensor::empty({4, 200}, DType::fp8_e4m3);
  Tensor x_int = Tensor::zeros({4, 256}, DType::int32);
  EXPECT_THROW(quantize_fp8_per_token_group(x, q_bad, s), InvalidArgument);
  EXPECT_THROW(quantize_fp8_per_token_group(x, q, s_bad), InvalidArgument);
  EXPECT_THROW(quantize_fp8_per_token_group(x_odd, q_odd, s), InvalidArgument);
  EXPECT_THROW(quantize_fp8_per_token_group(x_int, q, s), InvalidArgument);
  EXPECT_THROW(quantize_fp8_per_token_group(x, s, s), InvalidArgument);  // q must be fp8
  EXPECT_THROW(quantize_fp8_per_token_group(x, q, s, 0), InvalidArgument);
  EXPECT_THROW(dequantize_fp8_per_token_group(q, s_bad, x), InvalidArgument);
  EXPECT_THROW(dequantize_fp8_per_token_group(q, s, q), InvalidArgument);  // out must be bf16/fp32
  TensorView strided = x.view();
  strided.shape[1] = 128;  // every other half-row: not contiguous
  EXPECT_THROW(quantize_fp8_per_token_group(strided, q_bad, Tensor::empty({4, 1}, DType::fp32)), InvalidArgument);
  try {
    quantize_fp8_per_token_group(x_odd, q_odd, s);
    FAIL();
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();  // names the op, the argument, the value and the rule
    EXPECT_NE(m.find("quantize_fp8_per_token_group"), std::string::npos) << m;
    EXPECT_NE(m.find("200"), std::string::npos) << m;
    EXPECT_NE(m.find("multiple of group_size = 128"), std::string::npos) << m;
  }
  TensorView on_gpu(nullptr, DType::bf16, {4, 256}, Device::cuda(0));
  EXPECT_THROW(quantize_fp8_per_token_group(on_gpu, q, s), Error);
}

// ---- 128 x 128 weight blocks ----------------------------------------------------------------------

TEST(QuantFp8Block, ScaleInvPerBlockAndRoundTrip) {
  const int64_t N = 300, K = 200;  // partial edge blocks: 3 x 2 blocks
  for (DType dt : {DType::fp32, DType::bf16}) {
    Tensor w = dt == DType::fp32 ? test::random_f32(N, K, 21, 0.05f) : test::random_bf16(N, K, 21, 0.05f);
    for (int64_t r = 128; r < 256; ++r)  // block (1, 1) all zero
      std::memset(static_cast<char*>(w.data()) + (r * K + 128) * dtype_size(dt), 0, (K - 128) * dtype_size(dt));
    Tensor q = Tensor::empty({N, K}, DType::fp8_e4m3), si = Tensor::empty({3, 2}, DType::fp32);
    test::poison(si);
    quantize_fp8_block_weight(w, q, si);
    const std::vector<float> wf = test::to_float(w);
    for (int64_t br = 0; br < 3; ++br)
      for (int64_t bc = 0; bc < 2; ++bc) {
        float amax = 0;
        for (int64_t r = br * 128; r < std::min(N, br * 128 + 128); ++r)
          for (int64_t c = bc * 128; c < std::min(K, bc * 128 + 128); ++c) amax = std::max(amax, std::fabs(wf[r * K + c]));
        const float want = (br == 1 && bc == 1) ? kFloorScale : amax / 448.0f;
        EXPECT_EQ(si.ptr<float>()[br * 2 + bc], want) << br << "," << bc;
        for (int64_t r = br * 128; r < std::min(N, br * 128 + 128); ++r)
          for (int64_t c = bc * 128; c < std::min(K, bc * 128 + 128); ++c)
            ASSERT_EQ(q.ptr<uint8_t>()[r * K + c], float_to_fp8_e4m3_bits(wf[r * K + c] / want));
      }
    Tensor back = Tensor::empty({N, K}, DType::fp32);
    test::poison(back);
    dequantize_fp8_block_weight(q, si, back);
    EXPECT_LT(test::rel_l2_error(back, w), 0.04);
    for (int64_t r = 128; r < 256; ++r)
      for (int64_t c = 128; c < K; ++c) ASSERT_EQ(back.ptr<float>()[r * K + c], 0.0f);
  }
}

TEST(QuantFp8Block, BadShapesThrow) {
  Tensor w = test::random_f32(256, 256, 2);
  Tensor q = Tensor::empty({256, 256}, DType::fp8_e4m3), si = Tensor::empty({2, 2}, DType::fp32);
  EXPECT_THROW(quantize_fp8_block_weight(w, q, Tensor::empty({2, 3}, DType::fp32)), InvalidArgument);
  EXPECT_THROW(quantize_fp8_block_weight(w, Tensor::empty({256, 128}, DType::fp8_e4m3), si), InvalidArgument);
  EXPECT_THROW(quantize_fp8_block_weight(Tensor::empty({256}, DType::fp32), q, si), InvalidArgument);
  EXPECT_THROW(dequantize_fp8_block_weight(q, si, Tensor::empty({256, 256}, DType::bf16)), InvalidArgument);
  EXPECT_THROW(dequantize_fp8_block_weight(q, Tensor::empty({1, 2}, DType::fp32), w), InvalidArgument);
}

// ---- MXFP4 ----------------------------------------------------------------------------------------

TEST(QuantMxfp4, HandComputedBlocks) {
  Tensor w = Tensor::zeros({2, 64}, DType::fp32);
  float* p = w.ptr<float>();
  // Block (0, 0): amax 3 -> floor(log2 3) - 2 = -1 -> scale 0.5, e8m0 126.
  const float b0[8] = {3.0f, 1.0f, -0.25f, 0.3f, 2.9f, 0.125f, 1.6f, -1.1f};
  //          x/0.5:    6     2     -0.5    0.6   5.8   0.25(tie->0) 3.2  -2.2
  for (int i = 0; i < 8; ++i) p[i] = b0[i];
  // Block (0, 1): amax 7.5 -> exponent 0 -> scale 1 (127); 7.5 saturates to 6, 5 ties to 4.
  p[32] = 7.5f;
  p[33] = -5.0f;
  // Block (1, 0): amax 0.001 -> floor(log2) = -10 -> exponent -12 (e8m0 115); 0.001 / 2^-12 = 4.096 -> 4.
  p[64] = 0.001f;
  p[65] = -0.0004f;  // 1.6384 -> 1.5
  // Block (1, 1): all zero -> fixed scale 2^0 (e8m0 127), zero codes.
  Tensor packed = Tensor::empty({2, 32}, DType::fp4_e2m1x2), scales = Tensor::empty({2, 2}, DType::e8m0);
  test::poison(packed);
  test::poison(scales);
  mxfp4_pack(w, packed, scales);
  const uint8_t* s = scales.ptr<uint8_t>();
  EXPECT_EQ(s[0], 126);
  EXPECT_EQ(s[1], 127);
  EXPECT_EQ(s[2], 115);
  EXPECT_EQ(s[3], 127);
  const uint8_t* b = packed.ptr<uint8_t>();
  EXPECT_EQ(b[0], 0x47);  // low nibble = element 0 (6 -> code 7), high = element 1 (2 -> code 4)
  EXPECT_EQ(b[1], 0x19);  // -0.5 -> 0x9, 0.5 -> 0x1
  EXPECT_EQ(b[2], 0x07);  // 6 -> 0x7, tie 0.25 -> 0x0
  EXPECT_EQ(b[3], 0xc5);  // 3 -> 0x5, -2 -> 0xc
  for (int i = 4; i < 16; ++i) EXPECT_EQ(b[i], 0) << i;
  EXPECT_EQ(b[16], 0xe7);  // 6 (saturated) -> 0x7, -4 -> 0xe
  EXPECT_EQ(b[32], 0xb6);  // 4 -> 0x6, -1.6384 -> -1.5 = 0xb
  Tensor back = Tensor::empty({2, 64}, DType::fp32);
  test::poison(back);
  mxfp4_unpack(packed, scales, back);
  const float want0[8] = {3.0f, 1.0f, -0.25f, 0.25f, 3.0f, 0.0f, 1.5f, -1.0f};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(back.ptr<float>()[i], want0[i]) << i;
  EXPECT_EQ(back.ptr<float>()[32], 6.0f);
  EXPECT_EQ(back.ptr<float>()[33], -4.0f);
  EXPECT_EQ(back.ptr<float>()[64], 4.0f * std::ldexp(1.0f, -12));
  EXPECT_EQ(back.ptr<float>()[65], -1.5f * std::ldexp(1.0f, -12));
  for (int i = 96; i < 128; ++i) EXPECT_EQ(back.ptr<float>()[i], 0.0f);
}

TEST(QuantMxfp4, ScaleRuleAndRoundTripBoundOnRandomData) {
  const int64_t N = 64, K = 256;
  for (DType dt : {DType::fp32, DType::bf16}) {
    Tensor w = dt == DType::fp32 ? test::random_f32(N, K, 31, 0.02f) : test::random_bf16(N, K, 31, 0.02f);
    Tensor packed = Tensor::empty({N, K / 2}, DType::fp4_e2m1x2), scales = Tensor::empty({N, K / 32}, DType::e8m0);
    mxfp4_pack(w, packed, scales);
    Tensor back = Tensor::empty({N, K}, DType::fp32);
    test::poison(back);
    mxfp4_unpack(packed, scales, back);
    const std::vector<float> wf = test::to_float(w);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t blk = 0; blk < K / 32; ++blk) {
        float amax = 0;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(wf[r * K + blk * 32 + i]));
        int e2 = 0;
        std::frexp(amax, &e2);  // amax = m * 2^e2, m in [0.5, 1): floor(log2 amax) = e2 - 1
        ASSERT_EQ(scales.ptr<uint8_t>()[r * (K / 32) + blk], (e2 - 1) - 2 + 127);
        const float scale = std::ldexp(1.0f, e2 - 3);
        for (int i = 0; i < 32; ++i) {
          const int64_t j = r * K + blk * 32 + i;
          ASSERT_EQ(back.ptr<float>()[j], fp4_e2m1_bits_to_float(float_to_fp4_e2m1_bits(wf[j] / scale)) * scale);
          ASSERT_LE(std::fabs(back.ptr<float>()[j] - wf[j]), 2.0f * scale);  // worst case: saturation 8 -> 6
        }
      }
    const double err = test::rel_l2_error(back, w);
    EXPECT_LT(err, 0.25);
    EXPECT_GT(err, 0.01);
  }
}

TEST(QuantMxfp4, NonFiniteBlockReadsBackNaNOthersUntouched) {
  Tensor w = test::random_f32(1, 64, 8);
  w.ptr<float>()[5] = std::numeric_limits<float>::quiet_NaN();
  Tensor packed = Tensor::empty({1, 32}, DType::fp4_e2m1x2), scales = Tensor::empty({1, 2}, DType::e8m0);
  mxfp4_pack(w, packed, scales);
  EXPECT_EQ(scales.ptr<uint8_t>()[0], 0xff);
  EXPECT_NE(scales.ptr<uint8_t>()[1], 0xff);
  Tensor back = Tensor::empty({1, 64}, DType::fp32);
  mxfp4_unpack(packed, scales, back);
  for (int i = 0; i < 32; ++i) EXPECT_TRUE(std::isnan(back.ptr<float>()[i])) << i;
  for (int i = 32; i < 64; ++i) EXPECT_FALSE(std::isnan(back.ptr<float>()[i])) << i;
}

TEST(QuantMxfp4, BadShapesThrow) {
  Tensor w = test::random_f32(4, 64, 2);
  Tensor packed = Tensor::empty({4, 32}, DType::fp4_e2m1x2), scales = Tensor::empty({4, 2}, DType::e8m0);
  EXPECT_THROW(mxfp4_pack(test::random_f32(4, 48, 2), Tensor::empty({4, 24}, DType::fp4_e2m1x2), scales), InvalidArgument);
  EXPECT_THROW(mxfp4_pack(w, Tensor::empty({4, 64}, DType::fp4_e2m1x2), scales), InvalidArgument);
  EXPECT_THROW(mxfp4_pack(w, packed, Tensor::empty({4, 2}, DType::uint8)), InvalidArgument);
  EXPECT_THROW(mxfp4_pack(w, packed, Tensor::empty({4, 3}, DType::e8m0)), InvalidArgument);
  EXPECT_THROW(mxfp4_unpack(packed, scales, Tensor::empty({4, 64}, DType::bf16)), InvalidArgument);
  EXPECT_THROW(mxfp4_unpack(packed, scales, Tensor::empty({4, 60}, DType::fp32)), InvalidArgument);
  EXPECT_THROW(mxfp4_unpack(packed, Tensor::empty({3, 2}, DType::e8m0), w), InvalidArgument);
}
