// The registered ops. Test shapes pad and offset their views (ld > cols, head blocks of
// wider buffers) so that both the vectorized and the scalar paths of a kernel run; perf
// shapes are one Llama3-8B layer's (hidden 4096, 32 query heads and 8 kv heads of 128,
// intermediate 14336).
#include "backend/op_registry.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "backend/op_cases.hpp"
#include "backend/ops.hpp"
#include "core/error.hpp"

namespace upipe {

const tensor& case_tensors::operator[](std::string_view name) const {
  std::size_t i = 0;
  while (i < specs_->size() && name != (*specs_)[i].name) ++i;
  UPIPE_CHECK(i < specs_->size(), "op case has no tensor named " + std::string(name));
  return list_[i];
}

double host_dot(backend& be, const tensor& a, const tensor& b) {
  UPIPE_CHECK(a.numel() == b.numel(), std::string("host_dot: ") + a.label() + " and " + b.label() + " differ in size");
  std::vector<float> x(static_cast<std::size_t>(a.numel())), y(x.size());
  be.download_f32(x.data(), a);
  be.download_f32(y.data(), b);
  double sum = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) sum += static_cast<double>(x[i]) * y[i];
  return sum;
}

namespace {

using namespace op_cases;

// ---------------------------------------------------------------------------------------
// GEMM: c = alpha op(a) op(b) + beta c

op_case gemm_case(std::int64_t m, std::int64_t n, std::int64_t k, transpose ta, transpose tb, float alpha,
                  float beta) {
  const bool at = ta == transpose::yes, bt = tb == transpose::yes;
  op_case c;
  c.size = dims_text({{"m", m}, {"n", n}, {"k", k}}) + (at ? " a^T" : "") + (bt ? " b^T" : "");
  c.tensors = {{.name = "a", .dims = at ? shape{k, m} : shape{m, k}},
               {.name = "b", .dims = bt ? shape{n, k} : shape{k, n}},
               out({.name = "c", .dims = {m, n}})};
  c.run = [=](backend& be, const case_tensors& t) {
    ops::gemm(be, {t["a"].matrix(), ta, t["b"].matrix(), tb, t["c"].matrix(), alpha, beta});
  };
  c.flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  c.float64 = [=](f64::host_case& h) { f64::gemm(h, m, n, k, at, bt, alpha, beta); };
  return c;
}

op_entry gemm_entry() {
  return {"gemm",
          [] {
            return std::vector<op_case>{gemm_case(37, 29, 45, transpose::none, transpose::none, 1.0f, 0.0f),
                                        gemm_case(37, 29, 45, transpose::yes, transpose::none, 1.0f, 0.0f),
                                        gemm_case(16, 48, 32, transpose::none, transpose::yes, 1.5f, 0.5f),
                                        gemm_case(33, 17, 64, transpose::yes, transpose::yes, 1.0f, 1.0f)};
          },
          [](std::int64_t tokens, dtype) {
            return gemm_case(tokens, hidden, hidden, transpose::none, transpose::yes, 1.0f, 0.0f);
          }};
}

// ---------------------------------------------------------------------------------------
// Attention

struct attention_shape {
  std::int64_t sq, skv, hq, hk, d;
  attn_mask mask;
  std::int64_t window = 0;            // the sliding window (0: none)
  std::int64_t q_first = 0, k_first = 0;  // the rows' global indices, which the window reads
  attention_dtype arithmetic = attention_dtype::bf16;
};

// FP8 attention against the cpu backend's FP8 definition (ops/fp8_attention.hpp): both sides
// quantize the same inputs with the same scales and round P and dS where the kernels do, but
// an output can still land one FP8 step away where the two sides' fp32 sums straddle a
// rounding boundary, so each head's relative RMS error is held (tests/gpu/sdpa_test.cpp says
// more). The log-sum-exp reads only the scores of the quantized Q and K, so it keeps its 1e-3.
constexpr double fp8_head_rms_tol = 2e-2;
const char* const fp8_reference_test = "tests/backend/attention_fp8_test.cpp";
bool is_fp8(const attention_shape& a) { return a.arithmetic == attention_dtype::fp8; }

std::vector<case_tensor> attention_tensors(const attention_shape& a, bool backward) {
  std::vector<case_tensor> t = {{.name = "q", .dims = {a.sq, a.hq, a.d}},
                                {.name = "k", .dims = {a.skv, a.hk, a.d}},
                                {.name = "v", .dims = {a.skv, a.hk, a.d}},
                                out({.name = "out", .dims = {a.sq, a.hq, a.d}, .per_head_rms = is_fp8(a)},
                                    is_fp8(a) ? fp8_head_rms_tol : bf16_tol),
                                out({.name = "lse", .type = case_dtype::f32, .dims = {a.sq, a.hq, 1}}, bf16_tol, 1e-3)};
  if (!backward) return t;
  const double grad_tol = is_fp8(a) ? fp8_head_rms_tol : bf16_tol;
  t[3].bf16_tolerance = t[4].bf16_tolerance = 0.0;  // forward state, compared by sdpa_forward
  t.push_back({.name = "d_out", .dims = {a.sq, a.hq, a.d}});
  t.push_back(out({.name = "d_q", .dims = {a.sq, a.hq, a.d}, .per_head_rms = is_fp8(a)}, grad_tol));
  t.push_back(out({.name = "d_k", .dims = {a.skv, a.hk, a.d}, .per_head_rms = is_fp8(a)}, grad_tol));
  t.push_back(out({.name = "d_v", .dims = {a.skv, a.hk, a.d}, .per_head_rms = is_fp8(a)}, grad_tol));
  return t;
}

std::string attention_text(const attention_shape& a) {
  std::string text = dims_text({{"sq", a.sq}, {"skv", a.skv}, {"hq", a.hq}, {"hk", a.hk}, {"d", a.d}}) +
                     (a.mask == attn_mask::causal ? " causal" : " unmasked");
  if (a.window > 0)
    text += " window " + std::to_string(a.window) + " (q at " + std::to_string(a.q_first) + ", k at " +
            std::to_string(a.k_first) + ")";
  if (is_fp8(a)) text += " fp8";
  return text;
}

void attention_forward(backend& be, const case_tensors& t, const attention_shape& a) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(a.d));
  ops::sdpa_forward(be, {t["q"].heads(), t["k"].heads(), t["v"].heads(), t["out"].heads(), t["lse"].heads(), a.mask,
                         scale, {{}, a.q_first, a.k_first}, a.window, a.arithmetic});
}

