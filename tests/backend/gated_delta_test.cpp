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
#include <cstring>
#include <map>
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

// Through the op entry, or (exec given) straight to the chunked driver on that executor.
forward_result run_forward(backend& be, const gdr_data& d, std::int64_t r0, std::int64_t r1,
                           const std::vector<float>* initial, std::int64_t pass_chunks,
                           gated_delta::stage_executor* exec = nullptr) {
  segment sg{be, r1 - r0, r0, d, {}};
  gated_delta_forward_args a{sg.heads(d.hk, d.dk, d.q, "q"), sg.heads(d.hk, d.dk, d.k, "k"),
                             sg.heads(d.hv, d.dv, d.v, "v"), sg.matrix(d.hv, d.g, "g"), sg.matrix(d.hv, d.beta, "beta"),
                             initial != nullptr ? sg.state(d.dv, initial, "initial") : head_view{},
                             sg.make({sg.rows, d.hv, d.dv}, nullptr, "out").heads(),
                             sg.state(d.dv, nullptr, "final"), sg.documents(), {},
                             sg.workspace(gated_delta_pass::forward, pass_chunks)};
  if (exec != nullptr)
    gated_delta::chunked_forward(a, *exec);
  else
    ops::gated_delta_forward(be, a);
  return {sg.read(a.out), sg.read(a.final_state)};
}

struct backward_result {
  std::vector<float> d_q, d_k, d_v, d_g, d_beta, d_initial;
};

backward_result run_backward(backend& be, const gdr_data& d, std::int64_t r0, std::int64_t r1,
                             const std::vector<float>* initial, const std::vector<float>* d_final,
                             std::int64_t pass_chunks, gated_delta::stage_executor* exec = nullptr) {
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
  if (exec != nullptr)
    gated_delta::chunked_backward(a, *exec);
  else
    ops::gated_delta_backward(be, a);
  return {sg.read(a.d_q), sg.read(a.d_k), sg.read(a.d_v), sg.read(a.d_g), sg.read(a.d_beta), sg.read(a.d_initial_state)};
}

// Segment [r0, r1)'s summary: transition (hv, dk, dk) and local state (hv, dk, dv).
std::pair<std::vector<float>, std::vector<float>> run_summary(backend& be, const gdr_data& d, std::int64_t r0,
                                                              std::int64_t r1,
                                                              gated_delta::stage_executor* exec = nullptr) {
  segment sg{be, r1 - r0, r0, d, {}};
  gated_delta_summary_args a{sg.heads(d.hk, d.dk, d.q, "q"), sg.heads(d.hk, d.dk, d.k, "k"),
                             sg.heads(d.hv, d.dv, d.v, "v"), sg.matrix(d.hv, d.g, "g"), sg.matrix(d.hv, d.beta, "beta"),
                             sg.state(d.dk, nullptr, "transition"), sg.state(d.dv, nullptr, "local"), sg.documents(), {},
                             sg.workspace(gated_delta_pass::summary, 2)};
  if (exec != nullptr)
    gated_delta::chunked_summary(a, *exec);
  else
    ops::gated_delta_summary(be, a);
  return {sg.read(a.transition), sg.read(a.local_state)};
}

std::vector<float> run_summary_backward(backend& be, const gdr_data& d, std::int64_t r0, std::int64_t r1,
                                        gated_delta::stage_executor* exec = nullptr) {
  segment sg{be, r1 - r0, r0, d, {}};
  gated_delta_summary_backward_args a{sg.heads(d.hk, d.dk, d.q, "q"), sg.heads(d.hk, d.dk, d.k, "k"),
                                      sg.matrix(d.hv, d.g, "g"), sg.matrix(d.hv, d.beta, "beta"),
                                      sg.heads(d.hv, d.dv, d.d_out, "d_out"), sg.state(d.dv, nullptr, "local_d"),
                                      sg.documents(), {}, sg.workspace(gated_delta_pass::summary_backward, 2)};
  if (exec != nullptr)
    gated_delta::chunked_summary_backward(a, *exec);
  else
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

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](float x, float y) {
           return std::memcmp(&x, &y, sizeof(float)) == 0;
         });
}

