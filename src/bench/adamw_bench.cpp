#include "bench/adamw_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "core/error.hpp"

namespace upipe {

namespace {

// Normal-ish values (a sum of four uniforms), cheap enough for a billion elements: the
// time does not depend on the values as long as none is subnormal.
void fill(float* x, std::int64_t n, float scale, std::uint64_t seed) {
  std::uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  const auto uniform = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<double>(s >> 11) * 0x1p-53) - 0.5f;
  };
  for (std::int64_t i = 0; i < n; ++i) x[i] = scale * (uniform() + uniform() + uniform() + uniform());
}

}  // namespace

std::size_t host_adamw_bench::host_bytes(std::int64_t params, dtype work) {
  return static_cast<std::size_t>(params) * (4 * sizeof(float) + dtype_size(work));
}

host_adamw_bench::host_adamw_bench(backend& be, std::int64_t params, int tensors, int threads)
    : be_(be), params_(params) {
  if (params < 1 || tensors < 1 || tensors > params || threads < 0)
    throw config_error("bench-adamw: --params " + std::to_string(params) + ", --tensors " + std::to_string(tensors) +
                       " and --threads " + std::to_string(threads) +
                       " must be positive (threads 0: every core) with at most one tensor a parameter; for example "
                       "--params 64M --tensors 16");
  const int cores = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 64u));
  pool_ = std::make_unique<host_pool>(threads > 0 ? threads : cores);
  for (int t = 0; t < tensors; ++t) {
    const std::int64_t n = t + 1 < tensors ? params / tensors : params - (tensors - 1) * (params / tensors);
    const auto f32 = [&](const char* label) {
      buffers_.push_back(be.allocate_zeroed(mem_tag::optimizer_host, dtype::f32, {1, n}, label));
      return buffers_.back().as<float>();
    };
    host_shard s;
    s.n = n;
    s.grad = f32("grad");
    s.master = f32("master");
    s.exp_avg = f32("exp_avg");
    s.exp_avg_sq = f32("exp_avg_sq");
    buffers_.push_back(be.allocate_zeroed(mem_tag::optimizer_host, be.work_dtype(), {1, n}, "working_copy"));
    s.weights = buffers_.back().data();
    s.weights_type = be.work_dtype();
    s.ranges = {{0, n, true}};
    fill(s.master, n, 0.02f, 2 * static_cast<std::uint64_t>(t));
    fill(s.grad, n, 1e-3f, 2 * static_cast<std::uint64_t>(t) + 1);
    shards_.push_back(s);
  }
}

double host_adamw_bench::step(bool working_copy) {
  host_adamw update;
  update.config.lr = 1e-4;
  update.config.weight_decay = 0.1;
  update.step = ++steps_;
  update.lr = 1e-4;
  host_work work;
  work.adamw = update;
  const auto start = std::chrono::steady_clock::now();
  host_batch batch(*pool_);
  for (host_shard s : shards_) {
    if (!working_copy) s.weights = nullptr;
    submit_host_work(batch, s, work);
  }
  batch.wait();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace upipe
