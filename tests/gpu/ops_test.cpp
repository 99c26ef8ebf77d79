// The CUDA kernels (ops/cuda/kernels_*.cu) against the CPU reference: every op runs through
// the checked entries on a cpu backend and on a cuda backend from the same inputs (rounded
// to bf16 first wherever the GPU stores bf16, so both start from the same numbers), and
// whole tensors, padding included, are compared as max|gpu - cpu| / max|cpu|. Views are
// padded and offset so that both the 16-byte vector paths and the scalar paths run.
// Skipped when no CUDA device is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "core/dtype.hpp"

namespace upipe {
namespace {

constexpr double bf16_tolerance = 2e-2;
constexpr double f32_tolerance = 1e-5;
constexpr float neg_inf = -std::numeric_limits<float>::infinity();

bool have_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// A tensor on each backend holding the same values.
struct twin {
  tensor on_cpu, on_gpu;
};

// max |got - want| / max |want|; NaN or a mismatched infinity counts as infinite error.
double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (got[i] != want[i]) err = std::numeric_limits<double>::infinity();
      continue;
    }
    const double diff = std::abs(static_cast<double>(got[i]) - want[i]);
    err = std::isnan(diff) ? std::numeric_limits<double>::infinity() : std::max(err, diff);
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  return scale > 0.0 ? err / scale : err;
}

class gpu_ops : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!have_device()) return;
    const memory_limits limits{std::size_t{256} << 20, std::size_t{64} << 20};
    cpu_ = make_cpu_backend(limits);
    gpu_ = make_backend(backend_kind::cuda, limits);
  }
  static void TearDownTestSuite() {
    gpu_.reset();
    cpu_.reset();
  }
  void SetUp() override {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
  }

  static backend& cpu() { return *cpu_; }
  static backend& gpu() { return *gpu_; }

  std::vector<float> random_values(std::int64_t n, float lo, float hi) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& x : v) x = dist(rng_);
    return v;
  }

  // Values rounded to bf16 when either side stores bf16.
  static twin make_twin(dtype cpu_type, dtype gpu_type, const shape& dims, std::vector<float> values) {
    if (cpu_type == dtype::bf16 || gpu_type == dtype::bf16)
      for (float& v : values) v = round_to_bf16(v);
    twin t{cpu().allocate(mem_tag::activations, cpu_type, dims, "cpu"),
           gpu().allocate(mem_tag::activations, gpu_type, dims, "gpu")};
    cpu().upload_f32(t.on_cpu, values.data());
    gpu().upload_f32(t.on_gpu, values.data());
    return t;
  }
  twin random_twin(dtype cpu_type, dtype gpu_type, const shape& dims, float lo = -1.0f, float hi = 1.0f) {
    return make_twin(cpu_type, gpu_type, dims, random_values(dims.numel(), lo, hi));
  }
  // The working dtype on each side: f32 on the cpu, bf16 on the gpu.
  twin work_twin(const shape& dims, float lo = -1.0f, float hi = 1.0f) {
    return random_twin(dtype::f32, dtype::bf16, dims, lo, hi);
  }
  twin f32_twin(const shape& dims, float lo = -1.0f, float hi = 1.0f) {
    return random_twin(dtype::f32, dtype::f32, dims, lo, hi);
  }

  // An (n x 1) i32 column inside an (n, 2) allocation whose padding holds INT32_MAX.
  static twin index_twin(const std::vector<std::int32_t>& values) {
    const auto n = static_cast<std::int64_t>(values.size());
    std::vector<std::int32_t> padded(static_cast<std::size_t>(2 * n), std::numeric_limits<std::int32_t>::max());
    for (std::int64_t i = 0; i < n; ++i) padded[2 * i] = values[i];
    twin t{cpu().allocate(mem_tag::activations, dtype::i32, shape{n, 2}, "ids"),
           gpu().allocate(mem_tag::activations, dtype::i32, shape{n, 2}, "ids")};
    cpu().upload_bytes(t.on_cpu, padded.data(), padded.size() * sizeof(std::int32_t));
    gpu().upload_bytes(t.on_gpu, padded.data(), padded.size() * sizeof(std::int32_t));
    return t;
  }

  static std::vector<float> fetch(backend& be, const tensor& t) {
    std::vector<float> out(static_cast<std::size_t>(t.numel()));
    be.download_f32(out.data(), t);
    return out;
  }
  static double error_of(const twin& t) { return relative_error(fetch(gpu(), t.on_gpu), fetch(cpu(), t.on_cpu)); }

  std::mt19937 rng_{20240611};

 private:
  static inline std::unique_ptr<backend> cpu_, gpu_;
};

