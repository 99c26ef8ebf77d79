// Training a mixture of experts (tiny-qwen3-moe: a dense layer below two sparse ones, 8
// experts, top-2) with the load-balancing loss on the cpu backend: D x C meshes under every
// strategy and ZeRO-2 and 3 train what one rank trains with the replicas' sequences as one
// batch (each sequence's load-balancing loss its own, the step's their mean), the step
// reports both terms, and the meta backend runs the Qwen3-30B-A3B preset's step.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "model/model_step.hpp"
#include "train/trainer.hpp"
#include "train_support.hpp"

namespace upipe {
namespace {

train_options moe_steps(int dp, const cp_settings& cp, std::int64_t batch, zero_stage zero) {
  train_options o = four_tiny_steps(cp, zero, batch);
  o.model = preset("tiny-qwen3-moe");
  o.model.moe.router_aux_loss_coef = 0.25;  // large enough that an error in its gradient shows in the losses
  o.step.router_aux = router_aux_loss::on;
  o.dp = dp;
  return o;
}

TEST(moe_train, meshes_train_what_one_rank_trains_and_report_both_terms) {
  const train_options one = moe_steps(1, {strategy_kind::ulysses, 1, 0}, 2, zero_stage::two);
  const std::vector<step_record> want = train(one, nullptr).steps;
  ASSERT_EQ(want.size(), 4u);
  for (const step_record& r : want) {
    EXPECT_TRUE(r.aux_on);
    EXPECT_GT(r.aux_loss, 0.9);  // E sum_e f_e p_e is 1 for a perfect balance, more otherwise
    EXPECT_NEAR(r.loss, r.lm_loss + 0.25 * r.aux_loss, 1e-12);
  }
  EXPECT_LT(want.back().loss, want.front().loss);
  for (const auto& [kind, zero] : {std::pair{strategy_kind::upipe, zero_stage::two},
                                   std::pair{strategy_kind::ring, zero_stage::three},
                                   std::pair{strategy_kind::ulysses, zero_stage::three}}) {
    const train_options mesh = moe_steps(2, {kind, 2, 0}, 1, zero);
    SCOPED_TRACE(std::string(strategy_name(kind)) + (zero == zero_stage::three ? " zero 3" : " zero 2"));
    const std::vector<step_record> got = train(mesh, nullptr).steps;
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_LT(std::abs(got[i].loss - want[i].loss) / want[i].loss, 1e-6) << "step " << i + 1;
      EXPECT_LT(std::abs(got[i].aux_loss - want[i].aux_loss) / want[i].aux_loss, 1e-6) << "step " << i + 1;
    }
  }
}

// The planner's probe: a whole Qwen3-30B-A3B step over 8 ranks on the meta backend. Its
// MoE MLP runs a tile at a time: the dispatch buffers (the router's, the gathered rows,
// an expert's block) grow with the tile, holding tile x k x D rows at least, and not with
// the sequence (but for a byte a token that marks the rows the aux loss counts).
std::size_t moe_peak(std::int64_t tile, std::int64_t seq_len) {
  model_step_request req;
  req.model = preset("qwen3-30b-a3b");
  req.backend = backend_kind::meta;
  req.cp = {strategy_kind::upipe, 8, 0};
  req.options.router_aux = router_aux_loss::on;
  req.options.mlp_tile = tile;
  req.shape_only = seq_len;
  req.record_timeline = true;
  req.limits = {std::size_t{400} << 30, std::size_t{64} << 30};  // replicated fp32 gradients: no ZeRO here
  return peak_of_labels(run_model_step(req, {}, {}).timeline, {"moe_"});
}

TEST(moe_train, qwen3_30b_a3b_dispatch_is_bounded_by_the_tile) {
  const std::size_t gathered = std::size_t{4096} * 8 * 2048 * 2;  // tile x k x D, bf16
  const std::size_t at_4k = moe_peak(4096, 65536);
  EXPECT_GE(at_4k, gathered);
  EXPECT_LT(at_4k, 8 * gathered);
  // Twice the sequence, the same tiles: only the aux loss's row mask (moe_counted_rows, a
  // byte a token of this rank's S / 8) grows with it.
  EXPECT_EQ(moe_peak(4096, 131072), at_4k + (131072 - 65536) / 8);
  EXPECT_LT(moe_peak(1024, 65536), at_4k / 3);
}

}  // namespace
}  // namespace upipe
