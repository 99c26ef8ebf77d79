// The CUDA implementations of the ops (bf16 storage, fp32 accumulation), behind plain
// launchers: pointers and sizes come in the same argument structs as on the CPU, plus
// a context (the stream, the library engines, scratch). Only CUDA translation units and
// GPU tests include this header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "core/dtype.hpp"
#include "ops/op_args.hpp"

namespace upipe::cuda {

class gemm_engine;
class sdpa_engine;
class grouped_gemm_engine;

// What an op runs with on the GPU: the backend's stream, its library engines and its
// device scratch. A launcher that needs only the stream takes context{.stream = s}.
struct context {
  cudaStream_t stream = nullptr;
  gemm_engine* gemm = nullptr;    // gemm_args
  sdpa_engine* sdpa = nullptr;    // sdpa_forward_args, sdpa_backward_args
  double* sum_result = nullptr;   // (1) f64 device memory, sum_squares_args
  grouped_gemm_engine* grouped = nullptr;  // moe_grouped_gemm_args
};

// One launcher per op, named run so that the CUDA backend dispatches an `op` with one
// std::visit (ops/cuda/*.cu, gemm_cublaslt.cpp, sdpa_cudnn.cpp). Every launcher checks
// its launch with UPIPE_CUDA_CHECK and returns without synchronizing, except where a
// result goes to host memory (sum_squares: copied on the stream, read once it is done).
void run(const gemm_args& args, const context& ctx);
void run(const sdpa_forward_args& args, const context& ctx);
void run(const sdpa_backward_args& args, const context& ctx);
void run(const rope_args& args, const context& ctx);
void run(const rmsnorm_forward_args& args, const context& ctx);
void run(const rmsnorm_backward_args& args, const context& ctx);
void run(const copy_heads_args& args, const context& ctx);
void run(const add_heads_args& args, const context& ctx);
void run(const fill_heads_args& args, const context& ctx);
void run(const lse_merge_args& args, const context& ctx);
void run(const embedding_forward_args& args, const context& ctx);
void run(const embedding_backward_args& args, const context& ctx);
void run(const swiglu_forward_args& args, const context& ctx);
void run(const swiglu_backward_args& args, const context& ctx);
void run(const bias_add_args& args, const context& ctx);
void run(const bias_grad_args& args, const context& ctx);
void run(const moe_route_args& args, const context& ctx);
void run(const moe_route_backward_args& args, const context& ctx);
void run(const moe_dispatch_args& args, const context& ctx);
void run(const moe_permute_args& args, const context& ctx);
void run(const moe_combine_args& args, const context& ctx);
void run(const moe_combine_backward_args& args, const context& ctx);
void run(const moe_balance_args& args, const context& ctx);
// Through ctx.grouped: CUTLASS never waits; cuBLAS reads the groups' sizes on the host
// (the stream synchronized once a call).
void run(const moe_grouped_gemm_args& args, const context& ctx);
void run(const sigmoid_gate_backward_args& args, const context& ctx);
void run(const cross_entropy_args& args, const context& ctx);
void run(const adamw_args& args, const context& ctx);
void run(const sum_squares_args& args, const context& ctx);
// Gated DeltaNet (kernels_gated_delta.cu, kernels_causal_conv.cu).
void run(const gated_delta_forward_args& args, const context& ctx);
void run(const gated_delta_backward_args& args, const context& ctx);
void run(const gated_delta_summary_args& args, const context& ctx);
void run(const gated_delta_summary_backward_args& args, const context& ctx);
void run(const gated_delta_scan_args& args, const context& ctx);
void run(const causal_conv_forward_args& args, const context& ctx);
void run(const causal_conv_backward_args& args, const context& ctx);
void run(const gated_delta_gates_forward_args& args, const context& ctx);
void run(const gated_delta_gates_backward_args& args, const context& ctx);

// Attention where the one query row sees one key (a one-token document), which cuDNN
// refuses: out = v, lse = scale q.k; backward d_v = the group's summed d_out, d_q = d_k = 0.
void single_key_attention_forward(const sdpa_forward_args& args, cudaStream_t stream);
void single_key_attention_backward(const sdpa_backward_args& args, cudaStream_t stream);
// FP8 attention (kernels_fp8.cu, ops/fp8_attention.hpp). Its f32 scalars live in one
// device array, by these slots: the inputs' amaxes; per operand (q, k, v, o, dO, the
// probabilities S, dS, dQ, dK, dV) a scale and its inverse; the amaxes cuDNN writes.
namespace fp8_slot {
enum : int {
  amax_q, amax_k, amax_v, amax_o, amax_d_o,
  scale_q, scale_k, scale_v, scale_o, scale_d_o, scale_s, scale_d_s, scale_d_q, scale_d_k, scale_d_v,
  descale_q, descale_k, descale_v, descale_o, descale_d_o, descale_s, descale_d_s, descale_d_q, descale_d_k,
  descale_d_v,
  amax_s_out, amax_o_out, amax_d_q_out, amax_d_k_out, amax_d_v_out, amax_d_s_out,
  count
};
inline constexpr int operands = scale_d_v - scale_q + 1;
}  // namespace fp8_slot
// *amax = max(*amax, max |x|) over a bf16 view (the caller zeroes *amax first).
void fp8_amax(const head_view& x, float* amax, cudaStream_t stream);
// The forward's (q, k, v, s, o) or the backward's scales and inverses from the amax slots.
void compute_fp8_forward_scales(float* slots, cudaStream_t stream);
void compute_fp8_backward_scales(float* slots, std::int64_t q_tokens, std::int64_t dim, float attn_scale,
                                 cudaStream_t stream);
// dst (packed tokens x heads x dim bytes) = fp8(x * *scale); dst (a bf16 view) = src * *descale.
void fp8_quantize(const head_view& x, std::uint8_t* dst, const float* scale, fp8_format format, cudaStream_t stream);
void fp8_dequantize(const std::uint8_t* src, const head_view& dst, const float* descale, fp8_format format,
                    cudaStream_t stream);
// dst[i] += src[i] (the communicators' fp32 reduction).
void add_f32(float* dst, const float* src, std::size_t count, cudaStream_t stream);

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

// The grouped expert GEMMs (ops/cuda/grouped_gemm.hpp): CUTLASS's grouped GEMM, the groups'
// sizes read on the device, or cuBLAS's grouped batched GEMM, the sizes read on the host.
// Their device arrays and CUTLASS's workspace take grouped_gemm_workspace_bytes of the
// arena at the first call, kept.
class grouped_gemm_engine {
 public:
  grouped_gemm_engine(cudaStream_t stream, const scratch_fn& scratch);
  ~grouped_gemm_engine();
  void run(const moe_grouped_gemm_args& args);

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
  // What the loaded cuDNN itself answers for FP8 attention at this head dim (a small causal
  // grouped-query graph built and its plans checked, with none of upipe's rules in front):
  // empty where it runs, else cuDNN's reason.
  static std::string fp8_support(std::int64_t head_dim, bool backward);

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace upipe::cuda
