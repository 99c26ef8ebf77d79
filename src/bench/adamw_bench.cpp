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

std::size_t host_adamw_bench::host_bytes(std::int64_t params, dtype work, adamw_state_format format,
                                         adamw_part part) {
  const double moments = format.moments == moment_format::f32 ? 8 : format.moments == moment_format::bf16 ? 4
                                                                                                          : 2 + 8.0 / q8_block;
  const double master = 4;  // f32, or bf16 with its bf16 compensation
  const double steps = part == adamw_part::master ? 4 : 0;  // the f32 steps of the master's half
  return static_cast<std::size_t>(static_cast<double>(params) * (sizeof(float) + moments + master + steps +
                                                                 static_cast<double>(dtype_size(work))));
}

host_adamw_bench::host_adamw_bench(backend& be, std::int64_t params, int tensors, int threads,
                                   adamw_state_format format, adamw_part part)
    : be_(be), params_(params), part_(part) {
  if (params < 1 || tensors < 1 || tensors > params || threads < 0)
    throw config_error("bench-adamw: --params " + std::to_string(params) + ", --tensors " + std::to_string(tensors) +
                       " and --threads " + std::to_string(threads) +
                       " must be positive (threads 0: every core) with at most one tensor a parameter; for example "
                       "--params 64M --tensors 16");
  const int cores = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 64u));
  pool_ = std::make_unique<host_pool>(threads > 0 ? threads : cores);
  for (int t = 0; t < tensors; ++t) {
    std::int64_t n = t + 1 < tensors ? params / tensors : params - (tensors - 1) * (params / tensors);
    if (format.moments == moment_format::q8) n = (n + q8_block - 1) / q8_block * q8_block;  // whole blocks
    const auto buffer = [&](dtype type, std::int64_t count, const char* label) {
      buffers_.push_back(be.allocate_zeroed(mem_tag::optimizer_host, type, {1, count}, label));
      return buffers_.back().data();
    };
    const dtype moments = format.moments == moment_format::f32    ? dtype::f32
                          : format.moments == moment_format::bf16 ? dtype::bf16
                                                                  : dtype::u8;
    const bool kahan = format.master == master_format::bf16_kahan;
    host_shard s;
    s.n = n;
    s.grad = buffer(dtype::f32, n, "grad");
    s.master_type = kahan ? dtype::bf16 : dtype::f32;
    s.master = buffer(s.master_type, n, "master");
    if (kahan) s.master_comp = static_cast<std::uint16_t*>(buffer(dtype::bf16, n, "master_comp"));
    s.moment_type = moments;
    s.exp_avg = buffer(moments, n, "exp_avg");
    s.exp_avg_sq = buffer(moments, n, "exp_avg_sq");
    if (moments == dtype::u8) {
      s.exp_avg_absmax = static_cast<float*>(buffer(dtype::f32, n / q8_block, "exp_avg_absmax"));
      s.exp_avg_sq_absmax = static_cast<float*>(buffer(dtype::f32, n / q8_block, "exp_avg_sq_absmax"));
    }
    // bf16-kahan on a bf16 device: the master is the working copy.
    const bool aliased = kahan && be.work_dtype() == dtype::bf16;
    s.weights = aliased ? nullptr : buffer(be.work_dtype(), n, "working_copy");
    s.weights_type = be.work_dtype();
    s.runs = {{n, true}};
    if (part == adamw_part::master) {  // steps of an update's size, as the moments' half writes them
      auto* steps = static_cast<float*>(buffer(dtype::f32, n, "direction"));
      fill(steps, n, 1e-2f, 1000 + static_cast<std::uint64_t>(t));
      s.direction = steps;
    }
    std::vector<float> values(static_cast<std::size_t>(n));
    fill(values.data(), n, 0.02f, 2 * static_cast<std::uint64_t>(t));
    if (kahan)
      for (std::int64_t i = 0; i < n; ++i) static_cast<std::uint16_t*>(s.master)[i] = float_to_bf16(values[i]);
    else
      std::copy(values.begin(), values.end(), static_cast<float*>(s.master));
    fill(static_cast<float*>(s.grad), n, 1e-3f, 2 * static_cast<std::uint64_t>(t) + 1);
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
  work.part = part_;
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
