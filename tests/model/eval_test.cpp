// Forward-only evaluation: each target's loss equals transformers' per-position losses on
// the same tokens, under every strategy and C, for a whole sequence and for packed
// documents (scripts/make_hf_fixtures.py, scripts/make_document_golden.py).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <tuple>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "model/hf_model.hpp"
#include "model/model_step.hpp"

namespace upipe {
namespace {

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// max |a - b| / max |b| over the counted targets; both sides must mask the same ones.
double per_target_error(const std::vector<float>& got, const nlohmann::json& want) {
  EXPECT_EQ(got.size(), want.size());
  double diff = 0, ref = 0;
  for (std::size_t t = 0; t < std::min(got.size(), want.size()); ++t) {
    if (want[t].is_null()) {
      EXPECT_TRUE(std::isnan(got[t])) << "target " << t << " crosses a document boundary";
      continue;
    }
    diff = std::max(diff, std::abs(static_cast<double>(got[t]) - want[t].get<double>()));
    ref = std::max(ref, std::abs(want[t].get<double>()));
  }
  return diff / ref;
}

class eval_positions : public ::testing::TestWithParam<std::string> {};

TEST_P(eval_positions, every_target_equals_transformers) {
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/" + GetParam();
  const model_config config = read_hf_config(dir);
  const hf_model_files files(dir, config);
  const auto golden = read_json(dir + "/golden.json");
  const auto documents = read_json(dir + "/documents.json");
  eval_sequence whole{golden["tokens"].get<std::vector<std::int32_t>>(), {}, {}};
  eval_sequence packed{whole.tokens, documents["starts"].get<std::vector<std::int64_t>>(), {}};
  for (int cp : {1, 2, 4}) {
    std::vector<std::pair<strategy_kind, int>> cases = {{strategy_kind::ulysses, 0}, {strategy_kind::ring, 0}};
    for (int u : valid_head_chunks(config.num_heads, cp)) cases.push_back({strategy_kind::upipe, u});
    if (cp == 4) cases.push_back({strategy_kind::hybrid, 0});
    for (auto [kind, u] : cases) {
      SCOPED_TRACE(std::string(strategy_name(kind)) + " C=" + std::to_string(cp) + " U=" + std::to_string(u));
      model_step_request req;
      req.model = config;
      req.cp = {kind, cp, u, kind == strategy_kind::hybrid ? 2 : 1};
      req.options.mlp_tile = 5;
      req.options.loss_chunk = 7;
      req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
      const eval_result r = evaluate(req, files, {whole, packed});
      ASSERT_EQ(r.target_loss.size(), 2u);
      EXPECT_LT(per_target_error(r.target_loss[0], golden["per_position_loss"]), 1e-5);
      EXPECT_LT(per_target_error(r.target_loss[1], documents["per_target_loss"]), 1e-5);
      // Forward only: nothing of training's state exists.
      for (const char* tag : {"grads", "optimizer", "checkpoints_device"})
        EXPECT_EQ(r.peak_bytes.count(tag) ? r.peak_bytes.at(tag) : 0, 0u) << tag;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(models, eval_positions,
                         ::testing::Values("hf/llama-yarn-shards", "hf/qwen3-tied", "hf/llama-fp16-linear"),
                         [](const auto& info) {
                           std::string name = info.param.substr(3);
                           for (char& c : name)
                             if (c == '-') c = '_';
                           return name;
                         });

// A chat corpus's loss mask in evaluation: the loss of each target the mask keeps equals
// transformers' on its row alone, and every other is not scored (tests/golden/hf/llama-chat).
TEST(eval_masked, only_the_targets_of_the_loss_mask_are_scored) {
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/hf/llama-chat";
  const model_config config = read_hf_config(dir);
  const hf_model_files files(dir, config);
  const auto chat = read_json(dir + "/chat.json");
  eval_sequence packed{chat["tokens"].get<std::vector<std::int32_t>>(), chat["starts"].get<std::vector<std::int64_t>>(),
                       {}};
  packed.targets = chat["mask"].get<std::vector<std::uint8_t>>();
  for (auto [kind, cp] : {std::pair{strategy_kind::upipe, 2}, std::pair{strategy_kind::ring, 4}}) {
    SCOPED_TRACE(std::string(strategy_name(kind)) + " C=" + std::to_string(cp));
    model_step_request req;
    req.model = config;
    req.cp = {kind, cp, 0};
    req.options.loss_chunk = 7;
    req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
    const eval_result r = evaluate(req, files, {packed});
    EXPECT_LT(per_target_error(r.target_loss.at(0), chat["per_target_loss"]), 1e-5);
    std::int64_t scored = 0;
    for (const float loss : r.target_loss[0]) scored += std::isnan(loss) ? 0 : 1;
    EXPECT_EQ(scored, chat["targets"].get<std::int64_t>());
  }
}

model_step_request tiny_request(const model_config& config, strategy_kind kind, int cp, int u) {
  model_step_request req;
  req.model = config;
  req.cp = {kind, cp, u};
  req.options.mlp_tile = 5;
  req.options.loss_chunk = 7;
  req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  return req;
}

// The argmax at a position is the token whose loss there is smallest: tried as the next
// token, every id of the vocabulary in turn (cp 1), against the argmax every strategy
// reports (only the asked rows' logits leave the ranks).
TEST(eval_argmax, is_the_token_of_least_loss_under_every_strategy) {
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/hf/qwen3-tied";
  const model_config config = read_hf_config(dir);
  const hf_model_files files(dir, config);
  const auto tokens = read_json(dir + "/golden.json")["tokens"].get<std::vector<std::int32_t>>();
  const std::vector<std::int64_t> at = {0, 13, static_cast<std::int64_t>(tokens.size()) - 2};
  std::vector<std::int32_t> least;
  for (const std::int64_t t : at) {
    std::vector<eval_sequence> tries;
    for (std::int32_t v = 0; v < config.vocab_size; ++v) {
      eval_sequence s{tokens, {}, {}};
      s.tokens[static_cast<std::size_t>(t) + 1] = v;
      tries.push_back(std::move(s));
    }
    const eval_result r = evaluate(tiny_request(config, strategy_kind::ulysses, 1, 0), files, tries);
    std::int32_t best = 0;
    for (std::int32_t v = 1; v < config.vocab_size; ++v)
      if (r.target_loss[v][t] < r.target_loss[best][t]) best = v;
    least.push_back(best);
  }
  for (auto [kind, cp, u] : std::vector<std::tuple<strategy_kind, int, int>>{
           {strategy_kind::ulysses, 1, 0}, {strategy_kind::ulysses, 2, 0}, {strategy_kind::ring, 2, 0},
           {strategy_kind::upipe, 4, 0}}) {
    SCOPED_TRACE(std::string(strategy_name(kind)) + " C=" + std::to_string(cp));
    const eval_result r = evaluate(tiny_request(config, kind, cp, u), files, {eval_sequence{tokens, {}, at}});
    ASSERT_EQ(r.argmax.size(), 1u);
    EXPECT_EQ(r.argmax[0], least);
  }
}

// Asked to stop, every rank stops at the same sequence and the finished ones are kept.
TEST(eval_hooks, stop_ends_every_rank_at_one_sequence) {
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/hf/llama-yarn-shards";
  const model_config config = read_hf_config(dir);
  const hf_model_files files(dir, config);
  const auto tokens = read_json(dir + "/golden.json")["tokens"].get<std::vector<std::int32_t>>();
  const std::vector<eval_sequence> seqs(5, eval_sequence{tokens, {}, {}});
  std::vector<std::size_t> seen;
  std::atomic<bool> stop{false};
  const eval_result r = evaluate(tiny_request(config, strategy_kind::ring, 2, 0), files, seqs,
                                 {[&](std::size_t done) {
                                    seen.push_back(done);
                                    if (done == 2) stop = true;
                                  },
                                  [&] { return stop.load(); }});
  EXPECT_EQ(r.completed, 2u);
  EXPECT_EQ(seen, (std::vector<std::size_t>{1, 2}));
  EXPECT_EQ(r.target_loss[1], r.target_loss[0]);
  EXPECT_TRUE(r.target_loss[2].empty());
}

}  // namespace
}  // namespace upipe
