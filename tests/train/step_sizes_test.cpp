// The step's sizes resolved once (resolve_step): the tile and chunk the GPU's arena gives
// whatever the backend, and the arenas with what the offload and the sequence chunks keep
// in host memory; bad budgets refused naming the flag.
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"
#include "cp/stage_plan.hpp"
#include "train/step_sizes.hpp"

namespace upipe {
namespace {

constexpr std::size_t mib = std::size_t{1} << 20, gib = std::size_t{1} << 30;

step_request llama(backend_kind kind) {
  step_request r;
  r.model = preset("llama3-8b");
  r.cp = {strategy_kind::upipe, 8, 8};
  r.seq_len = 1 << 20;
  r.backend = kind;
  r.memory_gib = 80;
  return r;
}

TEST(step_sizes, tile_and_chunk_are_the_gpu_arenas_on_every_backend) {
  const step_options gpu = with_default_sizes({}, preset("llama3-8b"), 80 * gib);
  for (backend_kind kind : {backend_kind::cpu, backend_kind::meta, backend_kind::cuda}) {
    const resolved_step s = resolve_step(llama(kind));
    EXPECT_EQ(s.step.mlp_tile, gpu.mlp_tile);
    EXPECT_EQ(s.step.loss_chunk, gpu.loss_chunk);
  }
  step_request given = llama(backend_kind::cpu);
  given.step.mlp_tile = 512;
  given.step.loss_chunk = 100;
  const resolved_step s = resolve_step(given);
  EXPECT_EQ(s.step.mlp_tile, 512);
  EXPECT_EQ(s.step.loss_chunk, 100);
}

TEST(step_sizes, arenas_follow_the_policy_the_offload_and_the_chunks) {
  step_request r = llama(backend_kind::cuda);
  EXPECT_EQ(resolve_step(r).limits.device_bytes, 80 * gib);
  EXPECT_EQ(resolve_step(r).limits.host_bytes, 16 * mib);  // checkpoints on the device: staging only
  r.step.policy.where = checkpoint_location::host_pinned;
  EXPECT_EQ(resolve_step(r).limits.host_bytes, 80 * gib);
  EXPECT_FALSE(resolve_step(r).limits.host_pageable);
  r.step.policy.where = checkpoint_location::host_pageable;
  EXPECT_TRUE(resolve_step(r).limits.host_pageable);
  r.step.policy.where = checkpoint_location::device;
  r.host_memory_gib = 2;
  EXPECT_EQ(resolve_step(r).limits.host_bytes, 2 * gib);

  step_request offloaded = llama(backend_kind::cuda);
  offloaded.zero = zero_stage::three;
  offloaded.offload = {true, true};
  EXPECT_EQ(resolve_step(offloaded).limits.host_bytes,
            16 * mib + offloaded_bytes(offloaded.model, 8, dtype::bf16, zero_stage::three, {true, true}, 1) + 64 * mib);

  step_request chunked = llama(backend_kind::cuda);
  chunked.cp.seq_chunks = 4;
  const attention_config c = attention_config_for(chunked.model, chunked.cp, chunked.seq_len);
  EXPECT_EQ(resolve_step(chunked).limits.host_bytes, 16 * mib + make_stage_plan(c, 0).host_peak(dtype::bf16) + 64 * mib);
  chunked.backend = backend_kind::meta;  // unbounded arenas on meta
  EXPECT_EQ(resolve_step(chunked).limits.host_bytes, std::size_t{1} << 50);
  EXPECT_TRUE(resolve_step(chunked).limits.gpu_workspaces);
}

TEST(step_sizes, budgets_are_checked_and_named) {
  const auto refused = [](step_request r, const std::string& says) {
    try {
      resolve_step(r);
      ADD_FAILURE() << "accepted: " << says;
    } catch (const config_error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  step_request r = llama(backend_kind::cpu);
  r.memory_gib = 0;
  refused(r, "--memory-gib 0 must be positive and at most 1048576");
  r.memory_gib = 8;
  r.host_memory_gib = -1;
  refused(r, "--host-memory-gib -1 must lie between 0");
  r.host_memory_gib = 0;
  r.step.mlp_tile = -3;
  refused(r, "--mlp-tile -3 and --loss-chunk 0 must be positive token counts");
}

}  // namespace
}  // namespace upipe
