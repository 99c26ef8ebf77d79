// sdpa_forward and sdpa_backward on the cuda backend (cuDNN's fused attention) against the
// cpu backend on the same bf16-representable inputs: causal and unmasked, grouped-query
// heads, sequence lengths that are not multiples of 64, head blocks of wider buffers (as
// UPipe's stages pass them), a token-major and a head-major log-sum-exp, a repeated shape
// served from the plan cache with fresh buffers, and the config_error of a head dim cuDNN
// cannot run.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "ops/cpu/cpu_ops.hpp"
#include "ops/cuda/cuda_ops.hpp"
#include "ops/fp8_attention.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

constexpr double rel_tolerance = 2e-2;  // max|gpu - cpu| / max|cpu| for bf16 outputs
constexpr double lse_tolerance = 1e-2;  // absolute, on the fp32 log-sum-exp
// Written into every output buffer first: the spare heads around a view must keep it.
constexpr float sentinel = 3.0f;

memory_limits gpu_limits() { return {std::size_t{1} << 30, std::size_t{64} << 20}; }
memory_limits cpu_limits() { return {std::size_t{512} << 20, std::size_t{16} << 20}; }

struct attention_case {
  std::int64_t sq, skv, hq, hk, d;
  attn_mask mask;
  bool strided;          // head blocks of buffers with spare heads on both sides
  bool head_major_lse;   // lse stored (heads, tokens) rather than (tokens, heads)
  std::int64_t window = 0;                // a sliding window (0: none)
  std::int64_t q_first = 0, k_first = 0;  // the rows' global indices, which the window reads
  std::vector<std::int64_t> documents;    // packed documents' starts (empty: one)
  attention_dtype arithmetic = attention_dtype::bf16;
  bool backward = true;                   // the forward alone (FP8 past head dim 128) when false
};

// FP8 against the cpu backend's FP8 definition, which rounds what the kernels round (the
// inputs, P, dS, the outputs): each head's relative RMS error. An output may still land one
// FP8 step away where the two sides' fp32 sums straddle a rounding boundary (one E4M3 step is
// up to 1/8 of a value, one E5M2 step 1/4), so the largest single error is no measure; a
// head 30% off, or a wrong head, is.
constexpr double fp8_head_rms_tolerance = 2e-2;

std::string name_of(const attention_case& c) {
  return "sq " + std::to_string(c.sq) + " skv " + std::to_string(c.skv) + " hq " + std::to_string(c.hq) + " hk " +
         std::to_string(c.hk) + " d " + std::to_string(c.d) + (c.mask == attn_mask::causal ? " causal" : " unmasked") +
         (c.strided ? " strided" : " dense") + (c.head_major_lse ? " head-major lse" : " token-major lse") +
         (c.window > 0 ? " window " + std::to_string(c.window) + " q at " + std::to_string(c.q_first) + " k at " +
                             std::to_string(c.k_first)
                       : std::string()) +
         (c.documents.empty() ? std::string() : " " + std::to_string(c.documents.size()) + " documents") +
         (c.arithmetic == attention_dtype::fp8 ? " fp8" : "");
}

// A (tokens, heads, dim) view inside its buffer: heads [1, 1 + heads) of heads + 3 when
// strided, the whole buffer otherwise.
struct heads_buffer {
  tensor storage;
  head_view view;
};

heads_buffer make_heads(backend& be, dtype type, std::int64_t tokens, std::int64_t heads, std::int64_t dim,
                        bool strided, const char* label) {
  tensor t = be.allocate(mem_tag::activations, type, shape{tokens, heads + (strided ? 3 : 0), dim}, label);
  const head_view v = t.heads().head_block(strided ? 1 : 0, heads);
  return {std::move(t), v};
}

heads_buffer make_lse(backend& be, std::int64_t tokens, std::int64_t heads, bool head_major, const char* label) {
  if (!head_major) return make_heads(be, dtype::f32, tokens, heads, 1, false, label);
  tensor t = be.allocate(mem_tag::activations, dtype::f32, shape{heads, tokens}, label);
  const head_view v{t.data(), dtype::f32, tokens, heads, 1, 1, tokens};
  return {std::move(t), v};
}

// Host values of whole buffers, spare heads included, already rounded to bf16.
struct host_inputs {
  std::vector<float> q, k, v, d_out;
};

