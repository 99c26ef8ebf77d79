// The run configuration as one request (issue #40 item 1, issue #39 item 4): what
// `train --print-config` writes loads back through --config-file as the same run; every
// command checks a value where it is read, by its row's one rule, naming the flag or the
// file, line and key; a key the command does not take is refused; a path longer than a path
// can be is refused clearly.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "core/digest.hpp"
#include "run_upipe.hpp"

namespace {

using upipe::testing::read_lines;
using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::source_path;
using upipe::testing::temp_dir;
namespace fs = std::filesystem;

// The TOML of a --print-config output (from its first section on), and its values alone
// (each line without its "  # source" comment).
std::string printed_toml(const std::string& output) { return output.substr(output.find("[model]")); }
std::string values_of(const std::string& output) {
  std::istringstream in(printed_toml(output));
  std::string values;
  for (std::string line; std::getline(in, line);) values += line.substr(0, line.find("  # ")) + "\n";
  return values;
}

// print-config of `args`, loaded back through --config-file and printed again: the same
// values. Returns the loaded file.
fs::path round_trip(const fs::path& dir, const std::string& name, const std::string& args) {
  const run_result first = run_upipe("train " + args + " --print-config");
  EXPECT_EQ(first.exit_code, 0) << first.output;
  const fs::path file = dir / (name + ".toml");
  std::ofstream(file) << printed_toml(first.output);
  const run_result again = run_upipe("train --config-file " + file.string() + " --print-config");
  EXPECT_EQ(again.exit_code, 0) << name << "\n" << again.output;
  EXPECT_EQ(values_of(again.output), values_of(first.output)) << name;
  return file;
}

void write_tokens(const fs::path& path, std::uint32_t count) {
  std::ofstream tokens(path, std::ios::binary);
  for (std::uint32_t t = 0; t < count; ++t) {
    const std::uint32_t id = (t * 7) % 200;
    tokens.write(reinterpret_cast<const char*>(&id), 4);
  }
}

TEST(run_config_round_trip, print_config_loads_back_as_the_same_run) {
  const auto dir = temp_dir("round_trip");
  write_tokens(dir / "tokens.bin", 3000);
  const std::string model = source_path("tests/golden/hf/llama-fp16-linear"), data = (dir / "tokens.bin").string();
  round_trip(dir, "demo", "");
  // A fine-tune: steps derived from the epochs, the warm-up from its ratio (both printed as
  // comments: loading the file derives them again).
  const std::string fine_tune = "--model " + model + " --data " + data + " --seq-len 64 --epochs 2 --warmup-ratio 0.1";
  const fs::path tuned = round_trip(dir, "fine_tune", fine_tune);
  // The resolved run is the same: the same losses step by step.
  const std::string metrics_a = (dir / "a.jsonl").string(), metrics_b = (dir / "b.jsonl").string();
  ASSERT_EQ(run_upipe("train " + fine_tune + " --stop-after 2 --metrics-json " + metrics_a).exit_code, 0);
  ASSERT_EQ(run_upipe("train --config-file " + tuned.string() + " --stop-after 2 --metrics-json " + metrics_b).exit_code,
            0);
  const auto a = read_lines(metrics_a), b = read_lines(metrics_b);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i + 1 < a.size(); ++i) {
    EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(a[i]["lr"], b[i]["lr"]) << "step " << i + 1;
  }
  round_trip(dir, "lora", fine_tune + " --lora r=4");
  // A checkpoint's run.toml holds the derived values beside what they derive from: taken
  // where both agree, refused where they do not.
  const std::string tuned_run = (dir / "tuned").string();
  ASSERT_EQ(run_upipe("train " + fine_tune + " --stop-after 1 --save " + tuned_run).exit_code, 0);
  const std::string stored = tuned_run + "/checkpoint-1/trainer/run.toml";
  const run_result record = run_upipe("train --config-file " + stored + " --print-config");
  EXPECT_EQ(record.exit_code, 0) << record.output;
  EXPECT_NE(record.output.find("steps = 94  # config file"), std::string::npos) << record.output;
  const run_result disagree = run_upipe("train " + fine_tune + " --steps 50");
  EXPECT_EQ(disagree.exit_code, 2);
  EXPECT_NE(disagree.output.find("--steps 50 and --epochs 2 (94 steps over --data) both set the schedule's length and "
                                 "disagree"), std::string::npos) << disagree.output;
  // A resume: its checkpoint's values and the --resume itself load back.
  const std::string run = (dir / "run").string();
  ASSERT_EQ(run_upipe("train --model " + model + " --data " + data + " --seq-len 64 --steps 6 --stop-after 2 --save " +
                      run).exit_code, 0);
  const fs::path resumed = round_trip(dir, "resume", "--resume " + run + " --stop-after 4");
  std::ifstream in(resumed);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("resume = '" + run + "/checkpoint-2'"), std::string::npos) << text;
  fs::remove_all(dir);
}

