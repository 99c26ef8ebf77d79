// Whole-model memory on the meta backend: the GPU's allocator and ledger, no data.
#include <gtest/gtest.h>

#include "model/model_step.hpp"

namespace upipe {
namespace {

model_step_result meta_step(const std::string& model, std::int64_t S, int cp, const std::string& policy = "") {
  model_step_request req;
  req.model = preset(model);
  req.cp = {strategy_kind::upipe, cp, 0};
  req.backend = backend_kind::meta;
  req.limits = {std::size_t{1} << 50, std::size_t{1} << 50};
  req.options.policy = parse_checkpoint_policy(policy);
  req.record_timeline = true;
  const std::vector<std::int32_t> tokens(static_cast<std::size_t>(S), 0);
  return run_model_step(req, {}, tokens);
}

constexpr std::size_t bf16 = 2, f32 = 4;

TEST(model_memory, llama3_8b_one_million_tokens_on_eight_ranks) {
  const model_step_result r = meta_step("llama3-8b", 1 << 20, 8);
  const model_config c = preset("llama3-8b");
  const std::size_t params = static_cast<std::size_t>(c.parameter_count());
  EXPECT_EQ(r.peak_bytes.at("weights"), params * bf16);
  EXPECT_EQ(r.peak_bytes.at("grads"), params * f32);
  // One layer-input checkpoint per layer but the first (backward looks the ids up again):
  // s x D bf16 each, s = 1M / 8.
  const std::size_t s = (1 << 20) / 8;
  EXPECT_EQ(r.peak_bytes.at("checkpoints_device"), (c.num_layers - 1) * s * c.hidden_size * bf16);
  EXPECT_EQ(r.peak_bytes.at("checkpoints_host"), 0u);
  EXPECT_GT(r.peak_bytes.at("attention"), 0u);
  EXPECT_GT(r.peak_bytes.at("activations"), 0u);
  EXPECT_GT(r.device_peak_bytes, r.peak_bytes.at("weights") + r.peak_bytes.at("grads"));
}

TEST(model_memory, default_tile_and_chunk_are_full_size_on_a_large_gpu_and_a_small_share_of_a_small_one) {
  const model_config c = preset("llama3-8b");
  const std::size_t V = static_cast<std::size_t>(c.vocab_size);
  const step_options large = with_default_sizes({}, c, std::size_t{139} << 30);
  EXPECT_EQ(large.mlp_tile, max_mlp_tile);
  EXPECT_EQ(static_cast<std::size_t>(large.loss_chunk), max_logits_bytes / (4 * V));
  const std::size_t small_gpu = std::size_t{6} << 30;
  const step_options small = with_default_sizes({}, c, small_gpu);
  const auto tile = static_cast<std::size_t>(small.mlp_tile);
  EXPECT_EQ(tile % 256, 0u);
  EXPECT_GE(tile, 256u);
  EXPECT_LE(tile * (2 * (4 * c.intermediate_size + 2 * c.hidden_size) + 4), small_gpu / 64);
  EXPECT_LE(static_cast<std::size_t>(small.loss_chunk) * 4 * V, small_gpu / 64);
  EXPECT_GE(small.loss_chunk, 1);
  // Sizes given are kept; negative ones are refused, naming the value.
  const step_options given = with_default_sizes({1000, 77, {}}, c, small_gpu);
  EXPECT_EQ(given.mlp_tile, 1000);
  EXPECT_EQ(given.loss_chunk, 77);
  try {
    with_default_sizes({-5, 0, {}}, c, small_gpu);
    ADD_FAILURE() << "a negative tile was accepted";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("--mlp-tile -5"), std::string::npos) << e.what();
  }
}

TEST(model_memory, tiled_mlp_peak_is_one_tile_whatever_the_length) {
  const model_config c = preset("llama3-8b");
  const std::size_t D = c.hidden_size, F = c.intermediate_size;
  const auto t = static_cast<std::size_t>(with_default_sizes({}, c, std::size_t{1} << 50).mlp_tile);
  // Backward of one tile: norm output and its rstd, gate, up, activation, d_act and the
  // working copy of the incoming gradient.
  const std::size_t tile = 2 * t * D * bf16 + 4 * t * F * bf16 + t * f32;
  for (std::int64_t S : {std::int64_t{1} << 16, std::int64_t{1} << 17}) {
    const model_step_result r = meta_step("llama3-8b", S, 8);
    EXPECT_EQ(peak_of_labels(r.timeline, {"mlp_"}), tile) << "S = " << S;
  }
}

TEST(model_memory, loss_peak_is_one_chunk_of_logits_whatever_the_length) {
  const model_config c = preset("llama3-8b");
  const std::size_t V = static_cast<std::size_t>(c.vocab_size), D = c.hidden_size;
  const auto n = static_cast<std::size_t>(with_default_sizes({}, c, std::size_t{1} << 50).loss_chunk);
  EXPECT_EQ(n, max_logits_bytes / (4 * V));
  const std::size_t chunk = n * D * bf16 + n * f32 + n * V * f32 + n * V * bf16;
  for (std::int64_t S : {std::int64_t{1} << 16, std::int64_t{1} << 18}) {
    const model_step_result r = meta_step("llama3-8b", S, 8);
    EXPECT_EQ(peak_of_labels(r.timeline, {"final_norm", "logits", "d_logits", "d_final_norm"}), chunk) << S;
  }
}

// The planner's probes run the first and the last MLP tile and loss chunk only: the peaks,
// every part's working set and the arena's high water are those of the step that runs them
// all, with tiles of one token, of a few, and with a shorter last one.
TEST(model_memory, probes_of_distinct_tile_shapes_hold_the_peaks_of_every_tile) {
  for (const auto& [tile, chunk] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {5, 7}, {8, 16}, {100, 3}}) {
    const auto run = [&](tile_sweep sweep) {
      model_step_request req;
      req.model = preset("tiny-qwen3");
      req.cp = {strategy_kind::upipe, 2, 0};
      req.backend = backend_kind::meta;
      req.limits = {std::size_t{1} << 40, std::size_t{1} << 40};
      req.options = {tile, chunk, parse_checkpoint_policy("what=input,every=2")};
      req.options.meta_tiles = sweep;
      req.record_timeline = true;
      return run_model_step(req, {}, std::vector<std::int32_t>(256, 0));
    };
    const model_step_result all = run(tile_sweep::every_tile), two = run(tile_sweep::distinct_shapes);
    EXPECT_EQ(two.peak_bytes, all.peak_bytes) << "tile " << tile << ", chunk " << chunk;
    EXPECT_EQ(two.device_peak_bytes, all.device_peak_bytes) << "tile " << tile << ", chunk " << chunk;
    for (const char* part : {"mlp_", "logits", "final_norm"})
      EXPECT_EQ(peak_of_labels(two.timeline, {part}), peak_of_labels(all.timeline, {part})) << part << " " << tile;
    EXPECT_LT(two.timeline.size(), all.timeline.size());  // fewer tiles ran
  }
}