// 4 h d FLOPs per visible (query, key) pair: half the s^2 pairs under the causal mask,
// fewer under a window.
double attention_flops(const attention_shape& a) {
  double pairs = 0;
  const document_mask rows{{}, a.q_first, a.k_first};
  for (std::int64_t i = 0; i < a.sq; ++i) {
    const std::int64_t end = a.mask == attn_mask::causal ? std::min(i + 1, a.skv) : a.skv;
    pairs += static_cast<double>(std::max<std::int64_t>(0, end - std::min(end, rows.first_key(i, a.window))));
  }
  return 4.0 * pairs * static_cast<double>(a.hq) * static_cast<double>(a.d);
}

op_case sdpa_forward_case(const attention_shape& a) {
  op_case c;
  c.size = attention_text(a);
  c.tensors = attention_tensors(a, false);
  c.run = [a](backend& be, const case_tensors& t) { attention_forward(be, t, a); };
  c.flops = attention_flops(a);
  if (is_fp8(a)) {
    c.reference_test = fp8_reference_test;
    return c;
  }
  c.float64 = [a](f64::host_case& h) {
    f64::sdpa_forward(h, a.sq, a.skv, a.hq, a.hk, a.d, a.mask == attn_mask::causal,
                      1.0 / std::sqrt(static_cast<float>(a.d)), {a.q_first, a.k_first, a.window});
  };
  return c;
}

op_case sdpa_backward_case(const attention_shape& a) {
  op_case c;
  c.size = attention_text(a);
  c.tensors = attention_tensors(a, true);
  // FP8's backward starts from bf16 attention's forward state: the backends' O and lse then
  // agree to bf16's rounding, where FP8's forward would round O one E4M3 step apart here and
  // there and count that against the backward.
  c.prepare = [a](backend& be, const case_tensors& t) {
    attention_shape forward = a;
    forward.arithmetic = attention_dtype::bf16;
    attention_forward(be, t, forward);
  };
  c.run = [a](backend& be, const case_tensors& t) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(a.d));
    ops::sdpa_backward(be, {t["q"].heads(), t["k"].heads(), t["v"].heads(), t["out"].heads(), t["d_out"].heads(),
                            t["lse"].heads(), t["d_q"].heads(), t["d_k"].heads(), t["d_v"].heads(), a.mask, scale,
                            {{}, a.q_first, a.k_first}, a.window, a.arithmetic});
  };
  c.flops = 2.5 * attention_flops(a);
  if (is_fp8(a)) {  // quantizing is a step function: finite differences do not apply
    c.reference_test = fp8_reference_test;
    return c;
  }
  c.objective = [a](backend& be, const case_tensors& t) {
    attention_forward(be, t, a);
    return host_dot(be, t["out"], t["d_out"]);
  };
  c.gradients = {{"q", "d_q"}, {"k", "d_k"}, {"v", "d_v"}};
  return c;
}

// d 64 and 128 (what cuDNN runs), grouped heads, lengths that are not multiples of 64;
// sliding windows on a causal block and on two blocks in the past (a ring's or a chunk's),
// one whose every query reaches the first key rows and one whose window starts inside them.
const attention_shape attention_test_shapes[] = {{40, 40, 4, 2, 64, attn_mask::causal},
                                                 {24, 56, 4, 1, 128, attn_mask::none},
                                                 {40, 40, 4, 2, 64, attn_mask::causal, 9, 80, 80},
                                                 {24, 56, 4, 1, 128, attn_mask::none, 40, 30, 0},
                                                 {24, 56, 4, 2, 64, attn_mask::none, 30, 50, 0}};
