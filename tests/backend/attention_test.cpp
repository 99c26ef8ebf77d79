// sdpa_forward, sdpa_backward and lse_merge on the cpu backend against an independent
// fp64 reference written here (full probability matrices, a mask predicate), finite
// differences of a scalar loss, and the ring identities: blocks merged by log-sum-exp
// equal the whole, and per-block backward with the final lse sums to the whole.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "op_test_support.hpp"

namespace upipe {
namespace {

using namespace op_test;

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();
constexpr float neg_inf_f = -std::numeric_limits<float>::infinity();

// How a (tokens, heads, dim) view sits in its allocation.
enum class layout { dense, head_block, head_major };

struct heads_buffer {
  tensor storage;
  head_view view;
};

heads_buffer make_heads_uninitialized(backend& be, std::int64_t tokens, std::int64_t heads, std::int64_t dim,
                                      layout how, const char* label) {
  if (how == layout::head_block) {
    // Heads [1, 1 + heads) of a buffer with two spare heads.
    tensor t = be.allocate(mem_tag::activations, dtype::f32, shape{tokens, heads + 2, dim}, label);
    head_view v = t.heads().head_block(1, heads);
    return {std::move(t), v};
  }
  if (how == layout::head_major) {
    tensor t = be.allocate(mem_tag::activations, dtype::f32, shape{heads, tokens, dim}, label);
    head_view v{t.data(), dtype::f32, tokens, heads, dim, dim, tokens * dim};
    return {std::move(t), v};
  }
  tensor t = be.allocate(mem_tag::activations, dtype::f32, shape{tokens, heads, dim}, label);
  head_view v = t.heads();
  return {std::move(t), v};
}

// Every byte of the allocation starts as NaN, so a read of the spare heads shows up.
heads_buffer make_heads(backend& be, std::int64_t tokens, std::int64_t heads, std::int64_t dim, layout how,
                        const char* label) {
  heads_buffer b = make_heads_uninitialized(be, tokens, heads, dim, how, label);
  std::fill(b.storage.as<float>(), b.storage.as<float>() + b.storage.numel(), nan_f);
  return b;
}

float& at(const head_view& v, std::int64_t t, std::int64_t h, std::int64_t x) {
  return static_cast<float*>(v.data)[t * v.token_stride + h * v.head_stride + x];
}

void fill_random(const head_view& v, std::mt19937& rng, float range) {
  std::uniform_real_distribution<float> dist(-range, range);
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (std::int64_t h = 0; h < v.heads; ++h)
      for (std::int64_t x = 0; x < v.dim; ++x) at(v, t, h, x) = dist(rng);
}

void fill_value(const head_view& v, float value) {
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (std::int64_t h = 0; h < v.heads; ++h)
      for (std::int64_t x = 0; x < v.dim; ++x) at(v, t, h, x) = value;
}

// A dense fp64 (tokens, heads, dim) array: the reference's own storage.
struct array3 {
  std::int64_t tokens = 0, heads = 0, dim = 0;
  std::vector<double> data;
  array3(std::int64_t t, std::int64_t h, std::int64_t d) : tokens(t), heads(h), dim(d), data(t * h * d, 0.0) {}
  double& operator()(std::int64_t t, std::int64_t h, std::int64_t x) { return data[(t * heads + h) * dim + x]; }
  double operator()(std::int64_t t, std::int64_t h, std::int64_t x) const { return data[(t * heads + h) * dim + x]; }
};

array3 to_array(const head_view& v) {
  array3 a(v.tokens, v.heads, v.dim);
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (std::int64_t h = 0; h < v.heads; ++h)
      for (std::int64_t x = 0; x < v.dim; ++x) a(t, h, x) = at(v, t, h, x);
  return a;
}

// max |got - want| / max |want| over the whole tensor.
double rel_error(const head_view& got, const array3& want) {
  double err = 0.0, scale = 0.0;
  for (std::int64_t t = 0; t < want.tokens; ++t)
    for (std::int64_t h = 0; h < want.heads; ++h)
      for (std::int64_t x = 0; x < want.dim; ++x) {
        err = worse(err, std::abs(at(got, t, h, x) - want(t, h, x)));
        scale = std::max(scale, std::abs(want(t, h, x)));
      }
  return err / scale;
}

using visibility = std::function<bool(std::int64_t query, std::int64_t key)>;

bool causal_visible(std::int64_t i, std::int64_t j) { return j <= i; }
bool all_visible(std::int64_t, std::int64_t) { return true; }

// Row-normalized attention probabilities P(h, i, j), computed directly from the inputs.
struct reference {
  array3 out, lse, probs;  // (sq, hq, d), (sq, hq, 1), (sq, hq, skv)
};

reference reference_forward(const array3& q, const array3& k, const array3& v, double scale, const visibility& vis) {
  const std::int64_t sq = q.tokens, skv = k.tokens, hq = q.heads, d = q.dim, group = hq / k.heads;
  reference r{array3(sq, hq, d), array3(sq, hq, 1), array3(sq, hq, skv)};
  std::vector<double> s(skv);
  for (std::int64_t h = 0; h < hq; ++h)
    for (std::int64_t i = 0; i < sq; ++i) {
      double top = -std::numeric_limits<double>::infinity();
      for (std::int64_t j = 0; j < skv; ++j) {
        if (!vis(i, j)) continue;
        s[j] = 0.0;
        for (std::int64_t x = 0; x < d; ++x) s[j] += q(i, h, x) * k(j, h / group, x);
        s[j] *= scale;
        top = std::max(top, s[j]);
      }
      double sum = 0.0;
      for (std::int64_t j = 0; j < skv; ++j)
        if (vis(i, j)) sum += std::exp(s[j] - top);
      r.lse(i, h, 0) = top + std::log(sum);
      for (std::int64_t j = 0; j < skv; ++j) {
        const double p = vis(i, j) ? std::exp(s[j] - top) / sum : 0.0;
        r.probs(i, h, j) = p;
        for (std::int64_t x = 0; x < d; ++x) r.out(i, h, x) += p * v(j, h / group, x);
      }
    }
  return r;
}

struct reference_grads {
  array3 d_q, d_k, d_v;
};

// The textbook softmax backward: D_i = sum_j P_ij dP_ij (not the d_out . out shortcut).
reference_grads reference_backward(const array3& q, const array3& k, const array3& v, const array3& d_out,
                                   double scale, const visibility& vis) {
  const reference f = reference_forward(q, k, v, scale, vis);
  const std::int64_t sq = q.tokens, skv = k.tokens, hq = q.heads, d = q.dim, group = hq / k.heads;
  reference_grads g{array3(sq, hq, d), array3(skv, k.heads, d), array3(skv, k.heads, d)};
  std::vector<double> d_p(skv);
  for (std::int64_t h = 0; h < hq; ++h)
    for (std::int64_t i = 0; i < sq; ++i) {
      const std::int64_t kv = h / group;
      double row = 0.0;
      for (std::int64_t j = 0; j < skv; ++j) {
        d_p[j] = 0.0;
        for (std::int64_t x = 0; x < d; ++x) d_p[j] += d_out(i, h, x) * v(j, kv, x);
        row += f.probs(i, h, j) * d_p[j];
      }
      for (std::int64_t j = 0; j < skv; ++j) {
        const double p = f.probs(i, h, j), d_s = p * (d_p[j] - row);
        for (std::int64_t x = 0; x < d; ++x) {
          g.d_q(i, h, x) += scale * d_s * k(j, kv, x);
          g.d_k(j, kv, x) += scale * d_s * q(i, h, x);
          g.d_v(j, kv, x) += p * d_out(i, h, x);
        }
      }
    }
  return g;
}

// Inputs and outputs of one attention call, in the layouts a strategy would use.
struct attention_problem {
  heads_buffer q, k, v, out, lse;
  float scale;
};

attention_problem make_problem(backend& be, std::int64_t sq, std::int64_t skv, std::int64_t hq, std::int64_t hk,
                               std::int64_t d, std::uint32_t seed) {
  std::mt19937 rng(seed);
  attention_problem p{make_heads(be, sq, hq, d, layout::head_block, "q"),
                      make_heads(be, skv, hk, d, layout::head_major, "k"),
                      make_heads(be, skv, hk, d, layout::head_block, "v"),
                      make_heads(be, sq, hq, d, layout::head_block, "out"),
                      make_heads(be, sq, hq, 1, layout::dense, "lse"),
                      static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)))};
  fill_random(p.q.view, rng, 1.5f);
  fill_random(p.k.view, rng, 1.5f);
  fill_random(p.v.view, rng, 1.0f);
  fill_value(p.out.view, nan_f);
  fill_value(p.lse.view, nan_f);
  return p;
}

