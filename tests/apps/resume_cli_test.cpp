// Resume as a preempted job lives it (issue #39): rotation never removes what a resumed run
// still needs, a run writes only where it was told (a copied run directory is a run of its
// own), every file of a checkpoint agrees with the others, and the README's run.toml works
// in an empty directory.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
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
using upipe::testing::source_path;
using upipe::testing::split;
using upipe::testing::temp_dir;
namespace fs = std::filesystem;

// Every file under `dir` (relative path -> bytes).
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files[fs::relative(e.path(), dir).string()] = read_file(e.path());
  return files;
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<nlohmann::json> steps_of(const fs::path& metrics) {
  std::vector<nlohmann::json> steps;
  for (const auto& r : read_lines(metrics))
    if (r.contains("step")) steps.push_back(r);
  return steps;
}

void expect_refused(const run_result& r, const std::string& words) {
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(words), std::string::npos) << "wanted '" << words << "' in: " << r.output;
}

// Sets element 0 of `tensor` in a safetensors file (f32) to `value`, in place.
void poke_f32(const fs::path& file, const std::string& tensor, float value) {
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  std::uint64_t header_bytes = 0;
  io.read(reinterpret_cast<char*>(&header_bytes), 8);
  std::string header(header_bytes, '\0');
  io.read(header.data(), static_cast<std::streamsize>(header_bytes));
  const auto j = nlohmann::json::parse(header);
  ASSERT_TRUE(j.contains(tensor)) << tensor << " not in " << file;
  ASSERT_EQ(j[tensor]["dtype"], "F32");
  io.seekp(static_cast<std::streamoff>(8 + header_bytes + j[tensor]["data_offsets"][0].get<std::uint64_t>()));
  io.write(reinterpret_cast<const char*>(&value), 4);
}

void edit_manifest(const fs::path& checkpoint, const std::string& key, const nlohmann::json& value) {
  const fs::path path = checkpoint / "trainer" / "manifest.json";
  auto j = nlohmann::json::parse(read_file(path));
  j[key] = value;
  std::ofstream(path) << j.dump(2);
}

// A corpus PREFIX (upipe's format: .tokens, .index, .json) of `documents` documents of
// `length` tokens below `vocab`.
void write_corpus(const fs::path& prefix, int documents, int length, std::uint32_t vocab) {
  std::ofstream tokens(prefix.string() + ".tokens", std::ios::binary), index(prefix.string() + ".index", std::ios::binary);
  std::uint64_t offset = 0;
  index.write(reinterpret_cast<const char*>(&offset), 8);
  for (int d = 0; d < documents; ++d) {
    for (int t = 0; t < length; ++t) {
      const std::uint32_t id = static_cast<std::uint32_t>((d * 31 + t * 7 + 3) % vocab);
      tokens.write(reinterpret_cast<const char*>(&id), 4);
    }
    offset += static_cast<std::uint64_t>(length);
    index.write(reinterpret_cast<const char*>(&offset), 8);
  }
  std::ofstream(prefix.string() + ".json")
      << nlohmann::json{{"format", "upipe-tokens"}, {"version", 1},       {"dtype", "uint32"},
                        {"vocab_size", vocab},      {"documents", documents}, {"tokens", offset}}.dump();
}

