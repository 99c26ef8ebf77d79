// The op entries: every shape, dtype and stride rule of the ops lives here, so that the
// backends' implementations can trust their arguments.
#include "backend/ops.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <utility>
#include <vector>

#include "backend/op_checks.hpp"
#include "core/error.hpp"
#include "ops/rope_frequencies.hpp"

namespace upipe::ops {

// The checks every entry shares (backend/op_checks.hpp declares those other entry files use).
namespace checks {

// Built by appending, which also keeps GCC 12's -Wrestrict false positive away.
std::string describe(const mat_view& m) {
  std::string s = "(";
  s += std::to_string(m.rows);
  s += " x ";
  s += std::to_string(m.cols);
  s += ", ld ";
  s += std::to_string(m.ld);
  s += ", ";
  s += dtype_name(m.type);
  s += ")";
  return s;
}

std::string describe(const head_view& v) {
  std::string s = "(tokens ";
  s += std::to_string(v.tokens);
  s += ", heads ";
  s += std::to_string(v.heads);
  s += ", dim ";
  s += std::to_string(v.dim);
  s += ", strides ";
  s += std::to_string(v.token_stride);
  s += "/";
  s += std::to_string(v.head_stride);
  s += ", ";
  s += dtype_name(v.type);
  s += ")";
  return s;
}

void check_finite_scalar(const char* op, const char* name, float value, const char* example) {
  UPIPE_CHECK(std::isfinite(value), std::string("ops::") + op + ": " + name + " " + std::to_string(value) +
                                        " must be finite (e.g. " + example + ")");
}

void check_matrix(const char* op, const char* name, const mat_view& m) {
  UPIPE_CHECK(m.rows >= 0 && m.cols >= 0, fail(op, name, m, "sizes must be non-negative"));
  UPIPE_CHECK(m.ld >= m.cols, fail(op, name, m, "leading dimension must be >= cols"));
}

// Sizes non-negative and no two elements at one address (dim is contiguous; the token
// and head strides may nest either way, e.g. a head-major layout).
void check_layout(const char* op, const char* name, const head_view& v) {
  UPIPE_CHECK(v.tokens >= 0 && v.heads >= 0 && v.dim >= 0, fail(op, name, v, "sizes must be non-negative"));
  UPIPE_CHECK(v.token_stride >= 0 && v.head_stride >= 0, fail(op, name, v, "strides must be non-negative"));
  if (v.tokens == 0 || v.heads == 0 || v.dim == 0) return;
  // (stride, extent) of the extents > 1, by stride; on the stack: every op call checks this.
  std::pair<std::int64_t, std::int64_t> outer[2];
  std::size_t n = 0;
  if (v.tokens > 1) outer[n++] = {v.token_stride, v.tokens};
  if (v.heads > 1) outer[n++] = {v.head_stride, v.heads};
  if (n == 2 && outer[1] < outer[0]) std::swap(outer[0], outer[1]);
  std::int64_t span = v.dim;
  for (std::size_t i = 0; i < n; ++i) {
    const auto [stride, extent] = outer[i];
    UPIPE_CHECK(stride >= span, fail(op, name, v, "strides overlap: each stride must clear the block inside it"));
    span = stride * (extent - 1) + span;
  }
}

void check_type(const char* op, const char* name, const mat_view& m, dtype want, dtype alt) {
  UPIPE_CHECK(m.type == want || m.type == alt,
              fail(op, name, m, "dtype must be " + std::string(dtype_name(want)) +
                                    (want == alt ? "" : " or " + std::string(dtype_name(alt)))));
}

void check_type(const char* op, const char* name, const head_view& v, dtype want, dtype alt) {
  UPIPE_CHECK(v.type == want || v.type == alt,
              fail(op, name, v, "dtype must be " + std::string(dtype_name(want)) +
                                    (want == alt ? "" : " or " + std::string(dtype_name(alt)))));
}

void check_dims(const char* op, const char* name, const mat_view& m, std::int64_t rows, std::int64_t cols) {
  UPIPE_CHECK(m.rows == rows && m.cols == cols,
              fail(op, name, m, "expected " + std::to_string(rows) + " x " + std::to_string(cols)));
}

void check_dims(const char* op, const char* name, const head_view& v, std::int64_t tokens, std::int64_t heads,
                std::int64_t dim) {
  UPIPE_CHECK(v.tokens == tokens && v.heads == heads && v.dim == dim,
              fail(op, name, v,
                   "expected (tokens " + std::to_string(tokens) + ", heads " + std::to_string(heads) + ", dim " +
                       std::to_string(dim) + ")"));
}

// A view of the working type (bf16 on GPU storage) or of fp32 (accumulators, the CPU).
void check_work_or_f32(const backend& be, const char* op, const char* name, const head_view& v) {
  check_type(op, name, v, be.work_dtype(), dtype::f32);
}

// The layout ops convert between f32 and bf16; i32 ids and labels are never converted.
void check_arithmetic(const char* op, const char* name, const head_view& v) {
  check_type(op, name, v, dtype::f32, dtype::bf16);
}

// A column of token ids or labels: (rows x 1) i32.
void check_index_column(const char* op, const char* name, const mat_view& m, std::int64_t rows) {
  check_matrix(op, name, m);
  check_type(op, name, m, dtype::i32, dtype::i32);
  check_dims(op, name, m, rows, 1);
}

// The q/k/v triple shared by forward and backward: GQA shapes and the mask rule.
void check_attention_inputs(const backend& be, const char* op, const head_view& q, const head_view& k,
                            const head_view& v, attn_mask mask) {
  for (const auto& [name, view] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
    check_layout(op, name, *view);
    check_type(op, name, *view, be.work_dtype(), be.work_dtype());
  }
  check_dims(op, "v", v, k.tokens, k.heads, k.dim);
  UPIPE_CHECK(k.dim == q.dim, fail(op, "k", k, "head dim must equal q's (" + std::to_string(q.dim) + ")"));
  UPIPE_CHECK(k.heads > 0 && q.heads % k.heads == 0,
              fail(op, "k", k, "kv heads must divide the query heads (" + std::to_string(q.heads) + ")"));
  UPIPE_CHECK(mask != attn_mask::causal || q.tokens == k.tokens,
              fail(op, "k", k,
                   "a causal mask needs as many keys as queries (" + std::to_string(q.tokens) +
                       "); use attn_mask::none for a block strictly in the past"));
}

// An fp32 per-(token, head) scalar such as the log-sum-exp: (tokens, heads, 1).
void check_row_scalar(const char* op, const char* name, const head_view& s, const head_view& like) {
  check_layout(op, name, s);
  check_type(op, name, s, dtype::f32, dtype::f32);
  check_dims(op, name, s, like.tokens, like.heads, 1);
}

// Runs lie inside the view and never overlap, since an overlap would rotate a token twice;
// gaps are allowed and their tokens are left as they are (e.g. padding).
void check_position_runs(const rope_args& args) {
  std::vector<std::pair<std::int64_t, std::int64_t>> spans;  // [begin, end) in tokens
  for (const position_run& run : args.positions) {
    UPIPE_CHECK(run.token_begin >= 0 && run.count >= 0 && run.token_begin + run.count <= args.x.tokens,
                fail("rope", "x", args.x,
                     "position run [" + std::to_string(run.token_begin) + ", +" + std::to_string(run.count) +
                         ") leaves the view's tokens"));
    UPIPE_CHECK(run.position_begin >= 0, "ops::rope: position_begin " + std::to_string(run.position_begin) +
                                             " must be non-negative");
    if (run.count > 0) spans.emplace_back(run.token_begin, run.token_begin + run.count);
  }
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i)
    UPIPE_CHECK(spans[i].first >= spans[i - 1].second,
                "ops::rope: position runs overlap at token " + std::to_string(spans[i].first) +
                    "; each token must be covered at most once");
}

// A flat shard of the optimizer: (1 x n) of one of two dtypes.
void check_shard(const char* op, const char* name, const mat_view& m, std::int64_t n, dtype want = dtype::f32,
                 dtype alt = dtype::f32) {
  check_matrix(op, name, m);
  check_type(op, name, m, want, alt);
  check_dims(op, name, m, 1, n);
}

bool view_empty(const mat_view& m) { return m.data == nullptr && m.cols == 0; }

void check_empty(const char* op, const char* name, const mat_view& m, const char* why) {
  UPIPE_CHECK(view_empty(m), fail(op, name, m, std::string("must be empty: ") + why));
}

// The moments' side of an AdamW call: both moments of one format, the gradient, and for
// q8 whole blocks with their absmax.
void check_adamw_moments(const adamw_args& a, std::int64_t n) {
  const char* op = "adamw";
  check_shard(op, "exp_avg", a.exp_avg, n, a.exp_avg.type, a.exp_avg.type);
  UPIPE_CHECK(a.exp_avg.type != dtype::i32, fail(op, "exp_avg", a.exp_avg, "dtype must be f32, bf16 or u8 (q8)"));
  check_shard(op, "exp_avg_sq", a.exp_avg_sq, n, a.exp_avg.type, a.exp_avg.type);
  check_shard(op, "grad", a.grad, n, dtype::f32, dtype::bf16);
  if (a.exp_avg.type != dtype::u8) {
    check_empty(op, "exp_avg_absmax", a.exp_avg_absmax, "only q8 (u8) moments have block absmaxes");
    check_empty(op, "exp_avg_sq_absmax", a.exp_avg_sq_absmax, "only q8 (u8) moments have block absmaxes");
    return;
  }
  UPIPE_CHECK(n % q8_block == 0, fail(op, "exp_avg", a.exp_avg,
                                      "q8 moments go in whole blocks: n must be a multiple of " +
                                          std::to_string(q8_block) + " (pad the shard)"));
  check_shard(op, "exp_avg_absmax", a.exp_avg_absmax, n / q8_block);
  check_shard(op, "exp_avg_sq_absmax", a.exp_avg_sq_absmax, n / q8_block);
}

// The master's side: f32, or bf16 with its bf16 compensation (Kahan), and the working copy.
void check_adamw_master(const backend& be, const adamw_args& a, std::int64_t n) {
  const char* op = "adamw";
  check_shard(op, "master", a.master, n, dtype::f32, dtype::bf16);
  if (a.master.type == dtype::bf16)
    check_shard(op, "master_comp", a.master_comp, n, dtype::bf16, dtype::bf16);
  else
    check_empty(op, "master_comp", a.master_comp, "an f32 master has no compensation (bf16-kahan's)");
  if (view_empty(a.weights)) return;
  check_matrix(op, "weights", a.weights);
  check_type(op, "weights", a.weights, be.work_dtype(), be.work_dtype());
  check_dims(op, "weights", a.weights, 1, n);
}

// Runs cover [0, n) in increasing order, at most adamw_max_runs of them.
void check_adamw_runs(const adamw_args& a, std::int64_t n) {
  if (a.runs.empty()) return;
  UPIPE_CHECK(a.runs.size() <= adamw_max_runs, "ops::adamw: " + std::to_string(a.runs.size()) +
                                                   " weight-decay runs; a call takes at most " +
                                                   std::to_string(adamw_max_runs) + " (split it at a block)");
  std::int64_t begin = 0;
  for (const adamw_run& r : a.runs) {
    UPIPE_CHECK(r.end > begin, "ops::adamw: the weight-decay runs must increase (a run ends at " +
                                   std::to_string(r.end) + " after " + std::to_string(begin) + ")");
    begin = r.end;
  }
  UPIPE_CHECK(begin == n, "ops::adamw: the weight-decay runs end at " + std::to_string(begin) +
                              ", not at the call's " + std::to_string(n) + " elements");
}

void check_adamw_scalars(const adamw_args& args) {
  UPIPE_CHECK(args.step >= 1, "ops::adamw: step " + std::to_string(args.step) +
                                  " must be >= 1 (steps count from 1 for the bias corrections)");
  UPIPE_CHECK(args.lr >= 0.0f && std::isfinite(args.lr),
              "ops::adamw: lr " + std::to_string(args.lr) + " must be finite and >= 0 (e.g. 3e-4)");
  for (const auto& [name, beta] : {std::pair{"beta1", args.beta1}, std::pair{"beta2", args.beta2}})
    UPIPE_CHECK(beta >= 0.0f && beta < 1.0f,
                std::string("ops::adamw: ") + name + " " + std::to_string(beta) + " must be in [0, 1) (e.g. 0.9)");
  UPIPE_CHECK(args.eps > 0.0f && std::isfinite(args.eps),
              "ops::adamw: eps " + std::to_string(args.eps) + " must be finite and > 0 (e.g. 1e-8)");
  UPIPE_CHECK(args.weight_decay >= 0.0f && std::isfinite(args.weight_decay),
              "ops::adamw: weight_decay " + std::to_string(args.weight_decay) + " must be finite and >= 0 (e.g. 0.1)");
  UPIPE_CHECK(std::isfinite(args.grad_scale), "ops::adamw: grad_scale " + std::to_string(args.grad_scale) +
                                                  " must be finite (e.g. the clipping coefficient)");
}

}  // namespace checks