void run_forward(backend& be, const attention_problem& p, attn_mask mask) {
  ops::sdpa_forward(be, sdpa_forward_args{p.q.view, p.k.view, p.v.view, p.out.view, p.lse.view, mask, p.scale});
}

TEST(sdpa_forward, matches_reference_for_gqa_masks_and_strided_views) {
  auto be = make_test_backend();
  std::uint32_t seed = 100;
  for (std::int64_t group : {1, 2, 4})
    for (attn_mask mask : {attn_mask::causal, attn_mask::none}) {
      const std::int64_t hk = 2, hq = hk * group, d = 16;
      const std::int64_t sq = mask == attn_mask::causal ? 37 : 19, skv = mask == attn_mask::causal ? 37 : 31;
      attention_problem p = make_problem(*be, sq, skv, hq, hk, d, seed++);
      run_forward(*be, p, mask);
      const reference r = reference_forward(to_array(p.q.view), to_array(p.k.view), to_array(p.v.view), p.scale,
                                            mask == attn_mask::causal ? visibility(causal_visible) : all_visible);
      EXPECT_LT(rel_error(p.out.view, r.out), 1e-5) << "group " << group << " mask " << int(mask);
      EXPECT_LT(rel_error(p.lse.view, r.lse), 1e-5) << "group " << group << " mask " << int(mask);
      // The spare heads around the head block stay untouched.
      EXPECT_TRUE(std::isnan(static_cast<float*>(p.out.storage.data())[0]));
    }
}

