// Chat fine-tuning as a user runs it: prepare-data on conversations (the binary's own copy
// of the Python helper and its modules), train on a mixture with a plain corpus, eval each.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "run_upipe.hpp"

namespace upipe::testing {
namespace {

namespace fs = std::filesystem;

std::vector<nlohmann::json> read_lines(const fs::path& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Conversations and documents, a few times over, so that a corpus holds several windows.
void write_rows(const fs::path& path, int copies) {
  std::ifstream in(source_path("tests/golden/hf/llama-chat/chat.jsonl"));
  std::stringstream rows;
  rows << in.rdbuf();
  std::ofstream out(path);
  for (int i = 0; i < copies; ++i) out << rows.str();
}

TEST(sft_cli, prepare_train_on_a_mixture_resume_and_evaluate_each_source) {
  if (std::system("python3 -c 'import tokenizers, jinja2' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "prepare-data needs tokenizers and jinja2 for python3";
  const fs::path dir = temp_dir("sft_cli");
  const std::string model = source_path("tests/golden/hf/llama-chat");
  write_rows(dir / "chat.jsonl", 6);
  std::ofstream(dir / "book.txt") << "The quick brown fox jumps over the lazy dog. " << std::string(400, 'a');
  run_result r = run_upipe("prepare-data --tokenizer " + model + " --out " + (dir / "chat").string() +
                           " --heldout-fraction 0.3 --seed 2 --workers 1 " + (dir / "chat.jsonl").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("in the loss mask"), std::string::npos) << r.output;
  r = run_upipe("prepare-data --tokenizer " + model + " --out " + (dir / "book").string() + " --workers 1 " +
                (dir / "book.txt").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string mixture = (dir / "chat").string() + ":0.75," + (dir / "book").string() + ":0.25";
  const std::string run = "train --model " + model + " --seq-len 64 --cp 2 --steps 8 --batch 2 --eval-samples 0 " +
                          "--checkpoint-policy what=input --lr 1e-3 ";
  const std::string train = run + "--data " + mixture + " ";
  r = run_upipe(train + "--metrics-json " + (dir / "m.jsonl").string() + " --eval-every 4 --eval-data " +
                (dir / "chat-heldout").string() + "," + (dir / "book").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto steps = read_lines(dir / "m.jsonl");
  ASSERT_EQ(steps.size(), 9u);  // 8 steps and the final record
  std::int64_t chat = 0, book = 0;
  for (std::size_t i = 0; i < 8; ++i) {
    const auto& d = steps[i]["data"];
    chat += d[(dir / "chat").string()]["sequences"].get<std::int64_t>();
    book += d[(dir / "book").string()]["sequences"].get<std::int64_t>();
    EXPECT_EQ(d[(dir / "chat").string()]["targets"].get<std::int64_t>() +
                  d[(dir / "book").string()]["targets"].get<std::int64_t>(),
              steps[i]["targets"].get<std::int64_t>());
  }
  EXPECT_EQ(chat, 12);
  EXPECT_EQ(book, 4);
  EXPECT_EQ(steps[3]["eval_losses"].size(), 2u);
  // Saved mid-way and resumed: the same losses.
  r = run_upipe(train + "--stop-after 3 --save " + (dir / "ck").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_upipe(train + "--resume " + (dir / "ck").string() + " --metrics-json " + (dir / "r.jsonl").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto resumed = read_lines(dir / "r.jsonl");
  ASSERT_EQ(resumed.size(), 6u);
  for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ(resumed[i]["loss"], steps[3 + i]["loss"]) << "step " << 4 + i;
  // Another weighting is another run.
  r = run_upipe(run + "--resume " + (dir / "ck").string() + " --data " + (dir / "chat").string() + ":0.5," +
                (dir / "book").string() + ":0.5");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("which has data.data = '" + mixture + "'"), std::string::npos) << r.output;
  // Each held-out source on its own; the chat's loss over the assistant turns alone.
  r = run_upipe("eval --model " + model + " --data " + (dir / "chat-heldout").string() + "," + (dir / "book").string() +
                " --seq-len 64 --samples 2 --cp 2 --json " + (dir / "e.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir / "e.json");
  const auto e = nlohmann::json::parse(in);
  ASSERT_EQ(e["lengths"].size(), 2u);
  EXPECT_EQ(e["lengths"][0]["data"], (dir / "chat-heldout").string());
  EXPECT_GT(e["lengths"][0]["masked"].get<std::int64_t>(), e["lengths"][0]["targets"].get<std::int64_t>());
  EXPECT_EQ(e["lengths"][1]["masked"].get<std::int64_t>(), 0);
  EXPECT_EQ(run_upipe("eval --model " + model + " --data " + mixture + " --seq-len 64").exit_code, 2);  // weights
  fs::remove_all(dir);
}

}  // namespace
}  // namespace upipe::testing
