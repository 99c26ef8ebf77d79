// rope on the cpu backend against an fp64 reference written here: positions 0..N and
// 8,000,000, inverse as the exact undo, position runs with offsets and gaps, and the
// Llama 3 scaled inverse frequencies.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>
#include <vector>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "op_test_support.hpp"

namespace upipe {
namespace {

using namespace op_test;

float& at(const head_view& v, std::int64_t t, std::int64_t h, std::int64_t x) {
  return static_cast<float*>(v.data)[t * v.token_stride + h * v.head_stride + x];
}

// (tokens, heads + 1, dim) storage; the view is heads [0, heads), the last head a witness.
struct rope_input {
  tensor storage;
  head_view view;
};

rope_input make_input(backend& be, std::int64_t tokens, std::int64_t heads, std::int64_t dim, std::uint32_t seed) {
  tensor t = be.allocate(mem_tag::activations, dtype::f32, shape{tokens, heads + 1, dim}, "x");
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.as<float>()[i] = dist(rng);
  head_view v = t.heads().head_block(0, heads);
  return {std::move(t), v};
}

// Plain (unscaled) inverse frequencies, theta^(-2i/d).
std::vector<double> plain_frequencies(double theta, std::int64_t d) {
  std::vector<double> f(d / 2);
  for (std::int64_t i = 0; i < d / 2; ++i) f[i] = std::pow(theta, -2.0 * static_cast<double>(i) / d);
  return f;
}

// The expected value of token t after rotation to `position` (fp64 throughout).
double expected(const std::vector<float>& before, const head_view& v, const std::vector<double>& freq, std::int64_t t,
                std::int64_t h, std::int64_t x, std::int64_t position) {
  const std::int64_t half = v.dim / 2, i = x % half;
  const double angle = static_cast<double>(position) * freq[i];
  const auto base = t * v.token_stride + h * v.head_stride;
  const double x1 = before[base + i], x2 = before[base + i + half];
  return x < half ? x1 * std::cos(angle) - x2 * std::sin(angle) : x2 * std::cos(angle) + x1 * std::sin(angle);
}

// max |x - reference| over the tokens of one run.
double run_error(const std::vector<float>& before, const head_view& v, const std::vector<double>& freq,
                 const position_run& run) {
  double err = 0.0;
  for (std::int64_t n = 0; n < run.count; ++n)
    for (std::int64_t h = 0; h < v.heads; ++h)
      for (std::int64_t x = 0; x < v.dim; ++x) {
        const std::int64_t t = run.token_begin + n;
        err = worse(err, std::abs(at(v, t, h, x) - expected(before, v, freq, t, h, x, run.position_begin + n)));
      }
  return err;
}

void apply(backend& be, const head_view& x, std::span<const position_run> runs, const rope_config& config,
           rope_direction direction) {
  ops::rope(be, rope_args{x, runs, config, direction});
}

TEST(rope, forward_matches_fp64_reference_at_positions_0_to_n) {
  auto be = make_test_backend();
  rope_input in = make_input(*be, 64, 3, 128, 1);
  const std::vector<float> before = snapshot(in.storage);
  const position_run runs[] = {{0, 0, 64}};
  apply(*be, in.view, runs, rope_config{}, rope_direction::forward);
  EXPECT_LT(run_error(before, in.view, plain_frequencies(500000.0, 128), runs[0]), 1e-6);
  // Position 0 is the identity.
  for (std::int64_t x = 0; x < 128; ++x) EXPECT_EQ(at(in.view, 0, 2, x), before[2 * 128 + x]);
}

TEST(rope, forward_is_exact_at_position_eight_million) {
  auto be = make_test_backend();
  rope_input in = make_input(*be, 4, 2, 128, 2);
  const std::vector<float> before = snapshot(in.storage);
  const position_run runs[] = {{0, 8'000'000, 4}};
  apply(*be, in.view, runs, rope_config{}, rope_direction::forward);
  const std::vector<double> freq = plain_frequencies(500000.0, 128);
  EXPECT_LT(run_error(before, in.view, freq, runs[0]), 1e-6);
  // The test has teeth: an fp32 angle at this position is off by far more.
  const float angle32 = static_cast<float>(8'000'003) * static_cast<float>(freq[1]);
  EXPECT_GT(std::abs(std::cos(static_cast<double>(angle32)) - std::cos(8'000'003.0 * freq[1])), 1e-4);
}

TEST(rope, inverse_undoes_forward) {
  auto be = make_test_backend();
  rope_input in = make_input(*be, 32, 4, 64, 3);
  const std::vector<float> before = snapshot(in.storage);
  const position_run runs[] = {{0, 0, 16}, {16, 7'999'990, 16}};
  apply(*be, in.view, runs, rope_config{}, rope_direction::forward);
  apply(*be, in.view, runs, rope_config{}, rope_direction::inverse);
  const std::vector<float> after = snapshot(in.storage);
  double err = 0.0;
  for (std::size_t i = 0; i < after.size(); ++i) err = worse(err, std::abs(double(after[i]) - before[i]));
  EXPECT_LT(err, 1e-6);
}

TEST(rope, runs_place_tokens_at_their_positions_and_skip_the_rest) {
  auto be = make_test_backend();
  rope_input in = make_input(*be, 16, 2, 32, 4);
  const std::vector<float> before = snapshot(in.storage);
  const position_run runs[] = {{5, 7, 7}, {0, 100, 5}};  // tokens 12..15 are in no run
  apply(*be, in.view, runs, rope_config{}, rope_direction::forward);
  const std::vector<double> freq = plain_frequencies(500000.0, 32);
  EXPECT_LT(run_error(before, in.view, freq, runs[0]), 1e-6);
  EXPECT_LT(run_error(before, in.view, freq, runs[1]), 1e-6);
  const std::vector<float> after = snapshot(in.storage);
  const std::int64_t row = 3 * 32;  // one token of storage: 2 heads + the witness
  for (std::int64_t i = 12 * row; i < 16 * row; ++i) EXPECT_EQ(after[i], before[i]) << "uncovered token element " << i;
  for (std::int64_t t = 0; t < 16; ++t)
    for (std::int64_t x = 0; x < 32; ++x) EXPECT_EQ(after[t * row + 64 + x], before[t * row + 64 + x]) << "witness";
}

rope_config llama3_config() {
  rope_config c;
  c.theta = 500000.0;
  c.scaling = rope_scaling{rope_kind::llama3, 8.0, 1.0, 4.0, 8192};
  return c;
}

// Hugging Face's llama3 rule, written as its three candidate values and a selection.
std::vector<double> llama3_frequencies_here(std::int64_t d) {
  std::vector<double> f = plain_frequencies(500000.0, d);
  for (double& inv : f) {
    const double wavelen = 2.0 * std::numbers::pi / inv;
    const double slowed = inv / 8.0;
    const double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
    const double blended = (1.0 - smooth) * slowed + smooth * inv;
    const bool high = wavelen < 8192.0 / 4.0, low = wavelen > 8192.0 / 1.0;
    inv = high ? inv : (low ? slowed : blended);
  }
  return f;
}

TEST(rope, llama3_inverse_frequencies) {
  const std::vector<double> got = ops::rope_inverse_frequencies(llama3_config(), 128);
  const std::vector<double> mine = llama3_frequencies_here(128);
  ASSERT_EQ(got.size(), 64u);
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i] / mine[i], 1.0, 1e-12) << "pair " << i;
  // Values computed separately in Python: high band kept, middle blended, low slowed by 8.
  const std::pair<std::size_t, double> known[] = {{0, 1.0},
                                                  {20, 0.016560440080994446},
                                                  {28, 0.0032114459947525913},
                                                  {29, 0.002166570763503359},
                                                  {30, 0.0013718935677611381},
                                                  {34, 0.00017850781276799638},
                                                  {50, 4.411534674558404e-06},
                                                  {63, 3.068925988914511e-07}};
  for (auto [i, value] : known) EXPECT_NEAR(got[i] / value, 1.0, 1e-12) << "pair " << i;
  // Without scaling the frequencies are the plain ones.
  const std::vector<double> plain = ops::rope_inverse_frequencies(rope_config{}, 128);
  EXPECT_NEAR(plain[63] / 2.455140791131609e-06, 1.0, 1e-12);
}

TEST(rope, forward_uses_llama3_scaled_frequencies) {
  auto be = make_test_backend();
  rope_input in = make_input(*be, 8, 2, 128, 5);
  const std::vector<float> before = snapshot(in.storage);
  const position_run runs[] = {{0, 123'456, 8}};
  apply(*be, in.view, runs, llama3_config(), rope_direction::forward);
  EXPECT_LT(run_error(before, in.view, llama3_frequencies_here(128), runs[0]), 1e-6);
}

}  // namespace
}  // namespace upipe