// Columns [first, first + cols) of a tensor's matrix.
mat_view columns(const tensor& t, std::int64_t cols, std::int64_t first = 0) {
  return t.matrix().col_block(first, cols);
}

head_view heads_of(const tensor& t, std::int64_t offset, std::int64_t tokens, std::int64_t heads, std::int64_t dim,
                   std::int64_t token_stride, std::int64_t head_stride) {
  void* data = static_cast<char*>(t.data()) + offset * static_cast<std::int64_t>(dtype_size(t.type()));
  return {data, t.type(), tokens, heads, dim, token_stride, head_stride};
}

// ---------------------------------------------------------------------------------------
// RMSNorm

struct norm_case {
  std::int64_t rows, cols, pad, first;  // view columns [first, first + cols) of cols + pad
};

TEST_F(gpu_ops, rmsnorm_forward_matches_cpu) {
  // Warp rows and block rows; aligned rows, odd lds (alternating alignment) and tails.
  for (const norm_case& c : {norm_case{37, 128, 0, 0}, norm_case{37, 96, 3, 1}, norm_case{9, 2048, 0, 0},
                             norm_case{9, 3000, 5, 2}, norm_case{5, 6144, 0, 0}}) {
    SCOPED_TRACE("rows " + std::to_string(c.rows) + " cols " + std::to_string(c.cols));
    const std::int64_t width = c.cols + c.pad;
    const twin x = work_twin(shape{c.rows, width}, -2.0f, 2.0f);
    const twin weight = work_twin(shape{1, c.cols}, 0.5f, 1.5f);
    const twin y = work_twin(shape{c.rows, width});
    const twin rstd = f32_twin(shape{c.rows, 2});
    for (const bool gpu_side : {false, true}) {
      auto pick = [&](const twin& t) -> const tensor& { return gpu_side ? t.on_gpu : t.on_cpu; };
      ops::rmsnorm_forward(gpu_side ? gpu() : cpu(),
                           {columns(pick(x), c.cols, c.first), columns(pick(weight), c.cols),
                            columns(pick(y), c.cols, c.first), columns(pick(rstd), 1), 1e-5f});
    }
    EXPECT_LT(error_of(y), bf16_tolerance);
    EXPECT_LT(error_of(rstd), f32_tolerance);
  }
}

TEST_F(gpu_ops, rmsnorm_forward_in_place_and_mixed_dtypes) {
  const std::int64_t rows = 13, cols = 1536;
  // In place on bf16.
  const twin x = work_twin(shape{rows, cols}, -3.0f, 3.0f);
  const twin weight = work_twin(shape{1, cols}, 0.5f, 1.5f);
  const twin rstd = f32_twin(shape{rows, 1});
  // An f32 input with bf16 weights into an f32 output.
  const twin x32 = f32_twin(shape{rows, cols}, -3.0f, 3.0f);
  const twin y32 = f32_twin(shape{rows, cols});
  const twin rstd2 = f32_twin(shape{rows, 1});
  for (const bool gpu_side : {false, true}) {
    backend& be = gpu_side ? gpu() : cpu();
    auto pick = [&](const twin& t) -> const tensor& { return gpu_side ? t.on_gpu : t.on_cpu; };
    ops::rmsnorm_forward(be, {pick(x).matrix(), pick(weight).matrix(), pick(x).matrix(), pick(rstd).matrix(), 1e-6f});
    ops::rmsnorm_forward(be,
                         {pick(x32).matrix(), pick(weight).matrix(), pick(y32).matrix(), pick(rstd2).matrix(), 1e-6f});
  }
  EXPECT_LT(error_of(x), bf16_tolerance);
  EXPECT_LT(error_of(rstd), f32_tolerance);
  EXPECT_LT(error_of(y32), 1e-5);  // f32 in and out; only the weights are bf16
  EXPECT_LT(error_of(rstd2), f32_tolerance);
}

