// Golden test of the hybrid linear-attention families (scripts/make_hybrid_fixtures.py,
// references by transformers in float64, bf16 directories as save_pretrained writes them):
// Qwen3.5 with three Gated DeltaNet layers below a gated full-attention one, the same with
// full attention alone, Qwen3.5-MoE and Qwen3-Next (fused in_proj_qkvz / in_proj_ba, a dense
// layer among sparse ones). upipe's fp32 loss and every gradient are within 1e-5 of
// transformers' (or twice transformers' own float32 error, where that is more: the packed
// documents' first tokens) under every CP strategy at C = 1, 2, 4 and 8 (every U, hybrid
// meshes, sequence chunks), with and without packed documents (each document then equals its
// own run: the state and the convolution start afresh at each), under the checkpoint policies.
// The multimodal Qwen3.5 directory (the Hub's layout) trains its text model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "formats/safetensors.hpp"
#include "model/adapter_files.hpp"
#include "model/hf_model.hpp"
#include "model/model_step.hpp"
#include "../support/compare.hpp"

namespace upipe {
namespace {

std::string fixture_dir(const std::string& name) {
  return std::string(UPIPE_SOURCE_DIR) + "/tests/golden/hybrid/" + name;
}

struct hybrid_case {
  model_config config;
  host_weights weights;
  std::vector<std::int32_t> tokens;
  double loss = 0;
  safetensors_file grads;
  std::vector<std::int64_t> documents;  // empty: one sequence
  // The bound on the loss's and every gradient's relative error: 1e-5, or twice what
  // transformers itself reaches in float32 where that is more (the fixture's float32_error:
  // at a document's first tokens the gated norm rescales small differences of rounded
  // products, which no fp32 engine computes closer).
  double bound = 1e-5;
};

double bound_of(const nlohmann::json& record) {
  UPIPE_CHECK(record.contains("float32_error"), "hybrid fixture without float32_error: rerun make_hybrid_fixtures.py");
  return std::max(1e-5, 2 * record["float32_error"].get<double>());
}

hybrid_case load(const std::string& name, bool documents) {
  const std::string dir = fixture_dir(name);
  hybrid_case g;
  g.config = read_hf_config(dir);
  g.weights = read_weights(g.config, dir);
  std::ifstream in(dir + "/golden.json");
  const auto j = nlohmann::json::parse(in);
  g.tokens = j["tokens"].get<std::vector<std::int32_t>>();
  g.loss = j["loss"].get<double>();
  if (!documents) {
    g.grads = read_safetensors(dir + "/grads.safetensors");
    g.bound = bound_of(j);
    return g;
  }
  std::ifstream docs(dir + "/documents.json");
  const auto d = nlohmann::json::parse(docs);
  g.loss = d["loss"].get<double>();
  g.documents = d["starts"].get<std::vector<std::int64_t>>();
  g.grads = read_safetensors(dir + "/documents_grads.safetensors");
  g.bound = bound_of(d);
  return g;
}

double worst_error = 0;

struct layout {
  strategy_kind kind;
  int cp, u, ring, chunks;
  std::string text() const {
    return std::string(strategy_name(kind)) + " C=" + std::to_string(cp) + " U=" + std::to_string(u) +
           " R=" + std::to_string(ring) + " N=" + std::to_string(chunks);
  }
};

model_step_request request(const hybrid_case& g, const layout& l) {
  model_step_request req;
  req.model = g.config;
  req.cp = {l.kind, l.cp, l.u, l.ring, l.chunks};
  req.options.mlp_tile = 37;  // tiles that do not divide the shard
  req.options.loss_chunk = 41;
  req.options.attention_input_tile = 11;
  req.options.router_aux = router_aux_loss::off;
  req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  req.documents = g.documents;
  return req;
}

void expect_matches(const hybrid_case& g, const model_step_request& req, const std::string& what) {
  SCOPED_TRACE(what);
  const model_step_result r = run_model_step(req, g.weights, g.tokens);
  const double loss_error = std::abs(r.loss - g.loss) / std::abs(g.loss);
  EXPECT_LT(loss_error, g.bound) << "loss " << r.loss << " vs " << g.loss;
  worst_error = std::max(worst_error, loss_error);
  ASSERT_EQ(r.grads.size(), g.grads.tensors.size());
  for (const auto& [name, entry] : g.grads.tensors) {
    const auto it = r.grads.find(name);
    ASSERT_NE(it, r.grads.end()) << name;
    const double error = it->second.size() == entry.values.size()
                             ? upipe::testing::max_difference_over_max(it->second, entry.values)
                             : INFINITY;
    EXPECT_LT(error, g.bound) << name;
    worst_error = std::max(worst_error, error);
  }
}

// Every strategy on C ranks: Ulysses, ring, UPipe at every U (U = C to U = H), FPDT and UPipe
// over sequence chunks, and the hybrid meshes of C ranks (rings of 2 and of C / 2).
std::vector<layout> every_layout(const model_config& m, int cp) {
  std::vector<layout> out = {{strategy_kind::ulysses, cp, 0, 1, 0}, {strategy_kind::ring, cp, 0, 1, 0},
                             {strategy_kind::fpdt, cp, 0, 1, 2}};
  for (int u : valid_head_chunks(m.num_heads, cp)) out.push_back({strategy_kind::upipe, cp, u, 1, 0});
  out.push_back({strategy_kind::upipe, cp, cp, 1, 3});
  for (int ring : {2, cp / 2}) {
    if (cp < 4 || (ring == cp / 2 && ring == 2)) continue;
    for (int u : valid_head_chunks(m.num_heads, cp / ring)) out.push_back({strategy_kind::hybrid, cp, u, ring, 0});
  }
  if (cp >= 2) out.push_back({strategy_kind::hybrid, cp, 0, cp, 0});  // a ring of groups of one
  return out;
}

struct hybrid_param {
  std::string name;
  bool documents;
};
std::string param_name(const ::testing::TestParamInfo<hybrid_param>& info) {
  std::string name = info.param.name + (info.param.documents ? "_documents" : "");
  for (char& c : name)
    if (c == '-') c = '_';
  return name;
}

class hybrid_golden : public ::testing::TestWithParam<hybrid_param> {};

TEST_P(hybrid_golden, single_device_matches_transformers) {
  const hybrid_case g = load(GetParam().name, GetParam().documents);
  expect_matches(g, request(g, {strategy_kind::ulysses, 1, 0, 1, 0}), "cp=1");
}

void expect_every_strategy(const hybrid_param& p, std::initializer_list<int> sizes) {
  const hybrid_case g = load(p.name, p.documents);
  worst_error = 0;
  for (int cp : sizes)
    for (const layout& l : every_layout(g.config, cp)) expect_matches(g, request(g, l), l.text());
  std::printf("hybrid golden %s%s: worst relative error of the loss and gradients, C = %d to %d: %.2e (bound %.2e)\n",
              p.name.c_str(), p.documents ? " (packed documents)" : "", *sizes.begin(), *(sizes.end() - 1), worst_error,
              g.bound);
}

TEST_P(hybrid_golden, every_strategy_on_two_and_four_ranks) { expect_every_strategy(GetParam(), {2, 4}); }

TEST_P(hybrid_golden, checkpoint_policies) {
  const hybrid_case g = load(GetParam().name, GetParam().documents);
  for (const char* policy : {"what=input,every=2,where=host-pinned", "what=input+attention,every=1,where=device",
                             "what=input+attention,every=2,where=host-pageable"})
    for (strategy_kind kind : {strategy_kind::upipe, strategy_kind::ring}) {
      model_step_request req = request(g, {kind, 2, 0, 1, 0});
      req.options.policy = parse_checkpoint_policy(policy);
      expect_matches(g, req, std::string(policy) + " " + std::string(strategy_name(kind)));
    }
}

INSTANTIATE_TEST_SUITE_P(families, hybrid_golden,
                         ::testing::Values(hybrid_param{"qwen3-5", false}, hybrid_param{"qwen3-5", true},
                                           hybrid_param{"qwen3-5-attention", false},
                                           hybrid_param{"qwen3-5-attention", true},
                                           hybrid_param{"qwen3-5-moe", false}, hybrid_param{"qwen3-5-moe", true},
                                           hybrid_param{"qwen3-next", false}, hybrid_param{"qwen3-next", true}),
                         param_name);

// Eight ranks (a rank's one value head in the head layouts, ring's sixteen halves) on the
// dense Qwen3.5 and on Qwen3-Next's fused projections, with packed documents: the other
// families' layers are the same code at C = 8 (kept to this to keep the suite fast).
class hybrid_golden_eight : public ::testing::TestWithParam<hybrid_param> {};
TEST_P(hybrid_golden_eight, every_strategy_on_eight_ranks) { expect_every_strategy(GetParam(), {8}); }
INSTANTIATE_TEST_SUITE_P(families, hybrid_golden_eight,
                         ::testing::Values(hybrid_param{"qwen3-5", false}, hybrid_param{"qwen3-5", true},
                                           hybrid_param{"qwen3-5-attention", true}, hybrid_param{"qwen3-next", true}),
                         param_name);

// LoRA against PEFT (tests/golden/lora/hybrid-<name>/, make_hybrid_fixtures.py): r 4, alpha 7
// with a non-zero B on every linear module of the dense Qwen3.5 (the gated q_proj's adapter
// covers its gate rows; the Gated DeltaNet's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and
// out_proj), on the attention's and the Gated DeltaNet's of the mixtures of experts (Qwen3-Next's
// fused in_proj_qkvz and in_proj_ba adapted whole): the loss and every adapter gradient
// within 1e-5 of PEFT's (or twice the base model's float32 error, where more) under every
// strategy at C = 1, 2 and 4.
class hybrid_lora : public ::testing::TestWithParam<std::string> {};

TEST_P(hybrid_lora, every_strategy_matches_peft) {
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/lora/hybrid-" + GetParam();
  hybrid_case g;
  g.config = read_hf_config(fixture_dir(GetParam()));
  g.weights = read_weights(g.config, fixture_dir(GetParam()));
  const lora_config lora = read_adapter_config(dir, g.config).lora;
  const host_weights adapters = read_adapter_weights(dir, g.config, lora);
  const safetensors_file peft = read_safetensors(dir + "/grads.safetensors");
  for (const auto& [name, entry] : peft.tensors) g.grads.tensors.emplace(name.substr(peft_name_prefix.size()), entry);
  std::ifstream in(dir + "/golden.json");
  const auto j = nlohmann::json::parse(in);
  g.tokens = j["tokens"].get<std::vector<std::int32_t>>();
  g.loss = j["loss"].get<double>();
  {
    std::ifstream base(fixture_dir(GetParam()) + "/golden.json");
    g.bound = bound_of(nlohmann::json::parse(base));  // the base model's float32 error
  }
  worst_error = 0;
  for (int cp : {1, 2, 4})
    for (const layout& l : every_layout(g.config, cp)) {
      model_step_request req = request(g, l);
      req.options.lora = lora;
      SCOPED_TRACE(l.text());
      const model_step_result r = run_model_step(req, g.weights, g.tokens, adapters);
      EXPECT_LT(std::abs(r.loss - g.loss) / std::abs(g.loss), g.bound) << "loss " << r.loss << " vs PEFT's " << g.loss;
      ASSERT_EQ(r.grads.size(), g.grads.tensors.size());
      for (const auto& [name, entry] : g.grads.tensors) {
        const auto it = r.grads.find(name);
        ASSERT_NE(it, r.grads.end()) << name;
        const double error = upipe::testing::max_difference_over_max(it->second, entry.values);
        EXPECT_LT(error, g.bound) << name;
        worst_error = std::max(worst_error, error);
      }
    }
  std::printf("hybrid lora %s: worst relative error against PEFT, C = 1 to 4: %.2e (bound %.2e)\n", GetParam().c_str(),
              worst_error, g.bound);
}

INSTANTIATE_TEST_SUITE_P(families, hybrid_lora,
                         ::testing::Values("qwen3-5", "qwen3-5-attention", "qwen3-5-moe", "qwen3-next"),
                         [](const auto& info) {
  std::string name = info.param;
  for (char& c : name)
    if (c == '-') c = '_';
  return name;
});

// The fixtures' configurations as transformers wrote them: every size from config.json.
TEST(hybrid_config, reads_what_transformers_wrote) {
  const model_config q = read_hf_config(fixture_dir("qwen3-5"));
  EXPECT_EQ(q.family, model_family::qwen3_5);
  EXPECT_TRUE(q.attention_gate);
  EXPECT_TRUE(q.qk_norm);
  EXPECT_EQ(q.traits().norm_offset, 1.0f);
  EXPECT_EQ(q.rope.rotary_dim, 4);  // 0.25 of head_dim 16
  EXPECT_EQ(q.linear.key_heads, 4);
  EXPECT_EQ(q.linear.value_heads, 8);
  EXPECT_EQ(q.linear.key_dim, 8);
  EXPECT_EQ(q.linear.value_dim, 12);
  EXPECT_EQ(q.linear.conv_kernel, 4);
  EXPECT_EQ(q.linear.layers, (std::vector<bool>{true, true, true, false}));
  EXPECT_EQ(q.linear_layer_count(), 3);
  const model_config next = read_hf_config(fixture_dir("qwen3-next"));
  EXPECT_EQ(next.family, model_family::qwen3_next);
  EXPECT_EQ(next.moe.experts, 8);
  EXPECT_TRUE(next.moe.normalize_top_k);
  EXPECT_EQ(next.moe.shared_width, 24);
  EXPECT_EQ(next.moe.sparse_layers, (std::vector<bool>{true, false, true, true}));
  const model_config moe = read_hf_config(fixture_dir("qwen3-5-moe"));
  EXPECT_EQ(moe.family, model_family::qwen3_5_moe);
  EXPECT_EQ(moe.sparse_layer_count(), 4);
  EXPECT_EQ(moe.intermediate_size, 16);  // no dense width: the experts' stands in
}

// Each stored tensor is read under its name and shape (the fused Qwen3-Next projections, the
// (C, 1, Kc) convolution), and nothing of the files is left unread.
TEST(hybrid_config, weights_under_transformers_names) {
  for (const char* name : {"qwen3-5", "qwen3-5-moe", "qwen3-next"}) {
    SCOPED_TRACE(name);
    const model_config c = read_hf_config(fixture_dir(name));
    const hf_model_files files(fixture_dir(name), c);
    EXPECT_TRUE(files.unused().empty()) << files.unused().front();
    std::ifstream in(fixture_dir(name) + "/golden.json");
    const auto stored = nlohmann::json::parse(in)["parameters"].get<std::vector<std::string>>();
    std::vector<std::string> ours;
    for (const parameter_spec& p : parameter_specs(c)) ours.push_back(p.name);
    std::sort(ours.begin(), ours.end());
    EXPECT_EQ(ours, stored);
  }
}

// The Hub's multimodal layout: the text model under model.language_model.*, the vision tower
// and the MTP head left out, read as the text model's names.
TEST(hybrid_config, multimodal_checkpoint_reads_its_text_model) {
  const std::string dir = fixture_dir("qwen3-5-vl");
  const model_config c = read_hf_config(dir);
  EXPECT_EQ(c.family, model_family::qwen3_5);
  EXPECT_EQ(c.linear_layer_count(), 3);
  EXPECT_FALSE(c.tie_embeddings);
  const hf_model_files files(dir, c);
  ASSERT_FALSE(files.unused().empty());
  for (const std::string& name : files.unused())
    EXPECT_TRUE(name.starts_with("model.visual.") || name.starts_with("mtp.")) << name;
  const host_weights w = read_weights(c, dir);
  EXPECT_EQ(w.count("model.layers.3.self_attn.q_proj.weight"), 1u);
  // Its loss is the multimodal class's on text (transformers' Qwen3_5ForConditionalGeneration).
  std::ifstream in(dir + "/golden.json");
  const auto j = nlohmann::json::parse(in);
  const auto tokens = j["tokens"].get<std::vector<std::int32_t>>();
  const double want = j["loss"].get<double>();
  for (const auto& [kind, cp] : {std::pair{strategy_kind::ulysses, 1}, std::pair{strategy_kind::ring, 4}}) {
    model_step_request req;
    req.model = c;
    req.cp = {kind, cp, 0};
    req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
    const model_step_result r = run_model_step(req, w, tokens);
    EXPECT_LT(std::abs(r.loss - want) / want, 1e-5) << strategy_name(kind) << " loss " << r.loss << " vs " << want;
  }
}

// What upipe refuses, each with the value and a valid alternative.
TEST(hybrid_config, refuses_what_it_does_not_run) {
  const std::string base = fixture_dir("qwen3-5") + "/config.json";
  std::ifstream in(base);
  const nlohmann::json good = nlohmann::json::parse(in);
  const auto refused = [&](const std::function<void(nlohmann::json&)>& edit, const std::string& needle) {
    nlohmann::json j = good;
    edit(j);
    const std::string path = ::testing::TempDir() + "/hybrid_config.json";
    std::ofstream(path) << j.dump();
    try {
      read_hf_config(path);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused([](nlohmann::json& j) { j["layer_types"][0] = "sliding_attention"; }, "linear_attention");
  refused([](nlohmann::json& j) { j["layer_types"].erase(0); }, "layer_types lists 3");
  refused([](nlohmann::json& j) { j["linear_num_value_heads"] = 6; }, "multiple of linear_num_key_heads");
  refused([](nlohmann::json& j) { j["attn_output_gate"] = false; }, "attn_output_gate");
  refused([](nlohmann::json& j) { j["rope_parameters"]["partial_rotary_factor"] = 0.1; }, "even");
  refused([](nlohmann::json& j) { j["linear_conv_kernel_dim"] = 0; }, "linear_conv_kernel_dim");
}

// Without layer_types, every full_attention_interval-th layer attends (Qwen3-Next's Hub config).
TEST(hybrid_config, interval_sets_the_layer_types) {
  std::ifstream in(fixture_dir("qwen3-next") + "/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  j.erase("layer_types");
  j["full_attention_interval"] = 2;
  j.erase("rope_parameters");
  j["rope_theta"] = 5000000;
  j["partial_rotary_factor"] = 0.5;
  const std::string path = ::testing::TempDir() + "/next_interval.json";
  std::ofstream(path) << j.dump();
  const model_config c = read_hf_config(path);
  EXPECT_EQ(c.linear.layers, (std::vector<bool>{true, false, true, false}));
  EXPECT_EQ(c.rope.theta, 5000000);
  EXPECT_EQ(c.rope.rotary_dim, 8);
}

}  // namespace
}  // namespace upipe