using namespace checks;

void gemm(backend& be, const gemm_args& args) {
  const char* op = "gemm";
  check_matrix(op, "a", args.a);
  check_matrix(op, "b", args.b);
  check_matrix(op, "c", args.c);
  check_type(op, "a", args.a, be.work_dtype(), dtype::f32);
  check_type(op, "b", args.b, be.work_dtype(), dtype::f32);
  check_type(op, "c", args.c, be.work_dtype(), dtype::f32);
  const bool ta = args.trans_a == transpose::yes, tb = args.trans_b == transpose::yes;
  const std::int64_t m = ta ? args.a.cols : args.a.rows, k = ta ? args.a.rows : args.a.cols;
  const std::int64_t kb = tb ? args.b.cols : args.b.rows, n = tb ? args.b.rows : args.b.cols;
  UPIPE_CHECK(kb == k, fail(op, "b", args.b,
                            "op(b) must have " + std::to_string(k) + " rows to match op(a)'s columns" +
                                (tb ? " (b is transposed)" : "")));
  check_dims(op, "c", args.c, m, n);
  be.count_gemm(2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k), ta);
  be.run(args);
}

static void check_documents(const char* op, const document_mask& m, std::int64_t window) {
  UPIPE_CHECK(window >= 0, std::string("ops::") + op + ": sliding window " + std::to_string(window) +
                               " is negative; give 0 for global attention or the number of keys a query sees");
  if (m.starts.empty()) return;
  UPIPE_CHECK(m.starts[0] == 0, std::string("ops::") + op + ": the first document starts at 0, not " +
                                    std::to_string(m.starts[0]));
  for (std::size_t i = 1; i < m.starts.size(); ++i)
    UPIPE_CHECK(m.starts[i] > m.starts[i - 1], std::string("ops::") + op + ": document starts must increase (" +
                                                   std::to_string(m.starts[i - 1]) + " then " +
                                                   std::to_string(m.starts[i]) + ")");
  UPIPE_CHECK(m.q_first >= 0 && m.k_first >= 0, std::string("ops::") + op + ": negative first row index");
}