std::vector<float> random_values(std::int64_t count, std::mt19937& rng, float range) {
  std::uniform_real_distribution<float> dist(-range, range);
  std::vector<float> values(static_cast<std::size_t>(count));
  for (float& x : values) x = round_to_bf16(dist(rng));
  return values;
}

// Every buffer of one case on one backend.
struct attention_run {
  heads_buffer q, k, v, out, lse, d_out, d_q, d_k, d_v;
};

void upload_value(backend& be, const tensor& t, float value) {
  const std::vector<float> values(static_cast<std::size_t>(t.numel()), value);
  be.upload_f32(t, values.data());
}

attention_run make_run(backend& be, const attention_case& c, const host_inputs& in) {
  const dtype w = be.work_dtype();
  attention_run r{make_heads(be, w, c.sq, c.hq, c.d, c.strided, "q"),
                  make_heads(be, w, c.skv, c.hk, c.d, c.strided, "k"),
                  make_heads(be, w, c.skv, c.hk, c.d, c.strided, "v"),
                  make_heads(be, w, c.sq, c.hq, c.d, c.strided, "out"),
                  make_lse(be, c.sq, c.hq, c.head_major_lse, "lse"),
                  make_heads(be, w, c.sq, c.hq, c.d, c.strided, "d_out"),
                  make_heads(be, w, c.sq, c.hq, c.d, c.strided, "d_q"),
                  make_heads(be, w, c.skv, c.hk, c.d, c.strided, "d_k"),
                  make_heads(be, w, c.skv, c.hk, c.d, c.strided, "d_v")};
  be.upload_f32(r.q.storage, in.q.data());
  be.upload_f32(r.k.storage, in.k.data());
  be.upload_f32(r.v.storage, in.v.data());
  be.upload_f32(r.d_out.storage, in.d_out.data());
  for (const tensor* t : {&r.out.storage, &r.lse.storage, &r.d_q.storage, &r.d_k.storage, &r.d_v.storage})
    upload_value(be, *t, sentinel);
  return r;
}

host_inputs make_inputs(const attention_case& c, std::uint32_t seed) {
  std::mt19937 rng(seed);
  const std::int64_t spare = c.strided ? 3 : 0;
  host_inputs in;
  in.q = random_values(c.sq * (c.hq + spare) * c.d, rng, 1.5f);
  in.k = random_values(c.skv * (c.hk + spare) * c.d, rng, 1.5f);
  in.v = random_values(c.skv * (c.hk + spare) * c.d, rng, 1.0f);
  in.d_out = random_values(c.sq * (c.hq + spare) * c.d, rng, 1.0f);
  return in;
}

// Forward, then backward from this backend's own out and lse, as training runs them.
void run_attention(backend& be, const attention_run& r, const attention_case& c) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
  const document_mask rows{c.documents, c.q_first, c.k_first};
  ops::sdpa_forward(be,
                    {r.q.view, r.k.view, r.v.view, r.out.view, r.lse.view, c.mask, scale, rows, c.window, c.arithmetic});
  sdpa_backward_args b;
  b.q = r.q.view;
  b.k = r.k.view;
  b.v = r.v.view;
  b.out = r.out.view;
  b.d_out = r.d_out.view;
  b.lse = r.lse.view;
  b.d_q = r.d_q.view;
  b.d_k = r.d_k.view;
  b.d_v = r.d_v.view;
  b.mask = c.mask;
  b.scale = scale;
  b.documents = rows;
  b.window = c.window;
  b.arithmetic = c.arithmetic;
  if (c.backward) ops::sdpa_backward(be, b);
  be.synchronize();
}

std::vector<float> download(backend& be, const tensor& t) {
  std::vector<float> values(static_cast<std::size_t>(t.numel()));
  be.download_f32(values.data(), t);
  return values;
}

// The buffer index of (token, head, x) of a view, counted in elements from the buffer start.
std::int64_t index_of(const heads_buffer& b, std::int64_t t, std::int64_t h, std::int64_t x) {
  const std::int64_t base =
      (static_cast<const std::byte*>(b.view.data) - static_cast<const std::byte*>(b.storage.data())) /
      static_cast<std::int64_t>(dtype_size(b.view.type));
  return base + t * b.view.token_stride + h * b.view.head_stride + x;
}

