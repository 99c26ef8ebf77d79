// `upipe train` as a user runs it: metrics, checkpoints, and refusals of bad input that
// never leave a checkpoint half-written.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "run_upipe.hpp"

namespace {

using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::run_upipe_env;
using upipe::testing::source_path;
using upipe::testing::temp_dir;
namespace fs = std::filesystem;

const std::string quick = "train --seq-len 64 --steps 6 --eval-samples 2 ";

std::vector<nlohmann::json> read_lines(const fs::path& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

TEST(train_cli, metrics_checkpoint_and_resume) {
  const auto dir = temp_dir("train_cli");
  const run_result first = run_upipe(quick + "--stop-after 3 --save " + (dir / "ckpt").string() + " --metrics-json " +
                                     (dir / "a.jsonl").string());
  ASSERT_EQ(first.exit_code, 0) << first.output;
  for (const char* f : {"config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"})
    EXPECT_TRUE(fs::exists(dir / "ckpt" / f)) << f;
  const run_result second = run_upipe(quick + "--resume " + (dir / "ckpt").string() + " --metrics-json " +
                                      (dir / "b.jsonl").string());
  ASSERT_EQ(second.exit_code, 0) << second.output;
  const auto a = read_lines(dir / "a.jsonl"), b = read_lines(dir / "b.jsonl");
  ASSERT_EQ(a.size(), 4u);  // three steps and the final record
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(b[0]["step"], 4);
  for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_bytes"}) EXPECT_TRUE(a[0].contains(key)) << key;
  EXPECT_TRUE(b.back()["final"].get<bool>());
  EXPECT_TRUE(b.back().contains("retrieval_accuracy"));
  EXPECT_NE(second.output.find("peak memory by tag per rank"), std::string::npos);
  fs::remove_all(dir);
}

TEST(train_cli, bad_input_is_refused_and_a_saved_checkpoint_survives) {
  const auto dir = temp_dir("train_bad");
  const fs::path ckpt = dir / "ckpt";
  ASSERT_EQ(run_upipe(quick + "--save " + ckpt.string()).exit_code, 0);
  const std::string before = [&] {
    std::ifstream in(ckpt / "model.safetensors", std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }();
  {
    std::ofstream big(dir / "big.bin", std::ios::binary);
    for (std::uint32_t t = 0; t < 200; ++t) {
      const std::uint32_t id = t == 150 ? 5000 : t % 200;
      big.write(reinterpret_cast<const char*>(&id), 4);
    }
    std::ofstream small(dir / "small.bin", std::ios::binary);
    const std::uint32_t ids[10] = {};
    small.write(reinterpret_cast<const char*>(ids), sizeof ids);
  }
  fs::create_directories(dir / "other");
  std::ofstream(dir / "other" / "notes.txt") << "not a checkpoint";
  const std::pair<std::string, std::string> cases[] = {
      {"--data " + (dir / "big.bin").string() + " --seq-len 64", "token 5000 at index 150"},
      {"--data " + (dir / "small.bin").string() + " --seq-len 64", "fewer than the sequence length 64"},
      {"--stop-after 9", "--stop-after 9 must lie between 1 and --steps 6"},
      {"--save-every 2", "needs --save DIR"},
      {"--resume " + ckpt.string() + " --init " + ckpt.string(), "contradict each other"},
      {"--model tiny-qwen3 --resume " + ckpt.string(), "that checkpoint is of another model"},
      {"--resume " + (dir / "nothing").string(), "holds no trainer_state.json"},
      {"--zero 1", "--zero 1 is not supported"},
      {"--attention ring --cp 4 --seq-len 60", "use --seq-len 64"},
      {"--seq-len 12", "too short for the passkey task"},
      {"--lr -1", "must be a positive number"},
      {"--save " + (dir / "other").string(), "is not an upipe checkpoint"},
      {"--save /proc/no/such/dir", "cannot create"},
      {"--comm nccl", "--comm nccl needs --backend cuda"},
      {"--comm carrier-pigeon", "unknown communicator 'carrier-pigeon'"},
      {"--comm-timeout 0", "--comm-timeout 0"},
      {"--memory-gib 0.00001", "no checkpoint policy fits S = 64 in an arena of 1e-05 GiB"},
  };
  for (const auto& [args, message] : cases) {
    const bool has_length = args.find("--seq-len") != std::string::npos;
    const std::string command = has_length ? "train --steps 6 --eval-samples 2 " + args : quick + args;
    const run_result r = run_upipe(command);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
  }
  // A full disk while saving (a 64 KiB file-size limit): a clear error, the earlier
  // checkpoint untouched and no temporary directory left behind.
  const std::string limited = "sh -c 'ulimit -f 64; exec " + std::string(UPIPE_BINARY) +
                              " train --seq-len 64 --steps 2 --eval-samples 0 --save " + ckpt.string() + "' 2>&1";
  FILE* pipe = popen(limited.c_str(), "r");
  std::string output;
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
  const int status = pclose(pipe);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << output;
  EXPECT_NE(output.find("File too large"), std::string::npos) << output;
  std::ifstream after(ckpt / "model.safetensors", std::ios::binary);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(after)), std::istreambuf_iterator<char>()), before);
  for (const auto& entry : fs::directory_iterator(dir))
    EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos) << entry.path();
  fs::remove_all(dir);
}

}  // namespace