// Fills the backward's outputs with NaN so that anything read before being written (or
// accumulated into) shows up.
struct backward_buffers {
  heads_buffer d_out, d_q, d_k, d_v;
};

backward_buffers make_backward_buffers(backend& be, const attention_problem& p, std::uint32_t seed) {
  std::mt19937 rng(seed);
  const head_view& q = p.q.view;
  const head_view& k = p.k.view;
  backward_buffers b{make_heads(be, q.tokens, q.heads, q.dim, layout::head_block, "d_out"),
                     make_heads(be, q.tokens, q.heads, q.dim, layout::head_major, "d_q"),
                     make_heads(be, k.tokens, k.heads, k.dim, layout::head_block, "d_k"),
                     make_heads(be, k.tokens, k.heads, k.dim, layout::dense, "d_v")};
  fill_random(b.d_out.view, rng, 1.0f);
  for (const auto* view : {&b.d_q.view, &b.d_k.view, &b.d_v.view})
    fill_value(*view, nan_f);
  return b;
}

sdpa_backward_args backward_args(const attention_problem& p, const backward_buffers& b, const head_view& k,
                                 const head_view& v, const head_view& d_k, const head_view& d_v, attn_mask mask) {
  sdpa_backward_args args;
  args.q = p.q.view;
  args.k = k;
  args.v = v;
  args.out = p.out.view;
  args.d_out = b.d_out.view;
  args.lse = p.lse.view;
  args.d_q = b.d_q.view;
  args.d_k = d_k;
  args.d_v = d_v;
  args.mask = mask;
  args.scale = p.scale;
  return args;
}

