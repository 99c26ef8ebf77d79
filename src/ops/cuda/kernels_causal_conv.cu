// Gated DeltaNet's causal depthwise conv (then SiLU) and its gates on the GPU, in fp32 as
// ops/cpu/causal_conv.cpp. The document starts a launch needs come in its parameters (as
// rope's position runs do), up to conv_max_resets of them: the rows are cut into ranges
// with at most that many starts within their reach. d_weight and the gates' parameter
// gradients are column sums: each block adds one partial per column with an atomic, so
// their last bits vary with the order of the blocks (as bias_grad's).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"
#include "ops/gated_delta/block.hpp"

namespace upipe::cuda {

namespace {

using namespace kernels;
using gated_delta::element;

constexpr kernel_config conv_config{.threads = 256, .blocks_per_sm = 8};
constexpr int conv_max_resets = 64;
constexpr int conv_max_taps = 8;
constexpr int resets_per_range = 32;  // leaves room for the starts within a range's reach

// A matrix of f32 or bf16: element (r, c) at data[r * ld + c].
struct any_matrix {
  void* data = nullptr;
  element type = element::f32;
  std::int64_t ld = 0;
  __device__ __forceinline__ float load(std::int64_t r, std::int64_t c) const {
    const std::int64_t at = r * ld + c;
    if (type == element::f32) return static_cast<const float*>(data)[at];
    return gated_delta::bf16_bits_to_float(static_cast<const std::uint16_t*>(data)[at]);
  }
  __device__ __forceinline__ void store(std::int64_t r, std::int64_t c, float v) const {
    const std::int64_t at = r * ld + c;
    if (type == element::f32)
      static_cast<float*>(data)[at] = v;
    else
      static_cast<std::uint16_t*>(data)[at] = gated_delta::float_to_bf16_bits(v);
  }
};

any_matrix matrix_of(const mat_view& m) {
  return {m.data, m.type == dtype::bf16 ? element::bf16 : element::f32, m.ld};
}

struct conv_params {
  any_matrix x, halo, weight, y, d_y, d_x, d_halo;
  float* d_weight = nullptr;
  std::int64_t d_weight_ld = 0;
  std::int64_t rows = 0, channels = 0, halo_rows = 0;
  int taps = 0;
  std::int64_t lo = 0, hi = 0;  // the launch's rows (outputs in forward, inputs in backward)
  int resets = 0;
  std::int64_t reset_rows[conv_max_resets] = {};
};

// The first row (negative: the halo's) that output row t may read.
__device__ __forceinline__ std::int64_t first_readable(const conv_params& p, std::int64_t t) {
  std::int64_t first = -p.halo_rows;
  for (int n = 0; n < p.resets; ++n)
    if (p.reset_rows[n] <= t && p.reset_rows[n] > first) first = p.reset_rows[n];
  return first;
}

__device__ __forceinline__ float conv_input(const conv_params& p, std::int64_t r, std::int64_t c) {
  return r >= 0 ? p.x.load(r, c) : p.halo.load(p.halo_rows + r, c);
}

// The conv's pre-activation at output row t, channel c.
__device__ __forceinline__ float conv_sum(const conv_params& p, std::int64_t t, std::int64_t c) {
  const std::int64_t first = first_readable(p, t);
  float z = 0.0f;
  for (int j = 0; j < p.taps; ++j) {
    const std::int64_t r = t - (p.taps - 1) + j;
    if (r >= first) z += p.weight.load(c, j) * conv_input(p, r, c);
  }
  return z;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void __launch_bounds__(conv_config.threads) conv_forward_kernel(const conv_params p) {
  const std::int64_t n = (p.hi - p.lo) * p.channels;
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
    const std::int64_t t = p.lo + e / p.channels, c = e % p.channels;
    const float z = conv_sum(p, t, c);
    p.y.store(t, c, z * sigmoid(z));
  }
}

// dz at output row t (0 outside the sequence).
__device__ __forceinline__ float conv_dz(const conv_params& p, std::int64_t t, std::int64_t c) {
  if (t < 0 || t >= p.rows) return 0.0f;
  const float z = conv_sum(p, t, c), s = sigmoid(z);
  return p.d_y.load(t, c) * s * (1.0f + z * (1.0f - s));
}

// d_x and d_halo: input row r (negative: the halo's) gathers the taps that read it.
__global__ void __launch_bounds__(conv_config.threads) conv_input_grad_kernel(const conv_params p) {
  const std::int64_t n = (p.hi - p.lo) * p.channels;
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
    const std::int64_t r = p.lo + e / p.channels, c = e % p.channels;
    float sum = 0.0f;
    for (int j = 0; j < p.taps; ++j) {
      const std::int64_t t = r + (p.taps - 1) - j;
      if (t < p.rows && r >= first_readable(p, t)) sum += conv_dz(p, t, c) * p.weight.load(c, j);
    }
    if (r >= 0)
      p.d_x.store(r, c, sum);
    else if (p.d_halo.data != nullptr)
      p.d_halo.store(p.halo_rows + r, c, sum);
  }
}

// d_weight[c, j] += sum over output rows t of dz(t) x(t - taps + 1 + j): blocks of 32
// channels x 8 row lanes over ranges of rows, one atomic per (channel, tap) a block.
constexpr int weight_columns = 32, weight_lanes = conv_config.threads / weight_columns;

__global__ void __launch_bounds__(conv_config.threads)
    conv_weight_grad_kernel(const conv_params p, std::int64_t rows_per_block, std::int64_t column_blocks) {
  __shared__ float partial[weight_lanes][weight_columns][conv_max_taps];
  const int lane = static_cast<int>(threadIdx.x) % weight_columns, row_lane = static_cast<int>(threadIdx.x) / weight_columns;
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) % column_blocks * weight_columns + lane;
  const std::int64_t first = p.lo + static_cast<std::int64_t>(blockIdx.x) / column_blocks * rows_per_block;
  const std::int64_t last = first + rows_per_block < p.hi ? first + rows_per_block : p.hi;
  float sum[conv_max_taps] = {};
  if (c < p.channels)
    for (std::int64_t t = first + row_lane; t < last; t += weight_lanes) {
      const float dz = conv_dz(p, t, c);
      const std::int64_t readable = first_readable(p, t);
      for (int j = 0; j < p.taps; ++j) {
        const std::int64_t r = t - (p.taps - 1) + j;
        if (r >= readable) sum[j] += dz * conv_input(p, r, c);
      }
    }
  for (int j = 0; j < conv_max_taps; ++j) partial[row_lane][lane][j] = sum[j];
  __syncthreads();
  if (row_lane != 0 || c >= p.channels) return;
  for (int j = 0; j < p.taps; ++j) {
    float total = 0.0f;
    for (int k = 0; k < weight_lanes; ++k) total += partial[k][lane][j];
    atomicAdd(p.d_weight + c * p.d_weight_ld + j, total);
  }
}