TEST(model_memory, checkpoint_policies_move_bytes_between_device_and_host) {
  const model_config c = preset("llama3.2-1b");
  const std::int64_t S = 1 << 16;
  const std::size_t s = S / 8, input = s * c.hidden_size * bf16;
  const std::size_t attention = s * c.num_heads * c.head_dim * bf16 + c.num_heads / 8 * S * f32;  // out + lse
  const std::size_t L = c.num_layers;
  struct expectation {
    const char* policy;
    std::size_t device, host;
  };
  // Layer 0's input is never kept (backward looks the token ids up again); its attention
  // output is, when the policy keeps attention.
  const expectation cases[] = {
      {"what=input,every=1,where=device", (L - 1) * input, 0},
      {"what=input,every=1,where=host-pinned", 0, (L - 1) * input},
      {"what=input,every=4,where=host-pageable", 0, (L / 4 - 1) * input},
      {"what=input+attention,every=1,where=device", (L - 1) * input + L * attention, 0},
      {"what=input+attention,every=2,where=host-pinned", 0, (L / 2 - 1) * input + L / 2 * attention},
  };
  for (const expectation& e : cases) {
    const model_step_result r = meta_step("llama3.2-1b", S, 8, e.policy);
    EXPECT_EQ(r.peak_bytes.at("checkpoints_device"), e.device) << e.policy;
    EXPECT_EQ(r.peak_bytes.at("checkpoints_host"), e.host) << e.policy;
  }
}

}  // namespace
}  // namespace upipe

namespace upipe {
namespace {

// Packed documents cost no memory: the mask is the list of starts, not a matrix, so the
// meta backend's peaks are those of the same step without documents, for every strategy.
TEST(model_memory, packed_documents_cost_no_memory) {
  for (auto kind : {strategy_kind::ulysses, strategy_kind::upipe, strategy_kind::ring}) {
    model_step_request req;
    req.model = preset("llama3-8b");
    req.model.num_layers = 2;
    req.cp = {kind, 8, 0};
    req.backend = backend_kind::meta;
    req.limits = {std::size_t{1} << 50, std::size_t{1} << 50};
    const std::vector<std::int32_t> tokens(std::size_t{1} << 17, 0);
    const model_step_result plain = run_model_step(req, {}, tokens);
    req.documents = {0, 1000, 1001, 70000, 100000};
    const model_step_result packed = run_model_step(req, {}, tokens);
    EXPECT_EQ(packed.peak_bytes, plain.peak_bytes) << strategy_name(kind);
    EXPECT_EQ(packed.device_peak_bytes, plain.device_peak_bytes) << strategy_name(kind);
  }
}

}  // namespace
}  // namespace upipe
