// The offloaded optimizer's arithmetic on one unit's shard in host memory, spread over
// the host pool (docs/design.md section 5): a later micro-batch's gradients added into
// the shard, the squares summed by block (the global norm), and AdamW with the working
// copy written. Every operation is elementwise or a block sum of a fixed layout, so the
// pieces the pool runs give the cpu backend's very values: ops/cpu (cpu::run of
// adamw_args and of sum_squares_args) is the code that runs.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/dtype.hpp"
#include "core/host_pool.hpp"
#include "optim/optimizer.hpp"

namespace upipe {

// One unit's shard as the host sees it: gradients, master weights, moments (f32, n
// elements each) and where the working copy goes.
struct host_shard {
  float* grad = nullptr;
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* weights = nullptr;  // n elements of weights_type: AdamW's working copy
  dtype weights_type = dtype::f32;
  std::int64_t n = 0;
  // This rank's part of each parameter, [begin, end) in the shard, and whether weight
  // decay applies (matrices); the padding past the last parameter is in none.
  struct range {
    std::int64_t begin, end;
    bool decay;
  };
  std::vector<range> ranges;
};

struct host_adamw {
  adamw_config config;
  std::int64_t step = 1;
  double lr = 0, grad_scale = 1;
};

// What one task does to a shard, in this order on each piece.
struct host_work {
  const float* incoming = nullptr;  // gradients to add into grad (a later micro-batch)
  double* block_sums = nullptr;     // the squares' sums per cpu::sum_squares_block, when wanted
  std::optional<host_adamw> adamw;  // the update, when wanted
};

// Blocks of the sum of squares a shard of n elements has.
std::int64_t sum_blocks(std::int64_t n);
// The shard's gradient squares summed as cpu::run(sum_squares_args) sums them, from block_sums.
double add_blocks(const std::vector<double>& block_sums);

// Adds the work's pieces (at most max_piece elements each, on block boundaries) to `batch`.
void submit_host_work(host_batch& batch, const host_shard& shard, const host_work& work);

}  // namespace upipe