namespace {

TEST(train_cli, default_run_learns_the_passkey_within_two_minutes) {
  const auto dir = upipe::testing::temp_dir("train_default");
  const auto start = std::chrono::steady_clock::now();
  const upipe::testing::run_result r = upipe::testing::run_upipe("train --metrics-json " + (dir / "m.jsonl").string());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LT(seconds, 120.0);
  const auto rows = read_lines(dir / "m.jsonl");
  ASSERT_GE(rows.size(), 2u);
  // The predictable filler is learned: the loss falls well below a quarter of its start.
  EXPECT_LT(rows[rows.size() - 2]["loss"].get<double>(), 0.25 * rows.front()["loss"].get<double>());
  // And the key is retrieved from anywhere in the context (chance is 0.1).
  EXPECT_GE(rows.back()["retrieval_accuracy"].get<double>(), 0.5);
  EXPECT_NE(r.output.find("retrieval accuracy"), std::string::npos);
  // The last tenth of the steps runs at the full length.
  EXPECT_EQ(rows[rows.size() - 2]["seq_len"].get<int>(), 128);
  EXPECT_EQ(rows.front()["seq_len"].get<int>(), 32);
  fs::remove_all(dir);
}

// Runs scripts/check_hf_checkpoint.py where PyTorch and transformers are installed (the
// device machine); elsewhere it is skipped and the recorded run stands in docs/benchmarks.md.
TEST(train_cli, checkpoint_loads_in_transformers_with_the_same_loss) {
  if (std::system("python3 -c 'import torch, transformers' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "PyTorch and transformers are not installed here";
  const auto dir = upipe::testing::temp_dir("train_hf");
  const std::string command = "python3 " + source_path("scripts/check_hf_checkpoint.py") + " " + UPIPE_BINARY + " " +
                              dir.string();
  EXPECT_EQ(std::system(command.c_str()), 0);
  fs::remove_all(dir);
}

}  // namespace

namespace {

// Under a launcher: the cpu backend cannot spread over processes and says so; a rank
// other than 0 keeps quiet on stdout (rank 0 speaks for the job).
TEST(train_cli, launcher_processes_are_refused_on_the_cpu_and_ranks_above_zero_are_quiet) {
  const run_result several = run_upipe_env("OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2", "train --steps 2");
  EXPECT_EQ(several.exit_code, 2) << several.output;
  EXPECT_NE(several.output.find("mpirun (Open MPI) started 2 processes"), std::string::npos) << several.output;
  const run_result quiet =
      run_upipe_env("SLURM_PROCID=1 SLURM_STEP_NUM_TASKS=2", "model-config --model tiny-llama");
  EXPECT_EQ(quiet.exit_code, 0) << quiet.output;
  EXPECT_EQ(quiet.output, "");
  const run_result bad = run_upipe_env("PMI_RANK=two PMI_SIZE=2", "model-config --model tiny-llama");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("PMI_RANK='two'"), std::string::npos) << bad.output;
}

}  // namespace
