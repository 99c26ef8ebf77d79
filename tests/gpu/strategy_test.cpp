// Every CP strategy on the CUDA backend with 2 and 4 virtual ranks sharing one GPU
// (threads communicator, device copies), against the float64 reference; and a whole
// training step of a tiny model against the cpu backend.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include "model/hf_model.hpp"
#include "model/model_step.hpp"
#include "runtime/attention_experiment.hpp"
#include "train/trainer.hpp"

#include "../support/compare.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

TEST(gpu_strategies, virtual_ranks_match_the_reference) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (int cp : {1, 2, 4})
    for (auto kind : {strategy_kind::ulysses, strategy_kind::upipe, strategy_kind::ring}) {
      std::vector<int> chunks = kind == strategy_kind::upipe ? valid_head_chunks(8, cp) : std::vector<int>{0};
      for (int u : chunks)
        for (bool qk_norm : {false, true}) {
          attention_config c{.seq_len = 512, .heads = 8, .kv_heads = 2, .head_dim = 64, .model_dim = 256, .cp = cp,
                             .head_chunk = u, .strategy = kind};
          c.qk_norm = qk_norm;
          experiment_options o;
          o.backend = backend_kind::cuda;
          o.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
          const experiment_result r = run_attention_experiment(c, o);
          ASSERT_TRUE(r.max_rel_error.has_value());
          for (const auto& [name, e] : r.rel_error)
            EXPECT_LT(e, bf16_tolerance) << strategy_name(kind) << " C=" << cp << " U=" << u << " qk_norm=" << qk_norm
                                         << " " << name;
        }
    }
}

// Hybrid on virtual ranks: 2 x 2 and 4 x 1 (and 2 x 4 on eight), Ulysses and every UPipe U
// inside the groups, with and without packed documents, against the float64 reference.
TEST(gpu_strategies, hybrid_meshes_match_the_reference) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (auto [cp, ring] : {std::pair{4, 2}, std::pair{4, 4}, std::pair{8, 2}})
    for (int u : valid_head_chunks(8, cp / ring))
      for (bool documents : {false, true}) {
        attention_config c{.seq_len = 512, .heads = 8, .kv_heads = 2, .head_dim = 64, .model_dim = 256, .cp = cp,
                           .head_chunk = u, .ring = ring, .strategy = strategy_kind::hybrid};
        experiment_options o;
        o.backend = backend_kind::cuda;
        o.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
        if (documents) o.documents = {0, 1, 64, 200, 201, 333, 384};
        const experiment_result r = run_attention_experiment(c, o);
        ASSERT_TRUE(r.max_rel_error.has_value());
        for (const auto& [name, e] : r.rel_error)
          EXPECT_LT(e, bf16_tolerance) << ring << "x" << cp / ring << " U=" << u << " documents=" << documents << " "
                                       << name;
      }
}

// Sequence chunks on the GPU: fpdt and upipe with N chunks (some uneven) keep the earlier
// chunks' K/V in pinned host memory and bring them back on the copy stream while the
// previous chunk is attended; the backward's dK/dV go to the host and back the same way.
// Against the float64 reference, with packed documents and qk-norm on some; the ledger's
// attention peaks equal the plan's.
TEST(gpu_strategies, sequence_chunks_prefetch_from_host_memory) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (int cp : {1, 2, 4})
    for (auto kind : {strategy_kind::fpdt, strategy_kind::upipe})
      for (int n : {2, 3, 5})
        for (bool documents : {false, true}) {
          attention_config c{.seq_len = 480, .heads = 8, .kv_heads = 2, .head_dim = 64, .model_dim = 256, .cp = cp,
                             .head_chunk = 0, .seq_chunks = n, .strategy = kind};
          c.qk_norm = documents;
          experiment_options o;
          o.backend = backend_kind::cuda;
          o.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
          if (documents) o.documents = {0, 1, 64, 200, 201, 333, 384};
          const experiment_result r = run_attention_experiment(c, o);
          ASSERT_TRUE(r.max_rel_error.has_value());
          for (const auto& [name, e] : r.rel_error)
            EXPECT_LT(e, bf16_tolerance) << strategy_name(kind) << " C=" << cp << " N=" << n
                                         << " documents=" << documents << " " << name;
          EXPECT_EQ(r.attention_forward_peak, r.plan_forward_peak);
          EXPECT_EQ(r.attention_backward_peak, r.plan_backward_peak);
          EXPECT_GT(r.attention_host_peak, 0u);
        }
}