struct comparison {
  double max_abs = 0.0, max_ref = 0.0;
  std::vector<double> head_err, head_ref;  // per head: sums of squared differences and references
  std::int64_t touched_spares = 0;  // buffer elements outside the view that lost the sentinel
  double relative() const { return max_abs / max_ref; }
  // The worst head's sqrt(sum (a - b)^2 / sum b^2).
  double head_rms() const {
    double worst = 0.0;
    for (std::size_t h = 0; h < head_err.size(); ++h)
      worst = std::max(worst, head_ref[h] > 0 ? std::sqrt(head_err[h] / head_ref[h]) : std::sqrt(head_err[h]));
    return worst;
  }
};

// gpu against cpu over the view; NaN counts as an infinite difference.
comparison compare(backend& gpu, const heads_buffer& got, backend& cpu, const heads_buffer& want) {
  const std::vector<float> a = download(gpu, got.storage), b = download(cpu, want.storage);
  std::vector<bool> in_view(a.size(), false);
  comparison c;
  c.head_err.assign(static_cast<std::size_t>(got.view.heads), 0.0);
  c.head_ref.assign(static_cast<std::size_t>(got.view.heads), 0.0);
  for (std::int64_t t = 0; t < got.view.tokens; ++t)
    for (std::int64_t h = 0; h < got.view.heads; ++h)
      for (std::int64_t x = 0; x < got.view.dim; ++x) {
        const auto i = static_cast<std::size_t>(index_of(got, t, h, x));
        const auto j = static_cast<std::size_t>(index_of(want, t, h, x));
        in_view[i] = true;
        // Equal values (a row that sees no key: lse -inf on both) differ by nothing.
        const double diff = a[i] == b[j] ? 0.0 : std::abs(static_cast<double>(a[i]) - b[j]);
        c.max_abs = std::isnan(diff) ? std::numeric_limits<double>::infinity() : std::max(c.max_abs, diff);
        c.max_ref = std::max(c.max_ref, std::abs(static_cast<double>(b[j])));
        if (std::isfinite(b[j])) {
          c.head_err[static_cast<std::size_t>(h)] += std::isnan(diff) ? std::numeric_limits<double>::infinity() : diff * diff;
          c.head_ref[static_cast<std::size_t>(h)] += static_cast<double>(b[j]) * b[j];
        }
      }
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!in_view[i] && a[i] != sentinel) ++c.touched_spares;
  return c;
}

void expect_match(backend& gpu, const attention_run& g, backend& cpu, const attention_run& r,
                  const attention_case& c) {
  const std::string name = name_of(c);
  const comparison lse = compare(gpu, g.lse, cpu, r.lse);
  EXPECT_LT(lse.max_abs, lse_tolerance) << name << ": lse";
  EXPECT_EQ(lse.touched_spares, 0) << name << ": lse";
  for (const auto& [label, got, want] : {std::tuple{"out", &g.out, &r.out}, std::tuple{"d_q", &g.d_q, &r.d_q},
                                         std::tuple{"d_k", &g.d_k, &r.d_k}, std::tuple{"d_v", &g.d_v, &r.d_v}}) {
    if (!c.backward && std::string(label) != "out") continue;
    const comparison e = compare(gpu, *got, cpu, *want);
    if (c.arithmetic == attention_dtype::fp8) {
      std::printf("fp8 %s %s: worst head's relative RMS %.3e, max |diff| / max %.3e\n", name.c_str(), label,
                  e.head_rms(), e.relative());
      EXPECT_LT(e.head_rms(), fp8_head_rms_tolerance) << name << ": " << label << " (max |diff| " << e.max_abs << ")";
    } else {
      EXPECT_LT(e.relative(), rel_tolerance) << name << ": " << label << " (max |diff| " << e.max_abs << ")";
    }
    EXPECT_EQ(e.touched_spares, 0) << name << ": " << label << " written outside its view";
  }
}

void check_case(backend& gpu, backend& cpu, const attention_case& c, std::uint32_t seed) {
  const host_inputs in = make_inputs(c, seed);
  const attention_run g = make_run(gpu, c, in);
  const attention_run r = make_run(cpu, c, in);
  run_attention(gpu, g, c);
  run_attention(cpu, r, c);
  expect_match(gpu, g, cpu, r, c);
}

TEST(gpu_sdpa, reports_the_loaded_cudnn) {
  EXPECT_GE(cuda::sdpa_engine::library_version(), std::size_t{90000});
}

