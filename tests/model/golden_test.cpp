// Golden test: upipe's loss and every weight gradient equal Hugging Face transformers'
// (fp32, CPU) for a tiny Llama (Llama 3 RoPE scaling, untied head) and a tiny Qwen3
// (q/k norm, tied head), under every CP strategy and checkpoint policy; the reference
// files were written by scripts/make_golden.py. And the same for model directories as
// save_pretrained writes them (scripts/make_hf_fixtures.py, tests/golden/hf/): a Llama
// with YaRN in three bf16 shards, a tied Qwen3 in one bf16 file, an fp16 Llama with
// linear scaling, read through the model directory as `--model DIR` reads it. And for each
// family of model/family.hpp (scripts/make_family_fixtures.py, references in float64, bf16
// directories): Qwen2 with q/k/v biases, Qwen2 with a window on its upper layer, Mistral
// with a window on every layer, Phi-3 with fused projections and a padding row, Gemma 3's
// text model (windows, two RoPEs, query_pre_attn_scalar, GeGLU, sandwich norms, a scaled
// tied embedding), within 1e-5 under every strategy.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>

#include <nlohmann/json.hpp>

#include "formats/safetensors.hpp"
#include "model/model_step.hpp"
#include "../support/compare.hpp"

namespace upipe {
namespace {

struct golden_case {
  model_config config;
  host_weights weights;
  std::vector<std::int32_t> tokens;
  double loss = 0;
  safetensors_file grads;
};

golden_case load(const std::string& name) {
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/" + name;
  golden_case g;
  g.config = read_hf_config(dir + "/config.json");
  g.weights = read_weights(g.config, dir);
  g.grads = read_safetensors(dir + "/grads.safetensors");
  std::ifstream in(dir + "/golden.json");
  const auto j = nlohmann::json::parse(in);
  g.tokens = j["tokens"].get<std::vector<std::int32_t>>();
  g.loss = j["loss"].get<double>();
  return g;
}

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() ? upipe::testing::max_difference_over_max(a, b) : INFINITY;
}

double worst_error = 0;  // over the cases of one test, for its summary line

void expect_matches(const golden_case& g, const model_step_request& req, const std::string& what) {
  SCOPED_TRACE(what);
  const model_step_result r = run_model_step(req, g.weights, g.tokens);
  const double loss_error = std::abs(r.loss - g.loss) / std::abs(g.loss);
  EXPECT_LT(loss_error, 1e-5) << "loss " << r.loss << " vs " << g.loss;
  worst_error = std::max(worst_error, loss_error);
  EXPECT_EQ(r.counted, static_cast<std::int64_t>(g.tokens.size()) - 1);
  ASSERT_EQ(r.grads.size(), g.grads.tensors.size());
  for (const auto& [name, entry] : g.grads.tensors) {
    auto it = r.grads.find(name);
    ASSERT_NE(it, r.grads.end()) << name;
    const double error = rel_error(it->second, entry.values);
    EXPECT_LT(error, 1e-5) << name;
    worst_error = std::max(worst_error, error);
  }
}

model_step_request request(const golden_case& g, strategy_kind kind, int cp, int chunk) {
  model_step_request req;
  req.model = g.config;
  req.cp = {kind, cp, chunk};
  req.options.mlp_tile = 5;    // tiles that do not divide the shard
  req.options.loss_chunk = 7;  // nor do the loss chunks
  req.options.attention_input_tile = 3;  // the attention backward norms its input 3 rows at a time
  req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  return req;
}

class golden : public ::testing::TestWithParam<std::string> {};

TEST_P(golden, single_device_matches_transformers) {
  const golden_case g = load(GetParam());
  expect_matches(g, request(g, strategy_kind::ulysses, 1, 0), "cp=1");
}

TEST_P(golden, every_strategy_with_two_and_four_ranks) {
  const golden_case g = load(GetParam());
  worst_error = 0;
  for (int cp : {2, 4}) {
    expect_matches(g, request(g, strategy_kind::ulysses, cp, 0), "ulysses C=" + std::to_string(cp));
    expect_matches(g, request(g, strategy_kind::ring, cp, 0), "ring C=" + std::to_string(cp));
    for (int u : valid_head_chunks(g.config.num_heads, cp))
      expect_matches(g, request(g, strategy_kind::upipe, cp, u), "upipe C=" + std::to_string(cp) + " U=" + std::to_string(u));
  }
  std::printf("golden %s: worst relative error of the loss and gradients, C = 2 and 4: %.2e\n", GetParam().c_str(),
              worst_error);
}

// Hybrid on four ranks: 2 x 2 (all-to-all in pairs, a ring of two) with Ulysses and every
// UPipe U inside, and 4 x 1 (a ring of four groups of one); packed documents on 2 x 2.
model_step_request hybrid(const golden_case& g, int ring, int u) {
  model_step_request req = request(g, strategy_kind::hybrid, 4, u);
  req.cp.ring = ring;
  return req;
}

TEST_P(golden, hybrid_on_two_by_two_and_four_by_one) {
  const golden_case g = load(GetParam());
  for (int u : valid_head_chunks(g.config.num_heads, 2))
    expect_matches(g, hybrid(g, 2, u), "hybrid 2x2 U=" + std::to_string(u));
  expect_matches(g, hybrid(g, 4, 0), "hybrid 4x1");
}

// Sequence chunks: fpdt and upipe (every U) with N = 2 and 3 (3 does not divide the shards),
// on one, two and four ranks, with the strided chunk layout and the host round trips.
TEST_P(golden, sequence_chunks_on_one_two_and_four_ranks) {
  const golden_case g = load(GetParam());
  for (int cp : {1, 2, 4})
    for (int n : {2, 3}) {
      model_step_request fpdt = request(g, strategy_kind::fpdt, cp, 0);
      fpdt.cp.seq_chunks = n;
      expect_matches(g, fpdt, "fpdt C=" + std::to_string(cp) + " N=" + std::to_string(n));
      for (int u : valid_head_chunks(g.config.num_heads, cp)) {
        model_step_request up = request(g, strategy_kind::upipe, cp, u);
        up.cp.seq_chunks = n;
        expect_matches(g, up, "upipe C=" + std::to_string(cp) + " U=" + std::to_string(u) + " N=" + std::to_string(n));
      }
    }
}

TEST_P(golden, every_checkpoint_policy) {
  const golden_case g = load(GetParam());
  for (const char* what : {"input", "input+attention"})
    for (int every : {1, 2})
      for (const char* where : {"device", "host-pinned", "host-pageable"}) {
        const std::string text = std::string("what=") + what + ",every=" + std::to_string(every) + ",where=" + where;
        for (auto kind : {strategy_kind::upipe, strategy_kind::ring}) {
          model_step_request req = request(g, kind, 2, 0);
          req.options.policy = parse_checkpoint_policy(text);
          expect_matches(g, req, text + " " + std::string(strategy_name(kind)));
        }
      }
}

// A packed sequence equals its documents taken one by one (scripts/make_document_golden.py:
// transformers on each of six documents of 9, 1, 23, 5, 20 and 4 tokens, summed): the
// attention stays inside each document, RoPE restarts with it, and the target that would
// cross a boundary is not counted.
TEST_P(golden, packed_documents_equal_the_documents_one_by_one) {
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/" + GetParam();
  if (!std::filesystem::exists(dir + "/documents.json")) GTEST_SKIP() << "no document reference for " << GetParam();
  golden_case g = load(GetParam());
  std::ifstream in(dir + "/documents.json");
  const auto j = nlohmann::json::parse(in);
  g.loss = j["loss"].get<double>();
  g.grads = read_safetensors(dir + "/documents_grads.safetensors");
  const auto starts = j["starts"].get<std::vector<std::int64_t>>();
  const auto targets = j["targets"].get<std::int64_t>();
  for (int cp : {1, 2, 4}) {
    std::vector<std::pair<strategy_kind, int>> cases = {{strategy_kind::ulysses, 0}, {strategy_kind::ring, 0}};
    for (int u : valid_head_chunks(g.config.num_heads, cp)) cases.push_back({strategy_kind::upipe, u});
    if (cp == 4) cases.push_back({strategy_kind::hybrid, 2});
    cases.push_back({strategy_kind::fpdt, 0});
    for (auto [kind, u] : cases) {
      model_step_request req = request(g, kind, cp, u);
      if (kind == strategy_kind::hybrid) req.cp.ring = 2;
      if (kind == strategy_kind::fpdt) req.cp.seq_chunks = 3;
      req.documents = starts;
      const std::string what = std::string(strategy_name(kind)) + " C=" + std::to_string(cp) + " U=" + std::to_string(u);
      SCOPED_TRACE(what);
      const model_step_result r = run_model_step(req, g.weights, g.tokens);
      EXPECT_EQ(r.counted, targets);
      EXPECT_LT(std::abs(r.loss - g.loss) / std::abs(g.loss), 1e-5) << "loss " << r.loss << " vs " << g.loss;
      for (const auto& [name, entry] : g.grads.tensors) {
        auto it = r.grads.find(name);
        ASSERT_NE(it, r.grads.end()) << name;
        EXPECT_LT(rel_error(it->second, entry.values), 1e-5) << name;
      }
    }
  }
  // Every checkpoint policy keeps the documents: the recomputed attention masks as the first.
  for (const char* policy : {"what=input+attention,every=2,where=host-pinned", "what=input,every=2,where=host-pageable"})
    for (auto kind : {strategy_kind::upipe, strategy_kind::ring}) {
      model_step_request req = request(g, kind, 2, 0);
      req.documents = starts;
      req.options.policy = parse_checkpoint_policy(policy);
      SCOPED_TRACE(std::string(policy) + " " + std::string(strategy_name(kind)));
      const model_step_result r = run_model_step(req, g.weights, g.tokens);
      EXPECT_LT(std::abs(r.loss - g.loss) / std::abs(g.loss), 1e-5);
      for (const auto& [name, entry] : g.grads.tensors) EXPECT_LT(rel_error(r.grads.at(name), entry.values), 1e-5) << name;
    }
}

// Chat fine-tuning (scripts/make_chat_fixtures.py, tests/golden/hf/llama-chat): two
// documents, three conversations rendered with a chat template (one with a tool call) and a
// prompt/completion pair, packed into one sequence with their loss mask, equal transformers
// run on each row alone with labels -100 where the mask is 0: the loss (the mean over every
// row's targets) and every gradient, under every strategy at C = 2 and 4.
TEST(golden_chat, masked_rows_packed_with_documents_equal_each_row_alone) {
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/hf/llama-chat";
  golden_case g;
  g.config = read_hf_config(dir + "/config.json");
  g.weights = read_weights(g.config, dir);
  g.grads = read_safetensors(dir + "/chat_grads.safetensors");
  std::ifstream in(dir + "/chat.json");
  const auto j = nlohmann::json::parse(in);
  g.tokens = j["tokens"].get<std::vector<std::int32_t>>();
  g.loss = j["loss"].get<double>();
  const auto starts = j["starts"].get<std::vector<std::int64_t>>();
  const auto mask = j["mask"].get<std::vector<std::uint8_t>>();
  const auto targets = j["targets"].get<std::int64_t>();
  ASSERT_LT(targets, static_cast<std::int64_t>(g.tokens.size()) / 2);  // most tokens are prompt
  for (int cp : {2, 4}) {
    std::vector<std::tuple<strategy_kind, int, int, int>> cases = {  // strategy, U, ring, sequence chunks
        {strategy_kind::ulysses, 0, 1, 0}, {strategy_kind::ring, 0, 1, 0}, {strategy_kind::fpdt, 0, 1, 3}};
    for (int u : valid_head_chunks(g.config.num_heads, cp)) {
      cases.push_back({strategy_kind::upipe, u, 1, 0});
      cases.push_back({strategy_kind::upipe, u, 1, 2});
    }
    if (cp == 4) {
      cases.push_back({strategy_kind::hybrid, 2, 2, 0});
      cases.push_back({strategy_kind::hybrid, 0, 4, 0});
    }
    for (auto [kind, u, ring, chunks] : cases) {
      model_step_request req = request(g, kind, cp, u);
      req.cp.ring = ring;
      req.cp.seq_chunks = chunks;
      req.documents = starts;
      req.targets = mask;
      const std::string what = std::string(strategy_name(kind)) + " C=" + std::to_string(cp) + " U=" +
                               std::to_string(u) + " R=" + std::to_string(ring) + " N=" + std::to_string(chunks);
      SCOPED_TRACE(what);
      const model_step_result r = run_model_step(req, g.weights, g.tokens);
      EXPECT_EQ(r.counted, targets);
      EXPECT_LT(std::abs(r.loss - g.loss) / std::abs(g.loss), 1e-5) << "loss " << r.loss << " vs " << g.loss;
      ASSERT_EQ(r.grads.size(), g.grads.tensors.size());
      for (const auto& [name, entry] : g.grads.tensors) EXPECT_LT(rel_error(r.grads.at(name), entry.values), 1e-5) << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(models, golden,
                         ::testing::Values("tiny-llama", "tiny-qwen3", "hf/llama-yarn-shards", "hf/qwen3-tied",
                                           "hf/llama-fp16-linear", "hf/qwen2-bias", "hf/qwen2-window",
                                           "hf/mistral-window", "hf/phi3-fused", "hf/gemma3-text"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name)
                             if (c == '-' || c == '/') c = '_';
                           return name;
                         });

}  // namespace
}  // namespace upipe
