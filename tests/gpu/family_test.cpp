// The model families (model/family.hpp) on the CUDA backend against the cpu backend: each
// directory of scripts/make_family_fixtures.py (Qwen2 with q/k/v biases and with a window,
// Mistral's window, Phi-3's fused projections and padding row, Gemma 3's windows, two
// RoPEs, GeGLU, sandwich norms and scaled embedding) gives the cpu's loss and every
// gradient under UPipe, ring, FPDT chunks and hybrid on virtual ranks of one GPU, at 256
// tokens (so the windows of 5 and 6 mask most of every shard); and with PEFT's adapters
// (tests/golden/lora/), the adapters' gradients. And the mixtures of experts of
// scripts/make_moe_fixtures.py with their load-balancing loss.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "model/adapter_files.hpp"
#include "model/model_step.hpp"
#include "step_compare.hpp"

namespace upipe {
namespace {

const char* const families[] = {"qwen2-bias", "qwen2-window", "mistral-window", "phi3-fused", "gemma3-text"};

std::string golden_dir(const std::string& kind, const std::string& name) {
  return std::string(UPIPE_SOURCE_DIR) + "/tests/golden/" + kind + "/" + name;
}

// 256 tokens; the padding token (Phi-3's 5, Gemma's 0) among them.
std::vector<std::int32_t> sequence() {
  std::vector<std::int32_t> tokens(256);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 37 + 11) % 256);
  tokens[40] = 0;
  tokens[41] = 5;
  return tokens;
}

void expect_gpu_matches_cpu(const model_step_request& req, const host_weights& w, const host_weights& adapters,
                            const std::string& what) {
  SCOPED_TRACE(what);
  const step_comparison c = expect_gpu_step_matches_cpu(req, w, sequence(), adapters);
  std::printf("family %s: loss cuda %.6f, cpu %.6f; worst gradient error %.2e\n", what.c_str(), c.gpu.loss, c.cpu.loss,
              c.worst_gradient);
}

std::vector<cp_settings> strategies() {
  cp_settings fpdt{strategy_kind::fpdt, 2, 0};
  fpdt.seq_chunks = 3;
  return {cp_settings{strategy_kind::ulysses, 1, 0}, cp_settings{strategy_kind::upipe, 2, 2},
          cp_settings{strategy_kind::ring, 2, 0}, fpdt, cp_settings{strategy_kind::hybrid, 4, 2, 2}};
}

TEST(gpu_family, every_family_matches_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (const char* name : families) {
    model_step_request req;
    req.model = read_hf_config(golden_dir("hf", name));
    const host_weights w = read_weights(req.model, golden_dir("hf", name));
    req.options.mlp_tile = 24;
    req.options.loss_chunk = 40;
    req.options.attention_input_tile = 40;
    for (const cp_settings& cp : strategies()) {
      req.cp = cp;
      expect_gpu_matches_cpu(req, w, {},
                             std::string(name) + " " + std::string(strategy_name(cp.strategy)) + " C=" +
                                 std::to_string(cp.cp));
    }
  }
}

TEST(gpu_family, peft_adapters_match_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (const char* name : families) {
    model_step_request req;
    req.model = read_hf_config(golden_dir("hf", name));
    const host_weights w = read_weights(req.model, golden_dir("hf", name));
    req.options.lora = read_adapter_config(golden_dir("lora", name), req.model).lora;
    const host_weights adapters = read_adapter_weights(golden_dir("lora", name), req.model, req.options.lora);
    req.options.mlp_tile = 24;
    req.options.loss_chunk = 40;
    req.cp = {strategy_kind::upipe, 2, 2};
    expect_gpu_matches_cpu(req, w, adapters, std::string(name) + " lora upipe C=2");
  }
}

// Qwen3-MoE (a dense layer below sparse ones), Mixtral and Qwen2-MoE (shared expert) with
// the load-balancing loss. The router reads bf16 activations on the GPU and fp32 on the
// cpu, so a token whose k-th and (k+1)-th experts are nearly tied may be routed apart
// (moe_test.cpp counts how often): the GPU run takes the cpu run's choices
// (model/moe_routing_log.hpp), its routing weights from its own probabilities at them, and
// every gradient, the experts' and routers' too, is held to the families' bounds.
TEST(gpu_family, mixtures_of_experts_match_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const std::vector<std::int32_t> tokens = sequence();
  for (const char* name : {"qwen3-moe", "mixtral", "qwen2-moe"}) {
    model_step_request req;
    req.model = read_hf_config(golden_dir("moe", name));
    const host_weights w = read_weights(req.model, golden_dir("moe", name));
    req.options.mlp_tile = 24;
    req.options.loss_chunk = 40;
    req.options.router_aux = router_aux_loss::on;
    for (const cp_settings& cp : {cp_settings{strategy_kind::upipe, 2, 2}, cp_settings{strategy_kind::ring, 2, 0}}) {
      req.cp = cp;
      SCOPED_TRACE(std::string(name) + " " + std::string(strategy_name(cp.strategy)));
      const step_comparison c = expect_gpu_step_matches_cpu(req, w, tokens);
      // The same choices: the same counts, the probability sums of bf16 inputs.
      EXPECT_LT(std::abs(c.gpu.aux_loss - c.cpu.aux_loss) / c.cpu.aux_loss, 1e-2);
      std::printf("family %s %s: loss cuda %.6f, cpu %.6f; aux %.6f, %.6f; worst gradient error %.2e\n", name,
                  std::string(strategy_name(cp.strategy)).c_str(), c.gpu.loss, c.cpu.loss, c.gpu.aux_loss,
                  c.cpu.aux_loss, c.worst_gradient);
    }
  }
}

}  // namespace
}  // namespace upipe
