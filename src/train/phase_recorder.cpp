#include "train/phase_recorder.hpp"

#include <cstdio>
#include <utility>

namespace upipe {

phase_recorder::phase_recorder(backend& be, parameter_store& trained, bool on) : be_(be), trained_(trained), on_(on) {
  if (!on_) return;
  be_.set_stage_listener([this](const char* ended) { stage_ended(ended); });
  be_.set_phase_timing(true);
  trained_.set_host_timing(true);
}

phase_recorder::~phase_recorder() {
  if (!on_) return;
  be_.set_stage_listener(nullptr);
  be_.set_phase_timing(false);
  trained_.set_host_timing(false);
}

void phase_recorder::begin(std::int64_t step) {
  step_ = step;
  table_ = {};
  if (on_) be_.take_phases();
}

void phase_recorder::end(step_record& record) {
  if (!on_) return;
  be_.set_stage(nullptr);  // the last stage ends (printed)
  add_phases(table_, be_.take_phases());
  table_.host = trained_.take_host_times();
  record.phases = std::move(table_);
}

void phase_recorder::stage_ended(const char* stage) {
  const backend::phase_times take = be_.take_phases();
  add_phases(table_, take);
  double waits = 0;
  for (const auto& [name, ms] : take.stages_ms)
    if (name.rfind("wait_", 0) == 0) waits += ms;
  std::fprintf(stderr, "upipe: phases: step %lld, %s done: %.3f s of the GPU's stream (%.3f s of it waiting)\n",
               static_cast<long long>(step_), stage, take.span_ms / 1e3, waits / 1e3);
}

double step_phases::gpu_ms() const {
  double ms = 0;
  for (const auto& [stage, t] : stages_ms)
    if (stage.rfind("wait_", 0) != 0 && stage.rfind("copy_", 0) != 0) ms += t;
  return ms;
}

void add_phases(step_phases& into, const backend::phase_times& take) {
  into.span_ms += take.span_ms;
  for (const auto& [stage, ms] : take.stages_ms) into.stages_ms[stage] += ms;
  for (const auto& [what, t] : take.side_copies) {
    backend::side_copy_time& c = into.side_copies[what];
    c.ms += t.ms;
    c.bytes += t.bytes;
    c.count += t.count;
  }
}

}  // namespace upipe
