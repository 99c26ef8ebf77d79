// The offloaded optimizer's arithmetic on one unit's shard in host memory, spread over
// the host pool (docs/design.md section 5): a later micro-batch's gradients added into
// the shard, the squares summed by block (the global norm), and AdamW (the whole update,
// or the master's half from the steps the GPU's moments sent) with the working copy
// written. Every operation is elementwise, a q8 block or a block sum of a fixed layout,
// and the pieces are whole blocks, so the pieces the pool runs give the cpu backend's
// very values: ops/cpu (cpu::run of adamw_args and of sum_squares_args) is the code that
// runs.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "core/dtype.hpp"
#include "core/host_pool.hpp"
#include "ops/op_args.hpp"
#include "optim/optimizer.hpp"

namespace upipe {

// One unit's shard as the host sees it (n elements each; a null pointer for what this
// placement keeps elsewhere): the gradients, the master weights (f32, or bf16 with its
// compensation), the moments (f32, bf16 or q8 codes with their block absmax), the steps
// of the master's half, and where the working copy goes.
struct host_shard {
  void* grad = nullptr;
  dtype grad_type = dtype::f32;
  void* master = nullptr;  // f32 or bf16 (bf16-kahan)
  dtype master_type = dtype::f32;
  std::uint16_t* master_comp = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  dtype moment_type = dtype::f32;  // f32, bf16 or u8
  float* exp_avg_absmax = nullptr;
  float* exp_avg_sq_absmax = nullptr;
  const float* direction = nullptr;  // the master's half: the steps from the GPU
  void* weights = nullptr;           // n elements of weights_type: AdamW's working copy
  dtype weights_type = dtype::f32;
  std::int64_t n = 0;
  // This rank's part of each parameter as weight-decay runs covering [0, n) (matrices
  // decay, norms and the padding do not).
  std::vector<adamw_run> runs;
};

struct host_adamw {
  adamw_config config;
  std::int64_t step = 1;
  double lr = 0, grad_scale = 1;
};

// The step's scalars into an adamw call (the device's update and the host's alike).
inline void set_scalars(adamw_args& args, const host_adamw& u) {
  args.lr = static_cast<float>(u.lr);
  args.beta1 = static_cast<float>(u.config.beta1);
  args.beta2 = static_cast<float>(u.config.beta2);
  args.eps = static_cast<float>(u.config.eps);
  args.weight_decay = static_cast<float>(u.config.weight_decay);
  args.grad_scale = static_cast<float>(u.grad_scale);
  args.step = u.step;
}

// What one task does to a shard, in this order on each piece.
struct host_work {
  const float* incoming = nullptr;  // gradients to add into grad (a later micro-batch)
  double* block_sums = nullptr;     // the squares' sums per cpu::sum_squares_block, when wanted
  std::optional<host_adamw> adamw;  // the update, when wanted
  adamw_part part = adamw_part::whole;  // master: the master's half, from the shard's direction
  host_work_log* log = nullptr;         // where each piece's time goes (a step's phase table), or none
};

// The kind a piece of `work` is logged as: host_adamw (the whole update), host_adamw_master
// (the master's half) or host_grad_sums (a later micro-batch's add and the norm's sums alone).
const char* host_work_kind(const host_work& work);

// Blocks of the sum of squares a shard of n elements has.
std::int64_t sum_blocks(std::int64_t n);
// The shard's gradient squares summed as cpu::run(sum_squares_args) sums them, from block_sums.
double add_blocks(const std::vector<double>& block_sums);

// The runs of elements [a, b) of a shard whose runs are `runs`, relative to a.
std::vector<adamw_run> runs_within(std::span<const adamw_run> runs, std::int64_t a, std::int64_t b);

// Where to cut [0, n) of a shard with `runs` into AdamW calls of at most adamw_max_runs
// runs each, on multiples of `block` (q8_block for q8 moments, else 1): the calls'
// boundaries, 0 first and n last. Throws internal_error where one block spans more runs.
std::vector<std::int64_t> adamw_call_bounds(std::span<const adamw_run> runs, std::int64_t n, std::int64_t block);

// Adds the work's pieces (at most max_piece elements each, on block boundaries) to `batch`.
void submit_host_work(host_batch& batch, const host_shard& shard, const host_work& work);

}  // namespace upipe
