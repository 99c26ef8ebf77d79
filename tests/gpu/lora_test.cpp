// LoRA on the CUDA backend (bf16 base frozen, adapters in bf16 with fp32 masters) against
// the cpu backend: PEFT's adapters (tests/golden/lora/) on their tiny bases give the cpu's
// loss and adapter gradients under UPipe, ring and hybrid on virtual ranks of one GPU; the
// frozen base holds no gradient; and LoRA training steps (ZeRO-3 base) follow the cpu's.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "model/adapter_files.hpp"
#include "model/model_step.hpp"
#include "train/trainer.hpp"

#include "../support/compare.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

TEST(gpu_lora, adapter_step_matches_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (const char* name : {"tiny-llama", "tiny-qwen3"}) {
    const std::string base = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/" + name;
    const std::string adapter = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/lora/" + name;
    model_step_request req;
    req.model = read_hf_config(base);
    const host_weights w = read_weights(req.model, base);
    req.options.lora = read_adapter_config(adapter, req.model).lora;
    const host_weights adapters = read_adapter_weights(adapter, req.model, req.options.lora);
    req.options.mlp_tile = 24;
    req.options.loss_chunk = 40;
    req.options.attention_input_tile = 40;  // 128 local tokens at C = 2: the attention input in tiles
    std::vector<std::int32_t> tokens(256);
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 37 + 11) % 256);
    for (const cp_settings cp : {cp_settings{strategy_kind::upipe, 2, 2}, cp_settings{strategy_kind::upipe, 2, 4},
                                 cp_settings{strategy_kind::ring, 2, 0}, cp_settings{strategy_kind::hybrid, 4, 2, 2}}) {
      const std::string what = std::string(name) + " " + std::string(strategy_name(cp.strategy)) + " C=" +
                               std::to_string(cp.cp) + " U=" + std::to_string(cp.head_chunk);
      req.cp = cp;
      req.backend = backend_kind::cpu;
      req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
      const model_step_result cpu = run_model_step(req, w, tokens, adapters);
      req.backend = backend_kind::cuda;
      req.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
      const model_step_result gpu = run_model_step(req, w, tokens, adapters);
      std::printf("lora %s: loss cuda %.6f, cpu %.6f\n", what.c_str(), gpu.loss, cpu.loss);
      EXPECT_LT(std::abs(gpu.loss - cpu.loss) / cpu.loss, bf16_tolerance) << what;
      ASSERT_EQ(gpu.grads.size(), cpu.grads.size()) << what;
      for (const auto& [param, values] : cpu.grads)
        EXPECT_LT(testing::max_difference_over_max(gpu.grads.at(param), values), 5e-2) << what << " " << param;
      // The frozen base: the only gradients on the GPU are the adapters' (f32).
      EXPECT_EQ(gpu.peak_bytes.at("grads"), 4 * static_cast<std::size_t>(lora_parameter_count(req.model, req.options.lora)))
          << what;
    }
  }
}

TEST(gpu_lora, training_steps_follow_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  train_options o;
  o.model = preset("tiny-llama");
  o.seq_len = 128;
  o.cp = {strategy_kind::upipe, 2, 0};
  o.zero = zero_stage::three;
  o.step.lora = parse_lora("r=8,alpha=16", o.model);
  o.optim.lr = 1e-2;
  o.optim.total_steps = 8;
  o.eval_samples = 0;
  o.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  const train_summary cpu = train(o, nullptr);
  o.backend = backend_kind::cuda;
  o.limits = {std::size_t{1} << 30, std::size_t{256} << 20};
  const train_summary gpu = train(o, nullptr);
  ASSERT_EQ(gpu.steps.size(), cpu.steps.size());
  for (std::size_t i = 0; i < gpu.steps.size(); ++i)
    EXPECT_LT(std::abs(gpu.steps[i].loss - cpu.steps[i].loss) / cpu.steps[i].loss, bf16_tolerance) << "step " << i + 1;
  EXPECT_LT(gpu.steps.back().loss, gpu.steps.front().loss);  // the adapters learn on the GPU too
}

}  // namespace
}  // namespace upipe
