// Communication volume: the counters equal each strategy's stage plan, message label by
// message label, and the plans equal the analytic byte counts. UPipe sends each kv head
// once per (destination rank, pass), and its Q/O bytes equal Ulysses'; sequence chunks
// keep the volume and add the host copies.
#include <gtest/gtest.h>

#include <algorithm>

#include "cp/head_schedule.hpp"
#include "cp/stage_plan.hpp"
#include "runtime/attention_experiment.hpp"

namespace upipe {
namespace {

// What rank 0's counters must show by label: the plan's messages over the all-to-all group
// and the ring (host copies are not the communicator's). Hybrid's all-to-all group runs on
// point-to-point rounds of the CP group, which count only the bytes that leave the rank.
std::map<std::string, std::uint64_t> planned_counts(const attention_config& c) {
  const stage_plan p = make_stage_plan(c, 0);
  std::map<std::string, std::uint64_t> out;
  for (const pass_plan* pass : {&p.forward, &p.backward})
    for (const plan_message& m : pass->messages()) {
      if (m.link != plan_link::all_to_all && m.link != plan_link::ring) continue;
      const bool rounds = c.strategy == strategy_kind::hybrid && m.link == plan_link::all_to_all;
      out[m.label] += rounds ? m.bytes_leaving(dtype::f32) : m.bytes(dtype::f32);
    }
  return out;
}

void expect_counters_follow_the_plan(const experiment_result& r) {
  EXPECT_EQ(r.bytes_sent_by_label, planned_counts(r.config));
}

experiment_result run(strategy_kind kind, int H, int K, int C, int U, std::int64_t S, int d) {
  const attention_config c = {.seq_len = S, .heads = H, .kv_heads = K, .head_dim = d, .model_dim = 16, .cp = C,
                              .head_chunk = U, .strategy = kind};
  experiment_options o;
  o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
  return run_attention_experiment(c, o);
}

std::uint64_t label(const experiment_result& r, const std::string& name) {
  auto it = r.bytes_sent_by_label.find(name);
  return it == r.bytes_sent_by_label.end() ? 0 : it->second;
}

TEST(counters, upipe_and_ulysses_match_the_analytic_volume) {
  const std::int64_t S = 32, d = 8, f32 = 4;
  for (auto [H, K, C] : {std::tuple{8, 4, 2}, {8, 2, 4}, {8, 1, 4}, {12, 4, 2}, {16, 16, 4}, {8, 8, 4}}) {
    const std::int64_t s = S / C;
    const std::uint64_t q_bytes = s * H * d * f32;
    // Each destination needs max(K/C, 1) kv heads, and every rank sends its s tokens of each.
    const std::uint64_t kv_bytes = std::int64_t{C} * std::max(K / C, 1) * s * d * f32;
    experiment_result uly = run(strategy_kind::ulysses, H, K, C, 0, S, static_cast<int>(d));
    for (int U = C; U <= H; U += C) {
      if (H % U) continue;
      experiment_result up = run(strategy_kind::upipe, H, K, C, U, S, static_cast<int>(d));
      for (const experiment_result* r : {&uly, &up}) {
        SCOPED_TRACE("H" + std::to_string(H) + " K" + std::to_string(K) + " C" + std::to_string(C) + " U" +
                     std::to_string(r->config.head_chunk));
        expect_counters_follow_the_plan(*r);
        for (const char* name : {"a2a_q", "a2a_o", "bwd_a2a_q", "bwd_a2a_o", "bwd_a2a_do", "bwd_a2a_dq"})
          EXPECT_EQ(label(*r, name), q_bytes) << name;
        for (const char* name : {"a2a_k", "a2a_v", "bwd_a2a_k", "bwd_a2a_v", "bwd_a2a_dk", "bwd_a2a_dv"})
          EXPECT_EQ(label(*r, name), kv_bytes) << name;
        EXPECT_EQ(r->bytes_sent.at("all_to_all"), 6 * q_bytes + 6 * kv_bytes);
      }
    }
  }
}

TEST(counters, ring_circulates_kv_and_fp32_gradients) {
  const std::int64_t S = 48, d = 8;
  for (auto [H, K, C] : {std::tuple{8, 2, 4}, {4, 4, 2}, {12, 3, 3}}) {
    const std::int64_t s = S / C;
    const std::uint64_t kv = 2 * s * K * d * 4;  // k and v of the local tokens, f32 on the cpu backend
    const experiment_result r = run(strategy_kind::ring, H, K, C, 0, S, static_cast<int>(d));
    expect_counters_follow_the_plan(r);
    // Forward and backward each send this rank's K/V to the C - 1 others; backward sends
    // the dK/dV (f32) of each visiting block back to its owner.
    EXPECT_EQ(label(r, "ring_kv"), 2 * (C - 1) * kv);
    EXPECT_EQ(label(r, "ring_dkv"), (C - 1) * kv);
    EXPECT_EQ(r.bytes_sent.at("send"), 3 * (C - 1) * kv);
    EXPECT_EQ(r.bytes_sent.count("all_to_all"), 0u);
  }
}

// Hybrid per mesh dimension: inside a group of A ranks the stages' all-to-alls carry
// Ulysses' volume for A ranks (of which (A - 1) / A leaves the rank, over the CP group's
// point-to-point sends); across the R groups each call's kv heads circulate as in ring, for
// the group's G = S / R tokens.
TEST(counters, hybrid_matches_the_volume_of_each_mesh_dimension) {
  const std::int64_t S = 48, d = 8, f32 = 4;
  for (auto [H, K, C, R] : {std::tuple{8, 2, 4, 2}, {8, 8, 4, 2}, {12, 4, 6, 3}, {8, 2, 8, 4}, {4, 2, 4, 4}})
    for (int U : valid_head_chunks(H, C / R)) {
      const int A = C / R;
      attention_config c = {.seq_len = S, .heads = H, .kv_heads = K, .head_dim = static_cast<int>(d), .model_dim = 16,
                            .cp = C, .head_chunk = U, .ring = R, .strategy = strategy_kind::hybrid};
      experiment_options o;
      o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
      const experiment_result r = run_attention_experiment(c, o);
      SCOPED_TRACE("H" + std::to_string(H) + " K" + std::to_string(K) + " " + std::to_string(R) + "x" +
                   std::to_string(A) + " U" + std::to_string(U));
      expect_counters_follow_the_plan(r);
      const std::int64_t s = S / C, G = S / R;
      const std::uint64_t q_bytes = s * H * d * f32 * (A - 1) / A;
      const std::uint64_t kv_bytes = std::int64_t{A} * std::max(K / A, 1) * s * d * f32 * (A - 1) / A;
      for (const char* name : {"a2a_q", "a2a_o", "bwd_a2a_q", "bwd_a2a_o", "bwd_a2a_do", "bwd_a2a_dq"})
        EXPECT_EQ(label(r, name), q_bytes) << name;
      for (const char* name : {"a2a_k", "a2a_v", "bwd_a2a_k", "bwd_a2a_v", "bwd_a2a_dk", "bwd_a2a_dv"})
        EXPECT_EQ(label(r, name), kv_bytes) << name;
      // Rank 0's stages: the distinct kv heads of each stage's query heads.
      const head_schedule schedule(H, K, A, U);
      std::int64_t kv_heads = 0;
      for (int t = 0; t < schedule.stages(); ++t) {
        std::vector<int> used;
        for (const int q : schedule.stage_heads(0, t))
          if (std::find(used.begin(), used.end(), schedule.kv_of(q)) == used.end()) used.push_back(schedule.kv_of(q));
        kv_heads += static_cast<std::int64_t>(used.size());
      }
      const std::uint64_t ring_kv = 2 * G * kv_heads * d * f32;
      EXPECT_EQ(label(r, "ring_kv"), 2 * (R - 1) * ring_kv);
      EXPECT_EQ(label(r, "ring_dkv"), (R - 1) * ring_kv);
    }
}

// A sliding window: ring and hybrid skip the steps whose K/V no query reaches, and their
// dK/dV; what each rank sends plus what its plan says the window saved is the volume
// without the window, label by label; a window of S or more saves nothing.
TEST(counters, a_window_saves_the_ring_steps_it_does_not_reach) {
  const std::int64_t S = 96, d = 8;
  for (auto [kind, H, K, C, R] : {std::tuple{strategy_kind::ring, 8, 2, 4, 4}, {strategy_kind::ring, 4, 4, 6, 6},
                                  {strategy_kind::hybrid, 8, 2, 8, 4}})
    for (const std::int64_t window : {std::int64_t{5}, S / (2 * R) + 3, S}) {
      attention_config c = {.seq_len = S, .heads = H, .kv_heads = K, .head_dim = static_cast<int>(d), .model_dim = 16,
                            .cp = C, .ring = kind == strategy_kind::hybrid ? R : 1, .strategy = kind};
      experiment_options o;
      o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
      const experiment_result global = run_attention_experiment(c, o);
      c.window = window;
      const experiment_result r = run_attention_experiment(c, o);
      SCOPED_TRACE(std::string(strategy_name(kind)) + " C" + std::to_string(C) + " W" + std::to_string(window));
      expect_counters_follow_the_plan(r);
      const auto saved = make_stage_plan(c, 0).saved_bytes_by_label(dtype::f32);
      for (const char* name : {"ring_kv", "ring_dkv"}) {
        const std::uint64_t skipped = saved.count(name) != 0 ? saved.at(name) : 0;
        EXPECT_EQ(label(r, name) + skipped, label(global, name)) << name;
        if (window == S) EXPECT_EQ(skipped, 0u) << name;
        if (window == 5) EXPECT_GT(skipped, 0u) << name;
      }
    }
}

// Sequence chunks under a window: the parts no query part reaches are neither fetched
// nor kept, so the host copies fall and the host holds the window's parts (a kv block
// that later stages read again keeps its parts until its last stage); the all-to-alls
// are unchanged (every head still crosses once). Host copies plus what the plan says the
// window saved are the copies without it.
TEST(counters, a_window_keeps_only_the_parts_it_reaches_on_the_host) {
  const std::int64_t S = 96, d = 8;
  struct chunked {
    strategy_kind kind;
    int K, U, N;
    bool blocks_span_stages;
  };
  for (const chunked& k : {chunked{strategy_kind::fpdt, 2, 0, 6, false}, chunked{strategy_kind::upipe, 8, 2, 4, false},
                           chunked{strategy_kind::upipe, 2, 2, 4, true}})
    for (const std::int64_t window : {std::int64_t{7}, std::int64_t{30}}) {
      const strategy_kind kind = k.kind;
      const int N = k.N;
      attention_config c = {.seq_len = S, .heads = 8, .kv_heads = k.K, .head_dim = static_cast<int>(d),
                            .model_dim = 16, .cp = 2, .head_chunk = k.U, .seq_chunks = N, .strategy = kind};
      experiment_options o;
      o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
      const experiment_result global = run_attention_experiment(c, o);
      c.window = window;
      const experiment_result r = run_attention_experiment(c, o);
      SCOPED_TRACE(std::string(strategy_name(kind)) + " N" + std::to_string(N) + " W" + std::to_string(window));
      expect_counters_follow_the_plan(r);
      EXPECT_EQ(r.bytes_sent_by_label, global.bytes_sent_by_label);
      const stage_plan windowed = make_stage_plan(c, 0);
      c.window = 0;
      const stage_plan plain = make_stage_plan(c, 0);
      const auto saved = windowed.saved_bytes_by_label(dtype::f32);
      EXPECT_GT(saved.at("attn_k_chunk"), 0u);
      const auto sent_by_label = windowed.bytes_by_label(dtype::f32);
      for (const auto& [label, bytes] : plain.bytes_by_label(dtype::f32)) {
        const auto it = sent_by_label.find(label);
        const std::uint64_t sent = it == sent_by_label.end() ? 0 : it->second;
        EXPECT_EQ(sent + (saved.count(label) != 0 ? saved.at(label) : 0), bytes) << label;
      }
      // The host holds the window's parts: less than the sequence's, as the ledger measured.
      if (k.blocks_span_stages)
        EXPECT_LE(r.attention_host_peak, global.attention_host_peak);
      else
        EXPECT_LT(r.attention_host_peak, global.attention_host_peak);
      EXPECT_EQ(r.attention_host_peak, r.plan_host_peak);
    }
}

// Sequence chunks move the same all-to-all volume as the unchunked stages (every head still
// crosses once per pass), and their host copies are the plan's: in forward each query chunk
// i brings parts 0..i of its stage's kv blocks back, N (N + 1) / 2 parts per block.
TEST(counters, sequence_chunks_keep_the_volume_and_count_host_copies) {
  const std::int64_t S = 48, d = 8;
  for (auto [H, K, C] : {std::tuple{8, 4, 2}, {8, 2, 4}, {12, 4, 2}, {8, 8, 4}})
    for (int U = C; U <= H; U += C) {
      if (H % U) continue;
      const experiment_result whole = run(strategy_kind::upipe, H, K, C, U, S, static_cast<int>(d));
      for (int n : {2, 3, 4}) {
        attention_config c = {.seq_len = S, .heads = H, .kv_heads = K, .head_dim = static_cast<int>(d),
                              .model_dim = 16, .cp = C, .head_chunk = U, .seq_chunks = n,
                              .strategy = strategy_kind::upipe};
        experiment_options o;
        o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
        const experiment_result r = run_attention_experiment(c, o);
        SCOPED_TRACE("H" + std::to_string(H) + " K" + std::to_string(K) + " C" + std::to_string(C) + " U" +
                     std::to_string(U) + " N" + std::to_string(n));
        expect_counters_follow_the_plan(r);
        EXPECT_EQ(r.bytes_sent, whole.bytes_sent);
        EXPECT_EQ(r.bytes_sent_by_label, whole.bytes_sent_by_label);
        // K and V of every kv head resident on rank 0 go to host once a pass and come back
        // N (N + 1) / 2 parts at a time per stage in forward.
        const head_schedule schedule(H, K, C, U);
        std::int64_t reads = 0;
        for (int t = 0; t < schedule.stages(); ++t) {
          std::vector<int> blocks;
          for (const kv_block& b : schedule.blocks(0))
            if (b.first_stage <= t && t <= b.last_stage) {
              bool used = false;
              for (const int q : schedule.stage_heads(0, t))
                used = used || std::find(b.kv_heads.begin(), b.kv_heads.end(), schedule.kv_of(q)) != b.kv_heads.end();
              if (used) reads += static_cast<std::int64_t>(b.kv_heads.size());
            }
        }
        const std::uint64_t part = static_cast<std::uint64_t>(S / n) * d * 4;  // one kv head's part, f32
        std::uint64_t k_stored = 0;
        for (const kv_block& b : schedule.blocks(0)) k_stored += b.kv_heads.size() * S * d * 4;
        const auto plan = make_stage_plan(c, 0);
        const auto host = plan.forward.bytes_by_label(dtype::f32);
        EXPECT_EQ(host.at("attn_k_host"), k_stored);
        if (S % (n * C) == 0) EXPECT_EQ(host.at("attn_k_chunk"), reads * part * n * (n + 1) / 2);
      }
    }
}

}  // namespace
}  // namespace upipe
