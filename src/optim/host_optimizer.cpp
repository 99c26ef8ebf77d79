#include "optim/host_optimizer.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "ops/cpu/cpu_ops.hpp"

namespace upipe {

namespace {

// 16 blocks (2^20 elements, 4 MiB of each f32 array): long enough for a core's streams,
// short enough that a layer's shard feeds every core. A multiple of q8_block, so that a
// piece holds whole q8 blocks.
constexpr std::int64_t piece_blocks = 16;
static_assert(piece_blocks * cpu::sum_squares_block % q8_block == 0);

mat_view flat(void* data, dtype type, std::int64_t n) { return {data, type, 1, n, n}; }

// Elements [a, b) of an n-element array of `type` (or nothing where there is none).
mat_view part(void* data, dtype type, std::int64_t a, std::int64_t b) {
  if (data == nullptr) return {};
  return flat(static_cast<char*>(data) + a * static_cast<std::int64_t>(dtype_size(type)), type, b - a);
}

adamw_args piece_args(const host_shard& s, const host_work& w, std::int64_t a, std::int64_t b,
                      const std::vector<adamw_run>& runs) {
  const host_adamw& u = *w.adamw;
  adamw_args args;
  args.part = w.part;
  if (w.part != adamw_part::moments) {
    args.master = part(s.master, s.master_type, a, b);
    args.master_comp = part(s.master_comp, dtype::bf16, a, b);
    args.weights = part(s.weights, s.weights_type, a, b);
  }
  if (w.part != adamw_part::master) {
    args.exp_avg = part(s.exp_avg, s.moment_type, a, b);
    args.exp_avg_sq = part(s.exp_avg_sq, s.moment_type, a, b);
    if (s.moment_type == dtype::u8) {
      args.exp_avg_absmax = part(s.exp_avg_absmax, dtype::f32, a / q8_block, b / q8_block);
      args.exp_avg_sq_absmax = part(s.exp_avg_sq_absmax, dtype::f32, a / q8_block, b / q8_block);
    }
    args.grad = part(s.grad, s.grad_type, a, b);
  }
  if (w.part != adamw_part::whole) args.direction = part(const_cast<float*>(s.direction), dtype::f32, a, b);
  set_scalars(args, u);
  args.runs = runs;
  return args;
}

void run_piece(const host_shard& s, const host_work& w, std::int64_t a, std::int64_t b) {
  if (w.incoming != nullptr) {
    if (s.grad_type == dtype::bf16) cpu::accumulate(static_cast<std::uint16_t*>(s.grad) + a, w.incoming + a, b - a);
    else cpu::accumulate(static_cast<float*>(s.grad) + a, w.incoming + a, b - a);
  }
  if (w.block_sums != nullptr) {
    double* sums = w.block_sums + a / cpu::sum_squares_block;
    if (s.grad_type == dtype::bf16) cpu::sum_squares_blocks(static_cast<const std::uint16_t*>(s.grad) + a, b - a, sums);
    else cpu::sum_squares_blocks(static_cast<const float*>(s.grad) + a, b - a, sums);
  }
  if (!w.adamw) return;
  const bool blocks = s.moment_type == dtype::u8 && w.part != adamw_part::master;
  const std::vector<adamw_run> runs = runs_within(s.runs, a, b);
  const std::vector<std::int64_t> bounds = adamw_call_bounds(runs, b - a, blocks ? q8_block : 1);
  for (std::size_t i = 0; i + 1 < bounds.size(); ++i) {
    const std::int64_t lo = a + bounds[i], hi = a + bounds[i + 1];
    cpu::run(piece_args(s, w, lo, hi, runs_within(s.runs, lo, hi)));
  }
}

}  // namespace

std::int64_t sum_blocks(std::int64_t n) { return (n + cpu::sum_squares_block - 1) / cpu::sum_squares_block; }

double add_blocks(const std::vector<double>& block_sums) {
  double sum = 0.0;
  for (double b : block_sums) sum += b;
  return sum;
}

std::vector<adamw_run> runs_within(std::span<const adamw_run> runs, std::int64_t a, std::int64_t b) {
  std::vector<adamw_run> out;
  std::int64_t begin = 0;
  for (const adamw_run& r : runs) {
    const std::int64_t lo = std::max(begin, a), hi = std::min(r.end, b);
    if (lo < hi) out.push_back({hi - a, r.decay});
    begin = r.end;
  }
  return out;
}

std::vector<std::int64_t> adamw_call_bounds(std::span<const adamw_run> runs, std::int64_t n, std::int64_t block) {
  std::vector<std::int64_t> bounds{0};
  std::size_t first = 0;  // the first run that reaches past bounds.back()
  while (bounds.back() < n) {
    if (runs.size() - first <= adamw_max_runs) {
      bounds.push_back(n);
      break;
    }
    const std::int64_t end = runs[first + adamw_max_runs - 1].end / block * block;
    if (end <= bounds.back())
      throw internal_error("adamw: a block of " + std::to_string(block) + " elements spans more than " +
                           std::to_string(adamw_max_runs) + " parameters");
    bounds.push_back(end);
    while (runs[first].end <= end) ++first;
  }
  return bounds;
}

const char* host_work_kind(const host_work& w) {
  if (!w.adamw) return "host_grad_sums";
  return w.part == adamw_part::master ? "host_adamw_master" : "host_adamw";
}

void submit_host_work(host_batch& batch, const host_shard& s, const host_work& w) {
  const std::int64_t piece = piece_blocks * cpu::sum_squares_block;
  for (std::int64_t a = 0; a < s.n; a += piece) {
    const std::int64_t b = std::min(s.n, a + piece);
    batch.add([s, w, a, b] {
      const auto start = host_work_log::clock::now();
      run_piece(s, w, a, b);
      if (w.log != nullptr) w.log->add(host_work_kind(w), start, host_work_log::clock::now());
    });
  }
}

}  // namespace upipe
