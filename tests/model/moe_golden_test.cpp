// Golden test of the mixture-of-experts families (scripts/make_moe_fixtures.py, references
// by transformers in float64, bf16 directories as save_pretrained writes them): a Qwen3-MoE
// with a dense layer below two sparse ones, a Mixtral, a Qwen2-MoE with a shared expert.
// upipe's fp32 loss and every gradient are within 1e-5 of transformers' under every CP
// strategy at C = 1, 2 and 4, without and with the load-balancing loss (summed over the CP
// group: the exact loss of the whole sequence), and with 203 tokens the layouts pad, so the
// loss must leave the padding's routing out.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "formats/safetensors.hpp"
#include "model/model_step.hpp"
#include "../support/compare.hpp"

namespace upipe {
namespace {

struct moe_case {
  model_config config;
  host_weights weights;
  std::vector<std::int32_t> tokens;
  double loss = 0, aux_loss = 0, loss_with_aux = 0;
  safetensors_file grads, aux_grads;
};

moe_case load(const std::string& name) {
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/moe/" + name;
  moe_case g;
  g.config = read_hf_config(dir);
  g.weights = read_weights(g.config, dir);
  g.grads = read_safetensors(dir + "/grads.safetensors");
  g.aux_grads = read_safetensors(dir + "/aux_grads.safetensors");
  std::ifstream in(dir + "/golden.json");
  const auto j = nlohmann::json::parse(in);
  g.tokens = j["tokens"].get<std::vector<std::int32_t>>();
  g.loss = j["loss"].get<double>();
  g.aux_loss = j["aux_loss"].get<double>();
  g.loss_with_aux = j["loss_with_aux"].get<double>();
  return g;
}

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() ? upipe::testing::max_difference_over_max(a, b) : INFINITY;
}

double worst_error = 0;

void expect_matches(const moe_case& g, const model_step_request& req, const std::string& what) {
  SCOPED_TRACE(what);
  const bool aux = req.options.router_aux == router_aux_loss::on;
  const model_step_result r = run_model_step(req, g.weights, g.tokens);
  const double want = aux ? g.loss_with_aux : g.loss;
  const double loss_error = std::abs(r.loss - want) / std::abs(want);
  EXPECT_LT(loss_error, 1e-5) << "loss " << r.loss << " vs " << want;
  if (aux) EXPECT_LT(std::abs(r.aux_loss - g.aux_loss) / g.aux_loss, 1e-5) << "aux loss " << r.aux_loss << " vs " << g.aux_loss;
  else EXPECT_EQ(r.aux_loss, 0.0);
  worst_error = std::max(worst_error, loss_error);
  const safetensors_file& grads = aux ? g.aux_grads : g.grads;
  ASSERT_EQ(r.grads.size(), grads.tensors.size());
  for (const auto& [name, entry] : grads.tensors) {
    auto it = r.grads.find(name);
    ASSERT_NE(it, r.grads.end()) << name;
    const double error = rel_error(it->second, entry.values);
    EXPECT_LT(error, 1e-5) << name;
    worst_error = std::max(worst_error, error);
  }
}

model_step_request request(const moe_case& g, strategy_kind kind, int cp, int chunk, bool aux) {
  model_step_request req;
  req.model = g.config;
  req.cp = {kind, cp, chunk};
  req.options.mlp_tile = 37;  // tiles that do not divide the shard
  req.options.loss_chunk = 41;
  req.options.router_aux = aux ? router_aux_loss::on : router_aux_loss::off;
  req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  return req;
}

struct moe_param {
  std::string name;
  bool aux;
};
std::string param_name(const ::testing::TestParamInfo<moe_param>& info) {
  std::string name = info.param.name + (info.param.aux ? "_with_aux" : "");
  for (char& c : name)
    if (c == '-') c = '_';
  return name;
}

class moe_golden : public ::testing::TestWithParam<moe_param> {};

TEST_P(moe_golden, single_device_matches_transformers) {
  const moe_case g = load(GetParam().name);
  expect_matches(g, request(g, strategy_kind::ulysses, 1, 0, GetParam().aux), "cp=1");
}

TEST_P(moe_golden, every_strategy_with_two_and_four_ranks) {
  const moe_case g = load(GetParam().name);
  const bool aux = GetParam().aux;
  worst_error = 0;
  for (int cp : {2, 4}) {
    expect_matches(g, request(g, strategy_kind::ulysses, cp, 0, aux), "ulysses C=" + std::to_string(cp));
    expect_matches(g, request(g, strategy_kind::ring, cp, 0, aux), "ring C=" + std::to_string(cp));
    for (int u : valid_head_chunks(g.config.num_heads, cp))
      expect_matches(g, request(g, strategy_kind::upipe, cp, u, aux),
                     "upipe C=" + std::to_string(cp) + " U=" + std::to_string(u));
    model_step_request fpdt = request(g, strategy_kind::fpdt, cp, 0, aux);
    fpdt.cp.seq_chunks = 2;
    expect_matches(g, fpdt, "fpdt N=2 C=" + std::to_string(cp));
  }
  model_step_request hybrid = request(g, strategy_kind::hybrid, 4, 0, aux);
  hybrid.cp.ring = 2;
  expect_matches(g, hybrid, "hybrid 2x2");
  std::printf("moe golden %s%s: worst relative error of the loss and gradients, C = 2 and 4: %.2e\n",
              GetParam().name.c_str(), aux ? " with the load-balancing loss" : "", worst_error);
}

// Recomputed layers route again as the forward did, and the load-balancing statistics are
// counted once per step whatever the policy recomputes.
TEST_P(moe_golden, checkpoint_policies) {
  const moe_case g = load(GetParam().name);
  for (const char* policy : {"what=input,every=2,where=host-pinned", "what=input+attention,every=1,where=device"}) {
    model_step_request req = request(g, strategy_kind::upipe, 2, 0, GetParam().aux);
    req.options.policy = parse_checkpoint_policy(policy);
    expect_matches(g, req, policy);
  }
}

INSTANTIATE_TEST_SUITE_P(families, moe_golden,
                         ::testing::Values(moe_param{"qwen3-moe", false}, moe_param{"qwen3-moe", true},
                                           moe_param{"mixtral", false}, moe_param{"mixtral", true},
                                           moe_param{"qwen2-moe", false}, moe_param{"qwen2-moe", true}),
                         param_name);

// transformers' rule: the load-balancing loss joins the loss where config.json's
// output_router_logits is true (the Qwen2-MoE fixture's), and not where it is false.
TEST(moe_config, router_logits_follow_the_config) {
  const moe_case qwen2 = load("qwen2-moe");
  const moe_case qwen3 = load("qwen3-moe");
  EXPECT_TRUE(qwen2.config.moe.output_router_logits);
  EXPECT_FALSE(qwen3.config.moe.output_router_logits);
  model_step_request req = request(qwen2, strategy_kind::ulysses, 2, 0, false);
  req.options.router_aux = router_aux_loss::config;
  const model_step_result r = run_model_step(req, qwen2.weights, qwen2.tokens);
  EXPECT_LT(std::abs(r.loss - qwen2.loss_with_aux) / qwen2.loss_with_aux, 1e-5);
  req = request(qwen3, strategy_kind::ulysses, 2, 0, false);
  req.options.router_aux = router_aux_loss::config;
  EXPECT_EQ(run_model_step(req, qwen3.weights, qwen3.tokens).aux_loss, 0.0);
}

}  // namespace
}  // namespace upipe
