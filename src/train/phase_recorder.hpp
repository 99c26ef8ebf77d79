// train --phases: rank 0's phase table of each step (step_phases, trainer.hpp), and each
// stage's time on stderr as the stage ends, so that a step longer than a sitting shows how
// far it came. The stage ends synchronize the step's stream (a kernel launch's worth of idle
// GPU each).
#pragma once

#include <cstdint>

#include "backend/backend.hpp"
#include "model/parameter_store.hpp"
#include "train/trainer.hpp"

namespace upipe {

class phase_recorder {
 public:
  // Off: every call does nothing. On: phase timing and the host's timing for the run.
  phase_recorder(backend& be, parameter_store& trained, bool on);
  ~phase_recorder();
  phase_recorder(const phase_recorder&) = delete;
  phase_recorder& operator=(const phase_recorder&) = delete;

  // A step begins: what ran since the last (held-out loss, saves) is no step's.
  void begin(std::int64_t step);
  // The rest of the step's stream and its host work, into the record (before its clock stops).
  void end(step_record& record);

 private:
  void stage_ended(const char* stage);

  backend& be_;
  parameter_store& trained_;
  bool on_;
  std::int64_t step_ = 0;
  step_phases table_;
};

}  // namespace upipe
