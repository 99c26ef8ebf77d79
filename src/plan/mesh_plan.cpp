// The planner's sweep over data-parallel meshes (docs/design.md section 11): at one length,
// D replicas of CP groups of C = gpus / D ranks, each configuration at the fewest sequence
// chunks that fit and its fastest checkpoint policy, timed by the step-time model; the
// recommendation is the mesh with the most tokens per second per GPU.
#include <algorithm>
#include <cmath>
#include <future>
#include <map>
#include <tuple>

#include "core/error.hpp"
#include "model/model_step.hpp"
#include "plan/planner.hpp"

namespace upipe {

namespace {

// A CP group of C consecutive ranks on nodes of G GPUs: inside one (C divides G) or over
// whole ones (G divides C).
bool placeable(int C, int G) { return C <= G ? G % C == 0 : C % G == 0; }

std::vector<int> replica_counts(const plan_request& r) {
  std::vector<int> out = r.dps;
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// Whether the configuration runs at seq_len (a length of its layout's unit that its
// attention can split).
bool runs_at(const model_config& model, const cp_settings& cp, std::int64_t seq_len) {
  if (seq_len % layout_unit(cp) != 0) return false;
  try {
    attention_config_for(model, cp, seq_len);
    return true;
  } catch (const config_error&) {
    return false;
  }
}

// The policy that fits with the shortest modelled step, else fastest_fit's closest: which
// checkpoints fit moves with the mesh, and recomputing the attention can cost more than
// moving its checkpoint through host memory, so the policies' fixed order is not the
// model's.
plan_point fastest_by_model(const plan_request& r, const cp_settings& cp, std::int64_t seq_len) {
  std::optional<plan_point> best;
  for (const checkpoint_policy& policy : r.policy ? std::vector<checkpoint_policy>{*r.policy} : candidate_policies()) {
    plan_point p = evaluate(r, cp, seq_len, policy);
    if (!p.fits) continue;
    p.time = model_step_time(r, cp, p);
    if (!best || p.time->total() < best->time->total()) best = std::move(p);
  }
  if (best) return *best;
  plan_point closest = fastest_fit(r, cp, seq_len);
  closest.time = model_step_time(r, cp, closest);
  return closest;
}

// One configuration's group (its sequence chunks ascending) on one mesh: the fewest chunks
// that fit, else the configuration that came closest (the first tried).
std::optional<mesh_entry> plan_group(const plan_request& r, const std::vector<cp_settings>& group, std::int64_t seq_len) {
  std::optional<mesh_entry> closest;
  for (const cp_settings& cp : group) {
    if (!runs_at(r.model, cp, seq_len)) continue;
    mesh_entry e;
    e.dp = r.dp;
    e.cp = cp;
    e.offload_optimizer = r.offload_optimizer;
    e.offload_params = r.offload_params;
    e.point = fastest_by_model(r, cp, seq_len);
    if (e.point.fits) return e;
    if (!closest) closest = std::move(e);
  }
  return closest;
}

// Faster in the model; at the same speed (U changes no modelled time) the larger U, whose
// fewer and larger stages the model does not count, then the smaller footprint on the GPU.
bool better(const mesh_entry& a, const mesh_entry& b) {
  const double ta = a.tokens_per_s_per_gpu(), tb = b.tokens_per_s_per_gpu();
  if (std::abs(ta - tb) > 1e-9 * std::max(ta, tb)) return ta > tb;
  if (a.cp.head_chunk != b.cp.head_chunk) return a.cp.head_chunk > b.cp.head_chunk;
  return a.point.gpu_bytes < b.point.gpu_bytes;
}

// The key a table row stands for: the mesh, the strategy and where the optimizer lives.
std::tuple<int, strategy_kind, bool, bool> row_key(const mesh_entry& e) {
  return {e.dp, e.cp.strategy, e.offload_optimizer, e.offload_params};
}

}  // namespace

std::vector<mesh_entry> plan_meshes(const plan_request& r, std::int64_t seq_len) {
  const int G = r.gpus / r.nodes;
  std::vector<offload_options> offloads = {{r.offload_optimizer, r.offload_params}};
  if (r.try_offload && r.zero != zero_stage::replicated) {
    offloads = {{false, false}, {true, false}};
    if (!r.lora.enabled()) offloads.push_back({true, true});
  }
  std::vector<std::future<std::optional<mesh_entry>>> work;
  for (const int d : replica_counts(r)) {
    if (!placeable(r.gpus / d, G)) continue;
    plan_request mesh = r;
    mesh.dp = d;
    // A thread per configuration (strategy, U, ring) and optimizer placement, its N ascending.
    std::vector<std::vector<cp_settings>> groups;
    for (const cp_settings& cp : plan_configurations(mesh)) {
      auto it = std::find_if(groups.begin(), groups.end(), [&](const std::vector<cp_settings>& g) {
        return g.front().strategy == cp.strategy && g.front().head_chunk == cp.head_chunk && g.front().ring == cp.ring;
      });
      if (it == groups.end()) groups.push_back({cp});
      else it->push_back(cp);
    }
    for (std::vector<cp_settings>& group : groups) {
      std::sort(group.begin(), group.end(),
                [](const cp_settings& a, const cp_settings& b) { return a.seq_chunks < b.seq_chunks; });
      for (const offload_options offload : offloads) {
        plan_request with = mesh;
        with.offload_optimizer = offload.optimizer;
        with.offload_params = offload.params;
        work.push_back(std::async(std::launch::async, [with, group, seq_len] { return plan_group(with, group, seq_len); }));
      }
    }
  }
  // Per mesh, strategy and optimizer placement: the fastest that fits, else the closest.
  std::vector<mesh_entry> out;
  std::map<std::tuple<int, strategy_kind, bool, bool>, std::size_t> row;
  for (auto& w : work) {
    std::optional<mesh_entry> e = w.get();
    if (!e) continue;
    const auto [it, added] = row.emplace(row_key(*e), out.size());
    if (added) {
      out.push_back(std::move(*e));
      continue;
    }
    mesh_entry& best = out[it->second];
    if (e->point.fits && (!best.point.fits || better(*e, best))) best = std::move(*e);
  }
  return out;
}

void recommend_mesh(plan_result& result) {
  for (std::size_t i = 0; i < result.meshes.size(); ++i) {
    const mesh_entry& e = result.meshes[i];
    if (!e.point.fits) continue;
    const auto faster = [&](const std::optional<std::size_t>& than) { return !than || better(e, result.meshes[*than]); };
    if (faster(result.recommended_mesh)) result.recommended_mesh = i;
    if (e.dp == 1 && faster(result.best_cp_only)) result.best_cp_only = i;
  }
}

}  // namespace upipe
