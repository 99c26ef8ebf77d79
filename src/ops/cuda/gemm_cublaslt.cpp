// GEMM through cuBLASLt. cuBLASLt is column-major and our views are row-major; a
// row-major r x c matrix with leading dimension ld is, byte for byte, the column-major
// c x r matrix with the same ld, i.e. its transpose. So c = op(a) op(b) is computed as
// c^T = op(b)^T op(a)^T: b is cuBLASLt's first operand and a its second, each with its
// own transpose flag unchanged, and nothing is copied.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "core/error.hpp"
#include "ops/cuda/cuda_check.hpp"
#include "ops/cuda/cuda_ops.hpp"
#include "ops/gemm_workspace.hpp"

#define UPIPE_CUBLASLT_CHECK(call) UPIPE_LIBRARY_CHECK("cuBLASLt", call, cublasLtGetStatusString)

namespace upipe::cuda {

namespace {

cudaDataType_t library_type(dtype t) { return t == dtype::bf16 ? CUDA_R_16BF : CUDA_R_32F; }
cublasOperation_t library_op(transpose t) { return t == transpose::yes ? CUBLAS_OP_T : CUBLAS_OP_N; }

// The largest power of two up to 256 that divides the address: algorithms that need more
// alignment than a view offers (a row or column block) must be excluded by the heuristic.
std::uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t align = 256;
  while (align > 1 && address % align != 0) align /= 2;
  return align;
}

// Everything the heuristic's choice depends on.
struct gemm_key {
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  transpose trans_a = transpose::none, trans_b = transpose::none;
  dtype ab_type = dtype::bf16, c_type = dtype::bf16;
  std::uint32_t align_a = 0, align_b = 0, align_c = 0;
  auto operator<=>(const gemm_key&) const = default;
};

std::string describe(const gemm_key& key) {
  std::string s = "gemm m " + std::to_string(key.m) + " n " + std::to_string(key.n) + " k " + std::to_string(key.k);
  s += key.trans_a == transpose::yes ? ", a transposed" : "";
  s += key.trans_b == transpose::yes ? ", b transposed" : "";
  s += ", a/b " + std::string(dtype_name(key.ab_type)) + ", c " + std::string(dtype_name(key.c_type));
  s += ", ld a/b/c " + std::to_string(key.lda) + "/" + std::to_string(key.ldb) + "/" + std::to_string(key.ldc);
  s += ", alignment a/b/c " + std::to_string(key.align_a) + "/" + std::to_string(key.align_b) + "/" +
       std::to_string(key.align_c) + " bytes";
  return s;
}

void log_status(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    std::fprintf(stderr, "upipe: %s failed: %s\n", call, cublasLtGetStatusString(status));
}

// The descriptors of one shape and the algorithm the heuristic picked for it.
class gemm_plan {
 public:
  gemm_plan(cublasLtHandle_t handle, const gemm_args& args, const gemm_key& key) {
    try {
      build(handle, args, key);
    } catch (...) {
      release();
      throw;
    }
  }
  ~gemm_plan() { release(); }
  gemm_plan(const gemm_plan&) = delete;
  gemm_plan& operator=(const gemm_plan&) = delete;

  // c = alpha * op(a) op(b) + beta * c, in place (C and D are one matrix).
  void run(cublasLtHandle_t handle, const gemm_args& args, void* workspace, cudaStream_t stream) const {
    UPIPE_CUBLASLT_CHECK(cublasLtMatmul(handle, desc_, &args.alpha, args.b.data, first_, args.a.data, second_,
                                        &args.beta, args.c.data, out_, args.c.data, out_, &algo_, workspace,
                                        cublaslt_workspace_bytes, stream));
  }