TEST(sdpa_backward, matches_reference_gradients) {
  auto be = make_test_backend();
  std::uint32_t seed = 200;
  for (std::int64_t group : {1, 2, 4})
    for (attn_mask mask : {attn_mask::causal, attn_mask::none}) {
      const std::int64_t hk = 2, hq = hk * group, d = 16;
      const std::int64_t sq = mask == attn_mask::causal ? 29 : 17, skv = mask == attn_mask::causal ? 29 : 23;
      attention_problem p = make_problem(*be, sq, skv, hq, hk, d, seed++);
      run_forward(*be, p, mask);
      backward_buffers b = make_backward_buffers(*be, p, seed++);
      ops::sdpa_backward(*be, backward_args(p, b, p.k.view, p.v.view, b.d_k.view, b.d_v.view, mask));
      const reference_grads g =
          reference_backward(to_array(p.q.view), to_array(p.k.view), to_array(p.v.view), to_array(b.d_out.view),
                             p.scale, mask == attn_mask::causal ? visibility(causal_visible) : all_visible);
      EXPECT_LT(rel_error(b.d_q.view, g.d_q), 1e-5) << "group " << group << " mask " << int(mask);
      EXPECT_LT(rel_error(b.d_k.view, g.d_k), 1e-5) << "group " << group << " mask " << int(mask);
      EXPECT_LT(rel_error(b.d_v.view, g.d_v), 1e-5) << "group " << group << " mask " << int(mask);
    }
}

// A sliding window at the rows' global indices, alone and with packed documents, under
// both masks: each query sees only the keys its window and its document allow.
TEST(sdpa, a_sliding_window_keeps_the_last_w_keys_of_each_query) {
  auto be = make_test_backend();
  struct windowed {
    attn_mask mask;
    std::int64_t sq, skv, q_first, k_first, window;
    std::vector<std::int64_t> starts;
  };
  const windowed cases[] = {{attn_mask::causal, 33, 33, 20, 20, 7, {}},
                            {attn_mask::causal, 33, 33, 20, 20, 7, {0, 25, 40}},
                            {attn_mask::causal, 33, 33, 0, 0, 2, {}},
                            {attn_mask::none, 17, 23, 40, 10, 35, {}},
                            {attn_mask::none, 17, 23, 40, 10, 35, {0, 12, 60}},
                            {attn_mask::none, 17, 23, 30, 10, 64, {}}};
  std::uint32_t seed = 600;
  for (const windowed& w : cases) {
    const document_mask rows{w.starts, w.q_first, w.k_first};
    const visibility vis = [&](std::int64_t i, std::int64_t j) {
      const std::int64_t gq = w.q_first + i, gk = w.k_first + j;
      const bool masked = w.mask == attn_mask::causal ? j <= i : true;
      return masked && gk > gq - w.window && gk >= rows.start_of(gq);
    };
    attention_problem p = make_problem(*be, w.sq, w.skv, 4, 2, 16, seed++);
    ops::sdpa_forward(*be, {p.q.view, p.k.view, p.v.view, p.out.view, p.lse.view, w.mask, p.scale, rows, w.window});
    const reference r = reference_forward(to_array(p.q.view), to_array(p.k.view), to_array(p.v.view), p.scale, vis);
    EXPECT_LT(rel_error(p.out.view, r.out), 1e-5) << "case " << seed;
    EXPECT_LT(rel_error(p.lse.view, r.lse), 1e-5) << "case " << seed;
    backward_buffers b = make_backward_buffers(*be, p, seed + 50);
    sdpa_backward_args args = backward_args(p, b, p.k.view, p.v.view, b.d_k.view, b.d_v.view, w.mask);
    args.documents = rows;
    args.window = w.window;
    ops::sdpa_backward(*be, args);
    const reference_grads g = reference_backward(to_array(p.q.view), to_array(p.k.view), to_array(p.v.view),
                                                 to_array(b.d_out.view), p.scale, vis);
    EXPECT_LT(rel_error(b.d_q.view, g.d_q), 1e-5) << "case " << seed;
    EXPECT_LT(rel_error(b.d_k.view, g.d_k), 1e-5) << "case " << seed;
    EXPECT_LT(rel_error(b.d_v.view, g.d_v), 1e-5) << "case " << seed;
  }
}

// loss = sum(w * out) in fp64, out recomputed by the reference from (possibly nudged) inputs.
double loss(const array3& q, const array3& k, const array3& v, const array3& w, double scale) {
  const reference r = reference_forward(q, k, v, scale, causal_visible);
  double sum = 0.0;
  for (std::size_t i = 0; i < w.data.size(); ++i) sum += w.data[i] * r.out.data[i];
  return sum;
}