void sdpa_forward(backend& be, const sdpa_forward_args& args) {
  const char* op = "sdpa_forward";
  check_attention_inputs(be, op, args.q, args.k, args.v, args.mask);
  check_documents(op, args.documents, args.window);
  check_layout(op, "out", args.out);
  check_type(op, "out", args.out, be.work_dtype(), be.work_dtype());
  check_dims(op, "out", args.out, args.q.tokens, args.q.heads, args.q.dim);
  check_row_scalar(op, "lse", args.lse, args.q);
  be.run(args);
}

void sdpa_backward(backend& be, const sdpa_backward_args& args) {
  const char* op = "sdpa_backward";
  const head_view& q = args.q;
  const head_view& k = args.k;
  check_attention_inputs(be, op, q, k, args.v, args.mask);
  check_documents(op, args.documents, args.window);
  for (const auto& [name, view] : {std::pair{"out", &args.out}, std::pair{"d_out", &args.d_out},
                                   std::pair{"d_q", &args.d_q}}) {
    check_layout(op, name, *view);
    check_dims(op, name, *view, q.tokens, q.heads, q.dim);
  }
  for (const auto& [name, view] : {std::pair{"d_k", &args.d_k}, std::pair{"d_v", &args.d_v}}) {
    check_layout(op, name, *view);
    check_dims(op, name, *view, k.tokens, k.heads, k.dim);
  }
  for (const auto& [name, view] : {std::pair{"out", &args.out}, std::pair{"d_out", &args.d_out},
                                   std::pair{"d_q", &args.d_q}, std::pair{"d_k", &args.d_k},
                                   std::pair{"d_v", &args.d_v}})
    check_type(op, name, *view, be.work_dtype(), be.work_dtype());
  check_row_scalar(op, "lse", args.lse, q);
  be.run(args);
}

