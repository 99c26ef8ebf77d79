// The CUDA backend: bf16 storage, fp32 accumulation. One device arena (a single
// cudaMalloc that the shared arena allocator carves up), one host pool (pinned, or
// pageable behind pinned bounce buffers), one non-blocking compute stream on which every
// op, copy and fill of this backend runs in order, and a copy stream for side copies
// (checkpoint offload and prefetch) joined to it by events. Ops return without
// synchronizing; host transfers and synchronize() wait.
#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>  // header-only (NVTX3 in the CUDA toolkit): a no-op unless a profiler listens
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "core/machine.hpp"
#include "ops/cuda/cuda_check.hpp"
#include "ops/cuda/cuda_ops.hpp"

namespace upipe {

namespace {

constexpr std::size_t cudnn_minimum_version = 90000;  // cudnnGetVersion() of cuDNN 9.0.0

// Launch configuration of this file's elementwise kernels: a grid-stride loop.
struct elementwise_launch {
  static constexpr int threads = 256;
  static constexpr std::int64_t max_blocks = 4096;
  static unsigned blocks(std::int64_t n) {
    return static_cast<unsigned>(std::clamp<std::int64_t>((n + threads - 1) / threads, 1, max_blocks));
  }
};

// The same bits as float_to_bf16 (core/dtype.hpp): round to nearest even, NaN quiet.
__device__ std::uint16_t to_bf16_bits(float value) {
  const std::uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0)
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

__device__ float from_bf16_bits(std::uint16_t bits) { return __uint_as_float(static_cast<std::uint32_t>(bits) << 16); }

__global__ void f32_to_bf16_kernel(const float* in, std::uint16_t* out, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = to_bf16_bits(in[i]);
}

__global__ void bf16_to_f32_kernel(const std::uint16_t* in, float* out, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = from_bf16_bits(in[i]);
}

std::string gib(std::size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f GiB", static_cast<double>(bytes) / static_cast<double>(1u << 30));
  return text;
}

// cuDNN 9 encodes major * 10000 + minor * 100 + patch; cuDNN 8 major * 1000 + minor * 100 + patch.
std::string cudnn_version_name(std::size_t v) {
  if (v >= 10000)
    return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
  return std::to_string(v / 1000) + "." + std::to_string(v / 100 % 10) + "." + std::to_string(v % 100);
}

void log_cuda(cudaError_t status, const char* call) noexcept {
  if (status != cudaSuccess) std::fprintf(stderr, "upipe: %s failed: %s\n", call, cudaGetErrorString(status));
}

void check_device(int device) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || device < 0 || device >= count) {
    (void)cudaGetLastError();
    throw config_error("the cuda backend needs GPU " + std::to_string(device) + " but " +
                       (status != cudaSuccess ? std::string("the CUDA runtime reports: ") + cudaGetErrorString(status)
                                              : std::to_string(count) + " GPU(s) are visible") +
                       ": run on a machine with a GPU, or use --backend cpu");
  }
}

void check_cudnn_version() {
  const std::size_t version = cuda::sdpa_engine::library_version();
  if (version < cudnn_minimum_version)
    throw config_error("cuDNN " + cudnn_version_name(version) + " is loaded (cudnnGetVersion() = " +
                       std::to_string(version) +
                       ") but the cuda backend's fused attention needs cuDNN 9.0 or newer: install cuDNN 9 and put "
                       "its library directory first on LD_LIBRARY_PATH");
}

// Side copies between device memory and pageable host memory, which the GPU's copy
// engines cannot reach asynchronously: each chunk passes through one of two pinned
// bounce buffers, the device side copied on the copy stream and the pageable side by a
// host function on a stream of its own (run by the CUDA runtime's host thread). Events
// order each buffer's writer after its last reader, so a device-to-bounce copy overlaps
// the previous chunk's host copy. Nothing here waits on the host.
class pageable_mover {
 public:
  static constexpr std::size_t chunk_bytes = std::size_t{32} << 20;

