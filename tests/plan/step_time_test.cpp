// The planner's step-time model: compute from the model's FLOPs at the stated rates, the
// attention's collectives from its stage plan on the links they take, ZeRO's and the host's
// bytes; each term against its own arithmetic.
#include <gtest/gtest.h>

#include "cp/stage_plan.hpp"
#include "model/config.hpp"
#include "plan/step_time.hpp"

namespace upipe {
namespace {

step_time_request request(const char* model, strategy_kind kind, int gpus, int per_node, std::int64_t S) {
  step_time_request r;
  r.model = preset(model);
  // upipe: U = C; hybrid: Ulysses inside each node's group, a ring over the nodes.
  if (kind == strategy_kind::hybrid) r.cp = {kind, gpus, r.model.num_heads, gpus / per_node, 1};
  else r.cp = {kind, gpus, kind == strategy_kind::upipe ? gpus : 0, 1, 1};
  r.gpus_per_node = per_node;
  r.seq_len = S;
  r.policy = {checkpoint_content::layer_input, 1, checkpoint_location::device};
  return r;
}

TEST(step_time, compute_is_the_model_flops_at_the_stated_rates) {
  const step_time_request r = request("llama3-8b", strategy_kind::upipe, 8, 8, 1 << 20);
  throughput_rates rates;
  const step_time t = estimate_step_time(r, rates);
  const model_config& m = r.model;
  const double S = 1 << 20, s = S / 8, D = m.hidden_size, d = m.head_dim;
  const double qkv = D * d * (m.num_heads + 2 * m.num_kv_heads), down = D * m.intermediate_size;
  const double layer = qkv + D * d * m.num_heads + 3 * down;
  const double head = D * static_cast<double>(m.vocab_size);
  // 6 N s for the step, and the recompute's forward of every layer (2 N_layer s) but the
  // MLP's down projection, with q, k and v projected once more for the attention's backward.
  EXPECT_NEAR(t.gemm,
              (6 * (m.num_layers * layer + head) * s + 2 * m.num_layers * (layer - down + qkv) * s) /
                  (rates.gemm_tflops * 1e12),
              1e-9 * t.gemm);
  // Causal attention: 2 S^2 H d forward, twice that backward, and the recompute's forward.
  EXPECT_NEAR(t.attention, m.num_layers * 8 * S * S * m.num_heads * d / 8 / (rates.attention_tflops * 1e12),
              1e-9 * t.attention);
  // Doubling S quadruples the attention and doubles the GEMMs.
  step_time_request twice = r;
  twice.seq_len *= 2;
  const step_time t2 = estimate_step_time(twice, rates);
  EXPECT_NEAR(t2.attention / t.attention, 4.0, 1e-9);
  EXPECT_NEAR(t2.gemm / t.gemm, 2.0, 1e-9);
}

TEST(step_time, the_collectives_take_the_links_of_the_mesh) {
  throughput_rates rates;
  // UPipe over 16 GPUs of two nodes: 8 of each rank's 15 parts leave the node.
  const step_time_request spans = request("llama3-8b", strategy_kind::upipe, 16, 8, 1 << 20);
  const step_time across = estimate_step_time(spans, rates);
  EXPECT_GT(across.all_to_all, 0);
  EXPECT_EQ(across.ring, 0);
  // The same bytes inside one node of 16 run at NVLink's pace only.
  step_time_request one_node = spans;
  one_node.gpus_per_node = 16;
  const step_time inside = estimate_step_time(one_node, rates);
  const stage_plan plan = make_stage_plan(attention_config_for(spans.model, spans.cp, spans.seq_len), 0);
  double leaving = 0;
  for (const pass_plan* pass : {&plan.forward, &plan.forward, &plan.backward})  // forward, its recompute, backward
    for (const plan_message& m : pass->messages())
      if (m.link == plan_link::all_to_all) leaving += static_cast<double>(m.bytes_leaving(dtype::bf16));
  EXPECT_NEAR(inside.all_to_all, spans.model.num_layers * leaving / (rates.nvlink_gbytes * 1e9), 1e-9 * inside.all_to_all);
  EXPECT_NEAR(across.all_to_all,
              spans.model.num_layers * leaving * 8.0 / 15.0 / (rates.network_gbits / 8 * 1e9), 1e-9 * across.all_to_all);
  // Hybrid 2 x 8: the all-to-all stays in the node, the ring crosses at the network's pace.
  const step_time hybrid = estimate_step_time(request("llama3-8b", strategy_kind::hybrid, 16, 8, 1 << 20), rates);
  EXPECT_GT(hybrid.ring, 0);
  EXPECT_LT(hybrid.all_to_all, across.all_to_all);
  // ZeRO's gathers cross nodes too.
  EXPECT_GT(across.zero, inside.zero);
}

TEST(step_time, data_parallel_collectives_take_the_link_they_cross) {
  throughput_rates rates;
  // ZeRO-3 over D x C ranks in two levels: the CP group's share (C - 1) / C of every
  // gather and reduce-scatter, then its 1/C of the unit across the D replicas.
  step_time_request r = request("llama3-8b", strategy_kind::upipe, 4, 8, 128 << 10);
  r.zero = zero_stage::three;
  const model_config& m = r.model;
  const double D = m.hidden_size, d = m.head_dim;
  const double layer = D * d * (2 * m.num_heads + 2 * m.num_kv_heads) + 3 * D * m.intermediate_size;
  // Every stored weight takes part, the norms' too (two a layer and the final one).
  const double weights = m.num_layers * (layer + 2 * D) + D + 2 * D * static_cast<double>(m.vocab_size);
  const double bytes = (2 * 2 + 4) * weights;  // bf16 gathered twice, f32 reduced once
  const double nvlink = rates.nvlink_gbytes * 1e9, network = rates.network_gbits / 8 * 1e9;
  const step_time alone = estimate_step_time(r, rates);
  EXPECT_NEAR(alone.zero, bytes * 3 / 4 / nvlink, 1e-9 * alone.zero);
  EXPECT_EQ(alone.data_parallel, 0);
  // Two replicas in one node of 8: the second level over NVLink; the CP group's unchanged.
  r.dp = 2;
  const step_time two = estimate_step_time(r, rates);
  EXPECT_DOUBLE_EQ(two.zero, alone.zero);
  EXPECT_NEAR(two.data_parallel, bytes / 2 / 4 / nvlink, 1e-9 * two.data_parallel);
  // Four replicas over two nodes: across them at the network's pace.
  r.dp = 4;
  const step_time four = estimate_step_time(r, rates);
  EXPECT_NEAR(four.data_parallel, bytes * 3 / 4 / 4 / network, 1e-9 * four.data_parallel);
  // The compute is a replica's whatever D.
  EXPECT_DOUBLE_EQ(four.gemm, alone.gemm);
  EXPECT_DOUBLE_EQ(four.attention, alone.attention);
}

TEST(step_time, host_copies_count_the_chunks_and_the_checkpoints) {
  throughput_rates rates;
  step_time_request r = request("llama3-8b", strategy_kind::upipe, 8, 8, 1 << 20);
  EXPECT_EQ(estimate_step_time(r, rates).host, 0);
  r.cp.seq_chunks = 4;
  const double chunks = estimate_step_time(r, rates).host;
  EXPECT_GT(chunks, 0);
  r.policy.where = checkpoint_location::host_pinned;
  const double with_checkpoints = estimate_step_time(r, rates).host;
  // 31 layer inputs (s, D) in bf16 out and back.
  const double s = (1 << 20) / 8.0;
  EXPECT_NEAR(with_checkpoints - chunks, 2 * 31 * s * r.model.hidden_size * 2 / (rates.pcie_gbytes * 1e9),
              1e-9 * with_checkpoints);
}

}  // namespace
}  // namespace upipe