void expect_same_bits(const backward_result& a, const backward_result& b) {
  EXPECT_TRUE(same_bits(a.d_q, b.d_q));
  EXPECT_TRUE(same_bits(a.d_k, b.d_k));
  EXPECT_TRUE(same_bits(a.d_v, b.d_v));
  EXPECT_TRUE(same_bits(a.d_g, b.d_g));
  EXPECT_TRUE(same_bits(a.d_beta, b.d_beta));
  EXPECT_TRUE(same_bits(a.d_initial, b.d_initial));
}

// Every phase's indices in reverse give the same bits: no index reads what another of its
// phase writes, so the GPU's threads, in whatever order they run, compute the host's values.
TEST(gated_delta_chunks, phases_run_in_reverse_give_the_same_bits) {
  auto be = op_test::make_test_backend();
  const gdr_data d = make_data(150, 2, 4, 16, 24, {0, 40, 64, 129}, 9);
  const std::vector<float> initial(static_cast<std::size_t>(d.hv * d.dk * d.dv), 0.25f), d_final = initial;
  gated_delta::host_executor forward_order(false), reverse_order(true);
  const forward_result f1 = run_forward(*be, d, 10, d.s, &initial, 1, &forward_order);
  const forward_result f2 = run_forward(*be, d, 10, d.s, &initial, 1, &reverse_order);
  EXPECT_TRUE(same_bits(f1.out, f2.out));
  EXPECT_TRUE(same_bits(f1.final_state, f2.final_state));
  expect_same_bits(run_backward(*be, d, 10, d.s, &initial, &d_final, 1, &forward_order),
                   run_backward(*be, d, 10, d.s, &initial, &d_final, 1, &reverse_order));
  const auto s1 = run_summary(*be, d, 10, d.s, &forward_order), s2 = run_summary(*be, d, 10, d.s, &reverse_order);
  EXPECT_TRUE(same_bits(s1.first, s2.first));
  EXPECT_TRUE(same_bits(s1.second, s2.second));
  EXPECT_TRUE(same_bits(run_summary_backward(*be, d, 10, d.s, &forward_order),
                        run_summary_backward(*be, d, 10, d.s, &reverse_order)));
}

// A pass holds one chunk, three, or all of them: the same bits (the state crosses passes
// through the workspace exactly).
TEST(gated_delta_chunks, the_pass_length_changes_no_bit) {
  auto be = op_test::make_test_backend();
  const gdr_data d = make_data(333, 1, 2, 8, 16, {0, 100, 190}, 3);
  const std::vector<float> d_final(static_cast<std::size_t>(d.hv * d.dk * d.dv), 0.5f);
  const forward_result one = run_forward(*be, d, 0, d.s, nullptr, 1);
  const backward_result one_back = run_backward(*be, d, 0, d.s, nullptr, &d_final, 1);
  for (const std::int64_t pass : {3, 6}) {
    const forward_result other = run_forward(*be, d, 0, d.s, nullptr, pass);
    EXPECT_TRUE(same_bits(one.out, other.out)) << pass;
    EXPECT_TRUE(same_bits(one.final_state, other.final_state)) << pass;
    expect_same_bits(one_back, run_backward(*be, d, 0, d.s, nullptr, &d_final, pass));
  }
}