// Packed documents: cuDNN runs each document (and ring's one shared document of a past
// block) as a call of its own; every strategy equals the float64 reference. Boundaries
// inside and on the edges of shards and ring's chunks, a one-token document and one
// longer than a shard.
TEST(gpu_strategies, packed_documents_match_the_reference) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const std::vector<std::int64_t> documents = {0, 1, 64, 200, 201, 333, 384};
  for (int cp : {1, 2, 4})
    for (auto kind : {strategy_kind::ulysses, strategy_kind::upipe, strategy_kind::ring}) {
      attention_config c{.seq_len = 512, .heads = 8, .kv_heads = 2, .head_dim = 64, .model_dim = 256, .cp = cp,
                         .head_chunk = 0, .strategy = kind};
      experiment_options o;
      o.backend = backend_kind::cuda;
      o.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
      o.documents = documents;
      const experiment_result r = run_attention_experiment(c, o);
      ASSERT_TRUE(r.max_rel_error.has_value());
      for (const auto& [name, e] : r.rel_error)
        EXPECT_LT(e, bf16_tolerance) << strategy_name(kind) << " C=" << cp << " " << name;
    }
}

// A sliding window under every strategy on virtual ranks: cuDNN's diagonal band after
// Ulysses' and UPipe's all-to-all, ring's and hybrid's skipped steps with their banded past
// blocks, the chunked strategies' skipped parts; W shorter than a ring chunk and longer
// than a shard, packed documents on one; against the float64 reference.
TEST(gpu_strategies, sliding_windows_match_the_reference) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  struct windowed {
    strategy_kind kind;
    int cp, ring, seq_chunks;
  };
  const windowed cases[] = {{strategy_kind::ulysses, 4, 1, 0}, {strategy_kind::upipe, 4, 1, 0},
                            {strategy_kind::ring, 4, 1, 0},    {strategy_kind::hybrid, 4, 2, 0},
                            {strategy_kind::fpdt, 2, 1, 3},    {strategy_kind::upipe, 2, 1, 4}};
  for (const windowed& w : cases)
    for (const std::int64_t window : {40, 100, 300}) {
      attention_config c{.seq_len = 512, .heads = 8, .kv_heads = 2, .head_dim = 64, .model_dim = 256, .cp = w.cp,
                         .head_chunk = 0, .ring = w.ring, .seq_chunks = w.seq_chunks, .strategy = w.kind};
      c.window = window;
      experiment_options o;
      o.backend = backend_kind::cuda;
      o.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
      if (window == 100) o.documents = {0, 1, 64, 200, 201, 333, 384};
      const experiment_result r = run_attention_experiment(c, o);
      ASSERT_TRUE(r.max_rel_error.has_value());
      for (const auto& [name, e] : r.rel_error)
        EXPECT_LT(e, bf16_tolerance) << strategy_name(w.kind) << " C=" << w.cp << " W=" << window << " " << name;
      EXPECT_EQ(r.attention_forward_peak, r.plan_forward_peak);
      EXPECT_EQ(r.attention_backward_peak, r.plan_backward_peak);
    }
}

// Checkpoints on the device, and in pinned or pageable host memory through the copy
// stream (offload while the layer runs, prefetch during the previous layer's backward;
// pageable through the bounce buffers).
TEST(gpu_model, training_step_matches_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (const char* policy : {"what=input,every=1,where=device", "what=input,every=1,where=host-pinned",
                             "what=input+attention,every=2,where=host-pinned", "what=input,every=1,where=host-pageable",
                             "what=input+attention,every=2,where=host-pageable"})
  for (const char* name : {"tiny-llama", "tiny-qwen3"}) {
    model_step_request req;
    req.options.policy = parse_checkpoint_policy(policy);
    req.model = preset(name);
    req.cp = {strategy_kind::upipe, 2, 0};
    req.options.mlp_tile = 24;
    req.options.loss_chunk = 40;
    req.options.attention_input_tile = 40;  // 128 local tokens: the backward norms its input in tiles
    const host_weights w = random_weights(req.model, 3);
    std::vector<std::int32_t> tokens(256);
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 37 + 11) % 256);
    req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
    const model_step_result cpu = run_model_step(req, w, tokens);
    req.backend = backend_kind::cuda;
    req.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
    req.limits.host_pageable = req.options.policy.where == checkpoint_location::host_pageable;
    const model_step_result gpu = run_model_step(req, w, tokens);
    EXPECT_LT(std::abs(gpu.loss - cpu.loss) / cpu.loss, bf16_tolerance) << name << " " << policy;
    for (const auto& [param, values] : cpu.grads)
      EXPECT_LT(testing::max_difference_over_max(gpu.grads.at(param), values), 5e-2) << name << " " << policy << " " << param;
  }
}

