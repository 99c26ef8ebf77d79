// Timings of a mixture of experts' GEMMs (`upipe bench-kernels --moe`): at a model's expert
// shapes and a token count, a routing drawn at random with a realistic skew, and for each of
// an expert MLP's GEMM forms (the gate/up projection, the down projection, the input and
// the weight gradients) the per-expert loop, each grouped engine and a dense GEMM of the same
// FLOPs, in one run; TFLOP/s counted over the routed rows, each beside the dense GEMM's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.hpp"

namespace upipe {

struct moe_gemm_shape {
  std::string name;  // e.g. "qwen3-30b-a3b"
  std::int64_t experts, top_k, hidden, width;
};
// Qwen3-30B-A3B's experts (128 of 2048 x 768, top 8) and Mixtral's (8 of 4096 x 14336, top 2).
std::vector<moe_gemm_shape> moe_gemm_shapes();

struct moe_gemm_timing {
  std::string model, form, engine;  // engine: loop, cutlass, cublas or dense
  std::int64_t tokens = 0, rows = 0;
  std::int64_t busiest = 0, idle = 0;  // the routing: the largest expert's rows, experts with none
  double ms = 0, tflops = 0;
  double vs_dense = 0;  // this engine's TFLOP/s over the dense GEMM's
};

// Every form x engine at `tokens` for `shape`; `skew` s draws token t's k experts by
// Gumbel top-k over the weights (1 + e)^-s (0: uniform).
std::vector<moe_gemm_timing> run_moe_gemm_bench(backend& be, const moe_gemm_shape& shape, std::int64_t tokens,
                                                int repeats, double skew);

}  // namespace upipe
