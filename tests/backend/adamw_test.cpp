// adamw against an fp64 reference written here in adamw_args' form (decay inside the
// step), over several steps with weight decay, grad_scale and bias corrections, from
// zero moments and from a resumed state; one step worked out by hand; three steps of
// PyTorch's float32 op sequence; the vectorized loop against a scalar replay of the fp32
// formula, bit for bit, at every offset and split (the host optimizer updates a shard in
// pieces); the weights copy; the entry checks. sum_squares against an fp64 sum over a
// padded view, and its blocks.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "ops/cpu/cpu_ops.hpp"
#include "backend/ops.hpp"
#include "op_test_support.hpp"

namespace upipe {
namespace {

using namespace op_test;

// The optimizer state of one shard in fp64, rounded to float after every step as the
// f32 tensors are.
struct reference_state {
  std::vector<double> master, exp_avg, exp_avg_sq;
};

float as_stored(double x) { return static_cast<float>(x); }

// AdamW as adamw_args documents it, from the same float hyperparameters the op gets:
// master -= lr * (mhat / (sqrt(vhat) + eps) + wd * master), master read before the step.
void reference_adamw(reference_state& s, const std::vector<double>& grad, const adamw_args& a) {
  const double b1 = a.beta1, b2 = a.beta2, lr = a.lr, eps = a.eps, wd = a.weight_decay;
  const auto t = static_cast<double>(a.step);
  for (std::size_t i = 0; i < grad.size(); ++i) {
    const double g = grad[i] * static_cast<double>(a.grad_scale);
    const double m = b1 * s.exp_avg[i] + (1 - b1) * g;
    const double v = b2 * s.exp_avg_sq[i] + (1 - b2) * g * g;
    const double mhat = m / (1 - std::pow(b1, t)), vhat = v / (1 - std::pow(b2, t));
    s.master[i] = as_stored(s.master[i] - lr * (mhat / (std::sqrt(vhat) + eps) + wd * s.master[i]));
    s.exp_avg[i] = as_stored(m);
    s.exp_avg_sq[i] = as_stored(v);
  }
}

// One shard: every tensor a (1 x n) view with padding after it (ld > n).
struct shard {
  test_matrix master, exp_avg, exp_avg_sq, grad, weights;

