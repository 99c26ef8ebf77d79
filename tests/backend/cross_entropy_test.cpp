// cross_entropy against an fp64 reference written here (loss and gradient, logits up to
// +-1e3), finite differences of the summed loss, masked rows, grad_scale, two chunks
// against one, and labels >= V throwing with the label, its row and V named.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "backend/ops.hpp"
#include "op_test_support.hpp"

namespace upipe {
namespace {

using namespace op_test;

constexpr std::int32_t ignore_index = -100;  // Hugging Face's masked label

// Loss and gradient of every row, computed from the logits in fp64.
struct reference {
  std::vector<double> loss;  // (n)
  std::vector<double> grad;  // (n, V), softmax - onehot, unscaled
};

reference reference_cross_entropy(const std::vector<double>& logits, const std::vector<std::int32_t>& labels,
                                  std::int64_t vocab) {
  const auto rows = static_cast<std::int64_t>(labels.size());
  reference r{std::vector<double>(rows, 0.0), std::vector<double>(rows * vocab, 0.0)};
  for (std::int64_t i = 0; i < rows; ++i) {
    if (labels[i] < 0) continue;
    const double* x = logits.data() + i * vocab;
    const double top = *std::max_element(x, x + vocab);
    double sum = 0.0;
    for (std::int64_t j = 0; j < vocab; ++j) sum += std::exp(x[j] - top);
    r.loss[i] = top + std::log(sum) - x[labels[i]];
    for (std::int64_t j = 0; j < vocab; ++j)
      r.grad[i * vocab + j] = std::exp(x[j] - top) / sum - (j == labels[i] ? 1.0 : 0.0);
  }
  return r;
}

std::vector<double> scaled(std::vector<double> v, double factor) {
  for (double& x : v) x *= factor;
  return v;
}

struct ce_problem {
  test_matrix logits, row_loss;
  index_column labels;
  std::vector<std::int32_t> label_values;
};

// Logits uniform in [-range, range) with ld > V; row_loss pre-filled with garbage.
ce_problem make_problem(backend& be, const std::vector<std::int32_t>& labels, std::int64_t vocab, float range,
                        std::uint32_t seed) {
  std::mt19937 rng(seed);
  const auto rows = static_cast<std::int64_t>(labels.size());
  return {make_matrix(be, rows, vocab, 3, rng, -range, range, "logits"),
          make_matrix(be, rows, 1, 1, rng, 50.0f, 60.0f, "row_loss"), make_index_column(be, labels, 1, "labels"),
          labels};
}

void run(backend& be, const ce_problem& p, float grad_scale) {
  ops::cross_entropy(be, cross_entropy_args{p.logits.view, p.labels.view, p.row_loss.view, grad_scale});
}

bool all_finite(const test_matrix& m) {
  for (std::int64_t i = 0; i < m.view.rows; ++i)
    for (std::int64_t j = 0; j < m.view.cols; ++j)
      if (!std::isfinite(m(i, j))) return false;
  return true;
}

TEST(cross_entropy, matches_fp64_reference_including_large_logits) {
  auto be = make_test_backend();
  const std::int64_t vocab = 50;
  const std::vector<std::int32_t> labels = {7, 0, 49, 13, 13, 31, 2};
  for (float range : {4.0f, 1e3f}) {
    ce_problem p = make_problem(*be, labels, vocab, range, 1);
    const std::vector<float> before = snapshot(p.logits.storage);
    const reference want = reference_cross_entropy(to_vector(p.logits), labels, vocab);
    const float grad_scale = 1.0f / 7.0f;
    run(*be, p, grad_scale);
    EXPECT_TRUE(all_finite(p.logits)) << "range " << range;
    EXPECT_TRUE(all_finite(p.row_loss)) << "range " << range;
    EXPECT_LT(max_rel_error(p.row_loss, want.loss), 1e-6) << "range " << range;
    EXPECT_LT(max_rel_error(p.logits, scaled(want.grad, grad_scale)), 1e-6) << "range " << range;
    // The padding past V is not touched.
    for (std::int64_t i = 0; i < p.logits.view.rows; ++i)
      EXPECT_EQ(p.logits.storage.as<float>()[i * p.logits.view.ld + vocab],
                before[i * p.logits.view.ld + vocab]);
  }
}

TEST(cross_entropy, gradient_matches_finite_differences_of_the_summed_loss) {
  auto be = make_test_backend();
  const std::int64_t vocab = 9;
  const std::vector<std::int32_t> labels = {4, ignore_index, 0, 8, 4};
  ce_problem p = make_problem(*be, labels, vocab, 3.0f, 2);
  std::vector<double> logits = to_vector(p.logits);
  const float grad_scale = 0.5f;
  run(*be, p, grad_scale);
  const auto total_loss = [&] {
    const reference r = reference_cross_entropy(logits, labels, vocab);
    double sum = 0.0;
    for (double l : r.loss) sum += l;
    return sum;
  };
  EXPECT_LT(max_rel_error(p.logits, scaled(finite_differences(logits, total_loss), grad_scale)), 1e-6);
}

TEST(cross_entropy, masked_rows_get_zero_gradient_and_zero_loss) {
  auto be = make_test_backend();
  const std::int64_t vocab = 12;
  const std::vector<std::int32_t> labels = {ignore_index, 3, -1, 0, ignore_index};
  ce_problem p = make_problem(*be, labels, vocab, 5.0f, 3);
  const reference want = reference_cross_entropy(to_vector(p.logits), labels, vocab);
  run(*be, p, 1.0f);
  for (std::int64_t i : {0, 2, 4}) {
    EXPECT_EQ(p.row_loss(i, 0), 0.0f) << "row " << i;
    for (std::int64_t j = 0; j < vocab; ++j) EXPECT_EQ(p.logits(i, j), 0.0f) << "row " << i;
  }
  EXPECT_LT(max_rel_error(p.row_loss, want.loss), 1e-6);
  EXPECT_LT(max_rel_error(p.logits, want.grad), 1e-6);
}

TEST(cross_entropy, grad_scale_scales_the_gradient_and_not_the_loss) {
  auto be = make_test_backend();
  const std::int64_t vocab = 16;
  const std::vector<std::int32_t> labels = {1, 15, ignore_index, 8};
  ce_problem unit = make_problem(*be, labels, vocab, 6.0f, 4);
  ce_problem quarter = make_problem(*be, labels, vocab, 6.0f, 4);  // the same logits
  run(*be, unit, 1.0f);
  run(*be, quarter, 0.25f);
  for (std::int64_t i = 0; i < unit.logits.view.rows; ++i) {
    EXPECT_EQ(quarter.row_loss(i, 0), unit.row_loss(i, 0)) << "row " << i;
    for (std::int64_t j = 0; j < vocab; ++j)
      EXPECT_FLOAT_EQ(quarter.logits(i, j), 0.25f * unit.logits(i, j)) << "(" << i << ", " << j << ")";
  }
}

// The fused linear+cross-entropy runs the op on chunks of rows; the chunks together
// must give what one call on all rows gives.
TEST(cross_entropy, two_chunks_equal_one_chunk) {
  auto be = make_test_backend();
  const std::int64_t vocab = 20, split = 4;
  const std::vector<std::int32_t> labels = {3, 19, ignore_index, 0, 7, 7, ignore_index, 12, 5, 1};
  const auto rows = static_cast<std::int64_t>(labels.size());
  const float grad_scale = 1.0f / 8.0f;  // one over the unmasked tokens of both chunks
  ce_problem whole = make_problem(*be, labels, vocab, 10.0f, 5);
  ce_problem chunked = make_problem(*be, labels, vocab, 10.0f, 5);
  run(*be, whole, grad_scale);
  for (auto [first, count] : {std::pair<std::int64_t, std::int64_t>{0, split}, {split, rows - split}})
    ops::cross_entropy(*be, cross_entropy_args{chunked.logits.view.row_block(first, count),
                                               chunked.labels.view.row_block(first, count),
                                               chunked.row_loss.view.row_block(first, count), grad_scale});
  double whole_loss = 0.0, chunked_loss = 0.0;
  for (std::int64_t i = 0; i < rows; ++i) {
    whole_loss += whole.row_loss(i, 0);
    chunked_loss += chunked.row_loss(i, 0);
  }
  EXPECT_EQ(chunked_loss, whole_loss);
  EXPECT_GT(whole_loss, 0.0);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < vocab; ++j) ASSERT_EQ(chunked.logits(i, j), whole.logits(i, j)) << i << ", " << j;
}

TEST(cross_entropy, labels_at_or_past_the_vocabulary_throw_and_write_nothing) {
  auto be = make_test_backend();
  const std::int64_t vocab = 20;
  ce_problem p = make_problem(*be, {3, ignore_index, 20, 1}, vocab, 2.0f, 6);
  const std::vector<float> logits_before = snapshot(p.logits.storage), loss_before = snapshot(p.row_loss.storage);
  const std::string what = internal_error_message([&] { run(*be, p, 1.0f); });
  EXPECT_TRUE(mentions(what, {"cross_entropy", "label 20", "row 2", "[0, 20)"})) << what;
  EXPECT_EQ(snapshot(p.logits.storage), logits_before);
  EXPECT_EQ(snapshot(p.row_loss.storage), loss_before);
}

}  // namespace
}  // namespace upipe
