// The stage plans: what the passes allocate and send (the builders that walk each
// strategy's passes are in stage_plan_staged.cpp and stage_plan_chunks.cpp), and
// plan_check, which holds the executors to them while they run.
#include "cp/stage_plan.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "cp/strategy_table.hpp"

namespace upipe {

std::string_view link_name(plan_link link) {
  switch (link) {
    case plan_link::all_to_all: return "all_to_all";
    case plan_link::ring: return "ring";
    case plan_link::device_to_host: return "device_to_host";
    case plan_link::host_to_device: return "host_to_device";
  }
  return "unknown";
}

std::size_t pass_plan::allocate(const char* label, mem_tag tag, bool f32, const shape& dims) {
  buffers_.push_back({label, tag, f32, dims});
  events_.push_back({event::kind::allocate, buffers_.size() - 1});
  return buffers_.size() - 1;
}

void pass_plan::release(std::size_t buffer) { events_.push_back({event::kind::release, buffer}); }

void pass_plan::send(const char* label, plan_link link, int ranks, std::int64_t elements, bool f32) {
  messages_.push_back({label, link, ranks, elements, f32});
  events_.push_back({event::kind::message, messages_.size() - 1});
}

std::size_t pass_plan::peak(mem_tag tag, dtype work) const {
  std::size_t live = 0, most = 0;
  for (const event& e : events_) {
    if (e.what == event::kind::message || buffers_[e.index].tag != tag) continue;
    const std::size_t b = buffers_[e.index].bytes(work);
    if (e.what == event::kind::allocate) {
      live += b;
      most = std::max(most, live);
    } else {
      live -= b;
    }
  }
  return most;
}

std::map<std::string, std::uint64_t> pass_plan::bytes_by_label(dtype work) const {
  std::map<std::string, std::uint64_t> out;
  for (const plan_message& m : messages_) out[m.label] += m.bytes(work);
  return out;
}

std::map<plan_link, std::uint64_t> pass_plan::bytes_by_link(dtype work) const {
  std::map<plan_link, std::uint64_t> out;
  for (const plan_message& m : messages_) out[m.link] += m.bytes(work);
  return out;
}

std::size_t stage_plan::peak(dtype work) const { return std::max(forward_peak(work), backward_peak(work)); }

std::size_t stage_plan::host_peak(dtype work) const {
  return std::max(forward.peak(mem_tag::attention_host, work), backward.peak(mem_tag::attention_host, work));
}

std::map<std::string, std::uint64_t> stage_plan::bytes_by_label(dtype work) const {
  std::map<std::string, std::uint64_t> out = forward.bytes_by_label(work);
  for (const auto& [label, bytes] : backward.bytes_by_label(work)) out[label] += bytes;
  return out;
}

std::map<plan_link, std::uint64_t> stage_plan::bytes_by_link(dtype work) const {
  std::map<plan_link, std::uint64_t> out = forward.bytes_by_link(work);
  for (const auto& [link, bytes] : backward.bytes_by_link(work)) out[link] += bytes;
  return out;
}

std::map<std::string, std::uint64_t> stage_plan::saved_bytes_by_label(dtype work) const {
  std::map<std::string, std::uint64_t> out;
  if (config.window == 0) return out;
  attention_config global = config;
  global.window = 0;
  const std::map<std::string, std::uint64_t> here = bytes_by_label(work);
  for (const auto& [label, bytes] : make_stage_plan(global, rank).bytes_by_label(work)) {
    const auto it = here.find(label);
    const std::uint64_t sent = it == here.end() ? 0 : it->second;
    if (bytes > sent) out[label] = bytes - sent;
  }
  return out;
}

std::uint64_t stage_plan::saved_bytes(dtype work) const {
  std::uint64_t total = 0;
  for (const auto& [label, bytes] : saved_bytes_by_label(work)) total += bytes;
  return total;
}

stage_plan make_stage_plan(attention_config config, int rank) {
  validate(config);
  stage_plan p;
  p.config = config;
  p.rank = rank;
  const int A = config.all_to_all_size();
  p.group_rank = config.meshed() ? rank % A : rank;
  p.chunks = sequence_chunks(config.local_tokens(), config.seq_chunks);
  // Chunk i's gathered rows are the sequence's [first_i A, (first_i + count_i) A).
  for (const row_chunk& q : p.chunks) {
    std::size_t j = 0;
    while (j + 1 < p.chunks.size() && &p.chunks[j] != &q &&
           !document_mask{{}, A * q.first, A * p.chunks[j].first}.shares_document(A * q.count, A * p.chunks[j].count,
                                                                                config.window))
      ++j;
    p.first_part.push_back(j);
  }
  row_of(config.strategy).plan(p);
  return p;
}

plan_check::plan_check(memory_ledger& ledger, const pass_plan& pass, dtype work, const char* what)
    : ledger_(ledger), previous_(ledger.observer()), pass_(pass), work_(work), what_(what) {
  ledger_.set_observer(this);
}

plan_check::~plan_check() { ledger_.set_observer(previous_); }

void plan_check::fail(const std::string& message) {
  if (error_.empty()) error_ = message;
}

void plan_check::allocated(mem_tag tag, std::size_t bytes, std::string_view label) {
  if (!watched(tag) || !error_.empty()) return;
  live_[tag] += static_cast<std::int64_t>(bytes);
  const auto& events = pass_.events();
  // The plan's releases up to its next allocation.
  while (next_ < events.size() && events[next_].what != pass_plan::event::kind::allocate) {
    if (events[next_].what == pass_plan::event::kind::release) {
      const plan_buffer& b = pass_.buffers()[events[next_].index];
      plan_live_[b.tag] -= static_cast<std::int64_t>(b.bytes(work_));
    }
    ++next_;
  }
  if (next_ == events.size())
    return fail(std::string(label) + " (" + std::to_string(bytes) + " bytes) is past the end of the plan");
  const plan_buffer& b = pass_.buffers()[events[next_].index];
  ++next_;
  plan_live_[b.tag] += static_cast<std::int64_t>(b.bytes(work_));
  if (label != b.label || b.bytes(work_) != bytes || b.tag != tag)
    return fail(std::string(label) + " of " + std::to_string(bytes) + " bytes (" + std::string(mem_tag_name(tag)) +
                ") where the plan allocates " + std::string(b.label) + " of " + std::to_string(b.bytes(work_)) + " bytes (" +
                std::string(mem_tag_name(b.tag)) + ")");
  if (plan_live_[tag] != live_[tag])
    fail("after " + std::string(label) + ", " + std::to_string(live_[tag]) + " bytes are live where the plan has " +
         std::to_string(plan_live_[tag]));
}

void plan_check::freed(mem_tag tag, std::size_t bytes, std::string_view /*label*/) {
  if (watched(tag)) live_[tag] -= static_cast<std::int64_t>(bytes);
}

void plan_check::finish() {
  if (error_.empty())
    for (std::size_t i = next_; i < pass_.events().size(); ++i)
      if (pass_.events()[i].what == pass_plan::event::kind::allocate) {
        fail("the plan's " + std::string(pass_.buffers()[pass_.events()[i].index].label) + " was never allocated");
        break;
      }
  if (!error_.empty()) throw internal_error(std::string("the attention ") + what_ + " left its stage plan: " + error_);
}

}  // namespace upipe