namespace upipe {
namespace {

// A sliding window caps the attention: its compute is the window's pairs (S W - W (W - 1)
// / 2 rather than S^2 / 2), ring skips the steps no query reaches, and the chunked
// strategies the parts; a window of S or more changes nothing.
TEST(step_time, a_window_caps_the_attention_and_its_messages) {
  throughput_rates rates;
  for (const strategy_kind kind : {strategy_kind::ring, strategy_kind::upipe, strategy_kind::fpdt}) {
    step_time_request r = request("llama3-8b", kind, 8, 8, 1 << 20);
    if (kind == strategy_kind::fpdt) r.cp = {kind, 8, r.model.num_heads, 1, 16};
    const attention_config global = attention_config_for(r.model, r.cp, r.seq_len);
    attention_config windowed = global;
    windowed.window = 4096;
    const step_time g = layer_attention_time(global, r, rates, 2), w = layer_attention_time(windowed, r, rates, 2);
    const double S = 1 << 20, W = 4096;
    EXPECT_NEAR(w.attention / g.attention, (S * W - W * (W - 1) / 2) / (S * S / 2), 1e-12) << strategy_name(kind);
    if (kind == strategy_kind::ring) EXPECT_LT(w.ring, g.ring / 3);  // 2 of the 7 other ranks' steps are reached
    if (kind == strategy_kind::upipe) EXPECT_EQ(w.all_to_all, g.all_to_all);  // every head still crosses once
    if (kind == strategy_kind::fpdt) EXPECT_LT(w.host, g.host / 2);           // two parts a query part, not i + 1
    windowed.window = 1 << 20;
    const step_time whole = layer_attention_time(windowed, r, rates, 2);
    EXPECT_EQ(whole.attention, g.attention);
    EXPECT_EQ(whole.ring, g.ring);
    EXPECT_EQ(whole.host, g.host);
  }
}

}  // namespace
}  // namespace upipe

#include "model/model_step.hpp"

