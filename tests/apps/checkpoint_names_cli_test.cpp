// One way to name a checkpoint or an adapter (issue #47): a run directory (its latest),
// RUN/latest, RUN/best or a checkpoint directory, the same in every command that reads one;
// a LoRA run directory loads as its latest adapter in PEFT too (links at its root; PEFT's
// side is scripts/check_lora_adapter.py, which lora_cli runs where PEFT is installed). A resume
// keeps its schedule (the sequence and learning-rate warm-ups it derived), and a token file
// shorter than the run counts its passes and says once that the run is past its data.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_upipe.hpp"

namespace {

namespace fs = std::filesystem;
using upipe::testing::read_file;
using upipe::testing::read_lines;
using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::source_path;
using upipe::testing::temp_dir;

// `count` uint32 token ids below 200 into `path`.
void write_tokens(const fs::path& path, int count, int salt) {
  std::ofstream out(path, std::ios::binary);
  for (int t = 0; t < count; ++t) {
    const std::uint32_t id = static_cast<std::uint32_t>((t * 37 + salt * 11 + t / 7) % 200);
    out.write(reinterpret_cast<const char*>(&id), 4);
  }
}

run_result run_ok(const std::string& args) {
  const run_result r = run_upipe(args);
  EXPECT_EQ(r.exit_code, 0) << args << "\n" << r.output;
  return r;
}

double json_loss(const fs::path& file) { return nlohmann::json::parse(read_file(file))["loss"].get<double>(); }

std::vector<nlohmann::json> steps_of(const fs::path& metrics) {
  std::vector<nlohmann::json> steps;
  for (const auto& r : read_lines(metrics))
    if (r.contains("step")) steps.push_back(r);
  return steps;
}

// A LoRA run with checkpoints at 2 and 4 (best: the lower held-out loss of the two): each
// name of a checkpoint reads as that checkpoint in step, eval, export and train.
TEST(checkpoint_names, every_command_reads_a_run_directory_latest_best_or_a_checkpoint) {
  const fs::path dir = temp_dir("names");
  write_tokens(dir / "data.bin", 4096, 1);
  write_tokens(dir / "heldout.bin", 512, 2);
  const std::string base = source_path("tests/golden/tiny-llama"), run = (dir / "run").string();
  const std::string tokens = (dir / "heldout.bin").string();
  run_ok("train --model " + base + " --data " + (dir / "data.bin").string() + " --seq-len 64 --steps 4 --cp 2 "
         "--lr 1e-2 --lora r=4 --save " + run + " --save-every 2 --eval-every 2 --eval-data " + tokens +
         " --keep-best");
  const std::string best = read_file(dir / "run" / "best"), latest = read_file(dir / "run" / "latest");
  ASSERT_EQ(latest, "checkpoint-4\n");
  ASSERT_FALSE(best.empty());
  const auto step_loss = [&](const std::string& adapter, const std::string& name) {
    const fs::path json = dir / (name + ".json");
    run_ok("step --model " + base + " --adapter " + adapter + " --tokens " + tokens + " --seq-len 64 --cp 1 --json " +
           json.string());
    return json_loss(json);
  };
  const double at4 = step_loss(run + "/checkpoint-4", "c4"), at2 = step_loss(run + "/checkpoint-2", "c2");
  ASSERT_NE(at4, at2);
  EXPECT_EQ(step_loss(run, "run"), at4);
  EXPECT_EQ(step_loss(run + "/", "slash"), at4);
  EXPECT_EQ(step_loss(run + "/latest", "latest"), at4);
  EXPECT_EQ(step_loss(run + "/best", "best"), best == "checkpoint-4\n" ? at4 : at2);
  // eval and export take the same names.
  const auto eval_loss = [&](const std::string& adapter, const std::string& name) {
    const fs::path json = dir / (name + "-eval.json");
    run_ok("eval --model " + base + " --adapter " + adapter + " --data " + tokens + " --seq-len 64 --samples 1 "
           "--json " + json.string());
    return nlohmann::json::parse(read_file(json))["lengths"][0]["loss"].get<double>();
  };
  const double eval4 = eval_loss(run + "/checkpoint-4", "c4");
  EXPECT_NE(eval_loss(run + "/checkpoint-2", "c2"), eval4);
  EXPECT_EQ(eval_loss(run, "run"), eval4);
  EXPECT_EQ(eval_loss(run + "/latest", "latest"), eval4);
  run_ok("export " + base + " " + (dir / "merged").string() + " --merge-adapter " + run + "/latest");
  EXPECT_TRUE(fs::exists(dir / "merged" / "model.safetensors"));
  // train --init-adapter continues from it: step 1's loss is the adapted model's.
  const fs::path metrics = dir / "continue.jsonl";
  run_ok("train --model " + base + " --data " + tokens + " --seq-len 64 --steps 1 --cp 1 --eval-samples 0 "
         "--init-adapter " + run + " --metrics-json " + metrics.string());
  EXPECT_NEAR(steps_of(metrics)[0]["loss"].get<double>(), at4, 1e-6 * at4);
  // A run directory whose latest names no checkpoint is refused naming it.
  std::ofstream(dir / "run" / "latest") << "checkpoint-9\n";
  const run_result gone = run_upipe("step --model " + base + " --adapter " + run + " --seq-len 64");
  EXPECT_EQ(gone.exit_code, 2) << gone.output;
  EXPECT_NE(gone.output.find("names 'checkpoint-9', which is not a complete checkpoint"), std::string::npos)
      << gone.output;
  fs::remove_all(dir);
}

// The root of a LoRA run directory links to its latest checkpoint's adapter files, moved at
// every save; a full run saved over it (--overwrite) leaves no link behind.
TEST(checkpoint_names, a_lora_run_directory_links_its_latest_adapter_at_its_root) {
  const fs::path dir = temp_dir("links");
  const std::string run = (dir / "run").string();
  const std::string lora = "train --seq-len 64 --cp 2 --eval-samples 0 --lora r=4 --save-every 2 ";
  run_ok(lora + "--steps 6 --stop-after 4 --save " + run);
  for (const char* file : {"adapter_config.json", "adapter_model.safetensors"}) {
    ASSERT_TRUE(fs::is_symlink(dir / "run" / file)) << file;
    EXPECT_EQ(fs::read_symlink(dir / "run" / file), fs::path("checkpoint-4") / file);
    EXPECT_EQ(read_file(dir / "run" / file), read_file(dir / "run" / "checkpoint-4" / file));
  }
  run_ok(lora + "--steps 6 --resume " + run);
  EXPECT_EQ(fs::read_symlink(dir / "run" / "adapter_model.safetensors"),
            fs::path("checkpoint-6") / "adapter_model.safetensors");
  // A copy of the run directory links to its own checkpoints.
  fs::copy(dir / "run", dir / "copy", fs::copy_options::recursive | fs::copy_options::copy_symlinks);
  EXPECT_EQ(read_file(dir / "copy" / "adapter_model.safetensors"),
            read_file(dir / "copy" / "checkpoint-6" / "adapter_model.safetensors"));
  run_ok("train --seq-len 64 --cp 2 --eval-samples 0 --steps 2 --overwrite --save " + run);
  for (const char* file : {"adapter_config.json", "adapter_model.safetensors"})
    EXPECT_FALSE(fs::is_symlink(dir / "run" / file)) << file;
  fs::remove_all(dir);
}

// The passkey demo's sequence warm-up (9/10 of --steps) is derived once: resumed from step
// 20 with --steps 25 (whose own warm-up would be 22 steps), steps 21-22 stay at the full
// length, as in a run that was given that warm-up from the start, with its learning rates.
TEST(resume_schedule, more_steps_keep_the_sequence_warmup) {
  const fs::path dir = temp_dir("schedule");
  const std::string train = "train --cp 2 --eval-samples 0 --seq-len 64 ";
  run_ok(train + "--steps 20 --save " + (dir / "run").string() + " --metrics-json " + (dir / "m.jsonl").string());
  const run_result resumed = run_ok(train + "--steps 25 --resume " + (dir / "run").string());
  run_ok(train + "--steps 25 --seq-warmup 18 --metrics-json " + (dir / "whole.jsonl").string());
  const std::vector<nlohmann::json> ran = steps_of(dir / "m.jsonl"), whole = steps_of(dir / "whole.jsonl");
  ASSERT_EQ(ran.size(), 25u) << resumed.output;
  ASSERT_EQ(whole.size(), 25u);
  for (std::size_t i = 0; i < 25; ++i) EXPECT_EQ(ran[i]["seq_len"], whole[i]["seq_len"]) << "step " << i + 1;
  EXPECT_EQ(ran[17]["seq_len"], 18);  // step 18: the warm-up's length
  EXPECT_EQ(ran[20]["seq_len"], 64);  // step 21: the full length, not the warm-up's again
  for (std::size_t i = 20; i < 25; ++i) EXPECT_EQ(ran[i]["lr"], whole[i]["lr"]) << "step " << i + 1;
  fs::remove_all(dir);
}

// A warm-up given as a ratio of --steps is derived once too: a run stopped at step 2 of 40
// (warm-up 4) and resumed to 80 trains as a run of 80 with --warmup 4, bit for bit.
TEST(resume_schedule, more_steps_keep_the_learning_rate_warmup) {
  const fs::path dir = temp_dir("schedule_lr");
  const std::string train = "train --cp 2 --eval-samples 0 --seq-len 64 --seq-warmup 0 --lr 1e-3 ";
  run_ok(train + "--steps 40 --warmup-ratio 0.1 --stop-after 2 --save " + (dir / "run").string() +
         " --metrics-json " + (dir / "m.jsonl").string());
  run_ok(train + "--steps 80 --stop-after 8 --resume " + (dir / "run").string());
  run_ok(train + "--steps 80 --warmup 4 --stop-after 8 --metrics-json " + (dir / "whole.jsonl").string());
  const std::vector<nlohmann::json> ran = steps_of(dir / "m.jsonl"), whole = steps_of(dir / "whole.jsonl");
  ASSERT_EQ(ran.size(), 8u);
  ASSERT_EQ(whole.size(), 8u);
  for (std::size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(ran[i]["lr"], whole[i]["lr"]) << "step " << i + 1;
    EXPECT_EQ(ran[i]["loss"], whole[i]["loss"]) << "step " << i + 1;
  }
  EXPECT_DOUBLE_EQ(ran[2]["lr"].get<double>(), 1e-3 * 3 / 4);  // warm-up 4, not 8
  fs::remove_all(dir);
}

// A token file shorter than the run wraps around: the epoch counts on past 1.0, and the
// step that reads past its end says so once (a line, and past_end_of_data in its metrics).
TEST(data_epochs, a_short_token_file_counts_its_passes_and_says_once_that_it_repeats) {
  const fs::path dir = temp_dir("epochs");
  write_tokens(dir / "data.bin", 300, 5);  // 300 tokens; a step reads 2 x 64
  const std::string data = (dir / "data.bin").string();
  const std::string train = "train --cp 2 --eval-samples 0 --seq-len 64 --batch 2 --data " + data + " ";
  const run_result r = run_ok(train + "--steps 6 --stop-after 4 --save " + (dir / "run").string() +
                              " --metrics-json " + (dir / "m.jsonl").string());
  const run_result more = run_ok(train + "--steps 6 --resume " + (dir / "run").string());
  const std::vector<nlohmann::json> steps = steps_of(dir / "m.jsonl");
  ASSERT_EQ(steps.size(), 6u);
  for (std::size_t i = 0; i < steps.size(); ++i)
    EXPECT_DOUBLE_EQ(steps[i]["epoch"].get<double>(), static_cast<double>(i) * 128 / 300) << "step " << i + 1;
  // Step 3 reads tokens 256-383 of 300: past the end, said once.
  const std::string said = "step 3 reads past the end of --data " + data;
  EXPECT_NE(r.output.find(said), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("reads past the end", r.output.find(said) + said.size()), std::string::npos) << r.output;
  EXPECT_EQ(more.output.find("reads past the end"), std::string::npos) << more.output;
  for (std::size_t i = 0; i < steps.size(); ++i)
    EXPECT_EQ(steps[i].contains("past_end_of_data"), i == 2) << "step " << i + 1;
  EXPECT_EQ(steps[2]["past_end_of_data"], nlohmann::json::array({data}));
  fs::remove_all(dir);
}

// A save of an upipe before positions counted passes recorded a token file's position
// wrapped (below the file's size): it resumes, as the same place in the file; a position at
// another place is still refused as damaged.
TEST(data_epochs, a_wrapped_position_of_an_earlier_save_resumes) {
  const fs::path dir = temp_dir("epochs_wrapped");
  write_tokens(dir / "data.bin", 300, 5);
  const std::string train = "train --cp 2 --eval-samples 0 --seq-len 64 --batch 2 --data " +
                            (dir / "data.bin").string() + " ";
  run_ok(train + "--steps 6 --stop-after 4 --save " + (dir / "run").string());
  const fs::path manifest = dir / "run" / "checkpoint-4" / "trainer" / "manifest.json";
  nlohmann::json m = nlohmann::json::parse(read_file(manifest));
  ASSERT_EQ(m["data_position"], 4 * 128);
  m["data_position"] = 4 * 128 % 300;
  std::ofstream(manifest) << m.dump();
  run_ok(train + "--steps 6 --resume " + (dir / "run").string() + " --save " + (dir / "again").string());
  m["data_position"] = 4 * 128 % 300 + 1;
  std::ofstream(manifest) << m.dump();
  const run_result damaged = run_upipe(train + "--steps 6 --resume " + (dir / "run").string() + " --save " +
                                       (dir / "third").string());
  EXPECT_EQ(damaged.exit_code, 2) << damaged.output;
  EXPECT_NE(damaged.output.find("is damaged: its data position 213"), std::string::npos) << damaged.output;
  fs::remove_all(dir);
}

}  // namespace
