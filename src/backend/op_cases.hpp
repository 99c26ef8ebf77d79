// What the registry's files share when they build op cases (backend/op_registry.cpp,
// backend/op_registry_model.cpp and backend/op_registry_optim.cpp): the perf shapes, the output helper and the labels.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "backend/op_registry.hpp"

namespace upipe::op_cases {

inline constexpr double bf16_tol = 2e-2;  // one bf16 rounding of the output and of its inputs
// One Llama3-8B layer's shapes, for the perf cases.
inline constexpr std::int64_t hidden = 4096, q_heads = 32, kv_heads = 8, head_dim = 128, intermediate = 14336;

// Columns [first, first + cols) of a tensor's matrix.
inline mat_view cols_of(const tensor& t, std::int64_t cols, std::int64_t first = 0) {
  return t.matrix().col_block(first, cols);
}

// Output tensors: compared across backends.
inline case_tensor out(case_tensor t, double bf16_tolerance = bf16_tol, double f32_tolerance = 1e-5) {
  t.bf16_tolerance = bf16_tolerance;
  t.f32_tolerance = f32_tolerance;
  return t;
}

// "rows 37 cols 96": a case's size label.
inline std::string dims_text(std::initializer_list<std::pair<const char*, std::int64_t>> dims) {
  std::string s;
  // Appended piece by piece, which keeps GCC 12's -Wrestrict false positive away.
  for (const auto& [name, value] : dims) {
    if (!s.empty()) s += ' ';
    s += name;
    s += ' ';
    s += std::to_string(value);
  }
  return s;
}

// The entries of the ops the model families brought (op_registry_model.cpp): the bias's
// add and gradient, GeGLU.
std::vector<op_entry> model_op_entries();
// The mixture of experts' entries (op_registry_moe.cpp): the router, dispatch, permute,
// combine, balance statistics and sigmoid gate, with the grouped expert GEMMs'
// (op_registry_moe_gemm.cpp).
std::vector<op_entry> moe_op_entries();
std::vector<op_entry> moe_gemm_op_entries();
// Gated DeltaNet's (op_registry_gated_delta.cpp): the gated delta rule, its context-parallel
// summaries and scan, the causal conv, the gates.
std::vector<op_entry> gated_delta_op_entries();
// The gated delta rule's ops at Qwen3.5-27B's and Qwen3-Next-80B's head shapes (d 128, 16 key
// heads, 48 and 32 value heads): the GPU tests' (tests/gpu/gated_delta_test.cpp), too slow
// for the cpu suite's harness.
std::vector<op_case> gated_delta_model_cases();
// The optimizer's (op_registry_optim.cpp): AdamW in every state format, the sum of squares.
std::vector<op_entry> optimizer_op_entries();

}  // namespace upipe::op_cases
