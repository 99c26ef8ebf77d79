// The mixture-of-experts rows of the family table (model/family.hpp): config.json read as
// transformers' Qwen3MoeConfig, MixtralConfig and Qwen2MoeConfig read it (the fixtures of
// scripts/make_moe_fixtures.py and hand-written variants), the names their directories give
// each tensor, transformers 5's fused expert tensors read as the per-expert ones, the
// fields a written config.json keeps, and the configurations refused with their reason.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "formats/safetensors.hpp"
#include "model/hf_model.hpp"
#include "model/parameters.hpp"
#include "model/weights.hpp"
#include "config_variants.hpp"

namespace upipe {
namespace {

namespace fs = std::filesystem;

std::string fixture(const std::string& name) { return std::string(UPIPE_SOURCE_DIR) + "/tests/golden/moe/" + name; }

std::map<std::string, parameter_spec> specs_by_name(const model_config& c) {
  std::map<std::string, parameter_spec> out;
  for (const parameter_spec& p : parameter_specs(c)) out.emplace(p.name, p);
  return out;
}

class moe_files : public testing::config_variants {
 protected:
  moe_files() : config_variants(std::string(UPIPE_SOURCE_DIR) + "/tests/golden/moe") {}
};

TEST(moe_family, qwen3_moe_has_a_dense_layer_below_sparse_ones) {
  const model_config c = read_hf_config(fixture("qwen3-moe"));
  EXPECT_EQ(c.family, model_family::qwen3_moe);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.moe.experts, 8);
  EXPECT_EQ(c.moe.top_k, 2);
  EXPECT_EQ(c.moe.expert_width, 32);
  EXPECT_TRUE(c.moe.normalize_top_k);
  EXPECT_EQ(c.moe.sparse_layers, (std::vector<bool>{false, true, true}));
  EXPECT_DOUBLE_EQ(c.moe.router_aux_loss_coef, 0.25);
  const auto specs = specs_by_name(c);
  EXPECT_EQ(specs.at("model.layers.0.mlp.gate_proj.weight").shape, (std::vector<std::int64_t>{96, 64}));
  EXPECT_EQ(specs.at("model.layers.1.mlp.gate.weight").shape, (std::vector<std::int64_t>{8, 64}));
  EXPECT_EQ(specs.at("model.layers.1.mlp.experts.7.down_proj.weight").shape, (std::vector<std::int64_t>{64, 32}));
  EXPECT_EQ(specs.count("model.layers.1.mlp.gate_proj.weight"), 0u);
  // The FLOPs' matrices are the active ones: a token passes 2 of each sparse layer's 8 experts.
  std::int64_t matrices = 0;
  for (const parameter_spec& p : parameter_specs(c))
    if (p.kind == param_kind::matrix) matrices += p.shape[0] * p.shape[1];
  EXPECT_EQ(c.matmul_parameter_count(), matrices - 2 * (8 - 2) * 3 * 32 * 64);
}

TEST(moe_family, mixtral_names_its_experts_w1_w3_w2_and_always_renormalizes) {
  const model_config c = read_hf_config(fixture("mixtral"));
  EXPECT_EQ(c.family, model_family::mixtral);
  EXPECT_EQ(c.moe.experts, 8);
  EXPECT_EQ(c.moe.expert_width, 48);  // intermediate_size
  EXPECT_TRUE(c.moe.normalize_top_k);
  EXPECT_EQ(c.moe.sparse_layers, (std::vector<bool>{true, true}));
  EXPECT_EQ(router_name(c, 1), "model.layers.1.block_sparse_moe.gate.weight");
  EXPECT_EQ(expert_name(c, 0, 3, 1), "model.layers.0.block_sparse_moe.experts.3.w3.weight");
  EXPECT_EQ(fused_expert(c, 0, 3, 1).name, "model.layers.0.mlp.experts.gate_up_proj");
  EXPECT_EQ(fused_expert(c, 0, 3, 1).offset, (3 * 2 + 1) * 48 * 64);
}

TEST(moe_family, qwen2_moe_has_a_gated_shared_expert_and_qkv_biases) {
  const model_config c = read_hf_config(fixture("qwen2-moe"));
  EXPECT_EQ(c.family, model_family::qwen2_moe);
  EXPECT_EQ(c.moe.shared_width, 48);
  EXPECT_EQ(c.moe.top_k, 3);
  EXPECT_FALSE(c.moe.normalize_top_k);
  EXPECT_TRUE(c.moe.output_router_logits);
  EXPECT_EQ(c.biases, qkv_projections);
  const auto specs = specs_by_name(c);
  EXPECT_EQ(specs.at("model.layers.0.mlp.shared_expert_gate.weight").shape, (std::vector<std::int64_t>{1, 64}));
  EXPECT_EQ(specs.at("model.layers.0.mlp.shared_expert.up_proj.weight").shape, (std::vector<std::int64_t>{48, 64}));
  EXPECT_EQ(specs.count("model.layers.0.self_attn.o_proj.bias"), 0u);
}

TEST_F(moe_files, the_families_config_fields_as_transformers_reads_them) {
  // decoder_sparse_step 2: layers 1, 3, ... sparse, minus mlp_only_layers.
  const model_config step = read_hf_config(variant("qwen3-moe", {{"decoder_sparse_step", 2}, {"mlp_only_layers", nullptr}}));
  EXPECT_EQ(step.moe.sparse_layers, (std::vector<bool>{false, true, false}));
  // Qwen3MoeConfig writes num_local_experts; num_experts wins where both are given.
  const model_config alias = read_hf_config(variant("qwen3-moe", {{"num_local_experts", 6}, {"num_experts", nullptr}}));
  EXPECT_EQ(alias.moe.experts, 6);
  // Absent fields take the config class's defaults: Qwen3-MoE's 128 experts, top-8.
  const model_config defaults = read_hf_config(
      variant("qwen3-moe", {{"num_local_experts", nullptr}, {"num_experts", nullptr}, {"num_experts_per_tok", nullptr},
                            {"norm_topk_prob", nullptr}}));
  EXPECT_EQ(defaults.moe.experts, 128);
  EXPECT_EQ(defaults.moe.top_k, 8);
  EXPECT_FALSE(defaults.moe.normalize_top_k);
  // No experts: every layer dense, as transformers builds it.
  const model_config dense = read_hf_config(variant("qwen2-moe", {{"num_experts", 0}}));
  EXPECT_EQ(dense.sparse_layer_count(), 0);
  EXPECT_EQ(specs_by_name(dense).count("model.layers.0.mlp.gate_proj.weight"), 1u);
  // qkv_bias false drops Qwen2-MoE's biases.
  EXPECT_EQ(read_hf_config(variant("qwen2-moe", {{"qkv_bias", false}})).biases, 0);
}

TEST_F(moe_files, configurations_upipe_does_not_run_are_refused_by_name) {
  const auto refused = [&](const std::string& name, const nlohmann::json& changes, const std::string& says) {
    try {
      read_hf_config(variant(name, changes));
      ADD_FAILURE() << "accepted " << changes.dump();
    } catch (const config_error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused("qwen3-moe", {{"num_experts_per_tok", 9}}, "num_experts_per_tok = 9");
  refused("mixtral", {{"router_jitter_noise", 0.1}}, "router_jitter_noise");
  refused("qwen3-moe", {{"use_sliding_window", true}}, "use_sliding_window = true");
  refused("qwen2-moe", {{"use_sliding_window", true}, {"layer_types", nullptr}}, "without layer_types");
  refused("qwen3-moe", {{"decoder_sparse_step", 0}}, "decoder_sparse_step = 0");
  refused("qwen3-moe", {{"moe_intermediate_size", 0}}, "moe_intermediate_size = 0");
  EXPECT_THROW(read_hf_config(variant("qwen3-moe", {{"mlp_only_layers", "0"}})), io_error);
}

TEST_F(moe_files, a_written_config_reads_back_the_same_experts) {
  for (const char* name : {"qwen3-moe", "mixtral", "qwen2-moe"}) {
    SCOPED_TRACE(name);
    const model_config c = read_hf_config(fixture(name));
    const std::string path = (dir_ / (std::string(name) + "-written.json")).string();
    write_hf_config(c, path);
    const model_config back = read_hf_config(path);
    EXPECT_EQ(back.moe.experts, c.moe.experts);
    EXPECT_EQ(back.moe.top_k, c.moe.top_k);
    EXPECT_EQ(back.moe.expert_width, c.moe.expert_width);
    EXPECT_EQ(back.moe.shared_width, c.moe.shared_width);
    EXPECT_EQ(back.moe.normalize_top_k, c.moe.normalize_top_k);
    EXPECT_EQ(back.moe.sparse_layers, c.moe.sparse_layers);
    EXPECT_EQ(back.moe.output_router_logits, c.moe.output_router_logits);
    EXPECT_EQ(back.biases, c.biases);
  }
}

// transformers 5's layout: every expert of a layer in experts.gate_up_proj (E, 2I, D), gate
// rows then up rows, and experts.down_proj (E, D, I); read as the per-expert tensors.
TEST_F(moe_files, fused_expert_tensors_read_as_the_per_expert_ones) {
  const model_config c = read_hf_config(fixture("qwen3-moe"));
  const host_weights per_expert = read_weights(c, fixture("qwen3-moe"));
  const std::int64_t E = c.moe.experts, I = c.moe.expert_width, D = c.hidden_size;
  std::map<std::string, std::vector<float>> fused;
  for (const auto& [name, values] : per_expert)
    if (name.find(".experts.") == std::string::npos) fused[name] = values;
  for (int l = 1; l < 3; ++l) {
    std::vector<float> gate_up, down;
    for (int e = 0; e < E; ++e) {
      for (int role : {0, 1}) {
        const auto& v = per_expert.at(expert_name(c, l, e, role));
        gate_up.insert(gate_up.end(), v.begin(), v.end());
      }
      const auto& v = per_expert.at(expert_name(c, l, e, 2));
      down.insert(down.end(), v.begin(), v.end());
    }
    fused[layer_prefix(l) + "mlp.experts.gate_up_proj"] = gate_up;
    fused[layer_prefix(l) + "mlp.experts.down_proj"] = down;
  }
  std::vector<safetensors_tensor> tensors;
  for (const auto& [name, values] : fused) {
    std::vector<std::int64_t> shape;
    if (name.ends_with("gate_up_proj")) shape = {E, 2 * I, D};
    else if (name.ends_with("experts.down_proj")) shape = {E, D, I};
    else for (const parameter_spec& s : parameter_specs(c)) if (s.name == name) shape = s.shape;
    tensors.push_back({name, shape, values});
  }
  const fs::path dir = dir_ / "fused";
  fs::create_directories(dir);
  fs::copy_file(fixture("qwen3-moe") + "/config.json", dir / "config.json");
  write_safetensors((dir / "model.safetensors").string(), tensors);
  const hf_model_files files(dir.string(), c);
  EXPECT_TRUE(files.unused().empty());
  const host_weights read = read_all_weights(files, c);
  ASSERT_EQ(read.size(), per_expert.size());
  for (const auto& [name, values] : per_expert) EXPECT_EQ(read.at(name), values) << name;
  // A fused tensor of the wrong shape is refused by name.
  for (auto& t : tensors)
    if (t.name.ends_with("layers.2.mlp.experts.down_proj")) t.shape = {E, I, D};
  write_safetensors((dir / "model.safetensors").string(), tensors);
  EXPECT_THROW(hf_model_files(dir.string(), c), io_error);
}

}  // namespace
}  // namespace upipe
