// The 8-bit dynamic quantization maps of the q8 moment format (Dettmers et al., "8-bit
// Optimizers via Block-wise Quantization", 2022; bitsandbytes' create_dynamic_map): 256
// sorted values in [-1, 1] (signed, for exp_avg) or [0, 1] (unsigned, for exp_avg_sq).
// Level e = 0..6 holds values 10^(e-6) times the midpoints of equal steps of [0.1, 1]
// (2^e steps signed, each with both signs; 2^(e+1) unsigned), so that small magnitudes
// keep their relative precision; 0 and 1 complete the 256. A value is stored as the
// index of the nearest code after dividing by its block's absmax (a value on a midpoint
// takes the lower code, as bitsandbytes' bucketize does) and read back as code * absmax.
#pragma once

#include <cstdint>

#include "ops/adamw_formula.hpp"

namespace upipe {

struct q8_map {
  float code[256];  // ascending
  float mid[255];   // (code[i] + code[i + 1]) / 2, rounded to float
};

// Each value computed in double and rounded once to float (bitsandbytes builds its map in
// float32 steps; the two differ by at most one ulp in a few values, scripts/make_optimizer_fixtures.py).
const q8_map& q8_signed_map();    // exp_avg
const q8_map& q8_unsigned_map();  // exp_avg_sq

// The code of a value already divided by its block's absmax: how many midpoints lie
// below it (a branch-free binary search over the 255 ascending midpoints).
UPIPE_HOST_DEVICE inline std::uint8_t q8_code(const float* mid, float scaled) {
  int index = 0;
  for (int step = 128; step >= 1; step /= 2)
    if (index + step <= 255 && mid[index + step - 1] < scaled) index += step;
  return static_cast<std::uint8_t>(index);
}

// x / absmax as the encoding computes it: x times the reciprocal (0 for an all-zero
// block), clamped to [-1, 1] against the reciprocal's rounding.
UPIPE_HOST_DEVICE inline float q8_inverse(float absmax) { return absmax > 0.0f ? 1.0f / absmax : 0.0f; }
UPIPE_HOST_DEVICE inline float q8_scaled(float x, float inverse) {
  const float s = x * inverse;
  return s < -1.0f ? -1.0f : s > 1.0f ? 1.0f : s;
}

}  // namespace upipe
