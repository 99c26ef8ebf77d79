#include "ops/q8_map.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace upipe {

namespace {

q8_map build(bool is_signed) {
  std::vector<double> values;
  for (int level = 0; level < 7; ++level) {
    const int steps = is_signed ? 1 << level : 1 << (level + 1);
    const double scale = std::pow(10.0, level - 6);
    for (int k = 0; k < steps; ++k) {
      const double lo = 0.1 + 0.9 * k / steps, hi = 0.1 + 0.9 * (k + 1) / steps;
      values.push_back(scale * (lo + hi) / 2);
      if (is_signed) values.push_back(-scale * (lo + hi) / 2);
    }
  }
  values.push_back(0.0);
  values.push_back(1.0);
  std::sort(values.begin(), values.end());
  q8_map m{};
  for (int i = 0; i < 256; ++i) m.code[i] = static_cast<float>(values[static_cast<std::size_t>(i)]);
  for (int i = 0; i < 255; ++i) m.mid[i] = (m.code[i] + m.code[i + 1]) / 2.0f;
  return m;
}

}  // namespace

const q8_map& q8_signed_map() {
  static const q8_map m = build(true);
  return m;
}

const q8_map& q8_unsigned_map() {
  static const q8_map m = build(false);
  return m;
}

}  // namespace upipe