// Row ranges [lo, hi) of [begin, end) with at most resets_per_range document starts each;
// a range's parameters carry the starts within `reach` rows of it.
struct row_range {
  std::int64_t lo, hi;
};
std::vector<row_range> ranges_of(const std::vector<std::int64_t>& resets, std::int64_t begin, std::int64_t end) {
  std::vector<row_range> out;
  std::int64_t lo = begin;
  for (std::size_t n = resets_per_range; n < resets.size(); n += resets_per_range)
    if (resets[n] > lo && resets[n] < end) {
      out.push_back({lo, resets[n]});
      lo = resets[n];
    }
  out.push_back({lo, end});
  return out;
}

void carry_resets(conv_params& p, const std::vector<std::int64_t>& resets, std::int64_t reach) {
  p.resets = 0;
  for (const std::int64_t r : resets)
    if (r >= p.lo - reach && r < p.hi + reach) {
      UPIPE_CHECK(p.resets < conv_max_resets, "causal conv: too many document starts near rows [" +
                                                  std::to_string(p.lo) + ", " + std::to_string(p.hi) + ")");
      p.reset_rows[p.resets++] = r;
    }
}

conv_params conv_common(const mat_view& x, const mat_view& halo, const mat_view& weight,
                        const sequence_documents& documents, std::vector<std::int64_t>& resets) {
  if (weight.cols > conv_max_taps)
    throw config_error("the cuda causal conv takes kernels of up to " + std::to_string(conv_max_taps) +
                       " taps, not " + std::to_string(weight.cols) + " (linear_conv_kernel_dim is 4 in every config)");
  conv_params p;
  p.x = matrix_of(x);
  p.halo = matrix_of(halo);
  p.weight = matrix_of(weight);
  p.rows = x.rows;
  p.channels = x.cols;
  p.halo_rows = halo.rows;
  p.taps = static_cast<int>(weight.cols);
  for (const std::int64_t start : documents.starts)
    if (start >= documents.first && start < documents.first + x.rows) resets.push_back(start - documents.first);
  return p;
}

}  // namespace