 private:
  void build(cublasLtHandle_t handle, const gemm_args& args, const gemm_key& key) {
    UPIPE_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_first = library_op(key.trans_b), op_second = library_op(key.trans_a);
    UPIPE_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
    UPIPE_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
    // Each stored matrix as column-major: rows and columns swap, ld stays.
    const cudaDataType_t ab = library_type(key.ab_type), c = library_type(key.c_type);
    UPIPE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&first_, ab, static_cast<std::uint64_t>(args.b.cols),
                                                    static_cast<std::uint64_t>(args.b.rows), key.ldb));
    UPIPE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&second_, ab, static_cast<std::uint64_t>(args.a.cols),
                                                    static_cast<std::uint64_t>(args.a.rows), key.lda));
    UPIPE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&out_, c, static_cast<std::uint64_t>(key.n),
                                                    static_cast<std::uint64_t>(key.m), key.ldc));
    choose_algorithm(handle, key);
  }

  void release() noexcept {
    if (out_ != nullptr) log_status(cublasLtMatrixLayoutDestroy(out_), "cublasLtMatrixLayoutDestroy");
    if (second_ != nullptr) log_status(cublasLtMatrixLayoutDestroy(second_), "cublasLtMatrixLayoutDestroy");
    if (first_ != nullptr) log_status(cublasLtMatrixLayoutDestroy(first_), "cublasLtMatrixLayoutDestroy");
    if (desc_ != nullptr) log_status(cublasLtMatmulDescDestroy(desc_), "cublasLtMatmulDescDestroy");
    out_ = second_ = first_ = nullptr;
    desc_ = nullptr;
  }

  // An unsupported combination is a bug in the caller, so it throws with the shape
  // rather than aborting.
  void choose_algorithm(cublasLtHandle_t handle, const gemm_key& key) {
    struct preference_guard {
      cublasLtMatmulPreference_t p = nullptr;
      ~preference_guard() {
        if (p != nullptr) log_status(cublasLtMatmulPreferenceDestroy(p), "cublasLtMatmulPreferenceDestroy");
      }
    } guard;
    UPIPE_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&guard.p));
    const cublasLtMatmulPreference_t preference = guard.p;
    const std::uint64_t max_workspace = cublaslt_workspace_bytes;
    UPIPE_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                              &max_workspace, sizeof(max_workspace)));
    const std::pair<cublasLtMatmulPreferenceAttributes_t, std::uint32_t> alignments[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c}};
    for (const auto& [attribute, bytes] : alignments)
      UPIPE_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &bytes, sizeof(bytes)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, desc_, first_, second_, out_, out_,
                                                                 preference, 1, &result, &found);
    if (status != CUBLAS_STATUS_SUCCESS || found == 0 || result.state != CUBLAS_STATUS_SUCCESS)
      throw internal_error("cuBLASLt has no algorithm for " + describe(key) + " (" +
                           cublasLtGetStatusString(status != CUBLAS_STATUS_SUCCESS ? status : result.state) + ")");
    algo_ = result.algo;
  }

  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t first_ = nullptr;   // op(b)^T's operand: b stored, (b.cols x b.rows, ldb)
  cublasLtMatrixLayout_t second_ = nullptr;  // op(a)^T's operand: a stored, (a.cols x a.rows, lda)
  cublasLtMatrixLayout_t out_ = nullptr;     // c^T: (n x m, ldc)
  cublasLtMatmulAlgo_t algo_{};
};

}  // namespace

struct gemm_engine::impl {
  cudaStream_t stream = nullptr;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;  // cublaslt_workspace_bytes, from the backend's arena
  std::map<gemm_key, std::unique_ptr<gemm_plan>> plans;
};

gemm_engine::gemm_engine(cudaStream_t stream, const scratch_fn& scratch) : impl_(std::make_unique<impl>()) {
  impl_->stream = stream;
  impl_->workspace = scratch(cublaslt_workspace_bytes);
  UPIPE_CUBLASLT_CHECK(cublasLtCreate(&impl_->handle));
}

gemm_engine::~gemm_engine() {
  if (impl_ == nullptr) return;
  impl_->plans.clear();
  if (impl_->handle != nullptr) log_status(cublasLtDestroy(impl_->handle), "cublasLtDestroy");
}

void gemm_engine::run(const gemm_args& args) {
  const bool ta = args.trans_a == transpose::yes;
  gemm_key key;
  key.m = args.c.rows;
  key.n = args.c.cols;
  key.k = ta ? args.a.rows : args.a.cols;
  if (key.m == 0 || key.n == 0) return;
  UPIPE_CHECK(key.k > 0,
              "gemm_engine::run: k == 0 leaves c = beta * c, which cuda::run(gemm_args) does without cuBLASLt");
  if (args.a.type != args.b.type)
    throw internal_error("gemm_engine: a is " + std::string(dtype_name(args.a.type)) + " but b is " +
                         std::string(dtype_name(args.b.type)) + "; cuBLASLt needs one input dtype (convert one first)");
  if (args.a.type == dtype::f32 && args.c.type != dtype::f32)
    throw internal_error("gemm_engine: f32 inputs need an f32 output (cuBLASLt has no f32 x f32 -> bf16 at fp32 "
                         "compute); c is " + std::string(dtype_name(args.c.type)));
  key.lda = args.a.ld;
  key.ldb = args.b.ld;
  key.ldc = args.c.ld;
  key.trans_a = args.trans_a;
  key.trans_b = args.trans_b;
  key.ab_type = args.a.type;
  key.c_type = args.c.type;
  key.align_a = alignment_of(args.a.data);
  key.align_b = alignment_of(args.b.data);
  key.align_c = alignment_of(args.c.data);

  auto it = impl_->plans.find(key);
  if (it == impl_->plans.end())
    it = impl_->plans.emplace(key, std::make_unique<gemm_plan>(impl_->handle, args, key)).first;
  it->second->run(impl_->handle, args, impl_->workspace, impl_->stream);
}

}  // namespace upipe::cuda