  adamw_args args(float lr, float weight_decay, float grad_scale, std::int64_t step) const {
    adamw_args a{master.view, exp_avg.view, exp_avg_sq.view, grad.view, weights.view};
    a.lr = lr;
    a.weight_decay = weight_decay;
    a.grad_scale = grad_scale;
    a.step = step;
    return a;
  }
};

// Master in [-2, 2); the moments zero (a fresh optimizer) or random (a resumed one);
// weights, padding included, start in [9, 10), far from any master value, so a missed
// copy or a stray write shows.
shard make_shard(backend& be, std::int64_t n, std::mt19937& rng, bool zero_moments) {
  shard s{make_matrix(be, 1, n, 2, rng, -2.0f, 2.0f, "master"), make_matrix(be, 1, n, 2, rng, -0.1f, 0.1f, "exp_avg"),
          make_matrix(be, 1, n, 2, rng, 0.0f, 0.01f, "exp_avg_sq"), make_matrix(be, 1, n, 2, rng, -1.0f, 1.0f, "grad"),
          make_matrix(be, 1, n, 2, rng, 9.0f, 10.0f, "weights")};
  if (zero_moments)
    for (std::int64_t j = 0; j < n; ++j) s.exp_avg(0, j) = s.exp_avg_sq(0, j) = 0.0f;
  return s;
}

void set_row(const test_matrix& m, const std::vector<double>& values) {
  for (std::size_t j = 0; j < values.size(); ++j) m(0, static_cast<std::int64_t>(j)) = as_stored(values[j]);
}

TEST(adamw, matches_fp64_reference_over_several_steps) {
  auto be = make_test_backend();
  const std::int64_t n = 37;
  std::mt19937 rng(11);
  for (const bool fresh : {true, false}) {
    shard s = make_shard(*be, n, rng, fresh);
    reference_state want{to_vector(s.master), to_vector(s.exp_avg), to_vector(s.exp_avg_sq)};
    const std::int64_t first_step = fresh ? 1 : 7;
    std::uniform_real_distribution<float> grad_dist(-1.0f, 1.0f);
    for (std::int64_t t = first_step; t < first_step + 5; ++t) {
      for (std::int64_t j = 0; j < n; ++j) s.grad(0, j) = grad_dist(rng);
      const adamw_args a = s.args(3e-3f, 0.1f, 0.37f, t);
      reference_adamw(want, to_vector(s.grad), a);
      ops::adamw(*be, a);
      EXPECT_LT(max_rel_error(s.master, want.master), 1e-6) << "step " << t << (fresh ? " fresh" : " resumed");
      EXPECT_LT(max_rel_error(s.exp_avg, want.exp_avg), 1e-6) << "step " << t;
      EXPECT_LT(max_rel_error(s.exp_avg_sq, want.exp_avg_sq), 1e-6) << "step " << t;
      for (std::int64_t j = 0; j < n; ++j) ASSERT_EQ(s.weights(0, j), s.master(0, j)) << "step " << t << ", " << j;
    }
  }
}

// beta1 0.5, beta2 0.75, lr 0.5, weight decay 0.25, eps 0.25, grad_scale 2 at step 1:
// bias corrections 0.5 and 0.25, so step_size = 1, sqrt(bc2) = 0.5 and decay = 0.875.
//   p 1,  g 0.5 -> 1:     m 0.5,   v 0.25,   denom 1 + 0.25,        p 0.875 - 0.5 / 1.25 = 0.475
//   p -2, g -0.25 -> -0.5: m -0.25, v 0.0625, denom 0.5 + 0.25,      p -1.75 + 0.25 / 0.75 = -17/12
//   p 0,  g 0, m 1, v 4:   m 0.5,   v 3,      denom 2 sqrt(3) + 0.25, p -0.5 / denom
TEST(adamw, one_step_matches_values_worked_by_hand) {
  auto be = make_test_backend();
  std::mt19937 rng(12);
  shard s = make_shard(*be, 3, rng, true);
  set_row(s.master, {1.0, -2.0, 0.0});
  set_row(s.grad, {0.5, -0.25, 0.0});
  set_row(s.exp_avg, {0.0, 0.0, 1.0});
  set_row(s.exp_avg_sq, {0.0, 0.0, 4.0});
  adamw_args a = s.args(0.5f, 0.25f, 2.0f, 1);
  a.beta1 = 0.5f;
  a.beta2 = 0.75f;
  a.eps = 0.25f;
  ops::adamw(*be, a);
  EXPECT_FLOAT_EQ(s.master(0, 0), 0.475f);
  EXPECT_FLOAT_EQ(s.master(0, 1), static_cast<float>(-17.0 / 12.0));
  EXPECT_FLOAT_EQ(s.master(0, 2), static_cast<float>(-0.5 / (2.0 * std::sqrt(3.0) + 0.25)));
  EXPECT_EQ(s.exp_avg(0, 0), 0.5f);
  EXPECT_EQ(s.exp_avg(0, 1), -0.25f);
  EXPECT_EQ(s.exp_avg(0, 2), 0.5f);
  EXPECT_EQ(s.exp_avg_sq(0, 0), 0.25f);
  EXPECT_EQ(s.exp_avg_sq(0, 1), 0.0625f);
  EXPECT_EQ(s.exp_avg_sq(0, 2), 3.0f);
}

// torch.optim.AdamW's single-tensor path (CPU, lr 1e-3, betas (0.9, 0.999), eps 1e-8,
// weight_decay 0.01, the hyperparameters rounded to float first) replayed op by op in
// float32 with numpy, since torch is not installed here; the gradients are fed to it
// already halved. The first step moves each weight by lr against the gradient's sign
// after decaying it by 1 - 1e-5, as AdamW's first step must.
TEST(adamw, three_steps_match_pytorch_float32_sequence) {
  auto be = make_test_backend();
  std::mt19937 rng(13);
  shard s = make_shard(*be, 3, rng, true);
  set_row(s.master, {0.5, -1.25, 2.0});
  const std::vector<std::vector<double>> grads = {{0.1, -0.3, 0.02}, {-0.05, -0.2, 0.4}, {0.3, 0.1, -0.01}};
  const std::vector<std::vector<double>> torch_master = {
      {0.49899500608444214, -1.2489874362945557, 1.998979926109314},
      {0.4987236559391022, -1.2480045557022095, 1.998183250427246},
      {0.49804815649986267, -1.2474400997161865, 1.9975789785385132}};
  const std::vector<double> torch_exp_avg = {0.016800004988908768, -0.016150005161762238, 0.018310004845261574};
  const std::vector<double> torch_exp_avg_sq = {2.5619048756198026e-05, 3.494457632768899e-05,
                                                4.0084287320496514e-05};
  for (std::int64_t t = 1; t <= 3; ++t) {
    set_row(s.grad, grads[t - 1]);
    adamw_args a = s.args(1e-3f, 0.01f, 0.5f, t);
    a.beta2 = 0.999f;
    ops::adamw(*be, a);
    for (std::int64_t j = 0; j < 3; ++j)
      EXPECT_NEAR(s.master(0, j), torch_master[t - 1][j], 4e-7) << "step " << t << ", element " << j;
  }
  for (std::int64_t j = 0; j < 3; ++j) {
    EXPECT_NEAR(s.exp_avg(0, j), torch_exp_avg[j], 1e-6 * std::abs(torch_exp_avg[j])) << j;
    EXPECT_NEAR(s.exp_avg_sq(0, j), torch_exp_avg_sq[j], 1e-6 * torch_exp_avg_sq[j]) << j;
  }
}

// The fp32 formula of ops/adamw_formula.hpp, one element at a time in plain scalar
// code, each operation rounded to float as the op rounds it.
void scalar_adamw(std::vector<float>& p, std::vector<float>& m, std::vector<float>& v, const std::vector<float>& g,
                  const adamw_args& a) {
  const auto t = static_cast<double>(a.step);
  const auto one_minus_b1 = static_cast<float>(1.0 - static_cast<double>(a.beta1));
  const auto one_minus_b2 = static_cast<float>(1.0 - static_cast<double>(a.beta2));
  const auto decay = static_cast<float>(1.0 - static_cast<double>(a.lr) * static_cast<double>(a.weight_decay));
  const auto step_size = static_cast<float>(static_cast<double>(a.lr) / (1.0 - std::pow(static_cast<double>(a.beta1), t)));
  const auto bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(a.beta2), t)));
  for (std::size_t i = 0; i < p.size(); ++i) {
    const float grad = g[i] * a.grad_scale;
    const float first = a.beta1 * m[i], first_add = one_minus_b1 * grad;
    m[i] = first + first_add;
    const float second = a.beta2 * v[i], square = one_minus_b2 * grad, second_add = square * grad;
    v[i] = second + second_add;
    const float root = std::sqrt(v[i]);
    const float denom = root / bc2_sqrt + a.eps;
    const float decayed = p[i] * decay, moved = step_size * m[i];
    p[i] = decayed - moved / denom;
  }
}

