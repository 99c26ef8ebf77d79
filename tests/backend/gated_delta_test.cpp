// The gated delta rule's chunked form on the cpu backend against its definition and
// under context parallelism: a sequence split into 2, 4 and 8 segments, each computed
// from a zero state and summarized (transition, local state), the summaries scanned, each
// segment run from the state entering it, gives the whole sequence's outputs, final state
// and every gradient, with packed documents inside segments and at their edges (fp32 on
// the cpu backend, and the same math in float64). The stages' phases run in reverse give
// the same bits (no index of a phase reads what another writes).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "backend/op_float64.hpp"
#include "backend/ops.hpp"
#include "ops/gated_delta/host_executor.hpp"
#include "ops/gated_delta/workspace.hpp"
#include "op_test_support.hpp"

namespace upipe {
namespace {

struct gdr_data {
  std::int64_t s, hk, hv, dk, dv;
  std::vector<float> q, k, v, g, beta, d_out;
  std::vector<std::int64_t> starts;
};

gdr_data make_data(std::int64_t s, std::int64_t hk, std::int64_t hv, std::int64_t dk, std::int64_t dv,
                   std::vector<std::int64_t> starts, unsigned seed) {
  gdr_data d{s, hk, hv, dk, dv, {}, {}, {}, {}, {}, {}, std::move(starts)};
  std::mt19937 rng(seed);
  const auto fill = [&](std::vector<float>& x, std::int64_t n, float lo, float hi) {
    std::uniform_real_distribution<float> dist(lo, hi);
    x.resize(static_cast<std::size_t>(n));
    for (float& e : x) e = dist(rng);
  };
  fill(d.q, s * hk * dk, -1, 1);
  fill(d.k, s * hk * dk, -1, 1);
  fill(d.v, s * hv * dv, -1, 1);
  fill(d.g, s * hv, -0.6f, -0.01f);
  fill(d.beta, s * hv, 0.05f, 1.0f);
  fill(d.d_out, s * hv * dv, -1, 1);
  return d;
}

// Rows [r0, r1) of a (s, width) array.
std::vector<float> rows_of(const std::vector<float>& x, std::int64_t width, std::int64_t r0, std::int64_t r1) {
  return {x.begin() + r0 * width, x.begin() + r1 * width};
}

double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    err = op_test::worse(err, std::abs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  if (got.size() != want.size()) return 1e30;
  return scale > 0 ? err / scale : err;
}

// One segment's tensors on the cpu backend.
struct segment {
  backend& be;
  std::int64_t rows, first;
  const gdr_data& d;
  std::vector<tensor> held;

