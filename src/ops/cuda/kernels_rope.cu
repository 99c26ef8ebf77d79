// Rotate-half RoPE in place on a strided (tokens, heads, dim) view, bf16 or f32, as
// ops/cpu/rope.cpp. A block takes a tile of tokens: it first forms each (token, pair)
// angle in fp64 (position * inverse frequency, reduced modulo 2 pi in fp64) and keeps its
// fp32 cos and sin in shared memory, then rotates every head of those tokens with them.
// Positions come as runs passed by value, up to rope_max_runs a launch; the inverse
// frequencies (fp64, from ops::rope_inverse_frequencies) likewise, up to rope_max_pairs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"
#include "ops/rope_frequencies.hpp"

namespace upipe::cuda {

namespace {

using namespace kernels;

constexpr kernel_config rope_config{.threads = 256, .blocks_per_sm = 8};
constexpr int rope_max_runs = 8;
constexpr int rope_max_pairs = 128;      // head dim 256 in one launch; more loops over pair chunks
constexpr int rope_max_tile_tokens = 16;
constexpr int rope_tile_pairs = 2048;    // (token, head, pair) rotations a tile aims at

struct rope_params {
  void* x;
  std::int64_t token_stride, head_stride;
  int heads;
  int half;        // dim / 2: the offset of each pair's second element
  int pair_begin;  // the pairs [pair_begin, pair_begin + pair_count) of every head
  int pair_count;
  int tile_tokens;
  int run_count;
  float sign;    // +1 forward, -1 inverse (the transpose rotation)
  float factor;  // on cos and sin: yarn's attention factor, else 1
  std::int64_t run_token[rope_max_runs];     // first token of each run
  std::int64_t run_position[rope_max_runs];  // its position
  std::int64_t run_end[rope_max_runs];       // running sum of the counts: run r covers [end[r-1], end[r])
  double inv_freq[rope_max_pairs];           // of pairs pair_begin + i
};

// cos and sin of position * inv_freq, the product and its reduction to [-pi, pi] in fp64
// (a two-part 2 pi keeps the reduction exact to ~1e-16 * turns), so fp32 sincos sees a
// small argument and positions up to 1e7 keep full fp32 accuracy.
__device__ __forceinline__ void rope_angle(double position, double inv_freq, float& c, float& s) {
  constexpr double two_pi_hi = 6.283185307179586232e+00;
  constexpr double two_pi_lo = 2.449293598294706414e-16;
  constexpr double inv_two_pi = 1.591549430918953358e-01;
  const double angle = position * inv_freq;
  const double turns = rint(angle * inv_two_pi);
  double reduced = fma(-turns, two_pi_hi, angle);
  reduced = fma(-turns, two_pi_lo, reduced);
  sincosf(static_cast<float>(reduced), &s, &c);
}

// Width: pairs per access (16 bytes of each half when the layout allows, else 1).
template <class T, int Width>
__global__ void __launch_bounds__(rope_config.threads) rope_kernel(const __grid_constant__ rope_params p) {
  __shared__ float cos_tile[rope_max_tile_tokens * rope_max_pairs];
  __shared__ float sin_tile[rope_max_tile_tokens * rope_max_pairs];
  __shared__ std::int64_t token_tile[rope_max_tile_tokens];
  const std::int64_t total = p.run_end[p.run_count - 1];
  const std::int64_t tiles = (total + p.tile_tokens - 1) / p.tile_tokens;
  const int units_per_head = p.pair_count / Width;
  const int units_per_token = p.heads * units_per_head;
  T* const x = static_cast<T*>(p.x);
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const std::int64_t first = tile * p.tile_tokens;
    const int tokens = static_cast<int>(min(static_cast<std::int64_t>(p.tile_tokens), total - first));
    for (int k = threadIdx.x; k < tokens * p.pair_count; k += blockDim.x) {
      const int m = k / p.pair_count, i = k - m * p.pair_count;
      const std::int64_t u = first + m;
      int r = 0;
      while (u >= p.run_end[r]) ++r;
      const std::int64_t offset = u - (r > 0 ? p.run_end[r - 1] : 0);
      if (i == 0) token_tile[m] = p.run_token[r] + offset;
      float c, s;
      rope_angle(static_cast<double>(p.run_position[r] + offset), p.inv_freq[i], c, s);
      cos_tile[k] = p.factor * c;
      sin_tile[k] = p.factor * p.sign * s;
    }
    __syncthreads();
    for (int k = threadIdx.x; k < tokens * units_per_token; k += blockDim.x) {
      const int m = k / units_per_token, rest = k - m * units_per_token;
      const int h = rest / units_per_head, i = (rest - h * units_per_head) * Width;
      T* lo = x + token_tile[m] * p.token_stride + h * p.head_stride + p.pair_begin + i;
      T* hi = lo + p.half;
      float a[Width], b[Width];
      load_vec<Width>(lo, a);
      load_vec<Width>(hi, b);
      const float* c = cos_tile + m * p.pair_count + i;
      const float* s = sin_tile + m * p.pair_count + i;
#pragma unroll
      for (int e = 0; e < Width; ++e) {
        const float x1 = a[e], x2 = b[e];
        a[e] = x1 * c[e] - x2 * s[e];
        b[e] = x2 * c[e] + x1 * s[e];
      }
      store_vec<Width>(lo, a);
      store_vec<Width>(hi, b);
    }
    __syncthreads();
  }
}

// 16 bytes of pairs per access when every head's halves start on 16-byte boundaries.
template <class T>
constexpr int rope_vector_pairs = 16 / static_cast<int>(sizeof(T));

template <class T>
bool rope_vectorizable(const head_view& x) {
  constexpr auto width = rope_vector_pairs<T>;
  const auto bytes = static_cast<std::int64_t>(sizeof(T));
  return aligned16(x.data) && (x.dim / 2) % width == 0 && (x.tokens <= 1 || x.token_stride * bytes % 16 == 0) &&
         (x.heads <= 1 || x.head_stride * bytes % 16 == 0);
}

template <class T>
void launch_rope(rope_params& params, std::int64_t tokens, cudaStream_t stream, bool vec) {
  const int pairs_per_token = std::max(1, params.heads * params.pair_count);
  params.tile_tokens = std::clamp(rope_tile_pairs / pairs_per_token, 1, rope_max_tile_tokens);
  const int grid = grid_size(rope_config, ceil_div(tokens, params.tile_tokens));
  if (vec)
    launch("rope_kernel<vector>", rope_kernel<T, rope_vector_pairs<T>>, grid, rope_config, 0, stream, params);
  else
    launch("rope_kernel<scalar>", rope_kernel<T, 1>, grid, rope_config, 0, stream, params);
}

}  // namespace