namespace upipe {
namespace {

// The model's GEMM FLOPs are the engine's: every forward a checkpoint policy runs (the
// first; each layer's again in its own backward, but a kept attention's q, k, v and the
// MLP's down projection; q, k, v once more in the attention's backward; a block's
// re-forward of all but its last layer), the backward's two GEMMs and the head, against
// the meta backend's count of 2 m n k over a step of five layers (a partial last block).
TEST(step_time, the_gemm_flops_are_those_the_step_runs_under_every_policy) {
  for (const char* text : {"what=input,every=1", "what=input,every=2", "what=input,every=3",
                           "what=input+attention,every=1", "what=input+attention,every=2",
                           "what=input+attention,every=4"}) {
    model_step_request req;
    req.model = preset("llama3-8b");
    req.model.num_layers = 5;
    req.cp = {strategy_kind::ulysses, 4, 0};
    req.backend = backend_kind::meta;
    req.options.policy = parse_checkpoint_policy(text);
    req.limits = {std::size_t{1} << 40, std::size_t{1} << 40};
    const model_step_result measured = run_model_step(req, {}, std::vector<std::int32_t>(8192, 0));
    step_time_request r;
    r.model = req.model;
    r.cp = req.cp;
    r.seq_len = 8192;
    r.policy = req.options.policy;
    EXPECT_DOUBLE_EQ(step_gemm_flops(r), measured.gemm_flops.all) << text;
  }
  // Every 4 layers of 32: 24 of them re-forwarded once more than every 1's.
  checkpoint_policy every4{checkpoint_content::layer_input, 4, checkpoint_location::device};
  double block = 0;
  for (int l = 0; l < 32; ++l) block += forward_passes(every4, 32, l).attention - 2;
  EXPECT_EQ(block, 24);
}

step_time_request offloaded(bool optimizer, bool params, bool overlap) {
  step_time_request r = request("llama3-8b", strategy_kind::upipe, 1, 8, 512 << 10);
  r.cp = {strategy_kind::upipe, 1, 1};
  r.policy = {checkpoint_content::layer_input, 4, checkpoint_location::host_pinned};
  r.offload_optimizer = optimizer;
  r.offload_master = !optimizer;
  r.offload_params = params;
  r.state = {moment_format::q8, master_format::bf16_kahan};
  r.grad_bytes = 2;
  r.overlap = overlap;
  return r;
}

// The host's AdamW: the shard's elements at the bytes its part reads and writes, over the
// host's rate; without the overlap the step waits for all of it, with it for the first
// unit's alone while the next forward is longer than the rest; a step with no next step
// waits for all of it either way.
TEST(step_time, the_offloaded_update_is_the_host_adamw_less_what_the_overlap_hides) {
  throughput_rates rates;
  const model_config m = preset("llama3-8b");
  double elements = 0;
  for (const auto& unit : parameter_units(m))
    for (const unit_parameter& p : unit) elements += static_cast<double>(p.numel);
  const double embedding = static_cast<double>(m.vocab_size) * m.hidden_size;
  for (const bool optimizer : {true, false}) {
    const step_time off = estimate_step_time(offloaded(optimizer, true, false), rates);
    const step_time on = estimate_step_time(offloaded(optimizer, true, true), rates);
    // Whole (gradient 2, master and compensation 8, q8 moments 4) or the master's half (its
    // f32 steps 4, master and compensation 8); bf16-kahan's master is the working copy.
    const double bytes = optimizer ? 2 + 8 + 4 : 4 + 8;
    EXPECT_NEAR(off.host_adamw, elements * bytes / (rates.host_adamw_gbytes * 1e9), 1e-9 * off.host_adamw);
    EXPECT_DOUBLE_EQ(off.host_adamw_exposed, off.host_adamw);
    EXPECT_DOUBLE_EQ(on.host_adamw, off.host_adamw);
    EXPECT_NEAR(on.host_adamw_exposed, embedding * bytes / (rates.host_adamw_gbytes * 1e9), 1e-9 * on.host_adamw);
    EXPECT_NEAR(on.total() + on.lone_step_extra, off.total(), 1e-9 * off.total());
    EXPECT_DOUBLE_EQ(off.lone_step_extra, 0);
    // The steps (or the gradient shards) out on the step's stream; the weights come in beside it.
    EXPECT_NEAR(on.offload_copies, elements * (optimizer ? 2 : 4) / (rates.pcie_gbytes * 1e9), 1e-9 * on.offload_copies);
    EXPECT_EQ(on.weights_in, 0);
  }
  // A host slower than the forward: the overlap hides a forward's worth.
  throughput_rates slow = rates;
  slow.host_adamw_gbytes = 1e-3;
  const step_time crawl = estimate_step_time(offloaded(true, true, true), slow);
  EXPECT_NEAR(crawl.host_adamw - crawl.host_adamw_exposed, crawl.forward, 1e-9 * crawl.host_adamw);
  // Nothing offloaded: the device's AdamW alone.
  step_time_request none = offloaded(true, false, true);
  none.offload_optimizer = none.offload_master = false;
  const step_time device = estimate_step_time(none, rates);
  EXPECT_EQ(device.host_adamw, 0);
  EXPECT_GT(device.update, 0);
}

}  // namespace
}  // namespace upipe
