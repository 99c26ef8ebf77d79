// The grouped expert GEMMs' engine (ops/cuda/cuda_ops.hpp): CUTLASS's grouped GEMM
// (grouped_gemm_cutlass.cu), whose groups' sizes stay on the device, and cuBLAS's grouped
// batched GEMM, whose sizes must be on the host: it reads the offsets back (the stream
// synchronized), drops the empty groups and hands cuBLAS the rest. cuBLAS is column-major,
// so each row-major product is computed transposed, as in gemm_cublaslt.cpp. Both take
// their device memory from one reservation of the arena (grouped_gemm_workspace_bytes):
// cuBLAS's workspace in the first half, the groups' arrays and CUTLASS's workspace in the second.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "ops/cuda/cuda_check.hpp"
#include "ops/cuda/cuda_ops.hpp"
#include "ops/cuda/grouped_gemm.hpp"
#include "ops/gemm_workspace.hpp"

#define UPIPE_CUBLAS_CHECK(call) UPIPE_LIBRARY_CHECK("cuBLAS", call, cublasGetStatusString)

namespace upipe::cuda {

namespace {

constexpr std::size_t cublas_part = grouped_gemm_workspace_bytes / 2;
constexpr int max_groups = 1024;  // the MoE entries' limit on E

cudaDataType_t library_type(dtype t) { return t == dtype::bf16 ? CUDA_R_16BF : CUDA_R_32F; }

bool aligned(const mat_view& m) {
  const auto bytes = static_cast<std::int64_t>(dtype_size(m.type));
  return m.rows == 0 || (reinterpret_cast<std::uintptr_t>(m.data) % 16 == 0 && (m.ld * bytes) % 16 == 0);
}

// CUTLASS's TMA loads and stores need every row of every operand on 16 bytes.
void check_cutlass_alignment(const moe_grouped_gemm_args& a) {
  bool ok = aligned(a.rows) && aligned(a.other) && aligned(a.out);
  for (const mat_view& w : a.weights) ok = ok && aligned(w);
  if (!ok)
    throw config_error("CUTLASS's grouped GEMM needs every row of its operands on 16 bytes (the hidden size and the "
                       "expert width multiples of 8), which this model's are not (rows " +
                       std::to_string(a.rows.cols) + " columns, weights " + std::to_string(a.weights.front().rows) +
                       " x " + std::to_string(a.weights.front().cols) + "); use --moe-gemm loop");
}

}  // namespace

struct grouped_gemm_engine::impl {
  cudaStream_t stream = nullptr;
  scratch_fn scratch;
  std::byte* workspace = nullptr;  // grouped_gemm_workspace_bytes of the arena, taken at the first call
  cublasHandle_t cublas = nullptr;
  std::int32_t* host_offsets = nullptr;  // pinned: max_groups + 1
  void** host_pointers = nullptr;        // pinned: 3 x max_groups