// Central difference of the loss along one input element against the op's gradient.
void expect_matches_fd(array3& input, std::int64_t t, std::int64_t h, std::int64_t x, const head_view& grad,
                       const std::function<double()>& eval) {
  constexpr double step = 1e-5;
  const double saved = input(t, h, x);
  input(t, h, x) = saved + step;
  const double up = eval();
  input(t, h, x) = saved - step;
  const double down = eval();
  input(t, h, x) = saved;
  const double fd = (up - down) / (2 * step);
  EXPECT_NEAR(at(grad, t, h, x), fd, 1e-5 * std::max(1.0, std::abs(fd))) << "(" << t << ", " << h << ", " << x << ")";
}

TEST(sdpa_backward, matches_finite_differences_of_a_scalar_loss) {
  auto be = make_test_backend();
  const std::int64_t s = 12, hq = 4, hk = 2, d = 8;
  attention_problem p = make_problem(*be, s, s, hq, hk, d, 300);
  run_forward(*be, p, attn_mask::causal);
  backward_buffers b = make_backward_buffers(*be, p, 301);
  ops::sdpa_backward(*be, backward_args(p, b, p.k.view, p.v.view, b.d_k.view, b.d_v.view, attn_mask::causal));
  array3 q = to_array(p.q.view), k = to_array(p.k.view), v = to_array(p.v.view), w = to_array(b.d_out.view);
  const auto eval = [&] { return loss(q, k, v, w, p.scale); };
  for (auto [t, h, x] : {std::array<std::int64_t, 3>{0, 0, 0}, {5, 1, 3}, {11, 3, 7}, {7, 2, 1}})
    expect_matches_fd(q, t, h, x, b.d_q.view, eval);
  for (auto [t, h, x] : {std::array<std::int64_t, 3>{0, 0, 0}, {4, 1, 5}, {11, 1, 2}, {8, 0, 6}}) {
    expect_matches_fd(k, t, h, x, b.d_k.view, eval);
    expect_matches_fd(v, t, h, x, b.d_v.view, eval);
  }
}

// Ring attention's backward: each key block, given the final out and lse, yields its own
// d_k/d_v and a share of d_q; the shares add up to the unblocked gradients.
TEST(sdpa_backward, key_blocks_with_the_final_lse_sum_to_the_whole) {
  auto be = make_test_backend();
  const std::int64_t sq = 16, skv = 40, split = 24, hq = 4, hk = 2, d = 16;
  attention_problem p = make_problem(*be, sq, skv, hq, hk, d, 400);
  run_forward(*be, p, attn_mask::none);
  backward_buffers b = make_backward_buffers(*be, p, 401);
  array3 d_q_sum(sq, hq, d);
  for (auto [first, count] : {std::array<std::int64_t, 2>{0, split}, {split, skv - split}}) {
    ops::sdpa_backward(*be, backward_args(p, b, p.k.view.token_block(first, count), p.v.view.token_block(first, count),
                                          b.d_k.view.token_block(first, count),
                                          b.d_v.view.token_block(first, count), attn_mask::none));
    const array3 part = to_array(b.d_q.view);
    for (std::size_t i = 0; i < part.data.size(); ++i) d_q_sum.data[i] += part.data[i];
  }
  const reference_grads g = reference_backward(to_array(p.q.view), to_array(p.k.view), to_array(p.v.view),
                                               to_array(b.d_out.view), p.scale, all_visible);
  heads_buffer d_q_total = make_heads(*be, sq, hq, d, layout::dense, "d_q_total");
  for (std::int64_t t = 0; t < sq; ++t)
    for (std::int64_t h = 0; h < hq; ++h)
      for (std::int64_t x = 0; x < d; ++x) at(d_q_total.view, t, h, x) = static_cast<float>(d_q_sum(t, h, x));
  EXPECT_LT(rel_error(d_q_total.view, g.d_q), 1e-5);
  EXPECT_LT(rel_error(b.d_k.view, g.d_k), 1e-5);
  EXPECT_LT(rel_error(b.d_v.view, g.d_v), 1e-5);
}