// Group sizes 1, 2, 4 and 8; d 64 and 128; s 128 and 1000 (not a multiple of 64); sq != skv
// for an unmasked block; dense and strided views; both lse layouts (on cuDNN < 9.26 a
// token-major lse goes through the packed copy in backward).
TEST(gpu_sdpa, matches_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  auto gpu = make_backend(backend_kind::cuda, gpu_limits());
  auto cpu = make_cpu_backend(cpu_limits());
  const attention_case cases[] = {
      {128, 128, 1, 1, 64, attn_mask::causal, false, false},
      {128, 128, 4, 1, 128, attn_mask::none, true, true},
      {128, 128, 8, 8, 64, attn_mask::causal, true, false},
      {128, 128, 8, 1, 128, attn_mask::causal, false, true},
      {128, 1000, 8, 1, 128, attn_mask::none, true, false},
      {1000, 1000, 8, 4, 64, attn_mask::causal, true, false},
      {1000, 1000, 4, 4, 128, attn_mask::none, true, true},
  };
  std::uint32_t seed = 1;
  for (const attention_case& c : cases) check_case(*gpu, *cpu, c, seed++);
}

// FP8 attention (cuDNN's FP8 graphs, the quantizing kernels, scales computed on the
// device) against the cpu backend's FP8 definition at every head dim it runs: forward and
// backward at 128 (grouped and whole heads, causal and a block of the past with more keys
// than queries, lengths not multiples of 64, strided head blocks, both lse layouts), the
// forward alone at 16 to 256.
TEST(gpu_sdpa, fp8_matches_the_cpu_definition) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  auto gpu = make_backend(backend_kind::cuda, gpu_limits());
  auto cpu = make_cpu_backend(cpu_limits());
  const auto fp8 = attention_dtype::fp8;
  std::vector<attention_case> cases = {
      {128, 128, 1, 1, 128, attn_mask::causal, false, false, 0, 0, 0, {}, fp8},
      {1000, 1000, 8, 4, 128, attn_mask::causal, true, false, 0, 0, 0, {}, fp8},
      {128, 1000, 8, 1, 128, attn_mask::none, true, false, 0, 0, 0, {}, fp8},
      {1000, 1000, 4, 4, 128, attn_mask::none, false, true, 0, 0, 0, {}, fp8},
  };
  for (std::int64_t d = fp8_head_dim_multiple; d <= fp8_forward_max_head_dim; d += fp8_head_dim_multiple)
    if (fp8_attention_runs(d, false) && !fp8_attention_runs(d, true))
      cases.push_back({1000, 1000, 4, 2, d, attn_mask::causal, d % 32 == 0, false, 0, 0, 0, {}, fp8, false});
  std::uint32_t seed = 41;
  for (const attention_case& c : cases) check_case(*gpu, *cpu, c, seed++);
}

