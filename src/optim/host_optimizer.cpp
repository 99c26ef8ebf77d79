#include "optim/host_optimizer.hpp"

#include <algorithm>

#include "ops/cpu/cpu_ops.hpp"

namespace upipe {

namespace {

// 16 blocks (2^20 elements, 4 MiB of each f32 array): long enough for a core's streams,
// short enough that a layer's shard feeds every core.
constexpr std::int64_t piece_blocks = 16;

mat_view flat(void* data, dtype type, std::int64_t n) { return {data, type, 1, n, n}; }

void run_piece(const host_shard& s, const host_work& w, std::int64_t a, std::int64_t b) {
  if (w.incoming != nullptr) cpu::accumulate(s.grad + a, w.incoming + a, b - a);
  if (w.block_sums != nullptr)
    cpu::sum_squares_blocks(s.grad + a, b - a, w.block_sums + a / cpu::sum_squares_block);
  if (!w.adamw) return;
  const host_adamw& u = *w.adamw;
  for (const host_shard::range& r : s.ranges) {
    const std::int64_t lo = std::max(a, r.begin), hi = std::min(b, r.end);
    if (lo >= hi) continue;
    const std::int64_t n = hi - lo;
    char* weights = static_cast<char*>(s.weights);
    adamw_args args{flat(s.master + lo, dtype::f32, n), flat(s.exp_avg + lo, dtype::f32, n),
                    flat(s.exp_avg_sq + lo, dtype::f32, n), flat(s.grad + lo, dtype::f32, n),
                    weights == nullptr ? mat_view{}
                                       : flat(weights + lo * static_cast<std::int64_t>(dtype_size(s.weights_type)),
                                              s.weights_type, n),
                    static_cast<float>(u.lr), static_cast<float>(u.config.beta1), static_cast<float>(u.config.beta2),
                    static_cast<float>(u.config.eps), static_cast<float>(r.decay ? u.config.weight_decay : 0.0),
                    static_cast<float>(u.grad_scale), u.step};
    cpu::run(args);
  }
}

}  // namespace

std::int64_t sum_blocks(std::int64_t n) { return (n + cpu::sum_squares_block - 1) / cpu::sum_squares_block; }

double add_blocks(const std::vector<double>& block_sums) {
  double sum = 0.0;
  for (double b : block_sums) sum += b;
  return sum;
}

void submit_host_work(host_batch& batch, const host_shard& s, const host_work& w) {
  const std::int64_t piece = piece_blocks * cpu::sum_squares_block;
  for (std::int64_t a = 0; a < s.n; a += piece) {
    const std::int64_t b = std::min(s.n, a + piece);
    batch.add([s, w, a, b] { run_piece(s, w, a, b); });
  }
}

}  // namespace upipe