// FP8 (ops/fp8_attention.hpp's head dims on Hopper): both passes at d 128, a causal block with
// grouped heads and an unmasked one of the past; the forward alone also at 64 and 256.
const attention_shape attention_fp8_shapes[] = {
    {40, 40, 4, 2, 128, attn_mask::causal, 0, 0, 0, attention_dtype::fp8},
    {24, 56, 4, 1, 128, attn_mask::none, 0, 0, 0, attention_dtype::fp8}};
const attention_shape attention_fp8_forward_shapes[] = {
    {40, 40, 4, 2, 64, attn_mask::causal, 0, 0, 0, attention_dtype::fp8},
    {24, 56, 4, 1, 128, attn_mask::none, 0, 0, 0, attention_dtype::fp8},
    {40, 40, 4, 2, 256, attn_mask::causal, 0, 0, 0, attention_dtype::fp8}};
attention_shape attention_perf_shape(std::int64_t tokens, attention_dtype arithmetic) {
  return {tokens, tokens, q_heads, kv_heads, head_dim, attn_mask::causal, 0, 0, 0, arithmetic};
}

// An attention op's entry: its cases at `shapes`, its perf case at Llama3-8B's.
template <std::size_t n>
op_entry attention_entry(const char* name, const attention_shape (&shapes)[n], op_case (*make)(const attention_shape&),
                         attention_dtype arithmetic) {
  return {name,
          [&shapes, make] {
            std::vector<op_case> cases;
            for (const attention_shape& a : shapes) cases.push_back(make(a));
            return cases;
          },
          [make, arithmetic](std::int64_t tokens, dtype) { return make(attention_perf_shape(tokens, arithmetic)); }};
}

// Merges a block's partial result into f32 accumulators; a constant -inf lse is a row that
// has seen no key yet.
op_case lse_merge_case(std::int64_t tokens, std::int64_t heads, std::int64_t dim, bool empty_rows,
                       case_dtype part_type) {
  op_case c;
  c.size = dims_text({{"tokens", tokens}, {"heads", heads}, {"dim", dim}}) + (empty_rows ? " from -inf" : "");
  const float neg_inf = -std::numeric_limits<float>::infinity();
  c.tensors = {out({.name = "out", .type = case_dtype::f32, .dims = {tokens, heads, dim}}),
               empty_rows ? out({.name = "lse", .type = case_dtype::f32, .dims = {tokens, heads, 1},
                                 .fill = case_fill::constant, .lo = neg_inf})
                          : out({.name = "lse", .type = case_dtype::f32, .dims = {tokens, heads, 1}, .lo = -2, .hi = 2}),
               {.name = "out_part", .type = part_type, .dims = {tokens, heads, dim}},
               {.name = "lse_part", .type = case_dtype::f32, .dims = {tokens, heads, 1}, .lo = -2, .hi = 2}};
  c.run = [](backend& be, const case_tensors& t) {
    ops::lse_merge(be, {t["out"].heads(), t["lse"].heads(), t["out_part"].heads(), t["lse_part"].heads()});
  };
  c.bytes = (3.0 * 4 + (part_type == case_dtype::f32 ? 4.0 : 2.0)) * static_cast<double>(tokens * heads * dim);
  c.float64 = [=](f64::host_case& h) { f64::lse_merge(h, tokens, heads, dim); };
  return c;
}

op_entry lse_merge_entry() {
  return {"lse_merge",
          [] {
            return std::vector<op_case>{lse_merge_case(33, 3, 64, false, case_dtype::work),
                                        lse_merge_case(17, 2, 40, true, case_dtype::f32)};
          },
          [](std::int64_t tokens, dtype) { return lse_merge_case(tokens, q_heads, head_dim, false, case_dtype::work); }};
}

// ---------------------------------------------------------------------------------------
// RoPE

// Head-major with a gap after each head, or token-major with padding after each token.
struct rope_shape {
  std::int64_t tokens, heads, dim;
  bool head_major;
  case_dtype type;
  rope_kind scaling;
  rope_direction direction;
};

// Runs with a gap and positions up to 8,000,000, more than one launch's worth.
std::vector<position_run> spread_runs(std::int64_t tokens) {
  std::vector<position_run> runs{{0, 0, 5}, {5, 100, 3}, {10, 8'000'000, 6}};
  std::int64_t token = 16, position = 7'999'990;
  while (token + 2 <= tokens - 4 && runs.size() < 12) {
    runs.push_back({token, position, 2});
    token += 2;
    position -= 777'777;
  }
  return runs;
}

