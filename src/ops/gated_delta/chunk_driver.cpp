#include "ops/gated_delta/chunk_driver.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "ops/gated_delta/chunk_backward.hpp"
#include "ops/gated_delta/workspace_layout.hpp"

namespace upipe::gated_delta {

std::int64_t stage_smem_floats(stage s, std::int64_t dk, std::int64_t dv) {
  switch (s) {
    case stage::prepare: return prepare_smem_floats(dk, dv);
    case stage::state_pass: return state_pass_smem_floats(dk);
    case stage::output: return output_smem_floats(dk, dv);
    case stage::intra_backward: return intra_backward_smem_floats(dk, dv);
    case stage::reverse_pass: return reverse_pass_smem_floats(dk);
    case stage::wy_backward: return wy_backward_smem_floats(dk, dv);
    case stage::output_backward: return output_backward_smem_floats(dk, dv);
    case stage::qk_backward: return qk_backward_smem_floats(dk);
  }
  return 0;
}

namespace {

element element_of(dtype type) { return type == dtype::bf16 ? element::bf16 : element::f32; }

tensor3 tensor_of(const head_view& v) {
  return {v.data, element_of(v.type), v.token_stride, v.head_stride};
}
matrix_f32 matrix_of(const mat_view& m) { return {static_cast<float*>(m.data), m.ld}; }
stack_f32 stack_of(const head_view& v) {
  return {static_cast<float*>(v.data), v.token_stride, v.head_stride};
}
// A contiguous (hv, dk, cols) stack in the workspace.
stack_f32 stack_at(float* data, std::int64_t dk, std::int64_t cols) { return {data, dk * cols, cols}; }

// The problem's fields of every stage.
stage_params problem(const head_view& q, const head_view& k, std::int64_t hv, std::int64_t dv, const mat_view& g,
                     const mat_view& beta, const gated_delta_options& o) {
  stage_params p;
  p.s = q.tokens;
  p.hk = q.heads;
  p.hv = hv;
  p.dk = q.dim;
  p.dv = dv;
  p.scale = o.scale != 0.0f ? o.scale : 1.0f / std::sqrt(static_cast<float>(q.dim));
  p.eps = o.l2_eps;
  p.l2 = o.norm == qk_norm::l2;
  p.q = tensor_of(q);
  p.k = tensor_of(k);
  p.g = matrix_of(g);
  p.beta = matrix_of(beta);
  return p;
}

// The workspace's pass buffers into p, and the pass's chunks.
struct passes {
  gated_delta_workspace_layout layout;
  float* base;
  std::vector<std::int64_t> resets;  // rows of the segment where the state resets

