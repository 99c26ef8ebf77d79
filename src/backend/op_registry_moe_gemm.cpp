// The registry's entries for the grouped expert GEMMs (moe_grouped_gemm_args): the three
// forms through each CUDA engine, held to a float64 loop over the groups. Each case's groups
// are uneven, one is empty, and the row matrices run past the last group (the rows a
// capacity leaves unused), which the op leaves as they were. The perf case is
// Qwen3-30B-A3B's up projection at `tokens` (128 experts of 768 x 2048, 8 a token), its
// groups' sizes as a skewed routing gives them.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/op_cases.hpp"
#include "backend/op_float64.hpp"
#include "backend/ops.hpp"

namespace upipe::op_cases {

namespace {

// G groups of `counts` rows within `rows` rows; rows (m, K) by a group's (N, K) matrix
// (rows_by_weight_t), (K, N) matrix (rows_by_weight), or its (K, N) gradient from rows
// (m, K) and other (m, N).
struct grouped_shape {
  std::vector<std::int64_t> counts;
  std::int64_t rows, K, N;
  std::int64_t groups() const { return static_cast<std::int64_t>(counts.size()); }
};

std::vector<std::int64_t> offsets_of(const grouped_shape& s) {
  std::vector<std::int64_t> o{0};
  for (std::int64_t c : s.counts) o.push_back(o.back() + c);
  return o;
}

const char* form_name(grouped_form f) {
  return f == grouped_form::rows_by_weight_t ? "rows W^T" : f == grouped_form::rows_by_weight ? "rows W" : "dW";
}

// weights: the groups' matrices stacked (G x a group's rows); each group's view a block of it.
std::vector<mat_view> group_views(const tensor& weights, std::int64_t groups) {
  std::vector<mat_view> views;
  const std::int64_t each = weights.matrix().rows / groups;
  for (std::int64_t g = 0; g < groups; ++g) views.push_back(weights.matrix().row_block(g * each, each));
  return views;
}

// The float64 definition: each group's GEMM on its rows, the other rows untouched.
void grouped_f64(f64::host_case& h, const grouped_shape& s, grouped_form form, double beta) {
  const std::vector<std::int64_t> o = offsets_of(s);
  const std::vector<double>& rows = h["rows"];
  std::vector<double>& w = h["weights"];
  for (std::int64_t g = 0; g < s.groups(); ++g) {
    const std::int64_t base = g * s.K * s.N;  // a group's matrix: N x K (W^T form) or K x N
    for (std::int64_t r = o[static_cast<std::size_t>(g)]; r < o[static_cast<std::size_t>(g) + 1]; ++r) {
      if (form == grouped_form::weight_gradient) {
        for (std::int64_t i = 0; i < s.K; ++i)
          for (std::int64_t j = 0; j < s.N; ++j)
            w[static_cast<std::size_t>(base + i * s.N + j)] +=
                rows[static_cast<std::size_t>(r * s.K + i)] * h["other"][static_cast<std::size_t>(r * s.N + j)];
        continue;
      }
      for (std::int64_t j = 0; j < s.N; ++j) {
        double sum = 0;
        for (std::int64_t i = 0; i < s.K; ++i)
          sum += rows[static_cast<std::size_t>(r * s.K + i)] *
                 w[static_cast<std::size_t>(base + (form == grouped_form::rows_by_weight_t ? j * s.K + i : i * s.N + j))];
        double& out = h["out"][static_cast<std::size_t>(r * s.N + j)];
        out = sum + beta * out;
      }
    }
  }
}

op_case grouped_case(const grouped_shape& s, grouped_form form, bool f32_out, grouped_engine engine, bool test) {
  op_case c;
  const bool gradient = form == grouped_form::weight_gradient;
  const float beta = gradient || f32_out ? 1.0f : 0.0f;
  c.size = dims_text({{"groups", s.groups()}, {"rows", s.rows}, {"K", s.K}, {"N", s.N}}) + " " + form_name(form) +
           (f32_out && !gradient ? " f32 beta 1" : "");
  const std::int64_t G = s.groups();
  const shape weights = form == grouped_form::rows_by_weight_t ? shape{G * s.N, s.K} : shape{G * s.K, s.N};
  c.tensors = {{.name = "rows", .dims = {s.rows, s.K}},
               {.name = "other", .dims = {gradient ? s.rows : 0, s.N}},
               gradient ? out({.name = "weights", .type = case_dtype::f32, .dims = weights})
                        : case_tensor{.name = "weights", .dims = weights},
               {.name = "offsets", .type = case_dtype::i32, .dims = {1, G + 1}, .fill = case_fill::ids, .lo = 0.0f,
                .hi = 1.0f},
               gradient ? case_tensor{.name = "out", .dims = {0, s.N}}
                        : out({.name = "out", .type = f32_out ? case_dtype::f32 : case_dtype::work, .dims = {s.rows, s.N}})};
  c.prepare = [s](backend& be, const case_tensors& t) {
    const std::vector<std::int64_t> o = offsets_of(s);
    const std::vector<std::int32_t> ids(o.begin(), o.end());
    be.upload_bytes(t["offsets"], ids.data(), ids.size() * sizeof(std::int32_t));
  };
  c.run = [s, form, beta, engine](backend& be, const case_tensors& t) {
    moe_grouped_gemm_args a;
    a.form = form;
    a.rows = t["rows"].matrix();
    a.other = t["other"].matrix();
    a.weights = group_views(t["weights"], s.groups());
    a.offsets = t["offsets"].matrix();
    a.out = t["out"].matrix();
    a.beta = beta;
    a.engine = engine;
    ops::moe_grouped_gemm(be, a);
  };
  if (test) c.float64 = [s, form, beta](f64::host_case& h) { grouped_f64(h, s, form, beta); };
  std::int64_t used = 0;
  for (std::int64_t n : s.counts) used += n;
  c.flops = 2.0 * static_cast<double>(used) * static_cast<double>(s.K) * static_cast<double>(s.N);
  return c;
}

// Qwen3-30B-A3B's routed rows at `tokens`: 8 a token over 128 experts, expert e's share
// proportional to 1 / (1 + e / 16) (a few hot experts, a long tail), summing to 8 tokens.
grouped_shape qwen3_up(std::int64_t tokens) {
  const std::int64_t experts = 128, rows = 8 * tokens;
  std::vector<double> share;
  double total = 0;
  for (std::int64_t e = 0; e < experts; ++e) total += share.emplace_back(1.0 / (1.0 + static_cast<double>(e) / 16.0));
  grouped_shape s{{}, rows, 2048, 768};
  std::int64_t given = 0;
  for (std::int64_t e = 0; e < experts; ++e) {
    const double even = static_cast<double>(rows) * share[static_cast<std::size_t>(e)] / total;
    const std::int64_t n = e + 1 == experts ? rows - given : static_cast<std::int64_t>(std::floor(even));
    s.counts.push_back(n);
    given += n;
  }
  return s;
}

const std::vector<grouped_shape> grouped_test_shapes = {
    {{5, 0, 12, 3}, 24, 64, 40},
    {{17, 1, 0, 30, 2, 9, 0, 41}, 104, 32, 72},
};

op_entry grouped_entry(const char* name, grouped_form form, bool f32_out, grouped_engine engine) {
  return {name,
          [form, f32_out, engine] {
            std::vector<op_case> cases;
            for (const grouped_shape& s : grouped_test_shapes) cases.push_back(grouped_case(s, form, f32_out, engine, true));
            return cases;
          },
          [form, f32_out, engine](std::int64_t tokens, dtype) {
            return grouped_case(qwen3_up(tokens), form, f32_out, engine, false);
          }};
}

}  // namespace

std::vector<op_entry> moe_gemm_op_entries() {
  std::vector<op_entry> entries;
  for (const grouped_engine engine : {grouped_engine::cutlass, grouped_engine::cublas}) {
    const bool cublas = engine == grouped_engine::cublas;
    entries.push_back(grouped_entry(cublas ? "moe_grouped_gemm_cublas" : "moe_grouped_gemm",
                                    grouped_form::rows_by_weight_t, false, engine));
    entries.push_back(grouped_entry(cublas ? "moe_grouped_gemm_data_cublas" : "moe_grouped_gemm_data",
                                    grouped_form::rows_by_weight, true, engine));
    entries.push_back(grouped_entry(cublas ? "moe_grouped_gemm_data_bf16_cublas" : "moe_grouped_gemm_data_bf16",
                                    grouped_form::rows_by_weight, false, engine));
    entries.push_back(grouped_entry(cublas ? "moe_grouped_gemm_weights_cublas" : "moe_grouped_gemm_weights",
                                    grouped_form::weight_gradient, false, engine));
  }
  return entries;
}

}  // namespace upipe::op_cases
