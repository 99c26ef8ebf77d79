// Model configurations: the presets against the published Hugging Face configs and
// parameter totals, the parameter list, reading and writing config.json, and refusals.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <unistd.h>

#include "core/error.hpp"
#include "model/config.hpp"

namespace upipe {
namespace {

namespace fs = std::filesystem;

// A scratch folder per test, removed afterwards.
class model_config_files : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("upipe_model_config_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  std::string write_file(const std::string& name, const std::string& text) const {
    const std::string path = (dir_ / name).string();
    std::ofstream out(path);
    out << text;
    return path;
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

std::int64_t numel(const parameter_spec& spec) {
  return std::accumulate(spec.shape.begin(), spec.shape.end(), std::int64_t{1},
                         std::multiplies<>());
}

std::int64_t sum_of_specs(const model_config& c) {
  std::int64_t total = 0;
  for (const parameter_spec& spec : parameter_specs(c)) total += numel(spec);
  return total;
}

// Every field but the name.
void expect_same_model(const model_config& a, const model_config& b) {
  EXPECT_EQ(a.family, b.family);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope.theta, b.rope.theta);
  EXPECT_EQ(a.rope.scaling.enabled(), b.rope.scaling.enabled());
  if (a.rope.scaling.enabled() && b.rope.scaling.enabled()) {
    EXPECT_EQ(a.rope.scaling.factor, b.rope.scaling.factor);
    EXPECT_EQ(a.rope.scaling.low_freq_factor, b.rope.scaling.low_freq_factor);
    EXPECT_EQ(a.rope.scaling.high_freq_factor, b.rope.scaling.high_freq_factor);
    EXPECT_EQ(a.rope.scaling.original_max_position, b.rope.scaling.original_max_position);
  }
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
}

template <class Error, class Fn>
void expect_error(Fn&& fn, std::initializer_list<std::string> fragments) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << *fragments.begin();
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const std::string& fragment : fragments)
      EXPECT_NE(what.find(fragment), std::string::npos) << "'" << fragment << "' not in: " << what;
  }
}

// ---------------------------------------------------------------------------------------
// Presets
// ---------------------------------------------------------------------------------------

struct expected_preset {
  const char* name;
  model_family family;
  std::int64_t V;
  int D, F, L, H, K, d;
  double eps, theta;
  double factor;  // 0: no scaling
  std::int64_t original_max_position;
  bool tied;
};

const expected_preset expected_presets[] = {
    {"llama3-8b", model_family::llama, 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000, 8, 8192, false},
    {"llama3-70b", model_family::llama, 128256, 8192, 28672, 80, 64, 8, 128, 1e-5, 500000, 8, 8192, false},
    {"llama3.2-1b", model_family::llama, 128256, 2048, 8192, 16, 32, 8, 64, 1e-5, 500000, 32, 8192, true},
    {"llama3.2-3b", model_family::llama, 128256, 3072, 8192, 28, 24, 8, 128, 1e-5, 500000, 32, 8192, true},
    {"qwen3-8b", model_family::qwen3, 151936, 4096, 12288, 36, 32, 8, 128, 1e-6, 1000000, 0, 0, false},
    {"qwen3-32b", model_family::qwen3, 151936, 5120, 25600, 64, 64, 8, 128, 1e-6, 1000000, 0, 0, false},
    {"qwen2.5-7b", model_family::qwen2, 152064, 3584, 18944, 28, 28, 4, 128, 1e-6, 1000000, 0, 0, false},
    {"mistral-7b", model_family::mistral, 32000, 4096, 14336, 32, 32, 8, 128, 1e-5, 10000, 0, 0, false},
    {"gemma3-4b", model_family::gemma3, 262208, 2560, 10240, 34, 8, 4, 256, 1e-6, 1000000, 8, 0, true},
    {"gemma3-12b", model_family::gemma3, 262208, 3840, 15360, 48, 16, 8, 256, 1e-6, 1000000, 8, 0, true},
    {"gemma3-27b", model_family::gemma3, 262208, 5376, 21504, 62, 32, 16, 128, 1e-6, 1000000, 8, 0, true},
    {"tiny-llama", model_family::llama, 256, 64, 160, 2, 4, 2, 16, 1e-5, 10000, 8, 32, false},
    {"tiny-qwen3", model_family::qwen3, 256, 64, 96, 2, 4, 2, 32, 1e-6, 10000, 0, 0, true},
    {"tiny-gemma3", model_family::gemma3, 256, 64, 96, 3, 4, 2, 16, 1e-6, 1000000, 8, 0, true},
    {"qwen3-30b-a3b", model_family::qwen3_moe, 151936, 2048, 6144, 48, 32, 4, 128, 1e-6, 1000000, 0, 0, false},
    {"qwen3.5-27b", model_family::qwen3_5, 248320, 5120, 17408, 64, 24, 4, 256, 1e-6, 10000000, 0, 0, false},
    {"qwen3.5-35b-a3b", model_family::qwen3_5_moe, 248320, 2048, 512, 40, 16, 2, 256, 1e-6, 10000000, 0, 0, false},
    {"qwen3-next-80b-a3b", model_family::qwen3_next, 151936, 2048, 5120, 48, 16, 2, 256, 1e-6, 10000000, 0, 0, false},
    {"tiny-qwen3-moe", model_family::qwen3_moe, 256, 64, 96, 3, 4, 2, 16, 1e-6, 10000, 0, 0, false},
};