// Model directories as save_pretrained writes them (bf16 shards with YaRN, a tied Qwen3,
// fp16 with linear scaling), loaded as `--model DIR` loads them, on a sequence of packed
// documents: the GPU's step equals the cpu backend's on the same weights, under ulysses
// and upipe at C = 2.
TEST(gpu_model, hf_directories_step_like_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (const char* name : {"llama-yarn-shards", "qwen3-tied", "llama-fp16-linear"})
    for (strategy_kind kind : {strategy_kind::ulysses, strategy_kind::upipe}) {
      const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/hf/" + name;
      model_step_request req;
      req.model = read_hf_config(dir);
      req.cp = {kind, 2, 0};
      const host_weights w = read_weights(req.model, dir);
      req.documents = {0, 17, 18, 70};  // packed documents too
      std::vector<std::int32_t> tokens(128);
      for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 53 + 7) % 256);
      req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
      const model_step_result cpu = run_model_step(req, w, tokens);
      req.backend = backend_kind::cuda;
      req.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
      const model_step_result gpu = run_model_step(req, w, tokens);
      EXPECT_LT(std::abs(gpu.loss - cpu.loss) / cpu.loss, bf16_tolerance) << name;
      for (const auto& [param, values] : cpu.grads)
        EXPECT_LT(testing::max_difference_over_max(gpu.grads.at(param), values), 5e-2) << name << " " << param;
    }
}

// Forward-only evaluation (upipe eval, eval --niah) on the GPU: each target's loss near
// the cpu backend's under upipe and hybrid, and the argmax at the asked positions the
// same where the cpu's prediction is clear (a margin over bf16's rounding).
TEST(gpu_model, evaluation_scores_like_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/hf/llama-yarn-shards";
  const model_config config = read_hf_config(dir);
  const hf_model_files files(dir, config);
  eval_sequence seq;
  for (int i = 0; i < 256; ++i) seq.tokens.push_back((i * 53 + 7) % 256);
  for (int i = 0; i < 255; i += 5) seq.argmax_at.push_back(i);
  for (const cp_settings cp : {cp_settings{strategy_kind::upipe, 2, 0}, cp_settings{strategy_kind::hybrid, 4, 0, 2}}) {
    model_step_request req;
    req.model = config;
    req.cp = cp;
    req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
    const eval_result cpu = evaluate(req, files, {seq});
    req.backend = backend_kind::cuda;
    req.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
    const eval_result gpu = evaluate(req, files, {seq});
    ASSERT_EQ(gpu.target_loss[0].size(), cpu.target_loss[0].size());
    EXPECT_LT(testing::max_difference_over_max(gpu.target_loss[0], cpu.target_loss[0]), bf16_tolerance);
    int same = 0;
    for (std::size_t j = 0; j < seq.argmax_at.size(); ++j) same += gpu.argmax[0][j] == cpu.argmax[0][j];
    EXPECT_GE(same, static_cast<int>(0.9 * static_cast<double>(seq.argmax_at.size())));
  }
}

// --offload optimizer on the GPU: the gradient shards cross to pinned host memory as each
// unit's backward ends, AdamW runs on the host's cores and the bf16 weights come back; ten
// steps of a tiny Llama follow the run whose AdamW ran on the GPU (ZeRO-2 and ZeRO-3).
TEST(gpu_model, offloaded_optimizer_trains_like_the_device_optimizer) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (zero_stage z : {zero_stage::two, zero_stage::three}) {
    train_options o;
    o.model = preset("tiny-llama");
    o.seq_len = 128;
    o.cp = {strategy_kind::upipe, 2, 0};
    o.zero = z;
    o.optim.lr = 3e-3;
    o.optim.total_steps = 10;
    o.eval_samples = 0;
    o.backend = backend_kind::cuda;
    o.limits = {std::size_t{1} << 30, std::size_t{256} << 20};
    const train_summary device = train(o, nullptr);
    o.offload_optimizer = true;
    const train_summary host = train(o, nullptr);
    ASSERT_EQ(host.steps.size(), device.steps.size());
    for (std::size_t i = 0; i < host.steps.size(); ++i)
      EXPECT_LT(std::abs(host.steps[i].loss - device.steps[i].loss) / device.steps[i].loss, bf16_tolerance)
          << "step " << i + 1;
    EXPECT_EQ(host.peak_bytes[0].at("optimizer"), 0u);
    EXPECT_GT(host.peak_bytes[0].at("optimizer_host"), 0u);
  }
}

}  // namespace
}  // namespace upipe
