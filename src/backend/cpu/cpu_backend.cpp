// The cpu backend: the reference. fp32 everywhere; the arenas are reserved address
// ranges whose pages the kernel commits on first touch and that large frees give back.
#include <sys/mman.h>

#include <cstring>
#include <variant>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "ops/cpu/cpu_ops.hpp"

namespace upipe {

namespace {

std::byte* reserve(std::size_t bytes, const char* what) {
  if (bytes == 0) return nullptr;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw config_error(std::string("cannot reserve ") + std::to_string(bytes) + " bytes of address space for the cpu " +
                       what + ": lower the memory limit (for example --memory-gib 8)");
  return static_cast<std::byte*>(p);
}

class cpu_backend final : public backend {
 public:
  explicit cpu_backend(const memory_limits& limits)
      : backend(backend_kind::cpu, dtype::f32, limits),
        device_bytes_(device_arena().capacity()),
        host_bytes_(host_arena().capacity()) {
    device_base_ = reserve(device_bytes_, "arena");
    host_base_ = reserve(host_bytes_, "host pool");
    set_bases(device_base_, host_base_);
  }
  ~cpu_backend() override {
    if (device_base_ != nullptr) munmap(device_base_, device_bytes_);
    if (host_base_ != nullptr) munmap(host_base_, host_bytes_);
  }

  void copy_bytes(void* dst, const void* src, std::size_t bytes) override {
    if (dst != src && bytes > 0) std::memmove(dst, src, bytes);
  }
  void add_f32(float* dst, const float* src, std::size_t count) override {
    for (std::size_t i = 0; i < count; ++i) dst[i] += src[i];
  }
  void fill_bytes(void* dst, int value, std::size_t bytes) override { std::memset(dst, value, bytes); }
  void synchronize() override { note_host_sync(); }
  void upload_f32(const tensor& dst, const float* host) override {
    note_host_sync();
    const std::int64_t n = dst.numel();
    UPIPE_CHECK(dst.type() == dtype::f32 || dst.type() == dtype::bf16,
                std::string("upload_f32 into the ") + std::string(dtype_name(dst.type())) + " tensor " + dst.label() +
                    ": ids and codes go through upload_bytes");
    if (n == 0) return;  // an empty shard: its host side may be a null pointer, which memcpy may not take
    if (dst.type() == dtype::f32) {
      std::memcpy(dst.data(), host, static_cast<std::size_t>(n) * sizeof(float));
      return;
    }
    auto* out = dst.as<std::uint16_t>();
    for (std::int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(host[i]);
  }
  void upload_bytes(const tensor& dst, const void* host, std::size_t bytes) override {
    note_host_sync();
    UPIPE_CHECK(bytes <= dst.bytes(), "upload larger than the tensor");
    if (bytes > 0) std::memcpy(dst.data(), host, bytes);
  }
  void download_bytes(void* host, const tensor& src, std::size_t bytes) override {
    note_host_sync();
    UPIPE_CHECK(bytes <= src.bytes(), "download larger than the tensor");
    if (bytes > 0) std::memcpy(host, src.data(), bytes);
  }
  void download_f32(float* host, const tensor& src) override {
    note_host_sync();
    const std::int64_t n = src.numel();
    UPIPE_CHECK(src.type() == dtype::f32 || src.type() == dtype::bf16,
                std::string("download_f32 from the ") + std::string(dtype_name(src.type())) + " tensor " +
                    src.label() + ": ids and codes go through download_bytes");
    if (n == 0) return;
    if (src.type() == dtype::f32) {
      std::memcpy(host, src.data(), static_cast<std::size_t>(n) * sizeof(float));
      return;
    }
    const auto* in = src.as<std::uint16_t>();
    for (std::int64_t i = 0; i < n; ++i) host[i] = bf16_to_float(in[i]);
  }

  void run(const op& args) override {
    std::visit([](const auto& a) { cpu::run(a); }, args);
    // The host reads sum_squares' result, which waits on a device.
    if (std::holds_alternative<sum_squares_args>(args)) note_host_sync();
  }

 protected:
  // Give large freed blocks' pages back so resident memory follows the ledger.
  void on_release(void* data, std::size_t bytes, bool) override {
    constexpr std::size_t page = 4096, threshold = std::size_t{1} << 20;
    if (bytes < threshold) return;
    auto begin = (reinterpret_cast<std::uintptr_t>(data) + page - 1) / page * page;
    auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes) / page * page;
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }

 private:
  std::size_t device_bytes_, host_bytes_;
  std::byte* device_base_ = nullptr;
  std::byte* host_base_ = nullptr;
};

}  // namespace

std::unique_ptr<backend> make_cpu_backend(const memory_limits& limits) {
  return std::make_unique<cpu_backend>(limits);
}

}  // namespace upipe
