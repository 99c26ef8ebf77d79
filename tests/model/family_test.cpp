// The family table (model/family.hpp): each family's config.json read as transformers reads
// it (the fixtures of scripts/make_family_fixtures.py and hand-written variants of their
// configs), the parameters and kinds it implies, written configs that read back the same,
// the windows' attention FLOPs, and LoRA on Phi-3's fused modules.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "model/lora.hpp"
#include "model/model_step.hpp"
#include "model/parameters.hpp"
#include "model/weights.hpp"
#include "config_variants.hpp"

namespace upipe {
namespace {

namespace fs = std::filesystem;

std::string fixture(const std::string& name) { return std::string(UPIPE_SOURCE_DIR) + "/tests/golden/hf/" + name; }

std::map<std::string, parameter_spec> specs_by_name(const model_config& c) {
  std::map<std::string, parameter_spec> out;
  for (const parameter_spec& p : parameter_specs(c)) out.emplace(p.name, p);
  return out;
}

std::vector<bool> windows_of(const model_config& c) {
  std::vector<bool> out;
  for (int l = 0; l < c.num_layers; ++l) out.push_back(c.layer_window(l) > 0);
  return out;
}

class family_files : public testing::config_variants {
 protected:
  family_files() : config_variants(std::string(UPIPE_SOURCE_DIR) + "/tests/golden/hf") {}
};

TEST(family_table, every_row_is_found_by_its_model_type) {
  std::set<std::string> types;
  for (const family_row& row : family_table()) {
    EXPECT_TRUE(types.insert(std::string(row.model_type)).second) << row.model_type;
    ASSERT_NE(find_family(row.model_type), nullptr);
    EXPECT_EQ(find_family(row.model_type)->family, row.family);
    EXPECT_EQ(&family_traits(row.family), &row);
    EXPECT_NE(family_names().find(std::string(row.model_type)), std::string::npos);
  }
  EXPECT_EQ(find_family("gemma3"), nullptr);  // the multimodal wrapper is not a text model
}

TEST(family_table, qwen2_has_biases_on_q_k_and_v) {
  const model_config c = read_hf_config(fixture("qwen2-bias"));
  EXPECT_EQ(c.family, model_family::qwen2);
  EXPECT_EQ(c.biases, qkv_projections);
  EXPECT_TRUE(c.windowed_layers.empty());
  const auto specs = specs_by_name(c);
  const parameter_spec& bias = specs.at("model.layers.1.self_attn.k_proj.bias");
  EXPECT_EQ(bias.kind, param_kind::bias);
  EXPECT_EQ(bias.shape, (std::vector<std::int64_t>{2 * 16}));
  EXPECT_EQ(specs.count("model.layers.0.self_attn.o_proj.bias"), 0u);
  EXPECT_EQ(specs.at("model.embed_tokens.weight").kind, param_kind::embedding);
  EXPECT_EQ(specs.at("model.layers.0.input_layernorm.weight").kind, param_kind::norm);
  EXPECT_EQ(specs.at("lm_head.weight").kind, param_kind::matrix);
}

TEST_F(family_files, qwen2_windows_follow_use_sliding_window_and_max_window_layers) {
  const model_config c = read_hf_config(fixture("qwen2-window"));
  EXPECT_EQ(c.sliding_window, 6);
  EXPECT_EQ(windows_of(c), (std::vector<bool>{false, true}));
  // Without layer_types, transformers' rule: layers from max_window_layers on.
  const model_config derived = read_hf_config(variant("qwen2-window", {{"layer_types", nullptr}}));
  EXPECT_EQ(windows_of(derived), (std::vector<bool>{false, true}));
  const model_config all = read_hf_config(variant("qwen2-window", {{"layer_types", nullptr}, {"max_window_layers", 0}}));
  EXPECT_EQ(windows_of(all), (std::vector<bool>{true, true}));
  // use_sliding_window false drops the window whatever sliding_window says.
  const model_config off = read_hf_config(variant("qwen2-window", {{"layer_types", nullptr}, {"use_sliding_window", false}}));
  EXPECT_EQ(windows_of(off), (std::vector<bool>{false, false}));
}

TEST_F(family_files, mistral_windows_every_layer_and_keeps_its_head_dim) {
  const model_config c = read_hf_config(fixture("mistral-window"));
  EXPECT_EQ(c.family, model_family::mistral);
  EXPECT_EQ(c.head_dim, 24);
  EXPECT_EQ(windows_of(c), (std::vector<bool>{true, true}));
  EXPECT_EQ(c.layer_window(0), 5);
  const model_config none = read_hf_config(variant("mistral-window", {{"sliding_window", nullptr}}));
  EXPECT_EQ(windows_of(none), (std::vector<bool>{false, false}));
}

TEST(family_table, phi3_stores_qkv_and_gate_up_fused) {
  const model_config c = read_hf_config(fixture("phi3-fused"));
  EXPECT_EQ(c.family, model_family::phi3);
  EXPECT_EQ(c.padding_id, 5);
  const auto specs = specs_by_name(c);
  const std::int64_t q = 4 * 16, kv = 2 * 16;
  EXPECT_EQ(specs.at("model.layers.0.self_attn.qkv_proj.weight").shape, (std::vector<std::int64_t>{q + 2 * kv, 64}));
  EXPECT_EQ(specs.at("model.layers.0.mlp.gate_up_proj.weight").shape, (std::vector<std::int64_t>{2 * 96, 64}));
  EXPECT_EQ(specs.count("model.layers.0.self_attn.q_proj.weight"), 0u);
  EXPECT_EQ(projection_rows(c, layer_projection::k).first, q);
  EXPECT_EQ(projection_rows(c, layer_projection::v).first, q + kv);
  EXPECT_EQ(projection_rows(c, layer_projection::up).first, 96);
  // The fused layer's views are blocks of the stored rows.
  std::vector<float> buffer(1 << 16);
  const layer_params p = make_layer_params(c, 0, [&](const std::string& name) {
    const parameter_spec& spec = specs.at(name);
    const std::int64_t rows = spec.shape.size() == 1 ? 1 : spec.shape[0], cols = spec.shape.back();
    return mat_view{buffer.data(), dtype::f32, rows, cols, cols};
  });
  EXPECT_EQ(p.attention.wk.weight.data, buffer.data() + q * 64);
  EXPECT_EQ(p.attention.wv.weight.data, buffer.data() + (q + kv) * 64);
  EXPECT_EQ(p.attention.wv.weight.rows, kv);
  EXPECT_EQ(p.up.weight.data, buffer.data() + 96 * 64);
  EXPECT_EQ(p.up.weight.rows, 96);
}

TEST_F(family_files, gemma3_reads_both_rope_styles_alike) {
  const model_config c = read_hf_config(fixture("gemma3-text"));
  EXPECT_EQ(c.family, model_family::gemma3);
  EXPECT_EQ(windows_of(c), (std::vector<bool>{true, true, false}));
  EXPECT_EQ(c.sliding_window, 5);
  EXPECT_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.rope.scaling.kind, rope_kind::linear);
  EXPECT_EQ(c.rope.scaling.factor, 2.0);
  ASSERT_TRUE(c.local_rope.has_value());
  EXPECT_EQ(c.local_rope->theta, 1e4);
  EXPECT_FALSE(c.local_rope->scaling.enabled());
  EXPECT_EQ(&c.layer_rope(0), &*c.local_rope);
  EXPECT_EQ(&c.layer_rope(2), &c.rope);
  EXPECT_EQ(c.query_pre_attn_scalar, 24);
  EXPECT_FLOAT_EQ(c.attention_scale(), static_cast<float>(1.0 / std::sqrt(24.0)));
  EXPECT_EQ(c.activation, gate_activation::gelu_tanh);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.padding_id, 0);
  const auto specs = specs_by_name(c);
  for (const char* norm : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm"})
    EXPECT_EQ(specs.at(std::string("model.layers.2.") + norm + ".weight").kind, param_kind::norm) << norm;
  // The older style: rope_theta, rope_local_base_freq, rope_scaling for the global layers,
  // and sliding_window_pattern in place of layer_types.
  const model_config legacy = read_hf_config(variant(
      "gemma3-text", {{"rope_parameters", nullptr}, {"layer_types", nullptr}, {"rope_theta", 1e6},
                      {"rope_local_base_freq", 1e4}, {"sliding_window_pattern", 3},
                      {"rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}}}));
  EXPECT_EQ(windows_of(legacy), windows_of(c));
  EXPECT_EQ(legacy.rope, c.rope);
  EXPECT_EQ(*legacy.local_rope, *c.local_rope);
  // Neither named: transformers' defaults, 1e6 global and 1e4 local.
  const model_config defaults = read_hf_config(variant("gemma3-text", {{"rope_parameters", nullptr}}));
  EXPECT_EQ(defaults.rope.theta, 1e6);
  EXPECT_EQ(defaults.local_rope->theta, 1e4);
}

TEST_F(family_files, written_configs_read_back_the_same) {
  for (const char* name : {"qwen2-bias", "qwen2-window", "mistral-window", "phi3-fused", "gemma3-text"}) {
    SCOPED_TRACE(name);
    const model_config c = read_hf_config(fixture(name));
    const std::string out = (dir_ / (std::string(name) + ".json")).string();
    write_hf_config(c, out);
    const model_config back = read_hf_config(out);
    EXPECT_EQ(back.family, c.family);
    EXPECT_EQ(back.biases, c.biases);
    EXPECT_EQ(back.activation, c.activation);
    EXPECT_EQ(windows_of(back), windows_of(c));
    EXPECT_EQ(back.sliding_window, c.windowed_layers.empty() ? 0 : c.sliding_window);
    EXPECT_EQ(back.rope, c.rope);
    EXPECT_EQ(back.local_rope, c.local_rope);
    EXPECT_EQ(back.query_pre_attn_scalar, c.query_pre_attn_scalar);
    EXPECT_EQ(back.padding_id, c.padding_id);
    EXPECT_EQ(back.tie_embeddings, c.tie_embeddings);
    EXPECT_EQ(back.head_dim, c.head_dim);
  }
}

TEST(family_table, initialization_reads_the_kinds) {
  for (const char* name : {"qwen2-bias", "gemma3-text"}) {
    SCOPED_TRACE(name);
    const model_config c = read_hf_config(fixture(name));
    const host_weights w = random_weights(c, 7);
    const float norm_center = 1.0f - c.traits().norm_offset;
    for (const parameter_spec& p : parameter_specs(c)) {
      const std::vector<float>& v = w.at(p.name);
      double mean = 0;
      for (float e : v) mean += e;
      mean /= static_cast<double>(v.size());
      if (p.kind == param_kind::norm)
        EXPECT_NEAR(mean, norm_center, 0.1) << p.name;
      else
        EXPECT_NEAR(mean, 0.0, 0.1) << p.name;  // a bias starts near 0, not at a norm's 1
    }
  }
}

TEST(family_table, a_window_caps_the_attention_flops) {
  const model_config mistral = preset("mistral-7b");
  model_config global = mistral;
  global.windowed_layers.clear();
  const double S = 32768, W = 4096;
  const double per_square = 6.0 * mistral.num_layers * mistral.num_heads * mistral.head_dim;
  EXPECT_DOUBLE_EQ(global.model_flops(32768) - mistral.model_flops(32768), per_square * (S * S - (2 * S * W - W * W)));
  EXPECT_DOUBLE_EQ(mistral.model_flops(4096), global.model_flops(4096));  // a window as long as the sequence
  // Gemma 3's 52 windowed layers of 62 cost their window, the other 10 the whole square.
  const model_config gemma = preset("gemma3-27b");
  const double per_layer = 6.0 * gemma.num_heads * gemma.head_dim, w = 1024;
  const double matmul = 6.0 * static_cast<double>(gemma.matmul_parameter_count()) * S;
  EXPECT_DOUBLE_EQ(gemma.model_flops(32768), matmul + per_layer * (10 * S * S + 52 * (2 * S * w - w * w)));
}

TEST(family_table, lora_adapts_phi3s_fused_modules_whole) {
  const model_config c = read_hf_config(fixture("phi3-fused"));
  const lora_config all = parse_lora("r=4,alpha=8,targets=qkv_proj,o,gate_up_proj,down", c);
  EXPECT_EQ(all.target_list().size(), 7u);
  EXPECT_EQ(lora_module_names(c, all), (std::vector<std::string>{"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}));
  EXPECT_EQ(parse_lora("r=4,targets=q,k,v", c).targets, qkv_projections);
  try {
    parse_lora("r=4,targets=q,v", c);
    ADD_FAILURE() << "q without k on a fused qkv_proj was accepted";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("qkv_proj"), std::string::npos) << e.what();
  }
  try {
    parse_lora("r=4,targets=q_proj", c);
    ADD_FAILURE() << "q_proj was accepted for Phi-3";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("qkv_proj, o_proj, gate_up_proj, down_proj"), std::string::npos) << e.what();
  }
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const parameter_spec& p : lora_parameter_specs(c, all)) shapes[p.name] = p.shape;
  EXPECT_EQ(shapes.size(), 2u * 4u * 2u);
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.qkv_proj.lora_A.weight"), (std::vector<std::int64_t>{4, 64}));
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.qkv_proj.lora_B.weight"), (std::vector<std::int64_t>{128, 4}));
  EXPECT_EQ(shapes.at("model.layers.1.mlp.gate_up_proj.lora_B.weight"), (std::vector<std::int64_t>{192, 4}));
  EXPECT_EQ(lora_parameter_count(c, all), 2 * 4 * ((64 + 128) + (64 + 64) + (64 + 192) + (96 + 64)));
}

// The presets of the new families run a whole step on the meta backend (the planner's probe):
// rank 0 of 4 at 64K tokens under UPipe, holding every parameter's bf16 weight and f32
// gradient (biases, fused tensors and the post-norms included).
TEST(family_table, new_presets_step_on_the_meta_backend) {
  for (const char* name : {"qwen2.5-7b", "mistral-7b", "gemma3-4b", "gemma3-12b", "gemma3-27b"}) {
    SCOPED_TRACE(name);
    model_step_request req;
    req.model = preset(name);
    req.cp = {strategy_kind::upipe, 4, 0};
    req.backend = backend_kind::meta;
    req.limits = {std::size_t{1} << 50, std::size_t{1} << 50};
    req.shape_only = 65536;
    const model_step_result r = run_model_step(req, {}, {});
    const auto params = static_cast<std::size_t>(req.model.parameter_count());
    EXPECT_EQ(r.peak_bytes.at("weights"), params * 2);
    EXPECT_EQ(r.peak_bytes.at("grads"), params * 4);
    EXPECT_GT(r.peak_bytes.at("attention"), 0u);
  }
}

// transformers' validate_layer_type: one layer type per layer; and a window applied to a
// layer is a positive number of tokens (0 or less read as "no window" ran every layer full).
TEST_F(family_files, layer_types_and_window_sizes_are_checked_as_transformers_checks_them) {
  const auto refused = [&](const char* fixture_name, const nlohmann::json& fields, std::initializer_list<std::string> words) {
    try {
      read_hf_config(variant(fixture_name, fields));
      ADD_FAILURE() << fixture_name << " with " << fields.dump() << " was accepted";
    } catch (const config_error& e) {
      for (const std::string& w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
    }
  };
  refused("gemma3-text", {{"layer_types", nlohmann::json::array()}}, {"layer_types lists 0 layers", "num_hidden_layers"});
  refused("gemma3-text", {{"layer_types", {"sliding_attention"}}}, {"layer_types lists 1 layers"});
  refused("gemma3-text", {{"sliding_window", 0}}, {"sliding_window = 0", "positive", "null"});
  refused("gemma3-text", {{"sliding_window", -4}}, {"sliding_window = -4"});
  refused("gemma3-text", {{"layer_types", nullptr}, {"sliding_window", 0}}, {"sliding_window = 0"});
  refused("qwen2-window", {{"sliding_window", 0}}, {"sliding_window = 0"});
  refused("mistral-window", {{"sliding_window", 0}}, {"sliding_window = 0"});
  // No layer windowed, or the window dropped: nothing to check.
  const model_config full = read_hf_config(
      variant("gemma3-text", {{"layer_types", {"full_attention", "full_attention", "full_attention"}}, {"sliding_window", 0}}));
  EXPECT_EQ(windows_of(full), (std::vector<bool>{false, false, false}));
  const model_config off = read_hf_config(variant("qwen2-window", {{"use_sliding_window", false}, {"sliding_window", 0}}));
  EXPECT_EQ(windows_of(off), (std::vector<bool>{false, false}));
  const model_config none = read_hf_config(variant("gemma3-text", {{"sliding_window", nullptr}}));
  EXPECT_EQ(windows_of(none), (std::vector<bool>{false, false, false}));
}

}  // namespace
}  // namespace upipe
