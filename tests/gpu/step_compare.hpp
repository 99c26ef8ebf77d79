// One model step on the CUDA backend against the same step on the cpu backend: the loss and
// every gradient. A mixture of experts' GPU run takes the cpu run's expert choices
// (model/moe_routing_log.hpp: bf16 activations on the GPU may route a near tie apart,
// moe_test.cpp counts how often), so the experts' and routers' gradients are held to the
// same bounds as every other: 5e-2 of the largest, 8e-2 for a norm's weight (its gradient
// sums bf16 products with cancellation over every token; gemma3's K norm under fpdt
// measured 5.9e-2 on the H200).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/model_step.hpp"
#include "model/moe_routing_log.hpp"

#include "../support/compare.hpp"
#include "gpu_support.hpp"

namespace upipe {

struct step_comparison {
  model_step_result cpu, gpu;
  double worst_gradient = 0;  // the worst parameter's max |gpu - cpu| / max |cpu|
};

inline step_comparison expect_gpu_step_matches_cpu(model_step_request req, const host_weights& weights,
                                                   const std::vector<std::int32_t>& tokens,
                                                   const host_weights& adapters = {}) {
  step_comparison c;
  moe_routing_log log(moe_routing_log::mode::record);
  req.options.moe.routing_log = &log;
  req.backend = backend_kind::cpu;
  req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  c.cpu = run_model_step(req, weights, tokens, adapters);
  log.set_mode(moe_routing_log::mode::replay);
  req.backend = backend_kind::cuda;
  req.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
  c.gpu = run_model_step(req, weights, tokens, adapters);
  EXPECT_LT(std::abs(c.gpu.loss - c.cpu.loss) / c.cpu.loss, bf16_tolerance);
  EXPECT_EQ(c.gpu.grads.size(), c.cpu.grads.size());
  for (const auto& [param, values] : c.cpu.grads) {
    const auto it = c.gpu.grads.find(param);
    if (it == c.gpu.grads.end()) {
      ADD_FAILURE() << param << ": no gradient on the GPU";
      continue;
    }
    const double error = testing::max_difference_over_max(it->second, values);
    const bool norm_weight = param.find("norm.weight") != std::string::npos;
    EXPECT_LT(error, norm_weight ? 8e-2 : 5e-2) << param;
    c.worst_gradient = std::max(c.worst_gradient, error);
  }
  return c;
}

}  // namespace upipe
