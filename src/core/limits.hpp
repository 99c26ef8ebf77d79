// The plausibility limits a value from a user (a flag, a config.json, a safetensors header,
// a trainer state) must pass before any arithmetic or allocation uses it, each with its
// reason, and checked arithmetic for the products computed from them. The limits are far
// above every released dense model and low enough that every size derived from them (a
// parameter count, S x D or S x F activations in bytes at S <= 2^30) fits in 64 bits, so
// that later code can multiply without checking again.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "core/error.hpp"

namespace upipe {

struct plausibility_limit {
  std::int64_t max;
  const char* reason;  // completes "at most MAX: REASON"
};

namespace limits {

// Widths: Llama 3.1 405B has D = 16384, F = 53248, H = 128, d = 128; 8x those still fit.
inline constexpr plausibility_limit hidden_size{std::int64_t{1} << 17,
                                                "8x the widest released dense model (D = 16384)"};
inline constexpr plausibility_limit intermediate_size{std::int64_t{1} << 20,
                                                      "16x the widest released MLP (F = 53248)"};
inline constexpr plausibility_limit heads{std::int64_t{1} << 12, "32x the most heads of a released model (128)"};
inline constexpr plausibility_limit head_dim{std::int64_t{1} << 10, "4x the largest released head (d = 256)"};
inline constexpr plausibility_limit layers{4096, "32x the deepest released dense model (126 layers)"};
inline constexpr plausibility_limit vocab_size{(std::int64_t{1} << 31) - 1, "what 32-bit token ids address"};
inline constexpr plausibility_limit parameters{std::int64_t{1} << 40,
                                               "2^40 = 1.1 trillion, beyond any dense model one CP group trains"};
inline constexpr plausibility_limit context{std::int64_t{1} << 40,
                                            "2^40 positions, 1024x the longest sequence this engine runs"};
// Counts of work: each is one pass over a sequence, so more would run for days.
inline constexpr plausibility_limit samples{std::int64_t{1} << 20, "2^20, days of forward passes"};
inline constexpr plausibility_limit steps{std::int64_t{1} << 40, "2^40 steps"};
inline constexpr plausibility_limit repeats{1000, "a thousand timed repeats, more than any timing needs"};
// Memory sizes given in GiB: 2^20 GiB is a pebibyte, beyond any machine's.
inline constexpr double max_memory_gib = 1048576.0;

}  // namespace limits

// A real number as a message shows it: 1e+300, 0.05, -5 (std::to_string would print 300
// digits, or 0.000000 for 1e-9).
inline std::string real_text(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", value);
  return text;
}

// Throws config_error "NAME = VALUE must lie between LO and MAX (REASON); for example EXAMPLE".
inline void require_within(std::int64_t value, std::int64_t lo, const plausibility_limit& limit,
                           const std::string& name, const std::string& example) {
  if (value >= lo && value <= limit.max) return;
  throw config_error(name + " = " + std::to_string(value) + " must lie between " + std::to_string(lo) + " and " +
                     std::to_string(limit.max) + " (at most " + limit.reason + "); for example " + example);
}

// a * b and a + b for sizes, or config_error naming `what` when the result would not fit.
inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, const std::string& what) {
  std::int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out))
    throw config_error(what + " overflows 64 bits (" + std::to_string(a) + " x " + std::to_string(b) +
                       "): a size this large is no real configuration");
  return out;
}
inline std::int64_t checked_add(std::int64_t a, std::int64_t b, const std::string& what) {
  std::int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out))
    throw config_error(what + " overflows 64 bits (" + std::to_string(a) + " + " + std::to_string(b) +
                       "): a size this large is no real configuration");
  return out;
}

}  // namespace upipe