  explicit pageable_mover(cudaStream_t copy_stream) : copy_stream_(copy_stream) {
    try {
      UPIPE_CUDA_CHECK(cudaStreamCreateWithFlags(&host_stream_, cudaStreamNonBlocking));
      UPIPE_CUDA_CHECK(cudaEventCreateWithFlags(&host_done_, cudaEventDisableTiming));
      for (slot& s : slots_) {
        UPIPE_CUDA_CHECK(cudaHostAlloc(&s.buffer, chunk_bytes, cudaHostAllocPortable));
        UPIPE_CUDA_CHECK(cudaEventCreateWithFlags(&s.filled, cudaEventDisableTiming));
        UPIPE_CUDA_CHECK(cudaEventCreateWithFlags(&s.free, cudaEventDisableTiming));
      }
    } catch (...) {
      release();
      throw;
    }
  }
  pageable_mover(const pageable_mover&) = delete;
  pageable_mover& operator=(const pageable_mover&) = delete;
  ~pageable_mover() { release(); }

  // device -> pageable host, after what the copy stream holds so far.
  void to_host(std::byte* host, const std::byte* device, std::size_t bytes) {
    for (std::size_t off = 0; off < bytes; off += chunk_bytes) {
      const std::size_t n = std::min(chunk_bytes, bytes - off);
      slot& s = next();
      if (s.used) UPIPE_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, s.free, 0));
      UPIPE_CUDA_CHECK(cudaMemcpyAsync(s.buffer, device + off, n, cudaMemcpyDeviceToHost, copy_stream_));
      UPIPE_CUDA_CHECK(cudaEventRecord(s.filled, copy_stream_));
      UPIPE_CUDA_CHECK(cudaStreamWaitEvent(host_stream_, s.filled, 0));
      host_copy(host + off, s.buffer, n);
      UPIPE_CUDA_CHECK(cudaEventRecord(s.free, host_stream_));
      s.used = true;
    }
  }
  // pageable host -> device; the last device copy is on the copy stream, so joining the
  // copy stream joins it. The host side runs after every earlier host copy (to_host's
  // included), in order on the host stream.
  void to_device(std::byte* device, const std::byte* host, std::size_t bytes) {
    for (std::size_t off = 0; off < bytes; off += chunk_bytes) {
      const std::size_t n = std::min(chunk_bytes, bytes - off);
      slot& s = next();
      if (s.used) UPIPE_CUDA_CHECK(cudaStreamWaitEvent(host_stream_, s.free, 0));
      host_copy(s.buffer, host + off, n);
      UPIPE_CUDA_CHECK(cudaEventRecord(s.filled, host_stream_));
      UPIPE_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, s.filled, 0));
      UPIPE_CUDA_CHECK(cudaMemcpyAsync(device + off, s.buffer, n, cudaMemcpyHostToDevice, copy_stream_));
      UPIPE_CUDA_CHECK(cudaEventRecord(s.free, copy_stream_));
      s.used = true;
    }
  }
  void synchronize() const { UPIPE_CUDA_CHECK(cudaStreamSynchronize(host_stream_)); }
  // Work issued on `stream` from now on waits for the host copies issued so far.
  void join_into(cudaStream_t stream) {
    UPIPE_CUDA_CHECK(cudaEventRecord(host_done_, host_stream_));
    UPIPE_CUDA_CHECK(cudaStreamWaitEvent(stream, host_done_, 0));
  }

 private:
  struct slot {
    std::byte* buffer = nullptr;
    cudaEvent_t filled = nullptr, free = nullptr;
    bool used = false;
  };
  struct copy_job {
    std::byte* dst;
    const std::byte* src;
    std::size_t bytes;
  };

  // Never throws: waits for the host copies, then frees the buffers.
  void release() noexcept {
    if (host_stream_ != nullptr) log_cuda(cudaStreamSynchronize(host_stream_), "cudaStreamSynchronize(host copies)");
    for (slot& s : slots_) {
      if (s.buffer != nullptr) log_cuda(cudaFreeHost(s.buffer), "cudaFreeHost(bounce buffer)");
      if (s.filled != nullptr) log_cuda(cudaEventDestroy(s.filled), "cudaEventDestroy");
      if (s.free != nullptr) log_cuda(cudaEventDestroy(s.free), "cudaEventDestroy");
    }
    if (host_done_ != nullptr) log_cuda(cudaEventDestroy(host_done_), "cudaEventDestroy");
    if (host_stream_ != nullptr) log_cuda(cudaStreamDestroy(host_stream_), "cudaStreamDestroy(host copies)");
    host_stream_ = nullptr;
    host_done_ = nullptr;
    for (slot& s : slots_) s = slot{};
  }
  slot& next() { return slots_[next_++ % slots_.size()]; }
  void host_copy(std::byte* dst, const std::byte* src, std::size_t bytes) {
    auto job = std::make_unique<copy_job>(copy_job{dst, src, bytes});
    UPIPE_CUDA_CHECK(cudaLaunchHostFunc(
        host_stream_,
        [](void* p) {
          std::unique_ptr<copy_job> j(static_cast<copy_job*>(p));
          std::memcpy(j->dst, j->src, j->bytes);
        },
        job.get()));
    job.release();  // the host function owns it now
  }

  cudaStream_t copy_stream_;
  cudaStream_t host_stream_ = nullptr;
  cudaEvent_t host_done_ = nullptr;
  std::array<slot, 2> slots_{};
  std::size_t next_ = 0;
};