void rope(backend& be, const rope_args& args) {
  check_layout("rope", "x", args.x);
  check_work_or_f32(be, "rope", "x", args.x);
  UPIPE_CHECK(args.x.dim % 2 == 0, fail("rope", "x", args.x, "head dim must be even (rotate-half pairs i, i + d/2)"));
  check_rope_config(args.config);
  check_position_runs(args);
  const int rotary = args.config.rotary_dim;
  if (rotary == 0 || rotary == args.x.dim) return be.run(args);
  UPIPE_CHECK(rotary > 0 && rotary < args.x.dim && rotary % 2 == 0,
              fail("rope", "x", args.x, "rotary_dim " + std::to_string(rotary) +
                                            " must be even and at most the head dim (partial RoPE)"));
  // Partial RoPE: the kernels rotate the narrowed heads, whose frequencies are a head of rotary_dim's.
  rope_args narrowed = args;
  narrowed.x.dim = rotary;
  be.run(narrowed);
}

void rmsnorm_forward(backend& be, const rmsnorm_forward_args& args) {
  const char* op = "rmsnorm_forward";
  const std::int64_t rows = args.x.rows, cols = args.x.cols;
  for (const auto& [name, view] :
       {std::pair{"x", &args.x}, std::pair{"weight", &args.weight}, std::pair{"y", &args.y}}) {
    check_matrix(op, name, *view);
    check_type(op, name, *view, be.work_dtype(), dtype::f32);
  }
  check_matrix(op, "rstd", args.rstd);
  check_type(op, "rstd", args.rstd, dtype::f32, dtype::f32);
  check_dims(op, "weight", args.weight, 1, cols);
  check_dims(op, "y", args.y, rows, cols);
  check_dims(op, "rstd", args.rstd, rows, 1);
  UPIPE_CHECK(args.eps >= 0.0f, "ops::rmsnorm_forward: eps " + std::to_string(args.eps) + " must be >= 0 (e.g. 1e-5)");
  check_finite_scalar(op, "weight_offset", args.weight_offset, "0 (Llama) or 1 (Gemma)");
  be.run(args);
}