void run(const causal_conv_forward_args& args, const context& ctx) {
  std::vector<std::int64_t> resets;
  conv_params p = conv_common(args.x, args.halo, args.weight, args.documents, resets);
  p.y = matrix_of(args.y);
  for (const row_range& r : ranges_of(resets, 0, p.rows)) {
    p.lo = r.lo;
    p.hi = r.hi;
    carry_resets(p, resets, p.taps);
    if (p.hi > p.lo && p.channels > 0)
      launch("conv_forward_kernel", conv_forward_kernel, grid_for_units(conv_config, (p.hi - p.lo) * p.channels),
             conv_config, 0, ctx.stream, p);
  }
}

void run(const causal_conv_backward_args& args, const context& ctx) {
  std::vector<std::int64_t> resets;
  conv_params p = conv_common(args.x, args.halo, args.weight, args.documents, resets);
  p.d_y = matrix_of(args.d_y);
  p.d_x = matrix_of(args.d_x);
  p.d_halo = args.d_halo.rows > 0 ? matrix_of(args.d_halo) : any_matrix{};
  p.d_weight = static_cast<float*>(args.d_weight.data);
  p.d_weight_ld = args.d_weight.ld;
  if (p.channels == 0) return;
  // Inputs: the halo's rows (negative) and the sequence's; their taps reach taps - 1 rows on.
  for (const row_range& r : ranges_of(resets, -p.halo_rows, p.rows)) {
    p.lo = r.lo;
    p.hi = r.hi;
    carry_resets(p, resets, 2 * p.taps);
    if (p.hi > p.lo)
      launch("conv_input_grad_kernel", conv_input_grad_kernel,
             grid_for_units(conv_config, (p.hi - p.lo) * p.channels), conv_config, 0, ctx.stream, p);
  }
  if (args.d_weight.rows == 0) return;
  const std::int64_t column_blocks = ceil_div(p.channels, weight_columns);
  for (const row_range& r : ranges_of(resets, 0, p.rows)) {
    p.lo = r.lo;
    p.hi = r.hi;
    carry_resets(p, resets, p.taps);
    if (p.hi <= p.lo) continue;
    const std::int64_t wanted = static_cast<std::int64_t>(multiprocessor_count()) * conv_config.blocks_per_sm;
    const std::int64_t ranges = std::max<std::int64_t>(
        1, std::min(ceil_div(wanted, column_blocks), ceil_div(p.hi - p.lo, std::int64_t{64})));
    const std::int64_t rows_per_block = ceil_div(p.hi - p.lo, ranges);
    const auto grid = static_cast<int>(column_blocks * ceil_div(p.hi - p.lo, rows_per_block));
    launch("conv_weight_grad_kernel", conv_weight_grad_kernel, grid, conv_config, 0, ctx.stream, p, rows_per_block,
           column_blocks);
  }
}

namespace {

struct gate_params {
  any_matrix a, b, a_log, dt_bias;
  float* g = nullptr;
  float* beta = nullptr;
  const float* d_g = nullptr;
  const float* d_beta = nullptr;
  std::int64_t g_ld = 0, beta_ld = 0, d_g_ld = 0, d_beta_ld = 0;
  any_matrix d_a, d_b;
  float* d_a_log = nullptr;
  float* d_dt_bias = nullptr;
  std::int64_t rows = 0, heads = 0;
};

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__global__ void __launch_bounds__(conv_config.threads) gates_forward_kernel(const gate_params p) {
  const std::int64_t n = p.rows * p.heads, stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
    const std::int64_t t = e / p.heads, h = e % p.heads;
    p.g[t * p.g_ld + h] = -expf(p.a_log.load(0, h)) * softplus(p.a.load(t, h) + p.dt_bias.load(0, h));
    p.beta[t * p.beta_ld + h] = sigmoid(p.b.load(t, h));
  }
}