// Accumulators as ring attention starts them: lse -inf, out garbage.
struct merge_accumulators {
  heads_buffer out, lse;
};

merge_accumulators make_accumulators(backend& be, std::int64_t sq, std::int64_t hq, std::int64_t d) {
  merge_accumulators acc{make_heads(be, sq, hq, d, layout::dense, "out_acc"),
                         make_heads(be, sq, hq, 1, layout::dense, "lse_acc")};
  fill_value(acc.out.view, nan_f);
  fill_value(acc.lse.view, neg_inf_f);
  return acc;
}

// One block: attention of all queries on keys [first, first + count), merged into acc.
void merge_block(backend& be, const attention_problem& p, const merge_accumulators& acc, std::int64_t first,
                 std::int64_t count, attn_mask mask) {
  const head_view& q = p.q.view;
  heads_buffer out = make_heads(be, q.tokens, q.heads, q.dim, layout::head_block, "out_part");
  heads_buffer lse = make_heads(be, q.tokens, q.heads, 1, layout::dense, "lse_part");
  ops::sdpa_forward(be, sdpa_forward_args{q, p.k.view.token_block(first, count), p.v.view.token_block(first, count),
                                          out.view, lse.view, mask, p.scale});
  ops::lse_merge(be, lse_merge_args{acc.out.view, acc.lse.view, out.view, lse.view});
}

TEST(lse_merge, two_disjoint_key_blocks_equal_attention_on_all_keys) {
  auto be = make_test_backend();
  const std::int64_t sq = 20, skv = 50, split = 30, hq = 4, hk = 2, d = 16;
  attention_problem p = make_problem(*be, sq, skv, hq, hk, d, 500);
  run_forward(*be, p, attn_mask::none);
  merge_accumulators acc = make_accumulators(*be, sq, hq, d);
  merge_block(*be, p, acc, split, skv - split, attn_mask::none);  // order must not matter
  merge_block(*be, p, acc, 0, split, attn_mask::none);
  EXPECT_LT(rel_error(acc.out.view, to_array(p.out.view)), 1e-5);
  EXPECT_LT(rel_error(acc.lse.view, to_array(p.lse.view)), 1e-5);
}

// The zigzag ring's shape: a past block (mask none) then the diagonal block (causal).
TEST(lse_merge, past_block_then_causal_diagonal_equals_shifted_causal_reference) {
  auto be = make_test_backend();
  const std::int64_t past = 21, sq = 15, hq = 4, hk = 1, d = 16;
  attention_problem p = make_problem(*be, sq, past + sq, hq, hk, d, 600);
  merge_accumulators acc = make_accumulators(*be, sq, hq, d);
  merge_block(*be, p, acc, 0, past, attn_mask::none);
  merge_block(*be, p, acc, past, sq, attn_mask::causal);
  const reference r = reference_forward(to_array(p.q.view), to_array(p.k.view), to_array(p.v.view), p.scale,
                                        [&](std::int64_t i, std::int64_t j) { return j <= i + past; });
  EXPECT_LT(rel_error(acc.out.view, r.out), 1e-5);
  EXPECT_LT(rel_error(acc.lse.view, r.lse), 1e-5);
}

