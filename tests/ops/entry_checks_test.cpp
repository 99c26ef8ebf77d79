// The op entries reject mismatched shapes, dtypes and strides with internal_error
// before any backend runs, on the cpu backend and on the shape-only meta backend.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "ops/ops.hpp"

namespace upipe {
namespace {

memory_limits small_limits() { return memory_limits{std::size_t{256} << 20, std::size_t{64} << 20}; }

struct entry_checks : ::testing::Test {
  std::unique_ptr<backend> be = make_cpu_backend(small_limits());
  std::vector<tensor> keep;  // tensors live as long as the test

  head_view heads(std::int64_t t, std::int64_t h, std::int64_t d, dtype type = dtype::f32) {
    keep.push_back(be->allocate_zeroed(mem_tag::activations, type, shape{t, h, d}, "h"));
    return keep.back().heads();
  }
  mat_view matrix(std::int64_t r, std::int64_t c) {
    keep.push_back(be->allocate_zeroed(mem_tag::activations, dtype::f32, shape{r, c}, "m"));
    return keep.back().matrix();
  }
};

TEST_F(entry_checks, gemm) {
  const mat_view a = matrix(4, 5), b = matrix(5, 6), c = matrix(4, 6), c_bad = matrix(4, 7);
  EXPECT_NO_THROW(ops::gemm(*be, gemm_args{a, transpose::none, b, transpose::none, c}));
  EXPECT_THROW(ops::gemm(*be, gemm_args{a, transpose::yes, b, transpose::none, c}), internal_error);  // k mismatch
  EXPECT_THROW(ops::gemm(*be, gemm_args{a, transpose::none, b, transpose::none, c_bad}), internal_error);
  EXPECT_THROW(ops::gemm(*be, gemm_args{a, transpose::none, b, transpose::yes, c}), internal_error);
  mat_view short_ld = c;
  short_ld.ld = 5;
  EXPECT_THROW(ops::gemm(*be, gemm_args{a, transpose::none, b, transpose::none, short_ld}), internal_error);
  mat_view bf16_a = a;
  bf16_a.type = dtype::bf16;  // the cpu works in f32 only
  EXPECT_THROW(ops::gemm(*be, gemm_args{bf16_a, transpose::none, b, transpose::none, c}), internal_error);
}

TEST_F(entry_checks, sdpa_forward) {
  const head_view q = heads(8, 4, 16), k = heads(8, 2, 16), v = heads(8, 2, 16), out = heads(8, 4, 16),
                  lse = heads(8, 4, 1);
  EXPECT_NO_THROW(ops::sdpa_forward(*be, sdpa_forward_args{q, k, v, out, lse}));
  const head_view k3 = heads(8, 3, 16), v3 = heads(8, 3, 16);
  EXPECT_THROW(ops::sdpa_forward(*be, sdpa_forward_args{q, k3, v3, out, lse}), internal_error);  // 4 % 3
  const head_view k_long = heads(12, 2, 16), v_long = heads(12, 2, 16);
  EXPECT_THROW(ops::sdpa_forward(*be, sdpa_forward_args{q, k_long, v_long, out, lse, attn_mask::causal}),
               internal_error);
  EXPECT_NO_THROW(ops::sdpa_forward(*be, sdpa_forward_args{q, k_long, v_long, out, lse, attn_mask::none}));
  EXPECT_THROW(ops::sdpa_forward(*be, sdpa_forward_args{q, k, heads(8, 2, 8), out, lse}), internal_error);
  EXPECT_THROW(ops::sdpa_forward(*be, sdpa_forward_args{q, k, v, heads(8, 2, 16), lse}), internal_error);
  EXPECT_THROW(ops::sdpa_forward(*be, sdpa_forward_args{q, k, v, out, heads(8, 4, 2)}), internal_error);
  EXPECT_THROW(ops::sdpa_forward(*be, sdpa_forward_args{q, k, v, out, heads(8, 4, 1, dtype::bf16)}), internal_error);
  head_view overlapping = out;
  overlapping.token_stride = 8;  // token rows would overlap each other's heads
  EXPECT_THROW(ops::sdpa_forward(*be, sdpa_forward_args{q, k, v, overlapping, lse}), internal_error);
}

TEST_F(entry_checks, sdpa_backward) {
  const head_view q = heads(8, 4, 16), k = heads(8, 2, 16), lse = heads(8, 4, 1);
  const auto args = [&] {
    return sdpa_backward_args{q,          k,          heads(8, 2, 16), heads(8, 4, 16), heads(8, 4, 16), lse,
                              heads(8, 4, 16), heads(8, 2, 16), heads(8, 2, 16), heads(8, 4, 16), heads(8, 4, 1)};
  };
  EXPECT_NO_THROW(ops::sdpa_backward(*be, args()));
  sdpa_backward_args bad = args();
  bad.d_k = heads(8, 4, 16);
  EXPECT_THROW(ops::sdpa_backward(*be, bad), internal_error);
  bad = args();
  bad.d_q = heads(8, 2, 16);
  EXPECT_THROW(ops::sdpa_backward(*be, bad), internal_error);
  bad = args();
  bad.softmax_sum = heads(7, 4, 1);
  EXPECT_THROW(ops::sdpa_backward(*be, bad), internal_error);
  bad = args();
  bad.d_q_accum = heads(8, 4, 16, dtype::bf16);
  EXPECT_THROW(ops::sdpa_backward(*be, bad), internal_error);
}

TEST_F(entry_checks, rope) {
  const head_view x = heads(10, 2, 8);
  const position_run good[] = {{0, 0, 4}, {4, 100, 6}};
  EXPECT_NO_THROW(ops::rope(*be, rope_args{x, good, rope_config{}}));
  const position_run overlap[] = {{0, 0, 5}, {4, 100, 6}};
  EXPECT_THROW(ops::rope(*be, rope_args{x, overlap, rope_config{}}), internal_error);
  const position_run outside[] = {{6, 0, 5}};
  EXPECT_THROW(ops::rope(*be, rope_args{x, outside, rope_config{}}), internal_error);
  EXPECT_THROW(ops::rope(*be, rope_args{heads(10, 2, 7), good, rope_config{}}), internal_error);
  rope_config bad_scaling;
  bad_scaling.scaling = rope_scaling{true, 8.0, 4.0, 1.0, 8192};  // low >= high
  EXPECT_THROW(ops::rope(*be, rope_args{x, good, bad_scaling}), internal_error);
  EXPECT_THROW(ops::rope_inverse_frequencies(rope_config{}, 7), internal_error);
}

TEST_F(entry_checks, rmsnorm) {
  const mat_view x = matrix(4, 8), w = matrix(1, 8), y = matrix(4, 8), rstd = matrix(4, 1);
  EXPECT_NO_THROW(ops::rmsnorm_forward(*be, rmsnorm_forward_args{x, w, y, rstd}));
  EXPECT_THROW(ops::rmsnorm_forward(*be, rmsnorm_forward_args{x, matrix(1, 7), y, rstd}), internal_error);
  EXPECT_THROW(ops::rmsnorm_forward(*be, rmsnorm_forward_args{x, w, y, matrix(3, 1)}), internal_error);
  EXPECT_NO_THROW(ops::rmsnorm_backward(*be, rmsnorm_backward_args{x, w, rstd, y, matrix(4, 8), matrix(1, 8)}));
  EXPECT_THROW(ops::rmsnorm_backward(*be, rmsnorm_backward_args{x, w, rstd, y, matrix(4, 8), matrix(4, 8)}),
               internal_error);
  EXPECT_THROW(ops::rmsnorm_backward(*be, rmsnorm_backward_args{x, w, rstd, matrix(4, 9), matrix(4, 8), matrix(1, 8)}),
               internal_error);
}

TEST_F(entry_checks, layout_ops_and_merge) {
  const head_view a = heads(4, 2, 8), b = heads(4, 2, 8);
  EXPECT_THROW(ops::copy_heads(*be, a, heads(4, 3, 8)), internal_error);
  EXPECT_THROW(ops::add_heads(*be, heads(4, 2, 8, dtype::bf16), b), internal_error);  // dst must be f32
  EXPECT_NO_THROW(ops::add_heads(*be, a, heads(4, 2, 8, dtype::bf16)));
  const head_view lse = heads(4, 2, 1), lse_part = heads(4, 2, 1);
  ops::fill_heads(*be, lse, -std::numeric_limits<float>::infinity());
  EXPECT_NO_THROW(ops::lse_merge(*be, lse_merge_args{a, lse, b, lse_part}));
  EXPECT_THROW(ops::lse_merge(*be, lse_merge_args{a, lse, heads(4, 2, 4), lse_part}), internal_error);
  EXPECT_THROW(ops::lse_merge(*be, lse_merge_args{a, lse, b, heads(4, 1, 1)}), internal_error);
  EXPECT_THROW(ops::lse_merge(*be, lse_merge_args{heads(4, 2, 8, dtype::bf16), lse, b, lse_part}), internal_error);
}

// The planner runs the same entries on meta: bf16 work type, no data, same rules.
TEST(entry_checks_meta, checks_shapes_without_data) {
  auto be = make_meta_backend(small_limits());
  tensor q = be->allocate(mem_tag::activations, dtype::bf16, shape{64, 8, 128}, "q");
  tensor k = be->allocate(mem_tag::activations, dtype::bf16, shape{64, 2, 128}, "k");
  tensor out = be->allocate(mem_tag::activations, dtype::bf16, shape{64, 8, 128}, "out");
  tensor lse = be->allocate(mem_tag::activations, dtype::f32, shape{64, 8, 1}, "lse");
  EXPECT_NO_THROW(ops::sdpa_forward(*be, sdpa_forward_args{q.heads(), k.heads(), k.heads(), out.heads(), lse.heads()}));
  EXPECT_THROW(ops::sdpa_forward(*be, sdpa_forward_args{q.heads(), k.heads(), k.heads(), out.heads(), q.heads()}),
               internal_error);
}

}  // namespace
}  // namespace upipe
