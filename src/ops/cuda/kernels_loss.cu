// Fused softmax cross-entropy on f32 logits, in place, as ops/cpu/cross_entropy.cpp: a
// block per row; one pass forms the running max and the fp64 sum of exp (online
// softmax), a second writes (softmax - onehot(label)) * grad_scale. Long aligned rows go
// to a cluster of blocks that keeps the row on chip and reads it once. The row's loss
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

// Long aligned rows (a 128K-token vocabulary is 512 KB of f32) are split over a cluster
// of blocks, each keeping its slice on chip: the first register_units float4 of a
// thread's share in registers (plain 16-byte loads), the rest in shared memory by one
// bulk asynchronous copy (the Hopper copy engine, completion counted on an mbarrier).
// The max and the sum of exp travel through distributed shared memory, so the logits are
// read from memory once and written once; keeping half of the slice in registers lets
// four blocks share a multiprocessor.
constexpr int cluster_blocks = 8;
constexpr int register_units = 8;  // float4 per thread held in registers
constexpr int cluster_min_blocks_per_sm = 4;
constexpr std::size_t cluster_shared_limit = 200 * 1024;  // bytes of shared memory per block

__device__ inline std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// Thread 0: starts the copy of `bytes` (a multiple of 16, both ends 16-byte aligned) into
// shared memory, completing `barrier`; every thread then waits for it with wait_bulk.
__device__ inline void start_bulk_load(void* dst, const void* src, std::uint32_t bytes, std::uint64_t* barrier) {
  const std::uint32_t bar = shared_address(barrier);
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_address(dst)),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

__device__ inline void wait_bulk(std::uint64_t* barrier) {
  const std::uint32_t bar = shared_address(barrier);
  std::uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar)
        : "memory");
}

__device__ inline float max4(const float4& v) { return fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)); }

__device__ inline float4 exp4_minus(const float4& v, float top) {
  return {expf(v.x - top), expf(v.y - top), expf(v.z - top), expf(v.w - top)};
}

// (e * factor) minus `hit` at index `at` - first of the four elements.
__device__ inline float4 gradient4(const float4& e, float factor, std::int64_t at, float hit) {
  return {e.x * factor - (at == 0 ? hit : 0.0f), e.y * factor - (at == 1 ? hit : 0.0f),
          e.z * factor - (at == 2 ? hit : 0.0f), e.w * factor - (at == 3 ? hit : 0.0f)};
}

