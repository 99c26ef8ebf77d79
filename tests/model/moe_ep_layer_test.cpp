// A sparse layer under expert parallelism on the cpu backend (model/moe_exchange.hpp):
// P ranks on threads hold the same weights and tokens of their own, each running its L =
// experts / P experts and exchanging the dispatched rows with the group. Each rank's
// output, input gradient and router gradient are what the layer computes for its tokens
// alone (the same rows through the same experts: equal), and each expert's gradient at its
// rank is the sum of what every rank's tokens give it alone. The exchange waits on the host
// once a direction (its sizes), whatever the GEMMs; dropless and with a capacity (each
// source's rows dropped as without EP).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "model/hf_model.hpp"
#include "../support/moe_layer.hpp"

namespace upipe {
namespace {

model_config fixture(const std::string& name) {
  return read_hf_config(std::string(UPIPE_SOURCE_DIR) + "/tests/golden/moe/" + name);
}

void expect_ep_matches_alone(const model_config& m, int P, const moe_options& o) {
  const testing::ep_group group(
      m, P, 45, [] { return make_cpu_backend({std::size_t{128} << 20, std::size_t{16} << 20}); }, o);
  const std::vector<testing::moe_layer::result>& alone = group.alone;
  const testing::ep_run ep = group.run(o);
  for (std::size_t r = 0; r < alone.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    // The sizes' all_to_all a direction; the ids, rows and outputs forward, and in the
    // backward also the outputs' gradient and the input gradient.
    EXPECT_EQ(ep.all_to_all_calls[r], 2u);
    EXPECT_EQ(ep.all_to_all_v_calls[r], 8u);
    EXPECT_EQ(ep.own_syncs[r], 2u);
    EXPECT_EQ(ep.results[r].y, alone[r].y);
    EXPECT_EQ(ep.results[r].d_h, alone[r].d_h);
    EXPECT_EQ(ep.results[r].grads[0], alone[r].grads[0]);  // the router
  }
  EXPECT_LT(testing::expert_gradient_error(m, ep, alone), 1e-5);
}

TEST(moe_layer_ep, each_rank_computes_what_its_tokens_give_alone) {
  const model_config qwen3 = fixture("qwen3-moe"), qwen2 = fixture("qwen2-moe");
  for (const int P : {2, 4}) {
    SCOPED_TRACE("qwen3-moe P=" + std::to_string(P));
    expect_ep_matches_alone(qwen3, P, {});
  }
  SCOPED_TRACE("qwen2-moe (a shared expert) P=2");
  expect_ep_matches_alone(qwen2, 2, {});
}

TEST(moe_layer_ep, the_per_expert_loop_and_a_capacity_carry_over) {
  const model_config m = fixture("qwen3-moe");
  moe_options o;
  o.gemm = moe_gemm::loop;
  expect_ep_matches_alone(m, 2, o);
  o.gemm = moe_gemm::grouped;
  o.capacity_factor = 1.0;  // some experts drop rows of each source's tile
  expect_ep_matches_alone(m, 4, o);
}

// Without data (the meta backend: the planner, rank 0 of an emulated mesh) the exchange
// sizes its buffers for the worst case, P n min(k, L) rows received, so the layer's arena
// reaches higher with each P; with data, rank 0 alone is refused with the reason.
TEST(moe_layer_ep, without_data_the_buffers_hold_the_worst_case) {
  const model_config m = fixture("qwen3-moe");  // 8 experts, top-2: 1024, 2048, 4096 rows
  const auto high_water = [&](int P) {
    const std::unique_ptr<backend> be = make_meta_backend({std::size_t{1} << 30, std::size_t{16} << 20});
    testing::moe_layer layer(m, *be, 512);
    const std::unique_ptr<communicator> peers = make_loopback_communicator(*be, P);
    layer.run({}, nullptr, 0, P > 1 ? peers.get() : nullptr);
    return be->device_arena().high_water();
  };
  const std::size_t alone = high_water(1), two = high_water(2), four = high_water(4);
  EXPECT_GT(two, alone);
  EXPECT_GT(four, two);
  const std::unique_ptr<backend> cpu = make_cpu_backend({std::size_t{128} << 20, std::size_t{16} << 20});
  testing::moe_layer layer(m, *cpu, 45);
  const std::unique_ptr<communicator> rank0 = make_loopback_communicator(*cpu, 2);
  try {
    layer.run({}, nullptr, 0, rank0.get());
    ADD_FAILURE() << "an emulated EP group ran with data";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("--emulate-cp"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace upipe
