// The memory ledger: bytes current and peak per tag on one rank, a resettable window
// (for phase peaks such as the attention phase) and an optional timeline.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace upipe {

enum class mem_tag : std::uint8_t {
  weights,
  grads,
  optimizer,
  checkpoints_device,
  checkpoints_host,
  optimizer_host,  // --offload optimizer: master weights, moments and gradient shards in host memory
  attention_host,  // sequence chunks: earlier chunks' K/V (and their gradients) in host memory
  weights_host,    // --offload optimizer,params: the working-dtype weights in host memory
  activations,
  attention,
  comm,
  workspace,
  count
};
constexpr std::size_t mem_tag_count = static_cast<std::size_t>(mem_tag::count);

std::string_view mem_tag_name(mem_tag tag);
// Host tags live in host memory; every other tag is device (arena) memory.
constexpr bool is_host_tag(mem_tag tag) {
  return tag == mem_tag::checkpoints_host || tag == mem_tag::optimizer_host || tag == mem_tag::weights_host ||
         tag == mem_tag::attention_host;
}

struct ledger_event {
  std::uint64_t seq;
  mem_tag tag;
  std::int64_t delta;         // bytes, + on allocation, - on free
  std::uint64_t device_total;  // device bytes in use after the event
  std::string label;
};

// Sees every allocation and free of a ledger as it happens (the attention plan's check,
// cp/stage_plan.hpp). Must not throw: it notes what it finds and reports it later.
class ledger_observer {
 public:
  virtual ~ledger_observer() = default;
  virtual void allocated(mem_tag tag, std::size_t bytes, std::string_view label) = 0;
  virtual void freed(mem_tag tag, std::size_t bytes, std::string_view label) = 0;
};

class memory_ledger {
 public:
  // At most one observer at a time; nullptr removes it.
  void set_observer(ledger_observer* observer) { observer_ = observer; }
  ledger_observer* observer() const { return observer_; }

  void on_alloc(mem_tag tag, std::size_t bytes, std::string_view label);
  void on_free(mem_tag tag, std::size_t bytes, std::string_view label);

  std::size_t current(mem_tag tag) const { return current_[index(tag)]; }
  std::size_t peak(mem_tag tag) const { return peak_[index(tag)]; }
  // Device bytes (all non-host tags together), now and at their highest.
  std::size_t device_current() const { return device_current_; }
  std::size_t device_peak() const { return device_peak_; }
  // Every tag's peak under its name (for reports and JSON).
  std::map<std::string, std::size_t> peaks_by_name() const;

  // A window starts at the current values; window_peak() is the highest value since.
  void reset_window();
  std::size_t window_peak(mem_tag tag) const { return window_peak_[index(tag)]; }

  // The timeline keeps every event while enabled (off by default: it grows with the run).
  void record_timeline(bool on) { timeline_on_ = on; }
  const std::vector<ledger_event>& timeline() const { return timeline_; }

 private:
  static std::size_t index(mem_tag t) { return static_cast<std::size_t>(t); }
  void note_peaks(std::size_t tag_index);

  std::array<std::size_t, mem_tag_count> current_{}, peak_{}, window_peak_{};
  std::size_t device_current_ = 0, device_peak_ = 0;
  std::uint64_t seq_ = 0;
  bool timeline_on_ = false;
  std::vector<ledger_event> timeline_;
  ledger_observer* observer_ = nullptr;
};

}  // namespace upipe
