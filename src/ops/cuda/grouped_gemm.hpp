// The grouped expert GEMMs' engines (moe_grouped_gemm_args), behind grouped_gemm_engine
// (ops/cuda/cuda_ops.hpp): CUTLASS's Hopper grouped GEMM (grouped_gemm_cutlass.cu, built
// for sm_90a where the CUTLASS headers were fetched) and cuBLAS's grouped batched GEMM
// (grouped_gemm.cu). Both take the groups' pointers, sizes and strides in device arrays
// that a small kernel writes from the offsets; CUTLASS reads the sizes there, cuBLAS needs
// them on the host too.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "ops/op_args.hpp"

namespace upipe::cuda {

// Is CUTLASS's grouped GEMM compiled into this build (the headers were fetched)?
bool cutlass_grouped_available();
// Runs a through CUTLASS on `stream`: its groups' arrays and CUTLASS's workspace in the
// `workspace_bytes` at `workspace` (device memory, kept by the engine). Never waits.
void cutlass_grouped_run(const moe_grouped_gemm_args& a, void* workspace, std::size_t workspace_bytes,
                         cudaStream_t stream);

}  // namespace upipe::cuda