// A run with --keep-last 1 stopped by SIGTERM and resumed five times (each resume from the
// run directory alone, which rotation has cleared down to one checkpoint) finishes, equal
// bit for bit to the run that never stopped; no half-removed checkpoint is left.
TEST(resume_with_rotation, keep_last_1_stopped_five_times_equals_the_uninterrupted_run) {
  const auto dir = temp_dir("keep_last_resume");
  const std::string common =
      "train --seq-len 64 --seq-warmup 0 --steps 40 --eval-samples 0 --save-dtype fp32 --save-every 3 --keep-last 1 "
      "--cp 2";
  const run_result whole = run_in(dir, common + " --save whole --metrics-json whole.jsonl");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  fs::current_path(dir);
  for (int stop = 0; stop < 5; ++stop) {
    const std::vector<std::string> args =
        stop == 0 ? split(common + " --save run --metrics-json run.jsonl") : split("train --resume run");
    const std::size_t lines = fs::exists(dir / "run.jsonl") ? read_lines(dir / "run.jsonl").size() : 0;
    const fs::path log = dir / ("stop" + std::to_string(stop) + ".log");
    ASSERT_EQ(run_and_signal(args, dir / "run.jsonl", lines + 3, SIGTERM, log), 75) << read_file(log);
    const auto saved = steps_of(dir / "run.jsonl");
    ASSERT_LT(saved.back()["step"].get<std::int64_t>(), 40) << "the run finished before the signal";
    const std::string latest = "checkpoint-" + std::to_string(saved.back()["step"].get<std::int64_t>());
    EXPECT_EQ(names_in(dir / "run"), (std::vector<std::string>{latest, "latest"})) << read_file(log);
  }
  const run_result finished = run_in(dir, "train --resume run");
  ASSERT_EQ(finished.exit_code, 0) << finished.output;
  EXPECT_EQ(names_in(dir / "run"), (std::vector<std::string>{"checkpoint-40", "latest"}));
  const auto a = steps_of(dir / "whole.jsonl"), b = steps_of(dir / "run.jsonl");
  ASSERT_EQ(a.size(), 40u);
  ASSERT_EQ(b.size(), 40u);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i]["step"], a[i]["step"]);
    EXPECT_EQ(b[i]["loss"], a[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(b[i]["grad_norm"], a[i]["grad_norm"]) << "step " << i + 1;
  }
  for (const char* file : {"model.safetensors", "config.json", "trainer/rank-00000-of-00002.safetensors",
                           "trainer/rank-00001-of-00002.safetensors"})
    EXPECT_EQ(checkpoint_bytes(dir / "run" / "checkpoint-40" / file),
              checkpoint_bytes(dir / "whole" / "checkpoint-40" / file))
        << file;
  fs::current_path(fs::temp_directory_path());
  fs::remove_all(dir);
}