void rmsnorm_backward(backend& be, const rmsnorm_backward_args& args) {
  const char* op = "rmsnorm_backward";
  const std::int64_t rows = args.x.rows, cols = args.x.cols;
  for (const auto& [name, view] : {std::pair{"x", &args.x}, std::pair{"weight", &args.weight},
                                   std::pair{"d_y", &args.d_y}, std::pair{"d_x", &args.d_x}}) {
    check_matrix(op, name, *view);
    check_type(op, name, *view, be.work_dtype(), dtype::f32);
  }
  const bool d_weight = args.d_weight.rows > 0;  // else not wanted
  for (const auto& [name, view] : {std::pair{"rstd", &args.rstd}, std::pair{"d_weight", &args.d_weight}}) {
    if (view == &args.d_weight && !d_weight) continue;
    check_matrix(op, name, *view);
    check_type(op, name, *view, dtype::f32, dtype::f32);
  }
  check_dims(op, "weight", args.weight, 1, cols);
  if (d_weight) check_dims(op, "d_weight", args.d_weight, 1, cols);
  check_dims(op, "d_y", args.d_y, rows, cols);
  check_dims(op, "d_x", args.d_x, rows, cols);
  check_dims(op, "rstd", args.rstd, rows, 1);
  check_finite_scalar(op, "weight_offset", args.weight_offset, "0 (Llama) or 1 (Gemma)");
  be.run(args);
}

void copy_heads(backend& be, const head_view& dst, const head_view& src) {
  check_layout("copy_heads", "dst", dst);
  check_layout("copy_heads", "src", src);
  check_arithmetic("copy_heads", "dst", dst);
  check_arithmetic("copy_heads", "src", src);
  check_dims("copy_heads", "dst", dst, src.tokens, src.heads, src.dim);
  be.run(copy_heads_args{dst, src});
}

void add_heads(backend& be, const head_view& dst, const head_view& src) {
  check_layout("add_heads", "dst", dst);
  check_layout("add_heads", "src", src);
  // f32 for cross-stage accumulators; the working dtype for residual adds; bf16 for a
  // kept bf16 gradient shard taking a later micro-batch, on any backend.
  check_arithmetic("add_heads", "dst", dst);
  check_arithmetic("add_heads", "src", src);
  check_dims("add_heads", "dst", dst, src.tokens, src.heads, src.dim);
  be.run(add_heads_args{dst, src});
}

void fill_heads(backend& be, const head_view& dst, float value) {
  check_layout("fill_heads", "dst", dst);
  check_arithmetic("fill_heads", "dst", dst);
  be.run(fill_heads_args{dst, value});
}

void lse_merge(backend& be, const lse_merge_args& args) {
  const char* op = "lse_merge";
  check_layout(op, "out", args.out);
  check_layout(op, "out_part", args.out_part);
  check_type(op, "out", args.out, dtype::f32, dtype::f32);
  check_work_or_f32(be, op, "out_part", args.out_part);
  check_dims(op, "out_part", args.out_part, args.out.tokens, args.out.heads, args.out.dim);
  check_row_scalar(op, "lse", args.lse, args.out);
  check_row_scalar(op, "lse_part", args.lse_part, args.out);
  be.run(args);
}

// Ids outside [0, V) can only be seen where the data lives: the implementations check them.
void embedding_forward(backend& be, const embedding_forward_args& args) {
  const char* op = "embedding_forward";
  check_matrix(op, "table", args.table);
  check_matrix(op, "out", args.out);
  check_type(op, "table", args.table, be.work_dtype(), be.work_dtype());
  check_type(op, "out", args.out, be.work_dtype(), be.work_dtype());
  check_index_column(op, "ids", args.ids, args.out.rows);
  UPIPE_CHECK(args.out.cols == args.table.cols,
              fail(op, "out", args.out, "cols must equal the table's (" + std::to_string(args.table.cols) + ")"));
  check_finite_scalar(op, "scale", args.scale, "1, or sqrt(D) for Gemma");
  be.run(args);
}

void embedding_backward(backend& be, const embedding_backward_args& args) {
  const char* op = "embedding_backward";
  check_matrix(op, "d_out", args.d_out);
  check_matrix(op, "d_table", args.d_table);
  check_type(op, "d_out", args.d_out, be.work_dtype(), dtype::f32);
  check_type(op, "d_table", args.d_table, dtype::f32, dtype::f32);
  check_index_column(op, "ids", args.ids, args.d_out.rows);
  UPIPE_CHECK(args.d_table.cols == args.d_out.cols,
              fail(op, "d_table", args.d_table, "cols must equal d_out's (" + std::to_string(args.d_out.cols) + ")"));
  check_finite_scalar(op, "scale", args.scale, "1, or sqrt(D) for Gemma");
  UPIPE_CHECK(args.padding_id >= -1 && args.padding_id < args.d_table.rows,
              "ops::embedding_backward: padding_id " + std::to_string(args.padding_id) +
                  " must be a row of the table [0, " + std::to_string(args.d_table.rows) + ") or -1 for none");
  be.run(args);
}

void swiglu_forward(backend& be, const swiglu_forward_args& args) {
  const char* op = "swiglu_forward";
  for (const auto& [name, view] :
       {std::pair{"gate", &args.gate}, std::pair{"up", &args.up}, std::pair{"out", &args.out}}) {
    check_matrix(op, name, *view);
    check_type(op, name, *view, be.work_dtype(), be.work_dtype());
    check_dims(op, name, *view, args.gate.rows, args.gate.cols);
  }
  be.run(args);
}

