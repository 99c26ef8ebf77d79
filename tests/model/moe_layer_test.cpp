// A sparse layer alone on the cpu backend (model/moe_mlp.hpp): its forward against the
// float64 definition (softmax, top-k, renormalization, each kept expert's gated MLP,
// Qwen2-MoE's gated shared expert), dropless and with a capacity that drops the tokens past
// it in token order; the grouped GEMMs, cuBLAS's form and the per-expert loop alike; no
// host synchronization inside the layer but the loop's; choices replayed from a routing log
// with the weights from the layer's own probabilities.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "core/error.hpp"
#include "model/hf_model.hpp"
#include "model/moe_routing_log.hpp"
#include "../support/moe_layer.hpp"

namespace upipe {
namespace {

model_config fixture(const std::string& name) {
  return read_hf_config(std::string(UPIPE_SOURCE_DIR) + "/tests/golden/moe/" + name);
}

double max_relative(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

class moe_layer_cpu : public ::testing::Test {
 protected:
  std::unique_ptr<backend> be_ = make_cpu_backend({std::size_t{256} << 20, std::size_t{16} << 20});
};

TEST_F(moe_layer_cpu, forward_matches_float64_dropless_and_with_a_shared_expert) {
  for (const char* name : {"qwen3-moe", "qwen2-moe"}) {
    SCOPED_TRACE(name);
    const model_config m = fixture(name);
    testing::moe_layer layer(m, *be_, 70);
    const auto r = layer.run({});
    EXPECT_LT(max_relative(r.y, layer.reference(0)), 1e-5);
  }
}

// F = 1 over 8 experts, 2 a token and a skewed router: some experts are chosen by more than
// ceil(70 * 2 / 8) = 18 tokens, whose later tokens lose that expert.
TEST_F(moe_layer_cpu, a_capacity_drops_each_experts_later_tokens) {
  const model_config m = fixture("qwen3-moe");
  testing::moe_layer layer(m, *be_, 70);
  const std::int64_t capacity = moe_capacity(1.0, 70, m.moe.top_k, m.moe.experts);
  ASSERT_EQ(capacity, 18);
  const std::vector<double> dropless = layer.reference(0), capped = layer.reference(capacity);
  ASSERT_GT(max_relative(std::vector<float>(dropless.begin(), dropless.end()), capped), 1e-3)
      << "the case drops no token: it would not test the capacity";
  moe_options o;
  o.capacity_factor = 1.0;
  EXPECT_LT(max_relative(layer.run(o).y, capped), 1e-5);
  // Room for every token: the dropless layer.
  o.capacity_factor = static_cast<double>(m.moe.experts) / m.moe.top_k;
  EXPECT_LT(max_relative(layer.run(o).y, dropless), 1e-5);
}

TEST_F(moe_layer_cpu, grouped_cublas_and_loop_compute_alike) {
  const model_config m = fixture("qwen2-moe");
  testing::moe_layer layer(m, *be_, 45);
  moe_options o;
  const auto grouped = layer.run(o);
  for (const moe_gemm g : {moe_gemm::cublas, moe_gemm::loop}) {
    SCOPED_TRACE(std::string(moe_gemm_name(g)));
    o.gemm = g;
    const auto other = layer.run(o);
    EXPECT_EQ(other.y, grouped.y);
    EXPECT_EQ(other.d_h, grouped.d_h);
    EXPECT_EQ(other.grads, grouped.grads);
  }
}

// What a GPU backend would wait for: the cpu counts the same calls. The loop reads each
// tile's expert offsets twice (forward and backward); the grouped GEMMs read nothing.
TEST_F(moe_layer_cpu, only_the_per_expert_loop_waits_on_the_host) {
  const model_config m = fixture("qwen2-moe");
  testing::moe_layer layer(m, *be_, 45);
  moe_options o;
  std::uint64_t syncs = 99;
  layer.run(o, &syncs);
  EXPECT_EQ(syncs, 0u);
  o.gemm = moe_gemm::loop;
  layer.run(o, &syncs);
  EXPECT_EQ(syncs, 2u);
}

TEST_F(moe_layer_cpu, the_statistics_count_the_counted_rows_choices) {
  const model_config m = fixture("qwen3-moe");
  testing::moe_layer layer(m, *be_, 70);
  layer.run({});
  const router_balance b = read_router_balance(*be_, layer.balance(), m.moe.experts);
  double counts = 0, probs = 0;
  for (std::size_t e = 0; e < b.counts.size(); ++e) {
    counts += b.counts[e];
    probs += b.prob_sums[e];
  }
  const double counted_rows = 70 - 14;  // every fifth row (t % 5 == 3) is not counted
  EXPECT_EQ(counts, counted_rows * m.moe.top_k);
  EXPECT_NEAR(probs, counted_rows, 1e-4);  // each row's probabilities sum to 1
}

// The choices of a routing log, replayed: the same choices give the same layer; changed
// choices give the float64 layer at those choices, weighted by the layer's own probabilities.
TEST_F(moe_layer_cpu, replayed_choices_route_the_layer) {
  const model_config m = fixture("qwen3-moe");
  testing::moe_layer layer(m, *be_, 40);
  moe_routing_log log(moe_routing_log::mode::record);
  moe_options o;
  o.routing_log = &log;
  const auto recorded = layer.run(o, nullptr, 3);
  ASSERT_EQ(log.tiles(), 1u);
  log.set_mode(moe_routing_log::mode::replay);
  const auto replayed = layer.run(o, nullptr, 3);
  EXPECT_EQ(replayed.y, recorded.y);
  EXPECT_EQ(replayed.grads, recorded.grads);
  // Each token's choices moved to the next experts.
  moe_routing_log::choices c = log.get({3, 1, 0}, 40, m.moe.top_k);
  for (std::int32_t& e : c.experts) e = (e + 1) % m.moe.experts;
  log.put({3, 1, 0}, c);
  const auto moved = layer.run(o, nullptr, 3);
  EXPECT_LT(max_relative(moved.y, layer.reference(0, c.experts)), 1e-5);
  EXPECT_GT(max_relative(moved.y, layer.reference(0)), 1e-3);
  // Another rank's tile was never recorded.
  EXPECT_THROW(layer.run(o, nullptr, 4), std::exception);
}

TEST(moe_routing_log, compares_the_sets_chosen) {
  moe_routing_log a, b;
  a.put({0, 1, 0}, {2, 2, {0, 1, 2, 3}});
  b.put({0, 1, 0}, {2, 2, {1, 0, 2, 4}});  // row 0 the same set in another order; row 1 one expert apart
  const moe_routing_log::difference d = a.compare(b);
  EXPECT_EQ(d.rows, 2);
  EXPECT_EQ(d.rows_differing, 1);
  EXPECT_EQ(d.slots, 4);
  EXPECT_EQ(d.slots_differing, 1);
}

TEST(moe_options, a_capacity_factor_is_checked) {
  EXPECT_THROW(validate_moe_options({moe_gemm::grouped, -1.0}), config_error);
  EXPECT_THROW(validate_moe_options({moe_gemm::grouped, std::nan("")}), config_error);
  EXPECT_NO_THROW(validate_moe_options({moe_gemm::grouped, 1.25}));
  EXPECT_EQ(moe_capacity(1.25, 100, 8, 128), 8);  // ceil(1.25 x 800 / 128) = ceil(7.8125)
  EXPECT_EQ(moe_capacity(0.0, 100, 8, 128), 0);
  EXPECT_THROW(parse_moe_gemm("fast"), config_error);
  EXPECT_EQ(parse_moe_gemm("loop"), moe_gemm::loop);
}

}  // namespace
}  // namespace upipe
