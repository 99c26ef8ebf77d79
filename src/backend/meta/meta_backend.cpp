// The meta backend: shapes only. Allocations go through the same arena and ledger as
// the real backends, but no memory exists and no op or copy does anything, so a whole
// step at millions of tokens runs in milliseconds and reports the exact peak.
#include "backend/backend.hpp"

#include <variant>
#include <vector>

#include "ops/gemm_workspace.hpp"
#include "ops/op_args.hpp"
#include "ops/sdpa_workspace.hpp"

namespace upipe {

namespace {

class meta_backend final : public backend {
 public:
  explicit meta_backend(const memory_limits& limits)
      : backend(backend_kind::meta, dtype::bf16, limits), gpu_workspaces_(limits.gpu_workspaces) {
    if (gpu_workspaces_) reserve(cublaslt_workspace_bytes, "cublaslt_workspace");
  }

  void copy_bytes(void*, const void*, std::size_t) override {}
  void add_f32(float*, const float*, std::size_t) override {}
  void fill_bytes(void*, int, std::size_t) override {}
  void synchronize() override {}
  void upload_f32(const tensor&, const float*) override {}
  void download_f32(float*, const tensor&) override {}
  void upload_bytes(const tensor&, const void*, std::size_t) override {}
  void download_bytes(void*, const tensor&, std::size_t) override {}

  void run(const op& args) override {
    std::visit([this](const auto& a) { model(a); }, args);
  }

 private:
  // What an op does on meta: nothing, unless the CUDA backend's implementation of it holds
  // a workspace (holds_device_workspace, ops/op_args.hpp), whose reservation is modelled
  // here. An op marked so that has no overload below matches no overload and fails to
  // compile, rather than being given no memory.
  template <class args_type>
    requires(!holds_device_workspace<args_type>)
  void model(const args_type&) {}
  // cuBLASLt's workspace is one fixed reservation, made with the backend (constructor).
  void model(const gemm_args&) {}
  // The grouped GEMMs' arrays and workspace: one reservation at the first.
  void model(const moe_grouped_gemm_args&) {
    if (gpu_workspaces_) grow(grouped_bytes_, grouped_gemm_workspace_bytes, "grouped_gemm_workspace");
  }
  // As the CUDA engine, no plan (and no workspace) for a call where nothing attends.
  // FP8 attention first grows its operands' buffer, then the plan its workspace.
  void model(const sdpa_forward_args& a) {
    if (!gpu_workspaces_ || !attends(a.q, a.k)) return;
    if (a.arithmetic == attention_dtype::fp8) grow(fp8_bytes_, sdpa_fp8_forward_bytes(a), "cudnn_workspace");
    grow(cudnn_bytes_, sdpa_forward_workspace_bytes(a.q.tokens, a.q.heads), "cudnn_workspace");
  }
  void model(const sdpa_backward_args& a) {
    if (!gpu_workspaces_ || !attends(a.q, a.k)) return;
    if (a.arithmetic == attention_dtype::fp8) grow(fp8_bytes_, sdpa_fp8_backward_bytes(a), "cudnn_workspace");
    grow(cudnn_bytes_, sdpa_backward_workspace_bytes(a.q.tokens, a.q.heads, a.q.dim, a.k.tokens, a.mask),
         "cudnn_workspace");
  }

  static bool attends(const head_view& q, const head_view& k) {
    return q.tokens > 0 && q.heads > 0 && q.dim > 0 && k.tokens > 0;
  }
  // As the CUDA engines: cached workspaces that live as long as the backend, a larger
  // one taken (and the smaller kept) when a plan needs more.
  void reserve(std::size_t bytes, const char* label) {
    const auto words = static_cast<std::int64_t>((bytes + sizeof(float) - 1) / sizeof(float));
    workspaces_.push_back(allocate(mem_tag::workspace, dtype::f32, {words}, label));
  }
  void grow(std::size_t& held, std::size_t bytes, const char* label) {
    if (bytes <= held) return;
    reserve(bytes, label);
    held = bytes;
  }

  bool gpu_workspaces_;
  std::size_t cudnn_bytes_ = 0, fp8_bytes_ = 0, grouped_bytes_ = 0;
  std::vector<tensor> workspaces_;
};

}  // namespace

std::unique_ptr<backend> make_meta_backend(const memory_limits& limits) {
  return std::make_unique<meta_backend>(limits);
}

}  // namespace upipe
