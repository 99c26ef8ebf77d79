// Reference RoPE, rotate-half convention, in place. Angles are formed and their sin and
// cos taken in fp64 so that positions up to 1e7 keep full fp32 accuracy.
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/cpu/cpu_ops.hpp"
#include "ops/rope_frequencies.hpp"

namespace upipe::cpu {

void run(const rope_args& args) {
  const head_view& x = args.x;
  const std::int64_t half = x.dim / 2;
  if (half == 0) return;
  const std::vector<double> inv_freq = ops::rope_inverse_frequencies(args.config, x.dim);
  const double factor = ops::rope_attention_factor(args.config);
  // The inverse rotates by -angle: the transpose of the forward rotation.
  const double sign = args.direction == rope_direction::forward ? 1.0 : -1.0;
  std::vector<float> cos_a(static_cast<std::size_t>(half)), sin_a(static_cast<std::size_t>(half));
  // Tokens outside every run are left untouched.
  for (const position_run& run : args.positions) {
    for (std::int64_t n = 0; n < run.count; ++n) {
      const auto position = static_cast<double>(run.position_begin + n);
      for (std::int64_t i = 0; i < half; ++i) {
        const double angle = position * inv_freq[i];
        cos_a[i] = static_cast<float>(factor * std::cos(angle));
        sin_a[i] = static_cast<float>(factor * sign * std::sin(angle));
      }
      const std::int64_t t = run.token_begin + n;
      for (std::int64_t h = 0; h < x.heads; ++h) {
        float* lo = static_cast<float*>(x.data) + t * x.token_stride + h * x.head_stride;
        float* hi = lo + half;
        for (std::int64_t i = 0; i < half; ++i) {
          const float x1 = lo[i], x2 = hi[i];
          lo[i] = x1 * cos_a[i] - x2 * sin_a[i];
          hi[i] = x2 * cos_a[i] + x1 * sin_a[i];
        }
      }
    }
  }
}

}  // namespace upipe::cpu
