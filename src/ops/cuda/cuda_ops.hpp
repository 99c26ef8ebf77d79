// The CUDA implementations of the ops (bf16 storage, fp32 accumulation), behind plain
// launchers: pointers and sizes come in the same argument structs as on the CPU, plus
// the stream. Only CUDA translation units and GPU tests include this header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <memory>

#include "ops/op_args.hpp"

namespace upipe::cuda {

// Elementwise, normalization, layout and loss kernels (ops/cuda/*.cu). Every launcher
// checks its launch with UPIPE_CUDA_CHECK and returns without synchronizing.
void rmsnorm_forward(const rmsnorm_forward_args& args, cudaStream_t stream);
void rmsnorm_backward(const rmsnorm_backward_args& args, cudaStream_t stream);
void rope(const rope_args& args, cudaStream_t stream);
void swiglu_forward(const swiglu_forward_args& args, cudaStream_t stream);
void swiglu_backward(const swiglu_backward_args& args, cudaStream_t stream);
void embedding_forward(const embedding_forward_args& args, cudaStream_t stream);
void embedding_backward(const embedding_backward_args& args, cudaStream_t stream);
void cross_entropy(const cross_entropy_args& args, cudaStream_t stream);
void adamw(const adamw_args& args, cudaStream_t stream);
void copy_heads(const head_view& dst, const head_view& src, cudaStream_t stream);
void add_heads(const head_view& dst, const head_view& src, cudaStream_t stream);
void fill_heads(const head_view& dst, float value, cudaStream_t stream);
void lse_merge(const lse_merge_args& args, cudaStream_t stream);
// Attention where the one query row sees one key (a one-token document), which cuDNN
// refuses: out = v, lse = scale q.k; backward d_v = the group's summed d_out, d_q = d_k = 0.
void single_key_attention_forward(const sdpa_forward_args& args, cudaStream_t stream);
void single_key_attention_backward(const sdpa_backward_args& args, cudaStream_t stream);
void add_f32(float* dst, const float* src, std::size_t count, cudaStream_t stream);
// Sum of squares of an f32 matrix into *result (device memory, one double), accumulated
// in fp64.
void sum_squares(const mat_view& x, double* result, cudaStream_t stream);

// Device scratch for the library engines, taken from the backend's arena (tag
// workspace) so the ledger sees it.
using scratch_fn = std::function<void*(std::size_t bytes)>;

// GEMM through cuBLASLt: a and b of one dtype (bf16 or f32), c bf16 or f32, fp32
// compute; the heuristic's choice is cached per shape; a 32 MiB workspace.
class gemm_engine {
 public:
  gemm_engine(cudaStream_t stream, const scratch_fn& scratch);
  ~gemm_engine();
  void run(const gemm_args& args);

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

// Fused attention through cuDNN: causal or unmasked, grouped-query heads, log-sum-exp
// output, strided views; plans built once per shape and cached.
class sdpa_engine {
 public:
  sdpa_engine(cudaStream_t stream, const scratch_fn& scratch);
  ~sdpa_engine();
  void forward(const sdpa_forward_args& args);
  void backward(const sdpa_backward_args& args);
  // cudnnGetVersion() of the library loaded at run time.
  static std::size_t library_version();

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace upipe::cuda
