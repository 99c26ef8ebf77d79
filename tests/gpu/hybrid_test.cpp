// The hybrid linear-attention families (scripts/make_hybrid_fixtures.py: Qwen3.5 with three
// Gated DeltaNet layers below a gated full-attention one, Qwen3.5-MoE, Qwen3-Next) on the
// CUDA backend against the cpu backend: the loss and every gradient under each way the
// linear layers run over a CP group on virtual ranks of one GPU (the head layouts' all-to-all
// stages: ulysses and upipe; the sequence layouts' summaries and halos: ring, fpdt's chunks,
// hybrid), with packed documents, and with PEFT's adapters (tests/golden/lora/hybrid-*).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "model/adapter_files.hpp"
#include "model/model_step.hpp"

#include "step_compare.hpp"

namespace upipe {
namespace {

std::string hybrid_dir(const std::string& name) {
  return std::string(UPIPE_SOURCE_DIR) + "/tests/golden/hybrid/" + name;
}

// 256 tokens: several chunks of 64 per shard at C = 1, a partial chunk under CP.
std::vector<std::int32_t> sequence() {
  std::vector<std::int32_t> tokens(256);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 37 + 11) % 256);
  return tokens;
}

// The experts of qwen3_5_moe and qwen3_next take the cpu's choices (step_compare.hpp) and
// are held to the bounds of every other parameter.
void expect_gpu_matches_cpu(const model_step_request& req, const host_weights& w, const host_weights& adapters,
                            const std::string& what) {
  SCOPED_TRACE(what);
  const step_comparison c = expect_gpu_step_matches_cpu(req, w, sequence(), adapters);
  std::printf("hybrid %s: loss cuda %.6f, cpu %.6f; worst gradient error %.2e\n", what.c_str(), c.gpu.loss, c.cpu.loss,
              c.worst_gradient);
}

std::vector<cp_settings> strategies() {
  cp_settings fpdt{strategy_kind::fpdt, 2, 0};
  fpdt.seq_chunks = 3;
  return {cp_settings{strategy_kind::ulysses, 1, 0}, cp_settings{strategy_kind::ulysses, 2, 0},
          cp_settings{strategy_kind::upipe, 2, 2},   cp_settings{strategy_kind::ring, 2, 0},
          fpdt,                                      cp_settings{strategy_kind::hybrid, 4, 2, 2}};
}

model_step_request request(const model_config& model) {
  model_step_request req;
  req.model = model;
  req.options.mlp_tile = 24;
  req.options.loss_chunk = 40;
  req.options.attention_input_tile = 40;
  return req;
}

TEST(gpu_hybrid, every_family_and_layout_matches_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (const char* name : {"qwen3-5", "qwen3-5-moe", "qwen3-next"}) {
    model_step_request req = request(read_hf_config(hybrid_dir(name)));
    const host_weights w = read_weights(req.model, hybrid_dir(name));
    for (const cp_settings& cp : strategies()) {
      req.cp = cp;
      expect_gpu_matches_cpu(req, w, {}, std::string(name) + " " + std::string(strategy_name(cp.strategy)) + " C=" +
                                             std::to_string(cp.cp));
    }
  }
}

// Packed documents reset the state and the convolution at every start, on the GPU as on the cpu.
TEST(gpu_hybrid, packed_documents_match_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  model_step_request req = request(read_hf_config(hybrid_dir("qwen3-5")));
  const host_weights w = read_weights(req.model, hybrid_dir("qwen3-5"));
  req.documents = {0, 37, 38, 100, 161, 200};
  for (const cp_settings& cp : {cp_settings{strategy_kind::ring, 2, 0}, cp_settings{strategy_kind::upipe, 2, 2}}) {
    req.cp = cp;
    expect_gpu_matches_cpu(req, w, {}, std::string("qwen3-5 documents ") + std::string(strategy_name(cp.strategy)));
  }
}

TEST(gpu_hybrid, peft_adapters_match_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (const char* name : {"qwen3-5", "qwen3-next"}) {
    model_step_request req = request(read_hf_config(hybrid_dir(name)));
    const host_weights w = read_weights(req.model, hybrid_dir(name));
    const std::string lora_dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/lora/hybrid-" + name;
    req.options.lora = read_adapter_config(lora_dir, req.model).lora;
    const host_weights adapters = read_adapter_weights(lora_dir, req.model, req.options.lora);
    for (const cp_settings& cp : {cp_settings{strategy_kind::upipe, 2, 2}, cp_settings{strategy_kind::ring, 2, 0}}) {
      req.cp = cp;
      expect_gpu_matches_cpu(req, w, adapters, std::string(name) + " lora " + std::string(strategy_name(cp.strategy)));
    }
  }
}

}  // namespace
}  // namespace upipe
