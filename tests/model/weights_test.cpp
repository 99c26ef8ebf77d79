#include <gtest/gtest.h>

#include <filesystem>
#include <limits>

#include "core/error.hpp"
#include "formats/safetensors.hpp"
#include "model/parameter_store.hpp"
#include "model/weights.hpp"

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

// Weights that are not finite are refused as they load, naming the tensor and the
// element, under every sharding (a damaged file, or a run that diverged).
namespace upipe {
namespace {

TEST(weights, non_finite_values_are_refused_at_load_naming_the_tensor) {
  const model_config config = preset("tiny-llama");
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()})
    for (zero_stage z : {zero_stage::two, zero_stage::three, zero_stage::inference}) {
      host_weights w = random_weights(config, 1);
      w.at("model.layers.1.self_attn.k_proj.weight")[37] = bad;
      auto be = make_cpu_backend({std::size_t{64} << 20, std::size_t{1} << 20});
      auto comm = make_loopback_communicator(*be, 1);
      parameter_store store(config, *be, *comm, z);
      try {
        store.load(w);
        ADD_FAILURE() << "accepted a non-finite weight";
      } catch (const config_error& e) {
        EXPECT_NE(std::string(e.what()).find("model.layers.1.self_attn.k_proj.weight"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("at element 37"), std::string::npos) << e.what();
      }
    }
}

}  // namespace
}  // namespace upipe
