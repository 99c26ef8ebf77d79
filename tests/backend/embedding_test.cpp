// embedding forward (a row gather, exact) and backward (a scatter-add into the fp32
// table gradient where repeated ids add up), on padded views and a strided id column;
// ids outside the vocabulary throw, name the id, its row and V, and write nothing.
#include <gtest/gtest.h>

#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "backend/ops.hpp"
#include "op_test_support.hpp"

namespace upipe {
namespace {

using namespace op_test;

TEST(embedding_forward, copies_the_table_rows_of_the_ids) {
  auto be = make_test_backend();
  std::mt19937 rng(1);
  const std::int64_t vocab = 11, dim = 7;
  const std::int32_t ids_values[] = {3, 0, 10, 3, 7};
  test_matrix table = make_matrix(*be, vocab, dim, 2, rng, -2.0f, 2.0f, "table");
  test_matrix out = make_matrix(*be, 5, dim, 3, rng, 50.0f, 60.0f, "out");  // garbage: overwritten
  index_column ids = make_index_column(*be, ids_values, 1, "ids");
  const std::vector<float> out_before = snapshot(out.storage);
  ops::embedding_forward(*be, embedding_forward_args{table.view, ids.view, out.view});
  for (std::int64_t r = 0; r < 5; ++r)
    for (std::int64_t j = 0; j < dim + 3; ++j) {
      const float got = out.storage.as<float>()[r * (dim + 3) + j];
      if (j < dim)
        EXPECT_EQ(got, table(ids_values[r], j)) << "row " << r << " col " << j;
      else
        EXPECT_EQ(got, out_before[r * (dim + 3) + j]) << "padding of row " << r;
    }
}

TEST(embedding_backward, scatters_rows_and_adds_up_repeated_ids) {
  auto be = make_test_backend();
  std::mt19937 rng(2);
  const std::int64_t vocab = 10, dim = 6;
  const std::int32_t ids_values[] = {2, 5, 2, 2, 0, 9, 5};
  const auto n = static_cast<std::int64_t>(std::size(ids_values));
  test_matrix d_out = make_matrix(*be, n, dim, 1, rng, -1.0f, 1.0f, "d_out");
  test_matrix d_table = make_matrix(*be, vocab, dim, 0, rng, -0.5f, 0.5f, "d_table");  // earlier gradient
  index_column ids = make_index_column(*be, ids_values, 2, "ids");
  const std::vector<double> prior = to_vector(d_table);
  std::vector<double> want = prior;
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t j = 0; j < dim; ++j) want[ids_values[r] * dim + j] += d_out(r, j);
  ops::embedding_backward(*be, embedding_backward_args{d_out.view, ids.view, d_table.view});
  EXPECT_LT(max_rel_error(d_table, want), 1e-6);
  // Rows no id points at are left exactly as they were.
  for (std::int64_t v : {1, 3, 4, 6, 7, 8})
    for (std::int64_t j = 0; j < dim; ++j) EXPECT_EQ(d_table(v, j), prior[v * dim + j]) << "row " << v;
  // Three copies of id 2: its row gained the sum of those three d_out rows.
  EXPECT_NEAR(d_table(2, 4), prior[2 * dim + 4] + d_out(0, 4) + d_out(2, 4) + d_out(3, 4), 1e-6);
}

TEST(embedding, ids_outside_the_vocabulary_throw_and_write_nothing) {
  auto be = make_test_backend();
  std::mt19937 rng(3);
  const std::int64_t vocab = 11, dim = 4;
  test_matrix table = make_matrix(*be, vocab, dim, 0, rng, -1.0f, 1.0f, "table");
  test_matrix out = make_matrix(*be, 3, dim, 0, rng, -1.0f, 1.0f, "out");
  test_matrix d_table = make_matrix(*be, vocab, dim, 0, rng, -1.0f, 1.0f, "d_table");
  const std::vector<float> out_before = snapshot(out.storage), d_table_before = snapshot(d_table.storage);
  const std::int32_t too_large[] = {1, 4, 11};
  const std::int32_t negative[] = {0, -1, 2};
  index_column large_ids = make_index_column(*be, too_large, 0, "ids");
  index_column negative_ids = make_index_column(*be, negative, 0, "ids");

  std::string what = internal_error_message(
      [&] { ops::embedding_forward(*be, embedding_forward_args{table.view, large_ids.view, out.view}); });
  EXPECT_TRUE(mentions(what, {"embedding_forward", "id 11", "row 2", "[0, 11)"})) << what;
  what = internal_error_message(
      [&] { ops::embedding_forward(*be, embedding_forward_args{table.view, negative_ids.view, out.view}); });
  EXPECT_TRUE(mentions(what, {"id -1", "row 1", "[0, 11)"})) << what;
  what = internal_error_message(
      [&] { ops::embedding_backward(*be, embedding_backward_args{out.view, large_ids.view, d_table.view}); });
  EXPECT_TRUE(mentions(what, {"embedding_backward", "id 11", "row 2", "[0, 11)"})) << what;
  EXPECT_EQ(snapshot(out.storage), out_before);
  EXPECT_EQ(snapshot(d_table.storage), d_table_before);
}

}  // namespace
}  // namespace upipe