TEST_F(gpu_ops, rmsnorm_backward_matches_cpu_and_accumulates_d_weight) {
  // Warp rows, block rows with odd lds, and a row too long for the shared accumulator.
  for (const norm_case& c : {norm_case{40, 128, 0, 0}, norm_case{33, 2000, 3, 1}, norm_case{3, 70000, 0, 0}}) {
    SCOPED_TRACE("rows " + std::to_string(c.rows) + " cols " + std::to_string(c.cols));
    const std::int64_t width = c.cols + c.pad;
    const twin x = work_twin(shape{c.rows, width}, -2.0f, 2.0f);
    const twin weight = work_twin(shape{1, c.cols}, 0.5f, 1.5f);
    const twin rstd = f32_twin(shape{c.rows, 1}, 0.5f, 2.0f);
    const twin d_y = work_twin(shape{c.rows, width});
    const twin d_x = work_twin(shape{c.rows, width});
    const twin d_weight = f32_twin(shape{1, c.cols});  // accumulated onto these values
    for (const bool gpu_side : {false, true}) {
      auto pick = [&](const twin& t) -> const tensor& { return gpu_side ? t.on_gpu : t.on_cpu; };
      ops::rmsnorm_backward(gpu_side ? gpu() : cpu(),
                            {columns(pick(x), c.cols, c.first), columns(pick(weight), c.cols), pick(rstd).matrix(),
                             columns(pick(d_y), c.cols, c.first), columns(pick(d_x), c.cols, c.first),
                             pick(d_weight).matrix()});
    }
    EXPECT_LT(error_of(d_x), bf16_tolerance);
    EXPECT_LT(error_of(d_weight), 1e-4);  // fp32 sums over rows in another order
  }
}

TEST_F(gpu_ops, rmsnorm_backward_in_place) {
  const std::int64_t rows = 21, cols = 512;
  const twin x = work_twin(shape{rows, cols});
  const twin weight = work_twin(shape{1, cols}, 0.5f, 1.5f);
  const twin rstd = f32_twin(shape{rows, 1}, 0.5f, 2.0f);
  const twin d = work_twin(shape{rows, cols});  // d_y, overwritten by d_x
  const twin d_weight = f32_twin(shape{1, cols});
  for (const bool gpu_side : {false, true}) {
    auto pick = [&](const twin& t) -> const tensor& { return gpu_side ? t.on_gpu : t.on_cpu; };
    ops::rmsnorm_backward(gpu_side ? gpu() : cpu(), {pick(x).matrix(), pick(weight).matrix(), pick(rstd).matrix(),
                                                     pick(d).matrix(), pick(d).matrix(), pick(d_weight).matrix()});
  }
  EXPECT_LT(error_of(d), bf16_tolerance);
  EXPECT_LT(error_of(d_weight), 1e-4);
}

// ---------------------------------------------------------------------------------------
// RoPE

struct rope_layout {
  std::int64_t tokens, heads, dim, token_stride, head_stride, size;
};

// Head-major with a gap after each head (16-byte aligned rows for even dims of 8).
rope_layout head_major(std::int64_t tokens, std::int64_t heads, std::int64_t dim) {
  const std::int64_t head_stride = tokens * dim + 8;
  return {tokens, heads, dim, dim, head_stride, heads * head_stride};
}