// A removal killed half-way leaves a hidden name, never a half checkpoint under its own:
// the next save finishes it off.
TEST(resume_with_rotation, a_half_removed_checkpoint_is_finished_by_the_next_save) {
  const auto dir = temp_dir("half_removed");
  const std::string run = (dir / "run").string();
  const std::string common = "train --seq-len 32 --steps 6 --cp 1 --eval-samples 0 --save-every 2 --keep-last 1 --save " + run;
  ASSERT_EQ(run_upipe(common + " --stop-after 4").exit_code, 0);
  fs::create_directories(dir / "run" / ".checkpoint-2.removed-upipe" / "trainer");  // what a kill left
  const run_result r = run_upipe("train --resume " + run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(names_in(dir / "run"), (std::vector<std::string>{"checkpoint-6", "latest"}));
  fs::remove_all(dir);
}

// A copy of a run directory resumed is a run of its own: it saves (and rotates) in the copy,
// and the original stays as it was, byte for byte, and so does its metrics file. A checkpoint of another run dropped into
// a run directory is refused there, naming the way out; neither directory changes.
TEST(resume_writes_where_told, a_copied_run_directory_leaves_the_original_alone) {
  const auto dir = temp_dir("copied_run");
  const std::string original = (dir / "original").string(), copy = (dir / "copy").string();
  const fs::path metrics = dir / "original.jsonl";  // beside the run directory, as the README has it
  const run_result first = run_upipe("train --seq-len 32 --steps 8 --stop-after 4 --cp 1 --eval-samples 0 "
                                     "--save-every 2 --keep-last 1 --save " + original + " --metrics-json " +
                                     metrics.string());
  ASSERT_EQ(first.exit_code, 0) << first.output;
  fs::copy(original, copy, fs::copy_options::recursive);
  const auto before = snapshot(original);
  const std::string metrics_before = read_file(metrics);
  const run_result resumed = run_upipe("train --resume " + copy);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(snapshot(original), before);
  EXPECT_EQ(read_file(metrics), metrics_before);  // the original run's metrics
  EXPECT_NE(resumed.output.find("metrics.json: " + metrics.string() + " not taken"), std::string::npos)
      << resumed.output;
  EXPECT_EQ(names_in(copy), (std::vector<std::string>{"checkpoint-8", "latest"}));
  EXPECT_NE(resumed.output.find("it was saved into " + original), std::string::npos) << resumed.output;
  // A foreign checkpoint inside another run's directory.
  const std::string other = (dir / "other").string();
  ASSERT_EQ(run_upipe("train --seq-len 32 --steps 2 --cp 1 --eval-samples 0 --save " + other).exit_code, 0);
  fs::copy(fs::path(original) / "checkpoint-4", fs::path(other) / "checkpoint-4", fs::copy_options::recursive);
  const auto other_before = snapshot(other);
  expect_refused(run_upipe("train --resume " + other + "/checkpoint-4"), "holds another run's checkpoints");
  EXPECT_EQ(snapshot(original), before);
  EXPECT_EQ(snapshot(other), other_before);
  // A checkpoint outside any run directory saves only where --save says.
  fs::copy(fs::path(original) / "checkpoint-4", dir / "lone", fs::copy_options::recursive);
  const run_result lone = run_upipe("train --resume " + (dir / "lone").string() + " --stop-after 5");
  ASSERT_EQ(lone.exit_code, 0) << lone.output;
  EXPECT_NE(lone.output.find("not taken"), std::string::npos) << lone.output;
  EXPECT_EQ(snapshot(original), before);
  fs::remove_all(dir);
}

// What a damaged checkpoint holds is refused at load, naming the file, before step 1.
TEST(checkpoint_integrity, disagreeing_or_damaged_files_are_refused) {
  const auto dir = temp_dir("integrity");
  const fs::path run = dir / "run";
  ASSERT_EQ(run_upipe("train --seq-len 32 --steps 8 --stop-after 4 --cp 2 --eval-samples 0 --save-every 2 "
                      "--save-dtype fp32 --save " + run.string()).exit_code, 0);
  const auto damaged = [&](const std::string& name) {
    const fs::path c = dir / name;
    fs::remove_all(c);
    fs::copy(run, c, fs::copy_options::recursive);
    return c;
  };
  {  // the manifest's step against the directory's name
    const fs::path c = damaged("named");
    edit_manifest(c / "checkpoint-4", "step", 3);
    expect_refused(run_upipe("train --resume " + (c / "checkpoint-4").string()), "differs from the step its directory");
  }
  {  // total_steps below the step, or none
    const fs::path c = damaged("total");
    edit_manifest(c / "checkpoint-4", "total_steps", 2);
    expect_refused(run_upipe("train --resume " + c.string()), "lies past total_steps = 2");
    edit_manifest(c / "checkpoint-4", "total_steps", 0);
    expect_refused(run_upipe("train --resume " + c.string()), "total_steps = 0 must be at least 1");
  }
  {  // a rank's shard from another step's checkpoint
    const fs::path c = damaged("shard");
    fs::copy_file(c / "checkpoint-2" / "trainer" / "rank-00001-of-00002.safetensors",
                  c / "checkpoint-4" / "trainer" / "rank-00001-of-00002.safetensors",
                  fs::copy_options::overwrite_existing);
    expect_refused(run_upipe("train --resume " + c.string()), "rank-00001-of-00002.safetensors was written at step 2");
  }
  {  // an emptied or edited run.toml
    const fs::path c = damaged("toml");
    const fs::path toml = c / "checkpoint-4" / "trainer" / "run.toml";
    std::ofstream(toml, std::ios::trunc).flush();
    expect_refused(run_upipe("train --resume " + c.string()), toml.string() + " is empty");
    std::ofstream(toml) << "[optimizer]\nlr = 0.5\n";
    expect_refused(run_upipe("train --resume " + c.string()), "is not the file the checkpoint was saved with");
    fs::remove(toml);
    expect_refused(run_upipe("train --resume " + c.string()), toml.string() + " is missing");
  }
  {  // a negative second moment
    const fs::path c = damaged("moment");
    poke_f32(c / "checkpoint-4" / "trainer" / "rank-00000-of-00002.safetensors", "unit.1.exp_avg_sq", -1.0f);
    expect_refused(run_upipe("train --resume " + c.string()), "which is never negative");
  }
  fs::remove_all(dir);
}

// 8-bit moments: a block's absmax below zero is refused.
TEST(checkpoint_integrity, a_negative_absmax_is_refused) {
  const auto dir = temp_dir("integrity_q8");
  const fs::path run = dir / "run";
  ASSERT_EQ(run_upipe("train --seq-len 32 --steps 4 --stop-after 2 --cp 1 --eval-samples 0 --optimizer-state 8bit "
                      "--save " + run.string()).exit_code, 0);
  poke_f32(run / "checkpoint-2" / "trainer" / "rank-00000-of-00001.safetensors", "unit.1.exp_avg_sq_absmax", -0.5f);
  expect_refused(run_upipe("train --resume " + run.string()), "second moment's block absmax");
  fs::remove_all(dir);
}

// A LoRA run's frozen base is part of the run: --init another base on resume is refused,
// and a resume without --init takes the stored one.
TEST(checkpoint_integrity, a_lora_resume_keeps_its_base) {
  const auto dir = temp_dir("lora_base");
  const std::string model = source_path("tests/golden/hf/llama-fp16-linear");
  const fs::path full = dir / "full";
  ASSERT_EQ(run_upipe("train --model " + model + " --seq-len 32 --steps 2 --cp 1 --eval-samples 0 --save-every 1 "
                      "--save " + full.string()).exit_code, 0);
  const std::string base1 = (full / "checkpoint-1").string(), base2 = (full / "checkpoint-2").string();
  const std::string lora = (dir / "lora").string();
  ASSERT_EQ(run_upipe("train --model " + model + " --init " + base1 + " --lora r=2 --seq-len 32 --steps 4 "
                      "--stop-after 2 --cp 1 --eval-samples 0 --save " + lora).exit_code, 0);
  expect_refused(run_upipe("train --resume " + lora + " --init " + base2), "--init '" + base2 + "' differs from the run");
  const run_result printed = run_upipe("train --resume " + lora + " --print-config");
  EXPECT_NE(printed.output.find("init = '" + base1 + "'  # checkpoint"), std::string::npos) << printed.output;
  const run_result resumed = run_upipe("train --resume " + lora);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  fs::remove_all(dir);
}

// The README's run.toml, as printed, in an empty directory (its model and data stand-ins
// at the paths it names; the sequence length shrunk for the cpu): runs/ is made for the run
// directory and the metrics, and what the README does next works (eval and export of best,
// into a directory whose parent is missing).
TEST(readme, the_run_toml_works_in_an_empty_directory) {
  const auto dir = temp_dir("readme_run_toml");
  const std::string readme = read_file(source_path("README.md"));
  const std::string open = "```toml\n# run.toml\n";
  const auto begin = readme.find(open);
  ASSERT_NE(begin, std::string::npos);
  const auto body = begin + std::string("```toml\n").size(), end = readme.find("```", body);
  std::ofstream(dir / "run.toml") << readme.substr(body, end - body);
  fs::create_directories(dir / "models");
  fs::copy(source_path("tests/golden/hf/llama-fp16-linear"), dir / "models" / "Llama-3.2-1B");
  fs::create_directories(dir / "data");
  write_corpus(dir / "data" / "corpus", 24, 80, 256);
  write_corpus(dir / "data" / "corpus-heldout", 4, 80, 256);
  const run_result trained = run_in(dir, "train --config-file run.toml --seq-len 64");
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  EXPECT_TRUE(fs::exists(dir / "runs" / "llama-64k" / "latest"));
  EXPECT_TRUE(fs::exists(dir / "runs" / "llama-64k" / "best"));
  EXPECT_FALSE(read_lines(dir / "runs" / "llama-64k.jsonl").empty());
  const run_result evaluated =
      run_in(dir, "eval --model runs/llama-64k/best --data data/corpus-heldout --seq-len 64 --cp 4");
  EXPECT_EQ(evaluated.exit_code, 0) << evaluated.output;
  const run_result exported = run_in(dir, "export runs/llama-64k/best out/llama-64k");
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  const std::string best = read_file(dir / "runs" / "llama-64k" / "best");
  EXPECT_NE(exported.output.find((dir / "runs" / "llama-64k" / best.substr(0, best.size() - 1)).string()),
            std::string::npos) << exported.output;
  EXPECT_NE(exported.output.find((dir / "out" / "llama-64k").string()), std::string::npos) << exported.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "llama-64k" / "config.json"));
  fs::remove_all(dir);
}

}  // namespace