// rotary > 0: partial RoPE (the hybrids'), the first `rotary` dimensions of each head.
op_case rope_case(const rope_shape& r, std::vector<position_run> runs, double bytes, int rotary = 0) {
  const std::int64_t head_stride = r.head_major ? r.tokens * r.dim + 8 : r.dim;
  const std::int64_t token_stride = r.head_major ? r.dim : r.heads * r.dim + 4;
  const std::int64_t size = r.head_major ? r.heads * head_stride : r.tokens * token_stride;
  rope_config config;
  config.scaling.kind = r.scaling;
  if (r.scaling == rope_kind::linear || r.scaling == rope_kind::yarn) config.scaling.factor = 4.0;
  config.rotary_dim = rotary;
  op_case c;
  c.size = dims_text({{"tokens", r.tokens}, {"heads", r.heads}, {"dim", r.dim}}) +
           (r.head_major ? " head-major" : " token-major") +
           (r.direction == rope_direction::inverse ? " inverse" : "") +
           (rotary > 0 ? " rotary " + std::to_string(rotary) : "");
  c.tensors = {out({.name = "x", .type = r.type, .dims = {size}})};
  c.run = [=](backend& be, const case_tensors& t) {
    const tensor& x = t["x"];
    ops::rope(be, {{x.data(), x.type(), r.tokens, r.heads, r.dim, token_stride, head_stride}, runs, config,
                   r.direction});
  };
  c.float64 = [=](f64::host_case& h) {
    f64::rope(h, r.heads, r.dim, token_stride, head_stride, runs, config, r.direction == rope_direction::inverse);
  };
  c.bytes = bytes;
  return c;
}

op_entry rope_entry() {
  return {"rope",
          [] {
            std::vector<op_case> cases;
            for (const rope_shape& r :
                 {rope_shape{40, 3, 64, true, case_dtype::f32, rope_kind::llama3, rope_direction::forward},
                  rope_shape{40, 2, 128, true, case_dtype::f32, rope_kind::yarn, rope_direction::inverse},
                  rope_shape{40, 2, 300, false, case_dtype::f32, rope_kind::linear, rope_direction::forward},
                  rope_shape{40, 4, 128, true, case_dtype::work, rope_kind::none, rope_direction::forward},
                  rope_shape{40, 3, 72, false, case_dtype::work, rope_kind::none, rope_direction::inverse}})
              cases.push_back(rope_case(r, spread_runs(r.tokens), 0.0));
            // Partial RoPE as the hybrids' (a quarter of head_dim 256), in both directions.
            for (rope_direction d : {rope_direction::forward, rope_direction::inverse})
              cases.push_back(rope_case({40, 3, 256, false, case_dtype::work, rope_kind::none, d}, spread_runs(40), 0.0, 64));
            return cases;
          },
          [](std::int64_t tokens, dtype work) {
            const rope_shape r{tokens, q_heads, head_dim, false, case_dtype::work, rope_kind::llama3,
                               rope_direction::forward};
            return rope_case(r, {{0, 0, tokens}}, 2.0 * tokens * q_heads * head_dim * dtype_size(work));
          }};
}

// ---------------------------------------------------------------------------------------
// RMSNorm

struct norm_shape {
  std::int64_t rows, cols, pad, first;  // view columns [first, first + cols) of cols + pad
  float weight_offset = 0.0f;           // 1: Gemma's 1 + weight
};

std::string norm_text(const norm_shape& n) {
  return dims_text({{"rows", n.rows}, {"cols", n.cols}, {"ld", n.cols + n.pad}}) +
         (n.weight_offset != 0.0f ? " offset 1" : "");
}

std::vector<case_tensor> norm_tensors(const norm_shape& n) {
  const std::int64_t width = n.cols + n.pad;
  return {{.name = "x", .dims = {n.rows, width}, .lo = -2, .hi = 2},
          {.name = "weight", .dims = {1, n.cols}, .lo = 0.5f, .hi = 1.5f},
          out({.name = "y", .dims = {n.rows, width}}),
          out({.name = "rstd", .type = case_dtype::f32, .dims = {n.rows, 2}})};
}

void norm_forward(backend& be, const case_tensors& t, const norm_shape& n) {
  ops::rmsnorm_forward(be, {cols_of(t["x"], n.cols, n.first), t["weight"].matrix(), cols_of(t["y"], n.cols, n.first),
                            cols_of(t["rstd"], 1), 1e-5f, n.weight_offset});
}

op_case rmsnorm_forward_case(const norm_shape& n, double bytes) {
  op_case c;
  c.size = norm_text(n);
  c.tensors = norm_tensors(n);
  c.run = [n](backend& be, const case_tensors& t) { norm_forward(be, t, n); };
  c.float64 = [n](f64::host_case& h) {
    f64::rmsnorm_forward(h, n.rows, n.cols, n.cols + n.pad, n.first, 1e-5f, n.weight_offset);
  };
  c.bytes = bytes;
  return c;
}