  void run_cublas(const moe_grouped_gemm_args& a);
};

grouped_gemm_engine::grouped_gemm_engine(cudaStream_t stream, const scratch_fn& scratch) : impl_(std::make_unique<impl>()) {
  impl_->stream = stream;
  impl_->scratch = scratch;
}

grouped_gemm_engine::~grouped_gemm_engine() {
  if (impl_ == nullptr) return;
  if (impl_->cublas != nullptr && cublasDestroy(impl_->cublas) != CUBLAS_STATUS_SUCCESS)
    std::fprintf(stderr, "upipe: cublasDestroy failed\n");
  if (impl_->host_offsets != nullptr) (void)cudaFreeHost(impl_->host_offsets);
  if (impl_->host_pointers != nullptr) (void)cudaFreeHost(impl_->host_pointers);
}

void grouped_gemm_engine::run(const moe_grouped_gemm_args& a) {
  UPIPE_CHECK(static_cast<int>(a.weights.size()) <= max_groups,
              "grouped GEMM: " + std::to_string(a.weights.size()) + " groups exceed " + std::to_string(max_groups));
  if (impl_->workspace == nullptr) impl_->workspace = static_cast<std::byte*>(impl_->scratch(grouped_gemm_workspace_bytes));
  if (a.engine == grouped_engine::cublas) return impl_->run_cublas(a);
  check_cutlass_alignment(a);
  cutlass_grouped_run(a, impl_->workspace + cublas_part, grouped_gemm_workspace_bytes - cublas_part, impl_->stream);
}

// The groups with rows, as cuBLAS's column-major products of the transposed views:
//   rows W^T: out^T (N x c) = W (N x K, stored K x N: op T) rows^T (K x c)
//   rows W:   out^T (N x c) = W^T (N x K, stored so: op N) rows^T (K x c)
//   dW:       W^T (N x M) += other^T (N x c) rows (c x M, stored M x c: op T)
void grouped_gemm_engine::impl::run_cublas(const moe_grouped_gemm_args& a) {
  const int groups = static_cast<int>(a.weights.size());
  if (cublas == nullptr) {
    UPIPE_CUBLAS_CHECK(cublasCreate(&cublas));
    UPIPE_CUBLAS_CHECK(cublasSetWorkspace(cublas, workspace, cublas_part));
    UPIPE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_offsets), (max_groups + 1) * sizeof(std::int32_t),
                                   cudaHostAllocPortable));
    UPIPE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_pointers), 3 * max_groups * sizeof(void*),
                                   cudaHostAllocPortable));
  }
  UPIPE_CUBLAS_CHECK(cublasSetStream(cublas, stream));
  // The sizes on the host: this waits for the stream (and for the last call's pointer copy).
  UPIPE_CUDA_CHECK(cudaMemcpyAsync(host_offsets, a.offsets.data, (groups + 1) * sizeof(std::int32_t),
                                   cudaMemcpyDeviceToHost, stream));
  UPIPE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const bool gradient = a.form == grouped_form::weight_gradient;
  const mat_view& w0 = a.weights.front();
  const std::size_t out_bytes = dtype_size(gradient ? w0.type : a.out.type);
  std::vector<cublasOperation_t> op_a, op_b;
  std::vector<int> m, n, k, lda, ldb, ldc, one;
  std::vector<float> alpha, beta;
  int used = 0;
  for (int g = 0; g < groups; ++g) {
    const std::int64_t r0 = host_offsets[g], c = host_offsets[g + 1] - r0;
    if (c == 0) continue;
    const auto* rows = static_cast<const std::byte*>(a.rows.data) + r0 * a.rows.ld * 2;
    const mat_view& w = a.weights[static_cast<std::size_t>(g)];
    void* A = nullptr;
    void* B = nullptr;
    void* C = nullptr;
    if (gradient) {
      A = static_cast<std::byte*>(a.other.data) + r0 * a.other.ld * 2;
      B = const_cast<std::byte*>(rows);
      C = w.data;
      op_a.push_back(CUBLAS_OP_N), op_b.push_back(CUBLAS_OP_T);
      m.push_back(static_cast<int>(w.cols)), n.push_back(static_cast<int>(w.rows)), k.push_back(static_cast<int>(c));
      lda.push_back(static_cast<int>(a.other.ld)), ldb.push_back(static_cast<int>(a.rows.ld));
      ldc.push_back(static_cast<int>(w.ld));
    } else {
      const bool t = a.form == grouped_form::rows_by_weight_t;
      A = w.data;
      B = const_cast<std::byte*>(rows);
      C = static_cast<std::byte*>(a.out.data) + r0 * a.out.ld * static_cast<std::int64_t>(out_bytes);
      op_a.push_back(t ? CUBLAS_OP_T : CUBLAS_OP_N), op_b.push_back(CUBLAS_OP_N);
      m.push_back(static_cast<int>(t ? w.rows : w.cols)), n.push_back(static_cast<int>(c));
      k.push_back(static_cast<int>(a.rows.cols));
      lda.push_back(static_cast<int>(w.ld)), ldb.push_back(static_cast<int>(a.rows.ld));
      ldc.push_back(static_cast<int>(a.out.ld));
    }
    host_pointers[used] = A;
    host_pointers[max_groups + used] = B;
    host_pointers[2 * max_groups + used] = C;
    alpha.push_back(a.alpha), beta.push_back(a.beta), one.push_back(1);
    ++used;
  }
  if (used == 0) return;
  auto** device_pointers = reinterpret_cast<void**>(workspace + cublas_part);
  UPIPE_CUDA_CHECK(cudaMemcpyAsync(device_pointers, host_pointers, 3 * max_groups * sizeof(void*),
                                   cudaMemcpyHostToDevice, stream));
  const cudaDataType_t out_type = library_type(gradient ? w0.type : a.out.type);
  UPIPE_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
      cublas, op_a.data(), op_b.data(), m.data(), n.data(), k.data(), alpha.data(),
      const_cast<const void* const*>(device_pointers), CUDA_R_16BF, lda.data(),
      const_cast<const void* const*>(device_pointers + max_groups), CUDA_R_16BF, ldb.data(), beta.data(),
      device_pointers + 2 * max_groups, out_type, ldc.data(), used, one.data(), CUBLAS_COMPUTE_32F));
}

void run(const moe_grouped_gemm_args& args, const context& ctx) {
  UPIPE_CHECK(ctx.grouped != nullptr, "moe_grouped_gemm needs the backend's grouped GEMM engine");
  ctx.grouped->run(args);
}

}  // namespace upipe::cuda