class cuda_backend final : public backend {
 public:
  cuda_backend(const memory_limits& limits, int device)
      : backend(backend_kind::cuda, dtype::bf16, limits), device_(device) {
    check_device(device);
    UPIPE_CUDA_CHECK(cudaSetDevice(device_));
    check_cudnn_version();
    try {
      acquire(device_arena().capacity(), host_arena().capacity(), limits.host_pageable);
    } catch (...) {
      release_all();
      throw;
    }
  }
  ~cuda_backend() override { release_all(); }

  void copy_bytes(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0 || dst == src) return;
    use_device();
    after_host_copies(dst, src);
    UPIPE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
  }
  void copy_bytes_side(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0 || dst == src) return;
    use_device();
    UPIPE_CUDA_CHECK(cudaEventRecord(compute_done_, stream_));
    UPIPE_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, compute_done_, 0));
    if (pageable_ && in_host_pool(dst) && !in_host_pool(src)) {
      pageable_->to_host(static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), bytes);
    } else if (pageable_ && in_host_pool(src) && !in_host_pool(dst)) {
      pageable_->to_device(static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), bytes);
    } else {
      UPIPE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, copy_stream_));
    }
  }
  void join_side_copies() override {
    use_device();
    UPIPE_CUDA_CHECK(cudaEventRecord(copies_done_, copy_stream_));
    UPIPE_CUDA_CHECK(cudaStreamWaitEvent(stream_, copies_done_, 0));
  }
  std::uint64_t side_point() override {
    use_device();
    cudaEvent_t e = nullptr;
    UPIPE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    UPIPE_CUDA_CHECK(cudaEventRecord(e, copy_stream_));
    side_points_.emplace(++last_side_point_, e);
    return last_side_point_;
  }
  void join_side_point(std::uint64_t point) override {
    use_device();
    const auto it = side_points_.find(point);
    UPIPE_CHECK(it != side_points_.end(), "side copy point " + std::to_string(point) + " is unknown or joined");
    UPIPE_CUDA_CHECK(cudaStreamWaitEvent(stream_, it->second, 0));
    // The wait holds what the event stood for; the event itself may go.
    UPIPE_CUDA_CHECK(cudaEventDestroy(it->second));
    side_points_.erase(it);
  }
  void when_done(std::function<void()> fn) override {
    use_device();
    auto job = std::make_unique<std::function<void()>>(std::move(fn));
    UPIPE_CUDA_CHECK(cudaLaunchHostFunc(
        stream_,
        [](void* p) {
          std::unique_ptr<std::function<void()>> f(static_cast<std::function<void()>*>(p));
          (*f)();
        },
        job.get()));
    job.release();  // the host function owns it now
  }
  void add_f32(float* dst, const float* src, std::size_t count) override {
    if (count == 0) return;
    use_device();
    cuda::add_f32(dst, src, count, stream_);
  }
  void fill_bytes(void* dst, int value, std::size_t bytes) override {
    if (bytes == 0) return;
    use_device();
    if (in_host_pool(dst)) {  // cudaMemset does not take host memory
      synchronize();
      std::memset(dst, value, bytes);
      return;
    }
    UPIPE_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream_));
  }
  void synchronize() override {
    note_host_sync();
    use_device();
    UPIPE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    UPIPE_CUDA_CHECK(cudaStreamSynchronize(copy_stream_));
    if (pageable_) pageable_->synchronize();  // the host reads and writes the pool after this
    std::size_t free_bytes = 0, total_bytes = 0;
    UPIPE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    driver_peak_ = std::max(driver_peak_, total_bytes - free_bytes);
  }
  std::size_t driver_peak_bytes() const override { return driver_peak_; }
  int device_index() const override { return device_; }
  void* native_stream() const override { return stream_; }
  std::string library_versions() const override {
    const std::size_t v = cuda::sdpa_engine::library_version();  // major*10000 + minor*100 + patch (cuDNN 9)
    int runtime = 0;
    UPIPE_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    return "cuDNN " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100) +
           ", CUDA runtime " + std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10);
  }

  void upload_f32(const tensor& dst, const float* host) override;
  void download_f32(float* host, const tensor& src) override;
  void upload_bytes(const tensor& dst, const void* host, std::size_t bytes) override {
    UPIPE_CHECK(bytes <= dst.bytes(), "upload larger than the tensor");
    if (bytes == 0) return;
    use_device();
    after_host_copies(dst.data(), host);
    UPIPE_CUDA_CHECK(cudaMemcpyAsync(dst.data(), host, bytes, cudaMemcpyDefault, stream_));
    synchronize();
  }
  void download_bytes(void* host, const tensor& src, std::size_t bytes) override {
    UPIPE_CHECK(bytes <= src.bytes(), "download larger than the tensor");
    if (bytes == 0) return;
    use_device();
    after_host_copies(host, src.data());
    UPIPE_CUDA_CHECK(cudaMemcpyAsync(host, src.data(), bytes, cudaMemcpyDefault, stream_));
    synchronize();
  }

  void run(const op& args) override {
    use_device();
    std::visit([this](const auto& a) { cuda::run(a, context_); }, args);
    // The host reads sum_squares' result once run() returns.
    if (const auto* s = std::get_if<sum_squares_args>(&args); s != nullptr && s->x.rows > 0 && s->x.cols > 0)
      synchronize();
    // cuBLAS's grouped GEMM read the groups' sizes back (the stream synchronized).
    if (const auto* g = std::get_if<moe_grouped_gemm_args>(&args); g != nullptr && g->engine == grouped_engine::cublas)
      note_host_sync();
  }

 protected:
  void record_mark(std::size_t index) override {
    use_device();
    while (marks_.size() <= index) {
      cudaEvent_t e = nullptr;
      UPIPE_CUDA_CHECK(cudaEventCreate(&e));
      marks_.push_back(e);
    }
    UPIPE_CUDA_CHECK(cudaEventRecord(marks_[index], stream_));
  }
  // bench --phases' phases as NVTX ranges, so that Nsight Systems shows them on its timeline.
  void open_range(const char* name) override { nvtxRangePushA(name); }
  void close_range() override { nvtxRangePop(); }
  double mark_interval_ms(std::size_t from, std::size_t to) override {
    float ms = 0;
    UPIPE_CUDA_CHECK(cudaEventElapsedTime(&ms, marks_[from], marks_[to]));
    return ms;
  }

 private:
  // Host conversions go through device staging of at most this many elements, so an
  // upload needs little memory beyond the arena.
  static constexpr std::int64_t staging_elements = std::int64_t{4} << 20;
  // Converts n elements through an f32 staging buffer on the device, one chunk of at most
  // staging_elements at a time: `chunk(staging, first, count)` issues that chunk's copy and
  // kernel on the stream; the buffer is freed and the stream synchronized after the last.
  template <class Chunk>
  void through_staging(std::int64_t n, Chunk chunk) {
    const std::int64_t most = std::min(n, staging_elements);
    float* staging = nullptr;
    UPIPE_CUDA_CHECK(cudaMallocAsync(&staging, static_cast<std::size_t>(most) * sizeof(float), stream_));
    for (std::int64_t first = 0; first < n; first += most) chunk(staging, first, std::min(most, n - first));
    UPIPE_CUDA_CHECK(cudaFreeAsync(staging, stream_));
    synchronize();
  }

  // Any thread may drive a backend; the device is per thread in the CUDA runtime.
  void use_device() const { UPIPE_CUDA_CHECK(cudaSetDevice(device_)); }

  bool in_host_pool(const void* p) const {
    const auto* b = static_cast<const std::byte*>(p);
    return host_base_ != nullptr && b >= host_base_ && b < host_base_ + host_arena().capacity();
  }
  // A copy on the step's stream that touches the pageable pool runs after the pool's host
  // copies issued so far (side copies finish there, beyond the copy stream).
  void after_host_copies(const void* dst, const void* src) {
    if (pageable_ && (in_host_pool(dst) || in_host_pool(src))) pageable_->join_into(stream_);
  }

  void acquire(std::size_t device_bytes, std::size_t host_bytes, bool host_pageable);
  void release_all() noexcept;
  void* engine_scratch(std::size_t bytes, const char* label);

  int device_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t copy_stream_ = nullptr;  // side copies (checkpoint offload and prefetch)
  cudaEvent_t compute_done_ = nullptr, copies_done_ = nullptr;
  std::byte* device_base_ = nullptr;  // the arena, device_arena().capacity() bytes
  std::byte* host_base_ = nullptr;    // the host pool, host_arena().capacity() bytes
  bool host_pageable_ = false;                 // the host pool is mmap'ed pageable memory
  std::unique_ptr<pageable_mover> pageable_;  // its bounce buffers and host copies
  double* sum_result_ = nullptr;      // (1) f64 on the device: sum_squares' result
  std::vector<tensor> scratch_;       // the engines' cached workspaces (tag workspace)
  std::unique_ptr<cuda::gemm_engine> gemm_engine_;
  std::unique_ptr<cuda::sdpa_engine> sdpa_engine_;
  std::unique_ptr<cuda::grouped_gemm_engine> grouped_engine_;
  cuda::context context_;  // what the ops run with: stream_, the engines, sum_result_
  std::size_t driver_peak_ = 0;
  std::vector<cudaEvent_t> marks_;  // phase timing's events, reused
  std::map<std::uint64_t, cudaEvent_t> side_points_;  // side_point()s not yet joined
  std::uint64_t last_side_point_ = 0;
};

