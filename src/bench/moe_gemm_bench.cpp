#include "bench/moe_gemm_bench.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "backend/op_harness.hpp"
#include "backend/ops.hpp"
#include "core/random.hpp"

namespace upipe {

namespace {

// Standard normal values: a kernel over constants draws less power and would time faster.
tensor normal(backend& be, dtype type, const shape& dims, std::uint64_t stream, const char* label) {
  tensor t = be.allocate(mem_tag::activations, type, dims, label);
  std::vector<float> values(static_cast<std::size_t>(t.numel()));
  fill_normal(values, 20261207, stream, 1.0f);
  be.upload_f32(t, values.data());
  return t;
}

// Each token's k experts by Gumbel top-k over log (1 + e)^-skew: rows per expert.
std::vector<std::int64_t> routed_rows(const moe_gemm_shape& s, std::int64_t tokens, double skew) {
  std::vector<float> u(static_cast<std::size_t>(tokens * s.experts));
  fill_uniform(u, 20261207, 99, 1.0f);
  std::vector<std::int64_t> rows(static_cast<std::size_t>(s.experts), 0);
  std::vector<std::pair<double, std::int64_t>> score(static_cast<std::size_t>(s.experts));
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t e = 0; e < s.experts; ++e) {
      const double v = 0.5 * (u[static_cast<std::size_t>(t * s.experts + e)] + 1.0) * (1.0 - 1e-9) + 1e-12;
      score[static_cast<std::size_t>(e)] = {-skew * std::log1p(static_cast<double>(e)) - std::log(-std::log(v)), e};
    }
    std::partial_sort(score.begin(), score.begin() + s.top_k, score.end(), std::greater<>());
    for (std::int64_t j = 0; j < s.top_k; ++j) ++rows[static_cast<std::size_t>(score[static_cast<std::size_t>(j)].second)];
  }
  return rows;
}

struct form_spec {
  const char* name;
  grouped_form form;
  std::int64_t K, N;  // rows (m, K); out (m, N); the weight gradient's W is (K, N)
  dtype out;
};

}  // namespace

std::vector<moe_gemm_shape> moe_gemm_shapes() {
  return {{"qwen3-30b-a3b", 128, 8, 2048, 768}, {"mixtral-8x7b", 8, 2, 4096, 14336}};
}

std::vector<moe_gemm_timing> run_moe_gemm_bench(backend& be, const moe_gemm_shape& s, std::int64_t tokens,
                                                int repeats, double skew) {
  const std::vector<std::int64_t> counts = routed_rows(s, tokens, skew);
  std::vector<std::int32_t> offsets{0};
  for (std::int64_t c : counts) offsets.push_back(offsets.back() + static_cast<std::int32_t>(c));
  const std::int64_t m = offsets.back(), E = s.experts, D = s.hidden, I = s.width;
  tensor offsets_t = be.allocate(mem_tag::activations, dtype::i32, {1, E + 1}, "bench_offsets");
  be.upload_bytes(offsets_t, offsets.data(), offsets.size() * sizeof(std::int32_t));
  const dtype w = be.work_dtype();
  const form_spec forms[] = {{"gate/up", grouped_form::rows_by_weight_t, D, I, w},
                             {"down", grouped_form::rows_by_weight_t, I, D, w},
                             {"input grad", grouped_form::rows_by_weight, I, D, dtype::f32},
                             {"weight grad", grouped_form::weight_gradient, I, D, dtype::f32}};
  std::vector<moe_gemm_timing> out;
  for (const form_spec& f : forms) {
    const bool gradient = f.form == grouped_form::weight_gradient, t = f.form == grouped_form::rows_by_weight_t;
    tensor rows = normal(be, w, {m, f.K}, 1, "bench_rows");
    tensor other = gradient ? normal(be, w, {m, f.N}, 2, "bench_other") : tensor();
    // A group's matrix: (N, K) for rows W^T, (K, N) for rows W and the weight gradient.
    tensor weights = gradient ? normal(be, dtype::f32, {E * f.K, f.N}, 3, "bench_weight_grads")
                              : normal(be, w, {E * (t ? f.N : f.K), t ? f.K : f.N}, 3, "bench_weights");
    tensor result = gradient ? tensor() : be.allocate(mem_tag::activations, f.out, {m, f.N}, "bench_out");
    std::vector<mat_view> groups;
    const std::int64_t each = weights.matrix().rows / E;
    for (std::int64_t e = 0; e < E; ++e) groups.push_back(weights.matrix().row_block(e * each, each));
    const float beta = gradient ? 1.0f : 0.0f;
    const auto grouped = [&](grouped_engine engine) {
      return [&, engine] {
        ops::moe_grouped_gemm(be, {f.form, rows.matrix(), gradient ? other.matrix() : mat_view{}, groups,
                                   offsets_t.matrix(), gradient ? mat_view{} : result.matrix(), 1.0f, beta, engine});
      };
    };
    const auto loop = [&] {
      for (std::int64_t e = 0; e < E; ++e) {
        const std::int64_t first = offsets[static_cast<std::size_t>(e)], c = counts[static_cast<std::size_t>(e)];
        if (c == 0) continue;
        const mat_view block = rows.matrix().row_block(first, c);
        if (gradient)
          ops::gemm(be, {block, transpose::yes, other.matrix().row_block(first, c), transpose::none,
                         groups[static_cast<std::size_t>(e)], 1.0f, 1.0f});
        else
          ops::gemm(be, {block, transpose::none, groups[static_cast<std::size_t>(e)], t ? transpose::yes : transpose::none,
                         result.matrix().row_block(first, c)});
      }
    };
    // The dense GEMM of the same FLOPs: every routed row through one expert's matrix.
    const auto dense = [&] {
      if (gradient)
        ops::gemm(be, {rows.matrix(), transpose::yes, other.matrix(), transpose::none, groups[0], 1.0f, 1.0f});
      else
        ops::gemm(be, {rows.matrix(), transpose::none, groups[0], t ? transpose::yes : transpose::none, result.matrix()});
    };
    const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(f.K) * static_cast<double>(f.N);
    const std::pair<const char*, std::function<void()>> engines[] = {
        {"dense", dense}, {"loop", loop}, {"cutlass", grouped(grouped_engine::cutlass)},
        {"cublas", grouped(grouped_engine::cublas)}};
    double dense_tflops = 0;
    for (const auto& [engine, fn] : engines) {
      moe_gemm_timing r{s.name, f.name, engine, tokens, m,
                        *std::max_element(counts.begin(), counts.end()),
                        static_cast<std::int64_t>(std::count(counts.begin(), counts.end(), 0))};
      r.ms = time_mean_ms(be, repeats, fn);
      r.tflops = flops / (r.ms * 1e9);
      if (r.engine == "dense") dense_tflops = r.tflops;
      r.vs_dense = dense_tflops > 0 ? r.tflops / dense_tflops : 0;
      out.push_back(r);
    }
  }
  return out;
}

}  // namespace upipe
