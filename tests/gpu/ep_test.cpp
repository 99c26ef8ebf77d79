// Expert parallelism on the CUDA backend (virtual ranks of one GPU, the threads
// communicator) against the cpu backend: the mixtures of experts of
// scripts/make_moe_fixtures.py with their load-balancing loss, each sparse layer's experts
// split over EP groups of 2 and 4 ranks (in a CP group, and across replicas), the tokens
// exchanged with their experts' ranks by all_to_all_v both ways. In one replica the GPU
// takes the cpu's expert choices and every gradient is held to the families' bounds; over
// replicas the experts' and routers' gradients only to their size (a near tie routed apart
// by bf16 moves a token's gradient whole). On the GPU the EP run equals the run without EP
// to the same bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "model/model_step.hpp"
#include "model/moe_routing_log.hpp"

#include "../support/compare.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

std::string moe_dir(const std::string& name) { return std::string(UPIPE_SOURCE_DIR) + "/tests/golden/moe/" + name; }

std::vector<std::int32_t> sequence() {
  std::vector<std::int32_t> tokens(256);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 37 + 11) % 256);
  return tokens;
}

model_step_result run_on(model_step_request req, backend_kind kind, const host_weights& w) {
  req.backend = kind;
  req.limits = kind == backend_kind::cuda ? memory_limits{std::size_t{1} << 30, std::size_t{64} << 20}
                                          : memory_limits{std::size_t{256} << 20, std::size_t{64} << 20};
  return run_model_step(req, w, sequence());
}

bool routed(const std::string& param) {
  return param.find(".experts.") != std::string::npos || param.find(".gate.weight") != std::string::npos;
}

void expect_close(const model_step_result& got, const model_step_result& want, double routed_bound) {
  EXPECT_LT(std::abs(got.loss - want.loss) / want.loss, bf16_tolerance);
  EXPECT_LT(std::abs(got.aux_loss - want.aux_loss) / want.aux_loss, 5e-2);
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (const auto& [param, values] : want.grads) {
    const double error = testing::max_difference_over_max(got.grads.at(param), values);
    const bool norm_weight = param.find("norm.weight") != std::string::npos;
    EXPECT_LT(error, routed(param) ? routed_bound : norm_weight ? 8e-2 : 5e-2) << param;
  }
}

TEST(gpu_expert_parallel, virtual_ranks_match_the_cpu_backend) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  for (const char* name : {"qwen3-moe", "qwen3-moe-12"}) {
    model_step_request req;
    req.model = read_hf_config(moe_dir(name));
    const host_weights w = read_weights(req.model, moe_dir(name));
    req.options.mlp_tile = 24;
    req.options.loss_chunk = 40;
    req.options.router_aux = router_aux_loss::on;
    struct shape {
      cp_settings cp;
      int dp, ep;
    };
    for (const shape& s : {shape{{strategy_kind::upipe, 2, 2}, 1, 2}, shape{{strategy_kind::ring, 4, 0}, 1, 4},
                           shape{{strategy_kind::ulysses, 1, 0}, 2, 2}, shape{{strategy_kind::upipe, 2, 2}, 2, 4}}) {
      req.cp = s.cp;
      req.dp = s.dp;
      req.ep = s.ep;
      const std::string what = std::string(name) + " " + std::string(strategy_name(s.cp.strategy)) + " D=" +
                               std::to_string(s.dp) + " C=" + std::to_string(s.cp.cp) + " E=" + std::to_string(s.ep);
      SCOPED_TRACE(what);
      // One replica: the GPU runs take the cpu's expert choices (model/moe_routing_log.hpp),
      // and every gradient, the experts' and routers' too, is held to the families' bounds.
      // Over replicas the log's key (CP rank, layer, first token) is not unique, so the
      // routed parameters there are held to their size only.
      moe_routing_log log(moe_routing_log::mode::record);
      if (s.dp == 1) req.options.moe.routing_log = &log;
      const double routed_bound = s.dp == 1 ? 5e-2 : 1.0;
      const model_step_result cpu = run_on(req, backend_kind::cpu, w);
      log.set_mode(moe_routing_log::mode::replay);
      const model_step_result gpu = run_on(req, backend_kind::cuda, w);
      expect_close(gpu, cpu, routed_bound);
      // The same step without expert parallelism on the GPU: the exchange moves rows, it
      // computes nothing of its own.
      model_step_request plain = req;
      plain.ep = 1;
      expect_close(gpu, run_on(plain, backend_kind::cuda, w), routed_bound);
      req.options.moe.routing_log = nullptr;
      std::printf("gpu expert parallel %s: loss cuda %.6f, cpu %.6f; aux %.6f, %.6f\n", what.c_str(), gpu.loss,
                  cpu.loss, gpu.aux_loss, cpu.aux_loss);
    }
  }
}

}  // namespace
}  // namespace upipe