__global__ void __cluster_dims__(cluster_blocks, 1, 1)
    __launch_bounds__(cross_entropy_config.threads, cluster_min_blocks_per_sm)
        cross_entropy_cluster_kernel(cross_entropy_params p, std::int64_t slice) {
  namespace cg = cooperative_groups;
  constexpr int threads = cross_entropy_config.threads;
  constexpr std::int64_t held = std::int64_t{register_units} * threads;  // float4 units in registers
  extern __shared__ float4 rest[];  // the slice's units from `held` on
  __shared__ float max_scratch[32];
  __shared__ double sum_scratch[32];
  __shared__ float block_top;
  __shared__ double block_sum;
  __shared__ alignas(8) std::uint64_t loaded;
  cg::cluster_group cluster = cg::this_cluster();
  const int part = static_cast<int>(cluster.block_rank());
  const std::int64_t row = blockIdx.x / cluster_blocks;
  const int tid = static_cast<int>(threadIdx.x);
  const std::int32_t label = p.labels[row * p.ld_labels];
  if (label >= p.vocab) trap_out_of_range("cross_entropy", "label", label, row, p.vocab);
  float* x = p.logits + row * p.ld_logits;
  const std::int64_t begin = part * slice, end = begin + slice < p.vocab ? begin + slice : p.vocab;
  const std::int64_t units = end > begin ? (end - begin) / 4 : 0;  // the launcher makes slices whole units
  auto* src = reinterpret_cast<float4*>(x + begin);
  if (label < 0) {  // masked: every block of the cluster takes this branch, no cluster sync
    for (std::int64_t j = tid; j < units; j += threads) src[j] = float4{0.0f, 0.0f, 0.0f, 0.0f};
    if (part == 0 && tid == 0) p.row_loss[row * p.ld_loss] = 0.0f;
    return;
  }
  const std::int64_t in_shared = units > held ? units - held : 0;
  if (tid == 0 && in_shared > 0)
    start_bulk_load(rest, src + held, static_cast<std::uint32_t>(in_shared * sizeof(float4)), &loaded);
  float4 reg[register_units];
  float top = -INFINITY;
#pragma unroll
  for (int k = 0; k < register_units; ++k) {
    const std::int64_t j = tid + std::int64_t{k} * threads;
    reg[k] = j < units ? src[j] : float4{-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    top = fmaxf(top, max4(reg[k]));
  }
  __syncthreads();  // the barrier is initialized before anyone waits on it
  if (in_shared > 0) wait_bulk(&loaded);
  for (std::int64_t j = tid; j < in_shared; j += threads) top = fmaxf(top, max4(rest[j]));
  // The label's logit, read by the thread that holds it before it becomes exp(x - top).
  const std::int64_t at = label - begin;  // the label's index in this slice, if it is here
  const bool label_here = at >= 0 && at < units * 4;
  const std::int64_t label_unit = at / 4;
  const bool owner = label_here && label_unit % threads == tid;
  float label_logit = 0.0f;
  if (owner) {
    float4 u = label_unit < held ? float4{} : rest[label_unit - held];
#pragma unroll
    for (int k = 0; k < register_units; ++k)
      if (label_unit == tid + std::int64_t{k} * threads) u = reg[k];
    const int e = static_cast<int>(at % 4);
    label_logit = e == 0 ? u.x : e == 1 ? u.y : e == 2 ? u.z : u.w;
  }
  // e = exp(x - this thread's max) in place, and their sum.
  float thread_sum = 0.0f;  // a few dozen terms of at most 1 per thread
  if (top != -INFINITY) {
#pragma unroll
    for (int k = 0; k < register_units; ++k) {
      reg[k] = exp4_minus(reg[k], top);  // padding (-inf) becomes 0
      thread_sum += (reg[k].x + reg[k].y) + (reg[k].z + reg[k].w);
    }
    for (std::int64_t j = tid; j < in_shared; j += threads) {
      const float4 e = exp4_minus(rest[j], top);
      rest[j] = e;
      thread_sum += (e.x + e.y) + (e.z + e.w);
    }
  }
  const float local_top = group_reduce<max_op, threads, threads>(top, max_scratch);
  const double local_sum = group_sum<threads, threads>(
      top == -INFINITY ? 0.0 : static_cast<double>(thread_sum) * static_cast<double>(expf(top - local_top)), sum_scratch);
  if (tid == 0) {
    block_top = local_top;
    block_sum = local_sum;
  }
  cluster.sync();
  float row_top = -INFINITY;
  for (int r = 0; r < cluster_blocks; ++r) row_top = fmaxf(row_top, *cluster.map_shared_rank(&block_top, r));
  double row_sum = 0.0;
  for (int r = 0; r < cluster_blocks; ++r) {
    const float t = *cluster.map_shared_rank(&block_top, r);
    if (t != -INFINITY) row_sum += *cluster.map_shared_rank(&block_sum, r) * static_cast<double>(expf(t - row_top));
  }
  const double lse = static_cast<double>(row_top) + log(row_sum);
  if (owner) p.row_loss[row * p.ld_loss] = static_cast<float>(lse - static_cast<double>(label_logit));
  // softmax = e * exp(top - lse); the elements of a thread whose values are all -inf are 0.
  const float factor = top == -INFINITY ? 0.0f : expf(top - static_cast<float>(lse)) * p.grad_scale;
  const float hit = p.grad_scale;  // subtracted at the label
  const std::int64_t miss = 8;     // an offset no float4 contains
#pragma unroll
  for (int k = 0; k < register_units; ++k) {
    const std::int64_t j = tid + std::int64_t{k} * threads;
    if (j < units) src[j] = gradient4(reg[k], factor, j == label_unit ? at % 4 : miss, hit);
  }
  for (std::int64_t j = tid; j < in_shared; j += threads)
    src[held + j] = gradient4(rest[j], factor, held + j == label_unit ? at % 4 : miss, hit);
  cluster.sync();  // the other blocks may still read this block's partials
}

}  // namespace

void run(const cross_entropy_args& args, const context& ctx) {
  const cudaStream_t stream = ctx.stream;
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
  // Long aligned rows that a cluster can hold take the single-read path; short ones gain
  // nothing, and unaligned ones take the block-per-row kernel (two reads).
  const std::int64_t slice = ceil_div(ceil_div(args.logits.cols, cluster_blocks), 4) * 4;  // whole float4 units
  const std::int64_t held = std::int64_t{register_units} * cross_entropy_config.threads * 4;
  const auto shared_bytes = static_cast<std::size_t>(slice > held ? slice - held : 0) * sizeof(float);
  const bool aligned = reinterpret_cast<std::uintptr_t>(args.logits.data) % 16 == 0 && args.logits.ld % 4 == 0 &&
                       args.logits.cols % 4 == 0;
  if (aligned && args.logits.cols >= 8192 && shared_bytes <= cluster_shared_limit && rows * cluster_blocks <= INT32_MAX) {
    launch("cross_entropy_cluster_kernel", cross_entropy_cluster_kernel, static_cast<int>(rows * cluster_blocks),
           cross_entropy_config, shared_bytes, stream, params, slice);
    return;
  }
  launch("cross_entropy_kernel", cross_entropy_kernel, grid_size(cross_entropy_config, rows), cross_entropy_config, 0,
         stream, params);
}

}  // namespace upipe::cuda
