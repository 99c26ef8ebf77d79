// What a run holds in host and GPU memory, part by part, and the start-up check against
// what the machine offers (pretended through UPIPE_MEMORY_LIMIT and UPIPE_GPU_MEMORY_FREE):
// a run that cannot fit is out_of_memory_error naming the parts and a way out.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/error.hpp"
#include "core/machine.hpp"
#include "model/config.hpp"
#include "train/run_memory.hpp"
#include "train/step_sizes.hpp"

namespace upipe {
namespace {

constexpr std::size_t mib = std::size_t{1} << 20, gib = std::size_t{1} << 30;

// Sets an environment variable for one scope.
struct scoped_env {
  const char* name;
  scoped_env(const char* n, const char* value) : name(n) { setenv(n, value, 1); }
  ~scoped_env() { unsetenv(name); }
};

train_options tiny(backend_kind kind) {
  train_options o;
  o.model = preset("tiny-llama");
  o.cp = {strategy_kind::upipe, 2, 0};
  o.seq_len = 256;
  o.backend = kind;
  return o;
}

std::size_t part(const run_memory& m, const std::string& starts) {
  for (const memory_part& p : m.host)
    if (p.what.rfind(starts, 0) == 0) return p.bytes;
  return 0;
}

TEST(run_memory, counts_the_weights_sequences_and_process_beside_the_pools) {
  const train_options o = tiny(backend_kind::cpu);
  const run_memory m = run_memory_of(o);
  EXPECT_EQ(part(m, "the random first weights"), static_cast<std::size_t>(o.model.parameter_count()) * 4);
  EXPECT_EQ(part(m, "the step's sequences"), 256u * 24);
  EXPECT_EQ(part(m, "the process's own"), process_host_bytes(backend_kind::cpu));
  EXPECT_TRUE(m.gpu.empty());
  EXPECT_EQ(process_ranks(o), 2);
}

TEST(run_memory, the_gpu_pool_is_counted_whole_with_the_offload_and_the_arena) {
  train_options o = tiny(backend_kind::cuda);
  o.offload_optimizer = true;
  const resolved_step s = resolve_step(sizes_of(o, 2, 0));
  o.limits = s.limits;
  const run_memory m = run_memory_of(o);
  const pool_parts parts = pool_parts_of(sizes_of(o, 2, 0));
  ASSERT_GT(parts.offload, 0u);
  EXPECT_EQ(part(m, "the offloaded master weights, AdamW's moments"), 2 * parts.offload);
  EXPECT_EQ(part(m, "the host pools' room"), 2 * (o.limits.host_bytes - parts.offload));
  EXPECT_EQ(m.gpu_bytes(), 2 * 2 * gib + cuda_context_bytes);  // two ranks on the one GPU (no NCCL here)
}

TEST(run_memory, the_host_budget_is_everything_and_the_pools_get_what_remains) {
  train_options o = tiny(backend_kind::cuda);
  step_request r = sizes_of(o, 2, 6);
  EXPECT_EQ(r.ranks, 2);
  ASSERT_GT(r.host_beside_pools, 0u);
  const std::size_t pool = resolve_step(r).limits.host_bytes;
  EXPECT_EQ(pool, (6 * gib - r.host_beside_pools) / 2);
  o.limits = resolve_step(r).limits;
  o.host_memory_gib = 6;
  const run_memory m = run_memory_of(o);
  EXPECT_LE(m.host_bytes(), 6 * gib);
  EXPECT_GE(m.host_bytes(), 6 * gib - 2);  // the budget, less the division's remainder

  // A budget smaller than what lies beside the pools and the staging: exit 3, named.
  r.host_memory_gib = static_cast<double>(r.host_beside_pools) / gib;
  try {
    resolve_step(r);
    ADD_FAILURE() << "a budget with no room for the pools was accepted";
  } catch (const out_of_memory_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("everything the run may hold in host memory"), std::string::npos) << what;
    EXPECT_NE(what.find("give --host-memory-gib"), std::string::npos) << what;
  }
  r.backend = backend_kind::meta;  // meta refuses what the GPU would
  EXPECT_THROW(resolve_step(r), out_of_memory_error);
}

TEST(run_memory, a_run_past_the_machine_is_refused_naming_its_parts) {
  train_options o = tiny(backend_kind::cpu);
  o.host_memory_gib = 2;
  const run_memory m = run_memory_of(o);
  EXPECT_EQ(m.host_bytes(), 2 * gib);  // the budget, counted whole
  {
    const scoped_env pretend("UPIPE_MEMORY_LIMIT", "1G");
    EXPECT_EQ(available_host_memory().bytes, gib);
    EXPECT_EQ(available_host_memory().source, "UPIPE_MEMORY_LIMIT");
    try {
      require_run_memory(m, backend_kind::cpu);
      ADD_FAILURE() << "2 GiB accepted on a 1 GiB machine";
    } catch (const out_of_memory_error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("needs 2.00 GiB of host memory and the machine offers 0.95 GiB"), std::string::npos) << what;
      EXPECT_NE(what.find("the random first weights' f32 host copy"), std::string::npos) << what;
      EXPECT_NE(what.find("a shorter --seq-len"), std::string::npos) << what;
    }
    EXPECT_NO_THROW(require_run_memory(m, backend_kind::meta));  // meta takes nothing
  }
  const scoped_env pretend("UPIPE_MEMORY_LIMIT", "3G");
  EXPECT_NO_THROW(require_run_memory(m, backend_kind::cpu));
}

TEST(run_memory, a_gpu_without_room_for_the_arena_is_refused) {
  run_memory m;
  m.gpu = {{"the arena (--memory-gib) of 1 rank(s)", 80 * gib}, {"the CUDA context and libraries", cuda_context_bytes}};
  const scoped_env pretend("UPIPE_GPU_MEMORY_FREE", "79G");
  try {
    require_run_memory(m, backend_kind::cuda);
    ADD_FAILURE() << "an 80 GiB arena accepted on a GPU with 79 GiB free";
  } catch (const out_of_memory_error& e) {
    EXPECT_NE(std::string(e.what()).find("a smaller --memory-gib"), std::string::npos) << e.what();
  }
  const scoped_env roomy("UPIPE_GPU_MEMORY_FREE", "81G");
  EXPECT_NO_THROW(require_run_memory(m, backend_kind::cuda));
}

TEST(run_memory, sizes_are_read_with_their_suffixes) {
  EXPECT_EQ(parse_memory_size("3G"), 3 * gib);
  EXPECT_EQ(parse_memory_size("512M"), 512 * mib);
  EXPECT_EQ(parse_memory_size("1000"), 1000u);
  EXPECT_EQ(parse_memory_size("lots"), 0u);
}

}  // namespace
}  // namespace upipe
