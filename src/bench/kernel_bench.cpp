#include "bench/kernel_bench.hpp"

#include <cmath>
#include <functional>

#include "backend/op_harness.hpp"
#include "backend/ops.hpp"
#include "core/random.hpp"

namespace upipe {

namespace {

tensor filled(backend& be, dtype type, const shape& dims, float value, const char* label) {
  tensor t = be.allocate(mem_tag::activations, type, dims, label);
  ops::fill_heads(be, ops::as_heads(t.matrix()), value);
  return t;
}

// Standard normal values, as torch.randn gives the peer's attention inputs: a kernel over
// constants draws less power and would be timed faster than over real data.
tensor random_filled(backend& be, dtype type, const shape& dims, std::uint64_t stream, const char* label) {
  tensor t = be.allocate(mem_tag::activations, type, dims, label);
  std::vector<float> values(static_cast<std::size_t>(t.numel()));
  fill_normal(values, 20261201, stream, 1.0f);
  be.upload_f32(t, values.data());
  return t;
}

void bench_gemms(backend& be, const kernel_bench_options& o, std::vector<kernel_timing>& out) {
  const std::int64_t s = o.tokens, D = o.hidden, F = o.intermediate, kv = std::int64_t{o.kv_heads} * (D / o.heads);
  const dtype w = be.work_dtype();
  struct shape_case {
    const char* name;
    std::int64_t rows_out, inner;  // y (s, rows_out) = x (s, inner) W^T, W (rows_out, inner)
  };
  const shape_case cases[] = {{"gemm q_proj/o_proj", D, D}, {"gemm k_proj/v_proj", kv, D}, {"gemm gate_proj/up_proj", F, D},
                              {"gemm down_proj", D, F}};
  for (const shape_case& c : cases) {
    tensor x = filled(be, w, {s, c.inner}, 0.01f, "bench_x");
    tensor wt = filled(be, w, {c.rows_out, c.inner}, 0.01f, "bench_w");
    tensor y = be.allocate(mem_tag::activations, w, {s, c.rows_out}, "bench_y");
    const double ms = time_mean_ms(be, o.repeats, [&] {
      ops::gemm(be, {x.matrix(), transpose::none, wt.matrix(), transpose::yes, y.matrix()});
    });
    out.push_back({c.name, ms, 2.0 * s * c.rows_out * c.inner / (ms * 1e9), 0});
  }
}


void bench_attention(backend& be, const kernel_bench_options& o, std::vector<kernel_timing>& out) {
  const std::int64_t s = o.tokens;
  for (int d : {128, 64}) {
    const attention_ms ms = time_causal_attention(be, s, o.heads, o.kv_heads, d, attention_dtype::bf16, o.repeats);
    const double f_ms = ms.forward, b_ms = ms.backward, fwd_flops = causal_forward_flops(s, o.heads, d);
    const std::string tag = "sdpa d=" + std::to_string(d);
    out.push_back({tag + " forward", f_ms, fwd_flops / (f_ms * 1e9), 0});
    out.push_back({tag + " backward", b_ms, 2.5 * fwd_flops / (b_ms * 1e9), 0});
    out.push_back({tag + " forward+backward", f_ms + b_ms, 3.5 * fwd_flops / ((f_ms + b_ms) * 1e9), 0});
  }
}

void bench_memory_bound(backend& be, const kernel_bench_options& o, std::vector<kernel_timing>& out) {
  const std::int64_t s = o.tokens, D = o.hidden, F = o.intermediate, hd = D / o.heads;
  const dtype w = be.work_dtype();
  const double e = static_cast<double>(dtype_size(w));
  auto record = [&](const char* name, double bytes, const std::function<void()>& fn) {
    const double ms = time_mean_ms(be, o.repeats, fn);
    out.push_back({name, ms, 0, bytes / (ms * 1e6)});
  };
  tensor x = filled(be, w, {s, D}, 0.5f, "bench_x"), y = be.allocate(mem_tag::activations, w, {s, D}, "bench_y");
  tensor weight = filled(be, w, {1, D}, 1.0f, "bench_norm_w"), rstd = be.allocate(mem_tag::activations, dtype::f32, {s, 1}, "bench_rstd");
  record("copy (device to device)", 2.0 * s * D * e, [&] { be.copy_bytes(y.data(), x.data(), x.bytes()); });
  record("rmsnorm forward", 2.0 * s * D * e, [&] {
    ops::rmsnorm_forward(be, {x.matrix(), weight.matrix(), y.matrix(), rstd.matrix(), 1e-5f});
  });
  const std::vector<position_run> runs = {{0, 0, s}};
  const head_view xh = {x.data(), w, s, o.heads, hd, D, hd};
  record("rope (in place)", 2.0 * s * D * e, [&] { ops::rope(be, {xh, runs, rope_config{}, rope_direction::forward}); });
  const head_view yh = {y.data(), w, s, o.heads, hd, D, hd};
  record("pack heads (strided copy)", 1.0 * s * D * e, [&] { ops::copy_heads(be, yh.head_block(0, o.heads / 2), xh.head_block(o.heads / 2, o.heads / 2)); });
  tensor gate = filled(be, w, {s, F}, 0.5f, "bench_gate"), up = filled(be, w, {s, F}, 0.5f, "bench_up");
  tensor act = be.allocate(mem_tag::activations, w, {s, F}, "bench_act");
  record("swiglu forward", 3.0 * s * F * e, [&] { ops::swiglu_forward(be, {gate.matrix(), up.matrix(), act.matrix()}); });
  const std::int64_t n = std::max<std::int64_t>(1, (std::int64_t{256} << 20) / (4 * o.vocab));
  tensor logits = filled(be, dtype::f32, {n, o.vocab}, 0.1f, "bench_logits");
  tensor labels = be.allocate_zeroed(mem_tag::activations, dtype::i32, {n, 1}, "bench_labels");
  tensor loss = be.allocate(mem_tag::activations, dtype::f32, {n, 1}, "bench_loss");
  record("cross-entropy chunk (f32, in place)", 2.0 * n * o.vocab * 4, [&] {
    ops::cross_entropy(be, {logits.matrix(), labels.matrix(), loss.matrix(), 1.0f});
  });
}

}  // namespace

double causal_forward_flops(std::int64_t s, int heads, int d) {
  return 2.0 * static_cast<double>(s) * static_cast<double>(s) * heads * d;
}

// Causal fused attention forward and backward at s tokens, d, in `arithmetic`, on standard
// normal inputs.
attention_ms time_causal_attention(backend& be, std::int64_t s, int heads, int kv_heads, int d,
                                   attention_dtype arithmetic, int repeats) {
  const dtype w = be.work_dtype();
  tensor q = random_filled(be, w, {s, heads, d}, 1, "bench_q"), k = random_filled(be, w, {s, kv_heads, d}, 2, "bench_k");
  tensor v = random_filled(be, w, {s, kv_heads, d}, 3, "bench_v"), out_t = be.allocate(mem_tag::activations, w, {s, heads, d}, "bench_o");
  tensor lse = be.allocate(mem_tag::activations, dtype::f32, {s, heads, 1}, "bench_lse");
  tensor d_o = random_filled(be, w, {s, heads, d}, 4, "bench_do"), d_q = be.allocate(mem_tag::activations, w, q.dims(), "bench_dq");
  tensor d_k = be.allocate(mem_tag::activations, w, k.dims(), "bench_dk"), d_v = be.allocate(mem_tag::activations, w, v.dims(), "bench_dv");
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const sdpa_forward_args fwd{q.heads(), k.heads(), v.heads(), out_t.heads(), lse.heads(), attn_mask::causal, scale,
                              {}, 0, arithmetic};
  const sdpa_backward_args bwd{q.heads(), k.heads(), v.heads(), out_t.heads(), d_o.heads(), lse.heads(), d_q.heads(),
                               d_k.heads(), d_v.heads(), attn_mask::causal, scale, {}, 0, arithmetic};
  attention_ms ms;
  ms.forward = time_mean_ms(be, repeats, [&] { ops::sdpa_forward(be, fwd); });
  ms.backward = time_mean_ms(be, repeats, [&] { ops::sdpa_backward(be, bwd); });
  return ms;
}

std::vector<attention_dtype_timing> run_attention_dtype_bench(backend& be, const std::vector<std::int64_t>& lengths,
                                                              const kernel_bench_options& o) {
  std::vector<attention_dtype_timing> rows;
  constexpr int d = 128;
  for (const std::int64_t s : lengths)
    for (const attention_dtype arithmetic : {attention_dtype::bf16, attention_dtype::fp8}) {
      const attention_ms ms = time_causal_attention(be, s, o.heads, o.kv_heads, d, arithmetic, o.repeats);
      const double flops = 3.5 * causal_forward_flops(s, o.heads, d);
      rows.push_back({s, arithmetic, ms.forward, ms.backward, flops / ((ms.forward + ms.backward) * 1e9)});
    }
  return rows;
}

std::vector<kernel_timing> run_kernel_bench(backend& be, const kernel_bench_options& options) {
  std::vector<kernel_timing> out;
  bench_gemms(be, options, out);
  bench_attention(be, options, out);
  bench_memory_bound(be, options, out);
  return out;
}

}  // namespace upipe