TEST(run_config_rules, every_command_names_the_file_and_key_of_a_bad_value) {
  const auto dir = temp_dir("rules_file");
  std::ofstream(dir / "tile.toml") << "[system]\n\nmlp_tile = -1\n";
  const std::string at = (dir / "tile.toml").string() + ":3: system.mlp_tile = -1 must lie between 0 and 1073741824";
  for (const std::string& command : {"train", "step", "eval --niah", "bench --layers 1", "plan --model tiny-llama"}) {
    const run_result r = run_upipe(command + " --config-file " + (dir / "tile.toml").string());
    EXPECT_EQ(r.exit_code, 2) << command << "\n" << r.output;
    EXPECT_NE(r.output.find(at + " (the flag --mlp-tile; for example mlp_tile = 8192)"), std::string::npos)
        << command << "\n" << r.output;
  }
  // One rule per flag, from a flag or a file alike: --lr in (0, 1], --steps up to 10^9, --zero 2 or 3.
  std::ofstream(dir / "rules.toml") << "[optimizer]\nlr = 2\n";
  const run_result lr_file = run_upipe("train --config-file " + (dir / "rules.toml").string());
  EXPECT_NE(lr_file.output.find("rules.toml:2: optimizer.lr = 2.0 must lie in (0, 1]"), std::string::npos)
      << lr_file.output;
  EXPECT_NE(run_upipe("train --lr 2").output.find("--lr 2 must lie in (0, 1] (for example --lr 3e-4)"),
            std::string::npos);
  EXPECT_NE(run_upipe("train --steps 2000000000").output.find("--steps 2000000000 must lie between 1 and 1000000000"),
            std::string::npos);
  for (const std::string& command : {"train", "bench", "plan"}) {
    const run_result zero = run_upipe(command + " --zero 1");
    EXPECT_EQ(zero.exit_code, 2) << command;
    EXPECT_NE(zero.output.find("--zero 1 is not one of: 2, 3 (for example --zero 3)"), std::string::npos)
        << command << "\n" << zero.output;
  }
  // A value from a checkpoint's run.toml is named by that file too (an edited one).
  const std::string run = (dir / "run").string();
  ASSERT_EQ(run_upipe("train --seq-len 64 --steps 4 --stop-after 1 --eval-samples 0 --cp 2 --save " + run).exit_code, 0);
  const fs::path stored = fs::path(run) / "checkpoint-1" / "trainer" / "run.toml";
  std::ifstream in(stored);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  text.replace(text.find("packing = 'auto'"), 16, "packing = 'zip'");
  const std::string digest_before = upipe::file_sha256(stored.string(), "run.toml");
  std::ofstream(stored) << text;
  // As a program that wrote the file with its manifest would (an edit alone is refused by
  // the digest first, tests/apps/resume_cli_test.cpp): the value's own check names it.
  const fs::path manifest = fs::path(run) / "checkpoint-1" / "trainer" / "manifest.json";
  std::ifstream manifest_in(manifest);
  std::string manifest_text((std::istreambuf_iterator<char>(manifest_in)), std::istreambuf_iterator<char>());
  manifest_in.close();
  const std::size_t digest_at = manifest_text.find(digest_before);
  ASSERT_NE(digest_at, std::string::npos);
  manifest_text.replace(digest_at, digest_before.size(), upipe::file_sha256(stored.string(), "run.toml"));
  std::ofstream(manifest) << manifest_text;
  const run_result edited = run_upipe("train --resume " + run);
  EXPECT_EQ(edited.exit_code, 2);
  EXPECT_NE(edited.output.find(stored.string() + ":"), std::string::npos) << edited.output;
  EXPECT_NE(edited.output.find("data.packing = 'zip' is not one of: auto, documents, stream"), std::string::npos)
      << edited.output;
  fs::remove_all(dir);
}