// The host optimizer splits a shard into pieces at any element; each piece's vector loop
// starts at another alignment and ends in another tail, and the bits must not change.
TEST(adamw, every_lane_and_split_rounds_as_the_scalar_formula) {
  auto be = make_test_backend();
  const std::int64_t n = 1037;
  std::mt19937 rng(18);
  shard s = make_shard(*be, n, rng, false);
  tensor bf16_weights = be->allocate_zeroed(mem_tag::activations, dtype::bf16, shape{1, n}, "weights");
  std::vector<float> p(s.master.view.cols), m(p.size()), v(p.size()), g(p.size());
  for (std::int64_t j = 0; j < n; ++j) {
    p[j] = s.master(0, j), m[j] = s.exp_avg(0, j), v[j] = s.exp_avg_sq(0, j), g[j] = s.grad(0, j);
  }
  for (std::int64_t t = 1; t <= 3; ++t) {
    const adamw_args whole = s.args(1e-2f, 0.1f, 0.7f, t);
    scalar_adamw(p, m, v, g, whole);
    // Pieces [0, 5), [5, 22), [22, 531), [531, n): unaligned starts, short and long loops.
    const std::int64_t cuts[] = {0, 5, 22, 531, n};
    for (int k = 0; k < 4; ++k) {
      const std::int64_t a = cuts[k], len = cuts[k + 1] - cuts[k];
      adamw_args piece = whole;
      piece.master = s.master.view.col_block(a, len);
      piece.exp_avg = s.exp_avg.view.col_block(a, len);
      piece.exp_avg_sq = s.exp_avg_sq.view.col_block(a, len);
      piece.grad = s.grad.view.col_block(a, len);
      piece.weights = bf16_weights.matrix().col_block(a, len);
      cpu::run(piece);
    }
    for (std::int64_t j = 0; j < n; ++j) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(s.master(0, j)), std::bit_cast<std::uint32_t>(p[j])) << "step " << t << ", " << j;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(s.exp_avg(0, j)), std::bit_cast<std::uint32_t>(m[j])) << j;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(s.exp_avg_sq(0, j)), std::bit_cast<std::uint32_t>(v[j])) << j;
      ASSERT_EQ(bf16_weights.as<std::uint16_t>()[j], float_to_bf16(p[j])) << j;
    }
  }
}

