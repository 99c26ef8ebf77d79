// The optimizer's registered ops: AdamW in each state format (f32, bf16 and q8 moments;
// f32 and bf16-kahan masters; f32 and bf16 gradients; the whole update and its two
// halves; weight-decay runs), and the sum of squares. Every backend runs AdamW's one
// arithmetic (ops/adamw_formula.hpp), so the outputs must match the reference exactly,
// bit for bit, except a bf16 working copy against the cpu's f32 one.
#include <string>
#include <vector>

#include "backend/op_cases.hpp"
#include "backend/op_registry.hpp"
#include "backend/ops.hpp"

namespace upipe::op_cases {

namespace {

// AdamW's state: the same bits on every backend. A tolerance of exactly 0 would read as
// "not compared"; the smallest positive double still demands equal bits of any finite value.
constexpr double exact = 4.9e-324;
constexpr double copy_tol = 4e-3;  // the working copy rounded to bf16 on a bf16 backend

struct adamw_spec {
  std::int64_t n = 0, step = 1;
  moment_format moments = moment_format::f32;
  master_format master = master_format::f32;
  case_dtype grad = case_dtype::f32;
  bool weights = true;
  adamw_part part = adamw_part::whole;
  std::vector<adamw_run> runs = {};
};

case_tensor compared(case_tensor t) { return out(t, exact, exact); }

// The moments' tensors of a format: f32 and bf16 values near a trained state's, or
// random codes with their blocks' absmax.
void add_moments(std::vector<case_tensor>& t, const adamw_spec& s, bool output) {
  const auto wrap = [&](case_tensor x) { return output ? compared(x) : x; };
  const std::int64_t n = s.n;
  if (s.moments == moment_format::q8) {
    t.push_back(wrap({.name = "exp_avg", .type = case_dtype::u8, .dims = {1, n}, .fill = case_fill::ids, .lo = 0,
                      .hi = 256}));
    t.push_back(wrap({.name = "exp_avg_sq", .type = case_dtype::u8, .dims = {1, n}, .fill = case_fill::ids, .lo = 0,
                      .hi = 256}));
    t.push_back(wrap({.name = "exp_avg_absmax", .type = case_dtype::f32, .dims = {1, n / q8_block}, .lo = 0.01f,
                      .hi = 0.1f}));
    t.push_back(wrap({.name = "exp_avg_sq_absmax", .type = case_dtype::f32, .dims = {1, n / q8_block}, .lo = 1e-4f,
                      .hi = 1e-2f}));
    return;
  }
  const case_dtype type = s.moments == moment_format::bf16 ? case_dtype::bf16 : case_dtype::f32;
  t.push_back(wrap({.name = "exp_avg", .type = type, .dims = {1, n}, .lo = -0.1f, .hi = 0.1f}));
  t.push_back(wrap({.name = "exp_avg_sq", .type = type, .dims = {1, n}, .lo = 0, .hi = 0.01f}));
}

op_case adamw_case(const adamw_spec& s, dtype work) {
  const std::int64_t n = s.n;
  const bool moments = s.part != adamw_part::master, master = s.part != adamw_part::moments;
  const bool kahan = s.master == master_format::bf16_kahan;
  op_case c;
  c.size = dims_text({{"n", n}, {"step", s.step}}) + (s.part == adamw_part::moments ? " moments half"
                                                       : s.part == adamw_part::master ? " master half" : "") +
           (moments ? std::string(s.moments == moment_format::q8     ? " q8"
                                  : s.moments == moment_format::bf16 ? " bf16 moments"
                                                                     : "")
                    : "") +
           (master && kahan ? " bf16-kahan" : "") + (moments && s.grad == case_dtype::bf16 ? " bf16 grad" : "") +
           (master && !s.weights ? " no weights" : "") + (s.runs.empty() ? "" : " runs " + std::to_string(s.runs.size()));
  if (master) {
    c.tensors.push_back(compared({.name = "master", .type = kahan ? case_dtype::bf16 : case_dtype::f32, .dims = {1, n},
                                  .lo = -2.0f, .hi = 2.0f}));
    if (kahan)
      c.tensors.push_back(compared({.name = "master_comp", .type = case_dtype::bf16, .dims = {1, n}, .lo = -1e-3f,
                                    .hi = 1e-3f}));
    c.tensors.push_back(
        out({.name = "weights", .dims = {1, s.weights ? n : 1}, .fill = case_fill::zero}, copy_tol, exact));
  }
  if (moments) {
    add_moments(c.tensors, s, true);
    c.tensors.push_back({.name = "grad", .type = s.grad, .dims = {1, n}});
  }
  if (s.part == adamw_part::moments)
    c.tensors.push_back(compared({.name = "direction", .type = case_dtype::f32, .dims = {1, n}, .fill = case_fill::zero}));
  if (s.part == adamw_part::master)
    c.tensors.push_back({.name = "direction", .type = case_dtype::f32, .dims = {1, n}, .lo = -1e-3f, .hi = 1e-3f});
  c.run = [s, moments, master, kahan](backend& be, const case_tensors& t) {
    adamw_args a;
    if (master) {
      a.master = t["master"].matrix();
      if (kahan) a.master_comp = t["master_comp"].matrix();
      if (s.weights) a.weights = t["weights"].matrix();
    }
    if (moments) {
      a.exp_avg = t["exp_avg"].matrix();
      a.exp_avg_sq = t["exp_avg_sq"].matrix();
      a.grad = t["grad"].matrix();
      if (s.moments == moment_format::q8) {
        a.exp_avg_absmax = t["exp_avg_absmax"].matrix();
        a.exp_avg_sq_absmax = t["exp_avg_sq_absmax"].matrix();
      }
    }
    if (s.part != adamw_part::whole) a.direction = t["direction"].matrix();
    a.part = s.part;
    a.lr = 1e-3f;
    a.weight_decay = 0.1f;
    a.grad_scale = 0.8f;
    a.step = s.step;
    a.runs = s.runs;
    ops::adamw(be, a);
  };
  // The plain step (f32 moments and master, f32 gradients, one run) against its float64
  // definition; the other modes against tests/optim/adamw_modes_test.cpp's reference.
  if (s.moments == moment_format::f32 && !kahan && s.part == adamw_part::whole && s.runs.empty() &&
      s.grad == case_dtype::f32) {
    c.float64 = [s](f64::host_case& h) {
      adamw_args a;
      a.lr = 1e-3f;
      a.weight_decay = 0.1f;
      a.grad_scale = 0.8f;
      a.step = s.step;
      f64::adamw(h, a, s.n);
    };
  } else {
    c.reference_test = "tests/optim/adamw_modes_test.cpp";
  }
  const double moment_bytes = s.moments == moment_format::f32 ? 16 : s.moments == moment_format::bf16 ? 8 : 4;
  const double grad_bytes = s.grad == case_dtype::bf16 ? 2 : 4;
  const double master_bytes = 8;  // read and written: f32, or bf16 with its bf16 compensation
  c.bytes = static_cast<double>(n) * ((moments ? moment_bytes + grad_bytes : 0) + (master ? master_bytes : 0) +
                                      (s.part != adamw_part::whole ? 4 : 0) +
                                      (master && s.weights ? static_cast<double>(dtype_size(work)) : 0));
  return c;
}

std::vector<adamw_run> two_runs(std::int64_t n, std::int64_t first) { return {{first, true}, {n, false}}; }

op_entry adamw_entry() {
  return {"adamw",
          [] {
            const dtype w = dtype::f32;
            return std::vector<op_case>{
                adamw_case({.n = 1000}, w), adamw_case({.n = 37, .step = 3}, w),
                adamw_case({.n = 515, .step = 2, .weights = false}, w),
                adamw_case({.n = 700, .grad = case_dtype::bf16, .runs = two_runs(700, 333)}, w),
                adamw_case({.n = 600, .step = 4, .part = adamw_part::moments}, w),
                adamw_case({.n = 600, .step = 4, .part = adamw_part::master, .runs = two_runs(600, 100)}, w),
                adamw_case({.n = 600, .master = master_format::bf16_kahan, .part = adamw_part::master}, w)};
          },
          [](std::int64_t tokens, dtype work) { return adamw_case({.n = tokens * 1024}, work); }};
}

op_entry adamw_bf16_entry() {
  return {"adamw_bf16_moments",
          [] {
            const dtype w = dtype::f32;
            const moment_format m = moment_format::bf16;
            return std::vector<op_case>{
                adamw_case({.n = 999, .step = 2, .moments = m, .runs = two_runs(999, 500)}, w),
                adamw_case({.n = 333, .moments = m, .master = master_format::bf16_kahan, .grad = case_dtype::bf16}, w),
                adamw_case({.n = 421, .step = 5, .moments = m, .part = adamw_part::moments}, w)};
          },
          [](std::int64_t tokens, dtype work) {
            return adamw_case({.n = tokens * 1024, .moments = moment_format::bf16, .grad = case_dtype::bf16}, work);
          }};
}

op_entry adamw_q8_entry() {
  return {"adamw_q8",
          [] {
            const dtype w = dtype::f32;
            const moment_format m = moment_format::q8;
            const master_format k = master_format::bf16_kahan;
            return std::vector<op_case>{
                adamw_case({.n = 768, .step = 3, .moments = m, .runs = {{100, true}, {356, false}, {768, true}}}, w),
                adamw_case({.n = 512, .moments = m, .master = k, .grad = case_dtype::bf16, .weights = false}, w),
                adamw_case({.n = 1024, .step = 2, .moments = m, .master = k, .runs = two_runs(1024, 256)}, w),
                adamw_case({.n = 256, .step = 7, .moments = m, .part = adamw_part::moments}, w)};
          },
          [](std::int64_t tokens, dtype work) {
            return adamw_case({.n = tokens * 1024, .moments = moment_format::q8, .master = master_format::bf16_kahan,
                               .grad = case_dtype::bf16, .weights = false},
                              work);
          }};
}

// The fp64 result goes into a (1 x 1) f32 tensor to be compared like any output.
op_case sum_squares_case(std::int64_t rows, std::int64_t cols, std::int64_t pad, case_dtype type = case_dtype::f32) {
  op_case c;
  c.size = dims_text({{"rows", rows}, {"cols", cols}, {"ld", cols + pad}}) + (type == case_dtype::bf16 ? " bf16" : "");
  c.tensors = {{.name = "x", .type = type, .dims = {rows, cols + pad}},
               out({.name = "sum", .type = case_dtype::f32, .dims = {1, 1}}, 2e-2, 1e-5)};
  c.run = [cols](backend& be, const case_tensors& t) {
    const auto sum = static_cast<float>(ops::sum_squares(be, t["x"].matrix().col_block(0, cols)));
    be.upload_f32(t["sum"], &sum);
  };
  c.bytes = (type == case_dtype::bf16 ? 2.0 : 4.0) * static_cast<double>(rows) * static_cast<double>(cols);
  c.float64 = [=](f64::host_case& h) { f64::sum_squares(h, rows, cols, cols + pad); };
  return c;
}

op_entry sum_squares_entry() {
  return {"sum_squares",
          [] {
            return std::vector<op_case>{sum_squares_case(1, 100000, 0), sum_squares_case(37, 300, 5),
                                        sum_squares_case(5, 1001, 3, case_dtype::bf16)};
          },
          [](std::int64_t tokens, dtype) { return sum_squares_case(1, tokens * 1024, 0); }};
}

}  // namespace

std::vector<op_entry> optimizer_op_entries() {
  return {adamw_entry(), adamw_bf16_entry(), adamw_q8_entry(), sum_squares_entry()};
}

}  // namespace upipe::op_cases