  float* at(std::int64_t offset) const { return offset < 0 ? nullptr : base + offset; }
  void bind(stage_params& p) const {
    p.w = at(layout.w);
    p.u = at(layout.u);
    p.decay = at(layout.decay);
    p.segment = at(layout.segment);
    p.states = at(layout.states);
    p.d_delta = at(layout.d_delta);
    p.d_state_end = at(layout.d_state_end);
    p.d_q_heads = at(layout.d_q_heads);
    p.d_k_heads = at(layout.d_k_heads);
  }
  void select(stage_params& p, std::int64_t pass) const {
    p.pass_first = pass * layout.pass_chunks;
    p.pass_chunks = std::min(layout.pass_chunks, layout.chunks - p.pass_first);
  }
};

passes plan(const stage_params& p, const mat_view& workspace, const sequence_documents& documents,
            gated_delta_pass kind) {
  const gated_delta_shape shape{p.s, p.hk, p.hv, p.dk, p.dv};
  const std::int64_t per_pass = gated_delta_chunks_per_pass(shape, kind, workspace.cols);
  passes out{gated_delta_workspace_layout(shape, kind, per_pass), static_cast<float*>(workspace.data), {}};
  for (const std::int64_t start : documents.starts)
    if (start >= documents.first && start < documents.first + p.s) out.resets.push_back(start - documents.first);
  return out;
}

// prepare over the pass's chunks, in launches that carry at most max_resets document starts.
void prepare_pass(stage_params p, const passes& ps, stage_executor& exec) {
  std::int64_t local = 0;
  while (local < p.pass_chunks) {
    p.sub_first = local;
    p.resets = 0;
    std::int64_t end = local;
    while (end < p.pass_chunks) {
      const std::int64_t lo = chunk_first_row(p, end), hi = lo + chunk;
      const auto first = std::lower_bound(ps.resets.begin(), ps.resets.end(), lo);
      const auto last = std::lower_bound(ps.resets.begin(), ps.resets.end(), hi);
      if (p.resets + (last - first) > max_resets) break;
      for (auto it = first; it != last; ++it) p.reset_rows[p.resets++] = *it;
      ++end;
    }
    p.sub_chunks = end - local;
    exec.launch(stage::prepare, p.sub_chunks, p.hv, p);
    local = end;
  }
}

std::int64_t slices(std::int64_t cols) { return (cols + state_slice - 1) / state_slice; }

// The sequential pass over the pass's chunks for `cols` state columns.
void state_pass_of(stage_params p, std::int64_t cols, const float* values, float* delta_out, float* states_out,
                   state_start start, stack_f32 start_state, stack_f32 carry_out, stage_executor& exec) {
  p.cols = cols;
  p.values = values;
  p.delta_out = delta_out;
  p.states_out = states_out;
  p.start = start;
  p.start_state = start_state;
  p.carry_out = carry_out;
  exec.launch(stage::state_pass, p.hv, slices(cols), p);
}

}  // namespace

void chunked_forward(const gated_delta_forward_args& a, stage_executor& exec) {
  stage_params p = problem(a.q, a.k, a.v.heads, a.v.dim, a.g, a.beta, a.options);
  p.v = tensor_of(a.v);
  p.out = tensor_of(a.out);
  const passes ps = plan(p, a.workspace, a.documents, gated_delta_pass::forward);
  ps.bind(p);
  const stack_f32 carry = stack_at(ps.at(ps.layout.carry), p.dk, p.dv);
  for (std::int64_t pass = 0; pass < ps.layout.passes; ++pass) {
    ps.select(p, pass);
    prepare_pass(p, ps, exec);
    const bool last = pass + 1 == ps.layout.passes;
    const stack_f32 initial = stack_of(a.initial_state);
    const state_start start = pass > 0 ? state_start::given : initial.empty() ? state_start::zero : state_start::given;
    state_pass_of(p, p.dv, p.u, p.u, p.states, start, pass > 0 ? carry : initial,
                  last ? stack_of(a.final_state) : carry, exec);
    exec.launch(stage::output, p.pass_chunks, p.hv, p);
  }
}

void chunked_summary(const gated_delta_summary_args& a, stage_executor& exec) {
  stage_params p = problem(a.q, a.k, a.v.heads, a.v.dim, a.g, a.beta, a.options);
  p.v = tensor_of(a.v);
  const passes ps = plan(p, a.workspace, a.documents, gated_delta_pass::summary);
  ps.bind(p);
  const stack_f32 carry = stack_at(ps.at(ps.layout.carry), p.dk, p.dv);
  const stack_f32 transition = stack_at(ps.at(ps.layout.transition), p.dk, p.dk);
  for (std::int64_t pass = 0; pass < ps.layout.passes; ++pass) {
    ps.select(p, pass);
    prepare_pass(p, ps, exec);
    const bool last = pass + 1 == ps.layout.passes;
    state_pass_of(p, p.dv, p.u, nullptr, nullptr, pass > 0 ? state_start::given : state_start::zero, carry,
                  last ? stack_of(a.local_state) : carry, exec);
    state_pass_of(p, p.dk, nullptr, nullptr, nullptr, pass > 0 ? state_start::given : state_start::identity,
                  transition, last ? stack_of(a.transition) : transition, exec);
  }
}

void chunked_summary_backward(const gated_delta_summary_backward_args& a, stage_executor& exec) {
  stage_params p = problem(a.q, a.k, a.d_out.heads, a.d_out.dim, a.g, a.beta, a.options);
  p.d_out = tensor_of(a.d_out);
  const passes ps = plan(p, a.workspace, a.documents, gated_delta_pass::summary_backward);
  ps.bind(p);
  const stack_f32 d_carry = stack_at(ps.at(ps.layout.d_carry), p.dk, p.dv);
  for (std::int64_t pass = ps.layout.passes - 1; pass >= 0; --pass) {
    ps.select(p, pass);
    prepare_pass(p, ps, exec);
    exec.launch(stage::intra_backward, p.pass_chunks, p.hv, p);
    p.start = pass + 1 < ps.layout.passes ? state_start::given : state_start::zero;
    p.start_state = d_carry;
    p.carry_out = pass == 0 ? stack_of(a.local_d_initial) : d_carry;
    exec.launch(stage::reverse_pass, p.hv, slices(p.dv), p);
  }
}

void chunked_backward(const gated_delta_backward_args& a, stage_executor& exec) {
  stage_params p = problem(a.q, a.k, a.v.heads, a.v.dim, a.g, a.beta, a.options);
  p.v = tensor_of(a.v);
  p.d_out = tensor_of(a.d_out);
  p.d_q = tensor_of(a.d_q);
  p.d_k = tensor_of(a.d_k);
  p.d_v = tensor_of(a.d_v);
  p.d_g = matrix_of(a.d_g);
  p.d_beta = matrix_of(a.d_beta);
  const passes ps = plan(p, a.workspace, a.documents, gated_delta_pass::backward);
  ps.bind(p);
  const std::int64_t state = p.hv * p.dk * p.dv;
  const auto boundary = [&](std::int64_t pass) {
    return stack_at(ps.at(ps.layout.boundaries) + pass * state, p.dk, p.dv);
  };
  const stack_f32 initial = stack_of(a.initial_state);
  const auto entering = [&](std::int64_t pass) { return pass > 0 ? boundary(pass) : initial; };
  const auto start_of = [&](std::int64_t pass) {
    return pass > 0 || !initial.empty() ? state_start::given : state_start::zero;
  };
  // The state entering each pass, from the first.
  for (std::int64_t pass = 0; pass + 1 < ps.layout.passes; ++pass) {
    ps.select(p, pass);
    prepare_pass(p, ps, exec);
    state_pass_of(p, p.dv, p.u, nullptr, nullptr, start_of(pass), entering(pass), boundary(pass + 1), exec);
  }
  const stack_f32 d_carry = stack_at(ps.at(ps.layout.d_carry), p.dk, p.dv), d_final = stack_of(a.d_final_state);
  for (std::int64_t pass = ps.layout.passes - 1; pass >= 0; --pass) {
    ps.select(p, pass);
    prepare_pass(p, ps, exec);
    state_pass_of(p, p.dv, p.u, p.u, p.states, start_of(pass), entering(pass), {}, exec);
    exec.launch(stage::intra_backward, p.pass_chunks, p.hv, p);
    const bool last = pass + 1 == ps.layout.passes;
    stage_params r = p;
    r.start = !last || !d_final.empty() ? state_start::given : state_start::zero;
    r.start_state = last ? d_final : d_carry;
    r.carry_out = pass == 0 ? stack_of(a.d_initial_state) : d_carry;
    exec.launch(stage::reverse_pass, p.hv, slices(p.dv), r);
    exec.launch(stage::wy_backward, p.pass_chunks, p.hv, p);
    exec.launch(stage::output_backward, p.pass_chunks, p.hv, p);
    exec.launch(stage::qk_backward, p.pass_chunks * chunk, p.hk, p);
  }
}

}  // namespace upipe::gated_delta