// d_gate and d_up may alias gate and up (in place); the implementations read an
// element's inputs before writing its outputs.
void swiglu_backward(backend& be, const swiglu_backward_args& args) {
  const char* op = "swiglu_backward";
  for (const auto& [name, view] : {std::pair{"gate", &args.gate}, std::pair{"up", &args.up},
                                   std::pair{"d_out", &args.d_out}, std::pair{"d_gate", &args.d_gate},
                                   std::pair{"d_up", &args.d_up}}) {
    check_matrix(op, name, *view);
    check_dims(op, name, *view, args.gate.rows, args.gate.cols);
  }
  for (const auto& [name, view] : {std::pair{"gate", &args.gate}, std::pair{"up", &args.up},
                                   std::pair{"d_gate", &args.d_gate}, std::pair{"d_up", &args.d_up}})
    check_type(op, name, *view, be.work_dtype(), be.work_dtype());
  check_type(op, "d_out", args.d_out, be.work_dtype(), dtype::f32);
  be.run(args);
}

void bias_add(backend& be, const bias_add_args& args) {
  const char* op = "bias_add";
  check_matrix(op, "y", args.y);
  check_matrix(op, "bias", args.bias);
  check_type(op, "y", args.y, be.work_dtype(), dtype::f32);
  check_type(op, "bias", args.bias, be.work_dtype(), be.work_dtype());
  check_dims(op, "bias", args.bias, 1, args.y.cols);
  be.run(args);
}

void bias_grad(backend& be, const bias_grad_args& args) {
  const char* op = "bias_grad";
  check_matrix(op, "d_y", args.d_y);
  check_matrix(op, "d_bias", args.d_bias);
  check_type(op, "d_y", args.d_y, be.work_dtype(), dtype::f32);
  check_type(op, "d_bias", args.d_bias, dtype::f32, dtype::f32);
  check_dims(op, "d_bias", args.d_bias, 1, args.d_y.cols);
  be.run(args);
}

// Labels >= V can only be seen where the data lives: the implementations check them.
void cross_entropy(backend& be, const cross_entropy_args& args) {
  const char* op = "cross_entropy";
  const std::int64_t rows = args.logits.rows;
  check_matrix(op, "logits", args.logits);
  check_matrix(op, "row_loss", args.row_loss);
  check_type(op, "logits", args.logits, dtype::f32, dtype::f32);
  check_type(op, "row_loss", args.row_loss, dtype::f32, dtype::f32);
  check_index_column(op, "labels", args.labels, rows);
  check_dims(op, "row_loss", args.row_loss, rows, 1);
  UPIPE_CHECK(std::isfinite(args.grad_scale), "ops::cross_entropy: grad_scale " + std::to_string(args.grad_scale) +
                                                  " must be finite (e.g. 1 / the number of unmasked tokens)");
  be.run(args);
}

// master, the moments and the gradient are (1 x n) f32; weights is the working-dtype
// copy written from the updated master, or empty (data nullptr, 0 cols) to skip it.
void adamw(backend& be, const adamw_args& args) {
  const char* op = "adamw";
  const bool master_half = args.part == adamw_part::master;
  const std::int64_t n = args.part == adamw_part::moments ? args.grad.cols : args.master.cols;
  if (args.part != adamw_part::master) check_adamw_moments(args, n);
  if (args.part != adamw_part::moments) check_adamw_master(be, args, n);
  if (args.part == adamw_part::whole) {
    check_empty(op, "direction", args.direction, "the whole update keeps its step inside");
  } else {
    check_shard(op, "direction", args.direction, n);
  }
  if (args.part == adamw_part::moments) {
    check_empty(op, "master", args.master, "the moments half writes the step to direction");
    check_empty(op, "weights", args.weights, "the moments half writes the step to direction");
  }
  if (master_half) {
    check_empty(op, "exp_avg", args.exp_avg, "the master half reads its step from direction");
    check_empty(op, "grad", args.grad, "the master half reads its step from direction");
  }
  check_adamw_runs(args, n);
  check_adamw_scalars(args);
  be.run(args);
}

double sum_squares(backend& be, const mat_view& x) {
  check_matrix("sum_squares", "x", x);
  check_type("sum_squares", "x", x, dtype::f32, dtype::bf16);
  double result = 0.0;  // meta leaves it
  be.run(sum_squares_args{x, &result});
  return result;
}

}  // namespace upipe::ops

// ---------------------------------------------------------------------------------------
// Mixture of experts

