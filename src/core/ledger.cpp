#include "core/ledger.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace upipe {

std::string_view mem_tag_name(mem_tag tag) {
  switch (tag) {
    case mem_tag::weights: return "weights";
    case mem_tag::grads: return "grads";
    case mem_tag::optimizer: return "optimizer";
    case mem_tag::checkpoints_device: return "checkpoints_device";
    case mem_tag::checkpoints_host: return "checkpoints_host";
    case mem_tag::optimizer_host: return "optimizer_host";
    case mem_tag::attention_host: return "attention_host";
    case mem_tag::weights_host: return "weights_host";
    case mem_tag::activations: return "activations";
    case mem_tag::attention: return "attention";
    case mem_tag::comm: return "comm";
    case mem_tag::workspace: return "workspace";
    case mem_tag::count: break;
  }
  return "unknown";
}

void memory_ledger::note_peaks(std::size_t i) {
  peak_[i] = std::max(peak_[i], current_[i]);
  window_peak_[i] = std::max(window_peak_[i], current_[i]);
  device_peak_ = std::max(device_peak_, device_current_);
}

void memory_ledger::on_alloc(mem_tag tag, std::size_t bytes, std::string_view label) {
  const std::size_t i = index(tag);
  current_[i] += bytes;
  if (!is_host_tag(tag)) device_current_ += bytes;
  note_peaks(i);
  ++seq_;
  if (timeline_on_)
    timeline_.push_back({seq_, tag, static_cast<std::int64_t>(bytes), device_current_, std::string(label)});
  if (observer_ != nullptr) observer_->allocated(tag, bytes, label);
}

void memory_ledger::on_free(mem_tag tag, std::size_t bytes, std::string_view label) {
  const std::size_t i = index(tag);
  UPIPE_CHECK(current_[i] >= bytes, "ledger underflow for tag " + std::string(mem_tag_name(tag)));
  current_[i] -= bytes;
  if (!is_host_tag(tag)) device_current_ -= bytes;
  ++seq_;
  if (timeline_on_)
    timeline_.push_back({seq_, tag, -static_cast<std::int64_t>(bytes), device_current_, std::string(label)});
  if (observer_ != nullptr) observer_->freed(tag, bytes, label);
}

std::map<std::string, std::size_t> memory_ledger::peaks_by_name() const {
  std::map<std::string, std::size_t> out;
  for (std::size_t i = 0; i < mem_tag_count; ++i) out[std::string(mem_tag_name(static_cast<mem_tag>(i)))] = peak_[i];
  return out;
}

void memory_ledger::reset_window() {
  window_peak_ = current_;
}

}  // namespace upipe