TEST(adamw, empty_weights_update_the_master_alone) {
  auto be = make_test_backend();
  std::mt19937 rng(14);
  shard with = make_shard(*be, 19, rng, false);
  std::mt19937 same(14);
  shard without = make_shard(*be, 19, same, false);
  const std::vector<float> weights_before = snapshot(without.weights.storage);
  ops::adamw(*be, with.args(1e-2f, 0.1f, 1.0f, 3));
  adamw_args a = without.args(1e-2f, 0.1f, 1.0f, 3);
  a.weights = mat_view{};
  EXPECT_NO_THROW(ops::adamw(*be, a));
  EXPECT_EQ(snapshot(without.master.storage), snapshot(with.master.storage));
  EXPECT_EQ(snapshot(without.exp_avg.storage), snapshot(with.exp_avg.storage));
  EXPECT_EQ(snapshot(without.exp_avg_sq.storage), snapshot(with.exp_avg_sq.storage));
  EXPECT_EQ(snapshot(without.weights.storage), weights_before);
  // The padding after each (1 x n) view is not touched.
  for (std::int64_t j = 19; j < 21; ++j) EXPECT_GE(with.weights.storage.as<float>()[j], 9.0f);
}

// The cpu backend works in f32, but the implementation also stores a bf16 copy, as the
// GPU backends keep their weights.
TEST(adamw, cpu_implementation_rounds_a_bf16_weights_copy) {
  auto be = make_test_backend();
  std::mt19937 rng(15);
  shard s = make_shard(*be, 11, rng, true);
  tensor bf16_weights = be->allocate_zeroed(mem_tag::activations, dtype::bf16, shape{1, 11}, "weights");
  adamw_args a = s.args(1e-2f, 0.1f, 1.0f, 1);
  a.weights = bf16_weights.matrix();
  cpu::run(a);
  for (std::int64_t j = 0; j < 11; ++j)
    EXPECT_EQ(bf16_weights.as<std::uint16_t>()[j], float_to_bf16(s.master(0, j))) << j;
}

struct adamw_entry : ::testing::Test {
  std::unique_ptr<backend> be = make_test_backend();
  std::mt19937 rng{16};
  shard s = make_shard(*be, 8, rng, true);
  std::vector<tensor> keep;

  mat_view matrix(std::int64_t r, std::int64_t c, dtype type = dtype::f32) {
    keep.push_back(be->allocate_zeroed(mem_tag::activations, type, shape{r, c}, "m"));
    return keep.back().matrix();
  }
  adamw_args good() const { return s.args(1e-3f, 0.1f, 1.0f, 1); }
  std::string error_of(const adamw_args& a) {
    return internal_error_message([&] { ops::adamw(*be, a); });
  }
};