TEST(model_config, preset_names_are_the_documented_ones) {
  std::vector<std::string> names;
  for (const expected_preset& e : expected_presets) names.push_back(e.name);
  EXPECT_EQ(preset_names(), names);
}

TEST(model_config, every_preset_validates_with_the_published_shapes) {
  for (const expected_preset& e : expected_presets) {
    SCOPED_TRACE(e.name);
    const model_config c = preset(e.name);
    EXPECT_NO_THROW(validate(c));
    EXPECT_EQ(c.name, e.name);
    EXPECT_EQ(c.family, e.family);
    EXPECT_EQ(c.vocab_size, e.V);
    EXPECT_EQ(c.hidden_size, e.D);
    EXPECT_EQ(c.intermediate_size, e.F);
    EXPECT_EQ(c.num_layers, e.L);
    EXPECT_EQ(c.num_heads, e.H);
    EXPECT_EQ(c.num_kv_heads, e.K);
    EXPECT_EQ(c.head_dim, e.d);
    EXPECT_EQ(c.rms_norm_eps, e.eps);
    EXPECT_EQ(c.rope.theta, e.theta);
    EXPECT_EQ(c.rope.scaling.enabled(), e.factor > 0);
    if (e.factor > 0) EXPECT_EQ(c.rope.scaling.factor, e.factor);
    if (c.rope.scaling.kind == rope_kind::llama3) {
      EXPECT_EQ(c.rope.scaling.low_freq_factor, 1.0);
      EXPECT_EQ(c.rope.scaling.high_freq_factor, 4.0);
      EXPECT_EQ(c.rope.scaling.original_max_position, e.original_max_position);
    }
    EXPECT_EQ(c.tie_embeddings, e.tied);
    EXPECT_EQ(c.qk_norm, family_traits(e.family).qk_norm);
    EXPECT_EQ(c.parameter_count(), sum_of_specs(c));
  }
}

