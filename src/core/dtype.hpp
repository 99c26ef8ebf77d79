// Element types: fp32 (the CPU reference and every cross-stage accumulator) and bf16
// (GPU storage), with round-to-nearest-even conversion.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
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

}  // namespace upipe
