// The masked loss on the CUDA backend against the cpu backend: the chat fixture's rows
// (tests/golden/hf/llama-chat) packed with their loss mask under several strategies on
// virtual ranks of one GPU, and transformers' loss on them; loss chunks whose every row is
// masked; training steps on a masked corpus following the cpu's.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "model/hf_model.hpp"
#include "model/model_step.hpp"
#include "train/trainer.hpp"

#include "../support/compare.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

struct chat_fixture {
  model_config config;
  host_weights weights;
  std::vector<std::int32_t> tokens;
  std::vector<std::int64_t> starts;
  std::vector<std::uint8_t> mask;
  double loss = 0;
};

chat_fixture read_chat() {
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/hf/llama-chat";
  chat_fixture c;
  c.config = read_hf_config(dir);
  c.weights = read_weights(c.config, dir);
  std::ifstream in(dir + "/chat.json");
  const auto j = nlohmann::json::parse(in);
  c.tokens = j["tokens"].get<std::vector<std::int32_t>>();
  c.starts = j["starts"].get<std::vector<std::int64_t>>();
  c.mask = j["mask"].get<std::vector<std::uint8_t>>();
  c.loss = j["loss"].get<double>();
  return c;
}

TEST(gpu_sft, masked_rows_match_the_cpu_backend_and_transformers) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const chat_fixture c = read_chat();
  model_step_request req;
  req.model = c.config;
  req.documents = c.starts;
  req.targets = c.mask;
  for (const std::int64_t chunk : {std::int64_t{0}, std::int64_t{16}}) {  // 16: chunks of prompt rows alone
    req.options.loss_chunk = chunk;
    for (const cp_settings cp : {cp_settings{strategy_kind::ulysses, 1, 0}, cp_settings{strategy_kind::upipe, 2, 2},
                                 cp_settings{strategy_kind::ring, 2, 0}, cp_settings{strategy_kind::hybrid, 4, 2, 2},
                                 cp_settings{strategy_kind::fpdt, 2, 0, 1, 3}}) {
      const std::string what = std::string(strategy_name(cp.strategy)) + " C=" + std::to_string(cp.cp) +
                               " loss chunk " + std::to_string(chunk);
      req.cp = cp;
      req.backend = backend_kind::cpu;
      req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
      const model_step_result cpu = run_model_step(req, c.weights, c.tokens);
      req.backend = backend_kind::cuda;
      req.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
      const model_step_result gpu = run_model_step(req, c.weights, c.tokens);
      std::printf("sft %s: loss cuda %.6f, cpu %.6f, transformers %.6f, %lld targets\n", what.c_str(), gpu.loss,
                  cpu.loss, c.loss, static_cast<long long>(gpu.counted));
      EXPECT_EQ(gpu.counted, cpu.counted) << what;
      EXPECT_LT(std::abs(cpu.loss - c.loss) / c.loss, 1e-5) << what;
      EXPECT_LT(std::abs(gpu.loss - c.loss) / c.loss, bf16_tolerance) << what;
      ASSERT_EQ(gpu.grads.size(), cpu.grads.size()) << what;
      for (const auto& [param, values] : cpu.grads)
        EXPECT_LT(testing::max_difference_over_max(gpu.grads.at(param), values), 5e-2) << what << " " << param;
    }
  }
}

// A corpus of prompts and answers at /tmp: document d of lengths[d] tokens, its last quarter
// the targets.
std::string write_masked_corpus(const std::filesystem::path& dir, const std::vector<std::int64_t>& lengths) {
  std::filesystem::create_directories(dir);
  const std::string prefix = (dir / "chat").string();
  std::ofstream tokens(prefix + ".tokens", std::ios::binary), index(prefix + ".index", std::ios::binary),
      mask(prefix + ".mask", std::ios::binary);
  std::uint64_t offset = 0;
  index.write(reinterpret_cast<const char*>(&offset), 8);
  for (std::size_t d = 0; d < lengths.size(); ++d) {
    for (std::int64_t i = 0; i < lengths[d]; ++i) {
      const auto id = static_cast<std::uint32_t>((31 * d + 7 * static_cast<std::size_t>(i)) % 250);
      tokens.write(reinterpret_cast<const char*>(&id), 4);
      mask.put(4 * i >= 3 * lengths[d] ? 1 : 0);
    }
    offset += static_cast<std::uint64_t>(lengths[d]);
    index.write(reinterpret_cast<const char*>(&offset), 8);
  }
  const nlohmann::json m = {{"format", "upipe-tokens"}, {"version", 1}, {"dtype", "uint32"}, {"vocab_size", 256},
                            {"documents", lengths.size()}, {"tokens", offset},
                            {"loss_mask", {{"format", "upipe-loss-mask"}, {"version", 1}, {"dtype", "uint8"},
                                           {"file", "chat.mask"}}}};
  std::ofstream(prefix + ".json") << m.dump();
  return prefix;
}

TEST(gpu_sft, training_steps_on_a_masked_corpus_follow_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const auto dir = std::filesystem::temp_directory_path() / ("upipe_gpu_sft_" + std::to_string(::getpid()));
  train_options o;
  o.model = preset("tiny-llama");
  o.data_path = write_masked_corpus(dir, {300, 90, 140, 60, 500, 80, 200, 120});
  o.seq_len = 256;
  o.batch = 2;
  o.cp = {strategy_kind::upipe, 2, 0};
  o.optim.lr = 1e-3;
  o.optim.total_steps = 4;
  o.seed = 3;
  o.eval_samples = 0;
  o.limits = {std::size_t{512} << 20, std::size_t{64} << 20};
  const train_summary cpu = train(o, nullptr);
  o.backend = backend_kind::cuda;
  o.limits = {std::size_t{2} << 30, std::size_t{64} << 20};
  const train_summary gpu = train(o, nullptr);
  ASSERT_EQ(cpu.steps.size(), gpu.steps.size());
  for (std::size_t i = 0; i < cpu.steps.size(); ++i) {
    std::printf("step %zu: loss cuda %.6f, cpu %.6f, %lld targets\n", i + 1, gpu.steps[i].loss, cpu.steps[i].loss,
                static_cast<long long>(gpu.steps[i].targets));
    EXPECT_EQ(gpu.steps[i].targets, cpu.steps[i].targets);
    EXPECT_LT(std::abs(gpu.steps[i].loss - cpu.steps[i].loss) / cpu.steps[i].loss, bf16_tolerance) << "step " << i + 1;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace upipe