void run(const rope_args& args, const context& ctx) {
  const cudaStream_t stream = ctx.stream;
  const head_view& x = args.x;
  const std::int64_t half = x.dim / 2;
  if (half == 0 || x.heads == 0) return;
  const std::vector<double> inv_freq = ops::rope_inverse_frequencies(args.config, x.dim);
  std::vector<position_run> runs;
  for (const position_run& run : args.positions)
    if (run.count > 0) runs.push_back(run);
  rope_params params{};
  params.x = x.data;
  params.token_stride = x.token_stride;
  params.head_stride = x.head_stride;
  params.heads = static_cast<int>(x.heads);
  params.half = static_cast<int>(half);
  params.sign = args.direction == rope_direction::forward ? 1.0f : -1.0f;
  params.factor = static_cast<float>(ops::rope_attention_factor(args.config));
  with_types(
      [&](auto type) {
        using T = typename decltype(type)::type;
        const bool vec = rope_vectorizable<T>(x);
        for (std::size_t first_run = 0; first_run < runs.size(); first_run += rope_max_runs) {
          const std::size_t run_count = std::min<std::size_t>(rope_max_runs, runs.size() - first_run);
          params.run_count = static_cast<int>(run_count);
          std::int64_t end = 0;
          for (std::size_t r = 0; r < run_count; ++r) {
            const position_run& run = runs[first_run + r];
            end += run.count;
            params.run_token[r] = run.token_begin;
            params.run_position[r] = run.position_begin;
            params.run_end[r] = end;
          }
          for (std::int64_t pair_begin = 0; pair_begin < half; pair_begin += rope_max_pairs) {
            params.pair_begin = static_cast<int>(pair_begin);
            params.pair_count = static_cast<int>(std::min<std::int64_t>(rope_max_pairs, half - pair_begin));
            std::copy_n(inv_freq.begin() + pair_begin, params.pair_count, params.inv_freq);
            launch_rope<T>(params, end, stream, vec);
          }
        }
      },
      x.type);
}

}  // namespace upipe::cuda