op_case rmsnorm_backward_case(const norm_shape& n, double bytes) {
  const std::int64_t width = n.cols + n.pad;
  op_case c;
  c.size = norm_text(n);
  c.tensors = norm_tensors(n);
  c.tensors[2].bf16_tolerance = c.tensors[3].bf16_tolerance = 0.0;  // forward state
  c.tensors.push_back({.name = "d_y", .dims = {n.rows, width}});
  c.tensors.push_back(out({.name = "d_x", .dims = {n.rows, width}}));
  // Accumulated onto its values: fp32 sums over rows in another order on another backend.
  c.tensors.push_back(out({.name = "d_weight", .type = case_dtype::f32, .dims = {1, n.cols}}, bf16_tol, 1e-4));
  c.prepare = [n](backend& be, const case_tensors& t) { norm_forward(be, t, n); };
  c.run = [n](backend& be, const case_tensors& t) {
    ops::rmsnorm_backward(be, {cols_of(t["x"], n.cols, n.first), t["weight"].matrix(), cols_of(t["rstd"], 1),
                               cols_of(t["d_y"], n.cols, n.first), cols_of(t["d_x"], n.cols, n.first),
                               t["d_weight"].matrix(), n.weight_offset});
  };
  c.objective = [n](backend& be, const case_tensors& t) {
    norm_forward(be, t, n);
    return host_dot(be, t["y"], t["d_y"]);
  };
  c.gradients = {{"x", "d_x"}, {"weight", "d_weight"}};
  c.bytes = bytes;
  return c;
}

// Warp rows and block rows; aligned rows, odd lds and tails; a row too long for a block's
// shared accumulator.
const norm_shape norm_test_shapes[] = {{37, 128, 0, 0},      {37, 96, 3, 1},  {9, 3000, 5, 2},
                                       {3, 70000, 0, 0},     {37, 64, 0, 0, 1.0f}, {9, 2048, 3, 1, 1.0f}};

op_entry rmsnorm_forward_entry() {
  return {"rmsnorm_forward",
          [] {
            std::vector<op_case> cases;
            for (const norm_shape& n : norm_test_shapes) cases.push_back(rmsnorm_forward_case(n, 0.0));
            return cases;
          },
          [](std::int64_t tokens, dtype work) {
            return rmsnorm_forward_case({tokens, hidden, 0, 0}, 2.0 * tokens * hidden * dtype_size(work));
          }};
}

op_entry rmsnorm_backward_entry() {
  return {"rmsnorm_backward",
          [] {
            std::vector<op_case> cases;
            for (const norm_shape& n : norm_test_shapes) cases.push_back(rmsnorm_backward_case(n, 0.0));
            return cases;
          },
          [](std::int64_t tokens, dtype work) {
            return rmsnorm_backward_case({tokens, hidden, 0, 0}, 3.0 * tokens * hidden * dtype_size(work));
          }};
}

// ---------------------------------------------------------------------------------------
// Head layouts: copy (pack, unpack, convert), add, fill on head blocks of wider buffers

struct heads_shape {
  std::int64_t tokens, heads, dim;
  case_dtype dst_type, src_type;
};

// Heads [1, 1 + heads) of a (tokens, heads + 2, dim) buffer, so both views are strided.
head_view inner_heads(const tensor& t, std::int64_t heads) { return t.heads().head_block(1, heads); }

// Heads [1, 1 + heads) of a head-major (heads + 2, tokens, dim) buffer: against a
// token-major destination, a transposing copy (the all-to-all's pack and unpack).
head_view inner_heads_by_head(const tensor& t, std::int64_t heads) {
  const std::int64_t tokens = t.dims()[1], dim = t.dims()[2];
  const head_view all{t.data(), t.type(), tokens, heads + 2, dim, dim, tokens * dim};
  return all.head_block(1, heads);
}

std::string heads_text(const heads_shape& h) {
  return dims_text({{"tokens", h.tokens}, {"heads", h.heads}, {"dim", h.dim}});
}

op_case heads_case(const heads_shape& h, bool with_src, const case_step& run, double bytes, f64::heads_op op,
                   float value = 0) {
  op_case c;
  c.size = heads_text(h);
  c.tensors = {out({.name = "dst", .type = h.dst_type, .dims = {h.tokens, h.heads + 2, h.dim}}, bf16_tol, 1e-6)};
  if (with_src) c.tensors.push_back({.name = "src", .type = h.src_type, .dims = {h.heads + 2, h.tokens, h.dim}});
  c.run = run;
  c.bytes = bytes;
  c.float64 = [=](f64::host_case& t) { f64::heads(t, op, h.tokens, h.heads, h.dim, value); };
  return c;
}

const heads_shape heads_test_shapes[] = {{24, 4, 40, case_dtype::work, case_dtype::f32},
                                         {17, 3, 64, case_dtype::f32, case_dtype::work},
                                         {9, 2, 37, case_dtype::f32, case_dtype::f32}};

