// The op entries reject mismatched shapes, dtypes and strides with internal_error
// before any backend runs, on the cpu backend and on the shape-only meta backend.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "backend/ops.hpp"
#include "op_test_support.hpp"

namespace upipe {
namespace {

using namespace op_test;

struct entry_checks : ::testing::Test {
  std::unique_ptr<backend> be = make_cpu_backend(small_limits());
  std::vector<tensor> keep;  // tensors live as long as the test

  head_view heads(std::int64_t t, std::int64_t h, std::int64_t d, dtype type = dtype::f32) {
    keep.push_back(be->allocate_zeroed(mem_tag::activations, type, shape{t, h, d}, "h"));
    return keep.back().heads();
  }
  mat_view matrix(std::int64_t r, std::int64_t c, dtype type = dtype::f32) {
    keep.push_back(be->allocate_zeroed(mem_tag::activations, type, shape{r, c}, "m"));
    return keep.back().matrix();
  }
  // Zeroed, so every id and label is valid.
  mat_view ids(std::int64_t n) { return matrix(n, 1, dtype::i32); }
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
    return sdpa_backward_args{q,   k, heads(8, 2, 16), heads(8, 4, 16), heads(8, 4, 16),
                              lse, heads(8, 4, 16), heads(8, 2, 16), heads(8, 2, 16)};
  };
  EXPECT_NO_THROW(ops::sdpa_backward(*be, args()));
  sdpa_backward_args bad = args();
  bad.d_k = heads(8, 4, 16);
  EXPECT_THROW(ops::sdpa_backward(*be, bad), internal_error);
  bad = args();
  bad.d_q = heads(8, 2, 16);
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
  bad_scaling.scaling = rope_scaling{rope_kind::llama3, 8.0, 4.0, 1.0, 8192};  // low >= high
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
  // dst is f32 or bf16 on any backend (a kept bf16 gradient shard takes a later micro-batch).
  EXPECT_NO_THROW(ops::add_heads(*be, heads(4, 2, 8, dtype::bf16), b));
  EXPECT_NO_THROW(ops::add_heads(*be, a, heads(4, 2, 8, dtype::bf16)));
  // i32 ids and labels are never converted by the layout ops.
  EXPECT_THROW(ops::add_heads(*be, a, heads(4, 2, 8, dtype::i32)), internal_error);
  EXPECT_THROW(ops::copy_heads(*be, a, heads(4, 2, 8, dtype::i32)), internal_error);
  EXPECT_THROW(ops::fill_heads(*be, heads(4, 2, 8, dtype::i32), 0.0f), internal_error);
  const head_view lse = heads(4, 2, 1), lse_part = heads(4, 2, 1);
  ops::fill_heads(*be, lse, -std::numeric_limits<float>::infinity());
  EXPECT_NO_THROW(ops::lse_merge(*be, lse_merge_args{a, lse, b, lse_part}));
  EXPECT_THROW(ops::lse_merge(*be, lse_merge_args{a, lse, heads(4, 2, 4), lse_part}), internal_error);
  EXPECT_THROW(ops::lse_merge(*be, lse_merge_args{a, lse, b, heads(4, 1, 1)}), internal_error);
  EXPECT_THROW(ops::lse_merge(*be, lse_merge_args{heads(4, 2, 8, dtype::bf16), lse, b, lse_part}), internal_error);
}

TEST_F(entry_checks, embedding) {
  const mat_view table = matrix(10, 4), out = matrix(6, 4);
  EXPECT_NO_THROW(ops::embedding_forward(*be, embedding_forward_args{table, ids(6), out}));
  EXPECT_THROW(ops::embedding_forward(*be, embedding_forward_args{table, ids(5), out}), internal_error);
  EXPECT_THROW(ops::embedding_forward(*be, embedding_forward_args{table, matrix(6, 2, dtype::i32), out}),
               internal_error);
  EXPECT_THROW(ops::embedding_forward(*be, embedding_forward_args{table, matrix(6, 1), out}), internal_error);
  EXPECT_THROW(ops::embedding_forward(*be, embedding_forward_args{table, ids(6), matrix(6, 5)}), internal_error);
  EXPECT_THROW(ops::embedding_forward(*be, embedding_forward_args{matrix(10, 4, dtype::bf16), ids(6), out}),
               internal_error);
  EXPECT_THROW(ops::embedding_forward(*be, embedding_forward_args{table, ids(6), matrix(6, 4, dtype::bf16)}),
               internal_error);
  const std::string what = internal_error_message(
      [&] { ops::embedding_forward(*be, embedding_forward_args{table, matrix(6, 1), out}); });
  EXPECT_TRUE(mentions(what, {"ops::embedding_forward: ids (6 x 1, ld 1, f32)", "dtype must be i32"})) << what;

  const mat_view d_out = matrix(6, 4), d_table = matrix(10, 4);
  EXPECT_NO_THROW(ops::embedding_backward(*be, embedding_backward_args{d_out, ids(6), d_table}));
  EXPECT_THROW(ops::embedding_backward(*be, embedding_backward_args{d_out, ids(7), d_table}), internal_error);
  EXPECT_THROW(ops::embedding_backward(*be, embedding_backward_args{d_out, ids(6), matrix(10, 5)}), internal_error);
  EXPECT_THROW(ops::embedding_backward(*be, embedding_backward_args{d_out, ids(6), matrix(10, 4, dtype::bf16)}),
               internal_error);
  EXPECT_THROW(ops::embedding_backward(*be, embedding_backward_args{matrix(6, 4, dtype::i32), ids(6), d_table}),
               internal_error);
}

TEST_F(entry_checks, swiglu) {
  const mat_view gate = matrix(5, 8), up = matrix(5, 8), out = matrix(5, 8);
  EXPECT_NO_THROW(ops::swiglu_forward(*be, swiglu_forward_args{gate, up, out}));
  EXPECT_THROW(ops::swiglu_forward(*be, swiglu_forward_args{gate, matrix(5, 9), out}), internal_error);
  EXPECT_THROW(ops::swiglu_forward(*be, swiglu_forward_args{gate, up, matrix(4, 8)}), internal_error);
  EXPECT_THROW(ops::swiglu_forward(*be, swiglu_forward_args{matrix(5, 8, dtype::bf16), up, out}), internal_error);
  mat_view short_ld = out;
  short_ld.ld = 7;
  EXPECT_THROW(ops::swiglu_forward(*be, swiglu_forward_args{gate, up, short_ld}), internal_error);

  const mat_view d_out = matrix(5, 8);
  EXPECT_NO_THROW(ops::swiglu_backward(*be, swiglu_backward_args{gate, up, d_out, matrix(5, 8), matrix(5, 8)}));
  EXPECT_NO_THROW(ops::swiglu_backward(*be, swiglu_backward_args{gate, up, d_out, gate, up}));  // in place
  EXPECT_THROW(ops::swiglu_backward(*be, swiglu_backward_args{gate, up, d_out, matrix(5, 8), matrix(5, 7)}),
               internal_error);
  EXPECT_THROW(ops::swiglu_backward(*be, swiglu_backward_args{gate, up, matrix(6, 8), gate, up}), internal_error);
  EXPECT_THROW(ops::swiglu_backward(*be, swiglu_backward_args{gate, up, matrix(5, 8, dtype::bf16), gate, up}),
               internal_error);
  EXPECT_THROW(ops::swiglu_backward(*be, swiglu_backward_args{gate, up, d_out, matrix(5, 8, dtype::i32), up}),
               internal_error);
}

TEST_F(entry_checks, cross_entropy) {
  const mat_view logits = matrix(4, 10), loss = matrix(4, 1);
  EXPECT_NO_THROW(ops::cross_entropy(*be, cross_entropy_args{logits, ids(4), loss, 0.25f}));
  EXPECT_THROW(ops::cross_entropy(*be, cross_entropy_args{matrix(4, 10, dtype::bf16), ids(4), loss}), internal_error);
  EXPECT_THROW(ops::cross_entropy(*be, cross_entropy_args{logits, matrix(4, 1), loss}), internal_error);
  EXPECT_THROW(ops::cross_entropy(*be, cross_entropy_args{logits, ids(3), loss}), internal_error);
  EXPECT_THROW(ops::cross_entropy(*be, cross_entropy_args{logits, ids(4), matrix(4, 2)}), internal_error);
  EXPECT_THROW(ops::cross_entropy(*be, cross_entropy_args{logits, ids(4), matrix(4, 1, dtype::bf16)}),
               internal_error);
  const std::string what = internal_error_message([&] {
    ops::cross_entropy(*be, cross_entropy_args{logits, ids(4), loss, std::numeric_limits<float>::quiet_NaN()});
  });
  EXPECT_TRUE(mentions(what, {"ops::cross_entropy: grad_scale", "must be finite"})) << what;
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

// Residual adds in bf16 (the working dtype) and fp32 accumulation both pass; i32 never.
TEST(entry_checks_meta, add_heads_takes_a_bf16_or_f32_dst) {
  auto be = make_meta_backend(small_limits());
  tensor residual = be->allocate(mem_tag::activations, dtype::bf16, shape{64, 1, 4096}, "residual");
  tensor acc = be->allocate(mem_tag::activations, dtype::f32, shape{64, 1, 4096}, "acc");
  tensor ids = be->allocate(mem_tag::activations, dtype::i32, shape{64, 1, 4096}, "ids");
  EXPECT_NO_THROW(ops::add_heads(*be, residual.heads(), residual.heads()));
  EXPECT_NO_THROW(ops::add_heads(*be, residual.heads(), acc.heads()));
  EXPECT_NO_THROW(ops::add_heads(*be, acc.heads(), residual.heads()));
  EXPECT_THROW(ops::add_heads(*be, ids.heads(), residual.heads()), internal_error);
}

// On meta the working dtype is bf16: tables, activations and d_out in bf16, ids i32.
TEST(entry_checks_meta, embedding_swiglu_and_cross_entropy) {
  auto be = make_meta_backend(small_limits());
  const auto make = [&](dtype type, std::int64_t rows, std::int64_t cols) {
    return be->allocate(mem_tag::activations, type, shape{rows, cols}, "m");
  };
  tensor table = make(dtype::bf16, 8000, 1024), f32_table = make(dtype::f32, 8000, 1024);
  tensor ids = make(dtype::i32, 64, 1), x = make(dtype::bf16, 64, 1024), d_x = make(dtype::f32, 64, 1024);
  tensor d_table = make(dtype::f32, 8000, 1024);
  EXPECT_NO_THROW(ops::embedding_forward(*be, embedding_forward_args{table.matrix(), ids.matrix(), x.matrix()}));
  EXPECT_THROW(ops::embedding_forward(*be, embedding_forward_args{f32_table.matrix(), ids.matrix(), x.matrix()}),
               internal_error);
  for (const tensor* d_out : {&x, &d_x})
    EXPECT_NO_THROW(
        ops::embedding_backward(*be, embedding_backward_args{d_out->matrix(), ids.matrix(), d_table.matrix()}));
  EXPECT_THROW(ops::embedding_backward(*be, embedding_backward_args{x.matrix(), ids.matrix(), table.matrix()}),
               internal_error);

  tensor gate = make(dtype::bf16, 64, 14336), up = make(dtype::bf16, 64, 14336), d_out = make(dtype::f32, 64, 14336);
  EXPECT_NO_THROW(ops::swiglu_forward(*be, swiglu_forward_args{gate.matrix(), up.matrix(), gate.matrix()}));
  EXPECT_NO_THROW(ops::swiglu_backward(
      *be, swiglu_backward_args{gate.matrix(), up.matrix(), d_out.matrix(), gate.matrix(), up.matrix()}));
  EXPECT_THROW(ops::swiglu_forward(*be, swiglu_forward_args{d_out.matrix(), up.matrix(), gate.matrix()}),
               internal_error);

  tensor logits = make(dtype::f32, 64, 128256), bf16_logits = make(dtype::bf16, 64, 128256);
  tensor loss = make(dtype::f32, 64, 1);
  EXPECT_NO_THROW(ops::cross_entropy(*be, cross_entropy_args{logits.matrix(), ids.matrix(), loss.matrix()}));
  EXPECT_THROW(ops::cross_entropy(*be, cross_entropy_args{bf16_logits.matrix(), ids.matrix(), loss.matrix()}),
               internal_error);
}

}  // namespace
}  // namespace upipe
