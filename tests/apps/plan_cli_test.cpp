// `upipe plan` as a user runs it: the table, the JSON the issue names, the default host
// memory stated, and clear refusals of bad sizes.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <fstream>

#include <nlohmann/json.hpp>

#include "run_upipe.hpp"

namespace {

using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::temp_dir;

const std::string small = "plan --model llama3.2-1b --layers 2 --gpus 4 --gpu-memory 6GiB ";

TEST(plan_cli, json_holds_every_configuration_with_its_policy_and_peaks) {
  const auto dir = temp_dir("plan_cli");
  const auto path = (dir / "plan.json").string();
  const run_result r = run_upipe(small + "--host-memory 64GiB --seq-len 64K --seq-chunks 1,4 --json " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("upipe: U = "), std::string::npos) << r.output;
  std::ifstream in(path);
  const nlohmann::json doc = nlohmann::json::parse(in);
  EXPECT_FALSE(doc["host_memory_default"].get<bool>());
  EXPECT_EQ(doc["planned_seq_len"], 65536);
  // ulysses, upipe U = 4 (the smallest U, the only one chunked: for every N it reaches at
  // least as far as a larger U) at N = 1 and 4 (every N is tried until one reaches no
  // further than the best before it), U = 8, 16 and 32 at N = 1, ring, fpdt (N = 4, its
  // only N of at least 2).
  std::set<std::string> configurations;
  for (const auto& e : doc["entries"]) {
    const std::string name = e["strategy"].get<std::string>();
    configurations.insert(name + (e["head_chunk"].is_null() ? "" : " U=" + std::to_string(e["head_chunk"].get<int>())) +
                          " N=" + std::to_string(e["seq_chunks"].get<int>()));
    for (const char* key : {"strategy", "head_chunk", "seq_chunks", "max_seq_len", "peak_bytes", "checkpoint_policy",
                            "gpu_bytes", "arena_bytes", "host_bytes", "at_seq_len"})
      EXPECT_TRUE(e.contains(key)) << key << " in " << e.dump();
    EXPECT_GT(e["max_seq_len"].get<long long>(), 0);
    EXPECT_GT(e["peak_bytes"]["weights"].get<long long>(), 0);
    EXPECT_TRUE(e["checkpoint_policy"].contains("where"));
  }
  for (const char* name : {"ulysses U=32 N=1", "upipe U=4 N=1", "upipe U=4 N=4", "upipe U=8 N=1", "upipe U=16 N=1",
                           "upipe U=32 N=1", "ring N=1",
                           "fpdt U=32 N=4"})
    EXPECT_EQ(configurations.count(name), 1u) << name;
  EXPECT_EQ(configurations.size(), doc["entries"].size());
  std::filesystem::remove_all(dir);
}

// The printed command is the run: run as printed on meta (with --steps 1 --backend meta
// added), its arena high water and host memory are the plan's within 2%, and its host
// memory within the --host-memory-gib it was given.
void check_recommended_runs_as_planned(const std::string& plan_args, const std::string& name) {
  const auto dir = temp_dir("plan_run_" + name);
  const auto path = (dir / "plan.json").string();
  const run_result r = run_upipe(plan_args + " --json " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("recommended (the rule: "), std::string::npos) << r.output;
  std::ifstream in(path);
  const nlohmann::json doc = nlohmann::json::parse(in);
  for (const auto& m : doc["meshes"]) EXPECT_TRUE(m.contains("train_command")) << m.dump();
  ASSERT_TRUE(doc["recommended_command"].is_string()) << doc.dump(1);
  const std::string command = doc["recommended_command"].get<std::string>();
  EXPECT_NE(r.output.find(command), std::string::npos) << "the printed command is the JSON's";
  ASSERT_EQ(command.rfind("upipe train ", 0), 0u) << command;
  for (const char* flag : {"--memory-gib ", "--host-memory-gib ", "--checkpoint-policy ", "--offload ", "--seq-len "})
    EXPECT_NE(command.find(flag), std::string::npos) << flag << " missing from " << command;
  const auto metrics = (dir / "m.jsonl").string();
  const run_result run = run_upipe(command.substr(6) + " --steps 1 --backend meta --metrics-json " + metrics);
  ASSERT_EQ(run.exit_code, 0) << command << "\n" << run.output;
  const nlohmann::json last = upipe::testing::read_lines(metrics).back();
  const nlohmann::json& planned = doc["recommended"];
  const auto ratio = [](const nlohmann::json& measured, const nlohmann::json& plan) {
    return measured.get<double>() / plan.get<double>();
  };
  EXPECT_NEAR(ratio(last["arena_high_water_bytes"], planned["arena_bytes"]), 1.0, 0.02) << command;
  // The seconds plan expects a step to take, printed under the command, are the run's own
  // model's (train's final record).
  EXPECT_NE(r.output.find("  expected: "), std::string::npos) << r.output;
  EXPECT_NEAR(ratio(last["step_seconds_model"]["total"], planned["step_seconds_model"]["total"]), 1.0, 1e-9) << command;
  EXPECT_NEAR(ratio(last["host_bytes"], planned["host_bytes"]), 1.0, 0.02) << command;
  EXPECT_LE(last["host_bytes"].get<double>(), planned["host_budget_bytes"].get<double>()) << command;
  std::filesystem::remove_all(dir);
}

TEST(plan_cli, the_recommended_command_runs_on_meta_as_planned) {
  // One GPU (every placement and state format), a CP group of 4 at a requested length, LoRA.
  check_recommended_runs_as_planned("plan --model llama3.2-1b --layers 2 --gpus 1 --gpu-memory 6GiB --host-memory "
                                    "24GiB --seq-chunks 1,4", "one_gpu");
  check_recommended_runs_as_planned(small + "--host-memory 64GiB --seq-len 64K --seq-chunks 1", "cp4");
  check_recommended_runs_as_planned(small + "--host-memory 64GiB --seq-chunks 1 --attention upipe --lora r=8", "lora");
}

// No full fine-tune of llama3.2-1b fits a 6 GiB GPU without offloading (its weights, master
// and moments alone are 21 GiB): plan says so and plans LoRA instead, whose command runs.
TEST(plan_cli, where_no_full_fine_tune_fits_lora_is_offered) {
  const auto dir = temp_dir("plan_lora_instead");
  const auto path = (dir / "plan.json").string();
  const run_result r = run_upipe("plan --model llama3.2-1b --gpus 1 --gpu-memory 6GiB --host-memory 16GiB --offload none "
                                 "--optimizer-state fp32 --seq-chunks 1 --attention upipe --json " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("no full fine-tune fits; LoRA (--lora r=16"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("LoRA's longest length: S = "), std::string::npos) << r.output;
  std::ifstream in(path);
  const nlohmann::json doc = nlohmann::json::parse(in);
  EXPECT_TRUE(doc["recommended_command"].is_null());
  ASSERT_TRUE(doc["lora_command"].is_string()) << doc.dump(1);
  const std::string command = doc["lora_command"].get<std::string>();
  EXPECT_NE(command.find("--lora r=16"), std::string::npos) << command;
  const run_result run = run_upipe(command.substr(6) + " --steps 1 --backend meta");
  EXPECT_EQ(run.exit_code, 0) << command << "\n" << run.output;
  std::filesystem::remove_all(dir);
}

TEST(plan_cli, default_host_memory_is_the_papers_and_says_so) {
  const run_result r = run_upipe(small + "--attention upipe");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("default: 1.9 TiB, the paper's"), std::string::npos) << r.output;
}

TEST(plan_cli, bad_sizes_are_refused_with_an_example) {
  const run_result r = run_upipe("plan --gpu-memory 80XB");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--gpu-memory '80XB' is not a positive size"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("80GiB"), std::string::npos) << r.output;
  const run_result h = run_upipe("plan --host-memory 0GiB");
  EXPECT_EQ(h.exit_code, 2) << h.output;
  const run_result o = run_upipe("plan --optimizer sgd");
  EXPECT_EQ(o.exit_code, 2) << o.output;
  EXPECT_NE(o.output.find("use adamw"), std::string::npos) << o.output;
}

}  // namespace
