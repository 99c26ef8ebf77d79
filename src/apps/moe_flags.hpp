// A mixture of experts' run configuration rows (--moe-gemm, --moe-capacity-factor) into the
// step's options (model/moe_mlp.hpp), checked there before the first step.
#pragma once

#include "apps/run_config.hpp"
#include "model/transformer.hpp"

namespace upipe::apps {

inline void apply_moe(const run_config& c, step_options& step) {
  step.moe.gemm = parse_moe_gemm(c.moe_gemm);
  step.moe.capacity_factor = c.moe_capacity_factor;
  validate_moe_options(step.moe);
}

}  // namespace upipe::apps
