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

// The policy that fits with the shortest modelled step, else the one closest to fitting
// (its larger need over its budget smallest, as fastest_fit says): which checkpoints fit
// moves with the mesh, and moving the attention's checkpoint through host memory can beat
// recomputing it, so the policies' fixed order is not the model's. The model's time needs
// no probe (the length and the policy alone), so the policies are probed in its order,
// fastest first (ties in the policies' order), and the first that fits is the answer; only
// where none fits is every policy probed.
plan_point fastest_by_model(const plan_request& r, const cp_settings& cp, std::int64_t seq_len) {
  std::vector<plan_point> by_time;
  for (const checkpoint_policy& policy : r.policy ? std::vector<checkpoint_policy>{*r.policy} : candidate_policies()) {
    plan_point p;
    p.seq_len = seq_len;
    p.policy = policy;
    p.time = model_step_time(r, cp, p);
    by_time.push_back(std::move(p));
  }
  const std::vector<plan_point> unsorted = by_time;
  std::stable_sort(by_time.begin(), by_time.end(),
                   [](const plan_point& a, const plan_point& b) { return a.time->total() < b.time->total(); });
  // None fits: every policy probed, the closest (ties to the earlier in the policies' order).
  std::vector<plan_point> probed;
  for (const plan_point& timed : by_time) {
    plan_point p = evaluate(r, cp, seq_len, timed.policy);
    p.time = timed.time;
    if (p.fits) return p;
    probed.push_back(std::move(p));
  }
  std::optional<plan_point> closest;
  for (const plan_point& policy : unsorted) {
    const plan_point& p = *std::find_if(probed.begin(), probed.end(), [&](const plan_point& q) { return q.policy.str() == policy.policy.str(); });
    if (!closest || overshoot(r, p) < overshoot(r, *closest)) closest = p;
  }
  return *closest;
}

// One configuration's group (its sequence chunks ascending) on one mesh: the fewest chunks
// that fit, else the chunks that came closest, trying more only while they come closer (as
// the plan stops its N once one reaches no further).
std::optional<mesh_entry> plan_group(const plan_request& r, const std::vector<cp_settings>& group, std::int64_t seq_len) {
  std::optional<mesh_entry> closest;
  for (const cp_settings& cp : group) {
    if (!runs_at(r.model, cp, seq_len)) continue;
    mesh_entry e;
    e.dp = r.dp;
    e.cp = cp;
    e.offload_optimizer = r.offload_optimizer;
    e.offload_params = r.offload_params;
    e.offload_master = r.offload_master;
    e.state = r.state;
    e.point = fastest_by_model(r, cp, seq_len);
    if (e.point.fits) return e;
    if (closest && overshoot(r, e.point) >= overshoot(r, closest->point)) break;
    closest = std::move(e);
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

namespace {

// The configurations of one mesh, grouped by strategy, U and ring, each group's sequence
// chunks ascending.
std::vector<std::vector<cp_settings>> configuration_groups(const plan_request& mesh) {
  std::vector<std::vector<cp_settings>> groups;
  for (const cp_settings& cp : plan_configurations(mesh)) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const std::vector<cp_settings>& g) {
      return g.front().strategy == cp.strategy && g.front().head_chunk == cp.head_chunk && g.front().ring == cp.ring;
    });
    if (it == groups.end()) groups.push_back({cp});
    else it->push_back(cp);
  }
  for (std::vector<cp_settings>& group : groups)
    std::sort(group.begin(), group.end(),
              [](const cp_settings& a, const cp_settings& b) { return a.seq_chunks < b.seq_chunks; });
  return groups;
}

// Whether CP over every GPU's plan says a configuration group reaches seq_len: the longest
// length of any of its chunk counts, or true when the plan has none of it.
bool reaches(const std::vector<plan_entry>* cp_only, const cp_settings& cp, offload_options offload,
             std::int64_t seq_len) {
  if (cp_only == nullptr) return true;
  bool known = false;
  for (const plan_entry& e : *cp_only) {
    if (e.strategy != cp.strategy || e.head_chunk != cp.head_chunk || e.ring != cp.ring ||
        e.offload_optimizer != offload.optimizer || e.offload_params != offload.params)
      continue;
    known = true;
    if (e.longest && e.longest->seq_len >= seq_len) return true;
  }
  return !known;
}

// Every configuration of one mesh, a thread per configuration group and optimizer
// placement; with CP over every GPU's plan (D = 1), the groups it says cannot reach seq_len
// are left out.
std::vector<mesh_entry> plan_mesh(const plan_request& mesh, std::int64_t seq_len, const std::vector<plan_entry>* cp_only) {
  std::vector<offload_options> offloads = {{mesh.offload_optimizer, mesh.offload_params}};
  if (mesh.try_offload && mesh.zero != zero_stage::replicated) {
    offloads = {{false, false}, {true, false}};
    if (!mesh.lora.enabled()) offloads.push_back({true, true});
  }
  std::vector<std::future<std::optional<mesh_entry>>> work;
  for (const std::vector<cp_settings>& group : configuration_groups(mesh))
    for (const offload_options offload : offloads) {
      if (!reaches(cp_only, group.front(), offload, seq_len)) continue;
      plan_request with = mesh;
      with.offload_optimizer = offload.optimizer;
      with.offload_params = offload.params;
      work.push_back(std::async(std::launch::async, [with, group, seq_len] { return plan_group(with, group, seq_len); }));
    }
  std::vector<mesh_entry> out;
  for (auto& w : work)
    if (std::optional<mesh_entry> e = w.get()) out.push_back(std::move(*e));
  return out;
}

}  // namespace

std::vector<mesh_entry> plan_meshes(const plan_request& r, std::int64_t seq_len, const std::vector<plan_entry>* cp_only) {
  const int G = r.gpus / r.nodes;
  // Per mesh, strategy and optimizer placement: the fastest that fits, else the closest.
  std::vector<mesh_entry> out;
  std::map<std::tuple<int, strategy_kind, bool, bool>, std::size_t> row;
  for (const int d : replica_counts(r)) {
    if (!placeable(r.gpus / d, G)) continue;
    plan_request mesh = r;
    mesh.dp = d;
    bool any_fits = false;
    for (mesh_entry& e : plan_mesh(mesh, seq_len, d == r.dp ? cp_only : nullptr)) {
      any_fits = any_fits || e.point.fits;
      const auto [it, added] = row.emplace(row_key(e), out.size());
      if (added) {
        out.push_back(std::move(e));
        continue;
      }
      mesh_entry& best = out[it->second];
      if (e.point.fits && (!best.point.fits || better(e, best))) best = std::move(e);
    }
    // More replicas of smaller groups hold more of the sequence per GPU and the same ZeRO
    // state: where nothing fits with D replicas, nothing fits with more.
    if (!any_fits) break;
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
