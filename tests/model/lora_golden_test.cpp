// LoRA against PEFT: the loss and every adapter gradient of upipe's LoRA step equal those
// of PEFT on transformers (CPU) for a tiny Llama (Llama 3 RoPE, untied head), a tiny Qwen3
// (q/k norm, tied head) and each family of scripts/make_family_fixtures.py (Qwen2's biases
// and windows, Mistral's window, Phi-3's fused qkv_proj and gate_up_proj adapted whole,
// Gemma 3; a Qwen3-MoE on its attention's projections, scripts/make_moe_fixtures.py), r = 4
// and alpha = 7 on every projection, with a non-zero B, under cp = 1, 2 and
// 4 and every strategy: Ulysses, UPipe at every valid U (whose stages take B's rows of
// their own heads), ring and hybrid 2 x 2 (and 4 x 1). The reference files come from
// scripts/make_lora_fixtures.py and scripts/make_family_fixtures.py (tests/golden/lora/);
// the base weights are those of tests/golden/<model>/ (tests/golden/hf/<model>/ for the
// families). A frozen base has no gradient buffer and
// runs no weight-gradient GEMM: counted on the meta backend.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "model/adapter_files.hpp"
#include "model/model_step.hpp"
#include "../support/compare.hpp"
#include "formats/safetensors.hpp"