// The same context-parallel math in float64 (backend/op_float64.hpp's recurrence): the
// split agrees with the whole to rounding.
f64::host_case f64_segment(const gdr_data& d, std::int64_t r0, std::int64_t r1) {
  const auto doubles = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  f64::host_case t;
  t["q"] = doubles(rows_of(d.q, d.hk * d.dk, r0, r1));
  t["k"] = doubles(rows_of(d.k, d.hk * d.dk, r0, r1));
  t["v"] = doubles(rows_of(d.v, d.hv * d.dv, r0, r1));
  t["g"] = doubles(rows_of(d.g, d.hv, r0, r1));
  t["beta"] = doubles(rows_of(d.beta, d.hv, r0, r1));
  t["d_out"] = doubles(rows_of(d.d_out, d.hv * d.dv, r0, r1));
  const std::int64_t rows = r1 - r0, state = d.hv * d.dk * d.dv;
  for (const char* name : {"out", "d_v"}) t[name].assign(static_cast<std::size_t>(rows * d.hv * d.dv), 0.0);
  for (const char* name : {"d_q", "d_k"}) t[name].assign(static_cast<std::size_t>(rows * d.hk * d.dk), 0.0);
  for (const char* name : {"d_g", "d_beta"}) t[name].assign(static_cast<std::size_t>(rows * d.hv), 0.0);
  for (const char* name : {"final_state", "local_state", "local_d_initial", "d_initial_state"})
    t[name].assign(static_cast<std::size_t>(state), 0.0);
  t["transition"].assign(static_cast<std::size_t>(d.hv * d.dk * d.dk), 0.0);
  return t;
}

