// Element types: fp32 (the CPU reference and every cross-stage accumulator) and bf16
// (GPU storage), with round-to-nearest-even conversion; the OCP 8-bit floats E4M3 and
// E5M2 of FP8 attention (conversions only: they are never a tensor's storage type here).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>

namespace upipe {

// i32 holds token ids and labels; u8 the codes of 8-bit quantized optimizer moments; only
// f32 and bf16 are arithmetic types.
enum class dtype : std::uint8_t { f32, bf16, i32, u8 };

constexpr std::size_t dtype_size(dtype t) { return t == dtype::bf16 ? 2 : t == dtype::u8 ? 1 : 4; }
constexpr std::string_view dtype_name(dtype t) {
  return t == dtype::f32 ? "f32" : t == dtype::bf16 ? "bf16" : t == dtype::i32 ? "i32" : "u8";
}

// fp32 -> bf16 bits, round to nearest, ties to even; NaN stays a quiet NaN.
constexpr std::uint16_t float_to_bf16(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0)
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

constexpr float bf16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

// Rounds a float to the nearest bf16 value and back (the storage error of bf16).
constexpr float round_to_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

// The OCP 8-bit floating point formats (OCP 8-bit Floating Point Specification, v1.0):
// E4M3 (bias 7, no infinities, S.1111.111 the only NaN, largest 448) for values, E5M2
// (bias 15, IEEE-like infinities and NaNs, largest 57344) for gradients.
enum class fp8_format : std::uint8_t { e4m3, e5m2 };

struct fp8_layout {
  int mantissa_bits, bias;
  float largest;
};
constexpr fp8_layout fp8_layout_of(fp8_format f) {
  return f == fp8_format::e4m3 ? fp8_layout{3, 7, 448.0f} : fp8_layout{2, 15, 57344.0f};
}
constexpr float fp8_largest(fp8_format f) { return fp8_layout_of(f).largest; }

// The value of an 8-bit code.
inline float fp8_to_float(std::uint8_t code, fp8_format f) {
  const fp8_layout l = fp8_layout_of(f);
  const int exponent_bits = 7 - l.mantissa_bits;
  const int e = (code >> l.mantissa_bits) & ((1 << exponent_bits) - 1);
  const int m = code & ((1 << l.mantissa_bits) - 1);
  const float sign = (code & 0x80) ? -1.0f : 1.0f;
  if (f == fp8_format::e4m3 && e == 15 && m == 7) return std::numeric_limits<float>::quiet_NaN();
  if (f == fp8_format::e5m2 && e == 31)
    return m == 0 ? sign * std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), 1 - l.bias - l.mantissa_bits);
  return sign * std::ldexp(static_cast<float>((1 << l.mantissa_bits) + m), e - l.bias - l.mantissa_bits);
}

// fp32 -> fp8 code, round to nearest, ties to even, saturating: magnitudes beyond the
// largest finite value (infinities included) become it, as CUDA's satfinite conversion
// does; NaN stays NaN.
inline std::uint8_t float_to_fp8(float value, fp8_format f) {
  const fp8_layout l = fp8_layout_of(f);
  const std::uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  if (std::isnan(value)) return f == fp8_format::e4m3 ? 0x7f : 0x7e;
  const float magnitude = std::fabs(value);
  // The spacing of the codes around the magnitude: that of its binade, or the subnormals'.
  const int min_exponent = 1 - l.bias;
  int exponent = 0;
  std::frexp(magnitude, &exponent);  // magnitude in [2^(exponent-1), 2^exponent)
  const int ulp_exponent = std::max(exponent - 1, min_exponent) - l.mantissa_bits;
  // Exact: the quotient by a power of two, rounded ties-to-even (the default mode).
  float rounded = std::ldexp(std::nearbyint(std::ldexp(magnitude, -ulp_exponent)), ulp_exponent);
  rounded = std::min(rounded, l.largest);
  int e = 0;
  const float fraction = std::frexp(rounded, &e);  // rounded = fraction 2^e, fraction in [0.5, 1)
  if (rounded == 0.0f) return sign;
  if (e - 1 < min_exponent)  // subnormal: the mantissa counts units of the smallest spacing
    return static_cast<std::uint8_t>(sign | static_cast<int>(std::ldexp(rounded, l.bias - 1 + l.mantissa_bits)));
  const int mantissa = static_cast<int>(std::ldexp(fraction, l.mantissa_bits + 1)) - (1 << l.mantissa_bits);
  return static_cast<std::uint8_t>(sign | ((e - 1 + l.bias) << l.mantissa_bits) | mantissa);
}

// Rounds a float to the nearest fp8 value of a format and back (saturating).
inline float round_to_fp8(float value, fp8_format f) { return fp8_to_float(float_to_fp8(value, f), f); }

}  // namespace upipe