namespace upipe {
namespace {

struct lora_case {
  model_config config;
  host_weights weights, adapters;
  lora_config lora;
  std::vector<std::int32_t> tokens;
  double loss = 0;
  safetensors_file grads;  // PEFT's names
};

lora_case load(const std::string& name) {
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/lora/" + name;
  const bool tiny = name.rfind("tiny-", 0) == 0;  // a preset's fixture; the families' bases are HF directories
  const bool moe = name.find("moe") != std::string::npos;  // scripts/make_moe_fixtures.py's, in tests/golden/moe
  const std::string base = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/" + (tiny ? "" : moe ? "moe/" : "hf/") + name;
  lora_case c;
  c.config = read_hf_config(base + "/config.json");
  c.weights = read_weights(c.config, base);
  c.lora = read_adapter_config(dir, c.config).lora;
  c.adapters = read_adapter_weights(dir, c.config, c.lora);
  c.grads = read_safetensors(dir + "/grads.safetensors");
  std::ifstream in(dir + "/golden.json");
  const auto j = nlohmann::json::parse(in);
  c.tokens = j["tokens"].get<std::vector<std::int32_t>>();
  c.loss = j["loss"].get<double>();
  return c;
}

model_step_request request(const lora_case& c, strategy_kind kind, int cp, int chunk, int ring = 1) {
  model_step_request req;
  req.model = c.config;
  req.cp = {kind, cp, chunk, ring};
  req.options.mlp_tile = 5;              // tiles that do not divide the shard
  req.options.loss_chunk = 7;            // nor do the loss chunks
  req.options.attention_input_tile = 3;  // the attention backward norms its input 3 rows at a time
  req.options.lora = c.lora;
  req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  return req;
}

double worst_error = 0;  // over every case and tensor, for the summary line

void expect_matches(const lora_case& c, const model_step_request& req, const std::string& what) {
  SCOPED_TRACE(what);
  const model_step_result r = run_model_step(req, c.weights, c.tokens, c.adapters);
  const double loss_error = std::abs(r.loss - c.loss) / std::abs(c.loss);
  EXPECT_LT(loss_error, 1e-5) << "loss " << r.loss << " vs PEFT's " << c.loss;
  worst_error = std::max(worst_error, loss_error);
  ASSERT_EQ(r.grads.size(), c.grads.tensors.size());
  for (const auto& [file_name, entry] : c.grads.tensors) {
    const std::string name = file_name.substr(peft_name_prefix.size());
    const auto it = r.grads.find(name);
    ASSERT_NE(it, r.grads.end()) << name;
    const double error = testing::max_difference_over_max(it->second, entry.values);
    EXPECT_LT(error, 1e-5) << name;
    worst_error = std::max(worst_error, error);
  }
}

class lora_golden : public ::testing::TestWithParam<std::string> {};

TEST_P(lora_golden, adapter_and_fixture_agree_with_the_lora_flag) {
  const lora_case c = load(GetParam());
  // A mixture of experts adapts its attention: its experts are 3-D parameters PEFT adapts
  // through target_parameters only, and a target on the MLP is refused with that reason.
  const bool moe = c.config.sparse_layer_count() > 0;
  EXPECT_EQ(c.lora, parse_lora(moe ? "r=4,alpha=7,targets=q,k,v,o" : "r=4,alpha=7,targets=q,k,v,o,gate,up,down", c.config));
  if (moe) {
    EXPECT_EQ(parse_lora("r=4,alpha=7", c.config), c.lora);  // the default: every adaptable projection
    EXPECT_THROW(parse_lora("r=4,alpha=7,targets=q,gate", c.config), config_error);
  }
  // Every gradient is non-trivial: the fixture's B is not zero.
  for (const auto& [name, entry] : c.grads.tensors) {
    double largest = 0;
    for (float v : entry.values) largest = std::max(largest, static_cast<double>(std::abs(v)));
    EXPECT_GT(largest, 1e-6) << name;
  }
}

TEST_P(lora_golden, single_device_matches_peft) {
  const lora_case c = load(GetParam());
  expect_matches(c, request(c, strategy_kind::ulysses, 1, 0), "cp=1");
}

TEST_P(lora_golden, every_strategy_and_u_with_two_and_four_ranks) {
  const lora_case c = load(GetParam());
  for (int cp : {2, 4}) {
    expect_matches(c, request(c, strategy_kind::ulysses, cp, 0), "ulysses C=" + std::to_string(cp));
    expect_matches(c, request(c, strategy_kind::ring, cp, 0), "ring C=" + std::to_string(cp));
    for (int u : valid_head_chunks(c.config.num_heads, cp))
      expect_matches(c, request(c, strategy_kind::upipe, cp, u), "upipe C=" + std::to_string(cp) + " U=" + std::to_string(u));
  }
  for (int u : valid_head_chunks(c.config.num_heads, 2))
    expect_matches(c, request(c, strategy_kind::hybrid, 4, u, 2), "hybrid 2x2 U=" + std::to_string(u));
  expect_matches(c, request(c, strategy_kind::hybrid, 4, 0, 4), "hybrid 4x1");
  std::printf("lora golden %s: worst relative error against PEFT so far %.2e\n", GetParam().c_str(), worst_error);
}

// Sequence chunks carry the adapters too: fpdt and upipe with N = 2 and 3 chunks.
TEST_P(lora_golden, sequence_chunks_keep_the_adapters) {
  const lora_case c = load(GetParam());
  for (int cp : {1, 2})
    for (int n : {2, 3}) {
      model_step_request fpdt = request(c, strategy_kind::fpdt, cp, 0);
      fpdt.cp.seq_chunks = n;
      expect_matches(c, fpdt, "fpdt C=" + std::to_string(cp) + " N=" + std::to_string(n));
      model_step_request up = request(c, strategy_kind::upipe, cp, cp);
      up.cp.seq_chunks = n;
      expect_matches(c, up, "upipe C=" + std::to_string(cp) + " N=" + std::to_string(n));
    }
}

// Adapters on q and v only: k's projection trains nothing, so its backward norms no input
// tiles (the stage plans know it); every strategy gives the single device's gradients.
TEST_P(lora_golden, a_projection_that_trains_nothing_skips_its_input_tiles) {
  lora_case c = load(GetParam());
  // Where q, k and v are one module (Phi-3) they train together: o and down only there.
  const bool fused = c.config.traits().qkv_fused != nullptr;
  c.lora = parse_lora(fused ? "r=4,alpha=7,targets=o,down" : "r=4,alpha=7,targets=q,v", c.config);
  const std::string kept[2] = {fused ? "o_proj" : "q_proj", fused ? "down_proj" : "v_proj"};
  host_weights adapters;
  for (const auto& [name, values] : c.adapters)
    if (name.find(kept[0]) != std::string::npos || name.find(kept[1]) != std::string::npos) adapters[name] = values;
  c.adapters = adapters;
  const model_step_result one = run_model_step(request(c, strategy_kind::ulysses, 1, 0), c.weights, c.tokens, c.adapters);
  ASSERT_FALSE(one.grads.empty());
  std::vector<model_step_request> cases = {request(c, strategy_kind::ring, 2, 0), request(c, strategy_kind::upipe, 2, 2),
                                           request(c, strategy_kind::hybrid, 4, 2, 2)};
  cases.push_back(request(c, strategy_kind::fpdt, 2, 0));
  cases.back().cp.seq_chunks = 3;
  for (const model_step_request& req : cases) {
    SCOPED_TRACE(std::string(strategy_name(req.cp.strategy)) + " C=" + std::to_string(req.cp.cp));
    const model_step_result r = run_model_step(req, c.weights, c.tokens, c.adapters);
    EXPECT_LT(std::abs(r.loss - one.loss) / std::abs(one.loss), 1e-5);
    ASSERT_EQ(r.grads.size(), one.grads.size());
    for (const auto& [name, values] : one.grads)
      EXPECT_LT(testing::max_difference_over_max(r.grads.at(name), values), 1e-5) << name;
  }
}

TEST_P(lora_golden, checkpoint_policies_keep_the_adapters) {
  const lora_case c = load(GetParam());
  for (const char* policy : {"what=input+attention,every=2,where=host-pinned", "what=input,every=2,where=device"}) {
    model_step_request req = request(c, strategy_kind::upipe, 2, 2);
    req.options.policy = parse_checkpoint_policy(policy);
    expect_matches(c, req, policy);
  }
}

INSTANTIATE_TEST_SUITE_P(models, lora_golden,
                         ::testing::Values("tiny-llama", "tiny-qwen3", "qwen2-bias", "qwen2-window", "mistral-window",
                                           "phi3-fused", "gemma3-text", "qwen3-moe"),
                         [](const auto& info) {
  std::string name = info.param;
  for (char& ch : name)
    if (ch == '-') ch = '_';
  return name;
});

}  // namespace
}  // namespace upipe
