// LoRA training on the CPU backend: the same losses under every CP strategy and ZeRO stage
// (with the optimizer on the device or in host memory), a stopped-and-resumed run that is
// bit-identical to an uninterrupted one, the adapters' state as the only optimizer state
// (meta backend), and the options that contradict each other refused.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "core/error.hpp"
#include "model/adapter_files.hpp"
#include "train/trainer.hpp"
#include "train_support.hpp"

namespace upipe {
namespace {

train_options lora_run(strategy_kind kind, int cp, int chunk, zero_stage zero) {
  train_options o;
  o.model = preset("tiny-llama");
  o.seq_len = 64;
  o.cp = {kind, cp, chunk};
  o.zero = zero;
  o.step.lora = parse_lora("r=4,alpha=8", o.model);
  o.optim.lr = 1e-2;
  o.optim.total_steps = 10;
  o.optim.warmup_steps = 2;
  o.seed = 7;
  o.eval_samples = 0;
  o.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  return o;
}

std::filesystem::path temp(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("upipe_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

TEST(lora_train, losses_agree_across_strategies_zero_stages_and_optimizer_placement) {
  const std::vector<double> reference = losses(lora_run(strategy_kind::upipe, 1, 0, zero_stage::two));
  ASSERT_EQ(reference.size(), 10u);
  EXPECT_LT(reference.back(), reference.front());  // the adapters learn
  std::vector<train_options> runs = {lora_run(strategy_kind::ulysses, 2, 0, zero_stage::three),
                                     lora_run(strategy_kind::upipe, 4, 4, zero_stage::three),
                                     lora_run(strategy_kind::ring, 4, 0, zero_stage::two)};
  train_options hybrid = lora_run(strategy_kind::hybrid, 4, 2, zero_stage::three);
  hybrid.cp.ring = 2;
  runs.push_back(hybrid);
  train_options offloaded = lora_run(strategy_kind::upipe, 2, 2, zero_stage::two);
  offloaded.offload_optimizer = true;
  runs.push_back(offloaded);
  for (const train_options& o : runs) {
    const std::vector<double> got = losses(o);
    ASSERT_EQ(got.size(), reference.size());
    for (std::size_t i = 0; i < got.size(); ++i)
      EXPECT_LT(std::abs(got[i] - reference[i]) / reference[i], 1e-5)
          << strategy_name(o.cp.strategy) << " C=" << o.cp.cp << " U=" << o.cp.head_chunk << " step " << i + 1;
  }
}

TEST(lora_train, save_is_a_peft_adapter_and_resume_is_bit_identical) {
  const auto dir = temp("lora_resume");
  const train_options whole = lora_run(strategy_kind::upipe, 2, 0, zero_stage::three);
  const std::vector<double> uninterrupted = losses(whole);
  train_options first = whole;
  first.stop_after = 5;
  first.save_dir = dir.string();
  losses(first);
  const auto saved_dir = dir / "checkpoint-5";
  EXPECT_TRUE(is_adapter_directory(saved_dir.string()));
  EXPECT_FALSE(std::filesystem::exists(saved_dir / "config.json")) << "an adapter directory holds no model";
  const adapter_settings saved = read_adapter_config(saved_dir.string(), whole.model);
  EXPECT_EQ(saved.lora, whole.step.lora);
  EXPECT_EQ(saved.base_model, "tiny-llama");
  EXPECT_EQ(read_adapter_weights(saved_dir.string(), whole.model, whole.step.lora).size(),
            2u * 7 * whole.model.num_layers);
  train_options second = whole;
  second.resume_dir = dir.string();
  const std::vector<double> resumed = losses(second);
  ASSERT_EQ(resumed.size(), 5u);
  for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ(resumed[i], uninterrupted[5 + i]) << "step " << 6 + i;
  // Another rank count and ZeRO stage reshard the adapters' state.
  train_options resharded = lora_run(strategy_kind::ring, 4, 0, zero_stage::two);
  resharded.resume_dir = dir.string();
  const std::vector<double> again = losses(resharded);
  for (std::size_t i = 0; i < 5; ++i) EXPECT_LT(std::abs(again[i] - uninterrupted[5 + i]) / uninterrupted[5 + i], 1e-5);
  // Other adapters, or none, cannot resume it; nor can LoRA resume a full run.
  train_options other = second;
  other.step.lora = parse_lora("r=2", whole.model);
  EXPECT_THROW(train(other, nullptr), config_error);
  train_options full = second;
  full.step.lora = {};
  EXPECT_THROW(train(full, nullptr), config_error);
  std::filesystem::remove_all(dir);
}

TEST(lora_train, init_adapter_starts_from_the_saved_adapters) {
  const auto dir = temp("lora_init");
  train_options first = lora_run(strategy_kind::upipe, 2, 0, zero_stage::two);
  first.stop_after = 5;
  first.save_dir = dir.string();
  losses(first);
  // A new run from those adapters starts where they ended: its first step's loss is lower
  // than a fresh adapter's (whose B = 0 leaves the base's loss).
  train_options fresh = lora_run(strategy_kind::upipe, 2, 0, zero_stage::two);
  fresh.stop_after = 1;
  train_options continued = fresh;
  continued.init_adapter = dir.string();
  EXPECT_LT(losses(continued).front(), losses(fresh).front());
  std::filesystem::remove_all(dir);
}

TEST(lora_train, the_adapters_hold_the_only_gradients_and_optimizer_state) {
  // llama3-8b, two layers, rank 0 of 4 on the meta backend, ZeRO-3.
  train_options o = lora_run(strategy_kind::upipe, 4, 4, zero_stage::three);
  o.model = preset("llama3-8b");
  o.model.num_layers = 2;
  o.step.lora = parse_lora("r=16", o.model);
  o.seq_len = 8192;
  o.optim.total_steps = 1;
  o.backend = backend_kind::meta;
  o.limits = {std::size_t{1} << 40, std::size_t{1} << 40};
  const step_memory tuned = measure_step_memory(o);
  const auto per_layer = static_cast<std::size_t>(lora_parameter_count(o.model, o.step.lora) / 2);
  const std::size_t shard = (per_layer + 3) / 4, padded = 4 * shard;
  EXPECT_EQ(tuned.peak_bytes.at("optimizer"), 2 * shard * 3 * sizeof(float));  // masters, moments
  EXPECT_EQ(tuned.peak_bytes.at("grads"), (2 * shard + padded) * sizeof(float));  // shards + one open layer
  train_options full = o;
  full.step.lora = {};
  const step_memory trained = measure_step_memory(full);
  // The base stays sharded (ZeRO-3): the same weights as a full run's, plus the adapters.
  EXPECT_EQ(tuned.peak_bytes.at("weights"), trained.peak_bytes.at("weights") + 2 * 2 * per_layer);
  EXPECT_GT(trained.peak_bytes.at("optimizer"), 100 * tuned.peak_bytes.at("optimizer"));
}

TEST(lora_train, contradictory_options_are_refused) {
  train_options o = lora_run(strategy_kind::upipe, 2, 0, zero_stage::two);
  train_options no_lora = o;
  no_lora.step.lora = {};
  no_lora.init_adapter = "somewhere";
  EXPECT_THROW(validate(no_lora), config_error);
  train_options both = o;
  both.init_adapter = "somewhere";
  both.resume_dir = "elsewhere";
  EXPECT_THROW(validate(both), config_error);
  train_options bad = o;
  bad.step.lora.alpha = std::nan("");
  EXPECT_THROW(validate(bad), config_error);
  train_options too_wide = o;
  too_wide.step.lora.rank = 4096;  // beyond the 32 rows of tiny-llama's k projection
  EXPECT_THROW(validate(too_wide), config_error);
}

}  // namespace
}  // namespace upipe
