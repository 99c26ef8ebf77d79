// The workspace cuBLASLt's GEMMs are given, taken from the arena once when the CUDA
// backend starts. The meta backend reserves the same bytes at the same moment and the
// planner counts them, so all three read this one number.
#pragma once

#include <cstddef>

namespace upipe {

inline constexpr std::size_t cublaslt_workspace_bytes = std::size_t{32} << 20;

// The grouped expert GEMMs' device arrays (each group's sizes, pointers and strides) and
// the library's own workspace, taken from the arena at the first grouped GEMM and kept; the
// meta backend reserves the same bytes at the same moment.
inline constexpr std::size_t grouped_gemm_workspace_bytes = std::size_t{8} << 20;

}  // namespace upipe
