// Expert parallelism in training (tiny-qwen3-moe: a dense layer below two sparse ones of 8
// experts, top-2, the load-balancing loss on) on the cpu backend: D x C x E meshes under
// every strategy, ZeRO-2 and 3, the offloaded optimizer and LoRA train what one rank trains
// with the replicas' sequences as one batch; a run saved at one E (and mesh) resumes at
// another and continues the uninterrupted run's steps, the expert units' state read from
// the EP ranks' blocks; the model it saves holds every expert; and an --ep the mesh or the
// model cannot split is refused naming the ones that run.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "model/hf_model.hpp"
#include "model/lora.hpp"
#include "model/parameter_store.hpp"
#include "train/mesh.hpp"
#include "train/run_directory.hpp"
#include "train/train_checkpoint.hpp"
#include "train/trainer.hpp"
#include "train_support.hpp"

namespace upipe {
namespace {

namespace fs = std::filesystem;

constexpr double exact = 1e-6;

train_options moe_run(int dp, const cp_settings& cp, int ep, std::int64_t batch, zero_stage zero) {
  train_options o = four_tiny_steps(cp, zero, batch);
  o.model = preset("tiny-qwen3-moe");
  o.model.moe.router_aux_loss_coef = 0.25;  // large enough that an error in its gradient shows in the losses
  o.step.router_aux = router_aux_loss::on;
  o.dp = dp;
  o.ep = ep;
  return o;
}

std::string name_of(const train_options& o) {
  return std::string(strategy_name(o.cp.strategy)) + " D=" + std::to_string(o.dp) + " C=" + std::to_string(o.cp.cp) +
         " E=" + std::to_string(o.ep) + " zero=" + (o.zero == zero_stage::three ? "3" : "2") +
         (o.offload_params ? " offload optimizer,params" : o.offload_optimizer ? " offload optimizer" : "") +
         (o.step.lora.enabled() ? " lora" : "");
}

std::vector<step_record> steps_of(const train_options& o) { return train(o, nullptr).steps; }

// `o` against one rank (ulysses, C = 1, E = 1) with the replicas' sequences as its batch.
void expect_equals_one_rank(const train_options& o) {
  train_options one = o;
  one.dp = 1;
  one.ep = 1;
  one.cp = {strategy_kind::ulysses, 1, 0};
  one.batch = global_batch(o);
  one.offload_optimizer = one.offload_params = false;
  const std::vector<step_record> want = steps_of(one), got = steps_of(o);
  SCOPED_TRACE(name_of(o));
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_LT(std::abs(got[i].loss - want[i].loss) / want[i].loss, exact) << "step " << i + 1;
    EXPECT_LT(std::abs(got[i].aux_loss - want[i].aux_loss) / want[i].aux_loss, exact) << "step " << i + 1;
  }
  EXPECT_LT(got.back().loss, got.front().loss);
}

TEST(moe_ep_train, meshes_with_expert_parallelism_train_what_one_rank_trains) {
  expect_equals_one_rank(moe_run(1, {strategy_kind::upipe, 4, 0}, 2, 1, zero_stage::two));
  expect_equals_one_rank(moe_run(1, {strategy_kind::ring, 4, 0}, 4, 1, zero_stage::three));
  expect_equals_one_rank(moe_run(2, {strategy_kind::ulysses, 2, 0}, 4, 1, zero_stage::three));
  expect_equals_one_rank(moe_run(2, {strategy_kind::hybrid, 2, 0, 2}, 2, 1, zero_stage::two));
  expect_equals_one_rank(moe_run(4, {strategy_kind::ulysses, 1, 0}, 4, 1, zero_stage::two));
  train_options fpdt = moe_run(2, {strategy_kind::fpdt, 2, 0, 1, 2}, 2, 2, zero_stage::three);
  expect_equals_one_rank(fpdt);
}

TEST(moe_ep_train, the_offloaded_optimizer_and_lora_train_with_expert_parallelism) {
  train_options o = moe_run(1, {strategy_kind::upipe, 4, 0}, 2, 1, zero_stage::three);
  o.offload_optimizer = o.offload_params = true;
  expect_equals_one_rank(o);
  o = moe_run(2, {strategy_kind::ring, 2, 0}, 4, 1, zero_stage::two);
  o.offload_optimizer = true;
  expect_equals_one_rank(o);
  o = moe_run(1, {strategy_kind::ulysses, 4, 0}, 4, 1, zero_stage::three);
  o.step.lora = parse_lora("r=4,alpha=8,targets=q,k,v,o", o.model);
  o.optim.lr = 1e-2;
  expect_equals_one_rank(o);
}

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("upipe_ep_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

// Runs `o` to its stop_after, saving there; the checkpoint becomes `dir`.
void train_and_save(train_options o, const fs::path& dir) {
  const fs::path run = dir.string() + ".run";
  o.save_dir = run.string();
  train(o, nullptr);
  fs::rename(resolve_checkpoint(run.string()), dir);
  fs::remove_all(run);
}

// Saved at step 2 under `saved`, resumed on each of `next` (another E, mesh, ZeRO stage):
// steps 3 and 4 are the uninterrupted run's.
void expect_resumes(const train_options& saved, const std::vector<train_options>& next, const std::string& name) {
  const fs::path dir = scratch(name);
  const std::vector<step_record> whole = steps_of(saved);
  train_options first = saved;
  first.stop_after = 2;
  train_and_save(first, dir);
  const auto manifest = nlohmann::json::parse(std::ifstream(dir / "trainer" / "manifest.json"));
  EXPECT_EQ(manifest.value("expert_parallel", 1), saved.ep);
  for (train_options o : next) {
    o.resume_dir = dir.string();
    SCOPED_TRACE("saved " + name_of(saved) + ", resumed " + name_of(o));
    const std::vector<step_record> resumed = steps_of(o);
    ASSERT_EQ(resumed.size(), 2u);
    for (std::size_t i = 0; i < 2; ++i)
      EXPECT_LT(std::abs(resumed[i].loss - whole[2 + i].loss) / whole[2 + i].loss, exact) << "step " << 3 + i;
  }
  fs::remove_all(dir);
}

TEST(moe_ep_train, a_run_saved_at_one_expert_parallelism_resumes_at_another) {
  expect_resumes(moe_run(1, {strategy_kind::upipe, 4, 0}, 2, 1, zero_stage::three),
                 {moe_run(1, {strategy_kind::ring, 4, 0}, 4, 1, zero_stage::two),
                  moe_run(1, {strategy_kind::ulysses, 2, 0}, 1, 1, zero_stage::three),
                  moe_run(1, {strategy_kind::ulysses, 1, 0}, 1, 1, zero_stage::two)},
                 "from_e2");
  expect_resumes(moe_run(1, {strategy_kind::ring, 2, 0}, 1, 1, zero_stage::two),
                 {moe_run(1, {strategy_kind::upipe, 4, 0}, 4, 1, zero_stage::three),
                  moe_run(1, {strategy_kind::upipe, 2, 0}, 2, 1, zero_stage::two)},
                 "from_e1");
  // A mesh of replicas with EP groups across them, and 8-bit moments in EP blocks.
  train_options replicas = moe_run(2, {strategy_kind::ulysses, 2, 0}, 4, 1, zero_stage::two);
  replicas.state_format.moments = moment_format::q8;
  train_options four = moe_run(1, {strategy_kind::upipe, 4, 0}, 2, 2, zero_stage::three);
  four.state_format.moments = moment_format::q8;
  train_options one = moe_run(1, {strategy_kind::ulysses, 1, 0}, 1, 2, zero_stage::two);
  one.state_format.moments = moment_format::q8;
  expect_resumes(replicas, {four, one}, "q8_replicas");
}

// The checkpoint of an EP run is a whole model directory: every expert of every sparse layer,
// the weights the saved master holds.
TEST(moe_ep_train, the_saved_model_holds_every_expert) {
  const fs::path dir = scratch("model");
  train_options o = moe_run(1, {strategy_kind::upipe, 4, 0}, 4, 1, zero_stage::three);
  o.stop_after = 1;
  o.save_model.type = dtype::f32;
  train_and_save(o, dir);
  const host_weights saved = read_weights(o.model, dir.string());
  const saved_state state(dir.string());
  state.check_units(o.model);
  const auto units = parameter_units(o.model);
  for (std::size_t u = 0; u < units.size(); ++u)
    for (const unit_parameter& p : units[u]) {
      ASSERT_TRUE(saved.count(p.name)) << p.name;
      std::vector<float> master(static_cast<std::size_t>(p.numel));
      state.read(static_cast<int>(u), shard_state::master, p.offset, p.numel, master.data());
      EXPECT_EQ(saved.at(p.name), master) << p.name;
    }
  fs::remove_all(dir);
}

std::string refusal(const train_options& o) {
  try {
    validate(o);
  } catch (const config_error& e) {
    return e.what();
  }
  ADD_FAILURE() << name_of(o) << " was not refused";
  return "";
}

TEST(moe_ep_train, an_ep_the_mesh_or_the_model_cannot_split_is_refused) {
  train_options o = moe_run(1, {strategy_kind::upipe, 4, 0}, 3, 1, zero_stage::two);
  EXPECT_NE(refusal(o).find("--ep 3 must divide the mesh's --dp 1 x --cp 4 = 4 ranks and tiny-qwen3-moe's 8 experts; "
                            "valid: --ep 1, 2, 4"),
            std::string::npos)
      << refusal(o);
  o = moe_run(4, {strategy_kind::ulysses, 4, 0}, 16, 1, zero_stage::two);
  EXPECT_NE(refusal(o).find("valid: --ep 1, 2, 4, 8"), std::string::npos) << refusal(o);
  o.model = preset("tiny-llama");
  o.ep = 2;
  EXPECT_NE(refusal(o).find("has no sparse (mixture-of-experts) layer"), std::string::npos) << refusal(o);
  train_options q8 = moe_run(1, {strategy_kind::upipe, 4, 0}, 2, 1, zero_stage::two);
  q8.state_format.moments = moment_format::q8;
  EXPECT_NO_THROW(validate(q8));  // 4 experts of 3 x 32 x 64 parameters: whole blocks of 256
}

}  // namespace
}  // namespace upipe
