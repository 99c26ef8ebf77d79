// The workspace cuBLASLt's GEMMs are given, taken from the arena once when the CUDA
// backend starts. The meta backend reserves the same bytes at the same moment and the
// planner counts them, so all three read this one number.
#pragma once

#include <cstddef>

namespace upipe {

inline constexpr std::size_t cublaslt_workspace_bytes = std::size_t{32} << 20;

}  // namespace upipe
