// `upipe train` as a user runs it: metrics, checkpoints, and refusals of bad input that
// never leave a checkpoint half-written.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "formats/safetensors.hpp"

#include "run_upipe.hpp"

namespace {

using upipe::testing::read_lines;
using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::run_upipe_env;
using upipe::testing::source_path;
using upipe::testing::temp_dir;
namespace fs = std::filesystem;

const std::string quick = "train --seq-len 64 --steps 6 --eval-samples 2 ";

TEST(train_cli, metrics_checkpoint_and_resume) {
  const auto dir = temp_dir("train_cli");
  const run_result first = run_upipe(quick + "--stop-after 3 --save " + (dir / "ckpt").string() + " --metrics-json " +
                                     (dir / "a.jsonl").string());
  ASSERT_EQ(first.exit_code, 0) << first.output;
  for (const char* f : {"config.json", "model.safetensors", "trainer/manifest.json", "trainer/run.toml",
                        "trainer/rank-00000-of-00004.safetensors", "trainer/rank-00003-of-00004.safetensors"})
    EXPECT_TRUE(fs::exists(dir / "ckpt" / "checkpoint-3" / f)) << f;
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

// The flag end to end (the host pool sized for it): the same steps with the optimizer and
// the weights in host memory.
TEST(train_cli, offloaded_training_logs_the_same_steps) {
  const auto dir = temp_dir("train_offload");
  std::vector<nlohmann::json> runs[2];
  for (int i = 0; i < 2; ++i) {
    const fs::path metrics = dir / ("m" + std::to_string(i) + ".jsonl");
    const run_result r = run_upipe(quick + "--stop-after 3 --batch 2 --zero 3 --metrics-json " + metrics.string() +
                                   (i == 1 ? " --offload optimizer,params" : ""));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    runs[i] = read_lines(metrics);
  }
  ASSERT_EQ(runs[1].size(), runs[0].size());
  for (std::size_t i = 0; i + 1 < runs[0].size(); ++i) {
    EXPECT_EQ(runs[1][i]["loss"], runs[0][i]["loss"]) << i;
    EXPECT_EQ(runs[1][i]["grad_norm"], runs[0][i]["grad_norm"]) << i;
  }
  EXPECT_GT(runs[1][0]["peak_bytes"]["weights_host"].get<std::size_t>(), 0u);
  fs::remove_all(dir);
}

// --phases: each step's phase table printed and in the metrics, the step-time model's
// prediction in the final record; overlapped or not (--offload-overlap), the same steps.
TEST(train_cli, phases_and_the_overlap_are_printed_and_logged) {
  const auto dir = temp_dir("train_phases");
  std::vector<nlohmann::json> runs[2];
  for (int i = 0; i < 2; ++i) {
    const fs::path metrics = dir / ("m" + std::to_string(i) + ".jsonl");
    const run_result r = run_upipe(quick + "--stop-after 2 --zero 3 --offload master,params --phases --metrics-json " +
                                   metrics.string() + " --offload-overlap " + (i == 0 ? "off" : "on"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("# phases of step 2:"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("the GPU's own work"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("upipe: phases: step 1, forward done"), std::string::npos) << r.output;
    runs[i] = read_lines(metrics);
  }
  ASSERT_EQ(runs[1].size(), 3u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(runs[1][i]["loss"], runs[0][i]["loss"]) << i;
    const nlohmann::json& p = runs[1][i]["phases"];
    EXPECT_GT(p["stages_ms"]["forward"].get<double>(), 0.0);
    EXPECT_LE(p["span_ms"].get<double>(), p["wall_ms"].get<double>());
    EXPECT_GT(p["side_copies"]["weights_in"]["bytes"].get<double>(), 0.0);
  }
  const nlohmann::json& model = runs[1].back()["step_seconds_model"];
  EXPECT_GT(model["total"].get<double>(), 0.0);
  EXPECT_GT(model["host_adamw"].get<double>(), 0.0);
  EXPECT_GE(model["host_adamw"].get<double>(), model["host_adamw_exposed"].get<double>());
  const run_result bad = run_upipe(quick + "--offload-overlap sometimes");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("--offload-overlap"), std::string::npos) << bad.output;
  fs::remove_all(dir);
}

// The data position a save records follows from its steps (batch x sequence length, here
// over a token file): a manifest whose position was changed is refused as damaged, and a
// resume of another batch continues from the saved position, saying so.
TEST(train_cli, a_data_position_that_does_not_follow_from_the_steps_is_refused) {
  const auto dir = temp_dir("train_position");
  {
    std::ofstream tokens(dir / "tokens.bin", std::ios::binary);
    for (std::uint32_t t = 0; t < 1000; ++t) {
      const std::uint32_t id = t % 200;
      tokens.write(reinterpret_cast<const char*>(&id), 4);
    }
  }
  const std::string data = "--data " + (dir / "tokens.bin").string() + " --batch 2 ";
  const std::string ckpt = (dir / "ckpt").string();
  ASSERT_EQ(run_upipe(quick + data + "--stop-after 3 --save " + ckpt).exit_code, 0);
  const fs::path manifest_path = dir / "ckpt" / "checkpoint-3" / "trainer" / "manifest.json";
  nlohmann::json manifest = nlohmann::json::parse(std::ifstream(manifest_path));
  EXPECT_EQ(manifest["data_position"], 3 * 2 * 64);  // steps x batch x tokens
  EXPECT_EQ(manifest["batch"], 2);
  // Another batch continues from the saved position, and a resume of that save follows on.
  const std::string one = quick + "--data " + (dir / "tokens.bin").string() + " --batch 1 ";
  const run_result other_batch = run_upipe(one + "--stop-after 4 --resume " + ckpt + " --save " + ckpt + "2");
  EXPECT_EQ(other_batch.exit_code, 0) << other_batch.output;
  EXPECT_NE(other_batch.output.find("this run takes --batch 1 --seq-len 64, continuing from its data position 384"),
            std::string::npos) << other_batch.output;
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(dir / "ckpt2" / "checkpoint-4" / "trainer" / "manifest.json"))["data_position"],
            448);
  const run_result chained = run_upipe(one + "--stop-after 5 --resume " + ckpt + "2");
  EXPECT_EQ(chained.exit_code, 0) << chained.output;
  manifest["data_position"] = 128;
  std::ofstream(manifest_path) << manifest.dump();
  const run_result edited = run_upipe(quick + data + "--resume " + ckpt);
  EXPECT_EQ(edited.exit_code, 2) << edited.output;
  EXPECT_NE(edited.output.find("is damaged: its data position 128 does not follow from its 3 steps of 2 x 64 tokens"),
            std::string::npos) << edited.output;
  fs::remove_all(dir);
}

TEST(train_cli, bad_input_is_refused_and_a_saved_checkpoint_survives) {
  const auto dir = temp_dir("train_bad");
  const fs::path ckpt = dir / "ckpt";
  ASSERT_EQ(run_upipe(quick + "--save " + ckpt.string()).exit_code, 0);
  const std::string before = [&] {
    std::ifstream in(ckpt / "checkpoint-6" / "model.safetensors", std::ios::binary);
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
      {"--data " + (dir / "small.bin").string() + " --seq-len 64", "fewer than one sequence of --seq-len 64"},
      {"--stop-after 9", "--stop-after 9 must lie between 1 and --steps 6"},
      {"--save-every 2", "needs --save DIR"},
      {"--resume " + ckpt.string() + " --init " + ckpt.string(), "contradict each other"},
      {"--model tiny-qwen3 --resume " + ckpt.string(), "differs from the run in"},
      {"--resume " + (dir / "nothing").string(), "holds no trainer/manifest.json"},
      {"--zero 1", "--zero 1 is not one of: 2, 3"},
      {"--attention ring --cp 4 --seq-len 60", "use --seq-len 64"},
      {"--seq-len 12", "too short for the passkey task"},
      {"--lr -1", "--lr -1 must lie in (0, 1]"},
      {"--save " + (dir / "other").string(), "is neither empty nor a run directory"},
      {"--save " + ckpt.string(), "holds another run's checkpoints"},
      {"--save /proc/no/such/dir", "cannot make the directory"},
      {"--comm nccl", "--comm nccl needs --backend cuda"},
      {"--comm carrier-pigeon", "--comm carrier-pigeon is not one of: auto, threads, nccl"},
      {"--comm-timeout 0", "--comm-timeout 0"},
      {"--memory-gib 0.00001", "no checkpoint policy fits S = 64 in an arena of 1e-05 GiB"},
      {"--cp 0", "--cp 0 must lie between 1 and"},
      {"--batch -5", "--batch -5 must be -1 (the run chooses) or lie between 1 and 65536"},
      {"--weight-decay -1", "--weight-decay -1 must be 0 or more"},
      {"--max-grad-norm nan", "--max-grad-norm: 'nan' is not a finite number"},
      {"--lr 1e300", "must lie in (0, 1]"},
      {"--resume ''", "--resume: an empty value names nothing"},
      {"--head-chunk 4294967300", "--head-chunk"},
  };
  for (const auto& [args, message] : cases) {
    const bool has_length = args.find("--seq-len") != std::string::npos;
    const std::string command = has_length ? "train --steps 6 --eval-samples 2 " + args : quick + args;
    const run_result r = run_upipe(command);
    EXPECT_EQ(r.exit_code, 2) << args;  // bad input, flags included
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
  }
  // A full disk while saving (a 64 KiB file-size limit): a clear error, the earlier
  // checkpoint untouched and no temporary directory left behind.
  const std::string limited = "sh -c 'ulimit -f 64; exec " + std::string(UPIPE_BINARY) +
                              " train --seq-len 64 --steps 2 --eval-samples 0 --overwrite --save " + ckpt.string() +
                              "' 2>&1";
  FILE* pipe = popen(limited.c_str(), "r");
  std::string output;
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
  const int status = pclose(pipe);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << output;
  EXPECT_NE(output.find("File too large"), std::string::npos) << output;
  std::ifstream after(ckpt / "checkpoint-6" / "model.safetensors", std::ios::binary);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(after)), std::istreambuf_iterator<char>()), before);
  for (const fs::path& where : {dir, ckpt})
    for (const auto& entry : fs::directory_iterator(where))
      EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos) << entry.path();
  fs::remove_all(dir);
}

}  // namespace