// Twelve runs (more than one launch's worth), a gap, and positions up to 8,000,000.
std::vector<position_run> many_runs(std::int64_t tokens) {
  std::vector<position_run> runs{{0, 0, 5}, {5, 100, 3}, {10, 8'000'000, 6}};
  std::int64_t token = 16, position = 7'999'990;
  while (token + 2 <= tokens - 4 && runs.size() < 12) {
    runs.push_back({token, position, 2});
    token += 2;
    position -= 777'777;
  }
  return runs;
}

void run_rope(backend& be, const tensor& t, const rope_layout& l, const std::vector<position_run>& runs,
              const rope_config& config, rope_direction direction) {
  ops::rope(be, {heads_of(t, 0, l.tokens, l.heads, l.dim, l.token_stride, l.head_stride), runs, config, direction});
}

TEST_F(gpu_ops, rope_f32_matches_cpu_at_position_8m) {
  rope_config scaled, linear, yarn;
  scaled.scaling.kind = rope_kind::llama3;
  linear.scaling = {.kind = rope_kind::linear, .factor = 4.0};
  // YaRN scales cos and sin by its attention factor (1.139 here) in both directions.
  yarn.scaling = {.kind = rope_kind::yarn, .factor = 4.0, .original_max_position = 8192};
  for (const rope_layout& l : {head_major(40, 3, 64), head_major(40, 2, 128),
                               rope_layout{40, 2, 300, 2 * 300, 300, 40 * 2 * 300}}) {  // 150 pairs: two launches
    for (const rope_config& config : {rope_config{}, scaled, linear, yarn}) {
      SCOPED_TRACE("dim " + std::to_string(l.dim) + " scaling kind " +
                   std::to_string(static_cast<int>(config.scaling.kind)));
      const twin x = f32_twin(shape{l.size});
      const std::vector<position_run> runs = many_runs(l.tokens);
      for (const bool gpu_side : {false, true})
        run_rope(gpu_side ? gpu() : cpu(), gpu_side ? x.on_gpu : x.on_cpu, l, runs, config, rope_direction::forward);
      EXPECT_LT(error_of(x), f32_tolerance);
      for (const bool gpu_side : {false, true})
        run_rope(gpu_side ? gpu() : cpu(), gpu_side ? x.on_gpu : x.on_cpu, l, runs, config, rope_direction::inverse);
      EXPECT_LT(error_of(x), f32_tolerance);
    }
  }
}

TEST_F(gpu_ops, rope_bf16_matches_cpu) {
  for (const rope_layout& l : {head_major(40, 4, 128), rope_layout{40, 3, 72, 3 * 72 + 4, 72, 40 * (3 * 72 + 4)}}) {
    SCOPED_TRACE("dim " + std::to_string(l.dim));
    const twin x = work_twin(shape{l.size});
    const std::vector<position_run> runs = many_runs(l.tokens);
    for (const rope_direction direction : {rope_direction::forward, rope_direction::inverse}) {
      for (const bool gpu_side : {false, true})
        run_rope(gpu_side ? gpu() : cpu(), gpu_side ? x.on_gpu : x.on_cpu, l, runs, rope_config{}, direction);
      EXPECT_LT(error_of(x), bf16_tolerance);
    }
  }
}

// ---------------------------------------------------------------------------------------
// SwiGLU

