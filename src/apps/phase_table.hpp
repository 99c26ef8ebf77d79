// The step's phase table as train --phases and bench --phases print it (docs/design.md
// section 5, "The offloaded step's phases"), the step-time model's prediction beside it,
// and both as JSON.
#pragma once

#include <nlohmann/json.hpp>

#include "plan/step_time.hpp"
#include "train/trainer.hpp"

namespace upipe::apps {

// Lines starting "#   ": the wall time against the stream's stages, each stage's seconds
// and share, the GPU's own work and the step against it, the side copies (GB, GB/s), the
// host's work (busy and cpu seconds), and the model's parts with measured / model.
void print_step_phases(const step_phases& phases, const step_time& model);

nlohmann::json step_phases_json(const step_phases& phases);
// The model's parts in seconds, its total and what a step with no next step adds.
nlohmann::json step_time_json(const step_time& t);
// The rates it ran at (scripts/step_time_check.py --calibrate scales them by the measured).
nlohmann::json rates_json(const throughput_rates& r);

}  // namespace upipe::apps