// Which reading of the kernels' inner roundings the GPU follows: the GPU's outputs against
// the cpu's FP8 attention under each reading (each printed). The definition must be the
// closest of them (its worst per-head error within 10% of the best reading's), or the
// failure names the reading the kernels follow more closely.
TEST(gpu_sdpa, fp8_definition_is_the_closest_reading_of_the_kernels) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  auto gpu = make_backend(backend_kind::cuda, gpu_limits());
  auto cpu = make_cpu_backend(cpu_limits());
  const auto fp8 = attention_dtype::fp8;
  const attention_case cases[] = {
      {1000, 1000, 8, 4, 128, attn_mask::causal, false, false, 0, 0, 0, {}, fp8},
      {128, 1000, 8, 1, 128, attn_mask::none, false, false, 0, 0, 0, {}, fp8},
      {1000, 1000, 4, 4, 128, attn_mask::none, false, false, 0, 0, 0, {}, fp8},
  };
  const std::pair<const char*, cpu::fp8_inner_rounding> readings[] = {
      {"definition", {}},
      {"no P rounding", {.round_p = false}},
      {"no dS rounding", {.round_d_s = false}},
      {"neither", {.round_p = false, .round_d_s = false}},
      {"P block 64", {.p_block = 64}},
      {"P block 128", {.p_block = 128}},
      {"P block 64 reversed", {.p_block = 64, .p_block_reverse = true}},
      {"P block 128 reversed", {.p_block = 128, .p_block_reverse = true}},
      {"P block 256", {.p_block = 256}},
      {"dS unscaled", {.d_s_unscaled = true}},
      {"dS unscaled, P block 128", {.p_block = 128, .d_s_unscaled = true}},
      {"sum of rounded P", {.sum_rounded = true}},
      {"sum of rounded P, block 128", {.p_block = 128, .sum_rounded = true}},
      {"sum rounded, block 128, dS unscaled", {.p_block = 128, .d_s_unscaled = true, .sum_rounded = true}},
  };
  // Each reading's worst per-head relative RMS error over the cases and the four outputs.
  std::vector<double> worst(std::size(readings), 0.0);
  std::uint32_t seed = 71;
  for (const attention_case& c : cases) {
    const host_inputs in = make_inputs(c, seed++);
    const attention_run g = make_run(*gpu, c, in);
    run_attention(*gpu, g, c);
    for (std::size_t n = 0; n < std::size(readings); ++n) {
      const auto& [name, reading] = readings[n];
      const attention_run r = make_run(*cpu, c, in);
      const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
      cpu::run_fp8(sdpa_forward_args{r.q.view, r.k.view, r.v.view, r.out.view, r.lse.view, c.mask, scale, {}, 0, fp8},
                   reading);
      sdpa_backward_args b{r.q.view, r.k.view, r.v.view, r.out.view, r.d_out.view, r.lse.view, r.d_q.view, r.d_k.view,
                           r.d_v.view, c.mask, scale, {}, 0, fp8};
      cpu::run_fp8(b, reading);
      std::printf("reading %-36s %s:", name, name_of(c).c_str());
      for (const auto& [label, got, want] : {std::tuple{"out", &g.out, &r.out}, std::tuple{"d_q", &g.d_q, &r.d_q},
                                             std::tuple{"d_k", &g.d_k, &r.d_k}, std::tuple{"d_v", &g.d_v, &r.d_v}}) {
        const double e = compare(*gpu, *got, *cpu, *want).head_rms();
        worst[n] = std::max(worst[n], e);
        std::printf(" %s %.3e", label, e);
      }
      std::printf("\n");
    }
  }
  const std::size_t best = static_cast<std::size_t>(std::min_element(worst.begin(), worst.end()) - worst.begin());
  EXPECT_LE(worst[0], 1.1 * worst[best]) << "the kernels follow \"" << readings[best].first << "\" (worst head "
                                         << worst[best] << ") more closely than the definition (" << worst[0] << ")";
}

// The rows of ops/fp8_attention.hpp are what the loaded cuDNN runs: every multiple of 16 up
// to 256, forward and backward, asked of cuDNN with none of upipe's rules in front.
TEST(gpu_sdpa, fp8_head_dims_are_the_ones_cudnn_runs) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const std::size_t v = cuda::sdpa_engine::library_version();
  for (std::int64_t d = fp8_head_dim_multiple; d <= 256; d += fp8_head_dim_multiple)
    for (const bool backward : {false, true}) {
      const std::string refusal = cuda::sdpa_engine::fp8_support(d, backward);
      std::printf("cuDNN %zu.%zu.%zu fp8 %s d %3lld: %s\n", v / 10000, v % 10000 / 100, v % 100,
                  backward ? "backward" : "forward ", static_cast<long long>(d),
                  refusal.empty() ? "runs" : refusal.substr(0, 160).c_str());
      EXPECT_EQ(refusal.empty(), fp8_attention_runs(d, backward))
          << "d " << d << (backward ? " backward" : " forward") << ": " << refusal;
    }
}

// Where the backward cannot run, training in FP8 is refused by name, with the way out.
TEST(gpu_sdpa, fp8_backward_past_its_head_dim_is_refused_by_name) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  auto gpu = make_backend(backend_kind::cuda, gpu_limits());
  const attention_case c{256, 256, 2, 2, 64, attn_mask::causal, false, false, 0, 0, 0, {}, attention_dtype::fp8};
  const attention_run g = make_run(*gpu, c, make_inputs(c, 5));
  try {
    run_attention(*gpu, g, c);
    ADD_FAILURE() << "expected a config_error";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("--attention-dtype bf16"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("head dim 64"), std::string::npos) << e.what();
  }
}

// The CUDA engine runs an FP8 call whole: a window (run as pieces) is refused by name.
TEST(gpu_sdpa, fp8_refuses_pieces_by_name) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  auto gpu = make_backend(backend_kind::cuda, gpu_limits());
  const attention_case c{256, 256, 2, 2, 64, attn_mask::causal, false, false, 64, 0, 0, {}, attention_dtype::fp8};
  const attention_run g = make_run(*gpu, c, make_inputs(c, 3));
  try {
    run_attention(*gpu, g, c);
    ADD_FAILURE() << "expected a config_error";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("--attention-dtype bf16"), std::string::npos) << e.what();
  }
}

