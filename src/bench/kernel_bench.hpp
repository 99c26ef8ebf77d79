// Timings of single ops on one backend: the GEMMs of a Llama layer, fused attention
// forward and backward, and the memory-bound kernels beside a device-to-device copy of
// the same bytes. Used by `upipe bench-kernels` to compare with PyTorch in the same call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "ops/op_args.hpp"

namespace upipe {

struct kernel_timing {
  std::string name;      // e.g. "gemm q_proj", "sdpa d=128 forward", "rmsnorm"
  double ms = 0;         // mean over the timed repeats
  double tflops = 0;     // for compute-bound ops
  double gbytes_per_s = 0;  // for memory-bound ops (bytes read + written)
};

struct kernel_bench_options {
  std::int64_t tokens = 32768;
  int repeats = 5;
  int heads = 32, kv_heads = 8, hidden = 4096, intermediate = 14336;
  std::int64_t vocab = 128256;
};

std::vector<kernel_timing> run_kernel_bench(backend& be, const kernel_bench_options& options);

// Causal fused attention forward and backward at s tokens, head dim d, in `arithmetic`, on
// standard normal inputs: the mean of `repeats` timed runs each.
struct attention_ms {
  double forward = 0, backward = 0;
};
attention_ms time_causal_attention(backend& be, std::int64_t s, int heads, int kv_heads, int d,
                                   attention_dtype arithmetic, int repeats);
// Causal attention's forward FLOPs: half of 4 s^2 h d (the backward does 2.5 times them).
double causal_forward_flops(std::int64_t s, int heads, int d);

// Causal fused attention forward and backward (d 128, the options' heads) at each length,
// in bf16 and then in FP8 on the same inputs; TFLOP/s counts bf16's FLOPs for both (the
// model's work, 3.5 x 2 s^2 h d), so the rates compare as times do.
struct attention_dtype_timing {
  std::int64_t tokens = 0;
  attention_dtype arithmetic = attention_dtype::bf16;
  double forward_ms = 0, backward_ms = 0, tflops = 0;
};
std::vector<attention_dtype_timing> run_attention_dtype_bench(backend& be, const std::vector<std::int64_t>& lengths,
                                                              const kernel_bench_options& options);

// A Gated DeltaNet layer beside its model's full-attention layer at the same length
// (`bench-kernels --gdn`): the gated delta rule's forward and backward over the layer's
// heads (bf16 q/k/v, fp32 states, packed as one document), and causal fused attention
// forward and backward at the model's attention heads.
struct gdn_bench_model {
  const char* name;
  int k_heads, v_heads, head_dim;           // the linear layers'
  int attn_heads, attn_kv_heads, attn_dim;  // the full-attention layers'
};
// The models the bench knows (their config.json values); nullptr for another name.
const gdn_bench_model* find_gdn_bench_model(const std::string& name);
std::string gdn_bench_model_names();

struct gdn_timing {
  std::int64_t tokens = 0, pass_chunks = 0;
  double forward_ms = 0, backward_ms = 0, tflops = 0;            // the gated delta rule
  double attn_forward_ms = 0, attn_backward_ms = 0, attn_tflops = 0;  // the full attention
};
// `workspace_gib` bounds the gated delta rule's workspace (the passes' length).
std::vector<gdn_timing> run_gdn_bench(backend& be, const std::vector<std::int64_t>& lengths,
                                      const gdn_bench_model& model, int repeats, double workspace_gib);

}  // namespace upipe