namespace upipe::ops {

namespace {

// An (n, k) i32 matrix of expert ids or rows, and an optional (n, 1) u8 row mask.
void check_slots(const char* op, const char* name, const mat_view& m, std::int64_t n, std::int64_t k) {
  check_matrix(op, name, m);
  check_type(op, name, m, dtype::i32, dtype::i32);
  check_dims(op, name, m, n, k);
}
void check_row_mask(const char* op, const mat_view& counted, std::int64_t n) {
  if (counted.rows == 0) return;
  check_matrix(op, "counted", counted);
  check_type(op, "counted", counted, dtype::u8, dtype::u8);
  check_dims(op, "counted", counted, n, 1);
}
void check_f32(const char* op, const char* name, const mat_view& m, std::int64_t rows, std::int64_t cols) {
  check_matrix(op, name, m);
  check_type(op, name, m, dtype::f32, dtype::f32);
  check_dims(op, name, m, rows, cols);
}
// The routing kernels keep a row's E probabilities in a warp's registers.
constexpr std::int64_t max_experts = 1024;

}  // namespace

void moe_route(backend& be, const moe_route_args& args) {
  const char* op = "moe_route";
  const std::int64_t n = args.logits.rows, E = args.logits.cols, k = args.weights.cols;
  check_f32(op, "logits", args.logits, n, E);
  check_f32(op, "probs", args.probs, n, E);
  check_f32(op, "weights", args.weights, n, k);
  check_slots(op, "experts", args.experts, n, k);
  UPIPE_CHECK(E >= 1 && E <= max_experts, "ops::moe_route: E = " + std::to_string(E) + " experts must lie in [1, " +
                                              std::to_string(max_experts) + "]");
  UPIPE_CHECK(k >= 1 && k <= E, "ops::moe_route: k = " + std::to_string(k) + " experts per token must lie in [1, E = " +
                                    std::to_string(E) + "]");
  be.run(args);
}

void moe_route_backward(backend& be, const moe_route_backward_args& args) {
  const char* op = "moe_route_backward";
  const std::int64_t n = args.probs.rows, E = args.probs.cols, k = args.experts.cols;
  check_f32(op, "probs", args.probs, n, E);
  check_f32(op, "d_weights", args.d_weights, n, k);
  check_f32(op, "d_logits", args.d_logits, n, E);
  check_slots(op, "experts", args.experts, n, k);
  if (args.aux_grad.rows > 0) check_f32(op, "aux_grad", args.aux_grad, 1, E);
  check_row_mask(op, args.counted, n);
  UPIPE_CHECK(E <= max_experts, "ops::moe_route_backward: E = " + std::to_string(E) + " experts exceeds " +
                                    std::to_string(max_experts));
  be.run(args);
}

void moe_dispatch(backend& be, const moe_dispatch_args& args) {
  const char* op = "moe_dispatch";
  const std::int64_t n = args.experts.rows, k = args.experts.cols, E = args.offsets.cols - 1;
  check_slots(op, "experts", args.experts, n, k);
  check_slots(op, "position", args.position, n, k);
  check_slots(op, "offsets", args.offsets, 1, E + 1);
  check_slots(op, "scratch", args.scratch, moe_dispatch_scratch_rows(n), E);
  UPIPE_CHECK(E >= 1 && E <= max_experts, "ops::moe_dispatch: E = " + std::to_string(E) + " experts must lie in [1, " +
                                              std::to_string(max_experts) + "]");
  UPIPE_CHECK(args.capacity >= 0, "ops::moe_dispatch: capacity " + std::to_string(args.capacity) +
                                      " must be 0 (dropless) or a row count");
  UPIPE_CHECK(n * k < (std::int64_t{1} << 31), "ops::moe_dispatch: " + std::to_string(n * k) +
                                                   " rows exceed the i32 positions; use a smaller --mlp-tile");
  be.run(args);
}

void moe_permute(backend& be, const moe_permute_args& args) {
  const char* op = "moe_permute";
  check_matrix(op, "src", args.src);
  check_matrix(op, "dst", args.dst);
  // The working dtype (a tile's rows), or f32 on both sides (a copy bit for bit: expert
  // parallelism's expert ids ride it as 4-byte words, model/moe_exchange.cpp).
  check_type(op, "src", args.src, be.work_dtype(), dtype::f32);
  check_type(op, "dst", args.dst, args.src.type, args.src.type);
  check_dims(op, "dst", args.dst, args.dst.rows, args.src.cols);
  check_slots(op, "position", args.position, args.src.rows, args.position.cols);
  be.run(args);
}

void moe_combine(backend& be, const moe_combine_args& args) {
  const char* op = "moe_combine";
  const std::int64_t n = args.dst.rows, D = args.dst.cols;
  check_matrix(op, "src", args.src);
  check_matrix(op, "dst", args.dst);
  check_type(op, "src", args.src, be.work_dtype(), dtype::f32);
  check_type(op, "dst", args.dst, be.work_dtype(), dtype::f32);
  check_dims(op, "src", args.src, args.src.rows, D);
  check_slots(op, "position", args.position, n, args.position.cols);
  if (args.weights.rows > 0) check_f32(op, "weights", args.weights, n, args.position.cols);
  if (args.shared.rows > 0) {
    check_matrix(op, "shared", args.shared);
    check_type(op, "shared", args.shared, be.work_dtype(), dtype::f32);
    check_dims(op, "shared", args.shared, n, D);
    check_f32(op, "shared_gate", args.shared_gate, n, 1);
  }
  be.run(args);
}

void moe_combine_backward(backend& be, const moe_combine_backward_args& args) {
  const char* op = "moe_combine_backward";
  const std::int64_t n = args.d_dst.rows, k = args.position.cols, m = args.src.rows, D = args.d_dst.cols;
  for (const auto& [name, view] : {std::pair{"d_dst", &args.d_dst}, std::pair{"src", &args.src},
                                   std::pair{"d_src", &args.d_src}}) {
    check_matrix(op, name, *view);
    check_type(op, name, *view, be.work_dtype(), dtype::f32);
  }
  check_dims(op, "src", args.src, m, D);
  check_dims(op, "d_src", args.d_src, m, D);
  check_slots(op, "position", args.position, n, k);
  check_f32(op, "weights", args.weights, n, k);
  check_f32(op, "d_weights", args.d_weights, n, k);
  be.run(args);
}

void moe_balance(backend& be, const moe_balance_args& args) {
  const char* op = "moe_balance";
  const std::int64_t n = args.probs.rows, E = args.probs.cols;
  check_f32(op, "probs", args.probs, n, E);
  check_slots(op, "experts", args.experts, n, args.experts.cols);
  check_row_mask(op, args.counted, n);
  check_slots(op, "sums", args.sums, 1, 4 * E);
  UPIPE_CHECK(E <= max_experts, "ops::moe_balance: E = " + std::to_string(E) + " experts exceeds " +
                                    std::to_string(max_experts));
  be.run(args);
}

void moe_grouped_gemm(backend& be, const moe_grouped_gemm_args& args) {
  const char* op = "moe_grouped_gemm";
  const auto groups = static_cast<std::int64_t>(args.weights.size());
  UPIPE_CHECK(groups >= 1, "ops::moe_grouped_gemm: at least one group");
  check_slots(op, "offsets", args.offsets, 1, groups + 1);
  check_matrix(op, "rows", args.rows);
  check_type(op, "rows", args.rows, be.work_dtype(), be.work_dtype());
  const mat_view& w0 = args.weights.front();
  const bool gradient = args.form == grouped_form::weight_gradient;
  for (const mat_view& w : args.weights) {
    check_matrix(op, "weights", w);
    UPIPE_CHECK(w.rows == w0.rows && w.cols == w0.cols && w.ld == w0.ld && w.type == w0.type,
                fail(op, "weights", w, "every group's matrix must have the first's shape, ld and dtype " + describe(w0)));
  }
  check_type(op, "weights", w0, gradient ? dtype::f32 : be.work_dtype(), gradient ? dtype::f32 : be.work_dtype());
  const std::int64_t m = args.rows.rows;
  if (gradient) {
    check_matrix(op, "other", args.other);
    check_type(op, "other", args.other, be.work_dtype(), be.work_dtype());
    check_dims(op, "other", args.other, m, w0.cols);
    check_dims(op, "weights", w0, args.rows.cols, w0.cols);
    UPIPE_CHECK(args.beta == 1.0f, "ops::moe_grouped_gemm: a weight gradient accumulates (beta 1), got beta " +
                                       std::to_string(args.beta));
  } else {
    const bool t = args.form == grouped_form::rows_by_weight_t;
    check_matrix(op, "out", args.out);
    check_type(op, "out", args.out, be.work_dtype(), dtype::f32);
    check_dims(op, "weights", w0, t ? w0.rows : args.rows.cols, t ? args.rows.cols : w0.cols);
    check_dims(op, "out", args.out, m, t ? w0.rows : w0.cols);
  }
  check_finite_scalar(op, "alpha", args.alpha, "1");
  check_finite_scalar(op, "beta", args.beta, "0");
  // Every row of the tile as a GEMM row: the work of a dropless dispatch, a bound with a capacity.
  const auto d = [](std::int64_t v) { return static_cast<double>(v); };
  be.count_gemm(gradient ? 2.0 * d(w0.rows) * d(w0.cols) * d(m) : 2.0 * d(m) * d(args.out.cols) * d(args.rows.cols),
                gradient);
  be.run(args);
}

void sigmoid_gate_backward(backend& be, const sigmoid_gate_backward_args& args) {
  const char* op = "sigmoid_gate_backward";
  const std::int64_t n = args.s.rows;
  for (const auto& [name, view] : {std::pair{"z", &args.z}, std::pair{"d_z", &args.d_z}}) {
    check_matrix(op, name, *view);
    check_type(op, name, *view, dtype::f32, dtype::f32);
    check_dims(op, name, *view, n, 1);
  }
  for (const auto& [name, view] : {std::pair{"s", &args.s}, std::pair{"d_y", &args.d_y}, std::pair{"d_s", &args.d_s}}) {
    check_matrix(op, name, *view);
    check_type(op, name, *view, be.work_dtype(), dtype::f32);
    check_dims(op, name, *view, n, args.s.cols);
  }
  be.run(args);
}

}  // namespace upipe::ops