TEST_F(gpu_ops, swiglu_forward_and_backward_match_cpu) {
  for (const norm_case& c : {norm_case{33, 200, 0, 0}, norm_case{17, 333, 5, 1}}) {
    for (const dtype d_out_type : {dtype::bf16, dtype::f32}) {
      SCOPED_TRACE("cols " + std::to_string(c.cols) + " d_out " + std::string(dtype_name(d_out_type)));
      const shape dims{c.rows, c.cols + c.pad};
      const twin gate = work_twin(dims, -6.0f, 6.0f), up = work_twin(dims, -2.0f, 2.0f), out = work_twin(dims);
      const twin d_out = random_twin(dtype::f32, d_out_type, dims);
      const twin d_gate = work_twin(dims), d_up = work_twin(dims);
      for (const bool gpu_side : {false, true}) {
        backend& be = gpu_side ? gpu() : cpu();
        auto pick = [&](const twin& t) { return columns(gpu_side ? t.on_gpu : t.on_cpu, c.cols, c.first); };
        ops::swiglu_forward(be, {pick(gate), pick(up), pick(out)});
        ops::swiglu_backward(be, {pick(gate), pick(up), pick(d_out), pick(d_gate), pick(d_up)});
      }
      EXPECT_LT(error_of(out), bf16_tolerance);
      EXPECT_LT(error_of(d_gate), bf16_tolerance);
      EXPECT_LT(error_of(d_up), bf16_tolerance);
    }
  }
}

TEST_F(gpu_ops, swiglu_backward_in_place) {
  const shape dims{24, 256};
  const twin gate = work_twin(dims, -6.0f, 6.0f), up = work_twin(dims, -2.0f, 2.0f), d_out = work_twin(dims);
  for (const bool gpu_side : {false, true}) {
    auto pick = [&](const twin& t) { return (gpu_side ? t.on_gpu : t.on_cpu).matrix(); };
    ops::swiglu_backward(gpu_side ? gpu() : cpu(), {pick(gate), pick(up), pick(d_out), pick(gate), pick(up)});
  }
  EXPECT_LT(error_of(gate), bf16_tolerance);
  EXPECT_LT(error_of(up), bf16_tolerance);
}

// ---------------------------------------------------------------------------------------
// Embedding

