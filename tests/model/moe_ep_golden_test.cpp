// Expert parallelism against transformers (scripts/make_moe_fixtures.py: references in
// float64 of bf16 directories save_pretrained wrote): every sparse layer's experts split over
// EP groups of E = 1, 2 and 4 ranks of a D x C mesh (D = E / C replicas where E > C, each
// running the sequence), tokens exchanged with their experts' ranks both ways, under every
// CP strategy at C = 1, 2 and 4: upipe's fp32 loss and every gradient within 1e-5 of
// transformers', without and with the load-balancing loss, on the 203 tokens as one sequence
// and as six packed documents. The fixtures are the three families and a Qwen3-MoE of
// other sizes (12 experts, top-3, hidden 48); a model whose experts E does not divide is
// refused before anything runs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "formats/safetensors.hpp"
#include "model/model_step.hpp"
#include "../support/compare.hpp"

namespace upipe {
namespace {

struct ep_case {
  std::string name;
  model_config config;
  host_weights weights;
  std::vector<std::int32_t> tokens;
  std::vector<std::int64_t> starts;  // the packed documents
  std::int64_t document_targets = 0;
  double loss = 0, aux_loss = 0, loss_with_aux = 0;
  double documents_loss = 0, documents_aux_loss = 0, documents_loss_with_aux = 0;
  safetensors_file grads, aux_grads, documents_grads, documents_aux_grads;
};

const ep_case& fixture(const std::string& name) {
  static std::map<std::string, ep_case> loaded;
  if (auto it = loaded.find(name); it != loaded.end()) return it->second;
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/moe/" + name;
  ep_case g;
  g.name = name;
  g.config = read_hf_config(dir);
  g.weights = read_weights(g.config, dir);
  g.grads = read_safetensors(dir + "/grads.safetensors");
  g.aux_grads = read_safetensors(dir + "/aux_grads.safetensors");
  g.documents_grads = read_safetensors(dir + "/documents_grads.safetensors");
  g.documents_aux_grads = read_safetensors(dir + "/documents_aux_grads.safetensors");
  std::ifstream in(dir + "/golden.json");
  const auto j = nlohmann::json::parse(in);
  g.tokens = j["tokens"].get<std::vector<std::int32_t>>();
  g.loss = j["loss"].get<double>();
  g.aux_loss = j["aux_loss"].get<double>();
  g.loss_with_aux = j["loss_with_aux"].get<double>();
  std::ifstream docs(dir + "/documents.json");
  const auto d = nlohmann::json::parse(docs);
  g.starts = d["starts"].get<std::vector<std::int64_t>>();
  g.document_targets = d["targets"].get<std::int64_t>();
  g.documents_loss = d["loss"].get<double>();
  g.documents_aux_loss = d["aux_loss"].get<double>();
  g.documents_loss_with_aux = d["loss_with_aux"].get<double>();
  return loaded.emplace(name, std::move(g)).first->second;
}

struct run_shape {
  strategy_kind kind = strategy_kind::upipe;
  int cp = 1, ep = 1;
  bool aux = false, documents = false;
};

std::string describe(const run_shape& s) {
  return std::string(strategy_name(s.kind)) + " C=" + std::to_string(s.cp) + " E=" + std::to_string(s.ep) +
         " D=" + std::to_string(std::max(1, s.ep / s.cp)) + (s.aux ? " with aux" : "") +
         (s.documents ? " documents" : "");
}

model_step_request request(const ep_case& g, const run_shape& s) {
  model_step_request req;
  req.model = g.config;
  req.cp = {s.kind, s.cp, 0};
  if (s.kind == strategy_kind::hybrid) req.cp.ring = 2;
  if (s.kind == strategy_kind::fpdt) req.cp.seq_chunks = 2;
  req.ep = s.ep;
  req.dp = std::max(1, s.ep / s.cp);
  req.options.mlp_tile = 37;  // tiles that do not divide the shard
  req.options.loss_chunk = 41;
  req.options.router_aux = s.aux ? router_aux_loss::on : router_aux_loss::off;
  req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  if (s.documents) req.documents = g.starts;
  return req;
}

double worst = 0;

void expect_matches(const ep_case& g, const run_shape& s) {
  SCOPED_TRACE(g.name + " " + describe(s));
  const model_step_result r = run_model_step(request(g, s), g.weights, g.tokens);
  const double want = s.documents ? (s.aux ? g.documents_loss_with_aux : g.documents_loss)
                                  : (s.aux ? g.loss_with_aux : g.loss);
  const double want_aux = s.documents ? g.documents_aux_loss : g.aux_loss;
  const double loss_error = std::abs(r.loss - want) / std::abs(want);
  EXPECT_LT(loss_error, 1e-5) << "loss " << r.loss << " vs " << want;
  if (s.aux) EXPECT_LT(std::abs(r.aux_loss - want_aux) / want_aux, 1e-5) << r.aux_loss << " vs " << want_aux;
  else EXPECT_EQ(r.aux_loss, 0.0);
  if (s.documents) EXPECT_EQ(r.counted, g.document_targets);
  worst = std::max(worst, loss_error);
  const safetensors_file& grads =
      s.documents ? (s.aux ? g.documents_aux_grads : g.documents_grads) : (s.aux ? g.aux_grads : g.grads);
  ASSERT_EQ(r.grads.size(), grads.tensors.size());
  for (const auto& [name, entry] : grads.tensors) {
    auto it = r.grads.find(name);
    ASSERT_NE(it, r.grads.end()) << name;
    const double error = upipe::testing::max_difference_over_max(it->second, entry.values);
    EXPECT_LT(error, 1e-5) << name;
    worst = std::max(worst, error);
  }
}

// Every strategy the CP group size runs: ulysses, ring, upipe (its default U), fpdt (two
// sequence chunks) and, at C = 4, hybrid's 2 x 2; one rank attends alone whatever the
// strategy (ulysses).
std::vector<strategy_kind> strategies(int cp) {
  if (cp == 1) return {strategy_kind::ulysses};
  std::vector<strategy_kind> out{strategy_kind::ulysses, strategy_kind::ring, strategy_kind::upipe, strategy_kind::fpdt};
  if (cp == 4) out.push_back(strategy_kind::hybrid);
  return out;
}

struct ep_param {
  std::string name;
  bool aux;
};
std::string param_name(const ::testing::TestParamInfo<ep_param>& info) {
  std::string name = info.param.name + (info.param.aux ? "_with_aux" : "");
  for (char& c : name)
    if (c == '-') c = '_';
  return name;
}

class moe_ep_golden : public ::testing::TestWithParam<ep_param> {};

TEST_P(moe_ep_golden, every_strategy_at_c_1_2_4_and_e_1_2_4) {
  const ep_case& g = fixture(GetParam().name);
  worst = 0;
  for (int cp : {1, 2, 4})
    for (int ep : {1, 2, 4}) {
      if (g.config.moe.experts % ep != 0) continue;
      for (strategy_kind kind : strategies(cp)) expect_matches(g, {kind, cp, ep, GetParam().aux, false});
    }
  std::printf("moe ep golden %s%s: worst relative error of the loss and gradients: %.2e\n", g.name.c_str(),
              GetParam().aux ? " with the load-balancing loss" : "", worst);
}

// Packed documents: attention stays inside each, and the load-balancing loss counts every
// token of the sequence, whichever rank routes it and wherever its experts lie.
TEST_P(moe_ep_golden, packed_documents) {
  const ep_case& g = fixture(GetParam().name);
  worst = 0;
  for (int cp : {1, 2, 4})
    for (int ep : {1, 2, 4}) {
      if (g.config.moe.experts % ep != 0) continue;
      for (strategy_kind kind : {strategy_kind::upipe, strategy_kind::ring})
        expect_matches(g, {kind, cp, ep, GetParam().aux, true});
    }
  expect_matches(g, {strategy_kind::hybrid, 4, 2, GetParam().aux, true});
  expect_matches(g, {strategy_kind::fpdt, 2, 2, GetParam().aux, true});
  std::printf("moe ep golden %s%s, packed documents: worst relative error: %.2e\n", g.name.c_str(),
              GetParam().aux ? " with the load-balancing loss" : "", worst);
}

INSTANTIATE_TEST_SUITE_P(families, moe_ep_golden,
                         ::testing::Values(ep_param{"qwen3-moe", false}, ep_param{"qwen3-moe", true},
                                           ep_param{"mixtral", false}, ep_param{"mixtral", true},
                                           ep_param{"qwen2-moe", false}, ep_param{"qwen2-moe", true},
                                           ep_param{"qwen3-moe-12", false}, ep_param{"qwen3-moe-12", true}),
                         param_name);

// An E that does not divide the model's experts (Qwen2-MoE's 6 over 4 ranks) is refused
// before any rank runs, naming the rule.
TEST(moe_ep, an_ep_that_does_not_divide_the_experts_is_refused) {
  const ep_case& g = fixture("qwen2-moe");
  try {
    run_model_step(request(g, {strategy_kind::upipe, 4, 4, false, false}), g.weights, g.tokens);
    ADD_FAILURE() << "--ep 4 over 6 experts ran";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("--ep 4 must divide the model's 6 experts"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace upipe
