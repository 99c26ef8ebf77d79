// Hugging Face model directories: RoPE frequencies as transformers computes them, the
// errors a damaged directory gets, sharded writing read back, and a saved config.json
// that keeps every field of its base. Fixtures: tests/golden/hf/ (scripts/make_hf_fixtures.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "backend/ops.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "formats/safetensors.hpp"
#include "model/hf_model.hpp"

namespace upipe {
namespace {

namespace fs = std::filesystem;

const std::string fixtures = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/hf/";

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// A fresh copy of a fixture directory to damage.
fs::path copy_fixture(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("upipe_hf_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::copy(fixtures + name, dir, fs::copy_options::recursive);
  return dir;
}

template <class E>
void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning " << parts.front();
  } catch (const E& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << "\nlacks " << p;
  }
}

TEST(hf_model, rope_frequencies_and_attention_factor_are_transformers) {
  for (const char* name : {"llama-yarn-shards", "llama-fp16-linear", "qwen3-tied"}) {
    SCOPED_TRACE(name);
    const model_config c = read_hf_config(fixtures + name);
    const auto golden = read_json(fixtures + name + "/golden.json");
    const auto want = golden["inv_freq"].get<std::vector<double>>();
    const auto got = ops::rope_inverse_frequencies(c.rope, c.head_dim);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i] / want[i], 1.0, 1e-6) << "pair " << i;
    EXPECT_NEAR(ops::rope_attention_factor(c.rope), golden["attention_scaling"].get<double>(), 1e-7);
  }
  const model_config yarn = read_hf_config(fixtures + "llama-yarn-shards");
  EXPECT_EQ(yarn.rope.scaling.kind, rope_kind::yarn);
  EXPECT_EQ(yarn.max_position_embeddings, 128);
  EXPECT_EQ(yarn.stored_dtype, "bfloat16");
}

TEST(hf_model, shards_are_read_through_the_index) {
  const model_config c = read_hf_config(fixtures + "llama-yarn-shards");
  const hf_model_files files(fixtures + "llama-yarn-shards", c);
  EXPECT_EQ(files.files().size(), 3u);
  EXPECT_EQ(files.stored_dtype(), "BF16");
  EXPECT_TRUE(files.unused().empty());
  // The index file itself and a single-file directory are read too.
  const hf_model_files by_index(fixtures + "llama-yarn-shards/model.safetensors.index.json", c);
  std::vector<float> a(64), b(64);
  files.read("model.layers.1.mlp.down_proj.weight", 100, 64, a.data());
  by_index.read("model.layers.1.mlp.down_proj.weight", 100, 64, b.data());
  EXPECT_EQ(a, b);
  const model_config q = read_hf_config(fixtures + "qwen3-tied");
  EXPECT_TRUE(q.tie_embeddings);
  EXPECT_EQ(hf_model_files(fixtures + "qwen3-tied", q).files().size(), 1u);
}

