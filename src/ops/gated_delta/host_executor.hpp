// The chunked stages on the host: the cpu backend's executor, block after block, each
// block's phases index by index (in reverse where asked: the race check of
// ops/gated_delta/block.hpp). Shared memory starts as NaN for every block, as a GPU's
// holds what the last block left: a stage that reads what it has not written shows.
#pragma once

#include <limits>
#include <vector>

#include "ops/gated_delta/chunk_backward.hpp"
#include "ops/gated_delta/chunk_driver.hpp"

namespace upipe::gated_delta {

class host_executor final : public stage_executor {
 public:
  explicit host_executor(bool reverse_phases = false) : block_{reverse_phases} {}

  void launch(stage s, std::int64_t grid_x, std::int64_t grid_y, const stage_params& p) override {
    const auto floats = static_cast<std::size_t>(stage_smem_floats(s, p.dk, p.dv));
    for (std::int64_t y = 0; y < grid_y; ++y)
      for (std::int64_t x = 0; x < grid_x; ++x) {
        smem_.assign(floats, std::numeric_limits<float>::quiet_NaN());
        run(s, p, x, y);
      }
  }

 private:
  void run(stage s, const stage_params& p, std::int64_t x, std::int64_t y) {
    float* smem = smem_.data();
    switch (s) {
      case stage::prepare: return prepare(block_, p, x, y, smem);
      case stage::state_pass: return state_pass(block_, p, x, y, smem);
      case stage::output: return output(block_, p, x, y, smem);
      case stage::intra_backward: return intra_backward(block_, p, x, y, smem);
      case stage::reverse_pass: return reverse_pass(block_, p, x, y, smem);
      case stage::wy_backward: return wy_backward(block_, p, x, y, smem);
      case stage::output_backward: return output_backward(block_, p, x, y, smem);
      case stage::qk_backward: return qk_backward(block_, p, x, y, smem);
    }
  }

  host_block block_;
  std::vector<float> smem_;
};

}  // namespace upipe::gated_delta