TEST(lse_merge, empty_parts_change_nothing) {
  auto be = make_test_backend();
  const std::int64_t sq = 3, hq = 2, d = 4;
  merge_accumulators acc = make_accumulators(*be, sq, hq, d);
  fill_value(acc.out.view, 7.0f);
  heads_buffer out_part = make_heads(*be, sq, hq, d, layout::dense, "out_part");
  heads_buffer lse_part = make_heads(*be, sq, hq, 1, layout::dense, "lse_part");
  fill_value(out_part.view, nan_f);
  fill_value(lse_part.view, neg_inf_f);
  // Both -inf: lse stays -inf and out is left alone.
  ops::lse_merge(*be, lse_merge_args{acc.out.view, acc.lse.view, out_part.view, lse_part.view});
  EXPECT_EQ(at(acc.lse.view, 1, 1, 0), neg_inf_f);
  EXPECT_EQ(at(acc.out.view, 2, 1, 3), 7.0f);
  // A finite accumulator and an empty part: nothing moves, NaN in the part included.
  fill_value(acc.lse.view, 0.25f);
  ops::lse_merge(*be, lse_merge_args{acc.out.view, acc.lse.view, out_part.view, lse_part.view});
  EXPECT_EQ(at(acc.lse.view, 0, 1, 0), 0.25f);
  EXPECT_EQ(at(acc.out.view, 1, 0, 2), 7.0f);
  // An equal-weight merge of two parts is their mean, with lse + log 2.
  fill_value(out_part.view, 3.0f);
  fill_value(lse_part.view, 0.25f);
  ops::lse_merge(*be, lse_merge_args{acc.out.view, acc.lse.view, out_part.view, lse_part.view});
  EXPECT_NEAR(at(acc.out.view, 2, 0, 1), 5.0f, 1e-6);
  EXPECT_NEAR(at(acc.lse.view, 2, 0, 0), 0.25 + std::log(2.0), 1e-6);
}

}  // namespace
}  // namespace upipe

namespace upipe {
namespace {

// Which blocks share a document decides what ring skips: a past block shares one only if
// some query's document started at or before the block's last key.
TEST(document_mask, blocks_share_a_document_only_where_a_pair_does) {
  const std::vector<std::int64_t> starts = {0, 10, 12, 30};
  const auto mask = [&](std::int64_t q_first, std::int64_t k_first) { return document_mask{starts, q_first, k_first}; };
  EXPECT_EQ(mask(0, 0).start_of(11), 10);
  EXPECT_EQ(mask(0, 0).start_of(35), 30);
  EXPECT_TRUE(mask(16, 8).shares_document(8, 8));    // queries 16-23 in the document from 12: keys 12-15
  EXPECT_FALSE(mask(32, 16).shares_document(8, 8));  // queries 32-39 begin at 30: keys 16-23 are earlier
  EXPECT_TRUE(mask(24, 16).shares_document(8, 8));   // queries 24-29 still in the document from 12
  EXPECT_FALSE(mask(12, 0).shares_document(4, 8));   // document 12's queries, keys 0-7 of document 0
  EXPECT_TRUE(mask(8, 8).shares_document(8, 8));     // the causal diagonal always does
  const document_mask one_document{{}, 40, 0};
  EXPECT_TRUE(one_document.shares_document(8, 8));  // one document: every past block
}

// With a window, a block is skipped exactly when no (query, key) pair of it lies within the
// window and a document: shares_document and first_key against every pair, brute force.
TEST(document_mask, a_window_reaches_exactly_the_pairs_it_allows) {
  const std::vector<std::int64_t> starts = {0, 10, 12, 30};
  for (const bool documents : {false, true})
    for (const std::int64_t window : {1, 3, 8, 20, 100})
      for (std::int64_t q_first = 0; q_first < 40; q_first += 4)
        for (std::int64_t k_first = 0; k_first <= q_first; k_first += 4) {
          const document_mask m{documents ? std::span<const std::int64_t>(starts) : std::span<const std::int64_t>(),
                                q_first, k_first};
          const std::int64_t sq = 8, skv = 8;
          bool any = false;
          for (std::int64_t i = 0; i < sq; ++i) {
            const std::int64_t gq = q_first + i;
            std::int64_t first = skv;
            for (std::int64_t j = skv - 1; j >= 0; --j) {
              const std::int64_t gk = k_first + j;
              if (gk <= gq && gk > gq - window && gk >= m.start_of(gq)) first = j;
            }
            const std::int64_t last = std::min(skv, gq - k_first + 1);  // keys not after the query
            if (first < last) {
              any = true;
              EXPECT_EQ(m.first_key(i, window), first) << "q " << gq << " W " << window;
            }
          }
          EXPECT_EQ(m.shares_document(sq, skv, window), any)
              << "q " << q_first << " k " << k_first << " W " << window << " documents " << documents;
        }
}

}  // namespace
}  // namespace upipe