void cuda_backend::acquire(std::size_t device_bytes, std::size_t host_bytes, bool host_pageable) {
  UPIPE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  UPIPE_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  UPIPE_CUDA_CHECK(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
  UPIPE_CUDA_CHECK(cudaEventCreateWithFlags(&copies_done_, cudaEventDisableTiming));
  if (device_bytes > 0) {
    void* base = nullptr;
    const cudaError_t status = cudaMalloc(&base, device_bytes);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      std::size_t free_bytes = 0, total_bytes = 0;
      log_cuda(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
      const std::size_t suggestion = std::max<std::size_t>(1, free_bytes / (std::size_t{1} << 30) * 9 / 10);
      throw config_error("cannot allocate the GPU arena of " + std::to_string(device_bytes) + " bytes (" +
                         gib(device_bytes) + ") on GPU " + std::to_string(device_) + ": " +
                         cudaGetErrorString(status) + "; the GPU has " + std::to_string(free_bytes) + " bytes (" +
                         gib(free_bytes) + ") free of " + std::to_string(total_bytes) + " (" + gib(total_bytes) +
                         "). Lower the arena with --memory-gib (for example --memory-gib " +
                         std::to_string(suggestion) + ", shared by the ranks on one GPU) or run `upipe plan` to find "
                         "a configuration that fits");
    }
    device_base_ = static_cast<std::byte*>(base);
  }
  if (host_bytes > 0 && host_pageable) {
    // Reserved, not committed: pages are backed as checkpoints first touch them.
    void* base = mmap(nullptr, host_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED)
      throw config_error("cannot reserve a pageable host pool of " + std::to_string(host_bytes) + " bytes (" +
                         gib(host_bytes) + ") for GPU " + std::to_string(device_) + ": " + std::strerror(errno) +
                         ". Lower --host-memory-gib or run `upipe plan` to find a configuration that fits");
    host_base_ = static_cast<std::byte*>(base);
    host_pageable_ = true;
    pageable_ = std::make_unique<pageable_mover>(copy_stream_);
  } else if (host_bytes > 0) {
    void* base = nullptr;
    const cudaError_t status = cudaHostAlloc(&base, host_bytes, cudaHostAllocPortable | cudaHostAllocMapped);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      throw config_error("cannot pin a host pool of " + std::to_string(host_bytes) + " bytes (" + gib(host_bytes) +
                         ") for GPU " + std::to_string(device_) + ": " + cudaGetErrorString(status) +
                         ". Lower the memory limit (--memory-gib) or run `upipe plan` to find a configuration "
                         "that fits");
    }
    host_base_ = static_cast<std::byte*>(base);
  }
  set_bases(device_base_, host_base_);
  UPIPE_CUDA_CHECK(cudaMalloc(&sum_result_, sizeof(double)));
  gemm_engine_ = std::make_unique<cuda::gemm_engine>(
      stream_, [this](std::size_t bytes) { return engine_scratch(bytes, "cublaslt_workspace"); });
  sdpa_engine_ = std::make_unique<cuda::sdpa_engine>(
      stream_, [this](std::size_t bytes) { return engine_scratch(bytes, "cudnn_workspace"); });
  grouped_engine_ = std::make_unique<cuda::grouped_gemm_engine>(
      stream_, [this](std::size_t bytes) { return engine_scratch(bytes, "grouped_gemm_workspace"); });
  context_ = {stream_, gemm_engine_.get(), sdpa_engine_.get(), sum_result_, grouped_engine_.get()};
}

