// Every strategy equals the float64 single-device reference on every supported shape of
// the sweep (H, K, C, U, d, S), with random asymmetric weights.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "bench/attention_experiment.hpp"
#include "core/error.hpp"

namespace upipe {
namespace {

struct group_shape {
  int heads, kv_heads, cp;
};

std::vector<group_shape> supported_shapes() {
  std::vector<group_shape> shapes;
  for (int H : {4, 8, 12, 16})
    for (int K : {1, 2, 4, H}) {
      if (H % K != 0 || (K == H && K <= 4)) continue;  // K = H already listed
      for (int C : {1, 2, 3, 4})
        if (H % C == 0 && (K % C == 0 || C % K == 0)) shapes.push_back({H, K, C});
    }
  return shapes;
}

class strategy_sweep : public ::testing::TestWithParam<group_shape> {};

// The sweep's layer: a width unlike H*d, so a transposed weight cannot pass.
attention_config sweep_config(const group_shape& g, strategy_kind kind, int chunk, int d, std::int64_t S) {
  attention_config c;
  c.seq_len = S;
  c.heads = g.heads;
  c.kv_heads = g.kv_heads;
  c.head_dim = d;
  c.model_dim = 20;
  c.cp = g.cp;
  c.head_chunk = chunk;
  c.strategy = kind;
  c.rope.theta = 10000;
  return c;
}

experiment_result run(const attention_config& c) {
  experiment_options o;
  o.seed = 1000 + c.heads * 100 + c.kv_heads * 10 + c.cp;
  o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
  return run_attention_experiment(c, o);
}

TEST_P(strategy_sweep, matches_reference) {
  const group_shape g = GetParam();
  int runs = 0;
  for (int d : {8, 16})
    for (std::int64_t S : {24, 36, 48}) {
      std::vector<std::pair<strategy_kind, int>> cases = {{strategy_kind::ulysses, 0}, {strategy_kind::ring, 0}};
      for (int u : valid_head_chunks(g.heads, g.cp)) cases.push_back({strategy_kind::upipe, u});
      for (auto [kind, chunk] : cases) {
        const std::int64_t unit = kind == strategy_kind::ring ? 2 * g.cp : g.cp;
        if (S % unit != 0) continue;
        attention_config c = sweep_config(g, kind, chunk, d, S);
        c.rope.scaling.kind = S == 36 ? rope_kind::llama3 : rope_kind::none;  // Llama 3 scaling on one length
        c.rope.scaling.original_max_position = 16;
        c.qk_norm = (S == 48 && d == 16);  // Qwen3's per-head q/k norm on one configuration
        c.overlap_comm = (d == 16);         // the output exchange in flight during the next stage
        const experiment_result r = run(c);
        ASSERT_TRUE(r.max_rel_error.has_value());
        for (const auto& [name, e] : r.rel_error)
          EXPECT_LT(e, 1e-5) << strategy_name(kind) << " U=" << c.head_chunk << " d=" << d << " S=" << S << " tensor "
                             << name;
        ++runs;
      }
    }
  EXPECT_GT(runs, 0);
}

// Random document boundaries: every strategy keeps each token's attention inside its
// document and restarts RoPE with it, as the reference does. The boundaries fall anywhere:
// inside a rank's shard, on a shard's edge, a document of one token, and one longer than
// a shard; ring skips the blocks that share no document.
std::vector<std::int64_t> random_documents(std::int64_t S, std::uint64_t seed) {
  std::vector<std::int64_t> starts = {0};
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (std::int64_t g = 1; g < S; ++g) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    if (x % 5 == 0) starts.push_back(g);
  }
  if (starts.size() < 3) starts = {0, 1, S / 2};
  return starts;
}

TEST_P(strategy_sweep, packed_documents_match_reference) {
  const group_shape g = GetParam();
  int runs = 0;
  for (std::int64_t S : {24, 48}) {
    std::vector<std::pair<strategy_kind, int>> cases = {{strategy_kind::ulysses, 0}, {strategy_kind::ring, 0}};
    for (int u : valid_head_chunks(g.heads, g.cp)) cases.push_back({strategy_kind::upipe, u});
    for (auto [kind, chunk] : cases) {
      const std::int64_t unit = kind == strategy_kind::ring ? 2 * g.cp : g.cp;
      if (S % unit != 0) continue;
      attention_config c = sweep_config(g, kind, chunk, 8, S);
      c.qk_norm = S == 48;
      experiment_options o;
      o.seed = 7000 + c.heads * 100 + c.kv_heads * 10 + c.cp;
      o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
      o.documents = random_documents(S, o.seed + static_cast<std::uint64_t>(S));
      const experiment_result r = run_attention_experiment(c, o);
      ASSERT_TRUE(r.max_rel_error.has_value());
      for (const auto& [name, e] : r.rel_error)
        EXPECT_LT(e, 1e-5) << strategy_name(kind) << " U=" << c.head_chunk << " S=" << S << " tensor " << name;
      ++runs;
    }
  }
  EXPECT_GT(runs, 0);
}

INSTANTIATE_TEST_SUITE_P(all_supported, strategy_sweep, ::testing::ValuesIn(supported_shapes()),
                         [](const auto& info) {
                           return "H" + std::to_string(info.param.heads) + "_K" + std::to_string(info.param.kv_heads) +
                                  "_C" + std::to_string(info.param.cp);
                         });

// The sweep must cover the interesting regimes, or it proves little.
TEST(strategy_sweep_coverage, covers_split_and_replicated_kv) {
  bool split = false, replicated = false, odd_cp = false;
  for (const auto& g : supported_shapes()) {
    split |= g.kv_heads > g.cp && g.cp > 1;
    replicated |= g.kv_heads < g.cp;
    odd_cp |= g.cp == 3;
  }
  EXPECT_TRUE(split && replicated && odd_cp);
}

}  // namespace
}  // namespace upipe
