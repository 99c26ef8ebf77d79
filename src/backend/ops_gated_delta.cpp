// The Gated DeltaNet op entries: shapes, dtypes, documents and workspaces checked here, so
// that the implementations trust them.
#include <string>
#include <utility>

#include "backend/op_checks.hpp"
#include "backend/ops.hpp"
#include "core/error.hpp"
#include "ops/gated_delta/workspace.hpp"

namespace upipe::ops {

using namespace checks;

namespace {

bool is_empty(const head_view& v) { return v.data == nullptr; }

void check_view(const char* op, const char* name, const head_view& v, dtype type, std::int64_t tokens,
                std::int64_t heads, std::int64_t dim) {
  check_layout(op, name, v);
  check_type(op, name, v, type, type);
  check_dims(op, name, v, tokens, heads, dim);
}

void check_rows(const char* op, const char* name, const mat_view& m, dtype type, std::int64_t rows,
                std::int64_t cols) {
  check_matrix(op, name, m);
  check_type(op, name, m, type, type);
  check_dims(op, name, m, rows, cols);
}

// A stack of H_v (rows, cols) f32 state matrices, or empty where `optional`.
void check_states(const char* op, const char* name, const head_view& v, std::int64_t heads, std::int64_t rows,
                  std::int64_t cols, bool optional) {
  if (optional && is_empty(v)) return;
  check_view(op, name, v, dtype::f32, heads, rows, cols);
}

void check_sequence_documents(const char* op, const sequence_documents& d) {
  UPIPE_CHECK(d.first >= 0, std::string("ops::") + op + ": the segment's first row index " +
                                 std::to_string(d.first) + " is negative");
  if (d.starts.empty()) return;
  UPIPE_CHECK(d.starts[0] == 0, std::string("ops::") + op + ": the first document starts at 0, not " +
                                    std::to_string(d.starts[0]));
  for (std::size_t i = 1; i < d.starts.size(); ++i)
    UPIPE_CHECK(d.starts[i] > d.starts[i - 1], std::string("ops::") + op + ": document starts must increase (" +
                                                   std::to_string(d.starts[i - 1]) + " then " +
                                                   std::to_string(d.starts[i]) + ")");
}

void check_options(const char* op, const gated_delta_options& o) {
  UPIPE_CHECK(o.chunk_size == gated_delta_chunk,
              std::string("ops::") + op + ": chunk_size " + std::to_string(o.chunk_size) +
                  " is not supported: the chunked kernels run chunks of " + std::to_string(gated_delta_chunk));
  check_finite_scalar(op, "scale", o.scale, "0 for d_k^-0.5");
  UPIPE_CHECK(o.l2_eps > 0.0f && o.l2_eps < 1.0f, std::string("ops::") + op + ": l2_eps " +
                                                       std::to_string(o.l2_eps) + " must be in (0, 1) (e.g. 1e-6)");
}

struct gdr_dims {
  std::int64_t s, hk, hv, dk, dv;
};

// q, k (s, H_k, d_k) and v's (s, H_v, d_v) in the working dtype; H_k divides H_v; g and beta
// (s, H_v) f32. `v` may be absent (the backward summary), then dv comes from `dv_from`.
gdr_dims check_inputs(const backend& be, const char* op, const head_view& q, const head_view& k, const head_view* v,
                      const mat_view& g, const mat_view& beta, const head_view& dv_from) {
  const head_view& values = v != nullptr ? *v : dv_from;
  const gdr_dims d{q.tokens, q.heads, values.heads, q.dim, values.dim};
  check_view(op, "q", q, be.work_dtype(), d.s, d.hk, d.dk);
  check_view(op, "k", k, be.work_dtype(), d.s, d.hk, d.dk);
  if (v != nullptr) check_view(op, "v", *v, be.work_dtype(), d.s, d.hv, d.dv);
  UPIPE_CHECK(d.hk > 0 && d.hv % d.hk == 0,
              fail(op, "k", k, "key heads must divide the value heads (" + std::to_string(d.hv) + ")"));
  UPIPE_CHECK(d.dk > 0 && d.dv > 0, fail(op, "q", q, "head dims must be positive"));
  UPIPE_CHECK(d.s > 0, fail(op, "q", q, "the segment must hold at least one row"));
  check_rows(op, "g", g, dtype::f32, d.s, d.hv);
  check_rows(op, "beta", beta, dtype::f32, d.s, d.hv);
  return d;
}

void check_workspace(const char* op, const mat_view& w, const gdr_dims& d, gated_delta_pass pass) {
  check_matrix(op, "workspace", w);
  check_type(op, "workspace", w, dtype::f32, dtype::f32);
  const gated_delta_shape shape{d.s, d.hk, d.hv, d.dk, d.dv};
  UPIPE_CHECK(w.rows == 1 && gated_delta_chunks_per_pass(shape, pass, w.cols) > 0,
              fail(op, "workspace", w,
                   "must be one row of enough f32 elements for this shape, e.g. " +
                       std::to_string(gated_delta_workspace_floats(shape, pass, 16)) +
                       " for passes of 16 chunks (gated_delta_workspace_floats, ops/gated_delta/workspace.hpp)"));
}

}  // namespace

void gated_delta_forward(backend& be, const gated_delta_forward_args& a) {
  const char* op = "gated_delta_forward";
  const gdr_dims d = check_inputs(be, op, a.q, a.k, &a.v, a.g, a.beta, a.v);
  check_states(op, "initial_state", a.initial_state, d.hv, d.dk, d.dv, true);
  check_view(op, "out", a.out, be.work_dtype(), d.s, d.hv, d.dv);
  check_states(op, "final_state", a.final_state, d.hv, d.dk, d.dv, true);
  check_sequence_documents(op, a.documents);
  check_options(op, a.options);
  check_workspace(op, a.workspace, d, gated_delta_pass::forward);
  be.run(a);
}

void gated_delta_backward(backend& be, const gated_delta_backward_args& a) {
  const char* op = "gated_delta_backward";
  const gdr_dims d = check_inputs(be, op, a.q, a.k, &a.v, a.g, a.beta, a.v);
  check_states(op, "initial_state", a.initial_state, d.hv, d.dk, d.dv, true);
  check_view(op, "d_out", a.d_out, be.work_dtype(), d.s, d.hv, d.dv);
  check_states(op, "d_final_state", a.d_final_state, d.hv, d.dk, d.dv, true);
  check_view(op, "d_q", a.d_q, be.work_dtype(), d.s, d.hk, d.dk);
  check_view(op, "d_k", a.d_k, be.work_dtype(), d.s, d.hk, d.dk);
  check_view(op, "d_v", a.d_v, be.work_dtype(), d.s, d.hv, d.dv);
  check_rows(op, "d_g", a.d_g, dtype::f32, d.s, d.hv);
  check_rows(op, "d_beta", a.d_beta, dtype::f32, d.s, d.hv);
  check_states(op, "d_initial_state", a.d_initial_state, d.hv, d.dk, d.dv, true);
  check_sequence_documents(op, a.documents);
  check_options(op, a.options);
  check_workspace(op, a.workspace, d, gated_delta_pass::backward);
  be.run(a);
}

void gated_delta_summary(backend& be, const gated_delta_summary_args& a) {
  const char* op = "gated_delta_summary";
  const gdr_dims d = check_inputs(be, op, a.q, a.k, &a.v, a.g, a.beta, a.v);
  check_states(op, "transition", a.transition, d.hv, d.dk, d.dk, false);
  check_states(op, "local_state", a.local_state, d.hv, d.dk, d.dv, false);
  check_sequence_documents(op, a.documents);
  check_options(op, a.options);
  check_workspace(op, a.workspace, d, gated_delta_pass::summary);
  be.run(a);
}

void gated_delta_summary_backward(backend& be, const gated_delta_summary_backward_args& a) {
  const char* op = "gated_delta_summary_backward";
  const gdr_dims d = check_inputs(be, op, a.q, a.k, nullptr, a.g, a.beta, a.d_out);
  check_view(op, "d_out", a.d_out, be.work_dtype(), d.s, d.hv, d.dv);
  check_states(op, "local_d_initial", a.local_d_initial, d.hv, d.dk, d.dv, false);
  check_sequence_documents(op, a.documents);
  check_options(op, a.options);
  check_workspace(op, a.workspace, d, gated_delta_pass::summary_backward);
  be.run(a);
}

void gated_delta_scan(backend& be, const gated_delta_scan_args& a) {
  const char* op = "gated_delta_scan";
  UPIPE_CHECK(a.heads > 0 && a.transitions.tokens % a.heads == 0,
              fail(op, "transitions", a.transitions,
                   "must hold a whole number of segments of " + std::to_string(a.heads) + " heads"));
  const std::int64_t n = a.transitions.tokens, dk = a.transitions.heads, dv = a.locals.dim;
  check_states(op, "transitions", a.transitions, n, dk, dk, false);
  check_states(op, "locals", a.locals, n, dk, dv, false);
  check_states(op, "states", a.states, n, dk, dv, false);
  be.run(a);
}

namespace {

void check_conv_inputs(const backend& be, const char* op, const mat_view& x, const mat_view& halo,
                       const mat_view& weight) {
  check_matrix(op, "x", x);
  check_type(op, "x", x, be.work_dtype(), be.work_dtype());
  check_matrix(op, "weight", weight);
  check_type(op, "weight", weight, be.work_dtype(), be.work_dtype());
  check_dims(op, "weight", weight, x.cols, weight.cols);
  UPIPE_CHECK(weight.cols >= 1, fail(op, "weight", weight, "the kernel needs at least one tap"));
  if (halo.rows == 0) return;
  check_matrix(op, "halo", halo);
  check_type(op, "halo", halo, be.work_dtype(), be.work_dtype());
  check_dims(op, "halo", halo, weight.cols - 1, x.cols);
}

}  // namespace

void causal_conv_forward(backend& be, const causal_conv_forward_args& a) {
  const char* op = "causal_conv_forward";
  check_conv_inputs(be, op, a.x, a.halo, a.weight);
  check_rows(op, "y", a.y, be.work_dtype(), a.x.rows, a.x.cols);
  check_sequence_documents(op, a.documents);
  be.run(a);
}

void causal_conv_backward(backend& be, const causal_conv_backward_args& a) {
  const char* op = "causal_conv_backward";
  check_conv_inputs(be, op, a.x, a.halo, a.weight);
  check_rows(op, "d_y", a.d_y, be.work_dtype(), a.x.rows, a.x.cols);
  check_rows(op, "d_x", a.d_x, be.work_dtype(), a.x.rows, a.x.cols);
  if (a.d_halo.rows > 0) check_rows(op, "d_halo", a.d_halo, be.work_dtype(), a.weight.cols - 1, a.x.cols);
  if (a.d_weight.rows > 0) check_rows(op, "d_weight", a.d_weight, dtype::f32, a.x.cols, a.weight.cols);
  check_sequence_documents(op, a.documents);
  be.run(a);
}

namespace {

void check_gate_inputs(const backend& be, const char* op, const mat_view& a, const mat_view& b,
                       const mat_view& a_log, const mat_view& dt_bias) {
  check_matrix(op, "a", a);
  check_type(op, "a", a, be.work_dtype(), dtype::f32);
  check_rows(op, "b", b, b.type, a.rows, a.cols);
  check_type(op, "b", b, be.work_dtype(), dtype::f32);
  for (const auto& [name, view] : {std::pair{"a_log", &a_log}, std::pair{"dt_bias", &dt_bias}}) {
    check_matrix(op, name, *view);
    check_type(op, name, *view, be.work_dtype(), dtype::f32);
    check_dims(op, name, *view, 1, a.cols);
  }
}

}  // namespace

void gated_delta_gates_forward(backend& be, const gated_delta_gates_forward_args& a) {
  const char* op = "gated_delta_gates_forward";
  check_gate_inputs(be, op, a.a, a.b, a.a_log, a.dt_bias);
  check_rows(op, "g", a.g, dtype::f32, a.a.rows, a.a.cols);
  check_rows(op, "beta", a.beta, dtype::f32, a.a.rows, a.a.cols);
  be.run(a);
}

void gated_delta_gates_backward(backend& be, const gated_delta_gates_backward_args& a) {
  const char* op = "gated_delta_gates_backward";
  check_gate_inputs(be, op, a.a, a.b, a.a_log, a.dt_bias);
  check_rows(op, "d_g", a.d_g, dtype::f32, a.a.rows, a.a.cols);
  check_rows(op, "d_beta", a.d_beta, dtype::f32, a.a.rows, a.a.cols);
  check_rows(op, "d_a", a.d_a, a.a.type, a.a.rows, a.a.cols);
  check_rows(op, "d_b", a.d_b, a.b.type, a.a.rows, a.a.cols);
  if (a.d_a_log.rows > 0) check_rows(op, "d_a_log", a.d_a_log, dtype::f32, 1, a.a.cols);
  if (a.d_dt_bias.rows > 0) check_rows(op, "d_dt_bias", a.d_dt_bias, dtype::f32, 1, a.a.cols);
  be.run(a);
}

}  // namespace upipe::ops
