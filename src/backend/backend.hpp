// A backend: memory (one arena allocator for device tags, one for host tags, both
// feeding the rank's ledger), copies, streams and synchronization, and run(op), which
// dispatches an op's argument struct to the backend's implementation of it. Model and
// strategy code never asks which backend it runs on; it calls the op entries in
// backend/ops.hpp.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/allocator.hpp"
#include "core/ledger.hpp"
#include "core/tensor.hpp"
#include "ops/op_args.hpp"

namespace upipe {

enum class backend_kind : std::uint8_t { cpu, meta, cuda };
std::string_view backend_name(backend_kind kind);
// Parses "cpu", "meta" or "cuda"; throws config_error naming the valid values.
backend_kind parse_backend_kind(std::string_view name);

// Thrown when an arena cannot hold an allocation. Names the tag, the bytes asked and
// the ledger's breakdown.
class out_of_memory_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Host memory a run is about to allocate outside the arenas (`what`: "random weights of
// llama3-8b"): throws out_of_memory_error naming it, the bytes and what the machine has
// available, before anything is allocated, when it would not fit.
void require_host_memory(std::size_t bytes, const std::string& what);

struct memory_limits {
  std::size_t device_bytes = std::size_t{16} << 30;  // arena capacity
  std::size_t host_bytes = std::size_t{64} << 30;    // host pool capacity
  // meta only: reserve the CUDA backend's library workspaces (cuBLASLt at start, cuDNN's
  // attention workspace as it grows) at the same moments, so that the arena's placement
  // is the GPU's (the planner's probe).
  bool gpu_workspaces = false;
  // cuda only: the host pool is ordinary pageable memory (checkpoints where=host-pageable)
  // instead of pinned; side copies to and from it pass through small pinned bounce
  // buffers, the pageable side copied by a host thread, never by the step's stream.
  bool host_pageable = false;
};

class backend {
 public:
  backend(backend_kind kind, dtype work_type, const memory_limits& limits);
  virtual ~backend();
  backend(const backend&) = delete;
  backend& operator=(const backend&) = delete;

  backend_kind kind() const { return kind_; }
  // Storage type of activations and weights: f32 on cpu, bf16 on meta and cuda.
  dtype work_dtype() const { return work_type_; }
  // False on meta: tensors have no data and ops do nothing.
  bool has_data() const { return kind_ != backend_kind::meta; }

  tensor allocate(mem_tag tag, dtype type, const shape& dims, const char* label);
  tensor allocate_zeroed(mem_tag tag, dtype type, const shape& dims, const char* label);
  // Moves a device tensor's bytes to another device tag in the ledger (an activation
  // that becomes a checkpoint) without touching memory.
  void retag(tensor& t, mem_tag tag);

  memory_ledger& ledger() { return ledger_; }
  const memory_ledger& ledger() const { return ledger_; }
  const arena_allocator& device_arena() const { return device_arena_; }
  const arena_allocator& host_arena() const { return host_arena_; }

  // Byte movement and fp32 reduction used by the communicators.
  virtual void copy_bytes(void* dst, const void* src, std::size_t bytes) = 0;
  virtual void add_f32(float* dst, const float* src, std::size_t count) = 0;
  virtual void fill_bytes(void* dst, int value, std::size_t bytes) = 0;
  virtual void synchronize() = 0;
  // A copy beside the compute: it starts once the work issued so far is done and runs
  // while later work computes (on a GPU, on a copy stream). Neither buffer may be
  // written, nor src freed, before join_side_copies(). The defaults copy in order.
  virtual void copy_bytes_side(void* dst, const void* src, std::size_t bytes) { copy_bytes(dst, src, bytes); }
  // Work issued after this call waits for every side copy issued before it.
  virtual void join_side_copies() {}
  // A point in the side copies: side_point() stands for those issued so far, and
  // join_side_point() makes the work issued after it wait for those alone, not for side
  // copies issued since (a weights prefetch joined without waiting for a checkpoint's
  // offload that started after it). Each point is joined once. The defaults join all.
  virtual std::uint64_t side_point() { return 0; }
  virtual void join_side_point(std::uint64_t /*point*/) { join_side_copies(); }
  // Runs fn on a host thread once the work issued so far is done, without the caller
  // waiting: on a GPU from the CUDA runtime's callback thread, in the order of the step's
  // stream (fn must be short and must not call the backend). Where work is done as it is
  // issued (cpu, meta), fn runs now.
  virtual void when_done(std::function<void()> fn) { fn(); }
  // What the device's driver reports in use (all of the GPU, every context on it) at its
  // highest seen at a synchronize(); 0 where there is no driver (cpu, meta). Beside the
  // ledger it shows what lies outside the arena: the CUDA context and the libraries.
  virtual std::size_t driver_peak_bytes() const { return 0; }
  // The GPU and the stream this backend's work runs on in order (a cudaStream_t), for
  // communicators that enqueue on it (NCCL); -1 and nullptr off the GPU.
  virtual int device_index() const { return -1; }
  virtual void* native_stream() const { return nullptr; }
  // The libraries this backend runs on, as loaded at run time (e.g. "cuDNN 9.14.0").
  virtual std::string library_versions() const { return "none"; }
  // Host f32 values into a tensor of any dtype (converted), and back. No-ops on meta.
  virtual void upload_f32(const tensor& dst, const float* host) = 0;
  virtual void download_f32(float* host, const tensor& src) = 0;
  // Raw bytes between host memory and a tensor (token ids, checkpoints). No-ops on meta.
  virtual void upload_bytes(const tensor& dst, const void* host, std::size_t bytes) = 0;
  virtual void download_bytes(void* host, const tensor& src, std::size_t bytes) = 0;

  // Phase timing, off by default (and never on meta): code brackets its phases with
  // phase_scope; while on, the backend marks every change of phase in its stream of
  // work and take_phase_ms() returns the time between marks summed per phase (the
  // innermost open scope owns the time; none open: "other"), then starts afresh. Timing
  // on or off, each scope is also a named range for a profiler (open_range; NVTX on cuda).
  void set_phase_timing(bool on);
  void push_phase(const char* name) {
    open_range(name);
    if (phase_timing_) change_phase(name, true);
  }
  void pop_phase() {
    if (phase_timing_) change_phase(nullptr, false);
    close_range();
  }
  std::map<std::string, double> take_phase_ms();

  // The GEMM FLOPs issued so far (2 m n k each, on every backend, meta included), and those
  // of the GEMMs whose left operand is transposed: dY^T X, the form of every weight
  // gradient here. ops::gemm counts; tests and benchmarks read.
  struct gemm_flops {
    double all = 0, left_transposed = 0;
  };
  const gemm_flops& gemm_count() const { return gemm_count_; }
  void count_gemm(double flops, bool left_transposed) {
    gemm_count_.all += flops;
    if (left_transposed) gemm_count_.left_transposed += flops;
  }

  // Runs one op (its argument struct, ops/op_args.hpp). Call it through the checked
  // entries in backend/ops.hpp, which check the arguments first.
  virtual void run(const op& args) = 0;

  // Host synchronizations so far: each time the host waited for the device's work (a
  // download or upload, a synchronize(), an op whose result the host reads). The CUDA
  // backend counts every wait; the cpu backend counts the same calls, which would wait on
  // a device, so that code held to none on the cpu issues none on the GPU; meta counts none.
  std::uint64_t host_syncs() const { return host_syncs_; }

 protected:
  void note_host_sync() { ++host_syncs_; }
  // Base addresses of the two arenas; nullptr on meta. Set by the derived constructor.
  void set_bases(std::byte* device_base, std::byte* host_base) {
    device_base_ = device_base;
    host_base_ = host_base;
  }
  // Called when a block is returned, with its address and size (e.g. to drop pages).
  virtual void on_release(void* /*data*/, std::size_t /*bytes*/, bool /*host*/) {}
  // Phase marks: mark i is recorded now in this backend's order of work; the time
  // between two marks once synchronize() returned. The defaults read the host clock,
  // right where ops run synchronously on the host (cpu).
  virtual void record_mark(std::size_t index);
  virtual double mark_interval_ms(std::size_t from, std::size_t to);
  // A phase's range for a profiler's timeline (Nsight Systems), opened and closed on the
  // host as the phase's work is issued; none by default.
  virtual void open_range(const char* /*name*/) {}
  virtual void close_range() {}

 private:
  friend class tensor;
  void release(const tensor& t, std::size_t offset) noexcept;
  std::string breakdown() const;

  backend_kind kind_;
  dtype work_type_;
  arena_allocator device_arena_;
  arena_allocator host_arena_;
  std::byte* device_base_ = nullptr;
  std::byte* host_base_ = nullptr;
  memory_ledger ledger_;
  bool phase_timing_ = false;
  gemm_flops gemm_count_;
  std::uint64_t host_syncs_ = 0;
  std::vector<const char*> phase_stack_;
  std::vector<std::string> phase_of_mark_;  // the phase that starts at mark i
  std::vector<std::chrono::steady_clock::time_point> host_marks_;

  void change_phase(const char* name, bool push);
};

// Brackets one phase of work for the backend's phase timing (a no-op while it is off).
class phase_scope {
 public:
  phase_scope(backend& be, const char* name) : be_(be) { be_.push_phase(name); }
  ~phase_scope() { be_.pop_phase(); }
  phase_scope(const phase_scope&) = delete;
  phase_scope& operator=(const phase_scope&) = delete;

 private:
  backend& be_;
};

std::unique_ptr<backend> make_cpu_backend(const memory_limits& limits);
std::unique_ptr<backend> make_meta_backend(const memory_limits& limits);
// The CUDA backend on GPU `device` (only in builds with UPIPE_HAVE_CUDA): an arena of
// limits.device_bytes on the device, a host pool of limits.host_bytes (pinned, or pageable
// with limits.host_pageable).
std::unique_ptr<backend> make_cuda_backend(const memory_limits& limits, int device);
// Throws config_error when this build has no CUDA backend.
std::unique_ptr<backend> make_backend(backend_kind kind, const memory_limits& limits);

}  // namespace upipe
