// The chunked gated delta rule's drivers: the order of its stages over the passes of a
// sequence (docs/design.md, "Gated DeltaNet ops"), the same on every backend. A backend
// gives a stage_executor that runs one stage over a grid of blocks: the cpu backend block
// after block on the host, the CUDA backend as a kernel launch.
#pragma once

#include <cstdint>

#include "ops/gated_delta/chunk_common.hpp"
#include "ops/op_args.hpp"

namespace upipe::gated_delta {

enum class stage : std::uint8_t {
  prepare,
  state_pass,
  output,
  intra_backward,
  reverse_pass,
  wy_backward,
  output_backward,
  qk_backward
};

// The shared memory a stage's block takes, in floats.
std::int64_t stage_smem_floats(stage s, std::int64_t dk, std::int64_t dv);

class stage_executor {
 public:
  virtual ~stage_executor() = default;
  // Runs stage `s` on blocks (x, y) for x < grid_x, y < grid_y, in the order of the
  // executor's work (a later launch sees what an earlier one wrote).
  virtual void launch(stage s, std::int64_t grid_x, std::int64_t grid_y, const stage_params& p) = 0;
};

void chunked_forward(const gated_delta_forward_args& args, stage_executor& exec);
void chunked_backward(const gated_delta_backward_args& args, stage_executor& exec);
void chunked_summary(const gated_delta_summary_args& args, stage_executor& exec);
void chunked_summary_backward(const gated_delta_summary_backward_args& args, stage_executor& exec);

}  // namespace upipe::gated_delta
