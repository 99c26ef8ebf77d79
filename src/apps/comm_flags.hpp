// The flags of every command that runs a CP group on real ranks: how the ranks talk, and
// what runs beside the compute. One registration, one reading.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "comm/communicator.hpp"
#include "model/transformer.hpp"

namespace upipe::apps {

struct comm_flags {
  std::string kind = "auto";
  double timeout_s = comm_options{}.timeout_s;
  bool overlap = false, prefetch = false;

  // Checked here, before anything runs.
  comm_options options() const {
    const comm_options o{parse_comm_kind(kind), timeout_s};
    validate(o);
    return o;
  }
  // --overlap-comm and --prefetch-weights into a step's options.
  void apply(step_options& step) const {
    step.overlap_comm = overlap;
    step.prefetch_weights = prefetch;
  }
};

// --comm and --comm-timeout; with `step_flags` also --overlap-comm and --prefetch-weights.
inline void add_comm_flags(CLI::App& app, comm_flags& f, bool step_flags) {
  app.add_option("--comm", f.kind, "how ranks talk: auto (NCCL with a GPU per rank, else threads), threads, nccl")
      ->capture_default_str();
  app.add_option("--comm-timeout", f.timeout_s, "seconds before a stuck collective aborts every rank (NCCL)")
      ->capture_default_str();
  if (!step_flags) return;
  app.add_flag("--overlap-comm", f.overlap,
               "keep each attention stage's output all-to-all in flight while the next stage projects (NCCL)");
  app.add_flag("--prefetch-weights", f.prefetch, "ZeRO-3: gather the next layer's weights while this layer computes");
}

}  // namespace upipe::apps
