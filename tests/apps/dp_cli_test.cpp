// --dp as a user runs it (issue #31): `train` on a 2 x 2 mesh prints its placement and
// global batch and saves a shard per rank; a mesh the model cannot split is refused naming
// the ones that run; `bench --dp` times and checks the mesh (and emulates rank 0 of one);
// `plan` sweeps the meshes and prints the recommended one with its train command.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "run_upipe.hpp"

namespace {

using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::temp_dir;
namespace fs = std::filesystem;

TEST(dp_cli, train_on_two_replicas_prints_the_mesh_and_saves_every_rank) {
  const auto dir = temp_dir("dp_train");
  const run_result r = run_upipe("train --dp 2 --cp 2 --batch 2 --seq-len 64 --steps 3 --eval-samples 2 --save " +
                                 (dir / "ckpt").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("S=64 x 4 per step  dp=2 cp=2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("# mesh: --dp 2 x --cp 2 = 4 ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("replica 0: ranks 0-1 (node 0); replica 1: ranks 2-3 (node 0)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("global batch = dp 2 x batch 2 = 4 sequences of 64 tokens per step"), std::string::npos)
      << r.output;
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_TRUE(fs::exists(dir / "ckpt" / "checkpoint-3" / "trainer" /
                           ("rank-0000" + std::to_string(rank) + "-of-00004.safetensors")));
  std::ifstream manifest(dir / "ckpt" / "checkpoint-3" / "trainer" / "manifest.json");
  EXPECT_EQ(nlohmann::json::parse(manifest)["batch"], 4);  // the step's sequences over every replica
  fs::remove_all(dir);
}

TEST(dp_cli, a_mesh_the_model_cannot_split_is_refused_naming_those_that_run) {
  const run_result r = run_upipe("train --dp 2 --cp 3 --seq-len 96 --steps 1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("meshes of 6 ranks that upipe runs: --dp 3 --cp 2, --dp 6 --cp 1"), std::string::npos)
      << r.output;
  const run_result node = run_upipe("train --dp 3 --cp 2 --gpus-per-node 3 --seq-len 64 --steps 1");
  EXPECT_EQ(node.exit_code, 2) << node.output;
  EXPECT_NE(node.output.find("would cross a node boundary"), std::string::npos) << node.output;
}

TEST(dp_cli, bench_times_and_checks_a_mesh_and_emulates_rank_zero_of_one) {
  const auto dir = temp_dir("dp_bench");
  const auto path = (dir / "bench.json").string();
  const run_result r = run_upipe("bench --dp 2 --cp 2 --attention ulysses,ring --seq-len 128 --repeats 1 --json " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("D=2 x C=2"), std::string::npos) << r.output;
  std::ifstream in(path);
  for (const auto& row : nlohmann::json::parse(in)) {
    EXPECT_EQ(row["dp"], 2);
    EXPECT_TRUE(row["check_pass"].get<bool>()) << row.dump();  // against one rank with the replicas' batch
  }
  const run_result meta = run_upipe("bench --backend meta --dp 4 --emulate-cp 2 --model llama3-8b --layers 1 "
                                    "--attention upipe --seq-len 128K --json " + path);
  ASSERT_EQ(meta.exit_code, 0) << meta.output;
  std::ifstream again(path);
  const nlohmann::json rows = nlohmann::json::parse(again);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0]["dp"], 4);
  EXPECT_TRUE(rows[0]["emulated"].get<bool>());
  fs::remove_all(dir);
}

TEST(dp_cli, plan_sweeps_the_meshes_and_prints_the_train_command) {
  const auto dir = temp_dir("dp_plan");
  const auto path = (dir / "plan.json").string();
  const run_result r = run_upipe("plan --model llama3.2-1b --gpus 8 --gpu-memory 24GiB --host-memory 64GiB "
                                 "--attention ulysses,upipe --seq-chunks 1 --seq-len 64K --json " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("meshes at S = 64K"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fastest mesh: --dp "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("x CP over all 8 GPUs"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("upipe train --model llama3.2-1b --dp "), std::string::npos) << r.output;
  std::ifstream in(path);
  const nlohmann::json doc = nlohmann::json::parse(in);
  int recommended = 0;
  std::set<int> dps;
  for (const auto& m : doc["meshes"]) {
    dps.insert(m["dp"].get<int>());
    EXPECT_EQ(m["dp"].get<int>() * m["cp"].get<int>(), 8);
    if (!m["recommended"].get<bool>()) continue;
    ++recommended;
    EXPECT_GT(m["dp"].get<int>(), 1);  // below the length limit the model prefers replicas
    EXPECT_GT(m["speedup_over_cp_only"].get<double>(), 1.0);
    EXPECT_NE(m["train_command"].get<std::string>().find("--seq-len 65536"), std::string::npos);
  }
  EXPECT_EQ(recommended, 1);
  EXPECT_EQ(dps, (std::set<int>{1, 2, 4, 8}));
  const run_result bad = run_upipe("plan --model llama3.2-1b --gpus 8 --dp 3 --seq-len 64K");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--dp 3 must divide the 8 GPUs"), std::string::npos) << bad.output;
  fs::remove_all(dir);
}

}  // namespace
