// LoRA from the command line: bad --lora values refused before any work with exit 2, a
// PEFT-written adapter read by `upipe step` with PEFT's loss, adapter directories kept
// apart from model directories by `upipe export`, and (where PyTorch and PEFT are
// installed) scripts/check_lora_adapter.py: upipe's saved adapters load in PEFT, and their
// merged export in transformers, with upipe's loss.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_upipe.hpp"

namespace {

namespace fs = std::filesystem;
using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::source_path;

void expect_refused(const std::string& args, const std::string& says) {
  const run_result r = run_upipe(args);
  EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
  EXPECT_NE(r.output.find(says), std::string::npos) << args << "\n" << r.output;
}

TEST(lora_cli, bad_lora_values_are_refused_before_any_work) {
  const auto dir = upipe::testing::temp_dir("lora_bad");
  const std::string save = (dir / "out").string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"r=0", "r=0 must be a whole number between 1 and"},
      {"r=-3,alpha=8", "r=-3 must be a whole number between 1 and"},
      {"r=8,alpha=inf", "alpha=inf is not a number"},
      {"r=8,alpha=nan", "alpha=nan is not a number"},
      {"r=8,alpha=0", "alpha=0 must be a positive finite number"},
      {"r=4,r=8", "--lora gives r twice"},
      {"r=0x4,targets=", "r=0x4 is not a whole number written in decimal digits"},
      {"r=4,targets=", "targets= names no projection"},
      {"r=4,alpha=1e30", "scales the adapters' output by alpha / r"},
      {"r=8,targets=q,wq", "unknown target 'wq'"},
      {"r=8,targets=qkv_proj", "'qkv_proj', a module tiny-llama (llama) does not have"},
      {"r=8,targets=q_norm", "'q_norm', a module tiny-llama (llama) does not have"},
      {"r=8,dropout=0.1", "dropout=0.1 is not supported"},
      {"r=64", "use r <= 32"},
  };
  for (const auto& [lora, says] : cases) {
    expect_refused("train --steps 2 --lora " + lora + " --save " + save, says);
    EXPECT_FALSE(fs::exists(save)) << "a refused run wrote " << save;
  }
  expect_refused("plan --model llama3-8b --gpus 1 --gpu-memory 139GiB --lora r=0", "r=0 must be a whole number");
  expect_refused("step --lora r=8,targets=lm_head", "not a linear projection");
  expect_refused("train --steps 2 --init-adapter " + source_path("tests/golden/lora/tiny-llama") + " --model " +
                     source_path("tests/golden/tiny-llama") + " --lora r=8",
                 "differs from the adapters in");
  fs::remove_all(dir);
}

// Numbers that break parsers in r and alpha: refused (exit 2) or run, never a crash.
TEST(lora_cli, bad_numbers_in_r_and_alpha_are_handled) {
  for (const char* value : {"0", "-1", "2147483648", "1e300", "nan", "inf", "''", "abc", "3.5", "1K",
                            "99999999999999999999"})
    for (const std::string lora : {std::string("r=") + value, std::string("r=4,alpha=") + value}) {
      const std::string args = "train --backend meta --steps 1 --eval-samples 0 --lora " + lora;
      const run_result r = upipe::testing::run_upipe_env("", args, 60);
      EXPECT_TRUE(r.exit_code == 0 || r.exit_code == 2) << args << " exited " << r.exit_code << "\n" << r.output;
      EXPECT_EQ(r.output.find("internal error"), std::string::npos) << args << "\n" << r.output;
    }
}

TEST(lora_cli, step_reads_a_peft_adapter_with_peft_loss) {
  const auto dir = upipe::testing::temp_dir("lora_step");
  std::ifstream in(source_path("tests/golden/lora/tiny-llama/golden.json"));
  const auto golden = nlohmann::json::parse(in);
  const auto tokens = golden["tokens"].get<std::vector<std::uint32_t>>();
  std::ofstream(dir / "tokens.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 4));
  const std::string json = (dir / "step.json").string();
  const run_result r = run_upipe("step --model " + source_path("tests/golden/tiny-llama") + " --adapter " +
                                 source_path("tests/golden/lora/tiny-llama") + " --tokens " + (dir / "tokens.bin").string() +
                                 " --seq-len " + std::to_string(tokens.size()) + " --cp 2 --attention ring --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream result(json);
  const double loss = nlohmann::json::parse(result)["loss"].get<double>();
  EXPECT_LT(std::abs(loss - golden["loss"].get<double>()) / golden["loss"].get<double>(), 1e-5) << loss;
  fs::remove_all(dir);
}

TEST(lora_cli, export_keeps_adapters_and_models_apart) {
  const auto dir = upipe::testing::temp_dir("lora_export");
  const std::string adapter = source_path("tests/golden/lora/tiny-llama");
  expect_refused("export " + adapter + " " + (dir / "out").string(), "is a LoRA adapter directory, not a model");
  expect_refused("export " + adapter + " " + (dir / "out").string() + " --merge-adapter " + adapter,
                 "is not a model directory");
  expect_refused("export " + source_path("tests/golden/tiny-llama") + " " + (dir / "out").string() +
                     " --merge-adapter " + source_path("tests/golden/tiny-llama"),
                 "holds no adapter_config.json");
  // A PEFT adapter on another model's base: its tensors do not fit.
  expect_refused("export " + source_path("tests/golden/tiny-qwen3") + " " + (dir / "out").string() +
                     " --merge-adapter " + adapter,
                 "expected");
  EXPECT_FALSE(fs::exists(dir / "out"));
  expect_refused("eval --model " + adapter + " --seq-len 64", "is a LoRA adapter directory, not a model");
  const run_result merged = run_upipe("export " + source_path("tests/golden/tiny-llama") + " " + (dir / "out").string() +
                                      " --merge-adapter " + adapter);
  ASSERT_EQ(merged.exit_code, 0) << merged.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "config.json"));
  EXPECT_TRUE(fs::exists(dir / "out" / "model.safetensors"));
  fs::remove_all(dir);
}

// Runs scripts/check_lora_adapter.py where PyTorch, transformers and PEFT are installed;
// elsewhere it is skipped and the recorded run stands in docs/benchmarks.md.
TEST(lora_cli, adapters_load_in_peft_and_merged_in_transformers_with_the_same_loss) {
  if (std::system("python3 -c 'import torch, transformers, peft' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "PyTorch, transformers and PEFT are not installed here";
  const auto dir = upipe::testing::temp_dir("lora_peft");
  const std::string command = "python3 " + source_path("scripts/check_lora_adapter.py") + " " + UPIPE_BINARY + " " +
                              dir.string();
  EXPECT_EQ(std::system(command.c_str()), 0);
  fs::remove_all(dir);
}

}  // namespace