double rel_error64(const std::vector<double>& got, const std::vector<double>& want) {
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    err = op_test::worse(err, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return scale > 0 ? err / scale : err;
}

class gated_delta_cp_float64 : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(gated_delta_cp_float64, segments_give_the_whole_to_rounding) {
  const gdr_data d = cp_data();
  const std::int64_t segments = GetParam(), state = d.hv * d.dk * d.dv, square = d.hv * d.dk * d.dk;
  const f64::gated_delta_case whole_case{d.s, d.hk, d.hv, d.dk, d.dv, false, d.starts, 0};
  f64::host_case whole = f64_segment(d, 0, d.s);
  f64::gated_delta_forward(whole, whole_case);
  f64::gated_delta_backward(whole, whole_case);
  const std::vector<std::int64_t> edges = segment_edges(d.s, segments);
  std::vector<f64::host_case> parts;
  f64::host_case scan_forward, scan_backward;
  for (std::int64_t r = 0; r < segments; ++r) {
    parts.push_back(f64_segment(d, edges[r], edges[r + 1]));
    const f64::gated_delta_case c{edges[r + 1] - edges[r], d.hk, d.hv, d.dk, d.dv, true, d.starts, edges[r]};
    f64::gated_delta_summary(parts.back(), c);
    f64::gated_delta_summary_backward(parts.back(), c);
    for (f64::host_case* scan : {&scan_forward, &scan_backward}) {
      auto& m = (*scan)["transitions"];
      m.insert(m.end(), parts.back()["transition"].begin(), parts.back()["transition"].end());
    }
    auto& locals = scan_forward["locals"];
    locals.insert(locals.end(), parts.back()["local_state"].begin(), parts.back()["local_state"].end());
    auto& locals_d = scan_backward["locals"];
    locals_d.insert(locals_d.end(), parts.back()["local_d_initial"].begin(), parts.back()["local_d_initial"].end());
  }
  ASSERT_EQ(scan_forward["transitions"].size(), static_cast<std::size_t>(segments * square));
  for (f64::host_case* scan : {&scan_forward, &scan_backward})
    (*scan)["states"].assign(static_cast<std::size_t>(segments * state), 0.0);
  f64::gated_delta_scan(scan_forward, segments, d.hv, d.dk, d.dv, false);
  f64::gated_delta_scan(scan_backward, segments, d.hv, d.dk, d.dv, true);
  std::map<std::string, std::vector<double>> split;
  for (std::int64_t r = 0; r < segments; ++r) {
    f64::host_case& t = parts[r];
    const auto at = [&](f64::host_case& scan) {
      return std::vector<double>(scan["states"].begin() + r * state, scan["states"].begin() + (r + 1) * state);
    };
    t["initial_state"] = at(scan_forward);
    t["d_final_state"] = at(scan_backward);
    const f64::gated_delta_case c{edges[r + 1] - edges[r], d.hk, d.hv, d.dk, d.dv, true, d.starts, edges[r]};
    f64::gated_delta_forward(t, c);
    f64::gated_delta_backward(t, c);
    for (const char* name : {"out", "d_q", "d_k", "d_v", "d_g", "d_beta"})
      split[name].insert(split[name].end(), t[name].begin(), t[name].end());
  }
  for (const char* name : {"out", "d_q", "d_k", "d_v", "d_g", "d_beta"})
    EXPECT_LT(rel_error64(split[name], whole[name]), 1e-12) << name;
  EXPECT_LT(rel_error64(parts.back()["final_state"], whole["final_state"]), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(segments, gated_delta_cp_float64, ::testing::Values(2, 4, 8));

// The causal conv split as the ranks hold it: each segment with the K - 1 rows before it as
// its halo gives the whole's outputs; its d_halo, added to the rows it came from, and the
// segments' d_weight summed, give the whole's gradients.
struct conv_run {
  std::vector<float> y, d_x, d_halo, d_weight;
};

conv_run run_conv(backend& be, const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& d_y,
                  std::int64_t channels, std::int64_t taps, std::int64_t r0, std::int64_t r1,
                  const std::vector<std::int64_t>& starts) {
  const gdr_data none{};
  segment sg{be, r1 - r0, r0, none, {}};
  const std::int64_t halo_rows = std::min(r0, taps - 1);
  const std::vector<float> xs = rows_of(x, channels, r0, r1), dys = rows_of(d_y, channels, r0, r1);
  const std::vector<float> halo = rows_of(x, channels, r0 - halo_rows, r0);
  const mat_view xv = sg.make({sg.rows, channels}, &xs, "x").matrix();
  const mat_view hv = halo_rows > 0 ? sg.make({halo_rows, channels}, &halo, "halo").matrix() : mat_view{};
  const mat_view wv = sg.make({channels, taps}, &w, "weight").matrix();
  const mat_view yv = sg.make({sg.rows, channels}, nullptr, "y").matrix();
  const mat_view dyv = sg.make({sg.rows, channels}, &dys, "d_y").matrix();
  const mat_view dxv = sg.make({sg.rows, channels}, nullptr, "d_x").matrix();
  const mat_view dhv = halo_rows > 0 ? sg.make({halo_rows, channels}, nullptr, "d_halo").matrix() : mat_view{};
  const mat_view dwv = sg.make({channels, taps}, nullptr, "d_weight").matrix();
  const sequence_documents documents{starts, r0};
  ops::causal_conv_forward(be, {xv, hv, wv, yv, documents});
  ops::causal_conv_backward(be, {xv, hv, wv, dyv, dxv, dhv, dwv, documents});
  return {sg.read(yv), sg.read(dxv), halo_rows > 0 ? sg.read(dhv) : std::vector<float>{}, sg.read(dwv)};
}

class causal_conv_cp : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(causal_conv_cp, segments_with_halos_give_the_whole) {
  auto be = op_test::make_test_backend();
  const std::int64_t rows = 50, channels = 6, taps = 4, segments = GetParam();
  const std::vector<std::int64_t> starts = {0, 13, 25, 40};  // 25: the 2-way segment edge
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<float> x(rows * channels), w(channels * taps), d_y(x.size());
  for (auto* v : {&x, &w, &d_y})
    for (float& e : *v) e = dist(rng);
  const conv_run whole = run_conv(*be, x, w, d_y, channels, taps, 0, rows, starts);
  std::vector<float> y, d_x(x.size(), 0.0f), d_w(w.size(), 0.0f);
  const std::vector<std::int64_t> edges = segment_edges(rows, segments);
  for (std::int64_t r = 0; r < segments; ++r) {
    const conv_run part = run_conv(*be, x, w, d_y, channels, taps, edges[r], edges[r + 1], starts);
    append(y, part.y);
    for (std::size_t i = 0; i < part.d_x.size(); ++i) d_x[edges[r] * channels + i] += part.d_x[i];
    const std::int64_t halo_first = edges[r] - static_cast<std::int64_t>(part.d_halo.size()) / channels;
    for (std::size_t i = 0; i < part.d_halo.size(); ++i) d_x[halo_first * channels + i] += part.d_halo[i];
    for (std::size_t i = 0; i < d_w.size(); ++i) d_w[i] += part.d_weight[i];
  }
  EXPECT_LT(rel_error(y, whole.y), 1e-6);
  EXPECT_LT(rel_error(d_x, whole.d_x), 1e-6);
  EXPECT_LT(rel_error(d_w, whole.d_weight), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(segments, causal_conv_cp, ::testing::Values(2, 4, 8));

// The workspace's size and the passes it allows agree, for every op; a pass of all the
// chunks is the most, and a workspace too small for any pass allows none.
TEST(gated_delta_workspace, sizes_and_pass_lengths_agree) {
  const gated_delta_shape shape{1000, 2, 6, 32, 48};
  const std::int64_t chunks = gated_delta_chunks(shape.tokens);
  EXPECT_EQ(chunks, 16);
  for (const gated_delta_pass pass : {gated_delta_pass::forward, gated_delta_pass::backward, gated_delta_pass::summary,
                                      gated_delta_pass::summary_backward}) {
    for (const std::int64_t p : {std::int64_t{1}, std::int64_t{5}, chunks}) {
      const std::int64_t floats = gated_delta_workspace_floats(shape, pass, p);
      EXPECT_GE(gated_delta_chunks_per_pass(shape, pass, floats), p);
      EXPECT_GT(floats, 0);
    }
    EXPECT_EQ(gated_delta_chunks_per_pass(shape, pass, 1 << 30), chunks);
    EXPECT_EQ(gated_delta_chunks_per_pass(shape, pass, 100), 0);
    EXPECT_GT(gated_delta_flops(shape, pass), 0.0);
  }
  // The backward's pass buffers grow with the pass and its boundary states shrink.
  EXPECT_GT(gated_delta_workspace_floats(shape, gated_delta_pass::backward, chunks),
            gated_delta_workspace_floats(shape, gated_delta_pass::forward, chunks));
}

// Bad arguments: the entry names the value and the rule.
TEST(gated_delta_entries, refuse_a_chunk_size_a_head_ratio_and_a_workspace_that_do_not_fit) {
  auto be = op_test::make_test_backend();
  const gdr_data d = make_data(70, 2, 3, 8, 8, {}, 1);
  segment sg{*be, d.s, 0, d, {}};
  gated_delta_forward_args a{sg.heads(d.hk, d.dk, d.q, "q"), sg.heads(d.hk, d.dk, d.k, "k"),
                             sg.heads(d.hv, d.dv, d.v, "v"), sg.matrix(d.hv, d.g, "g"), sg.matrix(d.hv, d.beta, "beta"),
                             head_view{}, sg.make({d.s, d.hv, d.dv}, nullptr, "out").heads(), head_view{},
                             sg.documents(), {}, sg.workspace(gated_delta_pass::forward, 1)};
  const auto message = [&](const gated_delta_forward_args& args) {
    try {
      ops::gated_delta_forward(*be, args);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(a).find("key heads must divide the value heads (3)"), std::string::npos) << message(a);
  const gdr_data ok = make_data(70, 1, 2, 8, 8, {}, 1);
  segment good{*be, ok.s, 0, ok, {}};
  gated_delta_forward_args b{good.heads(1, 8, ok.q, "q"), good.heads(1, 8, ok.k, "k"), good.heads(2, 8, ok.v, "v"),
                             good.matrix(2, ok.g, "g"), good.matrix(2, ok.beta, "beta"), head_view{},
                             good.make({ok.s, 2, 8}, nullptr, "out").heads(), head_view{}, good.documents(), {},
                             good.workspace(gated_delta_pass::forward, 1)};
  EXPECT_EQ(message(b), "");
  gated_delta_forward_args chunked = b;
  chunked.options.chunk_size = 32;
  EXPECT_NE(message(chunked).find("chunk_size 32 is not supported"), std::string::npos) << message(chunked);
  gated_delta_forward_args small = b;
  small.workspace.cols = 10;
  EXPECT_NE(message(small).find("workspace"), std::string::npos) << message(small);
}

}  // namespace
}  // namespace upipe