// Sliding windows through cuDNN's diagonal band: a causal band, a window longer than the
// rows (no band), blocks of the past whose band starts inside the keys, whose first keys
// no query reaches (cut) and whose later queries reach none (zeroed), one with more queries
// than keys (split, as cuDNN wants s_q <= s_kv under a band), beyond 1024 keys (cuDNN
// 9.14.0 refuses a left bound without a right one there), and a window over packed
// documents.
TEST(gpu_sdpa, sliding_windows_match_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  auto gpu = make_backend(backend_kind::cuda, gpu_limits());
  auto cpu = make_cpu_backend(cpu_limits());
  const attention_case cases[] = {
      {1000, 1000, 8, 2, 128, attn_mask::causal, true, false, 300, 0, 0, {}},
      {512, 512, 4, 4, 64, attn_mask::causal, false, true, 4096, 512, 512, {}},
      {1000, 1500, 8, 2, 128, attn_mask::none, true, false, 2000, 3000, 1500, {}},
      {1000, 1000, 8, 1, 64, attn_mask::none, false, false, 1500, 2000, 0, {}},
      {1200, 800, 4, 2, 128, attn_mask::none, false, true, 1500, 1000, 0, {}},
      {1000, 1000, 8, 2, 64, attn_mask::causal, true, false, 200, 0, 0, {0, 100, 101, 650}},
      {600, 600, 4, 2, 64, attn_mask::none, false, false, 450, 1200, 600, {0, 900, 1500}},
  };
  std::uint32_t seed = 40;
  for (const attention_case& c : cases) check_case(*gpu, *cpu, c, seed++);
}

// The second call finds its plan in the cache and binds the new buffers' pointers.
TEST(gpu_sdpa, a_repeated_shape_runs_on_fresh_buffers) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  auto gpu = make_backend(backend_kind::cuda, gpu_limits());
  auto cpu = make_cpu_backend(cpu_limits());
  const attention_case c{1000, 1000, 4, 1, 64, attn_mask::causal, true, false};
  check_case(*gpu, *cpu, c, 11);
  check_case(*gpu, *cpu, c, 12);
}

// The planner's probe (meta with the GPU's workspaces) grows cuDNN's workspace at the same
// calls by the same bytes as the GPU, so that both place the arena alike: forward and
// backward, causal and not, below and above the 8K tokens where the backward doubles.
TEST(gpu_sdpa, workspaces_grow_as_the_meta_backend_models_them) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  auto gpu = make_cuda_backend({std::size_t{4} << 30, std::size_t{64} << 20}, 0);
  auto meta = make_meta_backend({std::size_t{4} << 30, std::size_t{64} << 20, true});
  const auto workspace = [](backend& be) { return be.ledger().current(mem_tag::workspace); };
  ASSERT_EQ(workspace(*gpu), workspace(*meta)) << "cuBLASLt's workspace";
  const attention_case cases[] = {{256, 256, 4, 2, 64, attn_mask::causal, false, false},
                                  {512, 384, 2, 1, 128, attn_mask::none, true, true},
                                  {8192, 8192, 4, 1, 128, attn_mask::causal, false, true},
                                  {16384, 16384, 2, 2, 128, attn_mask::causal, false, true}};
  for (const attention_case& c : cases) {
    const host_inputs in = make_inputs(c, 3);
    {
      const attention_run g = make_run(*gpu, c, in);
      const attention_run m = make_run(*meta, c, in);
      run_attention(*gpu, g, c);
      run_attention(*meta, m, c);
    }
    EXPECT_EQ(workspace(*gpu), workspace(*meta)) << name_of(c);
    EXPECT_EQ(gpu->device_arena().high_water(), meta->device_arena().high_water()) << name_of(c);
  }
}

TEST(gpu_sdpa, rejects_a_head_dim_it_cannot_run) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  auto gpu = make_backend(backend_kind::cuda, gpu_limits());
  const attention_case c{64, 64, 2, 1, 320, attn_mask::causal, false, false};
  const attention_run g = make_run(*gpu, c, make_inputs(c, 5));
  try {
    ops::sdpa_forward(*gpu, {g.q.view, g.k.view, g.v.view, g.out.view, g.lse.view, c.mask, 0.125f});
    ADD_FAILURE() << "head dim 320 was accepted";
  } catch (const config_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("head dim 320"), std::string::npos) << what;
    EXPECT_NE(what.find("256"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace upipe
