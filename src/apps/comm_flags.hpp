// How the ranks talk, and what runs beside the compute: the run configuration's rows
// (--comm, --comm-timeout, --overlap-comm, --prefetch-weights) for train and bench, and the
// same flags for bench-comm, which takes no run configuration.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "apps/run_config.hpp"
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

// The run configuration's: how the ranks talk (checked), and what runs beside the compute.
inline comm_options comm_of(const run_config& c) { return comm_flags{c.comm, c.comm_timeout}.options(); }
inline void apply_comm(const run_config& c, step_options& step) {
  step.overlap_comm = c.overlap_comm;
  step.prefetch_weights = c.prefetch_weights;
}

}  // namespace upipe::apps
