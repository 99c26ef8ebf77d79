// Fused softmax cross-entropy on f32 logits, in place, as ops/cpu/cross_entropy.cpp: a
// block per row; one pass forms the running max and the fp64 sum of exp (online
// softmax), a second writes (softmax - onehot(label)) * grad_scale. The row's loss
// (logsumexp - logit[label]) goes to row_loss; rows with a negative label get zeros.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/kernels_common.cuh"

namespace upipe::cuda {

namespace {

using namespace kernels;

constexpr kernel_config cross_entropy_config{.threads = 256, .blocks_per_sm = 8};
constexpr int vec_width = 4;  // floats per 16-byte access

struct cross_entropy_params {
  float* logits;  // (rows, vocab), ld_logits; replaced by the gradient
  const std::int32_t* labels;
  float* row_loss;
  std::int64_t rows, vocab, ld_logits, ld_labels, ld_loss;
  float grad_scale;
};

__global__ void __launch_bounds__(cross_entropy_config.threads) cross_entropy_kernel(cross_entropy_params p) {
  constexpr int threads = cross_entropy_config.threads;
  __shared__ float max_scratch[32];
  __shared__ double sum_scratch[32];
  const int tid = static_cast<int>(threadIdx.x);
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const std::int32_t label = p.labels[row * p.ld_labels];
    if (label >= p.vocab) trap_out_of_range("cross_entropy", "label", label, row, p.vocab);
    float* x = p.logits + row * p.ld_logits;
    const bool vec = is_aligned16(x);
    if (label < 0) {  // masked: zero gradient, zero loss
      for_each_chunk<vec_width>(p.vocab, vec, tid, threads, [&](std::int64_t j, auto width) {
        constexpr int w = decltype(width)::value;
        const float zeros[w] = {};
        store_vec<w>(x + j, zeros);
      });
      if (tid == 0) p.row_loss[row * p.ld_loss] = 0.0f;
      continue;
    }
    // Read before any thread overwrites it in the second pass (the reductions sync).
    const float label_logit = tid == 0 ? x[label] : 0.0f;
    float top = -INFINITY;
    double sum = 0.0;  // of exp(x - top)
    for_each_chunk<vec_width>(p.vocab, vec, tid, threads, [&](std::int64_t j, auto width) {
      constexpr int w = decltype(width)::value;
      float v[w];
      load_vec<w>(x + j, v);
      float chunk_top = v[0];
#pragma unroll
      for (int e = 1; e < w; ++e) chunk_top = fmaxf(chunk_top, v[e]);
      if (chunk_top > top) {
        sum *= static_cast<double>(expf(top - chunk_top));
        top = chunk_top;
      }
      if (top == -INFINITY) return;  // only -inf so far: nothing to add
#pragma unroll
      for (int e = 0; e < w; ++e) sum += static_cast<double>(expf(v[e] - top));
    });
    const float row_top = group_reduce<max_op, threads, threads>(top, max_scratch);
    const double scaled = top == -INFINITY ? 0.0 : sum * static_cast<double>(expf(top - row_top));
    const double row_sum = group_sum<threads, threads>(scaled, sum_scratch);
    const double lse = static_cast<double>(row_top) + log(row_sum);
    if (tid == 0) p.row_loss[row * p.ld_loss] = static_cast<float>(lse - static_cast<double>(label_logit));
    const auto lse_f = static_cast<float>(lse);
    for_each_chunk<vec_width>(p.vocab, vec, tid, threads, [&](std::int64_t j, auto width) {
      constexpr int w = decltype(width)::value;
      float v[w];
      load_vec<w>(x + j, v);
#pragma unroll
      for (int e = 0; e < w; ++e) {
        const float onehot = j + e == label ? 1.0f : 0.0f;
        v[e] = (expf(v[e] - lse_f) - onehot) * p.grad_scale;
      }
      store_vec<w>(x + j, v);
    });
  }
}

}  // namespace

void cross_entropy(const cross_entropy_args& args, cudaStream_t stream) {
  const std::int64_t rows = args.logits.rows;
  if (rows == 0) return;
  const cross_entropy_params params{static_cast<float*>(args.logits.data),
                                    static_cast<const std::int32_t*>(args.labels.data),
                                    static_cast<float*>(args.row_loss.data),
                                    rows,
                                    args.logits.cols,
                                    args.logits.ld,
                                    args.labels.ld,
                                    args.row_loss.ld,
                                    args.grad_scale};
  launch("cross_entropy_kernel", cross_entropy_kernel, grid_size(cross_entropy_config, rows), cross_entropy_config, 0,
         stream, params);
}

}  // namespace upipe::cuda
