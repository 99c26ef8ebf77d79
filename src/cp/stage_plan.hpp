// The stage plan of an attention strategy, built once per configuration and rank: what the
// executor runs (the stages, their sequence chunks and their fused attention calls) and
// everything the attention phase allocates, releases and sends, in the executor's order,
// with shapes and byte counts. The executors take their steps and calls from it, and
// while they run a check (plan_check) holds every allocation of theirs to the plan's next
// one and their live bytes to the plan's; so the memory model (the peak of the plan's
// events), the communication volume (the sum of its messages), bench-comm, the counters
// tests and the planner all read what actually runs.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/ledger.hpp"
#include "core/shape.hpp"
#include "cp/attention_config.hpp"
#include "cp/head_schedule.hpp"

namespace upipe {

// One fused attention call of a stage: stage slots [q_slot, q_slot + n_q) read kv slots
// [kv_slot, kv_slot + n_kv) of resident block `block` (its index among the blocks resident
// at the stage, in order of arrival), n_q / n_kv query heads per kv head.
struct sdpa_call {
  int q_slot = 0, n_q = 0;
  std::size_t block = 0;
  int kv_slot = 0, n_kv = 0;
};

// What a stage of a staged strategy does on this rank.
struct stage_step {
  int arriving = -1;  // the index of the kv block that becomes resident here (head_schedule::blocks), or -1
  std::vector<sdpa_call> calls;
  std::vector<std::size_t> used_blocks;  // resident blocks the calls read, ascending
};

// An allocation of the attention phase.
struct plan_buffer {
  const char* label = "";  // a string literal, as the executors' labels are
  mem_tag tag = mem_tag::attention;
  bool f32 = false;  // else the backend's working dtype
  shape dims;
  std::size_t bytes(dtype work) const {
    return static_cast<std::size_t>(dims.numel()) * (f32 ? std::size_t{4} : dtype_size(work));
  }
};

// Which link a message takes: the all-to-all group, the ring, or the copy stream between
// device and host memory.
enum class plan_link : std::uint8_t { all_to_all, ring, device_to_host, host_to_device };
std::string_view link_name(plan_link link);

// A message this rank sends: an all-to-all of `ranks` ranks sends `elements` in equal
// parts, one part to each rank, its own included; a ring step or a host copy sends all of
// them.
struct plan_message {
  const char* label = "";
  plan_link link = plan_link::all_to_all;
  int ranks = 1;
  std::int64_t elements = 0;
  bool f32 = false;
  std::uint64_t bytes(dtype work) const {
    return static_cast<std::uint64_t>(elements) * (f32 ? 4u : dtype_size(work));
  }
  // The bytes that leave the rank (an all-to-all keeps its own part).
  std::uint64_t bytes_leaving(dtype work) const {
    return link == plan_link::all_to_all ? bytes(work) / ranks * (ranks - 1) : bytes(work);
  }
};

// What one pass (forward or backward) allocates, releases and sends, in order.
class pass_plan {
 public:
  struct event {
    enum class kind : std::uint8_t { allocate, release, message } what;
    std::size_t index;  // into buffers() or messages()
  };

  std::size_t allocate(const char* label, mem_tag tag, bool f32, const shape& dims);
  void release(std::size_t buffer);
  void send(const char* label, plan_link link, int ranks, std::int64_t elements, bool f32);

  const std::vector<plan_buffer>& buffers() const { return buffers_; }
  const std::vector<plan_message>& messages() const { return messages_; }
  const std::vector<event>& events() const { return events_; }
  // The most bytes of `tag` live at once.
  std::size_t peak(mem_tag tag, dtype work) const;
  // Bytes sent, by message label and by link (whole buffers, as the counters count them).
  std::map<std::string, std::uint64_t> bytes_by_label(dtype work) const;
  std::map<plan_link, std::uint64_t> bytes_by_link(dtype work) const;

 private:
  std::vector<plan_buffer> buffers_;
  std::vector<plan_message> messages_;
  std::vector<event> events_;
};

struct stage_plan {
  attention_config config;  // validated
  int rank = 0;             // in the CP group
  int group_rank = 0;       // in the all-to-all group (the CP group but in hybrid)
  std::optional<head_schedule> schedule;  // staged strategies: over the all-to-all group
  std::vector<stage_step> stages;  // staged strategies (one for ulysses and fpdt); none for ring
  std::vector<row_chunk> chunks;   // the sequence chunks of a rank's shard (one: the whole shard)
  // Per chunk i: the first kv part query part i's window reaches (0 without a window); the
  // chunked executors skip the parts before it.
  std::vector<std::size_t> first_part;
  pass_plan forward, backward;

  // The attention phase's working set: the peaks of the device tag `attention` in each pass
  // and of the host tag `attention_host` (earlier chunks' K/V and their gradients).
  std::size_t forward_peak(dtype work) const { return forward.peak(mem_tag::attention, work); }
  std::size_t backward_peak(dtype work) const { return backward.peak(mem_tag::attention, work); }
  std::size_t peak(dtype work) const;
  std::size_t host_peak(dtype work) const;
  // Forward and backward together.
  std::map<std::string, std::uint64_t> bytes_by_label(dtype work) const;
  std::map<plan_link, std::uint64_t> bytes_by_link(dtype work) const;
  // What the sliding window saved, forward and backward together: by label, the bytes the
  // same plan without the window sends (or copies) beyond this one's (empty without one).
  std::map<std::string, std::uint64_t> saved_bytes_by_label(dtype work) const;
  std::uint64_t saved_bytes(dtype work) const;
};

// The plan of `config` (validated here) on `rank` of the CP group.
stage_plan make_stage_plan(attention_config config, int rank);

// Holds an executor's allocations to a pass of its plan while it runs: each allocation of
// the tags attention and attention_host must be the plan's next, with its label and bytes,
// and the bytes live at that moment must be the plan's (so the two peaks are equal). Frees
// may come in any order between allocations. The first difference is kept and thrown by
// finish() as an internal error, which also requires the whole pass to have run.
class plan_check final : public ledger_observer {
 public:
  plan_check(memory_ledger& ledger, const pass_plan& pass, dtype work, const char* what);
  ~plan_check() override;
  plan_check(const plan_check&) = delete;
  plan_check& operator=(const plan_check&) = delete;

  void allocated(mem_tag tag, std::size_t bytes, std::string_view label) override;
  void freed(mem_tag tag, std::size_t bytes, std::string_view label) override;
  void finish();

 private:
  static bool watched(mem_tag tag) { return tag == mem_tag::attention || tag == mem_tag::attention_host; }
  void fail(const std::string& message);

  memory_ledger& ledger_;
  ledger_observer* previous_;
  const pass_plan& pass_;
  dtype work_;
  const char* what_;
  std::size_t next_ = 0;  // the next event of the plan
  std::map<mem_tag, std::int64_t> plan_live_, live_;
  std::string error_;
};

}  // namespace upipe