template <class MakeCase>
op_entry heads_entry(const char* name, MakeCase make) {
  return {name,
          [make] {
            std::vector<op_case> cases;
            for (const heads_shape& h : heads_test_shapes) cases.push_back(make(h, 0.0));
            return cases;
          },
          [make](std::int64_t tokens, dtype work) {
            const heads_shape h{tokens, q_heads / 2, head_dim, case_dtype::work, case_dtype::work};
            return make(h, 2.0 * tokens * (q_heads / 2) * head_dim * dtype_size(work));
          }};
}

op_case copy_heads_case(const heads_shape& h, double bytes) {
  return heads_case(h, true, [h](backend& be, const case_tensors& t) {
    ops::copy_heads(be, inner_heads(t["dst"], h.heads), inner_heads_by_head(t["src"], h.heads));
  }, bytes, f64::heads_op::copy);
}

op_case add_heads_case(const heads_shape& h, double bytes) {
  return heads_case(h, true, [h](backend& be, const case_tensors& t) {
    ops::add_heads(be, inner_heads(t["dst"], h.heads), inner_heads_by_head(t["src"], h.heads));
  }, bytes * 1.5, f64::heads_op::add);
}

op_case fill_heads_case(const heads_shape& h, double bytes) {
  constexpr float value = 0.375f;
  return heads_case(h, false, [h](backend& be, const case_tensors& t) {
    ops::fill_heads(be, inner_heads(t["dst"], h.heads), value);
  }, bytes / 2, f64::heads_op::fill, value);
}

// ---------------------------------------------------------------------------------------
// SwiGLU

struct swiglu_shape {
  std::int64_t rows, cols, pad, first;
  case_dtype d_out_type;
  gate_activation activation = gate_activation::silu;
};

std::vector<case_tensor> swiglu_tensors(const swiglu_shape& s) {
  const std::int64_t width = s.cols + s.pad;
  return {{.name = "gate", .dims = {s.rows, width}, .lo = -3, .hi = 3},
          {.name = "up", .dims = {s.rows, width}},
          out({.name = "out", .dims = {s.rows, width}})};
}

void swiglu_forward_step(backend& be, const case_tensors& t, const swiglu_shape& s) {
  ops::swiglu_forward(be, {cols_of(t["gate"], s.cols, s.first), cols_of(t["up"], s.cols, s.first),
                           cols_of(t["out"], s.cols, s.first), s.activation});
}

op_case swiglu_forward_case(const swiglu_shape& s, double bytes) {
  op_case c;
  c.size = dims_text({{"rows", s.rows}, {"cols", s.cols}, {"ld", s.cols + s.pad}});
  c.tensors = swiglu_tensors(s);
  c.run = [s](backend& be, const case_tensors& t) { swiglu_forward_step(be, t, s); };
  c.float64 = [s](f64::host_case& h) {
    f64::swiglu_forward(h, s.rows, s.cols, s.cols + s.pad, s.first, s.activation);
  };
  c.bytes = bytes;
  return c;
}

op_case swiglu_backward_case(const swiglu_shape& s, double bytes) {
  const std::int64_t width = s.cols + s.pad;
  op_case c;
  c.size = dims_text({{"rows", s.rows}, {"cols", s.cols}, {"ld", width}}) +
           (s.d_out_type == case_dtype::f32 ? " d_out f32" : "");
  c.tensors = swiglu_tensors(s);
  c.tensors[2].bf16_tolerance = 0.0;  // the objective's forward output
  c.tensors.push_back({.name = "d_out", .type = s.d_out_type, .dims = {s.rows, width}});
  c.tensors.push_back(out({.name = "d_gate", .dims = {s.rows, width}}));
  c.tensors.push_back(out({.name = "d_up", .dims = {s.rows, width}}));
  c.run = [s](backend& be, const case_tensors& t) {
    ops::swiglu_backward(be, {cols_of(t["gate"], s.cols, s.first), cols_of(t["up"], s.cols, s.first),
                              cols_of(t["d_out"], s.cols, s.first), cols_of(t["d_gate"], s.cols, s.first),
                              cols_of(t["d_up"], s.cols, s.first), s.activation});
  };
  c.objective = [s](backend& be, const case_tensors& t) {
    swiglu_forward_step(be, t, s);
    return host_dot(be, t["out"], t["d_out"]);
  };
  c.gradients = {{"gate", "d_gate"}, {"up", "d_up"}};
  c.bytes = bytes;
  return c;
}

const swiglu_shape swiglu_test_shapes[] = {{33, 200, 0, 0, case_dtype::work}, {17, 333, 5, 1, case_dtype::f32}};

// The gated unit's entries for one activation: swiglu_* (silu), geglu_* (gelu_tanh) and
// sigmoid_gate_mul_* (sigmoid, the hybrids' attention output gate) are
// one op each way, registered per activation so that each has its tests and perf row.
op_entry gated_forward_entry(const char* name, gate_activation activation) {
  return {name,
          [activation] {
            std::vector<op_case> cases;
            for (swiglu_shape s : swiglu_test_shapes) {
              s.activation = activation;
              cases.push_back(swiglu_forward_case(s, 0.0));
            }
            return cases;
          },
          [activation](std::int64_t tokens, dtype work) {
            return swiglu_forward_case({tokens, intermediate, 0, 0, case_dtype::work, activation},
                                       3.0 * tokens * intermediate * dtype_size(work));
          }};
}

