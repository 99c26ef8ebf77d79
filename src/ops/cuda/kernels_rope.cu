// Rotate-half RoPE in place on a strided (tokens, heads, dim) view, bf16 or f32, as
// ops/cpu/rope.cpp. A thread takes one token and Width consecutive pairs: it forms their
// angles in fp64 (position * inverse frequency, reduced modulo 2 pi in fp64), keeps the
// fp32 cos and sin in registers and rotates those pairs of every head. Each angle is
// formed once whatever the head count: UPipe's stages hold one or two heads per rank, and
// the earlier kernel (a tile of angles in shared memory, then the heads) spent most of
// such a call forming angles with half its threads idle (issue #42: attn_rope 1.85 ms
// against Ulysses' 0.83 at 128K).
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
constexpr int rope_max_pairs = 128;  // head dim 256 in one launch; more loops over pair chunks

struct rope_params {
  void* x;
  std::int64_t token_stride, head_stride;
  int heads;
  int half;        // dim / 2: the offset of each pair's second element
  int pair_begin;  // the pairs [pair_begin, pair_begin + pair_count) of every head
  int pair_count;
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
  const std::int64_t total = p.run_end[p.run_count - 1];
  const int groups = p.pair_count / Width;
  const std::int64_t units = total * groups;
  T* const x = static_cast<T*>(p.x);
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < units;
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t u = k / groups;
    const int i = static_cast<int>(k - u * groups) * Width;
    int r = 0;
    while (u >= p.run_end[r]) ++r;
    const std::int64_t offset = u - (r > 0 ? p.run_end[r - 1] : 0);
    const double position = static_cast<double>(p.run_position[r] + offset);
    float c[Width], s[Width];
#pragma unroll
    for (int e = 0; e < Width; ++e) {
      rope_angle(position, p.inv_freq[i + e], c[e], s[e]);
      c[e] *= p.factor;
      s[e] *= p.factor * p.sign;
    }
    T* const token = x + (p.run_token[r] + offset) * p.token_stride + p.pair_begin + i;
    for (int h = 0; h < p.heads; ++h) {
      T* lo = token + h * p.head_stride;
      T* hi = lo + p.half;
      float a[Width], b[Width];
      load_vec<Width>(lo, a);
      load_vec<Width>(hi, b);
#pragma unroll
      for (int e = 0; e < Width; ++e) {
        const float x1 = a[e], x2 = b[e];
        a[e] = x1 * c[e] - x2 * s[e];
        b[e] = x2 * c[e] + x1 * s[e];
      }
      store_vec<Width>(lo, a);
      store_vec<Width>(hi, b);
    }
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
  const int width = vec ? rope_vector_pairs<T> : 1;
  const int grid = grid_for_units(rope_config, tokens * (params.pair_count / width));
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
