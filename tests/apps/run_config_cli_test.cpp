// Runs that last for days (issue #30): one run configuration from defaults, a config file,
// a checkpoint and flags; resume from the run directory alone, from another working
// directory, after SIGTERM, bit for bit; numbered checkpoints that rotate and never replace
// another run's; the data checks; the command line's own help for mistakes.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_upipe.hpp"

namespace {

using upipe::testing::checkpoint_bytes;
using upipe::testing::read_file;
using upipe::testing::read_lines;
using upipe::testing::run_and_signal;
using upipe::testing::run_in;
using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::run_upipe_env;
using upipe::testing::source_path;
using upipe::testing::split;
using upipe::testing::temp_dir;
namespace fs = std::filesystem;

struct resume_case {
  const char* name;
  const char* flags;
  std::vector<const char*> compared;  // files of the final checkpoint that must be equal byte for byte
};

// A run stopped by SIGTERM mid-way and resumed with --resume DIR alone from another
// directory equals the run that was never stopped: every step's loss and the final
// checkpoint's weights and optimizer state, bit for bit.
class resume_after_sigterm : public ::testing::TestWithParam<resume_case> {};

TEST_P(resume_after_sigterm, equals_the_uninterrupted_run) {
  const resume_case& c = GetParam();
  const auto dir = temp_dir(std::string("resume_") + c.name);
  const std::string common = std::string("train --seq-len 64 --seq-warmup 0 --steps 24 --eval-samples 0 --save-dtype "
                                         "fp32 --save-every 5 ") + c.flags;
  // Relative paths, resolved and stored by the first run.
  const run_result whole = run_in(dir, common + " --save whole --metrics-json whole.jsonl");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  std::vector<std::string> args = split(common + " --save run --metrics-json run.jsonl");
  fs::current_path(dir);
  const int status = run_and_signal(args, dir / "run.jsonl", 7, SIGTERM, dir / "first.log");
  ASSERT_EQ(status, 75) << read_file(dir / "first.log");
  const auto stopped = read_lines(dir / "run.jsonl");
  ASSERT_TRUE(stopped.back().value("final", false));
  EXPECT_EQ(stopped.back()["stopped_by_signal"], SIGTERM);
  const std::int64_t at = stopped[stopped.size() - 2]["step"].get<std::int64_t>();
  ASSERT_LT(at, 24) << "the run finished before the signal";
  EXPECT_TRUE(fs::exists(dir / "run" / ("checkpoint-" + std::to_string(at)) / "trainer" / "run.toml"));
  EXPECT_EQ(read_file(dir / "run" / "latest"), "checkpoint-" + std::to_string(at) + "\n");
  // From another directory, the run directory alone.
  fs::create_directories(dir / "elsewhere");
  const run_result resumed = run_in(dir / "elsewhere", "train --resume " + (dir / "run").string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto a = read_lines(dir / "whole.jsonl"), b = read_lines(dir / "run.jsonl");
  std::vector<nlohmann::json> steps_a, steps_b;
  for (const auto& r : a)
    if (r.contains("step")) steps_a.push_back(r);
  for (const auto& r : b)
    if (r.contains("step")) steps_b.push_back(r);
  ASSERT_EQ(steps_a.size(), 24u);
  ASSERT_EQ(steps_b.size(), 24u);  // the resumed run appended to the same metrics file
  for (std::size_t i = 0; i < 24; ++i) {
    EXPECT_EQ(steps_b[i]["step"], steps_a[i]["step"]);
    EXPECT_EQ(steps_b[i]["loss"], steps_a[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(steps_b[i]["grad_norm"], steps_a[i]["grad_norm"]) << "step " << i + 1;
    EXPECT_TRUE(steps_b[i].contains("time"));
  }
  for (const char* file : c.compared)
    EXPECT_EQ(checkpoint_bytes(dir / "run" / "checkpoint-24" / file), checkpoint_bytes(dir / "whole" / "checkpoint-24" / file))
        << file;
  fs::current_path(fs::temp_directory_path());
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    runs, resume_after_sigterm,
    ::testing::Values(
        resume_case{"cp2", "--cp 2", {"model.safetensors", "trainer/rank-00000-of-00002.safetensors"}},
        resume_case{"cp4_zero3", "--cp 4 --zero 3 --attention ring",
                    {"model.safetensors", "trainer/rank-00003-of-00004.safetensors"}},
        resume_case{"lora", "--cp 2 --lora r=4", {"adapter_model.safetensors", "trainer/rank-00001-of-00002.safetensors"}},
        resume_case{"offload", "--cp 2 --zero 3 --offload optimizer,params",
                    {"model.safetensors", "trainer/rank-00000-of-00002.safetensors"}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(run_config, a_config_file_under_the_flags) {
  const auto dir = temp_dir("run_config_file");
  std::ofstream(dir / "run.toml") << "[optimizer]\nlr = 3e-4\nsteps = 40\n\n[parallel]\ncp = 2\nattention = 'ring'\n"
                                     "\n[data]\nseq_len = 256\n";
  const run_result r = run_upipe("train --config-file " + (dir / "run.toml").string() + " --lr 5e-4 --print-config");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("lr = 0.0005  # flag"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("steps = 40  # config file"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("attention = 'ring'  # config file"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("seq_len = '256'  # config file"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("warmup = 20\n"), std::string::npos) << r.output;  // the demo's default, no comment
  // The printed configuration is itself a config file.
  std::ofstream(dir / "printed.toml") << r.output.substr(r.output.find("[model]"));
  const run_result again = run_upipe("train --config-file " + (dir / "printed.toml").string() + " --print-config");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("lr = 0.0005  # config file"), std::string::npos) << again.output;
  // Mistakes name the file, the line, the key and the rule.
  std::ofstream(dir / "typo.toml") << "[optimizer]\nlrr = 3e-4\n";
  const run_result typo = run_upipe("train --config-file " + (dir / "typo.toml").string());
  EXPECT_EQ(typo.exit_code, 2);
  EXPECT_NE(typo.output.find("typo.toml:2: 'optimizer.lrr' is not an option; did you mean 'optimizer.lr'?"),
            std::string::npos) << typo.output;
  std::ofstream(dir / "type.toml") << "[parallel]\ncp = 'two'\n";
  const run_result type = run_upipe("train --config-file " + (dir / "type.toml").string());
  EXPECT_EQ(type.exit_code, 2);
  EXPECT_NE(type.output.find("type.toml:2: parallel.cp must be a whole number"), std::string::npos) << type.output;
  std::ofstream(dir / "bad.toml") << "[optimizer\nlr = 1\n";
  const run_result syntax = run_upipe("train --config-file " + (dir / "bad.toml").string());
  EXPECT_EQ(syntax.exit_code, 2);
  EXPECT_NE(syntax.output.find("bad.toml:1:"), std::string::npos) << syntax.output;
  // A value from the file that breaks a rule is named with its source.
  std::ofstream(dir / "range.toml") << "[optimizer]\nlr = 5.0\n";
  const run_result range = run_upipe("train --config-file " + (dir / "range.toml").string());
  EXPECT_EQ(range.exit_code, 2);
  EXPECT_NE(range.output.find("range.toml:2: optimizer.lr = 5.0 must lie in (0, 1] (the flag --lr; for example lr = "
                              "3e-4)"), std::string::npos) << range.output;
  fs::remove_all(dir);
}

TEST(run_config, flags_beside_resume_are_refused_or_reported) {
  const auto dir = temp_dir("run_config_resume");
  const std::string run = (dir / "run").string();
  ASSERT_EQ(run_upipe("train --seq-len 64 --seq-warmup 0 --steps 8 --stop-after 3 --eval-samples 0 --cp 2 --lr 3e-4 "
                      "--save " + run).exit_code, 0);
  // The same run: another seed is another run.
  const run_result seed = run_upipe("train --resume " + run + " --seed 7");
  EXPECT_EQ(seed.exit_code, 2);
  EXPECT_NE(seed.output.find("--seed 7 differs from the run in"), std::string::npos) << seed.output;
  EXPECT_NE(seed.output.find("optimizer.seed = 1"), std::string::npos) << seed.output;
  // A new learning rate and a longer schedule are reported changes.
  const run_result changed = run_upipe("train --resume " + run + " --lr 1e-4 --steps 10 --stop-after 4");
  ASSERT_EQ(changed.exit_code, 0) << changed.output;
  EXPECT_NE(changed.output.find("resumed with optimizer.lr: 0.0003 -> 0.0001 (flag)"), std::string::npos)
      << changed.output;
  EXPECT_NE(changed.output.find("resumed with optimizer.steps: 8 -> 10 (flag)"), std::string::npos) << changed.output;
  // The whole configuration, each value's source, is --print-config's (the start is a few lines).
  const run_result shown = run_upipe("train --resume " + run + " --lr 1e-4 --steps 10 --print-config");
  EXPECT_NE(shown.output.find("cp = 2  # checkpoint"), std::string::npos) << shown.output;
  fs::remove_all(dir);
}

TEST(run_directory, checkpoints_rotate_and_keep_the_best) {
  const auto dir = temp_dir("run_directory");
  {
    std::ofstream tokens(dir / "tokens.bin", std::ios::binary);
    for (std::uint32_t t = 0; t < 4000; ++t) {
      const std::uint32_t id = (t * 7) % 200;
      tokens.write(reinterpret_cast<const char*>(&id), 4);
    }
  }
  const std::string run = (dir / "run").string(), data = (dir / "tokens.bin").string();
  const run_result r = run_upipe("train --seq-len 64 --steps 10 --cp 2 --data " + data + " --eval-data " + data +
                                 " --eval-every 2 --save " + run + " --save-every 2 --keep-last 2 --keep-best");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(run)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  const std::string best = read_file(dir / "run" / "best");
  ASSERT_FALSE(best.empty());
  std::vector<std::string> expected = {"best", "checkpoint-10", "checkpoint-8", "latest"};
  const std::string best_name = best.substr(0, best.size() - 1);
  if (best_name != "checkpoint-10" && best_name != "checkpoint-8") expected.push_back(best_name);
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(names, expected);
  EXPECT_EQ(read_file(dir / "run" / "latest"), "checkpoint-10\n");
  // Another run into the same directory is refused, and allowed with --overwrite.
  const std::string other = "train --seq-len 64 --steps 2 --cp 2 --eval-samples 0 --save " + run;
  const run_result refused = run_upipe(other);
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_NE(refused.output.find("holds another run's checkpoints"), std::string::npos) << refused.output;
  EXPECT_TRUE(fs::exists(dir / "run" / "checkpoint-10"));
  const run_result replaced = run_upipe(other + " --overwrite");
  ASSERT_EQ(replaced.exit_code, 0) << replaced.output;
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoint-10"));
  EXPECT_EQ(read_file(dir / "run" / "latest"), "checkpoint-2\n");
  // A run directory stands for its latest checkpoint wherever a model or checkpoint is read.
  const run_result exported = run_upipe("export " + run + " " + (dir / "hf").string());
  EXPECT_EQ(exported.exit_code, 0) << exported.output;
  EXPECT_TRUE(fs::exists(dir / "hf" / "config.json"));
  fs::remove_all(dir);
}

TEST(run_config, data_checks_refuse_before_step_one) {
  const auto dir = temp_dir("run_config_data");
  {
    std::ofstream tokens(dir / "short.bin", std::ios::binary);
    for (std::uint32_t t = 0; t < 100; ++t) tokens.write(reinterpret_cast<const char*>(&t), 4);
  }
  const run_result short_data =
      run_upipe("train --seq-len 128 --steps 2 --data " + (dir / "short.bin").string() + " --save " +
                (dir / "run").string());
  EXPECT_EQ(short_data.exit_code, 2);
  EXPECT_NE(short_data.output.find("holds 100 tokens (in the documents kept), fewer than one sequence of --seq-len 128"),
            std::string::npos)
      << short_data.output;
  EXPECT_FALSE(fs::exists(dir / "run"));
  // A corpus made by another tokenizer than the model directory's: the same model with a
  // tokenizer.json of other bytes.
  const std::string qwen = source_path("tests/golden/hf/qwen3-tied"), llama = (dir / "llama").string();
  fs::copy(source_path("tests/golden/hf/llama-fp16-linear"), llama);
  std::ofstream(dir / "llama" / "tokenizer.json", std::ios::app) << "\n";
  std::ofstream(dir / "docs.jsonl") << "{\"text\": \"the quick brown fox jumps over the lazy dog again and again\"}\n"
                                       "{\"text\": \"a second document with a few more words in it than the first\"}\n";
  const run_result prepared = run_upipe("prepare-data " + (dir / "docs.jsonl").string() + " --tokenizer " + qwen +
                                        " --out " + (dir / "corpus").string());
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  const std::string train = "train --model " + llama + " --seq-len 8 --steps 1 --cp 1 --data " + (dir / "corpus").string();
  // A corpus whose documents hold fewer tokens than one sequence.
  const run_result short_corpus = run_upipe("train --model " + llama + " --seq-len 256 --steps 1 --cp 1 --data " +
                                            (dir / "corpus").string() + " --allow-tokenizer-mismatch");
  EXPECT_EQ(short_corpus.exit_code, 2);
  EXPECT_NE(short_corpus.output.find("fewer than one sequence of --seq-len 256"), std::string::npos)
      << short_corpus.output;
  const run_result mismatch = run_upipe(train);
  EXPECT_EQ(mismatch.exit_code, 2);
  EXPECT_NE(mismatch.output.find("was tokenized with"), std::string::npos) << mismatch.output;
  EXPECT_NE(mismatch.output.find("--allow-tokenizer-mismatch"), std::string::npos) << mismatch.output;
  const run_result allowed = run_upipe(train + " --allow-tokenizer-mismatch");
  EXPECT_EQ(allowed.exit_code, 0) << allowed.output;
  fs::remove_all(dir);
}

TEST(run_config, a_pretrained_model_gets_the_fine_tune_defaults) {
  const auto dir = temp_dir("run_config_fine_tune");
  {
    std::ofstream tokens(dir / "tokens.bin", std::ios::binary);
    for (std::uint32_t t = 0; t < 3000; ++t) tokens.write(reinterpret_cast<const char*>(&t), 4);
  }
  const std::string model = source_path("tests/golden/hf/llama-fp16-linear");
  const run_result r = run_upipe("train --model " + model + " --data " + (dir / "tokens.bin").string() +
                                 " --seq-len 64 --print-config");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("# defaults: fine-tune"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("lr = 2e-05  # fine-tune default"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("warmup_ratio = 0.03  # fine-tune default"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("cp = 1  # fine-tune default"), std::string::npos) << r.output;
  // One epoch over 3000 tokens of 64 a step.
  EXPECT_NE(r.output.find("# steps = 47  # derived"), std::string::npos) << r.output;  // loading the file derives it again
  const run_result demo = run_upipe("train --print-config");
  EXPECT_NE(demo.output.find("# defaults: demo"), std::string::npos) << demo.output;
  EXPECT_NE(demo.output.find("lr = 0.001\n"), std::string::npos) << demo.output;
  fs::remove_all(dir);
}

TEST(command_line, mistakes_get_the_closest_name) {
  const run_result command = run_upipe("trian --steps 3");
  EXPECT_EQ(command.exit_code, 2);
  EXPECT_NE(command.output.find("'trian' is not a command of upipe; did you mean train?"), std::string::npos)
      << command.output;
  const run_result flag = run_upipe("train --stepz 3");
  EXPECT_EQ(flag.exit_code, 2);
  EXPECT_NE(flag.output.find("upipe train has no flag --stepz; did you mean --steps?"), std::string::npos)
      << flag.output;
  const run_result version = run_upipe("--version");
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_EQ(version.output.rfind("upipe ", 0), 0u) << version.output;
  const run_result gpus = run_upipe("plan --model tiny-llama --gpus 16 --gpus-per-node 8 --attention ring");
  EXPECT_EQ(gpus.exit_code, 0) << gpus.output;
  EXPECT_NE(gpus.output.find("gpus=16 (2 nodes of 8)"), std::string::npos) << gpus.output;
  const run_result disagree = run_upipe("plan --model tiny-llama --gpus 16 --gpus-per-node 8 --nodes 3");
  EXPECT_EQ(disagree.exit_code, 2);
  EXPECT_NE(disagree.output.find("--gpus 16 differs from --nodes 3 x --gpus-per-node 8"), std::string::npos)
      << disagree.output;
}

}  // namespace
