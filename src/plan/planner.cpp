#include "plan/planner.hpp"

#include <algorithm>
#include <functional>
#include <future>
#include <string>

#include "core/error.hpp"
#include "core/limits.hpp"
#include "model/hf_model.hpp"
#include "model/model_step.hpp"
#include "ops/gemm_workspace.hpp"

namespace upipe {

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;
constexpr std::int64_t longest_searched = std::int64_t{1} << 30;  // tokens

// Outside the arena on the H200 (driver peak minus arena, docs/benchmarks.md): the CUDA
// context, the cuBLASLt and cuDNN handles and the staging buffers, rounded up.
constexpr std::size_t context_bytes = 640 * mib;

train_options probe_options(const plan_request& r, const cp_settings& cp, std::int64_t seq_len,
                            const checkpoint_policy& policy) {
  train_options o;
  o.model = r.model;
  o.seq_len = seq_len;
  o.cp = cp;
  o.zero = r.zero;
  o.offload_optimizer = r.offload_optimizer;
  // The probe's arena is unbounded: the default sizes are those of the planned GPU's arena.
  o.step = with_default_sizes({r.mlp_tile, r.loss_chunk, policy}, r.model,
                              r.gpu_memory > context_bytes ? r.gpu_memory - context_bytes : r.gpu_memory);
  o.optim.total_steps = 1;
  o.optim.warmup_steps = 0;
  o.eval_samples = 0;
  o.backend = backend_kind::meta;
  o.limits = {std::size_t{1} << 50, std::size_t{1} << 50, true};  // with the GPU's library workspaces
  return o;
}

// The lengths searched: multiples of the layout's unit times 1024.
std::int64_t granule(const cp_settings& cp) { return layout_unit(cp) * 1024; }

// The longest multiple of the granule at which `fits` holds (0: not even one granule),
// searched from `known` (a length known to fit, or 0) by doubling, then bisection.
std::int64_t longest_fit(const cp_settings& cp, const std::function<bool(std::int64_t seq_len)>& fits_at,
                         std::int64_t known = 0) {
  const std::int64_t g = granule(cp);
  auto fits = [&](std::int64_t k) { return fits_at(k * g); };
  std::int64_t good = std::max<std::int64_t>(known / g, 1);
  if (known == 0 && !fits(1)) return 0;
  std::int64_t bad = 2 * good;
  while (bad * g <= longest_searched && fits(bad)) {
    good = bad;
    bad *= 2;
  }
  if (bad * g > longest_searched) return good * g;
  while (bad - good > 1) {
    const std::int64_t mid = good + (bad - good) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good * g;
}

// The configurations: ulysses (U = H), upipe at every valid U, ring, and hybrid (one
// all-to-all group per node, a ring over the nodes) with Ulysses and every UPipe U inside.
std::vector<cp_settings> configurations(const plan_request& r) {
  std::vector<cp_settings> out;
  for (strategy_kind kind : r.strategies) {
    if (kind == strategy_kind::upipe) {
      for (int u : valid_head_chunks(r.model.num_heads, r.gpus)) out.push_back({kind, r.gpus, u});
    } else if (kind == strategy_kind::hybrid) {
      for (int u : valid_head_chunks(r.model.num_heads, r.gpus / r.nodes)) out.push_back({kind, r.gpus, u, r.nodes});
    } else {
      out.push_back({kind, r.gpus, kind == strategy_kind::ulysses ? r.model.num_heads : 0});
    }
  }
  return out;
}

plan_entry plan_configuration(const plan_request& r, const cp_settings& cp) {
  plan_entry e;
  e.strategy = cp.strategy;
  e.head_chunk = cp.head_chunk;
  e.ring = cp.ring;
  e.offload_optimizer = r.offload_optimizer;
  const std::vector<checkpoint_policy> policies =
      r.policy ? std::vector<checkpoint_policy>{*r.policy} : candidate_policies();
  std::int64_t best = 0;
  std::size_t chosen = 0;
  for (std::size_t i = 0; i < policies.size(); ++i) {
    const auto fits = [&](std::int64_t seq_len) { return evaluate(r, cp, seq_len, policies[i]).fits; };
    // A later policy is searched only if it beats the best so far by a granule, from there.
    if (best > 0 && (best + granule(cp) > longest_searched || !fits(best + granule(cp)))) continue;
    const std::int64_t s = longest_fit(cp, fits, best > 0 ? best + granule(cp) : 0);
    if (s > best) best = s, chosen = i;  // ties keep the earlier (faster) policy
  }
  if (best > 0) e.longest = evaluate(r, cp, best, policies[chosen]);
  if (r.eval) {
    const std::int64_t s = longest_fit(cp, [&](std::int64_t seq_len) { return evaluate_forward(r, cp, seq_len).fits; });
    if (s > 0) e.longest_eval = evaluate_forward(r, cp, s);
  }
  if (r.seq_len) e.at_request = fastest_fit(r, cp, *r.seq_len);
  return e;
}

}  // namespace

std::vector<checkpoint_policy> candidate_policies() {
  using c = checkpoint_content;
  using l = checkpoint_location;
  // Fastest first: nothing recomputed but the layer (attention kept), then the attention
  // recomputed too, then the same with the checkpoints in pinned host memory (copied
  // while the GPU computes), then fewer checkpoints (longer recompute blocks).
  return {{c::layer_input_and_attention, 1, l::device}, {c::layer_input, 1, l::device},
          {c::layer_input_and_attention, 1, l::host_pinned}, {c::layer_input, 1, l::host_pinned},
          {c::layer_input, 2, l::host_pinned}, {c::layer_input, 3, l::host_pinned}, {c::layer_input, 4, l::host_pinned},
          {c::layer_input, 2, l::device}, {c::layer_input, 4, l::device}};
}

gpu_overheads estimate_overheads(const step_memory& memory) {
  gpu_overheads o;
  o.cublaslt_workspace = std::min(memory.workspace_at_end, cublaslt_workspace_bytes);
  o.cudnn_workspace = memory.workspace_at_end - o.cublaslt_workspace;
  o.context = gpu_context_bytes();
  return o;
}

plan_point evaluate(const plan_request& r, const cp_settings& cp, std::int64_t seq_len, const checkpoint_policy& policy) {
  plan_point p;
  p.seq_len = seq_len;
  p.policy = policy;
  p.memory = measure_step_memory(probe_options(r, cp, seq_len, policy));
  p.overheads = estimate_overheads(p.memory);
  p.arena_bytes = p.memory.arena_high_water;  // the meta probe reserves the workspaces as the GPU does
  p.gpu_bytes = p.arena_bytes + p.overheads.context;
  p.host_bytes = p.memory.host_high_water * static_cast<std::size_t>(r.gpus / r.nodes);  // one node's ranks
  const double keep = 1.0 - r.margin;
  p.fits = static_cast<double>(p.gpu_bytes) <= keep * static_cast<double>(r.gpu_memory) &&
           static_cast<double>(p.host_bytes) <= keep * static_cast<double>(r.host_memory);
  return p;
}

eval_point evaluate_forward(const plan_request& r, const cp_settings& cp, std::int64_t seq_len) {
  const train_options o = probe_options(r, cp, seq_len, candidate_policies().front());
  model_step_request req;
  req.model = r.model;
  req.cp = cp;
  req.options = o.step;
  req.backend = backend_kind::meta;
  req.limits = o.limits;
  const host_weights none;
  const eval_result m = upipe::evaluate(req, host_weight_source(none), {eval_sequence{{}, {}, {}, seq_len}});
  eval_point p;
  p.seq_len = seq_len;
  p.peak_bytes = m.peak_bytes;
  p.arena_bytes = m.arena_high_water;
  p.gpu_bytes = p.arena_bytes + context_bytes;
  p.fits = static_cast<double>(p.gpu_bytes) <= (1.0 - r.margin) * static_cast<double>(r.gpu_memory);
  return p;
}

void validate(const plan_request& r) {
  validate(r.model);
  if (r.gpus < 1)
    throw config_error("--gpus " + std::to_string(r.gpus) + " must be at least 1 (for example --gpus 8)");
  if (r.nodes < 1 || r.gpus % r.nodes != 0)
    throw config_error("--nodes " + std::to_string(r.nodes) + " must divide the " + std::to_string(r.gpus) +
                       " GPUs into equal nodes (for example --gpus-per-node 8 --nodes 2)");
  if (r.gpu_memory == 0) throw config_error("--gpu-memory must be positive (for example --gpu-memory 80GiB)");
  if (r.host_memory == 0) throw config_error("--host-memory must be positive (for example --host-memory 1.9TiB)");
  if (!(r.margin >= 0 && r.margin < 1))
    throw config_error("--margin " + real_text(r.margin) + " must lie in [0, 1) (for example 0.05)");
  if (r.strategies.empty()) throw config_error("--attention needs at least one of ulysses, upipe, ring, hybrid");
  for (strategy_kind kind : r.strategies) {
    if (kind == strategy_kind::hybrid && r.nodes == 1)
      throw config_error("hybrid needs more than one node (its ring runs across the nodes): give --gpus-per-node G "
                         "--nodes M with M >= 2, or plan ulysses, upipe and ring on one node");
    const cp_settings cp{kind, r.gpus, kind == strategy_kind::ulysses ? r.model.num_heads : 0,
                         kind == strategy_kind::hybrid ? r.nodes : 1};
    if (kind == strategy_kind::upipe && valid_head_chunks(r.model.num_heads, r.gpus).empty())
      throw config_error("upipe has no valid head chunk for " + std::to_string(r.model.num_heads) + " heads on " +
                         std::to_string(r.gpus) + " GPUs; use --gpus dividing the heads");
    attention_config_for(r.model, cp, layout_unit(cp));  // throws for a group size the model cannot use
    if (r.seq_len && *r.seq_len < layout_unit(cp))
      throw config_error("--seq-len " + std::to_string(*r.seq_len) + " must be at least " +
                         std::to_string(layout_unit(cp)) + " for " + std::string(strategy_name(kind)) + " on " +
                         std::to_string(r.gpus) + " GPUs (for example --seq-len 128K)");
    if (r.seq_len && *r.seq_len % layout_unit(cp) != 0) {
      const std::int64_t unit = layout_unit(cp);
      throw config_error("--seq-len " + std::to_string(*r.seq_len) + " must be a multiple of " + std::to_string(unit) +
                         " for " + std::string(strategy_name(kind)) + " on " + std::to_string(r.gpus) +
                         " GPUs; use --seq-len " + std::to_string((*r.seq_len / unit + 1) * unit));
    }
  }
}

plan_result make_plan(const plan_request& r) {
  validate(r);
  plan_result out;
  // Configurations are independent meta runs: one thread each.
  std::vector<std::future<plan_entry>> work;
  std::vector<bool> offloads = {r.offload_optimizer};
  if (r.try_offload && r.zero != zero_stage::replicated) offloads = {false, true};
  for (const cp_settings& cp : configurations(r))
    for (const bool offload : offloads) {
      plan_request with = r;
      with.offload_optimizer = offload;
      work.push_back(std::async(std::launch::async, [with, cp] { return plan_configuration(with, cp); }));
    }
  for (auto& w : work) out.entries.push_back(w.get());
  std::int64_t upipe_longest = 0;
  for (const plan_entry& e : out.entries)
    if (e.strategy == strategy_kind::upipe && e.longest) upipe_longest = std::max(upipe_longest, e.longest->seq_len);
  out.planned_seq_len = r.seq_len ? *r.seq_len : upipe_longest;
  for (const plan_entry& e : out.entries) {
    if (e.strategy != strategy_kind::upipe || !e.longest || e.longest->seq_len < out.planned_seq_len) continue;
    if (!out.recommended_head_chunk || e.head_chunk > *out.recommended_head_chunk) out.recommended_head_chunk = e.head_chunk;
  }
  return out;
}

plan_point fastest_fit(const plan_request& r, const cp_settings& cp, std::int64_t seq_len) {
  // How far a point is from fitting: its larger need over the budget it must keep to.
  const double keep = 1.0 - r.margin;
  const auto overshoot = [&](const plan_point& p) {
    return std::max(static_cast<double>(p.gpu_bytes) / (keep * static_cast<double>(r.gpu_memory)),
                    static_cast<double>(p.host_bytes) / (keep * static_cast<double>(r.host_memory)));
  };
  std::optional<plan_point> closest;
  for (const checkpoint_policy& p : r.policy ? std::vector<checkpoint_policy>{*r.policy} : candidate_policies()) {
    plan_point point = evaluate(r, cp, seq_len, p);
    if (point.fits) return point;
    if (!closest || overshoot(point) < overshoot(*closest)) closest = std::move(point);
  }
  return *closest;
}

std::size_t gpu_context_bytes() { return context_bytes; }

}  // namespace upipe