  tensor& make(const shape& dims, const std::vector<float>* values, const char* label) {
    held.push_back(be.allocate_zeroed(mem_tag::activations, dtype::f32, dims, label));
    if (values != nullptr) be.upload_f32(held.back(), values->data());
    return held.back();
  }
  head_view heads(std::int64_t heads, std::int64_t dim, const std::vector<float>& all, const char* label) {
    const std::vector<float> part = rows_of(all, heads * dim, first, first + rows);
    return make({rows, heads, dim}, &part, label).heads();
  }
  mat_view matrix(std::int64_t cols, const std::vector<float>& all, const char* label) {
    const std::vector<float> part = rows_of(all, cols, first, first + rows);
    return make({rows, cols}, &part, label).matrix();
  }
  head_view state(std::int64_t cols, const std::vector<float>* values, const char* label) {
    return make({d.hv, d.dk, cols}, values, label).heads();
  }
  mat_view workspace(gated_delta_pass pass, std::int64_t pass_chunks) {
    const gated_delta_shape shape{rows, d.hk, d.hv, d.dk, d.dv};
    return make({1, gated_delta_workspace_floats(shape, pass, pass_chunks)}, nullptr, "workspace").matrix();
  }
  sequence_documents documents() const { return {d.starts, first}; }
  std::vector<float> read(const head_view& v) {
    std::vector<float> out(static_cast<std::size_t>(v.tokens * v.heads * v.dim));
    std::copy_n(static_cast<const float*>(v.data), out.size(), out.begin());
    return out;
  }
  std::vector<float> read(const mat_view& m) {
    std::vector<float> out(static_cast<std::size_t>(m.rows * m.cols));
    std::copy_n(static_cast<const float*>(m.data), out.size(), out.begin());
    return out;
  }
};

struct forward_result {
  std::vector<float> out, final_state;
};

forward_result run_forward(backend& be, const gdr_data& d, std::int64_t r0, std::int64_t r1,
                           const std::vector<float>* initial, std::int64_t pass_chunks) {
  segment sg{be, r1 - r0, r0, d, {}};
  gated_delta_forward_args a{sg.heads(d.hk, d.dk, d.q, "q"), sg.heads(d.hk, d.dk, d.k, "k"),
                             sg.heads(d.hv, d.dv, d.v, "v"), sg.matrix(d.hv, d.g, "g"), sg.matrix(d.hv, d.beta, "beta"),
                             initial != nullptr ? sg.state(d.dv, initial, "initial") : head_view{},
                             sg.make({sg.rows, d.hv, d.dv}, nullptr, "out").heads(),
                             sg.state(d.dv, nullptr, "final"), sg.documents(), {},
                             sg.workspace(gated_delta_pass::forward, pass_chunks)};
  ops::gated_delta_forward(be, a);
  return {sg.read(a.out), sg.read(a.final_state)};
}

struct backward_result {
  std::vector<float> d_q, d_k, d_v, d_g, d_beta, d_initial;
};

backward_result run_backward(backend& be, const gdr_data& d, std::int64_t r0, std::int64_t r1,
                             const std::vector<float>* initial, const std::vector<float>* d_final,
                             std::int64_t pass_chunks) {
  segment sg{be, r1 - r0, r0, d, {}};
  gated_delta_backward_args a{sg.heads(d.hk, d.dk, d.q, "q"), sg.heads(d.hk, d.dk, d.k, "k"),
                              sg.heads(d.hv, d.dv, d.v, "v"), sg.matrix(d.hv, d.g, "g"),
                              sg.matrix(d.hv, d.beta, "beta"),
                              initial != nullptr ? sg.state(d.dv, initial, "initial") : head_view{},
                              sg.heads(d.hv, d.dv, d.d_out, "d_out"),
                              d_final != nullptr ? sg.state(d.dv, d_final, "d_final") : head_view{},
                              sg.make({sg.rows, d.hk, d.dk}, nullptr, "d_q").heads(),
                              sg.make({sg.rows, d.hk, d.dk}, nullptr, "d_k").heads(),
                              sg.make({sg.rows, d.hv, d.dv}, nullptr, "d_v").heads(),
                              sg.make({sg.rows, d.hv}, nullptr, "d_g").matrix(),
                              sg.make({sg.rows, d.hv}, nullptr, "d_beta").matrix(),
                              sg.state(d.dv, nullptr, "d_initial"), sg.documents(), {},
                              sg.workspace(gated_delta_pass::backward, pass_chunks)};
  ops::gated_delta_backward(be, a);
  return {sg.read(a.d_q), sg.read(a.d_k), sg.read(a.d_v), sg.read(a.d_g), sg.read(a.d_beta), sg.read(a.d_initial_state)};
}

// Segment [r0, r1)'s summary: transition (hv, dk, dk) and local state (hv, dk, dv).
std::pair<std::vector<float>, std::vector<float>> run_summary(backend& be, const gdr_data& d, std::int64_t r0,
                                                              std::int64_t r1) {
  segment sg{be, r1 - r0, r0, d, {}};
  gated_delta_summary_args a{sg.heads(d.hk, d.dk, d.q, "q"), sg.heads(d.hk, d.dk, d.k, "k"),
                             sg.heads(d.hv, d.dv, d.v, "v"), sg.matrix(d.hv, d.g, "g"), sg.matrix(d.hv, d.beta, "beta"),
                             sg.state(d.dk, nullptr, "transition"), sg.state(d.dv, nullptr, "local"), sg.documents(), {},
                             sg.workspace(gated_delta_pass::summary, 2)};
  ops::gated_delta_summary(be, a);
  return {sg.read(a.transition), sg.read(a.local_state)};
}

std::vector<float> run_summary_backward(backend& be, const gdr_data& d, std::int64_t r0, std::int64_t r1) {
  segment sg{be, r1 - r0, r0, d, {}};
  gated_delta_summary_backward_args a{sg.heads(d.hk, d.dk, d.q, "q"), sg.heads(d.hk, d.dk, d.k, "k"),
                                      sg.matrix(d.hv, d.g, "g"), sg.matrix(d.hv, d.beta, "beta"),
                                      sg.heads(d.hv, d.dv, d.d_out, "d_out"), sg.state(d.dv, nullptr, "local_d"),
                                      sg.documents(), {}, sg.workspace(gated_delta_pass::summary_backward, 2)};
  ops::gated_delta_summary_backward(be, a);
  return sg.read(a.local_d_initial);
}

// The scan of R segments' summaries (each vector holds the segments one after another).
std::vector<float> run_scan(backend& be, const gdr_data& d, std::int64_t segments, const std::vector<float>& m,
                            const std::vector<float>& locals, scan_direction direction) {
  segment sg{be, 0, 0, d, {}};
  const head_view mt = sg.make({segments * d.hv, d.dk, d.dk}, &m, "transitions").heads();
  const head_view lt = sg.make({segments * d.hv, d.dk, d.dv}, &locals, "locals").heads();
  const head_view st = sg.make({segments * d.hv, d.dk, d.dv}, nullptr, "states").heads();
  ops::gated_delta_scan(be, {mt, lt, st, d.hv, direction});
  return sg.read(st);
}

std::vector<std::int64_t> segment_edges(std::int64_t s, std::int64_t segments) {
  std::vector<std::int64_t> edges;
  for (std::int64_t r = 0; r <= segments; ++r) edges.push_back(s * r / segments);
  return edges;
}

void append(std::vector<float>& to, const std::vector<float>& from) { to.insert(to.end(), from.begin(), from.end()); }

std::vector<float> part(const std::vector<float>& all, std::int64_t index, std::int64_t size) {
  return {all.begin() + index * size, all.begin() + (index + 1) * size};
}

// 300 rows, grouped heads, documents at row 23, at a chunk edge (64), at the 2-, 4- and
// 8-way segment edges 150 and 75 (and 225), inside a segment (201, 262).
gdr_data cp_data() { return make_data(300, 2, 4, 16, 12, {0, 23, 64, 75, 150, 201, 225, 262}, 5); }

class gated_delta_cp : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(gated_delta_cp, segments_give_the_whole_sequences_outputs_state_and_gradients) {
  auto be = op_test::make_test_backend();
  const gdr_data d = cp_data();
  const std::int64_t segments = GetParam(), state = d.hv * d.dk * d.dv;
  const forward_result whole = run_forward(*be, d, 0, d.s, nullptr, 2);
  const std::vector<float> d_final_none(static_cast<std::size_t>(state), 0.0f);
  const backward_result whole_back = run_backward(*be, d, 0, d.s, nullptr, &d_final_none, 2);
  const std::vector<std::int64_t> edges = segment_edges(d.s, segments);
  std::vector<float> transitions, locals, local_d;
  for (std::int64_t r = 0; r < segments; ++r) {
    const auto [m, local] = run_summary(*be, d, edges[r], edges[r + 1]);
    append(transitions, m);
    append(locals, local);
    append(local_d, run_summary_backward(*be, d, edges[r], edges[r + 1]));
  }
  const std::vector<float> entering = run_scan(*be, d, segments, transitions, locals, scan_direction::forward);
  const std::vector<float> d_finals = run_scan(*be, d, segments, transitions, local_d, scan_direction::backward);
  forward_result split;
  backward_result split_back;
  for (std::int64_t r = 0; r < segments; ++r) {
    const std::vector<float> initial = part(entering, r, state), d_final = part(d_finals, r, state);
    const forward_result f = run_forward(*be, d, edges[r], edges[r + 1], &initial, 1);
    append(split.out, f.out);
    split.final_state = f.final_state;
    const backward_result b = run_backward(*be, d, edges[r], edges[r + 1], &initial, &d_final, 1);
    for (auto [to, from] : {std::pair{&split_back.d_q, &b.d_q}, std::pair{&split_back.d_k, &b.d_k},
                            std::pair{&split_back.d_v, &b.d_v}, std::pair{&split_back.d_g, &b.d_g},
                            std::pair{&split_back.d_beta, &b.d_beta}})
      append(*to, *from);
    // The gradient a segment sends back is the one its predecessor received from the scan.
    if (r > 0) EXPECT_LT(rel_error(b.d_initial, part(d_finals, r - 1, state)), 1e-5) << "segment " << r;
  }
  EXPECT_LT(rel_error(split.out, whole.out), 1e-5);
  EXPECT_LT(rel_error(split.final_state, whole.final_state), 1e-5);
  EXPECT_LT(rel_error(split_back.d_q, whole_back.d_q), 1e-5);
  EXPECT_LT(rel_error(split_back.d_k, whole_back.d_k), 1e-5);
  EXPECT_LT(rel_error(split_back.d_v, whole_back.d_v), 1e-5);
  EXPECT_LT(rel_error(split_back.d_g, whole_back.d_g), 1e-5);
  EXPECT_LT(rel_error(split_back.d_beta, whole_back.d_beta), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(segments, gated_delta_cp, ::testing::Values(2, 4, 8));

}  // namespace
}  // namespace upipe