TEST_F(gpu_ops, embedding_forward_and_backward_match_cpu) {
  const std::int64_t vocab = 50, n = 64;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  std::uniform_int_distribution<std::int32_t> pick_id(0, static_cast<std::int32_t>(vocab - 1));
  for (auto& id : ids) id = pick_id(rng_);
  ids[3] = ids[7] = ids[40] = 11;  // repeated ids add up
  ids[0] = 0;
  ids[1] = static_cast<std::int32_t>(vocab - 1);
  const twin id_column = index_twin(ids);
  for (const norm_case& c : {norm_case{0, 72, 0, 0}, norm_case{0, 70, 3, 1}}) {
    for (const dtype d_out_type : {dtype::bf16, dtype::f32}) {
      SCOPED_TRACE("dim " + std::to_string(c.cols) + " d_out " + std::string(dtype_name(d_out_type)));
      const std::int64_t width = c.cols + c.pad;
      const twin table = work_twin(shape{vocab, width});
      const twin out = work_twin(shape{n, width});
      const twin d_out = random_twin(dtype::f32, d_out_type, shape{n, width});
      const twin d_table = f32_twin(shape{vocab, width});  // accumulated onto these values
      for (const bool gpu_side : {false, true}) {
        backend& be = gpu_side ? gpu() : cpu();
        auto pick = [&](const twin& t) { return columns(gpu_side ? t.on_gpu : t.on_cpu, c.cols, c.first); };
        const mat_view id_view = columns(gpu_side ? id_column.on_gpu : id_column.on_cpu, 1);
        ops::embedding_forward(be, {pick(table), id_view, pick(out)});
        ops::embedding_backward(be, {pick(d_out), id_view, pick(d_table)});
      }
      EXPECT_EQ(error_of(out), 0.0);  // a gather is exact
      EXPECT_LT(error_of(d_table), 1e-6);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Cross-entropy

TEST_F(gpu_ops, cross_entropy_matches_cpu_with_masked_rows) {
  // Short rows (a block per row), a long unaligned row (a cluster, element loads) and
  // long aligned rows (a cluster, bulk asynchronous loads; one with a short last slice).
  for (const norm_case& c : {norm_case{20, 1000, 0, 0}, norm_case{6, 32003, 3, 1}, norm_case{6, 128256, 0, 0},
                             norm_case{7, 16388, 4, 0}}) {
    SCOPED_TRACE("vocab " + std::to_string(c.cols));
    std::vector<std::int32_t> labels(static_cast<std::size_t>(c.rows));
    std::uniform_int_distribution<std::int32_t> pick_label(0, static_cast<std::int32_t>(c.cols - 1));
    for (auto& label : labels) label = pick_label(rng_);
    labels[0] = 0;
    labels[1] = -100;  // masked
    labels[2] = static_cast<std::int32_t>(c.cols - 1);
    labels[4] = -1;  // masked
    labels[5] = static_cast<std::int32_t>((c.cols + 7) / 8);  // at a cluster slice's start
    const twin label_column = index_twin(labels);
    const twin logits = f32_twin(shape{c.rows, c.cols + c.pad}, -8.0f, 8.0f);
    const twin row_loss = f32_twin(shape{c.rows, 2});
    for (const bool gpu_side : {false, true}) {
      auto pick = [&](const twin& t) -> const tensor& { return gpu_side ? t.on_gpu : t.on_cpu; };
      ops::cross_entropy(gpu_side ? gpu() : cpu(),
                         {columns(pick(logits), c.cols, c.first), columns(pick(label_column), 1),
                          columns(pick(row_loss), 1), 0.25f});
    }
    EXPECT_LT(error_of(logits), f32_tolerance);
    EXPECT_LT(error_of(row_loss), f32_tolerance);
    const std::vector<float> loss = fetch(gpu(), row_loss.on_gpu);
    EXPECT_EQ(loss[2 * 1], 0.0f);
    EXPECT_EQ(loss[2 * 4], 0.0f);
  }
}

// ---------------------------------------------------------------------------------------
// AdamW and the sum of squares

TEST_F(gpu_ops, adamw_three_steps_match_cpu) {
  for (const bool with_weights : {true, false}) {
    for (const std::int64_t first : {0, 1}) {  // an offset shard: the scalar path
      SCOPED_TRACE(std::string(with_weights ? "with" : "without") + " weights, offset " + std::to_string(first));
      const std::int64_t n = 1001;
      const shape dims{1, n + first};
      const twin master = f32_twin(dims), exp_avg = f32_twin(dims, -0.1f, 0.1f);
      const twin exp_avg_sq = f32_twin(dims, 0.0f, 0.01f);
      const twin weights = work_twin(dims);
      for (std::int64_t step = 1; step <= 3; ++step) {
        const twin grad = f32_twin(dims, -2.0f, 2.0f);
        for (const bool gpu_side : {false, true}) {
          auto pick = [&](const twin& t) { return columns(gpu_side ? t.on_gpu : t.on_cpu, n, first); };
          adamw_args args{pick(master), pick(exp_avg), pick(exp_avg_sq), pick(grad), {}};
          if (with_weights) args.weights = pick(weights);
          args.lr = 1e-2f;
          args.weight_decay = 0.1f;
          args.grad_scale = 0.5f;
          args.step = step;
          ops::adamw(gpu_side ? gpu() : cpu(), args);
        }
      }
      EXPECT_LT(error_of(master), f32_tolerance);
      EXPECT_LT(error_of(exp_avg), f32_tolerance);
      EXPECT_LT(error_of(exp_avg_sq), f32_tolerance);
      const std::vector<float> gpu_master = fetch(gpu(), master.on_gpu);
      const std::vector<float> gpu_weights = fetch(gpu(), weights.on_gpu);
      if (with_weights) {
        EXPECT_LT(error_of(weights), bf16_tolerance);
        // The working copy is the stored master, rounded once.
        for (std::int64_t i = first; i < n + first; ++i)
          ASSERT_EQ(gpu_weights[i], round_to_bf16(gpu_master[i])) << "element " << i;
      } else {
        EXPECT_EQ(error_of(weights), 0.0);  // untouched
      }
    }
  }
}

TEST_F(gpu_ops, sum_squares_matches_cpu) {
  const twin padded = f32_twin(shape{50, 1006}, -3.0f, 3.0f);
  const twin flat = f32_twin(shape{1, 100'001}, -3.0f, 3.0f);
  const std::pair<const twin*, std::int64_t> cases[] = {{&padded, 0}, {&padded, 1}, {&flat, 0}, {&flat, 1}};
  for (const auto& [t, first] : cases) {
    const std::int64_t cols = t->on_cpu.matrix().cols - 3;
    const double want = ops::sum_squares(cpu(), columns(t->on_cpu, cols, first));
    const double got = ops::sum_squares(gpu(), columns(t->on_gpu, cols, first));
    EXPECT_NEAR(got, want, 1e-12 * want) << "first " << first << ", cols " << cols;
  }
  // A packed (ld == cols) matrix walks as one long row.
  const double want = ops::sum_squares(cpu(), padded.on_cpu.matrix());
  EXPECT_NEAR(ops::sum_squares(gpu(), padded.on_gpu.matrix()), want, 1e-12 * want);
}

TEST_F(gpu_ops, add_f32_matches_cpu) {
  for (const std::int64_t first : {0, 1}) {
    const std::int64_t count = 10'007;
    const twin dst = f32_twin(shape{count + 1}), src = f32_twin(shape{count + 1});
    for (const bool gpu_side : {false, true}) {
      backend& be = gpu_side ? gpu() : cpu();
      const tensor& d = gpu_side ? dst.on_gpu : dst.on_cpu;
      const tensor& s = gpu_side ? src.on_gpu : src.on_cpu;
      be.add_f32(d.as<float>() + first, s.as<float>() + first, static_cast<std::size_t>(count));
    }
    EXPECT_EQ(error_of(dst), 0.0) << "first " << first;
  }
}

// ---------------------------------------------------------------------------------------
// Layout ops on strided head views

struct head_layouts {
  std::int64_t tokens, heads, dim;
  // Packed (t, h, d); head-major with each token row rounded up to 8 and a gap per head;
  // token-major with 4 elements of padding per token (rows misaligned for bf16).
  std::int64_t padded_dim() const { return (dim + 7) / 8 * 8; }
  std::int64_t head_stride() const { return tokens * padded_dim() + 8; }
  std::int64_t size() const { return heads * head_stride() + tokens * (heads * dim + 4); }
  head_view packed(const tensor& t) const { return heads_of(t, 0, tokens, heads, dim, heads * dim, dim); }
  head_view by_head(const tensor& t) const { return heads_of(t, 0, tokens, heads, dim, padded_dim(), head_stride()); }
  head_view by_token(const tensor& t) const { return heads_of(t, 0, tokens, heads, dim, heads * dim + 4, dim); }
};

TEST_F(gpu_ops, copy_add_fill_heads_match_cpu_on_strided_views) {
  for (const std::int64_t dim : {24, 20}) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    const head_layouts l{6, 5, dim};
    const shape dims{l.size()};
    const twin f32_a = f32_twin(dims), f32_b = f32_twin(dims);
    const twin bf16_a = random_twin(dtype::bf16, dtype::bf16, dims);
    // add_heads into bf16 is a GPU case (the cpu's working dtype is f32): f32 on the cpu.
    const twin bf16_b = work_twin(dims);
    for (const bool gpu_side : {false, true}) {
      backend& be = gpu_side ? gpu() : cpu();
      auto pick = [&](const twin& t) -> const tensor& { return gpu_side ? t.on_gpu : t.on_cpu; };
      // Pack with conversion (misaligned source), unpack (vector rows), accumulate.
      ops::copy_heads(be, l.by_head(pick(bf16_a)), l.by_token(pick(f32_a)));
      ops::copy_heads(be, l.packed(pick(f32_b)), l.by_head(pick(bf16_a)));
      ops::add_heads(be, l.by_head(pick(f32_a)), l.packed(pick(bf16_b)));
      ops::add_heads(be, l.by_token(pick(bf16_b)), l.packed(pick(f32_b)));
      // Matrices as (rows, 1, cols) views at odd offsets and lds.
      ops::add_heads(be, heads_of(pick(f32_b), 3, 4, 1, 30, 33, 30), heads_of(pick(bf16_a), 1, 4, 1, 30, 31, 30));
    }
    EXPECT_EQ(error_of(bf16_a), 0.0);
    EXPECT_LT(error_of(f32_a), 1e-6);
    EXPECT_LT(error_of(f32_b), 1e-6);
    EXPECT_LT(error_of(bf16_b), bf16_tolerance);  // the gpu rounds the fp32 sum to bf16 once
    for (const bool gpu_side : {false, true}) {
      backend& be = gpu_side ? gpu() : cpu();
      auto pick = [&](const twin& t) -> const tensor& { return gpu_side ? t.on_gpu : t.on_cpu; };
      ops::fill_heads(be, l.by_head(pick(bf16_a)).head_block(1, 2), 0.375f);
      ops::fill_heads(be, l.by_token(pick(f32_a)).token_block(2, 3), -2.0f);
      ops::fill_heads(be, l.packed(pick(f32_b)), 1.5f);
    }
    EXPECT_EQ(error_of(bf16_a), 0.0);
    EXPECT_EQ(error_of(f32_a), 0.0);
    EXPECT_EQ(error_of(f32_b), 0.0);
  }
}

// ---------------------------------------------------------------------------------------
// Log-sum-exp merge

TEST_F(gpu_ops, lse_merge_matches_cpu_including_empty_rows) {
  const std::int64_t tokens = 7, heads = 3;
  for (const std::int64_t dim : {40, 36}) {
    for (const dtype part_type : {dtype::bf16, dtype::f32}) {
      SCOPED_TRACE("dim " + std::to_string(dim) + " part " + std::string(dtype_name(part_type)));
      const head_layouts l{tokens, heads, dim};
      const twin out = f32_twin(shape{l.size()}, -2.0f, 2.0f);
      const twin part = random_twin(dtype::f32, part_type, shape{l.size()}, -2.0f, 2.0f);
      // lse token-major (ts 3, hs 1); lse_part head-major (ts 1, hs tokens + 1).
      std::vector<float> lse = random_values(tokens * heads, -3.0f, 5.0f);
      std::vector<float> lse_part = random_values(heads * (tokens + 1), -3.0f, 5.0f);
      lse[0] = neg_inf;                  // empty accumulator: takes the part
      lse_part[1 * (tokens + 1) + 2] = neg_inf;  // (t 2, h 1): empty part, changes nothing
      lse[2 * heads + 2] = neg_inf;      // (t 2, h 2) and its part both empty
      lse_part[2 * (tokens + 1) + 2] = neg_inf;
      lse[5 * heads + 1] = 80.0f;        // far apart: one side's weight underflows
      const twin lse_t = make_twin(dtype::f32, dtype::f32, shape{tokens * heads}, lse);
      const twin lse_part_t = make_twin(dtype::f32, dtype::f32, shape{heads * (tokens + 1)}, lse_part);
      for (const bool gpu_side : {false, true}) {
        auto pick = [&](const twin& t) -> const tensor& { return gpu_side ? t.on_gpu : t.on_cpu; };
        const lse_merge_args args{dim == 40 ? l.packed(pick(out)) : l.by_head(pick(out)),
                                  heads_of(pick(lse_t), 0, tokens, heads, 1, heads, 1),
                                  dim == 40 ? l.by_head(pick(part)) : l.by_token(pick(part)),
                                  heads_of(pick(lse_part_t), 0, tokens, heads, 1, 1, tokens + 1)};
        ops::lse_merge(gpu_side ? gpu() : cpu(), args);
      }
      EXPECT_LT(error_of(out), f32_tolerance);
      EXPECT_LT(error_of(lse_t), f32_tolerance);
    }
  }
}

}  // namespace
}  // namespace upipe
