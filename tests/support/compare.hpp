// Comparing a result with its reference, for tests of several folders.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace upipe::testing {

// The largest absolute difference over the largest reference magnitude: one scale for a
// whole gradient, so that elements near zero do not dominate.
inline double max_difference_over_max(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
    ref = std::max(ref, std::abs(static_cast<double>(want[i])));
  }
  return ref > 0 ? diff / ref : diff;
}

}  // namespace upipe::testing
