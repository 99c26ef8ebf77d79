// The offloaded optimizer's host AdamW, timed: shards in a backend's host pool (pinned on
// the GPU), updated by the code --offload runs (model/host_optimizer on a pool of host
// threads). `upipe bench-adamw` prints it; scripts/bench_adamw.py runs it beside
// PyTorch's CPU AdamW in one process tree and quotes the ratio.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "core/host_pool.hpp"
#include "optim/host_optimizer.hpp"

namespace upipe {

class host_adamw_bench {
 public:
  // `params` elements in `tensors` equal shards (the last takes the rest), random normal
  // master weights and gradients, on `threads` host threads (0: every core), the state in
  // `format` (lean formats: --optimizer-state, --master-weights); `part` master: the
  // master's half alone, from f32 steps (what --offload master runs on the host).
  host_adamw_bench(backend& be, std::int64_t params, int tensors, int threads, adamw_state_format format = {},
                   adamw_part part = adamw_part::whole);
  // One AdamW step over every shard; with `working_copy`, also the working-dtype weights
  // (what the offload writes for the device); returns the seconds it took.
  double step(bool working_copy);

  std::int64_t params() const { return params_; }
  int threads() const { return pool_->threads(); }
  // The host memory the bench holds (master, moments, gradients, working copy).
  static std::size_t host_bytes(std::int64_t params, dtype work, adamw_state_format format = {},
                                adamw_part part = adamw_part::whole);

 private:
  backend& be_;
  std::int64_t params_;
  std::unique_ptr<host_pool> pool_;
  std::vector<tensor> buffers_;
  std::vector<host_shard> shards_;
  std::int64_t steps_ = 0;
  adamw_part part_ = adamw_part::whole;
};

}  // namespace upipe
