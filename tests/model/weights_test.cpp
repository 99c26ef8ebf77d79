#include <gtest/gtest.h>

#include <filesystem>

#include "core/error.hpp"
#include "model/weights.hpp"
#include "train/safetensors.hpp"

namespace upipe {
namespace {

TEST(weights, write_then_read_round_trips_in_f32_and_bf16) {
  const model_config c = preset("tiny-qwen3");
  const host_weights w = random_weights(c, 3);
  const auto dir = std::filesystem::temp_directory_path() / ("upipe_weights_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  write_weights(c, w, (dir / "model.safetensors").string(), dtype::f32);
  EXPECT_EQ(read_weights(c, dir.string()), w);  // a directory holding model.safetensors
  write_weights(c, w, (dir / "bf16.safetensors").string(), dtype::bf16);
  const host_weights b = read_weights(c, (dir / "bf16.safetensors").string());
  for (const auto& [name, values] : w)
    for (std::size_t i = 0; i < values.size(); ++i) ASSERT_EQ(b.at(name)[i], round_to_bf16(values[i])) << name;
  EXPECT_EQ(read_safetensors((dir / "model.safetensors").string()).tensors.count("lm_head.weight"), 0u);  // tied
  std::filesystem::remove_all(dir);
}

TEST(weights, random_weights_are_asymmetric_and_sized_by_the_config) {
  const model_config c = preset("tiny-llama");
  const host_weights w = random_weights(c, 1);
  ASSERT_EQ(w.size(), parameter_specs(c).size());
  const auto& norm = w.at("model.layers.0.input_layernorm.weight");
  EXPECT_NE(norm[0], norm[1]);  // not all ones: a misplaced norm weight shows
  EXPECT_NE(random_weights(c, 2).at("lm_head.weight"), w.at("lm_head.weight"));
}

TEST(weights, a_checkpoint_with_more_layers_is_refused) {
  model_config two = preset("tiny-llama"), one = two;
  one.num_layers = 1;
  const auto path = std::filesystem::temp_directory_path() / ("upipe_layers_" + std::to_string(::getpid()));
  write_weights(two, random_weights(two, 1), path.string(), dtype::f32);
  try {
    read_weights(one, path.string());
    FAIL();
  } catch (const io_error& e) {
    EXPECT_NE(std::string(e.what()).find("has 1 layers"), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace upipe
