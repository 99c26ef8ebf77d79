// `bench-kernels --gdn`: the gated delta rule of a Gated DeltaNet layer beside the fused
// attention of its model's full-attention layer (bench/kernel_bench.hpp).
#include <algorithm>
#include <string>
#include <vector>

#include "backend/op_harness.hpp"
#include "backend/ops.hpp"
#include "bench/kernel_bench.hpp"
#include "core/random.hpp"
#include "ops/gated_delta/workspace.hpp"

namespace upipe {

namespace {

// linear_num_key_heads, linear_num_value_heads, linear_key_head_dim; num_attention_heads,
// num_key_value_heads, head_dim, as the models' config.json files give them.
constexpr gdn_bench_model gdn_models[] = {{"qwen3.5-27b", 16, 48, 128, 24, 4, 256},
                                          {"qwen3-next-80b", 16, 32, 128, 16, 2, 256}};

tensor normal(backend& be, dtype type, const shape& dims, std::uint64_t stream, float scale, const char* label) {
  tensor t = be.allocate(mem_tag::activations, type, dims, label);
  std::vector<float> values(static_cast<std::size_t>(t.numel()));
  fill_normal(values, 20261207, stream, scale);
  be.upload_f32(t, values.data());
  return t;
}

// Every element `value`.
tensor constant(backend& be, const shape& dims, float value, const char* label) {
  tensor t = be.allocate(mem_tag::activations, dtype::f32, dims, label);
  ops::fill_heads(be, ops::as_heads(t.matrix()), value);
  return t;
}

gdn_timing time_gated_delta(backend& be, std::int64_t s, const gdn_bench_model& m, int repeats,
                            double workspace_gib) {
  const dtype w = be.work_dtype();
  const std::int64_t hk = m.k_heads, hv = m.v_heads, d = m.head_dim;
  tensor q = normal(be, w, {s, hk, d}, 1, 1.0f, "gdn_q"), k = normal(be, w, {s, hk, d}, 2, 1.0f, "gdn_k");
  tensor v = normal(be, w, {s, hv, d}, 3, 1.0f, "gdn_v"), d_out = normal(be, w, {s, hv, d}, 4, 1.0f, "gdn_d_out");
  // A decay near Qwen3-Next's at initialization (exp(g) about 0.97) and beta 0.5.
  tensor g = constant(be, {s, hv}, -0.03f, "gdn_g"), beta = constant(be, {s, hv}, 0.5f, "gdn_beta");
  tensor out = be.allocate(mem_tag::activations, w, {s, hv, d}, "gdn_out");
  tensor d_q = be.allocate(mem_tag::activations, w, {s, hk, d}, "gdn_d_q");
  tensor d_k = be.allocate(mem_tag::activations, w, {s, hk, d}, "gdn_d_k");
  tensor d_v = be.allocate(mem_tag::activations, w, {s, hv, d}, "gdn_d_v");
  tensor d_g = be.allocate(mem_tag::activations, dtype::f32, {s, hv}, "gdn_d_g");
  tensor d_beta = be.allocate(mem_tag::activations, dtype::f32, {s, hv}, "gdn_d_beta");
  const gated_delta_shape shape{s, hk, hv, d, d};
  const auto budget = static_cast<std::int64_t>(workspace_gib * (1 << 30) / sizeof(float));
  const std::int64_t pass_chunks = std::max<std::int64_t>(
      1, std::min(gated_delta_chunks_per_pass(shape, gated_delta_pass::forward, budget),
                  gated_delta_chunks_per_pass(shape, gated_delta_pass::backward, budget)));
  const std::int64_t floats = std::max(gated_delta_workspace_floats(shape, gated_delta_pass::forward, pass_chunks),
                                       gated_delta_workspace_floats(shape, gated_delta_pass::backward, pass_chunks));
  tensor workspace = be.allocate(mem_tag::workspace, dtype::f32, {1, floats}, "gdn_workspace");
  const gated_delta_forward_args fwd{q.heads(), k.heads(), v.heads(), g.matrix(), beta.matrix(), {}, out.heads(), {},
                                     {}, {}, workspace.matrix()};
  const gated_delta_backward_args bwd{q.heads(), k.heads(), v.heads(), g.matrix(), beta.matrix(), {},
                                      d_out.heads(), {}, d_q.heads(), d_k.heads(), d_v.heads(), d_g.matrix(),
                                      d_beta.matrix(), {}, {}, {}, workspace.matrix()};
  gdn_timing t;
  t.tokens = s;
  t.pass_chunks = pass_chunks;
  t.forward_ms = time_mean_ms(be, repeats, [&] { ops::gated_delta_forward(be, fwd); });
  t.backward_ms = time_mean_ms(be, repeats, [&] { ops::gated_delta_backward(be, bwd); });
  const double flops =
      gated_delta_flops(shape, gated_delta_pass::forward) + gated_delta_flops(shape, gated_delta_pass::backward);
  t.tflops = flops / ((t.forward_ms + t.backward_ms) * 1e9);
  return t;
}

}  // namespace

const gdn_bench_model* find_gdn_bench_model(const std::string& name) {
  for (const gdn_bench_model& m : gdn_models)
    if (name == m.name) return &m;
  return nullptr;
}

std::string gdn_bench_model_names() {
  std::string names;
  for (const gdn_bench_model& m : gdn_models) {
    if (!names.empty()) names += ", ";
    names += m.name;
  }
  return names;
}

std::vector<gdn_timing> run_gdn_bench(backend& be, const std::vector<std::int64_t>& lengths,
                                      const gdn_bench_model& model, int repeats, double workspace_gib) {
  std::vector<gdn_timing> rows;
  for (const std::int64_t s : lengths) {
    gdn_timing t = time_gated_delta(be, s, model, repeats, workspace_gib);  // its tensors freed before attention's
    const attention_ms a = time_causal_attention(be, s, model.attn_heads, model.attn_kv_heads, model.attn_dim,
                                                 attention_dtype::bf16, repeats);
    t.attn_forward_ms = a.forward;
    t.attn_backward_ms = a.backward;
    t.attn_tflops = 3.5 * causal_forward_flops(s, model.attn_heads, model.attn_dim) / ((a.forward + a.backward) * 1e9);
    rows.push_back(t);
  }
  return rows;
}

}  // namespace upipe
