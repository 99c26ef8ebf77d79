#include "ops/rope_frequencies.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "core/error.hpp"

namespace upipe::ops {

void check_rope_config(const rope_config& config) {
  UPIPE_CHECK(config.theta > 0.0, "ops::rope: theta " + std::to_string(config.theta) + " must be positive (e.g. 500000)");
  const rope_scaling& s = config.scaling;
  if (!s.enabled()) return;
  UPIPE_CHECK(s.factor > 0.0, "ops::rope: scaling factor " + std::to_string(s.factor) + " must be positive");
  if (s.kind == rope_kind::linear) return;
  UPIPE_CHECK(s.original_max_position > 0, "ops::rope: original_max_position must be positive (e.g. 8192)");
  if (s.kind == rope_kind::llama3)
    UPIPE_CHECK(s.low_freq_factor > 0.0 && s.high_freq_factor > s.low_freq_factor,
                "ops::rope: llama3 scaling needs 0 < low_freq_factor (" + std::to_string(s.low_freq_factor) +
                    ") < high_freq_factor (" + std::to_string(s.high_freq_factor) + "), e.g. 1 and 4");
  if (s.kind == rope_kind::yarn)
    UPIPE_CHECK(s.beta_fast > 0.0 && s.beta_slow > 0.0, "ops::rope: yarn's beta_fast and beta_slow must be positive");
}

namespace {

// The dimension (of head_dim) whose wave turns `rotations` times over the original context.
double yarn_dimension(double rotations, std::int64_t head_dim, double theta, double original) {
  return static_cast<double>(head_dim) * std::log(original / (rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(theta));
}

double yarn_mscale(double factor, double mscale) { return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

}  // namespace

std::vector<double> rope_inverse_frequencies(const rope_config& config, std::int64_t head_dim) {
  UPIPE_CHECK(head_dim > 0 && head_dim % 2 == 0,
              "ops::rope_inverse_frequencies: head dim " + std::to_string(head_dim) + " must be positive and even");
  check_rope_config(config);
  const rope_scaling& s = config.scaling;
  const auto original = static_cast<double>(s.original_max_position);
  std::vector<double> inv(static_cast<std::size_t>(head_dim / 2));
  for (std::size_t i = 0; i < inv.size(); ++i)
    inv[i] = 1.0 / std::pow(config.theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
  switch (s.kind) {
    case rope_kind::none:
      break;
    case rope_kind::linear:
      for (double& f : inv) f /= s.factor;
      break;
    case rope_kind::llama3: {
      const double low_wavelen = original / s.low_freq_factor;    // longer waves are slowed by factor
      const double high_wavelen = original / s.high_freq_factor;  // shorter waves are kept
      for (double& f : inv) {
        const double wavelen = 2.0 * std::numbers::pi / f;
        if (wavelen > low_wavelen) {
          f = f / s.factor;
        } else if (wavelen >= high_wavelen) {
          const double smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          f = (1.0 - smooth) * f / s.factor + smooth * f;
        }
      }
      break;
    }
    case rope_kind::yarn: {
      // Dimensions below `low` keep their frequency, those above `high` are divided by the
      // factor, and a linear ramp blends the band between.
      double low = yarn_dimension(s.beta_fast, head_dim, config.theta, original);
      double high = yarn_dimension(s.beta_slow, head_dim, config.theta, original);
      if (s.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, static_cast<double>(head_dim - 1));
      if (low == high) high += 0.001;  // as transformers does, against a zero-width ramp
      for (std::size_t i = 0; i < inv.size(); ++i) {
        const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        inv[i] = inv[i] / s.factor * ramp + inv[i] * (1.0 - ramp);
      }
      break;
    }
  }
  return inv;
}

double rope_attention_factor(const rope_config& config) {
  const rope_scaling& s = config.scaling;
  if (s.kind != rope_kind::yarn) return 1.0;
  if (s.attention_factor > 0.0) return s.attention_factor;
  if (s.mscale > 0.0 && s.mscale_all_dim > 0.0)
    return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
  return yarn_mscale(s.factor, 1.0);
}

}  // namespace upipe::ops