TEST(model_config, parameter_totals_match_the_published_models) {
  // Published totals (model cards / safetensors metadata) and, for 70B, 3B and 32B, the
  // same arithmetic: V*D*(tied ? 1 : 2) + D + L*(2D + (H+2K)d*D + H*d*D + 3*F*D [+ 2d]).
  EXPECT_EQ(preset("llama3-8b").parameter_count(), 8'030'261'248);
  EXPECT_EQ(preset("llama3.2-1b").parameter_count(), 1'235'814'400);
  EXPECT_EQ(preset("qwen3-8b").parameter_count(), 8'190'735'360);
  EXPECT_EQ(preset("llama3-70b").parameter_count(), 70'553'706'496);
  EXPECT_EQ(preset("llama3.2-3b").parameter_count(), 3'212'749'824);
  EXPECT_EQ(preset("qwen3-32b").parameter_count(), 32'762'123'264);
  // Qwen2.5-7B with its q/k/v biases and Mistral-7B-v0.1, as their safetensors indexes total.
  EXPECT_EQ(preset("qwen2.5-7b").parameter_count(), 7'615'616'512);
  EXPECT_EQ(preset("mistral-7b").parameter_count(), 7'241'732'096);
  // Qwen3-30B-A3B: 128 experts of width 768 in each of 48 layers, 3.3B of them active a token.
  EXPECT_EQ(preset("qwen3-30b-a3b").parameter_count(), 30'532'122'624);
  // The hybrids' text models, as transformers 5.25 builds them from the Hub's config.json
  // (Qwen3-Next-80B-A3B's card: 80B; the Qwen3.5 checkpoints add their vision towers).
  EXPECT_EQ(preset("qwen3.5-27b").parameter_count(), 26'895'998'464);
  EXPECT_EQ(preset("qwen3.5-35b-a3b").parameter_count(), 34'660'610'688);
  EXPECT_EQ(preset("qwen3-next-80b-a3b").parameter_count(), 79'674'391'296);
  for (const std::string& name : preset_names()) {
    SCOPED_TRACE(name);
    const model_config c = preset(name);
    EXPECT_EQ(c.parameter_count(), sum_of_specs(c));
  }
}

// ---------------------------------------------------------------------------------------
// Parameter list
// ---------------------------------------------------------------------------------------

using shape = std::vector<std::int64_t>;

TEST(model_config, llama_parameters_in_order_with_an_untied_head) {
  const model_config c = preset("tiny-llama");  // V 256, D 64, F 160, H 4, K 2, d 16
  const std::vector<parameter_spec> specs = parameter_specs(c);
  const std::vector<std::pair<std::string, shape>> layer = {
      {"input_layernorm.weight", {64}},
      {"self_attn.q_proj.weight", {64, 64}},
      {"self_attn.k_proj.weight", {32, 64}},
      {"self_attn.v_proj.weight", {32, 64}},
      {"self_attn.o_proj.weight", {64, 64}},
      {"post_attention_layernorm.weight", {64}},
      {"mlp.gate_proj.weight", {160, 64}},
      {"mlp.up_proj.weight", {160, 64}},
      {"mlp.down_proj.weight", {64, 160}},
  };
  ASSERT_EQ(specs.size(), 1 + 2 * layer.size() + 2);
  EXPECT_EQ(specs[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(specs[0].shape, (shape{256, 64}));
  std::size_t at = 1;
  for (int i = 0; i < 2; ++i)
    for (const auto& [suffix, expected_shape] : layer) {
      EXPECT_EQ(specs[at].name, "model.layers." + std::to_string(i) + "." + suffix);
      EXPECT_EQ(specs[at].shape, expected_shape) << specs[at].name;
      ++at;
    }
  EXPECT_EQ(specs[at].name, "model.norm.weight");
  EXPECT_EQ(specs[at].shape, shape{64});
  EXPECT_EQ(specs[at + 1].name, "lm_head.weight");
  EXPECT_EQ(specs[at + 1].shape, (shape{256, 64}));
  for (const parameter_spec& s : specs) EXPECT_EQ(s.name.find("_norm.weight"), std::string::npos) << s.name;
}

TEST(model_config, qwen3_parameters_have_head_norms_and_a_tied_head) {
  const model_config c = preset("tiny-qwen3");  // D 64, F 96, H 4, K 2, d 32 (H*d = 128)
  const std::vector<parameter_spec> specs = parameter_specs(c);
  const std::vector<std::pair<std::string, shape>> layer = {
      {"input_layernorm.weight", {64}},
      {"self_attn.q_proj.weight", {128, 64}},
      {"self_attn.k_proj.weight", {64, 64}},
      {"self_attn.v_proj.weight", {64, 64}},
      {"self_attn.o_proj.weight", {64, 128}},
      {"self_attn.q_norm.weight", {32}},
      {"self_attn.k_norm.weight", {32}},
      {"post_attention_layernorm.weight", {64}},
      {"mlp.gate_proj.weight", {96, 64}},
      {"mlp.up_proj.weight", {96, 64}},
      {"mlp.down_proj.weight", {64, 96}},
  };
  ASSERT_EQ(specs.size(), 1 + 2 * layer.size() + 1);
  EXPECT_EQ(specs[0].name, "model.embed_tokens.weight");
  std::size_t at = 1;
  for (int i = 0; i < 2; ++i)
    for (const auto& [suffix, expected_shape] : layer) {
      EXPECT_EQ(specs[at].name, "model.layers." + std::to_string(i) + "." + suffix);
      EXPECT_EQ(specs[at].shape, expected_shape) << specs[at].name;
      ++at;
    }
  EXPECT_EQ(specs.back().name, "model.norm.weight");  // tied: no lm_head
}

TEST(model_config, untied_qwen3_and_tied_llama_heads) {
  EXPECT_EQ(parameter_specs(preset("qwen3-8b")).back().name, "lm_head.weight");
  EXPECT_EQ(parameter_specs(preset("llama3.2-1b")).back().name, "model.norm.weight");
  const auto specs = parameter_specs(preset("llama3.2-1b"));
  EXPECT_EQ(specs.size(), 1u + 16u * 9u + 1u);
  EXPECT_EQ(specs[1 + 15 * 9 + 2].name, "model.layers.15.self_attn.k_proj.weight");
  EXPECT_EQ(specs[1 + 15 * 9 + 2].shape, (shape{512, 2048}));
}

// ---------------------------------------------------------------------------------------
// Reading config.json
// ---------------------------------------------------------------------------------------

// meta-llama/Llama-3.1-8B's config.json as published.
const char* llama31_8b_json = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// Qwen/Qwen3-8B's config.json as published.
const char* qwen3_8b_json = R"({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 12288,
  "max_position_embeddings": 40960,
  "max_window_layers": 36,
  "model_type": "qwen3",
  "num_attention_heads": 32,
  "num_hidden_layers": 36,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// A small config with the given fields replaced (null value: field removed).
std::string small_config(const std::string& model_type, const nlohmann::json& changes) {
  nlohmann::json j = {
      {"model_type", model_type}, {"vocab_size", 256},          {"hidden_size", 64},
      {"intermediate_size", 160}, {"num_hidden_layers", 2},     {"num_attention_heads", 4},
      {"num_key_value_heads", 2}, {"head_dim", 16},             {"rms_norm_eps", 1e-5},
      {"rope_theta", 10000.0},    {"tie_word_embeddings", false}, {"rope_scaling", nullptr},
  };
  for (const auto& [key, value] : changes.items()) {
    if (value.is_string() && value == "<remove>")
      j.erase(key);
    else
      j[key] = value;
  }
  return j.dump(2);
}

TEST_F(model_config_files, reads_the_published_llama_3_1_config) {
  const std::string file = write_file("config.json", llama31_8b_json);
  const model_config c = read_hf_config(file);
  EXPECT_EQ(c.name, file);
  expect_same_model(c, preset("llama3-8b"));
  EXPECT_EQ(c.parameter_count(), 8'030'261'248);
}

TEST_F(model_config_files, reads_the_published_qwen3_config) {
  const std::string file = write_file("config.json", qwen3_8b_json);
  const model_config c = read_hf_config(file);
  expect_same_model(c, preset("qwen3-8b"));
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.parameter_count(), 8'190'735'360);
}

TEST_F(model_config_files, llama_defaults_null_head_dim_and_missing_kv_heads) {
  // Llama 2 style: no head_dim key would also derive D / H; null must too.
  const std::string file = write_file(
      "config.json", small_config("llama", {{"head_dim", nullptr},
                                            {"num_key_value_heads", "<remove>"},
                                            {"rope_theta", "<remove>"},
                                            {"tie_word_embeddings", "<remove>"},
                                            {"rope_scaling", "<remove>"}}));
  const model_config c = read_hf_config(file);
  EXPECT_EQ(c.family, model_family::llama);
  EXPECT_EQ(c.head_dim, 16);      // D / H = 64 / 4
  EXPECT_EQ(c.num_kv_heads, 4);   // = H
  EXPECT_EQ(c.rope.theta, 10000.0);
  EXPECT_FALSE(c.rope.scaling.enabled());
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_FALSE(c.qk_norm);
}

TEST_F(model_config_files, qwen3_defaults_follow_transformers) {
  // Null head_dim and null kv heads derive D / H and H.
  model_config c = read_hf_config(write_file(
      "null.json", small_config("qwen3", {{"head_dim", nullptr}, {"num_key_value_heads", nullptr},
                                          {"tie_word_embeddings", true}})));
  EXPECT_EQ(c.family, model_family::qwen3);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.num_kv_heads, 4);
  // Absent keys take Qwen3Config's declared defaults: head_dim 128, num_key_value_heads 32.
  c = read_hf_config(write_file(
      "absent.json", small_config("qwen3", {{"hidden_size", 2048}, {"num_attention_heads", 32},
                                            {"head_dim", "<remove>"},
                                            {"num_key_value_heads", "<remove>"}})));
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_kv_heads, 32);
}

TEST_F(model_config_files, reads_rope_parameters_and_legacy_type_key) {
  // transformers 5 writes theta and scaling into one rope_parameters object.
  model_config c = read_hf_config(write_file(
      "v5.json",
      small_config("llama", {{"rope_theta", "<remove>"},
                             {"rope_scaling", "<remove>"},
                             {"rope_parameters",
                              {{"rope_type", "llama3"},
                               {"rope_theta", 500000.0},
                               {"factor", 32.0},
                               {"low_freq_factor", 1.0},
                               {"high_freq_factor", 4.0},
                               {"original_max_position_embeddings", 8192}}}})));
  EXPECT_EQ(c.rope.theta, 500000.0);
  ASSERT_TRUE(c.rope.scaling.enabled());
  EXPECT_EQ(c.rope.scaling.factor, 32.0);
  EXPECT_EQ(c.rope.scaling.original_max_position, 8192);

  c = read_hf_config(write_file(
      "default.json",
      small_config("qwen3", {{"rope_theta", "<remove>"},
                             {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e6}}}})));
  EXPECT_EQ(c.rope.theta, 1e6);
  EXPECT_FALSE(c.rope.scaling.enabled());

  c = read_hf_config(write_file(
      "legacy.json", small_config("llama", {{"rope_scaling",
                                             {{"type", "llama3"},
                                              {"factor", 8},
                                              {"low_freq_factor", 1},
                                              {"high_freq_factor", 4},
                                              {"original_max_position_embeddings", 32}}}})));
  ASSERT_TRUE(c.rope.scaling.enabled());
  EXPECT_EQ(c.rope.scaling.factor, 8.0);
  EXPECT_EQ(c.rope.scaling.original_max_position, 32);
}

// ---------------------------------------------------------------------------------------
// Writing config.json
// ---------------------------------------------------------------------------------------

TEST_F(model_config_files, every_preset_round_trips_through_config_json) {
  for (const std::string& name : preset_names()) {
    SCOPED_TRACE(name);
    const model_config original = preset(name);
    const std::string file = path(name + ".json");
    write_hf_config(original, file);
    const model_config read = read_hf_config(file);
    EXPECT_EQ(read.name, file);
    expect_same_model(read, original);
  }
}

TEST_F(model_config_files, written_config_carries_what_transformers_needs) {
  const std::string llama_file = path("llama.json");
  write_hf_config(preset("llama3.2-1b"), llama_file);
  std::ifstream llama_in(llama_file);
  const nlohmann::json llama = nlohmann::json::parse(llama_in);
  EXPECT_EQ(llama["model_type"], "llama");
  EXPECT_EQ(llama["architectures"], nlohmann::json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(llama["head_dim"], 64);
  EXPECT_EQ(llama["rope_scaling"]["rope_type"], "llama3");
  EXPECT_EQ(llama["rope_scaling"]["factor"], 32.0);
  EXPECT_EQ(llama["tie_word_embeddings"], true);
  EXPECT_EQ(llama["hidden_act"], "silu");
  EXPECT_EQ(llama["attention_bias"], false);
  EXPECT_EQ(llama["mlp_bias"], false);
  EXPECT_EQ(llama["max_position_embeddings"], 131072);
  EXPECT_EQ(llama["torch_dtype"], "float32");

  const std::string qwen_file = path("qwen.json");
  write_hf_config(preset("tiny-qwen3"), qwen_file);
  std::ifstream qwen_in(qwen_file);
  const nlohmann::json qwen = nlohmann::json::parse(qwen_in);
  EXPECT_EQ(qwen["model_type"], "qwen3");
  EXPECT_EQ(qwen["architectures"], nlohmann::json::array({"Qwen3ForCausalLM"}));
  EXPECT_EQ(qwen["head_dim"], 32);
  EXPECT_TRUE(qwen["rope_scaling"].is_null());
  EXPECT_EQ(qwen["max_position_embeddings"], 40960);
  EXPECT_EQ(qwen["use_sliding_window"], false);
}

TEST_F(model_config_files, write_to_a_missing_folder_is_an_io_error) {
  expect_error<io_error>([&] { write_hf_config(preset("tiny-llama"), path("no/such/dir/config.json")); },
                         {"no/such/dir/config.json"});
}

// ---------------------------------------------------------------------------------------
// Refusals
// ---------------------------------------------------------------------------------------

TEST(model_config, unknown_preset_lists_the_known_ones) {
  std::vector<std::string> fragments = {"llama3-9b", "--config", "config.json"};
  for (const std::string& name : preset_names()) fragments.push_back(name);
  try {
    preset("llama3-9b");
    FAIL() << "accepted an unknown preset";
  } catch (const config_error& e) {
    const std::string what = e.what();
    for (const std::string& f : fragments)
      EXPECT_NE(what.find(f), std::string::npos) << "'" << f << "' not in: " << what;
  }
}

TEST_F(model_config_files, unreadable_or_malformed_files_are_io_errors) {
  expect_error<io_error>([&] { read_hf_config(path("absent.json")); }, {"absent.json"});
  const std::string broken = write_file("broken.json", R"({"model_type": "llama", "hidden_size": )");
  expect_error<io_error>([&] { read_hf_config(broken); }, {"broken.json", "not valid JSON"});
  const std::string list = write_file("list.json", "[1, 2]");
  expect_error<io_error>([&] { read_hf_config(list); }, {"list.json", "object"});
}

TEST_F(model_config_files, missing_or_mistyped_fields_are_named) {
  std::string file = write_file("a.json", small_config("llama", {{"hidden_size", "<remove>"}}));
  expect_error<io_error>([&] { read_hf_config(file); }, {file, "hidden_size"});
  file = write_file("b.json", small_config("llama", {{"num_attention_heads", "32"}}));
  expect_error<io_error>([&] { read_hf_config(file); }, {file, "num_attention_heads", "integer"});
  file = write_file("c.json", small_config("llama", {{"tie_word_embeddings", 1}}));
  expect_error<io_error>([&] { read_hf_config(file); }, {"tie_word_embeddings"});
  file = write_file("d.json", small_config("llama", {{"rope_scaling",
                                                      {{"rope_type", "llama3"}, {"factor", 8.0}}}}));
  expect_error<io_error>([&] { read_hf_config(file); }, {"rope_scaling.low_freq_factor"});
  file = write_file("e.json", small_config("llama", {{"model_type", "<remove>"}}));
  expect_error<io_error>([&] { read_hf_config(file); }, {"model_type"});
}

TEST_F(model_config_files, unsupported_configurations_are_config_errors) {
  std::string file = write_file("gemma2.json", small_config("gemma2", {}));
  expect_error<config_error>([&] { read_hf_config(file); }, {"gemma2", "llama", "qwen3", "mistral", "gemma3_text"});
  file = write_file("gemma3.json", small_config("gemma3", {}));
  expect_error<config_error>([&] { read_hf_config(file); }, {"gemma3", "gemma3_text", "Gemma3ForCausalLM"});
  file = write_file("longrope.json", small_config("qwen3", {{"rope_scaling",
                                                             {{"rope_type", "longrope"},
                                                              {"factor", 4.0},
                                                              {"original_max_position_embeddings", 32768}}}}));
  expect_error<config_error>([&] { read_hf_config(file); }, {"longrope", "llama3", "linear", "yarn"});
  file = write_file("layers.json", small_config("llama", {{"num_hidden_layers", -2}}));
  expect_error<config_error>([&] { read_hf_config(file); }, {"num_hidden_layers", "-2", "positive"});
  file = write_file("gqa.json", small_config("llama", {{"num_key_value_heads", 3}}));
  expect_error<config_error>([&] { read_hf_config(file); }, {"K = 3", "H = 4", "for example K = 2"});
  file = write_file("bias.json", small_config("mistral", {{"attention_bias", true}}));
  expect_error<config_error>([&] { read_hf_config(file); }, {"attention_bias"});
  file = write_file("gelu.json", small_config("llama", {{"hidden_act", "gelu"}}));
  expect_error<config_error>([&] { read_hf_config(file); }, {"gelu", "silu", "gelu_pytorch_tanh"});
  file = write_file("softcap.json", small_config("gemma3_text", {{"final_logit_softcapping", 30.0}}));
  expect_error<config_error>([&] { read_hf_config(file); }, {"final_logit_softcapping", "null"});
  file = write_file("partial.json", small_config("phi3", {{"partial_rotary_factor", 0.75}}));
  expect_error<config_error>([&] { read_hf_config(file); }, {"partial_rotary_factor", "1.0"});
  file = write_file("types.json", small_config("qwen2", {{"use_sliding_window", true}, {"sliding_window", 8},
                                                         {"layer_types", {"full_attention", "chunked_attention"}}}));
  expect_error<config_error>([&] { read_hf_config(file); }, {"chunked_attention", "sliding_attention"});
}

TEST(model_config, validate_names_value_rule_and_alternative) {
  auto refused = [](auto change, std::initializer_list<std::string> fragments) {
    model_config c = preset("tiny-llama");
    change(c);
    expect_error<config_error>([&] { validate(c); }, fragments);
  };
  refused([](model_config& c) { c.num_kv_heads = 3; }, {"tiny-llama", "K = 3", "must divide", "K = 2"});
  refused([](model_config& c) { c.head_dim = 15; }, {"d = 15", "even", "d = 16"});
  refused([](model_config& c) { c.vocab_size = 0; }, {"vocab_size V = 0", "positive"});
  refused([](model_config& c) { c.intermediate_size = -1; }, {"intermediate_size F = -1"});
  refused([](model_config& c) { c.rms_norm_eps = 0.0; }, {"rms_norm_eps = 0", "positive"});
  refused([](model_config& c) { c.rope.theta = -1.0; }, {"rope_theta", "positive"});
  refused([](model_config& c) { c.rope.scaling.factor = 0.0; }, {"factor", "positive"});
  refused([](model_config& c) { c.rope.scaling.low_freq_factor = 4.0; },
          {"low_freq_factor = 4", "high_freq_factor = 4", "low 1, high 4"});
  refused([](model_config& c) { c.qk_norm = true; }, {"qk_norm", "llama"});
  // Disabled scaling is not checked.
  model_config c = preset("tiny-qwen3");
  c.rope.scaling.factor = 0.0;
  EXPECT_NO_THROW(validate(c));
}

}  // namespace
}  // namespace upipe

namespace upipe {
namespace {

TEST(model_flops, packed_documents_count_only_their_pairs) {
  const model_config c = preset("llama3-8b");
  const std::int64_t S = 1 << 20;
  const double matmul = 6.0 * static_cast<double>(c.matmul_parameter_count()) * S;
  const std::vector<std::int64_t> one = {0}, halves = {0, S / 2};
  EXPECT_DOUBLE_EQ(c.model_flops(S, one), c.model_flops(S));
  EXPECT_DOUBLE_EQ(c.model_flops(S, halves) - matmul, (c.model_flops(S) - matmul) / 2);
}

}  // namespace
}  // namespace upipe