TEST(run_config_rules, a_key_the_command_does_not_take_is_refused) {
  const auto dir = temp_dir("rules_keys");
  std::ofstream(dir / "keep.toml") << "[checkpoint]\nkeep_last = 3\n";
  const std::string file = (dir / "keep.toml").string();
  for (const std::string& command : {"eval --niah", "step", "bench"}) {
    const run_result r = run_upipe(command + " --config-file " + file);
    EXPECT_EQ(r.exit_code, 2) << command;
    EXPECT_NE(r.output.find(file + ":2: checkpoint.keep_last is not an option of upipe " +
                            command.substr(0, command.find(' ')) + ": only upipe train takes it (--keep-last"),
              std::string::npos)
        << r.output;
  }
  // plan plans a train run: it reads train's keys.
  const run_result plan = run_upipe("plan --model tiny-llama --gpus 16 --gpus-per-node 8 --attention ring "
                                    "--config-file " + file);
  EXPECT_EQ(plan.exit_code, 0) << plan.output;
  // A key of step's and train's, not bench's.
  std::ofstream(dir / "len.toml") << "[data]\nseq_len = '4K'\n";
  const run_result bench = run_upipe("bench --config-file " + (dir / "len.toml").string());
  EXPECT_EQ(bench.exit_code, 2);
  EXPECT_NE(bench.output.find("only upipe train and step take it (--seq-len"), std::string::npos) << bench.output;
  fs::remove_all(dir);
}

TEST(run_config_rules, long_paths_and_odd_values_get_a_clear_error) {
  const auto dir = temp_dir("rules_paths");
  const std::string long_path(5000, 'a'), long_name = "d/" + std::string(300, 'b');
  const std::pair<std::string, std::string> cases[] = {
      {"train --init " + long_path, "--init aaaa"},
      {"train --save " + long_path, "--save aaaa"},
      {"train --data " + long_name, "has a name of 300 characters, and a name in a path is at most 255"},
      {"train --metrics-json " + long_path, "a path is at most 4095"},
      {"step --weights " + long_path, "a path is at most 4095"},
      {"eval --weights " + long_path, "a path is at most 4095"},
      {"eval --config-file " + long_path, "--config-file aaaa"},
      {"plan --config-file " + long_path, "--config-file aaaa"},
  };
  for (const auto& [args, message] : cases) {
    const run_result r = run_upipe(args);
    EXPECT_EQ(r.exit_code, 2) << args.substr(0, 40) << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("upipe: error:"), std::string::npos) << r.output;
  }
  std::ofstream(dir / "long.toml") << "[model]\ninit = '" << long_path << "'\n";
  const run_result in_file = run_upipe("train --config-file " + (dir / "long.toml").string());
  EXPECT_EQ(in_file.exit_code, 2);
  EXPECT_NE(in_file.output.find("long.toml:2: model.init = 'aaaa"), std::string::npos) << in_file.output;
  EXPECT_NE(in_file.output.find("(5002 characters) is 5000 characters long, and a path is at most 4095"),
            std::string::npos) << in_file.output;
  std::ofstream(dir / "control.toml") << "[data]\ndata = \"a\\u0001b\"\n";
  const run_result control = run_upipe("train --config-file " + (dir / "control.toml").string());
  EXPECT_EQ(control.exit_code, 2);
  EXPECT_NE(control.output.find("control.toml:2: data.data = "), std::string::npos) << control.output;
  EXPECT_NE(control.output.find("holds a control character"), std::string::npos) << control.output;
  fs::remove_all(dir);
}

}  // namespace