namespace {

// How long it takes is a benchmark's question (docs/benchmarks.md), not a test's: CI
// machines are shared and noisy.
TEST(train_cli, default_run_learns_the_passkey) {
  const auto dir = upipe::testing::temp_dir("train_default");
  const upipe::testing::run_result r =
      upipe::testing::run_upipe("train --metrics-json " + (dir / "m.jsonl").string() + " --save " + (dir / "ckpt").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
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
  // The saved model finds the key at every depth in eval --niah as train's retrieval
  // accuracy says (the fraction of key digits right); a random model does not.
  const upipe::testing::run_result niah = upipe::testing::run_upipe(
      "eval --niah --model " + (dir / "ckpt").string() + " --lengths 128 --depths 0,0.25,0.5,0.75,1 --samples 8 --cp 4 "
      "--json " + (dir / "niah.json").string());
  ASSERT_EQ(niah.exit_code, 0) << niah.output;
  std::ifstream in(dir / "niah.json");
  const auto trained = nlohmann::json::parse(in)["niah"];
  EXPECT_EQ(trained["needle"], "passkey");
  EXPECT_EQ(trained["cells"].size(), 5u);
  EXPECT_NEAR(trained["token_accuracy"].get<double>(), rows.back()["retrieval_accuracy"].get<double>(), 0.15);
  const upipe::testing::run_result random = upipe::testing::run_upipe(
      "eval --niah --lengths 128 --samples 8 --cp 4 --json " + (dir / "random.json").string());
  ASSERT_EQ(random.exit_code, 0) << random.output;
  std::ifstream in_random(dir / "random.json");
  EXPECT_LT(nlohmann::json::parse(in_random)["niah"]["token_accuracy"].get<double>(), 0.2);
  fs::remove_all(dir);
}

std::string hf_fixture(const char* name) { return source_path("tests/golden/hf/") + name; }

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

void write_tokens(const fs::path& path, std::uint32_t count, std::uint32_t vocab) {
  std::ofstream out(path, std::ios::binary);
  for (std::uint32_t t = 0; t < count; ++t) {
    const std::uint32_t id = (t * 37 + 5) % vocab;
    out.write(reinterpret_cast<const char*>(&id), 4);
  }
}

// A model directory in, a model directory out: the config kept but for what training
// changed, the tokenizer and generation config copied, the trainer state apart, the files
// a user added kept across saves, and an export without the trainer state.
TEST(train_cli, a_model_directory_in_and_out) {
  const auto dir = temp_dir("train_hf_dir");
  write_tokens(dir / "data.bin", 2048, 256);
  const std::string data = "train --data " + (dir / "data.bin").string() + " --seq-len 64 --steps 4 --eval-samples 0 ";
  const std::string common = data + "--cp 2 ";
  const fs::path out = dir / "out";
  const run_result first = run_upipe(common + "--model " + hf_fixture("llama-yarn-shards") + " --stop-after 2 --save " +
                                     out.string());
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const fs::path saved = out / "checkpoint-2";
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                        "generation_config.json", "trainer/manifest.json", "trainer/rank-00000-of-00002.safetensors",
                        "trainer/rank-00001-of-00002.safetensors"})
    EXPECT_TRUE(fs::exists(saved / f)) << f;
  EXPECT_FALSE(fs::exists(saved / "optimizer.safetensors"));
  const auto config = read_json(saved / "config.json");
  EXPECT_EQ(config["fixture_note"], "kept");
  EXPECT_EQ(config["bos_token_id"], 1);
  EXPECT_EQ(config["dtype"], "bfloat16");
  EXPECT_EQ(config["rope_parameters"]["rope_type"], "yarn");
  const auto manifest = read_json(saved / "trainer" / "manifest.json");
  EXPECT_EQ(manifest["ranks"], 2);
  EXPECT_EQ(manifest["step"], 2);
  // The weights are bf16, like the input's.
  EXPECT_EQ(upipe::safetensors_view((saved / "model.safetensors").string()).find("model.norm.weight")->dtype, "BF16");
  // A user's file survives the resumed run's save; the resume needs no --model.
  std::ofstream(out / "NOTES.md") << "mine";
  const run_result second = run_upipe(data + "--cp 4 --zero 3 --resume " + out.string() + " --save " + out.string());
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_TRUE(fs::exists(out / "NOTES.md"));
  EXPECT_EQ(read_json(out / "checkpoint-4" / "trainer" / "manifest.json")["step"], 4);
  EXPECT_EQ(read_json(out / "checkpoint-4" / "trainer" / "manifest.json")["ranks"], 4);
  EXPECT_EQ(read_json(out / "checkpoint-4" / "config.json")["fixture_note"], "kept");
  // Export: fp32, no trainer state.
  const run_result exported = run_upipe("export " + out.string() + " " + (dir / "exported").string());
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  EXPECT_FALSE(fs::exists(dir / "exported" / "trainer"));
  EXPECT_TRUE(fs::exists(dir / "exported" / "tokenizer.json"));
  EXPECT_EQ(read_json(dir / "exported" / "config.json")["dtype"], "float32");
  EXPECT_EQ(upipe::safetensors_view((dir / "exported" / "model.safetensors").string()).find("lm_head.weight")->dtype,
            "F32");
  // --init DIR alone takes DIR's model; --config DIR reads DIR/config.json; a sharded save.
  const run_result init = run_upipe(common + "--init " + hf_fixture("qwen3-tied") + " --save " + (dir / "q").string() +
                                    " --max-shard-size 100KB");
  ASSERT_EQ(init.exit_code, 0) << init.output;
  EXPECT_TRUE(fs::exists(dir / "q" / "checkpoint-4" / "model.safetensors.index.json"));
  EXPECT_EQ(read_json(dir / "q" / "checkpoint-4" / "config.json")["model_type"], "qwen3");
  EXPECT_EQ(run_upipe(common + "--config " + hf_fixture("llama-fp16-linear") + " --init " +
                      hf_fixture("llama-fp16-linear")).exit_code, 0);
  fs::remove_all(dir);
}

