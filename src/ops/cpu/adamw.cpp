// AdamW on a flat fp32 shard and the fp64 sum of squares behind the global gradient
// norm, the arithmetic of ops/adamw_formula.hpp written so that the compiler vectorizes
// it: one pass over the shard, every lane computing exactly what the scalar loop would
// (this file compiles with contraction off and without errno from sqrt, so that the
// vector loop and its scalar tail round alike). On x86-64 each loop is built three times
// (AVX-512, AVX2, baseline) and the loader picks the widest the CPU has. One call runs on
// the calling thread; the host optimizer spreads pieces of a shard over every core.
#include <bit>
#include <cstdint>
#include <type_traits>

#include "core/dtype.hpp"
#include "ops/adamw_formula.hpp"
#include "ops/cpu/cpu_ops.hpp"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(UPIPE_NO_SIMD_CLONES)
#define UPIPE_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define UPIPE_SIMD_CLONES
#endif

namespace upipe::cpu {

namespace {

// float_to_bf16 (core/dtype.hpp) without the branch, so that it vectorizes: the rounded
// bits, or the quiet NaN for a NaN.
inline std::uint16_t bf16_bits(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const auto rounded = static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  const auto quiet = static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  const bool nan = (bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0;
  return nan ? quiet : rounded;
}

// W: the working copy's element (float, bf16 bits), or void for none.
template <class W>
[[gnu::always_inline]] inline void adamw_loop(const adamw_coefficients& c, float* __restrict master,
                                              float* __restrict exp_avg, float* __restrict exp_avg_sq,
                                              const float* __restrict grad, W* __restrict weights, std::int64_t n) {
  const adamw_coefficients k = c;  // in registers: no store below can change it
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) {
    float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_element(k, p, m, v, grad[i]);
    master[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (std::is_same_v<W, float>) weights[i] = p;
    if constexpr (std::is_same_v<W, std::uint16_t>) weights[i] = bf16_bits(p);
  }
}

UPIPE_SIMD_CLONES void adamw_no_copy(const adamw_coefficients& c, float* master, float* m, float* v, const float* g,
                                     std::int64_t n) {
  adamw_loop<void>(c, master, m, v, g, nullptr, n);
}
UPIPE_SIMD_CLONES void adamw_f32_copy(const adamw_coefficients& c, float* master, float* m, float* v, const float* g,
                                      float* w, std::int64_t n) {
  adamw_loop<float>(c, master, m, v, g, w, n);
}
UPIPE_SIMD_CLONES void adamw_bf16_copy(const adamw_coefficients& c, float* master, float* m, float* v, const float* g,
                                       std::uint16_t* w, std::int64_t n) {
  adamw_loop<std::uint16_t>(c, master, m, v, g, w, n);
}

// Eight fp64 lanes, lane j summing the squares of the elements i = j (mod 8) in order,
// then added as a fixed tree: a vector of any width computes the same sums.
UPIPE_SIMD_CLONES double lane_sum_squares(const float* x, std::int64_t n) {
  double lane[8] = {};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lane[j] += static_cast<double>(x[i + j]) * static_cast<double>(x[i + j]);
  for (; i < n; ++i) lane[i & 7] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

UPIPE_SIMD_CLONES void add_loop(float* __restrict dst, const float* __restrict src, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace

void accumulate(float* dst, const float* src, std::int64_t n) { add_loop(dst, src, n); }

void run(const adamw_args& args) {
  const adamw_coefficients c = adamw_coefficients_of(args);
  const std::int64_t n = args.master.cols;
  auto* master = static_cast<float*>(args.master.data);
  auto* m = static_cast<float*>(args.exp_avg.data);
  auto* v = static_cast<float*>(args.exp_avg_sq.data);
  const auto* g = static_cast<const float*>(args.grad.data);
  // The working copy is the stored master, so it never differs from what a reload sees.
  if (args.weights.data == nullptr || args.weights.cols == 0)
    adamw_no_copy(c, master, m, v, g, n);
  else if (args.weights.type == dtype::bf16)
    adamw_bf16_copy(c, master, m, v, g, static_cast<std::uint16_t*>(args.weights.data), n);
  else
    adamw_f32_copy(c, master, m, v, g, static_cast<float*>(args.weights.data), n);
}

void sum_squares_blocks(const float* x, std::int64_t n, double* block_sums) {
  for (std::int64_t b = 0; b * sum_squares_block < n; ++b) {
    const std::int64_t begin = b * sum_squares_block;
    block_sums[b] = lane_sum_squares(x + begin, n - begin < sum_squares_block ? n - begin : sum_squares_block);
  }
}

void run(const sum_squares_args& args) {
  const mat_view& x = args.x;
  double sum = 0.0;
  for (std::int64_t r = 0; r < x.rows; ++r) {
    const float* row = static_cast<const float*>(x.data) + r * x.ld;
    for (std::int64_t begin = 0; begin < x.cols; begin += sum_squares_block)
      sum += lane_sum_squares(row + begin, x.cols - begin < sum_squares_block ? x.cols - begin : sum_squares_block);
  }
  *args.result = sum;
}

}  // namespace upipe::cpu
