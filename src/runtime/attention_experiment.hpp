// One attention-layer experiment: forward and backward of the layer under CP on every
// rank of a group (threads on cpu, loopback rank 0 on meta), timed, with the ledger's
// peaks, the communicators' byte counts and, on backends with data, the error of every
// output against the float64 reference. Used by `upipe bench-attention` and the tests.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "cp/attention_config.hpp"

namespace upipe {

struct experiment_options {
  backend_kind backend = backend_kind::cpu;
  unsigned long long seed = 1;
  memory_limits limits;
  bool check = true;           // compare against the reference (backends with data)
  std::string dump_dir;        // write inputs, weights, outputs and gradients as .npy
  comm_options comm;           // how the ranks talk (threads in one process unless told)
  std::vector<std::int64_t> documents;  // packed documents: where each begins (empty: one)
};

struct experiment_result {
  attention_config config;
  backend_kind backend = backend_kind::cpu;
  double time_ms = 0;                               // forward + backward, rank 0
  std::map<std::string, std::size_t> peak_bytes;    // tag -> peak, rank 0
  std::size_t device_peak_bytes = 0;                // all device tags together, rank 0
  std::size_t arena_high_water = 0;                 // rank 0's arena high-water mark
  std::size_t driver_peak_bytes = 0;                // whole GPU per its driver (all virtual ranks); 0 on cpu
  std::size_t attention_peak_bytes = 0;             // max(forward, backward) of tag attention
  std::size_t attention_forward_peak = 0, attention_backward_peak = 0;
  std::size_t attention_host_peak = 0;              // tag attention_host (sequence chunks' K/V), rank 0
  // Rank 0's stage plan: the same peaks as the plan has them, and the bytes it sends by
  // message label and by link (stage_plan.hpp).
  std::size_t plan_forward_peak = 0, plan_backward_peak = 0, plan_host_peak = 0;
  std::map<std::string, std::uint64_t> plan_bytes_by_label;
  std::map<std::string, std::uint64_t> plan_bytes_by_link;
  // What the sliding window saved: the bytes the plan without it sends or copies beyond this one's.
  std::map<std::string, std::uint64_t> plan_saved_bytes_by_label;
  std::map<std::string, std::uint64_t> bytes_sent;           // collective -> bytes, rank 0
  std::map<std::string, std::uint64_t> bytes_sent_by_label;  // label -> bytes, rank 0
  std::map<std::string, double> rel_error;          // tensor -> max|a-b|/max|b|
  std::optional<double> max_rel_error;              // absent on meta
};

experiment_result run_attention_experiment(attention_config config, const experiment_options& options);

}  // namespace upipe
