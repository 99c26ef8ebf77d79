#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/dtype.hpp"

namespace upipe {
namespace {

TEST(bf16, round_to_nearest_even) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 lies exactly halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  EXPECT_EQ(float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  // Just above halfway rounds up.
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(std::numeric_limits<float>::infinity())), std::numeric_limits<float>::infinity());
  EXPECT_EQ(round_to_bf16(3.140625f), 3.140625f);  // exactly representable
}


// The value the OCP 8-bit floating point specification (v1.0) gives a code, written from
// its tables: sign, exponent field e, mantissa m; e = 0 subnormal.
double ocp_value(int code, int mantissa_bits, int bias) {
  const int exponent_bits = 7 - mantissa_bits;
  const int e = (code >> mantissa_bits) & ((1 << exponent_bits) - 1), m = code & ((1 << mantissa_bits) - 1);
  const double sign = (code & 0x80) ? -1.0 : 1.0, frac = static_cast<double>(m) / (1 << mantissa_bits);
  return e == 0 ? sign * std::pow(2.0, 1 - bias) * frac : sign * std::pow(2.0, e - bias) * (1.0 + frac);
}

bool is_nan_code(int code, fp8_format f) {
  return f == fp8_format::e4m3 ? (code & 0x7f) == 0x7f : (code & 0x7f) > 0x7c;
}

// Every code: its value as the specification gives it, and back to the same code.
TEST(fp8, every_code_matches_the_ocp_spec) {
  for (const fp8_format f : {fp8_format::e4m3, fp8_format::e5m2}) {
    const int mantissa_bits = f == fp8_format::e4m3 ? 3 : 2, bias = f == fp8_format::e4m3 ? 7 : 15;
    for (int code = 0; code < 256; ++code) {
      const float value = fp8_to_float(static_cast<std::uint8_t>(code), f);
      if (is_nan_code(code, f)) {
        EXPECT_TRUE(std::isnan(value)) << code;
        continue;
      }
      if (f == fp8_format::e5m2 && (code & 0x7f) == 0x7c) {
        EXPECT_EQ(value, (code & 0x80) ? -INFINITY : INFINITY);
        continue;
      }
      EXPECT_EQ(static_cast<double>(value), ocp_value(code, mantissa_bits, bias)) << "code " << code;
      if (code == 0x80) {
        EXPECT_EQ(float_to_fp8(value, f), 0x80);  // -0 keeps its sign
        continue;
      }
      EXPECT_EQ(float_to_fp8(value, f), code) << "code " << code;
    }
  }
}

// The specification's landmarks: largest, smallest normal and subnormal values.
TEST(fp8, ocp_landmarks) {
  EXPECT_EQ(fp8_to_float(0x7e, fp8_format::e4m3), 448.0f);
  EXPECT_EQ(fp8_to_float(0x08, fp8_format::e4m3), 0x1p-6f);
  EXPECT_EQ(fp8_to_float(0x01, fp8_format::e4m3), 0x1p-9f);
  EXPECT_EQ(fp8_to_float(0x7b, fp8_format::e5m2), 57344.0f);
  EXPECT_EQ(fp8_to_float(0x04, fp8_format::e5m2), 0x1p-14f);
  EXPECT_EQ(fp8_to_float(0x01, fp8_format::e5m2), 0x1p-16f);
  EXPECT_EQ(fp8_largest(fp8_format::e4m3), 448.0f);
  EXPECT_EQ(fp8_largest(fp8_format::e5m2), 57344.0f);
}

// Between each pair of neighbouring finite codes: below the midpoint rounds down, above it
// up, the midpoint itself to the code with the even mantissa (the even code).
TEST(fp8, round_to_nearest_even_everywhere) {
  for (const fp8_format f : {fp8_format::e4m3, fp8_format::e5m2}) {
    const int last = f == fp8_format::e4m3 ? 0x7e : 0x7b;
    for (int code = 0; code < last; ++code) {
      const float lo = fp8_to_float(static_cast<std::uint8_t>(code), f);
      const float hi = fp8_to_float(static_cast<std::uint8_t>(code + 1), f);
      const float mid = lo + (hi - lo) / 2;  // exact in fp32
      EXPECT_EQ(float_to_fp8(std::nextafter(mid, 0.0f), f), code);
      EXPECT_EQ(float_to_fp8(std::nextafter(mid, INFINITY), f), code + 1);
      EXPECT_EQ(float_to_fp8(mid, f), code % 2 == 0 ? code : code + 1) << "midpoint after code " << code;
      EXPECT_EQ(float_to_fp8(-mid, f), 0x80 | (code % 2 == 0 ? code : code + 1));
    }
  }
}

// Beyond the largest value (infinities included) a conversion saturates; NaN stays NaN.
TEST(fp8, saturates_and_keeps_nan) {
  EXPECT_EQ(float_to_fp8(480.0f, fp8_format::e4m3), 0x7e);
  EXPECT_EQ(float_to_fp8(1e9f, fp8_format::e4m3), 0x7e);
  EXPECT_EQ(float_to_fp8(-INFINITY, fp8_format::e4m3), 0xfe);
  EXPECT_EQ(float_to_fp8(INFINITY, fp8_format::e5m2), 0x7b);
  EXPECT_EQ(float_to_fp8(-65536.0f, fp8_format::e5m2), 0xfb);
  EXPECT_TRUE(std::isnan(round_to_fp8(NAN, fp8_format::e4m3)));
  EXPECT_TRUE(std::isnan(round_to_fp8(NAN, fp8_format::e5m2)));
  // Below half the smallest subnormal: zero; above it: the smallest subnormal.
  EXPECT_EQ(float_to_fp8(0x1p-11f, fp8_format::e4m3), 0x00);
  EXPECT_EQ(float_to_fp8(0x1.2p-10f, fp8_format::e4m3), 0x01);
  EXPECT_EQ(round_to_fp8(3.3f, fp8_format::e4m3), 3.25f);
  EXPECT_EQ(round_to_fp8(3.3f, fp8_format::e5m2), 3.5f);  // spacing 0.5 in [2, 4)
}

}  // namespace
}  // namespace upipe