// Never throws: a destructor (and a failed constructor) only logs.
void cuda_backend::release_all() noexcept {
  log_cuda(cudaSetDevice(device_), "cudaSetDevice");
  if (copy_stream_ != nullptr) log_cuda(cudaStreamSynchronize(copy_stream_), "cudaStreamSynchronize(copies)");
  if (stream_ != nullptr) log_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  for (cudaEvent_t e : marks_) log_cuda(cudaEventDestroy(e), "cudaEventDestroy");
  marks_.clear();
  for (const auto& [point, e] : side_points_) log_cuda(cudaEventDestroy(e), "cudaEventDestroy");
  side_points_.clear();
  grouped_engine_.reset();  // engines before the workspaces they hold (their destructors only log)
  sdpa_engine_.reset();
  gemm_engine_.reset();
  context_ = {};
  scratch_.clear();
  if (sum_result_ != nullptr) log_cuda(cudaFree(sum_result_), "cudaFree(sum_squares result)");
  if (device_base_ != nullptr) log_cuda(cudaFree(device_base_), "cudaFree(arena)");
  pageable_.reset();  // waits for its host copies
  if (host_base_ != nullptr && host_pageable_) {
    if (munmap(host_base_, host_arena().capacity()) != 0) std::fprintf(stderr, "upipe: munmap(host pool) failed\n");
  } else if (host_base_ != nullptr) {
    log_cuda(cudaFreeHost(host_base_), "cudaFreeHost(host pool)");
  }
  if (compute_done_ != nullptr) log_cuda(cudaEventDestroy(compute_done_), "cudaEventDestroy");
  if (copies_done_ != nullptr) log_cuda(cudaEventDestroy(copies_done_), "cudaEventDestroy");
  if (copy_stream_ != nullptr) log_cuda(cudaStreamDestroy(copy_stream_), "cudaStreamDestroy(copies)");
  if (stream_ != nullptr) log_cuda(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  sum_result_ = nullptr;
  device_base_ = host_base_ = nullptr;
  stream_ = copy_stream_ = nullptr;
  compute_done_ = copies_done_ = nullptr;
}

// The engines cache their workspaces, so these tensors live as long as the backend.
void* cuda_backend::engine_scratch(std::size_t bytes, const char* label) {
  const auto words = static_cast<std::int64_t>((bytes + sizeof(float) - 1) / sizeof(float));
  scratch_.push_back(allocate(mem_tag::workspace, dtype::f32, {words}, label));
  return scratch_.back().data();
}

void cuda_backend::upload_f32(const tensor& dst, const float* host) {
  const std::int64_t n = dst.numel();
  UPIPE_CHECK(dst.type() != dtype::i32 && dst.type() != dtype::u8,
              std::string("upload_f32 into the ") + std::string(dtype_name(dst.type())) + " tensor " + dst.label() +
                  ": ids and codes go through upload_bytes");
  if (dst.type() == dtype::f32) {
    upload_bytes(dst, host, static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
  if (n == 0) return;
  use_device();
  auto* out = dst.as<std::uint16_t>();
  if (in_host_pool(out)) {
    synchronize();
    for (std::int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(host[i]);
    return;
  }
  through_staging(n, [&](float* staging, std::int64_t first, std::int64_t count) {
    UPIPE_CUDA_CHECK(cudaMemcpyAsync(staging, host + first, static_cast<std::size_t>(count) * sizeof(float),
                                     cudaMemcpyHostToDevice, stream_));
    f32_to_bf16_kernel<<<elementwise_launch::blocks(count), elementwise_launch::threads, 0, stream_>>>(
        staging, out + first, count);
    UPIPE_CUDA_CHECK(cudaGetLastError());
  });
}

void cuda_backend::download_f32(float* host, const tensor& src) {
  const std::int64_t n = src.numel();
  UPIPE_CHECK(src.type() != dtype::i32 && src.type() != dtype::u8,
              std::string("download_f32 from the ") + std::string(dtype_name(src.type())) + " tensor " + src.label() +
                  ": ids and codes go through download_bytes");
  if (src.type() == dtype::f32) {
    download_bytes(host, src, static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
  if (n == 0) return;
  use_device();
  const auto* in = src.as<std::uint16_t>();
  if (in_host_pool(in)) {
    synchronize();
    for (std::int64_t i = 0; i < n; ++i) host[i] = bf16_to_float(in[i]);
    return;
  }
  through_staging(n, [&](float* staging, std::int64_t first, std::int64_t count) {
    bf16_to_f32_kernel<<<elementwise_launch::blocks(count), elementwise_launch::threads, 0, stream_>>>(
        in + first, staging, count);
    UPIPE_CUDA_CHECK(cudaGetLastError());
    UPIPE_CUDA_CHECK(cudaMemcpyAsync(host + first, staging, static_cast<std::size_t>(count) * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream_));
  });
}

}  // namespace

std::unique_ptr<backend> make_cuda_backend(const memory_limits& limits, int device) {
  return std::make_unique<cuda_backend>(limits, device);
}

std::size_t gpu_free_bytes(int device) {
  if (const std::size_t pretended = gpu_memory_override(); pretended > 0) return pretended;
  std::size_t free = 0, total = 0;
  if (cudaSetDevice(device) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess) {
    cudaGetLastError();  // clear it: the run's own calls name the device's trouble
    return 0;
  }
  return free;
}

}  // namespace upipe
