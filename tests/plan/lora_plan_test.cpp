// The planner with LoRA: the meta probe runs the LoRA step (a frozen base, the adapters'
// state alone), so that llama3-8b, whose full fine-tune with AdamW on the GPU fits no length
// on one H200, fits long sequences with LoRA r = 16.
#include <gtest/gtest.h>

#include "plan/planner.hpp"

namespace upipe {
namespace {

constexpr std::size_t gib = std::size_t{1} << 30;

TEST(lora_plan, llama3_8b_fits_one_h200_with_lora_and_not_without) {
  plan_request r;
  r.model = preset("llama3-8b");
  r.gpus = 1;
  r.gpu_memory = 139 * gib;
  r.host_memory = 128 * gib;
  r.strategies = {strategy_kind::ulysses};
  r.zero = zero_stage::two;  // one GPU: nothing to shard
  r.policy = parse_checkpoint_policy("what=input,every=1,where=host-pinned");
  r.eval = false;
  const plan_result full = make_plan(r);
  ASSERT_EQ(full.entries.size(), 1u);
  EXPECT_FALSE(full.entries[0].longest) << "8B parameters x 16 bytes of AdamW state do not fit 139 GiB";
  r.lora = parse_lora("r=16", r.model);
  const plan_result lora = make_plan(r);
  ASSERT_TRUE(lora.entries[0].longest);
  const plan_point& p = *lora.entries[0].longest;
  EXPECT_GE(p.seq_len, std::int64_t{256} << 10);  // the 128 GiB host holds the checkpoints of ~500K
  // The optimizer state at the planned point is the adapters' alone: masters and two moments.
  const auto adapters = static_cast<std::size_t>(lora_parameter_count(r.model, r.lora));
  EXPECT_EQ(p.memory.peak_bytes.at("optimizer"), 3 * sizeof(float) * adapters);
  EXPECT_EQ(p.memory.peak_bytes.at("weights"), 2 * static_cast<std::size_t>(r.model.parameter_count()) + 2 * adapters);
  EXPECT_EQ(p.memory.peak_bytes.at("grads"), sizeof(float) * (adapters + adapters / r.model.num_layers));
  // A bad configuration is refused before any probe.
  r.lora.alpha = -1;
  EXPECT_THROW(make_plan(r), config_error);
}

}  // namespace
}  // namespace upipe