TEST(hf_model, damaged_directories_are_clear_errors) {
  const fs::path dir = copy_fixture("llama-yarn-shards");
  const model_config c = read_hf_config(dir.string());
  // An index that places a tensor in a shard that lacks it.
  auto index = read_json(dir / "model.safetensors.index.json");
  index["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors";
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  expect_error<io_error>([&] { hf_model_files(dir.string(), c); },
                         {"model.norm.weight", "model-00001-of-00003.safetensors", "does not hold it"});
  fs::copy_file(fixtures + "llama-yarn-shards/model.safetensors.index.json", dir / "model.safetensors.index.json",
                fs::copy_options::overwrite_existing);
  // A missing shard.
  fs::remove(dir / "model-00002-of-00003.safetensors");
  expect_error<io_error>([&] { hf_model_files(dir.string(), c); }, {"model-00002-of-00003.safetensors", "missing"});
  // Neither weights file, but PyTorch's.
  fs::remove(dir / "model.safetensors.index.json");
  std::ofstream(dir / "pytorch_model.bin") << "x";
  expect_error<io_error>([&] { hf_model_files(dir.string(), c); }, {"neither", ".bin", "safetensors"});
  // Weights of a deeper model: a layer the configuration lacks.
  model_config shallow = c;
  shallow.num_layers = 1;
  expect_error<io_error>([&] { hf_model_files(fixtures + "llama-yarn-shards", shallow); }, {"model.layers.1", "1 layers"});
  // Weights of another width.
  model_config wide = c;
  wide.intermediate_size = 128;
  expect_error<io_error>([&] { hf_model_files(fixtures + "llama-yarn-shards", wide); }, {"mlp", "[160, 64]", "[128, 64]"});
  fs::remove_all(dir);
}

// A NaN or an Inf in a weights file is refused as it is read, naming the file, the tensor
// and the element.
TEST(hf_model, non_finite_weights_name_their_file_and_tensor) {
  const fs::path dir = copy_fixture("qwen3-tied");
  const model_config c = read_hf_config(dir.string());
  safetensors_file st = read_safetensors((dir / "model.safetensors").string());
  std::vector<safetensors_tensor> tensors;
  st.tensors.at("model.norm.weight").values[5] = -std::numeric_limits<float>::infinity();
  for (const auto& [name, e] : st.tensors) tensors.push_back({name, e.shape, e.values, dtype::f32});
  write_safetensors((dir / "model.safetensors").string(), tensors);
  const hf_model_files files(dir.string(), c);
  std::vector<float> out(64);
  expect_error<io_error>([&] { files.read("model.norm.weight", 0, 64, out.data()); },
                         {(dir / "model.safetensors").string(), "-Inf in model.norm.weight (element 5)"});
  files.read("model.norm.weight", 0, 5, out.data());  // the elements before it are fine
  fs::remove_all(dir);
}

TEST(hf_model, unused_tensors_are_listed_not_fatal) {
  const fs::path dir = copy_fixture("qwen3-tied");
  const model_config c = read_hf_config(dir.string());
  safetensors_file st = read_safetensors((dir / "model.safetensors").string());
  std::vector<safetensors_tensor> tensors;
  for (const auto& [name, e] : st.tensors) tensors.push_back({name, e.shape, e.values, dtype::bf16});
  const std::vector<float> inv(16, 0.5f);
  tensors.push_back({"model.rotary_emb.inv_freq", {16}, inv, dtype::f32});
  write_safetensors((dir / "model.safetensors").string(), tensors);
  const hf_model_files files(dir.string(), c);
  ASSERT_EQ(files.unused().size(), 1u);
  EXPECT_EQ(files.unused()[0], "model.rotary_emb.inv_freq");
  EXPECT_EQ(files.stored_dtype(), "BF16");
  fs::remove_all(dir);
}

TEST(hf_model, written_shards_read_back) {
  const model_config c = preset("tiny-llama");
  const host_weights w = random_weights(c, 3);
  for (dtype type : {dtype::bf16, dtype::f32}) {
    const fs::path dir = fs::temp_directory_path() / ("upipe_hf_write_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    hf_model_writer writer(dir.string(), c, {type, 40'000});
    for (const parameter_spec& p : parameter_specs(c)) {
      const std::vector<float>& v = w.at(p.name);
      const std::size_t half = v.size() / 2;  // in two pieces
      writer.write(p.name, std::span<const float>(v.data(), half));
      writer.write(p.name, std::span<const float>(v.data() + half, v.size() - half));
    }
    const std::vector<std::string> written = writer.commit();
    EXPECT_GT(written.size(), 3u);  // shards and the index
    const auto index = read_json(dir / "model.safetensors.index.json");
    EXPECT_EQ(index["metadata"]["total_parameters"].get<std::int64_t>(), c.parameter_count());
    EXPECT_EQ(index["metadata"]["total_size"].get<std::int64_t>(),
              c.parameter_count() * static_cast<std::int64_t>(dtype_size(type)));
    // Each shard within the limit, or a single tensor larger than it (as transformers cuts).
    std::map<std::string, int> per_shard;
    for (const auto& [name, file] : index["weight_map"].items()) ++per_shard[file.get<std::string>()];
    for (const auto& [file, count] : per_shard)
      if (count > 1) EXPECT_LE(fs::file_size(dir / file), 40'000u + 4096u) << file;
    const host_weights back = read_weights(c, dir.string());
    for (const auto& [name, v] : w) {
      const std::vector<float>& got = back.at(name);
      ASSERT_EQ(got.size(), v.size());
      for (std::size_t i = 0; i < v.size(); ++i) {
        const float want = type == dtype::bf16 ? bf16_to_float(float_to_bf16(v[i])) : v[i];
        ASSERT_EQ(got[i], want) << name << " " << i;
      }
    }
    fs::remove_all(dir);
  }
}

TEST(hf_model, saved_config_keeps_every_field_of_its_base) {
  const fs::path dir = fs::temp_directory_path() / ("upipe_hf_config_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto base = read_json(fixtures + "llama-yarn-shards/config.json");
  model_config c = read_hf_config(fixtures + "llama-yarn-shards");
  // Unchanged: every field as it was, the dtype as saved.
  write_hf_config(c, (dir / "same.json").string(), fixtures + "llama-yarn-shards", "float32");
  auto same = read_json(dir / "same.json");
  EXPECT_EQ(same["dtype"], "float32");
  same["dtype"] = base["dtype"];
  EXPECT_EQ(same, base);
  // A longer context and another RoPE: only those fields change, in the base's style.
  c.rope.theta = 20000;
  c.rope.scaling.factor = 8;
  c.max_position_embeddings = 256;
  write_hf_config(c, (dir / "extended.json").string(), fixtures + "llama-yarn-shards", "bfloat16");
  auto extended = read_json(dir / "extended.json");
  EXPECT_EQ(extended["max_position_embeddings"], 256);
  EXPECT_EQ(extended["rope_parameters"]["rope_type"], "yarn");
  EXPECT_EQ(extended["rope_parameters"]["rope_theta"], 20000.0);
  EXPECT_EQ(extended["rope_parameters"]["factor"], 8.0);
  EXPECT_FALSE(extended.contains("rope_scaling"));
  for (const auto& [key, value] : base.items())
    if (key != "rope_parameters" && key != "max_position_embeddings") EXPECT_EQ(extended[key], value) << key;
  const model_config back = read_hf_config((dir / "extended.json").string());
  EXPECT_EQ(back.rope.scaling.factor, 8.0);
  EXPECT_EQ(back.rope.theta, 20000.0);
  // A YaRN base that leaves the original context to max_position_embeddings: a longer
  // context writes the original out, so that transformers keeps the same frequencies.
  auto implicit = base;
  implicit["rope_parameters"].erase("original_max_position_embeddings");
  std::ofstream(dir / "implicit.json") << implicit.dump();
  model_config longer = read_hf_config((dir / "implicit.json").string());
  EXPECT_EQ(longer.rope.scaling.original_max_position, 128);
  longer.max_position_embeddings = 4096;
  write_hf_config(longer, (dir / "longer.json").string(), (dir / "implicit.json").string(), "bfloat16");
  const auto written = read_json(dir / "longer.json");
  EXPECT_EQ(written["rope_parameters"]["original_max_position_embeddings"], 128);
  EXPECT_EQ(read_hf_config((dir / "longer.json").string()).rope.scaling.original_max_position, 128);
  // A legacy base keeps its legacy keys.
  model_config legacy = preset("tiny-llama");
  write_hf_config(legacy, (dir / "legacy.json").string());
  legacy.rope.scaling = {.kind = rope_kind::linear, .factor = 2.0};
  write_hf_config(legacy, (dir / "legacy2.json").string(), (dir / "legacy.json").string(), "bfloat16");
  const auto legacy2 = read_json(dir / "legacy2.json");
  EXPECT_EQ(legacy2["rope_scaling"]["rope_type"], "linear");
  EXPECT_EQ(legacy2["torch_dtype"], "bfloat16");
  EXPECT_EQ(read_hf_config((dir / "legacy2.json").string()).rope.scaling.kind, rope_kind::linear);
  fs::remove_all(dir);
}

TEST(hf_model, companion_files_are_copied) {
  const fs::path dir = fs::temp_directory_path() / ("upipe_hf_companions_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto copied = copy_companion_files(fixtures + "qwen3-tied", dir.string());
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
    EXPECT_NE(std::find(copied.begin(), copied.end(), f), copied.end()) << f;
    EXPECT_EQ(fs::file_size(dir / f), fs::file_size(fs::path(fixtures + "qwen3-tied") / f)) << f;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace upipe
