// The lean AdamW state formats on the cpu backend against the independent NumPy reference
// of scripts/make_optimizer_fixtures.py (tests/golden/optim/), bit for bit over six steps:
// f32, bf16 and q8 moments with f32 and bf16-kahan master weights, weight-decay runs that
// split a q8 block, a block with no gradient (absmax 0). The same bits whether a step runs
// whole, as its two halves (the moments, then the master from the direction), or in
// pieces at a block boundary (as the host optimizer splits a shard); bf16 gradients read as
// their values; the working copy is the master's. The maps: sorted, 0 and 1 in both, the
// midpoints between codes, a value on a midpoint taking the lower code.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "../support/adamw_fixture.hpp"
#include "ops/q8_map.hpp"

namespace upipe {
namespace {

using namespace adamw_fixture;

memory_limits limits() { return {std::size_t{64} << 20, std::size_t{16} << 20}; }

// Runs the fixture's six steps on `mode` with `run_step` and checks every state tensor
// after each.
template <class Step>
void check_six_steps(const state_mode& mode, Step&& run_step, dtype grad_type = dtype::f32) {
  const fixture f = load();
  auto be = make_cpu_backend(limits());
  mode_state s(*be, f, mode, grad_type);
  for (std::int64_t t = 0; t < f.steps; ++t) {
    put(*be, s.grad, f.get("grad." + std::to_string(t)));
    run_step(*be, f, s, t);
    for (const auto& [what, got] : s.values(*be))
      EXPECT_EQ(first_difference(got, f.get(f.name(mode, t, what.c_str()))), "")
          << mode.key() << " step " << t << " " << what;
    // The cpu's f32 working copy holds the master's values.
    EXPECT_EQ(first_difference(take(*be, s.weights), take(*be, s.master)), "") << mode.key() << " step " << t;
  }
}

TEST(adamw_modes, every_mode_matches_the_reference_over_six_steps) {
  for (const state_mode& mode : all_modes())
    check_six_steps(mode, [](backend& be, const fixture& f, const mode_state& s, std::int64_t t) {
      std::vector<adamw_run> runs;
      ops::adamw(be, s.args(f, t, adamw_part::whole, 0, f.n, runs));
    });
}

TEST(adamw_modes, the_two_halves_give_the_whole_bits) {
  for (const state_mode& mode : all_modes())
    check_six_steps(mode, [](backend& be, const fixture& f, const mode_state& s, std::int64_t t) {
      std::vector<adamw_run> runs;
      ops::adamw(be, s.args(f, t, adamw_part::moments, 0, f.n, runs));
      // The master half in two calls at an element that is no block boundary.
      ops::adamw(be, s.args(f, t, adamw_part::master, 0, 301, runs));
      ops::adamw(be, s.args(f, t, adamw_part::master, 301, f.n, runs));
    });
}

TEST(adamw_modes, pieces_at_a_block_boundary_give_the_whole_bits) {
  for (const state_mode& mode : all_modes())
    check_six_steps(mode, [](backend& be, const fixture& f, const mode_state& s, std::int64_t t) {
      std::vector<adamw_run> runs;
      for (const auto& [a, b] : {std::pair<std::int64_t, std::int64_t>{0, 512}, {512, 768}, {768, f.n}})
        ops::adamw(be, s.args(f, t, adamw_part::whole, a, b, runs));
    });
}

TEST(adamw_modes, bf16_gradients_read_as_their_values) {
  // The fixture's gradients rounded to bf16, given once as f32 and once as bf16.
  const fixture f = load();
  for (const state_mode& mode : all_modes()) {
    auto be = make_cpu_backend(limits());
    mode_state as_f32(*be, f, mode), as_bf16(*be, f, mode, dtype::bf16);
    for (std::int64_t t = 0; t < f.steps; ++t) {
      std::vector<float> g = f.get("grad." + std::to_string(t));
      for (float& x : g) x = round_to_bf16(x);
      put(*be, as_f32.grad, g);
      put(*be, as_bf16.grad, g);
      std::vector<adamw_run> runs;
      ops::adamw(*be, as_f32.args(f, t, adamw_part::whole, 0, f.n, runs));
      ops::adamw(*be, as_bf16.args(f, t, adamw_part::whole, 0, f.n, runs));
      const auto want = as_f32.values(*be);
      for (const auto& [what, got] : as_bf16.values(*be))
        EXPECT_EQ(first_difference(got, want.at(what)), "") << mode.key() << " step " << t << " " << what;
    }
  }
}

TEST(q8_map, sorted_with_zero_one_and_midpoints) {
  for (const q8_map* m : {&q8_signed_map(), &q8_unsigned_map()}) {
    for (int i = 0; i < 255; ++i) {
      EXPECT_LT(m->code[i], m->code[i + 1]) << i;
      EXPECT_EQ(m->mid[i], (m->code[i] + m->code[i + 1]) / 2.0f) << i;
    }
    EXPECT_EQ(m->code[255], 1.0f);
    // Each code encodes to itself; a midpoint takes the lower code.
    for (int i = 0; i < 256; ++i) EXPECT_EQ(q8_code(m->mid, m->code[i]), i);
    for (int i = 0; i < 255; ++i) EXPECT_EQ(q8_code(m->mid, m->mid[i]), i);
  }
  EXPECT_EQ(q8_signed_map().code[127], 0.0f);
  EXPECT_EQ(q8_unsigned_map().code[0], 0.0f);
  EXPECT_NEAR(q8_signed_map().code[0], -0.99296875f, 1e-7f);  // the largest magnitude below 1: mean of [0.9859375, 1]
  // The smallest magnitude: 10^-6 times the mean of [0.1, 1] (one step at level 0).
  EXPECT_NEAR(q8_signed_map().code[128], 0.55e-6f, 1e-12f);
  EXPECT_NEAR(q8_unsigned_map().code[1], 0.325e-6f, 1e-12f);
  // An all-zero block: the reciprocal is 0, every value the zero code.
  EXPECT_EQ(q8_code(q8_signed_map().mid, q8_scaled(0.0f, q8_inverse(0.0f))), 127);
  EXPECT_EQ(q8_scaled(2.0f, 1.0f), 1.0f);
  EXPECT_EQ(q8_scaled(-2.0f, 1.0f), -1.0f);
}

}  // namespace
}  // namespace upipe
