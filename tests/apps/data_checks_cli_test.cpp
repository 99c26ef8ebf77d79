// The data a command reads, checked the same way wherever it is read (train's --data and
// --eval-data, eval's --data), train's held-out loss equal to eval's on the same weights and
// data, eval --adapter equal to the merged model, and what a newcomer meets first: the
// start's short summary, a one-step run's lr, a suggested --seq-len that is accepted, a
// summary that skips a skipped step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_upipe.hpp"

namespace upipe::testing {
namespace {

namespace fs = std::filesystem;

void write_tokens(const fs::path& path, const std::vector<std::uint32_t>& ids) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
}

std::vector<std::uint32_t> some_ids(std::size_t n, std::uint32_t vocab, std::uint32_t seed) {
  std::vector<std::uint32_t> ids(n);
  std::uint32_t x = seed;
  for (auto& id : ids) {
    x = x * 1664525u + 1013904223u;
    id = (x >> 8) % vocab;
  }
  return ids;
}

// A corpus of documents (each `length` tokens) at PREFIX, as prepare-data writes it; with
// `mask`, a loss mask whose documents alternate between no target and every one.
std::string write_corpus(const fs::path& dir, const std::string& name, int documents, std::int64_t length,
                         std::uint32_t vocab, const std::string& tokenizer_sha256, bool mask = false) {
  const std::string prefix = (dir / name).string();
  const auto ids = some_ids(static_cast<std::size_t>(documents * length), vocab, 7);
  write_tokens(prefix + ".tokens", ids);
  std::ofstream index(prefix + ".index", std::ios::binary);
  for (std::uint64_t d = 0; d <= static_cast<std::uint64_t>(documents); ++d) {
    const std::uint64_t at = d * static_cast<std::uint64_t>(length);
    index.write(reinterpret_cast<const char*>(&at), 8);
  }
  nlohmann::json m = {{"format", "upipe-tokens"}, {"version", 1}, {"dtype", "uint32"}, {"vocab_size", vocab},
                      {"documents", documents}, {"tokens", ids.size()}, {"tokenizer_sha256", tokenizer_sha256},
                      {"tokenizer", "another/model"}};
  if (mask) {
    m["loss_mask"] = {{"format", "upipe-loss-mask"}, {"version", 1}, {"dtype", "uint8"}};
    std::ofstream bytes(prefix + ".mask", std::ios::binary);
    for (int d = 0; d < documents; ++d) bytes << std::string(static_cast<std::size_t>(length), d % 2 ? '\1' : '\0');
  }
  std::ofstream(prefix + ".json") << m.dump();
  return prefix;
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

const std::string tiny = source_path("tests/golden/tiny-llama");

TEST(data_checks_cli, trains_held_out_loss_equals_evals_and_a_short_set_is_scored_once) {
  const fs::path dir = temp_dir("held_out_equal");
  write_tokens(dir / "train.bin", some_ids(400, 256, 1));
  write_tokens(dir / "held.bin", some_ids(150, 256, 2));  // 2 whole windows of 64, not --eval-sequences 4
  const std::string run = "train --model " + tiny + " --data " + (dir / "train.bin").string() +
                          " --seq-len 64 --cp 2 --steps 1 --eval-samples 0 --eval-every 1 --eval-sequences 4 ";
  // Saved in fp32: the checkpoint holds the weights the held-out loss was measured on.
  run_result r = run_upipe(run + "--eval-data " + (dir / "held.bin").string() + " --save " + (dir / "ck").string() +
                           " --save-dtype fp32 --metrics-json " + (dir / "m.jsonl").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("2 whole window(s) of --seq-len 64, not --eval-sequences 4"), std::string::npos) << r.output;
  const auto steps = read_lines(dir / "m.jsonl");
  ASSERT_GE(steps.size(), 1u);
  const double held_out = steps[0]["eval_loss"].get<double>();
  r = run_upipe("eval --model " + tiny + " --weights " + (dir / "ck").string() + " --data " +
                (dir / "held.bin").string() + " --seq-len 64 --samples 4 --cp 2 --json " + (dir / "e.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double evaluated = read_json(dir / "e.json")["lengths"][0]["loss"].get<double>();
  EXPECT_NEAR(held_out, evaluated, 1e-9 * evaluated) << "train's held-out loss against eval's on the same weights";
  // A held-out set shorter than one sequence is refused as --data is, with a --seq-len that is taken.
  write_tokens(dir / "short.bin", some_ids(50, 256, 3));
  r = run_upipe(run + "--eval-data " + (dir / "short.bin").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--eval-data " + (dir / "short.bin").string() + " holds 50 tokens"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("or --seq-len 50"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

TEST(data_checks_cli, a_corpus_of_another_tokenizer_is_refused_wherever_it_is_read) {
  const fs::path dir = temp_dir("tokenizer_checks");
  const std::string model = source_path("tests/golden/hf/llama-chat");  // has tokenizer.json
  const std::string other = write_corpus(dir, "other", 4, 64, 256, std::string(64, '0'));
  write_tokens(dir / "train.bin", some_ids(400, 256, 1));
  const std::string refusal = "was tokenized with another/model";
  run_result r = run_upipe("eval --model " + model + " --data " + other + " --seq-len 64 --samples 1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--data " + other + " " + refusal), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--allow-tokenizer-mismatch"), std::string::npos) << r.output;
  r = run_upipe("eval --model " + model + " --data " + other + " --seq-len 64 --samples 1 --allow-tokenizer-mismatch");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("upipe: warning: --data " + other), std::string::npos) << r.output;
  const std::string train = "train --model " + model + " --seq-len 64 --steps 1 --eval-samples 0 ";
  r = run_upipe(train + "--data " + (dir / "train.bin").string() + " --eval-every 1 --eval-data " + other);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--eval-data " + other + " " + refusal), std::string::npos) << r.output;
  // A mixture: each source is checked.
  r = run_upipe(train + "--data " + (dir / "train.bin").string() + ":0.5," + other + ":0.5");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--data " + other + " " + refusal), std::string::npos) << r.output;
  fs::remove_all(dir);
}

TEST(data_checks_cli, eval_adapter_equals_the_merged_model) {
  const fs::path dir = temp_dir("eval_adapter");
  const std::string adapter = source_path("tests/golden/lora/tiny-llama");
  write_tokens(dir / "held.bin", some_ids(300, 256, 4));
  run_result r = run_upipe("export " + tiny + " " + (dir / "merged").string() + " --merge-adapter " + adapter);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string eval = "eval --data " + (dir / "held.bin").string() + " --seq-len 64 --samples 2 --cp 2 ";
  r = run_upipe(eval + "--model " + (dir / "merged").string() + " --json " + (dir / "merged.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_upipe(eval + "--model " + tiny + " --adapter " + adapter + " --json " + (dir / "adapter.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_upipe(eval + "--model " + tiny + " --json " + (dir / "base.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double merged = read_json(dir / "merged.json")["lengths"][0]["loss"].get<double>();
  const double unmerged = read_json(dir / "adapter.json")["lengths"][0]["loss"].get<double>();
  const double base = read_json(dir / "base.json")["lengths"][0]["loss"].get<double>();
  EXPECT_NEAR(unmerged, merged, 1e-4 * merged);
  EXPECT_GT(std::abs(unmerged - base), 1e-3 * base) << "the adapter changed nothing: the test would prove nothing";
  r = run_upipe(eval + "--model " + tiny + " --adapter " + tiny);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("holds no adapter_config.json"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

TEST(data_checks_cli, the_start_is_short_a_one_step_run_learns_and_a_suggested_seq_len_is_taken) {
  const fs::path dir = temp_dir("newcomer");
  write_tokens(dir / "odd.bin", some_ids(101, 256, 5));
  const std::string run = "train --model " + tiny + " --data " + (dir / "odd.bin").string() + " --cp 2 --steps 1 "
                          "--eval-samples 0 --metrics-json " + (dir / "m.jsonl").string() + " ";
  run_result r = run_upipe(run + "--seq-len 128");
  ASSERT_EQ(r.exit_code, 2) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("or --seq-len (\\d+)"))) << r.output;
  r = run_upipe(run + "--seq-len " + m[1].str());  // the suggestion is one training takes
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // A fine-tune of one step runs it at the peak lr, not at the schedule's floor of 0.
  const auto steps = read_lines(dir / "m.jsonl");
  EXPECT_DOUBLE_EQ(steps.at(0)["lr"].get<double>(), 2e-5);
  // A few lines before the first step: no configuration table unless asked for.
  EXPECT_EQ(r.output.find("[optimizer]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("every option: --print-config"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("# saves nothing (no --save DIR)"), std::string::npos) << r.output;
  r = run_upipe(run + "--seq-len 64 --print-config");
  EXPECT_NE(r.output.find("[optimizer]"), std::string::npos) << r.output;
  // --help: each option's fine-tune default beside the demo's.
  r = run_upipe("train --help");
  for (const char* shown : {"(fine-tune default 1)", "(fine-tune default 0 (--warmup-ratio instead))",
                            "fine-tune default 2e-5", "fine-tune default 0.03"})
    EXPECT_NE(r.output.find(shown), std::string::npos) << shown << "\n" << r.output;
  fs::remove_all(dir);
}

TEST(data_checks_cli, the_summary_skips_skipped_steps) {
  const fs::path dir = temp_dir("skipped_summary");
  const std::string corpus = write_corpus(dir, "chat", 8, 64, 256, "", true);  // half the documents no target
  const run_result r = run_upipe("train --model " + tiny + " --data " + corpus + " --seq-len 64 --cp 2 --steps 8 "
                                 "--eval-samples 0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string summary = r.output.substr(r.output.find("\nsummary: "));
  const std::string line = summary.substr(0, summary.find('\n', 1));
  EXPECT_NE(line.find("(4 skipped: no target, no loss)"), std::string::npos) << line;
  EXPECT_NE(line.find("mean of the last 4 measured: "), std::string::npos) << line;
  EXPECT_EQ(line.find("nan"), std::string::npos) << line;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace upipe::testing