// One block per range of rows, a thread per head (heads <= 256): d_a and d_b per element,
// the column sums of d_a (d_dt_bias) and of g d_g (d_a_log) as one atomic per head a block.
constexpr std::int64_t gate_rows_per_block = 256;

__global__ void __launch_bounds__(conv_config.threads) gates_backward_kernel(const gate_params p) {
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * gate_rows_per_block;
  const std::int64_t last = first + gate_rows_per_block < p.rows ? first + gate_rows_per_block : p.rows;
  const std::int64_t h = threadIdx.x;
  if (h >= p.heads) return;
  float d_dt = 0.0f, d_log = 0.0f;
  for (std::int64_t t = first; t < last; ++t) {
    const float x = p.a.load(t, h) + p.dt_bias.load(0, h), e = expf(p.a_log.load(0, h));
    const float dg = p.d_g[t * p.d_g_ld + h], da = -e * (x > 20.0f ? 1.0f : sigmoid(x)) * dg;
    p.d_a.store(t, h, da);
    d_dt += da;
    d_log += -e * softplus(x) * dg;
    const float beta = sigmoid(p.b.load(t, h));
    p.d_b.store(t, h, p.d_beta[t * p.d_beta_ld + h] * beta * (1.0f - beta));
  }
  if (p.d_dt_bias != nullptr) atomicAdd(p.d_dt_bias + h, d_dt);
  if (p.d_a_log != nullptr) atomicAdd(p.d_a_log + h, d_log);
}

gate_params gate_common(const mat_view& a, const mat_view& b, const mat_view& a_log, const mat_view& dt_bias) {
  gate_params p;
  p.a = matrix_of(a);
  p.b = matrix_of(b);
  p.a_log = matrix_of(a_log);
  p.dt_bias = matrix_of(dt_bias);
  p.rows = a.rows;
  p.heads = a.cols;
  return p;
}

}  // namespace

void run(const gated_delta_gates_forward_args& args, const context& ctx) {
  gate_params p = gate_common(args.a, args.b, args.a_log, args.dt_bias);
  p.g = static_cast<float*>(args.g.data);
  p.g_ld = args.g.ld;
  p.beta = static_cast<float*>(args.beta.data);
  p.beta_ld = args.beta.ld;
  if (p.rows * p.heads == 0) return;
  launch("gates_forward_kernel", gates_forward_kernel, grid_for_units(conv_config, p.rows * p.heads), conv_config, 0,
         ctx.stream, p);
}

void run(const gated_delta_gates_backward_args& args, const context& ctx) {
  gate_params p = gate_common(args.a, args.b, args.a_log, args.dt_bias);
  if (p.heads > conv_config.threads)
    throw config_error("the cuda Gated DeltaNet gates take up to " + std::to_string(conv_config.threads) +
                       " value heads, not " + std::to_string(p.heads));
  p.d_g = static_cast<const float*>(args.d_g.data);
  p.d_g_ld = args.d_g.ld;
  p.d_beta = static_cast<const float*>(args.d_beta.data);
  p.d_beta_ld = args.d_beta.ld;
  p.d_a = matrix_of(args.d_a);
  p.d_b = matrix_of(args.d_b);
  p.d_a_log = args.d_a_log.rows > 0 ? static_cast<float*>(args.d_a_log.data) : nullptr;
  p.d_dt_bias = args.d_dt_bias.rows > 0 ? static_cast<float*>(args.d_dt_bias.data) : nullptr;
  if (p.rows * p.heads == 0) return;
  launch("gates_backward_kernel", gates_backward_kernel, static_cast<int>(ceil_div(p.rows, gate_rows_per_block)),
         conv_config, 0, ctx.stream, p);
}

}  // namespace upipe::cuda