TEST_F(adamw_entry, accepts_a_valid_step) { EXPECT_NO_THROW(ops::adamw(*be, good())); }

TEST_F(adamw_entry, rejects_mismatched_lengths) {
  adamw_args a = good();
  a.grad = matrix(1, 9);
  EXPECT_TRUE(mentions(error_of(a), {"ops::adamw", "grad", "expected 1 x 8"})) << error_of(a);
  a = good();
  a.exp_avg_sq = matrix(2, 4);
  EXPECT_TRUE(mentions(error_of(a), {"exp_avg_sq", "expected 1 x 8"})) << error_of(a);
  a = good();
  a.weights = matrix(1, 7);
  EXPECT_TRUE(mentions(error_of(a), {"weights", "expected 1 x 8"})) << error_of(a);
  a = good();
  a.weights.data = nullptr;  // empty means no data and no columns
  a.weights.cols = 0;
  EXPECT_NO_THROW(ops::adamw(*be, a));
}

TEST_F(adamw_entry, rejects_wrong_dtypes) {
  adamw_args a = good();
  a.exp_avg = matrix(1, 8, dtype::bf16);  // the two moments in one format
  EXPECT_TRUE(mentions(error_of(a), {"exp_avg_sq", "dtype must be bf16"})) << error_of(a);
  a = good();
  a.grad = matrix(1, 8, dtype::i32);
  EXPECT_TRUE(mentions(error_of(a), {"grad", "dtype must be f32 or bf16"})) << error_of(a);
  a = good();
  a.exp_avg = matrix(1, 8, dtype::u8);  // q8 needs whole blocks and their absmax
  a.exp_avg_sq = matrix(1, 8, dtype::u8);
  EXPECT_TRUE(mentions(error_of(a), {"exp_avg", "multiple of 256"})) << error_of(a);
  a = good();
  a.master = matrix(1, 8, dtype::bf16);  // bf16-kahan needs its compensation
  EXPECT_TRUE(mentions(error_of(a), {"master_comp", "dtype must be bf16"})) << error_of(a);
  a = good();
  a.part = adamw_part::moments;  // the halves carry their step in direction
  EXPECT_TRUE(mentions(error_of(a), {"direction", "expected 1 x 8"})) << error_of(a);
  a = good();
  a.weights = matrix(1, 8, dtype::bf16);  // the cpu's working dtype is f32
  EXPECT_TRUE(mentions(error_of(a), {"weights", "dtype must be f32"})) << error_of(a);
}

TEST_F(adamw_entry, rejects_bad_hyperparameters) {
  const auto with = [&](auto change) {
    adamw_args a = good();
    change(a);
    return error_of(a);
  };
  EXPECT_TRUE(mentions(with([](adamw_args& a) { a.step = 0; }), {"step 0", ">= 1"}));
  EXPECT_TRUE(mentions(with([](adamw_args& a) { a.lr = -1e-3f; }), {"lr", ">= 0"}));
  EXPECT_TRUE(mentions(with([](adamw_args& a) { a.beta1 = 1.0f; }), {"beta1", "[0, 1)"}));
  EXPECT_TRUE(mentions(with([](adamw_args& a) { a.beta2 = -0.5f; }), {"beta2", "[0, 1)"}));
  EXPECT_TRUE(mentions(with([](adamw_args& a) { a.eps = 0.0f; }), {"eps", "> 0"}));
  EXPECT_TRUE(mentions(with([](adamw_args& a) { a.weight_decay = -0.1f; }), {"weight_decay"}));
  EXPECT_TRUE(mentions(with([](adamw_args& a) { a.grad_scale = std::nanf(""); }), {"grad_scale", "finite"}));
  EXPECT_TRUE(with([](adamw_args& a) { a.lr = 0.0f; }).empty());  // lr 0 is allowed (warmup's start)
}