TEST(train_cli, bad_model_directories_and_flags_are_refused_before_step_one) {
  const auto dir = temp_dir("train_hf_bad");
  write_tokens(dir / "data.bin", 2048, 256);
  write_tokens(dir / "other.bin", 4096, 256);
  const std::string common = "train --seq-len 64 --steps 4 --cp 2 --eval-samples 0 ";
  const std::string data = "--data " + (dir / "data.bin").string() + " ";
  fs::copy(hf_fixture("llama-yarn-shards"), dir / "broken", fs::copy_options::recursive);
  fs::remove(dir / "broken" / "model-00003-of-00003.safetensors");
  fs::create_directories(dir / "empty");
  ASSERT_EQ(run_upipe(common + data + "--model " + hf_fixture("llama-yarn-shards") + " --stop-after 2 --save " +
                      (dir / "ckpt").string()).exit_code, 0);
  std::ofstream(dir / "int64.bin", std::ios::binary).write("\x05\0\0\0\0\0\0\0\x07\0\0\0\0\0\0\0", 16);
  const std::pair<std::string, std::string> cases[] = {
      {"--model " + (dir / "broken").string(), "model-00003-of-00003.safetensors, which is missing"},
      {"--model " + (dir / "empty").string(), "a directory without a config.json"},
      {"--model " + (dir / "nowhere").string(), "no such file"},
      {"--model tiny-llama --init " + hf_fixture("qwen3-tied"), "but tiny-llama needs [64, 64]"},
      {"--save-dtype fp16", "--save-dtype fp16 is not one of: bf16, fp32"},
      {"--max-shard-size 5XB", "--max-shard-size '5XB' is not a positive size"},
      {"--rope-scaling type=dynamic", "rope types are default, llama3, linear and yarn"},
      {"--offload disk", "--offload disk is not known: use none, optimizer, optimizer,params, master or master,params"},
      {"--optimizer-state 4bit", "--optimizer-state 4bit is not one of: fp32, bf16, 8bit"},
      {"--master-weights bf16", "--master-weights bf16 is not one of: fp32, bf16-kahan"},
      {"--grad-dtype fp16", "--grad-dtype fp16 is not one of: fp32, bf16"},
      {"--batch 2147483648", "lie between 1 and 65536"},
      {"--offload params", "use --offload optimizer,params"},
      {"--attention hybrid --ring 3", "--ring 3 must divide cp C = 2"},
      {"--attention upipe --ring 2", "--ring 2 applies to hybrid only"},
      {"--rope-scaling factor=4", "names no type"},
      {"--rope-scaling type=yarn,factor=x", "is not a number"},
      {"--rope-theta -5", "--rope-theta"},
      {"--save " + (dir / "data.bin").string(), "is not a directory"},
      {"--resume " + (dir / "ckpt").string() + " --data " + (dir / "other.bin").string(), "differs from the run in"},
  };
  for (const auto& [args, message] : cases) {
    const run_result r = run_upipe(common + (args.find("--data") == std::string::npos ? data : "") + args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
    EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << "trained before refusing: " << args;
  }
  const run_result long_run = run_upipe("train --seq-len 2048M --steps 1");
  EXPECT_EQ(long_run.exit_code, 2) << long_run.output;
  EXPECT_NE(long_run.output.find("beyond the longest this engine plans and runs"), std::string::npos) << long_run.output;
  const run_result wide = run_upipe("train --seq-len 64 --steps 4 --eval-samples 0 --data " + (dir / "int64.bin").string());
  EXPECT_EQ(wide.exit_code, 2) << wide.output;
  // The checkpoint the refused resume named is untouched.
  EXPECT_EQ(read_json(dir / "ckpt" / "checkpoint-2" / "trainer" / "manifest.json")["step"], 2);
  fs::remove_all(dir);
}

// upipe eval: forward only on a corpus, loss by position in buckets that count every target.
TEST(eval_cli, loss_by_position_over_a_corpus) {
  const auto dir = temp_dir("eval_cli");
  write_tokens(dir / "c.tokens", 1000, 256);
  {
    std::ofstream index(dir / "c.index", std::ios::binary);
    for (std::uint64_t o : {0ull, 300ull, 301ull, 760ull, 1000ull}) index.write(reinterpret_cast<const char*>(&o), 8);
    std::ofstream(dir / "c.json") << R"({"format": "upipe-tokens", "version": 1, "dtype": "uint32", "vocab_size": 256,
                                        "documents": 4, "tokens": 1000})";
  }
  const run_result r = run_upipe("eval --model " + hf_fixture("qwen3-tied") + " --data " + (dir / "c").string() +
                                 " --seq-len 128,512 --samples 2 --cp 2 --attention ring --json " + (dir / "e.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = read_json(dir / "e.json");
  ASSERT_EQ(j["lengths"].size(), 2u);
  for (const auto& l : j["lengths"]) {
    std::int64_t in_buckets = 0;
    for (const auto& b : l["by_position"]) in_buckets += b["targets"].get<std::int64_t>();
    EXPECT_EQ(in_buckets, l["targets"].get<std::int64_t>());
    EXPECT_GT(l["loss"].get<double>(), 0.0);
    EXPECT_EQ(l["peak_bytes"].value("grads", 0), 0);
  }
  EXPECT_EQ(j["packing"], "documents");
  EXPECT_EQ(run_upipe("eval --model tiny-llama --data " + (dir / "nothing").string()).exit_code, 2);
  if (std::system("python3 -c 'import matplotlib' >/dev/null 2>&1") == 0) {
    const run_result plot = run_upipe("report --out " + (dir / "plots").string() + " " + (dir / "e.json").string());
    EXPECT_EQ(plot.exit_code, 0) << plot.output;
    EXPECT_TRUE(fs::exists(dir / "plots" / "loss_by_position.svg"));
  }
  fs::remove_all(dir);
}

// eval --niah with the model tokenizer's own text: in the built-in haystack and in the
// user's data, a table and JSON of every depth x length cell.
TEST(eval_cli, needle_in_a_haystack_in_the_tokenizers_text) {
  if (std::system("python3 -c 'import tokenizers' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "Hugging Face tokenizers is not installed here";
  const auto dir = temp_dir("eval_niah");
  write_tokens(dir / "hay.bin", 4096, 256);
  for (const std::string haystack : {std::string(), " --data " + (dir / "hay.bin").string()}) {
    const run_result r = run_upipe("eval --niah --model " + hf_fixture("llama-yarn-shards") +
                                   " --lengths 256,512 --depths 0,0.5,1 --samples 2 --cp 2 --attention upipe --json " +
                                   (dir / "n.json").string() + haystack);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("exact match"), std::string::npos) << r.output;
    const auto j = read_json(dir / "n.json")["niah"];
    EXPECT_EQ(j["needle"], "text");
    EXPECT_EQ(j["haystack"], haystack.empty() ? "built-in" : (dir / "hay.bin").string());
    ASSERT_EQ(j["cells"].size(), 6u);
    for (const auto& c : j["cells"]) {
      EXPECT_EQ(c["samples"], 2);
      EXPECT_LT(c["mean_log_prob"].get<double>(), 0.0);
      EXPECT_GE(c["token_accuracy"].get<double>(), 0.0);
    }
  }
  if (std::system("python3 -c 'import matplotlib' >/dev/null 2>&1") == 0) {
    const run_result plot = run_upipe("report --out " + (dir / "plots").string() + " " + (dir / "n.json").string());
    EXPECT_EQ(plot.exit_code, 0) << plot.output;
    EXPECT_TRUE(fs::exists(dir / "plots" / "niah_heatmap.svg"));
    EXPECT_TRUE(fs::exists(dir / "plots" / "niah_heatmap.png"));
  }
  fs::remove_all(dir);
}

TEST(eval_cli, bad_needle_requests_are_refused_before_any_length_runs) {
  const auto dir = temp_dir("eval_niah_bad");
  write_tokens(dir / "hay.bin", 64, 256);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--niah --depths 0,1.5", "--depths entry '1.5'"},
      {"--niah --niah-vocab words", "--niah-vocab words is not known"},
      {"--niah --niah-vocab text", "needs the model directory's tokenizer.json"},
      {"--niah --lengths 8", "too short for the passkey task"},
      {"--niah --data " + (dir / "hay.bin").string(), "the passkey needle's haystack"},
      {"--niah --samples 0", "--samples = 0 must lie between 1 and"},
      {"--niah --model " + hf_fixture("llama-yarn-shards") + " --data " + (dir / "hay.bin").string() + " --lengths 1K",
       "fewer"},
  };
  for (const auto& [args, message] : cases) {
    const run_result r = run_upipe("eval " + args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
    EXPECT_EQ(r.output.find("sequences"), std::string::npos) << "ran before refusing: " << args;
  }
  fs::remove_all(dir);
}

// Ctrl-C stops a long evaluation at the next sequence: exit 130, no stack trace, the
// lengths finished so far in the JSON, marked interrupted.
TEST(eval_cli, ctrl_c_keeps_what_was_scored) {
  const auto dir = temp_dir("eval_interrupt");
  // 1024 windows of 1K tokens, each scored once: minutes of work, interrupted after seconds.
  write_tokens(dir / "data.bin", 1 << 20, 256);
  const std::string eval = std::string(UPIPE_BINARY) + " eval --model " + hf_fixture("llama-yarn-shards") + " --data " +
                           (dir / "data.bin").string() + " --seq-len 1K --samples 1024 --json " +
                           (dir / "e.json").string();
  const std::string script = eval + " >" + (dir / "out.txt").string() + " 2>&1 & p=$!; sleep 3; kill -INT $p; wait $p; "
                             "echo $? >" + (dir / "rc.txt").string();
  ASSERT_EQ(std::system(("sh -c '" + script + "'").c_str()), 0);
  std::ifstream rc(dir / "rc.txt");
  int code = 0;
  rc >> code;
  std::ifstream out_file(dir / "out.txt");
  const std::string out((std::istreambuf_iterator<char>(out_file)), std::istreambuf_iterator<char>());
  EXPECT_EQ(code, 130) << out;
  EXPECT_NE(out.find("interrupted at S 1024"), std::string::npos) << out;
  EXPECT_EQ(out.find("internal error"), std::string::npos) << out;
  const auto j = read_json(dir / "e.json");
  EXPECT_TRUE(j["interrupted"].get<bool>());
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
