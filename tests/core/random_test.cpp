// The counter-based normal draws: the moments of a standard normal, a value that depends
// only on (seed, stream, index), and streams that differ.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <vector>

#include "core/random.hpp"

namespace upipe {
namespace {

TEST(random, fill_normal_has_the_moments_of_a_scaled_standard_normal) {
  std::vector<float> v(std::size_t{1} << 21);
  fill_normal(v, 7, 1, 0.5f);
  double sum = 0, squares = 0, fourth = 0;
  for (float x : v) {
    sum += x;
    squares += static_cast<double>(x) * x;
    fourth += std::pow(static_cast<double>(x) / 0.5, 4);
  }
  const double n = static_cast<double>(v.size()), mean = sum / n;
  EXPECT_NEAR(mean, 0.0, 2e-3);
  EXPECT_NEAR(std::sqrt(squares / n - mean * mean), 0.5, 2e-3);
  EXPECT_NEAR(fourth / n, 3.0, 0.05);  // a normal's kurtosis, which a uniform (1.8) lacks
}

TEST(random, a_value_depends_on_seed_stream_and_index_only) {
  std::vector<float> longer(300000), shorter(1000);
  fill_normal(longer, 11, 4, 1.0f);
  fill_normal(shorter, 11, 4, 1.0f);
  for (std::size_t i = 0; i < shorter.size(); ++i) ASSERT_EQ(shorter[i], longer[i]) << i;
  std::vector<float> other_stream(1000), other_seed(1000);
  fill_normal(other_stream, 11, 5, 1.0f);
  fill_normal(other_seed, 12, 4, 1.0f);
  int same_stream = 0, same_seed = 0;
  for (std::size_t i = 0; i < shorter.size(); ++i) {
    same_stream += other_stream[i] == shorter[i];
    same_seed += other_seed[i] == shorter[i];
  }
  EXPECT_EQ(same_stream, 0);
  EXPECT_EQ(same_seed, 0);
}

}  // namespace
}  // namespace upipe