op_entry gated_backward_entry(const char* name, gate_activation activation) {
  return {name,
          [activation] {
            std::vector<op_case> cases;
            for (swiglu_shape s : swiglu_test_shapes) {
              s.activation = activation;
              cases.push_back(swiglu_backward_case(s, 0.0));
            }
            return cases;
          },
          [activation](std::int64_t tokens, dtype work) {
            return swiglu_backward_case({tokens, intermediate, 0, 0, case_dtype::work, activation},
                                        5.0 * tokens * intermediate * dtype_size(work));
          }};
}

// ---------------------------------------------------------------------------------------
// Embedding

// scale != 1: Gemma's scaled lookup; padding >= 0: that id's rows add no gradient.
struct embedding_extras {
  float scale = 1.0f;
  std::int32_t padding = -1;
};

op_case embedding_forward_case(std::int64_t n, std::int64_t vocab, std::int64_t dim, double bytes,
                               embedding_extras x = {}) {
  op_case c;
  c.size = dims_text({{"tokens", n}, {"vocab", vocab}, {"dim", dim}}) + (x.scale != 1.0f ? " scaled" : "") +
           (x.padding >= 0 ? " padding id" : "");
  c.tensors = {{.name = "table", .dims = {vocab, dim}},
               {.name = "ids", .type = case_dtype::i32, .dims = {n, 1}, .fill = case_fill::ids, .lo = 0,
                .hi = static_cast<float>(vocab)},
               out({.name = "out", .dims = {n, dim}})};
  c.run = [x](backend& be, const case_tensors& t) {
    ops::embedding_forward(be, {t["table"].matrix(), t["ids"].matrix(), t["out"].matrix(), x.scale});
  };
  c.float64 = [n, dim, x](f64::host_case& h) { f64::embedding_forward(h, n, dim, x.scale); };
  c.bytes = bytes;
  return c;
}

op_case embedding_backward_case(std::int64_t n, std::int64_t vocab, std::int64_t dim, double bytes,
                                embedding_extras x = {}) {
  op_case c = embedding_forward_case(n, vocab, dim, bytes, x);
  c.float64 = nullptr;  // the forward's; finite differences check this op
  c.tensors[2].bf16_tolerance = 0.0;  // the objective's forward output
  c.tensors.push_back({.name = "d_out", .dims = {n, dim}});
  // Repeated ids add up in another order on another backend.
  c.tensors.push_back(out({.name = "d_table", .type = case_dtype::f32, .dims = {vocab, dim}}, bf16_tol, 1e-6));
  c.run = [x](backend& be, const case_tensors& t) {
    ops::embedding_backward(be, {t["d_out"].matrix(), t["ids"].matrix(), t["d_table"].matrix(), x.scale, x.padding});
  };
  // The padding row's lookups count in the forward but train nothing: the objective leaves
  // them out, as nn.Embedding's padding_idx does.
  c.objective = [x](backend& be, const case_tensors& t) {
    ops::embedding_forward(be, {t["table"].matrix(), t["ids"].matrix(), t["out"].matrix(), x.scale});
    if (x.padding < 0) return host_dot(be, t["out"], t["d_out"]);
    const tensor& ids = t["ids"];
    std::vector<std::int32_t> id(static_cast<std::size_t>(ids.numel()));
    be.download_bytes(id.data(), ids, id.size() * sizeof(std::int32_t));
    std::vector<float> o(static_cast<std::size_t>(t["out"].numel())), d(o.size());
    be.download_f32(o.data(), t["out"]);
    be.download_f32(d.data(), t["d_out"]);
    const std::size_t dim = o.size() / id.size();
    double sum = 0.0;
    for (std::size_t r = 0; r < id.size(); ++r)
      if (id[r] != x.padding)
        for (std::size_t j = 0; j < dim; ++j) sum += static_cast<double>(o[r * dim + j]) * d[r * dim + j];
    return sum;
  };
  c.gradients = {{"table", "d_table"}};
  return c;
}

op_entry embedding_forward_entry() {
  return {"embedding_forward",
          [] {
            return std::vector<op_case>{embedding_forward_case(30, 50, 64, 0.0), embedding_forward_case(7, 3, 37, 0.0),
                                        embedding_forward_case(30, 9, 64, 0.0, {8.0f, -1})};
          },
          [](std::int64_t tokens, dtype work) {
            return embedding_forward_case(tokens, 32000, hidden, 2.0 * tokens * hidden * dtype_size(work));
          }};
}

