// Fused softmax cross-entropy on f32 logits, in place, as ops/cpu/cross_entropy.cpp: a
// block per row; one pass forms the running max and the fp64 sum of exp (online
// softmax), a second writes (softmax - onehot(label)) * grad_scale. Long rows go to a
// cluster of blocks that keeps the row on chip and reads it once. The row's loss
// (logsumexp - logit[label]) goes to row_loss; rows with a negative label get zeros.
#include <cooperative_groups.h>
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

// Rows too long to keep in one block's shared memory (a 128K-token vocabulary is 512 KB
// of f32) are split over a cluster of blocks, each keeping its slice on chip: the max
// and the sum of exp travel through distributed shared memory, so the logits are read
// from memory once and written once.
constexpr int cluster_blocks = 8;
constexpr std::size_t cluster_slice_limit = 200 * 1024;  // bytes of shared memory per block

__global__ void __cluster_dims__(cluster_blocks, 1, 1) __launch_bounds__(cross_entropy_config.threads)
    cross_entropy_cluster_kernel(cross_entropy_params p, std::int64_t slice) {
  namespace cg = cooperative_groups;
  constexpr int threads = cross_entropy_config.threads;
  extern __shared__ float4 slice_storage[];
  float* cache = reinterpret_cast<float*>(slice_storage);
  __shared__ float max_scratch[32];
  __shared__ double sum_scratch[32];
  __shared__ float block_top;
  __shared__ double block_sum;
  cg::cluster_group cluster = cg::this_cluster();
  const int part = static_cast<int>(cluster.block_rank());
  const std::int64_t row = blockIdx.x / cluster_blocks;
  const int tid = static_cast<int>(threadIdx.x);
  const std::int32_t label = p.labels[row * p.ld_labels];
  if (label >= p.vocab) trap_out_of_range("cross_entropy", "label", label, row, p.vocab);
  float* x = p.logits + row * p.ld_logits;
  const std::int64_t begin = part * slice, end = begin + slice < p.vocab ? begin + slice : p.vocab;
  const std::int64_t n = end > begin ? end - begin : 0;
  if (label < 0) {  // masked: every block of the cluster takes this branch, no cluster sync
    for (std::int64_t j = tid; j < n; j += threads) x[begin + j] = 0.0f;
    if (part == 0 && tid == 0) p.row_loss[row * p.ld_loss] = 0.0f;
    return;
  }
  // 16-byte accesses when the slice starts aligned (the usual case: a vocabulary that is a
  // multiple of 32 and an aligned row), element by element otherwise.
  const bool vec = n % 4 == 0 && reinterpret_cast<std::uintptr_t>(x + begin) % 16 == 0;
  float top = -INFINITY;
  if (vec) {
    const auto* src = reinterpret_cast<const float4*>(x + begin);
    for (std::int64_t j = tid; j < n / 4; j += threads) {
      const float4 v = src[j];
      slice_storage[j] = v;
      top = fmaxf(top, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
    }
  } else {
    for (std::int64_t j = tid; j < n; j += threads) {
      const float v = x[begin + j];
      cache[j] = v;
      top = fmaxf(top, v);
    }
  }
  top = group_reduce<max_op, threads, threads>(top, max_scratch);
  if (tid == 0) block_top = top;
  cluster.sync();
  float row_top = -INFINITY;
  for (int r = 0; r < cluster_blocks; ++r) row_top = fmaxf(row_top, *cluster.map_shared_rank(&block_top, r));
  float thread_sum = 0.0f;  // a few dozen terms per thread; the block and cluster sums are fp64
  if (row_top != -INFINITY)
    for (std::int64_t j = tid; j < n; j += threads) thread_sum += expf(cache[j] - row_top);
  const double sum = group_sum<threads, threads>(static_cast<double>(thread_sum), sum_scratch);
  if (tid == 0) block_sum = sum;
  cluster.sync();
  double row_sum = 0.0;
  for (int r = 0; r < cluster_blocks; ++r) row_sum += *cluster.map_shared_rank(&block_sum, r);
  const double lse = static_cast<double>(row_top) + log(row_sum);
  if (tid == 0 && label >= begin && label < end)
    p.row_loss[row * p.ld_loss] = static_cast<float>(lse - static_cast<double>(cache[label - begin]));
  const auto lse_f = static_cast<float>(lse);
  if (vec) {
    auto* dst = reinterpret_cast<float4*>(x + begin);
    for (std::int64_t j = tid; j < n / 4; j += threads) {
      float4 v = slice_storage[j];
      v.x = expf(v.x - lse_f) * p.grad_scale;
      v.y = expf(v.y - lse_f) * p.grad_scale;
      v.z = expf(v.z - lse_f) * p.grad_scale;
      v.w = expf(v.w - lse_f) * p.grad_scale;
      dst[j] = v;
    }
    __syncthreads();  // the label's element is fixed after the vector stores
    if (tid == 0 && label >= begin && label < end) x[label] -= p.grad_scale;
  } else {
    for (std::int64_t j = tid; j < n; j += threads) {
      const float onehot = begin + j == label ? 1.0f : 0.0f;
      x[begin + j] = (expf(cache[j] - lse_f) - onehot) * p.grad_scale;
    }
  }
  cluster.sync();  // the other blocks may still read this block's partials
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
  const std::int64_t slice = (args.logits.cols + cluster_blocks - 1) / cluster_blocks;
  const auto slice_bytes = static_cast<std::size_t>(slice) * sizeof(float);
  // Long rows that a cluster can hold take the single-read path; short ones gain nothing.
  if (args.logits.cols >= 8192 && slice_bytes <= cluster_slice_limit && rows * cluster_blocks <= INT32_MAX) {
    launch("cross_entropy_cluster_kernel", cross_entropy_cluster_kernel, static_cast<int>(rows * cluster_blocks),
           cross_entropy_config, slice_bytes, stream, params, slice);
    return;
  }
  launch("cross_entropy_kernel", cross_entropy_kernel, grid_size(cross_entropy_config, rows), cross_entropy_config, 0,
         stream, params);
}

}  // namespace upipe::cuda