// The planner runs the entries on meta: bf16 working dtype, no data, the same rules.
TEST(adamw_entry_meta, weights_in_the_bf16_working_dtype) {
  auto be = make_meta_backend(small_limits());
  std::vector<tensor> keep;
  const auto matrix = [&](std::int64_t c, dtype type) {
    keep.push_back(be->allocate(mem_tag::activations, type, shape{1, c}, "m"));
    return keep.back().matrix();
  };
  adamw_args a{matrix(8, dtype::f32), matrix(8, dtype::f32), matrix(8, dtype::f32), matrix(8, dtype::f32),
               matrix(8, dtype::bf16)};
  EXPECT_NO_THROW(ops::adamw(*be, a));
  a.weights = matrix(8, dtype::f32);
  EXPECT_THROW(ops::adamw(*be, a), internal_error);
  a.weights = matrix(8, dtype::bf16);
  a.master = matrix(9, dtype::f32);
  EXPECT_THROW(ops::adamw(*be, a), internal_error);
}

TEST(sum_squares, matches_fp64_sum_over_a_padded_view) {
  auto be = make_test_backend();
  std::mt19937 rng(17);
  const test_matrix x = make_matrix(*be, 5, 13, 4, rng, -3.0f, 3.0f, "x");  // ld 17
  double want = 0.0;
  for (double v : to_vector(x)) want += v * v;
  const double got = ops::sum_squares(*be, x.view);
  EXPECT_NEAR(got, want, 1e-12 * want);
  double with_padding = 0.0;
  for (float v : snapshot(x.storage)) with_padding += static_cast<double>(v) * v;
  EXPECT_GT(with_padding - got, 1e-3);  // the padding holds nonzero values and is skipped
}

TEST(sum_squares, accumulates_in_fp64) {
  auto be = make_test_backend();
  tensor t = be->allocate(mem_tag::activations, dtype::f32, shape{1, 4097}, "x");
  // 1e7 then 4096 ones: an fp32 accumulator stays at 1e14 (its ulp there is 2^23),
  // an fp64 one (ulp 2^-6) adds every one exactly.
  t.as<float>()[0] = 1e7f;
  for (std::int64_t j = 1; j < 4097; ++j) t.as<float>()[j] = 1.0f;
  EXPECT_EQ(ops::sum_squares(*be, t.matrix()), 1e14 + 4096.0);
}

// Blocks of sum_squares_block elements summed anywhere and added in order give
// sum_squares' very value (the host optimizer's norm), close to the fp64 sum.
TEST(sum_squares, blocks_added_in_order_are_the_whole) {
  auto be = make_test_backend();
  const std::int64_t n = 3 * cpu::sum_squares_block + 77;
  tensor t = be->allocate(mem_tag::activations, dtype::f32, shape{1, n}, "x");
  std::mt19937 rng(19);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  double want = 0.0;
  for (std::int64_t j = 0; j < n; ++j) {
    t.as<float>()[j] = dist(rng);
    want += static_cast<double>(t.as<float>()[j]) * t.as<float>()[j];
  }
  std::vector<double> blocks(4, -1.0);
  cpu::sum_squares_blocks(t.as<float>(), n, blocks.data());
  double added = 0.0;
  for (double b : blocks) added += b;
  EXPECT_EQ(added, ops::sum_squares(*be, t.matrix()));
  EXPECT_NEAR(added, want, 1e-12 * want);
  EXPECT_GT(blocks[3], 0.0);
}

TEST(sum_squares, empty_and_wrong_dtype) {
  auto be = make_test_backend();
  EXPECT_EQ(ops::sum_squares(*be, mat_view{}), 0.0);
  tensor t = be->allocate_zeroed(mem_tag::activations, dtype::i32, shape{2, 3}, "x");
  const std::string what = internal_error_message([&] { ops::sum_squares(*be, t.matrix()); });
  EXPECT_TRUE(mentions(what, {"ops::sum_squares", "dtype must be f32 or bf16"})) << what;
}

}  // namespace
}  // namespace upipe
