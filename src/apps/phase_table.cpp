#include "apps/phase_table.hpp"

#include <cstdio>
#include <string>

namespace upipe::apps {

namespace {

// What each stage of the table is, for its row.
const char* stage_note(const std::string& stage) {
  if (stage == "forward") return "the layers' forward";
  if (stage == "loss") return "the head's forward and backward";
  if (stage == "backward") return "the layers' recompute and backward";
  if (stage == "update") return "the norm and the update, but the parts below";
  if (stage == "adamw") return "the device's AdamW (or its moments' half)";
  if (stage == "grad_norm") return "the gradient norm's sums";
  if (stage == "copy_out") return "host copies on the stream: gradients or the master's steps out";
  if (stage == "copy_in") return "host copies on the stream: AdamW's weights back";
  if (stage == "wait_host") return "the stream idle while the step waits for the host's work";
  if (stage == "wait_copy") return "the stream waiting for side copies (weights, checkpoints)";
  return "the rest, outside the stages";
}

}  // namespace

void print_step_phases(const step_phases& p, const step_time& model) {
  const double wall = p.wall_ms / 1e3;
  std::printf("#   step %.3f s = the GPU's stream %.3f s (its stages below) + %.3f s not accounted for (launches "
              "before its first mark, the host after its last)\n",
              wall, p.span_ms / 1e3, p.rest_ms() / 1e3);
  for (const auto& [stage, ms] : p.stages_ms)
    std::printf("#     %-10s %10.3f s %6.1f%%  %s\n", stage.c_str(), ms / 1e3, wall > 0 ? 100 * ms / p.wall_ms : 0.0,
                stage_note(stage));
  const double own = p.gpu_ms() / 1e3;
  std::printf("#   the GPU's own work (the stages but the waits and the copies): %.3f s; the step / its own = %.3f\n",
              own, own > 0 ? wall / own : 0.0);
  for (const auto& [what, c] : p.side_copies)
    std::printf("#   beside the compute: %-15s %5d copies, %8.3f GB in %8.3f s (%.1f GB/s)\n", what.c_str(), c.count,
                c.bytes / 1e9, c.ms / 1e3, c.ms > 0 ? c.bytes / c.ms / 1e6 : 0.0);
  for (const auto& [kind, t] : p.host)
    std::printf("#   host: %-18s busy %8.3f s (%8.3f s on its threads, %d pieces)\n", kind.c_str(), t.busy_ms / 1e3,
                t.cpu_ms / 1e3, t.pieces);
  std::printf("#   model (plan/step_time): %.3f s = compute %.3f (GEMMs %.3f, attention %.3f, elementwise %.3f, "
              "device update %.3f; first forward %.3f) + collectives %.3f + host copies %.3f + the offload's copies "
              "%.3f + weights waited for %.3f + host AdamW %.3f of %.3f; a step with no next adds %.3f; measured / "
              "model = %.3f\n",
              model.total(), model.compute(), model.gemm, model.attention, model.elementwise, model.update,
              model.forward, model.all_to_all + model.ring + model.zero + model.data_parallel, model.host,
              model.offload_copies, model.weights_in, model.host_adamw_exposed, model.host_adamw,
              model.lone_step_extra, model.total() > 0 ? wall / model.total() : 0.0);
}

nlohmann::json step_phases_json(const step_phases& p) {
  nlohmann::json copies = nlohmann::json::object(), host = nlohmann::json::object();
  for (const auto& [what, c] : p.side_copies) copies[what] = {{"ms", c.ms}, {"bytes", c.bytes}, {"count", c.count}};
  for (const auto& [kind, t] : p.host) host[kind] = {{"busy_ms", t.busy_ms}, {"cpu_ms", t.cpu_ms}, {"pieces", t.pieces}};
  return {{"wall_ms", p.wall_ms}, {"span_ms", p.span_ms},   {"rest_ms", p.rest_ms()}, {"gpu_ms", p.gpu_ms()},
          {"stages_ms", p.stages_ms}, {"side_copies", copies}, {"host", host}};
}

nlohmann::json step_time_json(const step_time& t) {
  return {{"total", t.total()},
          {"compute", t.compute()},
          {"gemm", t.gemm},
          {"attention", t.attention},
          {"elementwise", t.elementwise},
          {"update", t.update},
          {"forward", t.forward},
          {"all_to_all", t.all_to_all},
          {"ring", t.ring},
          {"zero", t.zero},
          {"data_parallel", t.data_parallel},
          {"host", t.host},
          {"offload_copies", t.offload_copies},
          {"weights_in", t.weights_in},
          {"host_adamw", t.host_adamw},
          {"host_adamw_exposed", t.host_adamw_exposed},
          {"lone_step_extra", t.lone_step_extra}};
}

nlohmann::json rates_json(const throughput_rates& r) {
  return {{"gemm_tflops", r.gemm_tflops},       {"attention_tflops", r.attention_tflops},
          {"elementwise_ns", r.elementwise_ns}, {"device_gbytes", r.device_gbytes},
          {"host_adamw_gbytes", r.host_adamw_gbytes}, {"nvlink_gbytes", r.nvlink_gbytes},
          {"network_gbits", r.network_gbits},   {"pcie_gbytes", r.pcie_gbytes}};
}

}  // namespace upipe::apps
