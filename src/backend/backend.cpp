#include "backend/backend.hpp"

#include <cstdio>
#include <sstream>

#include "core/error.hpp"
#include "core/machine.hpp"

namespace upipe {

std::string_view backend_name(backend_kind kind) {
  switch (kind) {
    case backend_kind::cpu: return "cpu";
    case backend_kind::meta: return "meta";
    case backend_kind::cuda: return "cuda";
  }
  return "unknown";
}

backend_kind parse_backend_kind(std::string_view name) {
  if (name == "cpu") return backend_kind::cpu;
  if (name == "meta") return backend_kind::meta;
  if (name == "cuda") return backend_kind::cuda;
  throw config_error("unknown backend '" + std::string(name) +
                     "': the backend must be one of cpu, meta, cuda (for example --backend cpu)");
}

backend::backend(backend_kind kind, dtype work_type, const memory_limits& limits)
    : kind_(kind), work_type_(work_type), device_arena_(limits.device_bytes), host_arena_(limits.host_bytes) {}

backend::~backend() = default;

void backend::set_phase_timing(bool on) {
  phase_timing_ = on && has_data();
  phase_stack_.clear();
  owner_of_mark_.clear();
  host_marks_.clear();
  side_copies_.clear();
  side_host_marks_.clear();
  stage_ = nullptr;
  if (!phase_timing_) return;
  mark_now();
}

void backend::mark_now() {
  record_mark(owner_of_mark_.size());
  owner_of_mark_.push_back({phase_stack_.empty() ? "other" : phase_stack_.back(), stage_});
}

void backend::change_phase(const char* name, bool push) {
  if (push) {
    phase_stack_.push_back(name);
  } else if (!phase_stack_.empty()) {
    phase_stack_.pop_back();
  }
  mark_now();
}

void backend::set_stage(const char* name) {
  if (!phase_timing_) return;
  const char* ended = stage_;
  stage_ = name;
  mark_now();
  if (stage_listener_ && ended != nullptr) stage_listener_(ended);
}

bool backend::is_stage_phase(std::string_view phase) {
  for (const char* p : {"wait_host", "wait_copy", "copy_out", "copy_in", "adamw", "grad_norm"})
    if (phase == p) return true;
  return false;
}

backend::phase_times backend::take_phases() {
  phase_times out;
  if (!phase_timing_) return out;
  record_mark(owner_of_mark_.size());  // closes the last interval
  synchronize();
  for (std::size_t i = 0; i < owner_of_mark_.size(); ++i) {
    const double ms = mark_interval_ms(i, i + 1);
    const mark_owner& o = owner_of_mark_[i];
    out.phases_ms[o.phase] += ms;
    out.stages_ms[is_stage_phase(o.phase) ? o.phase : std::string(o.stage != nullptr ? o.stage : "other")] += ms;
    out.span_ms += ms;
  }
  for (std::size_t i = 0; i < side_copies_.size(); ++i) {
    side_copy_time& t = out.side_copies[side_copies_[i].what];
    t.ms += side_copy_ms(i);
    t.bytes += static_cast<double>(side_copies_[i].bytes);
    ++t.count;
  }
  owner_of_mark_.clear();
  host_marks_.clear();
  side_copies_.clear();
  side_host_marks_.clear();
  // The open scopes and the stage go on from here: they own the time until the next change.
  mark_now();
  return out;
}

void backend::record_mark(std::size_t index) {
  if (host_marks_.size() <= index) host_marks_.resize(index + 1);
  host_marks_[index] = std::chrono::steady_clock::now();
}

double backend::mark_interval_ms(std::size_t from, std::size_t to) {
  return std::chrono::duration<double, std::milli>(host_marks_[to] - host_marks_[from]).count();
}

void backend::copy_bytes_side(void* dst, const void* src, std::size_t bytes, const char* what) {
  if (!phase_timing_ || bytes == 0 || dst == src) return side_copy(dst, src, bytes, no_side_mark);
  side_copies_.push_back({what, bytes});
  side_copy(dst, src, bytes, side_copies_.size() - 1);
}

void backend::side_copy(void* dst, const void* src, std::size_t bytes, std::size_t timed) {
  record_side_copy_mark(timed, false);
  copy_bytes(dst, src, bytes);
  record_side_copy_mark(timed, true);
}

void backend::record_side_copy_mark(std::size_t timed, bool end) {
  if (timed == no_side_mark) return;
  if (side_host_marks_.size() < 2 * timed + 2) side_host_marks_.resize(2 * timed + 2);
  side_host_marks_[2 * timed + (end ? 1 : 0)] = std::chrono::steady_clock::now();
}

double backend::side_copy_ms(std::size_t timed) {
  return std::chrono::duration<double, std::milli>(side_host_marks_[2 * timed + 1] - side_host_marks_[2 * timed]).count();
}

void backend::join_side_copies() {
  const phase_scope wait(*this, "wait_copy");
  join_all_side_copies();
}

void backend::join_side_point(std::uint64_t point) {
  const phase_scope wait(*this, "wait_copy");
  join_one_side_point(point);
}

std::string backend::breakdown() const {
  std::ostringstream out;
  for (std::size_t i = 0; i < mem_tag_count; ++i) {
    const auto tag = static_cast<mem_tag>(i);
    if (ledger_.current(tag) == 0) continue;
    out << " " << mem_tag_name(tag) << "=" << ledger_.current(tag);
  }
  return out.str();
}

void require_host_memory(std::size_t bytes, const std::string& what) {
  const std::size_t available = available_memory_bytes();
  if (available == 0 || bytes <= available) return;
  const auto gib = [](std::size_t b) { return std::to_string(static_cast<double>(b) / (1 << 30)).substr(0, 6); };
  throw out_of_memory_error(what + " need " + gib(bytes) + " GiB of host memory, and this machine has " +
                            gib(available) + " GiB available: shorten --seq-len, use a smaller model (--layers N, a "
                            "slice), or see the memory a run needs on the meta backend (--backend meta)");
}

tensor backend::allocate(mem_tag tag, dtype type, const shape& dims, const char* label) {
  for (int i = 0; i < dims.rank; ++i)
    UPIPE_CHECK(dims[i] >= 0, std::string("negative dimension in ") + label + " " + dims.str());
  const std::size_t bytes = static_cast<std::size_t>(dims.numel()) * dtype_size(type);
  const bool host = is_host_tag(tag);
  arena_allocator& arena = host ? host_arena_ : device_arena_;
  const auto offset = arena.allocate(bytes);
  if (!offset) {
    std::ostringstream msg;
    msg << "out of memory on the " << backend_name(kind_) << " backend: " << label << " (tag "
        << mem_tag_name(tag) << ") asked for " << bytes << " bytes; the " << (host ? "host pool" : "arena")
        << " holds " << arena.capacity() << " bytes, " << arena.in_use() << " in use, largest free block "
        << arena.largest_free() << "; in use by tag:" << breakdown()
        << ". Run `upipe plan` to find a configuration that fits, or shorten the sequence.";
    throw out_of_memory_error(msg.str());
  }
  std::byte* base = host ? host_base_ : device_base_;
  void* data = base == nullptr ? nullptr : base + *offset;
  ledger_.on_alloc(tag, bytes, label);
  return tensor(this, *offset, data, bytes, type, dims, tag, label);
}

tensor backend::allocate_zeroed(mem_tag tag, dtype type, const shape& dims, const char* label) {
  tensor t = allocate(tag, type, dims, label);
  if (has_data() && t.bytes() > 0) fill_bytes(t.data(), 0, t.bytes());
  return t;
}

void backend::retag(tensor& t, mem_tag tag) {
  UPIPE_CHECK(!t.empty() && t.owner_ == this, "retag of a tensor this backend does not own");
  UPIPE_CHECK(!is_host_tag(t.tag()) && !is_host_tag(tag), "retag moves between device tags only");
  ledger_.on_free(t.tag(), t.bytes(), t.label());
  ledger_.on_alloc(tag, t.bytes(), t.label());
  t.tag_ = tag;
}

// A tensor's memory goes back to the backend that owns it: core's tensor frees through
// here, so that core needs nothing of the backend but its name.
void tensor::reset() noexcept {
  if (owner_ != nullptr) owner_->release(*this, offset_);
  owner_ = nullptr;
  data_ = nullptr;
}

void backend::release(const tensor& t, std::size_t offset) noexcept {
  const bool host = is_host_tag(t.tag());
  try {
    if (t.data() != nullptr) on_release(t.data(), (host ? host_arena_ : device_arena_).block_size(offset), host);
    (host ? host_arena_ : device_arena_).free(offset);
    ledger_.on_free(t.tag(), t.bytes(), t.label());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "upipe: error while freeing %s: %s\n", t.label(), e.what());
  }
}

#ifndef UPIPE_HAVE_CUDA
std::size_t gpu_free_bytes(int) { return gpu_memory_override(); }
#endif

std::unique_ptr<backend> make_backend(backend_kind kind, const memory_limits& limits) {
  switch (kind) {
    case backend_kind::cpu: return make_cpu_backend(limits);
    case backend_kind::meta: return make_meta_backend(limits);
    case backend_kind::cuda:
#ifdef UPIPE_HAVE_CUDA
      return make_cuda_backend(limits, 0);
#else
      break;
#endif
  }
  throw config_error(
      "backend 'cuda' is not available in this build (no CUDA backend compiled in): use --backend cpu "
      "for real numbers or --backend meta for memory only");
}

}  // namespace upipe
