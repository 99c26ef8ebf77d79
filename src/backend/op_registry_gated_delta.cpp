// The registry's Gated DeltaNet entries: the gated delta rule forward and backward, the
// context-parallel summaries and their scan, the causal conv and the gates. Test shapes
// carry grouped heads (H_v = 2 H_k), lengths that are not multiples of the chunk, document
// starts inside a chunk, at a chunk's first row and at the segment's first row, and passes
// of one chunk and of several; perf shapes are Qwen3-Next-80B's (H_k 16, H_v 32, d 128).
#include <cmath>
#include <string>
#include <vector>

#include "backend/op_cases.hpp"
#include "backend/ops.hpp"
#include "ops/gated_delta/workspace.hpp"

namespace upipe::op_cases {

namespace {

struct gdr_shape {
  std::int64_t s, hk, hv, dk, dv;
  bool initial;                     // an initial state (and d_final_state in backward)
  std::vector<std::int64_t> starts; // global document starts
  std::int64_t first;               // the segment's first row
  std::int64_t pass_chunks;         // the workspace holds passes of this many chunks
  float g_lo;                       // g uniform in [g_lo, g_lo / 20): decays from strong to near 1
  float scale = 0;                  // q's scale (0: d_k^-0.5)
  qk_norm norm = qk_norm::l2;
};

std::string gdr_text(const gdr_shape& g) {
  std::string text = dims_text({{"s", g.s}, {"hk", g.hk}, {"hv", g.hv}, {"dk", g.dk}, {"dv", g.dv}});
  if (g.initial) text += " initial";
  if (g.starts.size() > 1) {
    text += " documents ";
    text += std::to_string(g.starts.size());
    text += " from ";
    text += std::to_string(g.first);
  }
  text += " pass ";
  text += std::to_string(g.pass_chunks);
  if (g.norm == qk_norm::none) text += " no-l2";
  if (g.scale != 0) text += " scaled";
  return text;
}

gated_delta_shape shape_of(const gdr_shape& g) { return {g.s, g.hk, g.hv, g.dk, g.dv}; }

case_tensor workspace_tensor(const gdr_shape& g, gated_delta_pass pass) {
  return {.name = "workspace", .type = case_dtype::f32,
          .dims = {1, gated_delta_workspace_floats(shape_of(g), pass, g.pass_chunks)}};
}

// The inputs (q, k, v, g, beta, and the initial state where the shape has one).
std::vector<case_tensor> gdr_inputs(const gdr_shape& g, bool with_v) {
  // Unnormalized keys short enough that beta |k|^2 < 1 keeps the recurrence contracting.
  const float qk = g.norm == qk_norm::l2 ? 1.0f : 0.3f;
  std::vector<case_tensor> t = {{.name = "q", .dims = {g.s, g.hk, g.dk}, .lo = -qk, .hi = qk},
                                {.name = "k", .dims = {g.s, g.hk, g.dk}, .lo = -qk, .hi = qk}};
  if (with_v) t.push_back({.name = "v", .dims = {g.s, g.hv, g.dv}});
  t.push_back({.name = "g", .type = case_dtype::f32, .dims = {g.s, g.hv}, .lo = g.g_lo, .hi = g.g_lo / 20});
  t.push_back({.name = "beta", .type = case_dtype::f32, .dims = {g.s, g.hv}, .lo = 0.05f, .hi = 1.0f});
  if (g.initial) t.push_back({.name = "initial_state", .type = case_dtype::f32, .dims = {g.hv, g.dk, g.dv}});
  return t;
}

head_view state_view(const case_tensors& t, const char* name, bool present) {
  return present ? t[name].heads() : head_view{};
}

f64::gated_delta_case f64_case(const gdr_shape& g) {
  return {g.s, g.hk, g.hv, g.dk, g.dv, g.initial, g.starts, g.first, g.scale, g.norm == qk_norm::l2};
}

gated_delta_options options_of(const gdr_shape& g) {
  gated_delta_options o;
  o.scale = g.scale;
  o.norm = g.norm;
  return o;
}

void gdr_forward(backend& be, const case_tensors& t, const gdr_shape& g) {
  ops::gated_delta_forward(be, {t["q"].heads(), t["k"].heads(), t["v"].heads(), t["g"].matrix(), t["beta"].matrix(),
                                state_view(t, "initial_state", g.initial), t["out"].heads(),
                                t["final_state"].heads(), {g.starts, g.first}, options_of(g), t["workspace"].matrix()});
}

double gdr_flops(const gdr_shape& g, gated_delta_pass pass) { return gated_delta_flops(shape_of(g), pass); }

op_case gdr_forward_case(const gdr_shape& g) {
  op_case c;
  c.size = gdr_text(g);
  c.tensors = gdr_inputs(g, true);
  c.tensors.push_back(out({.name = "out", .dims = {g.s, g.hv, g.dv}}));
  // f32 on both sides from the same bf16 inputs; sums of d_k-long products in another
  // order over every chunk of the sequence.
  c.tensors.push_back(out({.name = "final_state", .type = case_dtype::f32, .dims = {g.hv, g.dk, g.dv}}, bf16_tol, 1e-4));
  c.tensors.push_back(workspace_tensor(g, gated_delta_pass::forward));
  c.run = [g](backend& be, const case_tensors& t) { gdr_forward(be, t, g); };
  c.float64 = [g](f64::host_case& h) { f64::gated_delta_forward(h, f64_case(g)); };
  c.flops = gdr_flops(g, gated_delta_pass::forward);
  return c;
}

op_case gdr_backward_case(const gdr_shape& g) {
  op_case c;
  c.size = gdr_text(g);
  c.tensors = gdr_inputs(g, true);
  c.tensors.push_back({.name = "out", .dims = {g.s, g.hv, g.dv}});
  c.tensors.push_back({.name = "final_state", .type = case_dtype::f32, .dims = {g.hv, g.dk, g.dv}});
  c.tensors.push_back({.name = "d_out", .dims = {g.s, g.hv, g.dv}});
  if (g.initial) c.tensors.push_back({.name = "d_final_state", .type = case_dtype::f32, .dims = {g.hv, g.dk, g.dv}});
  c.tensors.push_back(out({.name = "d_q", .dims = {g.s, g.hk, g.dk}}, bf16_tol, 1e-4));
  c.tensors.push_back(out({.name = "d_k", .dims = {g.s, g.hk, g.dk}}, bf16_tol, 1e-4));
  c.tensors.push_back(out({.name = "d_v", .dims = {g.s, g.hv, g.dv}}, bf16_tol, 1e-4));
  c.tensors.push_back(out({.name = "d_g", .type = case_dtype::f32, .dims = {g.s, g.hv}}, bf16_tol, 1e-4));
  c.tensors.push_back(out({.name = "d_beta", .type = case_dtype::f32, .dims = {g.s, g.hv}}, bf16_tol, 1e-4));
  if (g.initial)
    c.tensors.push_back(
        out({.name = "d_initial_state", .type = case_dtype::f32, .dims = {g.hv, g.dk, g.dv}}, bf16_tol, 1e-4));
  c.tensors.push_back(workspace_tensor(g, gated_delta_pass::backward));
  c.run = [g](backend& be, const case_tensors& t) {
    ops::gated_delta_backward(
        be, {t["q"].heads(), t["k"].heads(), t["v"].heads(), t["g"].matrix(), t["beta"].matrix(),
             state_view(t, "initial_state", g.initial), t["d_out"].heads(), state_view(t, "d_final_state", g.initial),
             t["d_q"].heads(), t["d_k"].heads(), t["d_v"].heads(), t["d_g"].matrix(), t["d_beta"].matrix(),
             state_view(t, "d_initial_state", g.initial), {g.starts, g.first}, options_of(g), t["workspace"].matrix()});
  };
  c.objective = [g](backend& be, const case_tensors& t) {
    gdr_forward(be, t, g);
    return host_dot(be, t["out"], t["d_out"]) + (g.initial ? host_dot(be, t["final_state"], t["d_final_state"]) : 0.0);
  };
  c.gradients = {{"q", "d_q"}, {"k", "d_k"}, {"v", "d_v"}, {"g", "d_g"}, {"beta", "d_beta"}};
  if (g.initial) c.gradients.push_back({"initial_state", "d_initial_state"});
  c.float64 = [g](f64::host_case& h) { f64::gated_delta_backward(h, f64_case(g)); };
  c.flops = gdr_flops(g, gated_delta_pass::backward);
  return c;
}

op_case gdr_summary_case(const gdr_shape& g) {
  op_case c;
  c.size = gdr_text(g);
  c.tensors = gdr_inputs(g, true);
  c.tensors.push_back(out({.name = "transition", .type = case_dtype::f32, .dims = {g.hv, g.dk, g.dk}}, bf16_tol, 1e-4));
  c.tensors.push_back(out({.name = "local_state", .type = case_dtype::f32, .dims = {g.hv, g.dk, g.dv}}, bf16_tol, 1e-4));
  c.tensors.push_back(workspace_tensor(g, gated_delta_pass::summary));
  c.run = [g](backend& be, const case_tensors& t) {
    ops::gated_delta_summary(be, {t["q"].heads(), t["k"].heads(), t["v"].heads(), t["g"].matrix(), t["beta"].matrix(),
                                  t["transition"].heads(), t["local_state"].heads(), {g.starts, g.first},
                                  options_of(g), t["workspace"].matrix()});
  };
  c.float64 = [g](f64::host_case& h) { f64::gated_delta_summary(h, f64_case(g)); };
  c.flops = gdr_flops(g, gated_delta_pass::summary);
  return c;
}

op_case gdr_summary_backward_case(const gdr_shape& g) {
  op_case c;
  c.size = gdr_text(g);
  c.tensors = gdr_inputs(g, false);
  c.tensors.push_back({.name = "d_out", .dims = {g.s, g.hv, g.dv}});
  c.tensors.push_back(
      out({.name = "local_d_initial", .type = case_dtype::f32, .dims = {g.hv, g.dk, g.dv}}, bf16_tol, 1e-4));
  c.tensors.push_back(workspace_tensor(g, gated_delta_pass::summary_backward));
  c.run = [g](backend& be, const case_tensors& t) {
    ops::gated_delta_summary_backward(be, {t["q"].heads(), t["k"].heads(), t["g"].matrix(), t["beta"].matrix(),
                                           t["d_out"].heads(), t["local_d_initial"].heads(), {g.starts, g.first},
                                           options_of(g), t["workspace"].matrix()});
  };
  c.float64 = [g](f64::host_case& h) { f64::gated_delta_summary_backward(h, f64_case(g)); };
  c.flops = gdr_flops(g, gated_delta_pass::summary_backward);
  return c;
}

// Grouped heads with documents (inside a chunk, at a chunk's first row) from a segment in
// the middle of the sequence, in passes of 1 chunk; no groups, no documents, one pass of
// every chunk; a document starting at the segment's first row, which drops the initial
// state; long memory (decays near 1) over several chunks.
std::vector<gdr_shape> gdr_test_shapes() {
  return {{150, 2, 4, 16, 24, true, {0, 140, 164, 229}, 100, 1, -1.0f},
          {133, 2, 2, 24, 16, false, {}, 0, 3, -0.5f},
          {70, 1, 3, 8, 8, true, {0, 37, 300, 333}, 300, 2, -1.0f},
          {140, 1, 2, 16, 16, true, {}, 0, 2, -0.05f},
          {90, 2, 2, 8, 8, false, {0, 50}, 0, 1, -0.5f, 0.3f, qk_norm::none}};
}

// Qwen3-Next-80B's linear layers: 16 key heads, 32 value heads of 128.
gdr_shape gdr_perf_shape(std::int64_t tokens) { return {tokens, 16, 32, 128, 128, false, {}, 0, 64, -1.0f}; }

template <class Make>
op_entry gdr_entry(const char* name, Make make) {
  return {name,
          [make] {
            std::vector<op_case> cases;
            for (const gdr_shape& g : gdr_test_shapes()) cases.push_back(make(g));
            return cases;
          },
          [make](std::int64_t tokens, dtype) { return make(gdr_perf_shape(tokens)); }};
}

// R segments' summaries combined, forward and backward.
op_case gdr_scan_case(std::int64_t segments, std::int64_t heads, std::int64_t dk, std::int64_t dv, bool backward) {
  op_case c;
  c.size = dims_text({{"segments", segments}, {"heads", heads}, {"dk", dk}, {"dv", dv}}) +
           (backward ? " backward" : " forward");
  // Transitions of norm below 1, as the products of decays and (I - beta k k^T) are.
  c.tensors = {{.name = "transitions", .type = case_dtype::f32, .dims = {segments * heads, dk, dk}, .lo = -0.1f,
                .hi = 0.1f},
               {.name = "locals", .type = case_dtype::f32, .dims = {segments * heads, dk, dv}},
               out({.name = "states", .type = case_dtype::f32, .dims = {segments * heads, dk, dv}}, bf16_tol, 1e-5)};
  c.run = [=](backend& be, const case_tensors& t) {
    ops::gated_delta_scan(be, {t["transitions"].heads(), t["locals"].heads(), t["states"].heads(), heads,
                               backward ? scan_direction::backward : scan_direction::forward});
  };
  c.float64 = [=](f64::host_case& h) { f64::gated_delta_scan(h, segments, heads, dk, dv, backward); };
  c.flops = 2.0 * static_cast<double>(segments * heads * dk * dk * dv);
  return c;
}

op_entry gdr_scan_entry() {
  return {"gated_delta_scan",
          [] {
            return std::vector<op_case>{gdr_scan_case(4, 3, 16, 24, false), gdr_scan_case(4, 3, 16, 24, true),
                                        gdr_scan_case(1, 2, 8, 8, false)};
          },
          [](std::int64_t, dtype) { return gdr_scan_case(8, 32, 128, 128, false); }};
}


// ---------------------------------------------------------------------------------------
// The causal conv (then SiLU) and the gates

struct conv_shape {
  std::int64_t rows, channels, taps;
  bool halo;
  std::vector<std::int64_t> starts;
  std::int64_t first;
};

std::string conv_text(const conv_shape& c) {
  std::string text = dims_text({{"rows", c.rows}, {"channels", c.channels}, {"taps", c.taps}});
  if (c.halo) text += " halo";
  if (c.starts.size() > 1) {
    text += " documents ";
    text += std::to_string(c.starts.size());
    text += " from ";
    text += std::to_string(c.first);
  }
  return text;
}

std::vector<case_tensor> conv_inputs(const conv_shape& c) {
  std::vector<case_tensor> t = {{.name = "x", .dims = {c.rows, c.channels}, .lo = -2, .hi = 2},
                                {.name = "weight", .dims = {c.channels, c.taps}}};
  if (c.halo) t.push_back({.name = "halo", .dims = {c.taps - 1, c.channels}, .lo = -2, .hi = 2});
  return t;
}

mat_view halo_view(const case_tensors& t, const conv_shape& c) { return c.halo ? t["halo"].matrix() : mat_view{}; }

f64::causal_conv_case f64_conv(const conv_shape& c) { return {c.rows, c.channels, c.taps, c.halo, c.starts, c.first}; }

void conv_forward(backend& be, const case_tensors& t, const conv_shape& c) {
  ops::causal_conv_forward(be, {t["x"].matrix(), halo_view(t, c), t["weight"].matrix(), t["y"].matrix(),
                                {c.starts, c.first}});
}

op_case conv_forward_case(const conv_shape& c) {
  op_case k;
  k.size = conv_text(c);
  k.tensors = conv_inputs(c);
  k.tensors.push_back(out({.name = "y", .dims = {c.rows, c.channels}}));
  k.run = [c](backend& be, const case_tensors& t) { conv_forward(be, t, c); };
  k.float64 = [c](f64::host_case& h) { f64::causal_conv_forward(h, f64_conv(c)); };
  k.bytes = 4.0 * static_cast<double>(c.rows * c.channels);
  return k;
}

op_case conv_backward_case(const conv_shape& c) {
  op_case k;
  k.size = conv_text(c);
  k.tensors = conv_inputs(c);
  k.tensors.push_back({.name = "y", .dims = {c.rows, c.channels}});
  k.tensors.push_back({.name = "d_y", .dims = {c.rows, c.channels}});
  k.tensors.push_back(out({.name = "d_x", .dims = {c.rows, c.channels}}));
  if (c.halo) k.tensors.push_back(out({.name = "d_halo", .dims = {c.taps - 1, c.channels}}));
  // Accumulated onto its values; rows summed in another order on another backend.
  k.tensors.push_back(out({.name = "d_weight", .type = case_dtype::f32, .dims = {c.channels, c.taps}}, bf16_tol, 1e-5));
  k.run = [c](backend& be, const case_tensors& t) {
    ops::causal_conv_backward(be, {t["x"].matrix(), halo_view(t, c), t["weight"].matrix(), t["d_y"].matrix(),
                                   t["d_x"].matrix(), c.halo ? t["d_halo"].matrix() : mat_view{},
                                   t["d_weight"].matrix(), {c.starts, c.first}});
  };
  k.objective = [c](backend& be, const case_tensors& t) {
    conv_forward(be, t, c);
    return host_dot(be, t["y"], t["d_y"]);
  };
  k.gradients = {{"x", "d_x"}, {"weight", "d_weight"}};
  if (c.halo) k.gradients.push_back({"halo", "d_halo"});
  k.float64 = [c](f64::host_case& h) { f64::causal_conv_backward(h, f64_conv(c)); };
  k.bytes = 8.0 * static_cast<double>(c.rows * c.channels);
  return k;
}

// A halo and documents (one at row 1, one at row 0 which drops the halo), taps 4 as every
// config has and 2; Qwen3-Next-80B's mixed channels (2 x 16 x 128 + 32 x 128) for perf.
std::vector<conv_shape> conv_test_shapes() {
  return {{37, 24, 4, true, {0, 101, 120}, 100},
          {20, 9, 4, true, {0, 50}, 50},
          {33, 16, 2, false, {}, 0},
          {40, 12, 4, false, {0, 3, 4, 30}, 0}};
}

template <class Make>
op_entry conv_entry(const char* name, Make make) {
  return {name,
          [make] {
            std::vector<op_case> cases;
            for (const conv_shape& c : conv_test_shapes()) cases.push_back(make(c));
            return cases;
          },
          [make](std::int64_t tokens, dtype) { return make(conv_shape{tokens, 8192, 4, true, {}, 0}); }};
}

void gates_forward(backend& be, const case_tensors& t) {
  ops::gated_delta_gates_forward(be, {t["a"].matrix(), t["b"].matrix(), t["a_log"].matrix(), t["dt_bias"].matrix(),
                                      t["g"].matrix(), t["beta"].matrix()});
}

// a spans softplus's threshold (20) so both of its branches run.
std::vector<case_tensor> gate_inputs(std::int64_t rows, std::int64_t heads) {
  return {{.name = "a", .dims = {rows, heads}, .lo = -4, .hi = 24},
          {.name = "b", .dims = {rows, heads}, .lo = -4, .hi = 4},
          {.name = "a_log", .dims = {1, heads}, .lo = -1, .hi = 2},
          {.name = "dt_bias", .dims = {1, heads}, .lo = -1, .hi = 1}};
}

op_case gates_forward_case(std::int64_t rows, std::int64_t heads) {
  op_case c;
  c.size = dims_text({{"rows", rows}, {"heads", heads}});
  c.tensors = gate_inputs(rows, heads);
  c.tensors.push_back(out({.name = "g", .type = case_dtype::f32, .dims = {rows, heads}}, 1e-5, 1e-5));
  c.tensors.push_back(out({.name = "beta", .type = case_dtype::f32, .dims = {rows, heads}}, 1e-5, 1e-5));
  c.run = [](backend& be, const case_tensors& t) { gates_forward(be, t); };
  c.float64 = [=](f64::host_case& h) { f64::gated_delta_gates_forward(h, rows, heads); };
  c.bytes = 12.0 * static_cast<double>(rows * heads);
  return c;
}

op_case gates_backward_case(std::int64_t rows, std::int64_t heads) {
  op_case c;
  c.size = dims_text({{"rows", rows}, {"heads", heads}});
  c.tensors = gate_inputs(rows, heads);
  for (const char* name : {"g", "beta", "d_g", "d_beta"})
    c.tensors.push_back({.name = name, .type = case_dtype::f32, .dims = {rows, heads}});
  c.tensors.push_back(out({.name = "d_a", .dims = {rows, heads}}));
  c.tensors.push_back(out({.name = "d_b", .dims = {rows, heads}}));
  c.tensors.push_back(out({.name = "d_a_log", .type = case_dtype::f32, .dims = {1, heads}}, bf16_tol, 1e-5));
  c.tensors.push_back(out({.name = "d_dt_bias", .type = case_dtype::f32, .dims = {1, heads}}, bf16_tol, 1e-5));
  c.run = [](backend& be, const case_tensors& t) {
    ops::gated_delta_gates_backward(be, {t["a"].matrix(), t["b"].matrix(), t["a_log"].matrix(), t["dt_bias"].matrix(),
                                         t["d_g"].matrix(), t["d_beta"].matrix(), t["d_a"].matrix(), t["d_b"].matrix(),
                                         t["d_a_log"].matrix(), t["d_dt_bias"].matrix()});
  };
  c.objective = [](backend& be, const case_tensors& t) {
    gates_forward(be, t);
    return host_dot(be, t["g"], t["d_g"]) + host_dot(be, t["beta"], t["d_beta"]);
  };
  c.gradients = {{"a", "d_a"}, {"b", "d_b"}, {"a_log", "d_a_log"}, {"dt_bias", "d_dt_bias"}};
  c.float64 = [=](f64::host_case& h) { f64::gated_delta_gates_backward(h, rows, heads); };
  c.bytes = 20.0 * static_cast<double>(rows * heads);
  return c;
}

template <class Make>
op_entry gates_entry(const char* name, Make make) {
  return {name, [make] { return std::vector<op_case>{make(37, 6), make(5, 48)}; },
          [make](std::int64_t tokens, dtype) { return make(tokens, 32); }};
}

}  // namespace

std::vector<op_case> gated_delta_model_cases() {
  // Qwen3.5-27B's linear layers (16 key heads, 48 value heads of 128) with documents, a
  // segment from row 50 with an initial state; Qwen3-Next-80B's (32 value heads) in passes
  // of one chunk. f32 outputs on both sides from the same bf16 inputs, apart only by the
  // order of fp32 sums (and the GPU's fused multiply-adds) through every chunk: 1e-3.
  const std::vector<gdr_shape> shapes = {{200, 16, 48, 128, 128, true, {0, 90, 114, 181}, 50, 2, -0.3f},
                                         {130, 16, 32, 128, 128, false, {}, 0, 1, -0.05f}};
  std::vector<op_case> cases;
  for (const gdr_shape& g : shapes)
    for (op_case (*make)(const gdr_shape&) :
         {gdr_forward_case, gdr_backward_case, gdr_summary_case, gdr_summary_backward_case}) {
      op_case c = make(g);
      for (case_tensor& t : c.tensors)
        if (t.bf16_tolerance > 0 && t.type == case_dtype::f32) t.f32_tolerance = 1e-3;
      cases.push_back(std::move(c));
    }
  return cases;
}

std::vector<op_entry> gated_delta_op_entries() {
  return {gdr_entry("gated_delta_forward", gdr_forward_case),
          gdr_entry("gated_delta_backward", gdr_backward_case),
          gdr_entry("gated_delta_summary", gdr_summary_case),
          gdr_entry("gated_delta_summary_backward", gdr_summary_backward_case),
          gdr_scan_entry(),
          conv_entry("causal_conv_forward", conv_forward_case),
          conv_entry("causal_conv_backward", conv_backward_case),
          gates_entry("gated_delta_gates_forward", gates_forward_case),
          gates_entry("gated_delta_gates_backward", gates_backward_case)};
}

}  // namespace upipe::op_cases