op_entry embedding_backward_entry() {
  return {"embedding_backward",
          [] {
            return std::vector<op_case>{embedding_backward_case(30, 50, 64, 0.0), embedding_backward_case(7, 3, 37, 0.0),
                                        embedding_backward_case(30, 9, 64, 0.0, {8.0f, 2})};
          },
          [](std::int64_t tokens, dtype work) {
            return embedding_backward_case(tokens, 32000, hidden, tokens * hidden * (dtype_size(work) + 8.0));
          }};
}

// ---------------------------------------------------------------------------------------
// Cross-entropy: in place on a copy of the logits, so that finite differences can perturb
// the copy's source.

op_case cross_entropy_case(std::int64_t n, std::int64_t vocab, float masked_share) {
  op_case c;
  c.size = dims_text({{"rows", n}, {"vocab", vocab}});
  const float lo = -masked_share * static_cast<float>(vocab);  // labels below 0 are masked rows
  c.tensors = {{.name = "logits_in", .type = case_dtype::f32, .dims = {n, vocab}, .lo = -4, .hi = 4},
               out({.name = "logits", .type = case_dtype::f32, .dims = {n, vocab}}),
               {.name = "labels", .type = case_dtype::i32, .dims = {n, 1}, .fill = case_fill::ids, .lo = lo,
                .hi = static_cast<float>(vocab)},
               out({.name = "row_loss", .type = case_dtype::f32, .dims = {n, 1}})};
  constexpr float grad_scale = 0.5f;
  const case_step copy_in = [](backend& be, const case_tensors& t) {
    ops::copy_heads(be, ops::as_heads(t["logits"].matrix()), ops::as_heads(t["logits_in"].matrix()));
  };
  const case_step loss = [grad_scale](backend& be, const case_tensors& t) {
    ops::cross_entropy(be, {t["logits"].matrix(), t["labels"].matrix(), t["row_loss"].matrix(), grad_scale});
  };
  c.prepare = copy_in;
  c.run = loss;
  c.objective = [=](backend& be, const case_tensors& t) {
    copy_in(be, t);
    loss(be, t);
    std::vector<float> rows(static_cast<std::size_t>(n));
    be.download_f32(rows.data(), t["row_loss"]);
    double sum = 0.0;
    for (float r : rows) sum += r;
    return grad_scale * sum;
  };
  c.gradients = {{"logits_in", "logits"}};
  // The loss of each row too (the gradient alone leaves row_loss to the other backend).
  c.float64 = [=](f64::host_case& h) { f64::cross_entropy(h, n, vocab, grad_scale); };
  c.bytes = 2.0 * static_cast<double>(n) * static_cast<double>(vocab) * 4;
  return c;
}

op_entry cross_entropy_entry() {
  return {"cross_entropy",
          [] { return std::vector<op_case>{cross_entropy_case(30, 50, 0.2f), cross_entropy_case(6, 500, 0.0f)}; },
          [](std::int64_t, dtype) {
            const std::int64_t vocab = 128256, rows = std::max<std::int64_t>(1, (std::int64_t{256} << 20) / (4 * vocab));
            return cross_entropy_case(rows, vocab, 0.0f);
          }};
}

std::vector<op_entry> build_registry() {
  std::vector<op_entry> entries{gemm_entry(),
          attention_entry("sdpa_forward", attention_test_shapes, sdpa_forward_case, attention_dtype::bf16),
          attention_entry("sdpa_backward", attention_test_shapes, sdpa_backward_case, attention_dtype::bf16),
          attention_entry("sdpa_forward_fp8", attention_fp8_forward_shapes, sdpa_forward_case, attention_dtype::fp8),
          attention_entry("sdpa_backward_fp8", attention_fp8_shapes, sdpa_backward_case, attention_dtype::fp8),
          rope_entry(),
          rmsnorm_forward_entry(),
          rmsnorm_backward_entry(),
          heads_entry("copy_heads", copy_heads_case),
          heads_entry("add_heads", add_heads_case),
          heads_entry("fill_heads", fill_heads_case),
          lse_merge_entry(),
          embedding_forward_entry(),
          embedding_backward_entry(),
          gated_forward_entry("swiglu_forward", gate_activation::silu),
          gated_backward_entry("swiglu_backward", gate_activation::silu),
          gated_forward_entry("geglu_forward", gate_activation::gelu_tanh),
          gated_backward_entry("geglu_backward", gate_activation::gelu_tanh),
          gated_forward_entry("sigmoid_gate_mul_forward", gate_activation::sigmoid),
          gated_backward_entry("sigmoid_gate_mul_backward", gate_activation::sigmoid),
          cross_entropy_entry()};
  for (op_entry& e : model_op_entries()) entries.push_back(std::move(e));
  for (op_entry& e : moe_op_entries()) entries.push_back(std::move(e));
  for (op_entry& e : gated_delta_op_entries()) entries.push_back(std::move(e));
  for (op_entry& e : optimizer_op_entries()) entries.push_back(std::move(e));
  return entries;
}

}  // namespace

const std::vector<op_entry>& op_registry() {
  static const std::vector<op_entry> entries = build_registry();
  return entries;
}

}  // namespace upipe
