#include "plan/planner.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <string>

#include "core/error.hpp"
#include "core/limits.hpp"
#include "cp/strategy_table.hpp"
#include "model/hf_model.hpp"
#include "model/model_step.hpp"
#include "train/run_memory.hpp"
#include "train/step_sizes.hpp"
#include "ops/gemm_workspace.hpp"

namespace upipe {

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;
constexpr std::size_t pool_headroom = 64 * mib;          // a pool's alignment beside its high water
constexpr double gib_hundredth = static_cast<double>(std::size_t{1} << 30) / 100;
constexpr std::int64_t longest_searched = std::int64_t{1} << 30;  // tokens

constexpr std::size_t context_bytes = cuda_context_bytes;  // outside the arena (train/run_memory.hpp)

train_options probe_options(const plan_request& r, const cp_settings& cp, std::int64_t seq_len,
                            const checkpoint_policy& policy) {
  train_options o;
  o.model = r.model;
  o.tokens = token_source::random;
  o.seq_len = seq_len;
  o.cp = cp;
  o.dp = r.dp;
  o.ep = r.ep;
  o.zero = r.zero;
  o.offload_optimizer = r.offload_optimizer;
  o.offload_params = r.offload_params;
  o.offload_master = r.offload_master;
  o.offload_overlap = r.offload_overlap;
  o.state_format = r.state.format;
  o.grad_type = r.state.grad_type;
  o.optim.max_grad_norm = r.max_grad_norm;
  o.optim.total_steps = 1;
  o.optim.warmup_steps = 0;
  o.eval_samples = 0;
  o.backend = backend_kind::meta;
  // The probe's arenas are unbounded (meta, with the GPU's library workspaces); the tile and
  // chunk are those of the planned GPU's arena, the GPU memory less the context.
  o.step = {r.mlp_tile, r.loss_chunk, policy};
  o.step.attention_arithmetic = r.attention_arithmetic;
  o.step.lora = r.lora;
  o.model_dir = r.model_dir;
  o.weights_in_model_dir = train_options::model_dir_weights::optional;
  const resolved_step resolved = resolve_step(sizes_of(o, planned_arena_gib(r), 0));
  o.step = resolved.step;
  o.limits = resolved.limits;
  return o;
}

// The lengths searched: multiples of the layout's unit times 1024.
std::int64_t granule(const cp_settings& cp) { return layout_unit(cp) * 1024; }

// The longest multiple of the granule at which `fits` holds (0: not even one granule).
// From nothing: doubling from one granule, then bisection. From `known` (a length known to
// fit, usually close to the answer): steps of 1, 2, 4, ... granules above it, then
// bisection, so a nearby answer costs few probes.
std::int64_t longest_fit(const cp_settings& cp, const std::function<bool(std::int64_t seq_len)>& fits_at,
                         std::int64_t known = 0) {
  const std::int64_t g = granule(cp), top = longest_searched / g;
  auto fits = [&](std::int64_t k) { return fits_at(k * g); };
  std::int64_t good = std::max<std::int64_t>(known / g, 1);
  if (known == 0 && !fits(1)) return 0;
  std::int64_t bad = 0;
  for (std::int64_t step = known == 0 ? good : 1; bad == 0; step *= 2) {
    if (good + step > top) {
      if (good == top || !fits(top)) bad = top;
      else return top * g;
    } else if (fits(good + step)) {
      good += step;
    } else {
      bad = good + step;
    }
  }
  while (bad - good > 1) {
    const std::int64_t mid = good + (bad - good) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good * g;
}

// The longest multiple of the granule whose need (overshoot: at most 1 fits) fits, searched
// from `start` granules: 1 from nothing, else a length near the answer (a neighbouring
// configuration's, or the policy before's answer and one granule more). A step's memory is
// close to affine in S (piecewise: its tiles and chunks are whole), so the boundary is
// predicted from the two latest probes (a secant) and probed there and one granule past
// it, a few rounds, each probe kept strictly between the longest known to fit and the
// shortest known not to; where the rounds leave no bracket, steps doubling away from the
// nearest probe find one; then bisection. An exact prediction costs three or four probes,
// where doubling then bisection costs about 2 log2 of the distance in granules.
std::int64_t longest_fit_predicted(const cp_settings& cp, const std::function<double(std::int64_t seq_len)>& need_at,
                                   std::int64_t start = 1) {
  const std::int64_t g = granule(cp), top = longest_searched / g;
  std::int64_t good = 0, bad = 0;  // the longest known to fit, the shortest known not to (0: none)
  const auto need = [&](std::int64_t k) {
    const double n = need_at(k * g);
    if (n <= 1) good = std::max(good, k);
    else bad = bad == 0 ? k : std::min(bad, k);
    return n;
  };
  const auto closed = [&] { return bad == 1 || good == top || (good > 0 && bad > 0 && bad - good <= 1); };
  std::int64_t k_a = std::clamp<std::int64_t>(start, 1, top);
  // From a start further on, first the shortest length (its probe the cheapest): where it
  // does not fit, nothing does.
  if (k_a > 1 && need(1) > 1) return 0;
  double need_a = need(k_a);
  // The second probe: from nothing 64 granules on (a slope over a span), else one granule
  // past the first toward the boundary.
  std::int64_t k_b = need_a > 1 ? k_a - 1 : k_a == 1 ? 64 : k_a + 1;
  for (int round = 0; round < 8 && !closed(); ++round) {
    k_b = std::clamp<std::int64_t>(k_b, good + 1, bad == 0 ? top : bad - 1);
    const double need_b = need(k_b);
    if (closed()) break;
    const double slope = (need_b - need_a) / static_cast<double>(k_b - k_a);
    std::int64_t next = slope > 0 ? static_cast<std::int64_t>(std::floor(static_cast<double>(k_b) + (1 - need_b) / slope))
                        : need_b <= 1 ? k_b * 2
                                      : (good + k_b) / 2;
    if (need_b > 1 && next >= k_b) next = k_b - 1;
    if (need_b <= 1 && next <= k_b) next = k_b + 1;
    k_a = k_b, need_a = need_b, k_b = next;
  }
  for (std::int64_t step = std::max<std::int64_t>(good, 1); !closed() && bad == 0; step *= 2)
    need(std::min(top, good + step));  // every probe fit: on up
  for (std::int64_t step = 1; !closed() && good == 0; step *= 2)
    need(std::max<std::int64_t>(1, bad - step));  // none fit: on down
  while (!closed()) need(good + (bad - good) / 2);
  return good * g;
}

// longest_fit from a length that may fit (a neighbouring configuration's answer): from it
// when it fits; else down from it in steps of 1, 2, 4, ... granules to one that fits, then
// bisection between, so that an answer near the hint costs few probes either way.
std::int64_t longest_fit_near(const cp_settings& cp, const std::function<bool(std::int64_t seq_len)>& fits_at,
                              std::int64_t hint) {
  const std::int64_t g = granule(cp);
  hint = hint / g * g;
  if (hint < g) return longest_fit(cp, fits_at);
  if (fits_at(hint)) return longest_fit(cp, fits_at, hint);
  std::int64_t bad = hint / g, good = 0;
  for (std::int64_t step = 1; good == 0; step *= 2) {
    if (bad - step < 1) {
      if (!fits_at(g)) return 0;
      good = 1;
    } else if (fits_at((bad - step) * g)) {
      good = bad - step;
    } else {
      bad -= step;
    }
  }
  while (bad - good > 1) {
    const std::int64_t mid = good + (bad - good) / 2;
    (fits_at(mid * g) ? good : bad) = mid;
  }
  return good * g;
}

}  // namespace

struct probe_cache {
  std::mutex mutex;
  std::map<std::string, step_memory> memory;
  plan_stats stats;  // under the mutex
};

namespace {

// What distinguishes one probe from another within a plan (one model, one machine).
std::string probe_key(const plan_request& r, const cp_settings& cp, std::int64_t seq_len, const checkpoint_policy& policy) {
  std::string key;
  for (const long long v : {static_cast<long long>(cp.strategy), static_cast<long long>(cp.cp),
                            static_cast<long long>(cp.head_chunk), static_cast<long long>(cp.ring),
                            static_cast<long long>(cp.seq_chunks), static_cast<long long>(seq_len),
                            static_cast<long long>(r.dp), static_cast<long long>(r.ep), static_cast<long long>(r.zero),
                            static_cast<long long>(r.offload_optimizer), static_cast<long long>(r.offload_params),
                            static_cast<long long>(r.offload_master), static_cast<long long>(r.state.format.moments),
                            static_cast<long long>(r.state.format.master), static_cast<long long>(r.state.grad_type),
                            static_cast<long long>(r.max_grad_norm > 0), static_cast<long long>(r.mlp_tile),
                            static_cast<long long>(r.loss_chunk)})
    key += std::to_string(v) + ",";
  return key + policy.str() + "," + lora_text(r.lora) + "," + real_text(planned_arena_gib(r));
}

// Runs one meta step and counts it (and its seconds) in the plan's stats.
template <typename Run>
auto counted(const plan_request& r, std::int64_t seq_len, bool eval, Run&& run) {
  const auto start = std::chrono::steady_clock::now();
  auto out = run();
  if (r.cache) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::lock_guard lock(r.cache->mutex);
    plan_stats& st = r.cache->stats;
    ++(eval ? st.eval_probes : st.step_probes);
    st.probe_seconds += seconds;
    st.longest_probed = std::max(st.longest_probed, seq_len);
    }
  return out;
}

step_memory probe_memory(const plan_request& r, const cp_settings& cp, std::int64_t seq_len,
                         const checkpoint_policy& policy) {
  const auto run = [&] { return measure_step_memory(probe_options(r, cp, seq_len, policy)); };
  if (!r.cache) return run();
  const std::string key = probe_key(r, cp, seq_len, policy);
  {
    std::lock_guard lock(r.cache->mutex);
    if (auto it = r.cache->memory.find(key); it != r.cache->memory.end()) {
      ++r.cache->stats.cache_hits;
      return it->second;
    }
  }
  step_memory m = counted(r, seq_len, false, run);
  std::lock_guard lock(r.cache->mutex);
  return r.cache->memory.emplace(key, std::move(m)).first->second;
}

}  // namespace

// The configurations, row by row of the strategy table, over a CP group of C = gpus / dp:
// every U a row takes over its all-to-all group (one all-to-all group per node for a mesh,
// whose ring runs over the nodes of a CP group: planned only where the group spans whole
// nodes), and its sequence chunks: every N >= 2 for a row that requires them (fpdt), every
// N at the smallest U for a row that chooses U (upipe), none for the rest (a row with all
// heads and optional chunks, Ulysses, is the chunked row's N = 1).
std::vector<cp_settings> plan_configurations(const plan_request& r) {
  const int C = r.gpus / r.dp, G = r.gpus / r.nodes;
  // A chunked row with all heads (fpdt) plans U = H over chunks once: the U = H of a row
  // that chooses U is left to it.
  const bool chunked_all_heads = std::any_of(r.strategies.begin(), r.strategies.end(), [](strategy_kind k) {
    return row_of(k).chunks == sequence_chunking::required && row_of(k).heads == head_stages::all;
  });
  std::vector<cp_settings> out;
  for (strategy_kind kind : r.strategies) {
    const strategy_row& row = row_of(kind);
    if (row.mesh && (C <= G || C % G != 0)) continue;
    const int rings = row.mesh ? C / G : 1;
    const std::vector<int> us = head_chunk_choices(row, r.model.num_heads, C / rings);
    if (row.chunks == sequence_chunking::none ||
        (row.chunks == sequence_chunking::optional && row.heads != head_stages::chosen)) {
      for (int u : us) out.push_back({kind, C, u, rings, 1});
      continue;
    }
    for (int u : us)
      for (int n : r.seq_chunks) {
        // Sequence chunks at the smallest U only: U heads x S/N tokens is the attention's
        // working set and the chunks' K/V in host memory do not depend on U, so for every N
        // the smallest U reaches at least as far as any larger one (each (U, N) is a search
        // of its own, dozens of meta steps of H/U x N attention calls per layer).
        const bool planned = row.chunks == sequence_chunking::required
                                 ? n >= 2
                                 : n == 1 || (u == us.front() && !(chunked_all_heads && u == r.model.num_heads));
        if (planned) out.push_back({kind, C, u, rings, n});
      }
  }
  // A hybrid's Gated DeltaNet layers take the head layouts only where C divides their heads.
  std::erase_if(out, [&](const cp_settings& cp) { return !linear_layers_run(r.model, cp); });
  return out;
}

step_time model_step_time(const plan_request& r, const cp_settings& cp, const plan_point& p) {
  step_time_request t;
  t.model = r.model;
  t.cp = cp;
  t.dp = r.dp;
  t.ep = r.ep;
  t.gpus_per_node = r.gpus / r.nodes;
  t.seq_len = p.seq_len;
  t.policy = p.policy;
  t.zero = r.zero;
  t.offload_optimizer = r.offload_optimizer;
  t.offload_params = r.offload_params;
  t.offload_master = r.offload_master;
  t.grad_bytes = r.max_grad_norm > 0 && r.state.grad_type == dtype::bf16 ? 2 : 4;
  t.lora = r.lora.enabled();
  t.state = r.state.format;
  t.streamed = r.max_grad_norm <= 0;  // plan's runs take one sequence a step
  t.overlap = r.offload_overlap;
  return estimate_step_time(t, r.rates);
}

step_time model_step_time(const train_options& o) {
  step_time_request t;
  t.model = o.model;
  t.cp = o.cp;
  t.dp = o.dp;
  t.gpus_per_node = o.gpus_per_node > 0 ? o.gpus_per_node : std::max(8, o.dp * o.cp.cp);
  t.seq_len = o.seq_len;
  t.policy = o.step.policy;
  t.zero = o.zero;
  t.offload_optimizer = o.offload_optimizer;
  t.offload_params = o.offload_params;
  t.offload_master = o.offload_master && !o.offload_optimizer;
  const optimizer_state_options state = state_options_of(o);
  t.streamed = state.grads == grad_keeping::streamed;
  t.grad_bytes = !t.streamed && state.grad_type == dtype::bf16 ? 2 : 4;
  t.lora = o.step.lora.enabled();
  t.state = o.state_format;
  t.overlap = o.offload_overlap;
  return estimate_step_time(t, throughput_rates{});
}

namespace {

// One configuration; `hint` is a neighbour's plan (the same strategy and U with fewer
// chunks, or a leaner state format), whose lengths start the searches. With `bounds`, the
// neighbour holds no more than this configuration at any length (a leaner state format in
// the same placement), so a policy it searched reaches no further here: one whose longest
// there falls short of the best so far here by a granule is passed over unprobed.
plan_entry plan_configuration(const plan_request& r, const cp_settings& cp, const plan_entry* hint = nullptr,
                              bool bounds = false) {
  plan_entry e;
  e.strategy = cp.strategy;
  e.head_chunk = cp.head_chunk;
  e.ring = cp.ring;
  e.seq_chunks = cp.seq_chunks;
  e.offload_optimizer = r.offload_optimizer;
  e.offload_params = r.offload_params;
  e.offload_master = r.offload_master;
  e.state = r.state;
  const std::vector<checkpoint_policy> policies =
      r.policy ? std::vector<checkpoint_policy>{*r.policy} : candidate_policies();
  std::int64_t best = 0;
  std::size_t chosen = 0;
  e.searched.assign(policies.size(), -1);
  const std::int64_t g = granule(cp);
  for (std::size_t i = 0; i < policies.size(); ++i) {
    const auto need = [&](std::int64_t seq_len) { return overshoot(r, evaluate(r, cp, seq_len, policies[i])); };
    // A later policy is searched only if it beats the best so far by a granule, from there
    // or from where the neighbour found this policy's longest, the further.
    const bool bounded = bounds && hint != nullptr && i < hint->searched.size() && hint->searched[i] >= 0;
    if (bounded && hint->searched[i] < best + g) continue;
    if (best > 0 && (best + g > longest_searched || need(best + g) > 1)) continue;
    const std::int64_t near = hint == nullptr                       ? 0
                              : i < hint->searched.size() && hint->searched[i] > 0 ? hint->searched[i]
                              : best == 0 && hint->longest                ? hint->longest->seq_len
                                                                           : 0;
    const std::int64_t s = longest_fit_predicted(cp, need, std::max(best > 0 ? best / g + 1 : 1, near / g));
    e.searched[i] = s;
    if (s > best) best = s, chosen = i;  // ties keep the earlier (faster) policy
  }
  if (best > 0) {
    e.longest = evaluate(r, cp, best, policies[chosen]);
    e.longest->time = model_step_time(r, cp, *e.longest);
  }
  if (r.eval) {
    const auto fits = [&](std::int64_t seq_len) { return evaluate_forward(r, cp, seq_len).fits; };
    const std::int64_t s = hint != nullptr && hint->longest_eval ? longest_fit_near(cp, fits, hint->longest_eval->seq_len)
                                                                : longest_fit(cp, fits);
    if (s > 0) e.longest_eval = evaluate_forward(r, cp, s);
  }
  if (r.seq_len) {
    e.at_request = fastest_fit(r, cp, *r.seq_len);
    e.at_request->time = model_step_time(r, cp, *e.at_request);
  }
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

std::vector<optimizer_state_options> state_ladder() {
  const adamw_state_format fp32{}, bf16{moment_format::bf16, master_format::f32}, q8{moment_format::q8, master_format::f32},
      q8_kahan{moment_format::q8, master_format::bf16_kahan};
  return {{fp32, dtype::f32}, {fp32, dtype::bf16}, {bf16, dtype::bf16}, {q8, dtype::bf16}, {q8_kahan, dtype::bf16}};
}

std::vector<offload_options> placements(bool lora) {
  if (lora) return {{false, false}, {true, false}};  // a LoRA base stays on the GPU, its adapters' state in f32
  return {{false, false}, {false, false, true}, {true, false}, {false, true, true}, {true, true}};
}

gpu_overheads estimate_overheads(const step_memory& memory) {
  gpu_overheads o;
  o.cublaslt_workspace = std::min(memory.workspace_at_end, cublaslt_workspace_bytes);
  o.cudnn_workspace = memory.workspace_at_end - o.cublaslt_workspace;
  o.context = gpu_context_bytes();
  return o;
}

double overshoot(const plan_request& r, const plan_point& p) {
  const double keep = 1.0 - r.margin;
  const std::size_t node_budget = p.host_budget * (r.nodes > 1 ? static_cast<std::size_t>(r.gpus / r.nodes) : 1);
  return std::max(static_cast<double>(p.gpu_bytes) / (keep * static_cast<double>(r.gpu_memory)),
                  static_cast<double>(std::max(p.host_bytes, node_budget)) / (keep * static_cast<double>(r.host_memory)));
}

plan_point evaluate(const plan_request& r, const cp_settings& cp, std::int64_t seq_len, const checkpoint_policy& policy) {
  plan_point p;
  p.seq_len = seq_len;
  p.policy = policy;
  p.memory = probe_memory(r, cp, seq_len, policy);
  p.overheads = estimate_overheads(p.memory);
  p.arena_bytes = p.memory.arena_high_water;  // the meta probe reserves the workspaces as the GPU does
  p.gpu_bytes = p.arena_bytes + p.overheads.context;
  // One process runs a node's ranks; on several nodes a launcher starts one per GPU.
  const train_options o = probe_options(r, cp, seq_len, policy);
  const std::size_t ranks = static_cast<std::size_t>(r.nodes > 1 ? 1 : r.gpus / r.nodes);
  std::size_t beside = 0;
  for (const memory_part& part : host_beside_pools(o)) beside += part.bytes;
  p.host_bytes = p.memory.host_high_water * ranks + beside;
  // Each pool: its high water with the alignment's headroom, and at least what train
  // requires a budget to leave it (the offload and the chunks as it sizes them).
  const std::size_t pool = std::max(p.memory.host_high_water + pool_headroom,
                                    pool_floor(pool_parts_of(sizes_of(o, planned_arena_gib(r), 0))));
  const double budget = static_cast<double>(pool * ranks + beside);
  p.host_budget = static_cast<std::size_t>(std::ceil(budget / gib_hundredth)) * static_cast<std::size_t>(gib_hundredth);
  if (r.nodes > 1) p.host_bytes *= static_cast<std::size_t>(r.gpus / r.nodes);  // the node's processes
  p.fits = overshoot(r, p) <= 1;
  return p;
}

eval_point evaluate_forward(const plan_request& r, const cp_settings& cp, std::int64_t seq_len) {
  const train_options o = probe_options(r, cp, seq_len, candidate_policies().front());
  model_step_request req;
  req.model = r.model;
  req.cp = cp;
  req.options = o.step;
  req.options.lora = {};  // evaluation reads the weights alone (a merged adapter)
  req.backend = backend_kind::meta;
  req.limits = o.limits;
  const host_weights none;
  const eval_result m = counted(r, seq_len, true, [&] {
    return upipe::evaluate(req, host_weight_source(none), {eval_sequence{{}, {}, {}, seq_len}});
  });
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
  if (r.lora.enabled()) validate(r.lora, r.model);
  if ((r.offload_optimizer || r.offload_params || r.try_offload) && r.zero == zero_stage::replicated)
    throw config_error("--offload needs an optimizer (it moves AdamW's state): drop --optimizer none");
  if (r.offload_params && !r.offload_optimizer && !r.offload_master)
    throw config_error("the weights go to host memory only with the master weights: use --offload optimizer,params "
                       "or master,params");
  if (r.offload_params && r.lora.enabled())
    throw config_error("--offload optimizer,params with --lora: a LoRA run's frozen base stays in GPU memory; use "
                       "--offload optimizer");
  if (r.lora.enabled() && (r.offload_master || r.try_state || !(r.state == optimizer_state_options{})))
    throw config_error("--lora keeps its adapters' AdamW state in f32: drop --optimizer-state, --master-weights, "
                       "--grad-dtype and --offload master");
  if ((r.try_state || r.offload_master || !(r.state == optimizer_state_options{})) && r.zero == zero_stage::replicated)
    throw config_error("--optimizer none plans no optimizer state: drop --optimizer-state, --master-weights, "
                       "--grad-dtype and --offload");
  if (!(r.max_grad_norm >= 0) || !std::isfinite(r.max_grad_norm))
    throw config_error("--max-grad-norm " + real_text(r.max_grad_norm) + " must be 0 (no clipping: no gradient shard "
                       "kept) or more (for example 1.0)");
  if (r.gpus < 1)
    throw config_error("--gpus " + std::to_string(r.gpus) + " must be at least 1 (for example --gpus 8)");
  if (r.nodes < 1 || r.gpus % r.nodes != 0)
    throw config_error("--nodes " + std::to_string(r.nodes) + " must divide the " + std::to_string(r.gpus) +
                       " GPUs into equal nodes (for example --gpus-per-node 8 --nodes 2)");
  if (r.dp < 1 || r.gpus % r.dp != 0)
    throw config_error("--dp " + std::to_string(r.dp) + " must divide the " + std::to_string(r.gpus) +
                       " GPUs into replicas of equal CP groups (for example --dp 1)");
  for (const int d : r.dps)
    if (d < 1 || r.gpus % d != 0)
      throw config_error("--dp " + std::to_string(d) + " must divide the " + std::to_string(r.gpus) +
                         " GPUs into replicas of equal CP groups (for example --dp 1,2,4)");
  if (r.ep != 1) {
    const int experts = r.model.sparse_layer_count() > 0 ? r.model.moe.experts : 1;
    if (r.ep < 1 || r.gpus % r.ep != 0 || experts % r.ep != 0)
      throw config_error("--ep " + std::to_string(r.ep) + " must divide the " + std::to_string(r.gpus) + " GPUs and " +
                         r.model.name + "'s " + std::to_string(experts) + " experts (for example --ep 1)");
  }
  if (r.gpu_memory == 0) throw config_error("--gpu-memory must be positive (for example --gpu-memory 80GiB)");
  if (static_cast<double>(r.gpu_memory) > limits::max_memory_gib * (1 << 30))
    throw config_error("--gpu-memory " + std::to_string(r.gpu_memory) +
                       " bytes is beyond a pebibyte, the most a rank's arena sizes for (for example --gpu-memory 80GiB)");
  if (r.host_memory == 0) throw config_error("--host-memory must be positive (for example --host-memory 1.9TiB)");
  if (!(r.margin >= 0 && r.margin < 1))
    throw config_error("--margin " + real_text(r.margin) + " must lie in [0, 1) (for example 0.05)");
  if (r.strategies.empty()) throw config_error("--attention needs at least one of " + strategy_names());
  if (r.seq_chunks.empty()) throw config_error("--seq-chunks needs at least one N (for example --seq-chunks 1,4,16)");
  for (const int n : r.seq_chunks)
    if (n < 1 || n > 4096)
      throw config_error("--seq-chunks " + std::to_string(n) + " must lie in [1, 4096] (for example --seq-chunks 1,4,16)");
  const int C = r.gpus / r.dp, G = r.gpus / r.nodes;  // a CP group, a node
  for (strategy_kind kind : r.strategies) {
    const strategy_row& row = row_of(kind);
    const std::string name(row.name);
    if (row.chunks == sequence_chunking::required &&
        std::none_of(r.seq_chunks.begin(), r.seq_chunks.end(), [](int n) { return n >= 2; }))
      throw config_error(name + " needs N >= 2 sequence chunks among --seq-chunks (for example --seq-chunks 4,16)");
    if (row.mesh && (C <= G || C % G != 0))
      throw config_error(name + " needs a CP group over more than one node (its ring runs across the nodes): give "
                         "--gpus-per-node G --nodes M with M >= 2, or plan ulysses, upipe and ring on one node");
    const int rings = row.mesh ? C / G : 1;
    const std::vector<int> us = head_chunk_choices(row, r.model.num_heads, C / rings);
    if (us.empty())
      throw config_error(name + " has no valid head chunk for " + std::to_string(r.model.num_heads) + " heads on " +
                         std::to_string(C / rings) + " GPUs; use --gpus dividing the heads");
    const cp_settings cp{kind, C, row.heads == head_stages::all ? r.model.num_heads : 0, rings,
                         row.chunks == sequence_chunking::required ? 2 : 1};
    attention_config_for(r.model, cp, granule(cp));  // throws for a group size the model cannot use
    if (r.seq_len && *r.seq_len < layout_unit(cp))
      throw config_error("--seq-len " + std::to_string(*r.seq_len) + " must be at least " +
                         std::to_string(layout_unit(cp)) + " for " + std::string(strategy_name(kind)) + " on " +
                         std::to_string(C) + " GPUs (for example --seq-len 128K)");
    if (r.seq_len && *r.seq_len % layout_unit(cp) != 0) {
      const std::int64_t unit = layout_unit(cp);
      throw config_error("--seq-len " + std::to_string(*r.seq_len) + " must be a multiple of " + std::to_string(unit) +
                         " for " + std::string(strategy_name(kind)) + " on " + std::to_string(C) +
                         " GPUs; use --seq-len " + std::to_string((*r.seq_len / unit + 1) * unit));
    }
  }
}

namespace {

// A stage's progress: each finished search reports, one at a time, to the request's callback.
class stage_progress {
 public:
  stage_progress(const plan_request& r, std::string stage, int total) : r_(r), stage_(std::move(stage)), total_(total) {
    if (r_.progress) r_.progress(stage_, 0, total_);
  }
  void tick() {
    if (!r_.progress) return;
    std::lock_guard lock(mutex_);
    r_.progress(stage_, ++done_, total_);
  }

 private:
  const plan_request& r_;
  std::string stage_;
  int total_ = 0, done_ = 0;
  std::mutex mutex_;
};

plan_request with_placement(plan_request r, const offload_options& offload) {
  r.offload_optimizer = offload.optimizer;
  r.offload_params = offload.params;
  r.offload_master = offload.master;
  return r;
}

// Every configuration in every placement asked for. Configurations are independent meta
// runs: a thread for each strategy, U, mesh and placement, which tries its sequence chunks
// N in ascending order and stops at the first N that reaches no further than the one
// before (more chunks only cost host traffic from there on: the attention no longer
// bounds the length).
std::vector<plan_entry> sweep(const plan_request& r) {
  std::vector<std::vector<cp_settings>> groups;
  for (const cp_settings& cp : plan_configurations(r)) {
    const auto same = [&](const std::vector<cp_settings>& g) {
      return g.front().strategy == cp.strategy && g.front().head_chunk == cp.head_chunk && g.front().ring == cp.ring;
    };
    auto it = std::find_if(groups.begin(), groups.end(), same);
    if (it == groups.end()) groups.push_back({cp});
    else it->push_back(cp);
  }
  std::vector<std::future<std::vector<plan_entry>>> work;
  std::vector<offload_options> offloads = {{r.offload_optimizer, r.offload_params, r.offload_master}};
  if (r.try_offload && r.zero != zero_stage::replicated) offloads = placements(r.lora.enabled());
  // With the state formats tried afterwards (every placement among them), the sweep takes
  // the placement that leaves the GPU the most: the configuration is chosen for the GPU.
  if (r.try_offload && r.try_state) offloads = {placements(r.lora.enabled()).back()};
  stage_progress progress(r, "configurations searched", static_cast<int>(groups.size() * offloads.size()));
  for (std::vector<cp_settings>& group : groups) {
    std::sort(group.begin(), group.end(), [](const cp_settings& a, const cp_settings& b) { return a.seq_chunks < b.seq_chunks; });
    for (const offload_options& offload : offloads) {
      work.push_back(std::async(std::launch::async, [with = with_placement(r, offload), group, &progress] {
        std::vector<plan_entry> entries;
        for (const cp_settings& cp : group) {
          entries.push_back(plan_configuration(with, cp, entries.empty() ? nullptr : &entries.back()));
          const auto longest = [](const plan_entry& e) { return e.longest ? e.longest->seq_len : 0; };
          std::int64_t best = 0;
          for (std::size_t i = 0; i + 1 < entries.size(); ++i) best = std::max(best, longest(entries[i]));
          if (entries.size() > 1 && longest(entries.back()) <= best) break;
        }
        progress.tick();
        return entries;
      }));
    }
  }
  std::vector<plan_entry> entries;
  for (auto& w : work)
    for (plan_entry& e : w.get()) entries.push_back(std::move(e));
  return entries;
}

// Every state format in every placement at one configuration: a thread per placement,
// which runs the formats from the leanest to the most precise, each search starting from
// the leaner format's answers and bounded by them (a more precise format holds more, so it
// reaches no further); the leanest starts from `hint`, the sweep's entry.
std::vector<plan_entry> sweep_states(const plan_request& r, const cp_settings& cp, const plan_entry* hint) {
  const std::vector<optimizer_state_options> ladder = state_ladder();
  const std::vector<offload_options> where = placements(r.lora.enabled());
  std::vector<std::future<std::vector<plan_entry>>> work;
  stage_progress progress(r, "placements' state formats searched", static_cast<int>(where.size()));
  for (const offload_options& offload : where) {
    plan_request with = with_placement(r, offload);
    with.eval = false;  // the same weights whatever the optimizer: the sweep's eval S stands
    work.push_back(std::async(std::launch::async, [with, cp, hint, ladder, &progress]() mutable {
      std::vector<plan_entry> entries(ladder.size());
      for (std::size_t f = ladder.size(); f-- > 0;) {
        with.state = ladder[f];
        const bool leaner = f + 1 < ladder.size();
        entries[f] = plan_configuration(with, cp, leaner ? &entries[f + 1] : hint, leaner);
      }
      progress.tick();
      return entries;
    }));
  }
  std::vector<std::vector<plan_entry>> by_placement;
  for (auto& w : work) by_placement.push_back(w.get());
  std::vector<plan_entry> entries;  // the ladder's order, each format in every placement
  for (std::size_t f = 0; f < ladder.size(); ++f)
    for (std::size_t p = 0; p < where.size(); ++p) entries.push_back(std::move(by_placement[p][f]));
  return entries;
}

// The most precise format that reaches `target` (the ladder's order), in the first
// placement that does (placements' order: the fewest bytes to the host first).
std::optional<std::size_t> recommend_state(const std::vector<plan_entry>& entries, std::int64_t target) {
  for (std::size_t i = 0; i < entries.size(); ++i)
    if (entries[i].longest && entries[i].longest->seq_len >= target) return i;
  return std::nullopt;
}

}  // namespace

std::shared_ptr<probe_cache> make_probe_cache() { return std::make_shared<probe_cache>(); }

plan_result make_plan(const plan_request& request) {
  validate(request);
  plan_request r = request;
  if (!r.cache) r.cache = make_probe_cache();
  if (r.try_state) r.state = state_ladder().back();  // the sweep at the leanest format
  plan_result out;
  out.entries = sweep(r);
  std::int64_t upipe_longest = 0;
  for (const plan_entry& e : out.entries)
    if (e.strategy == strategy_kind::upipe && e.longest) upipe_longest = std::max(upipe_longest, e.longest->seq_len);
  out.planned_seq_len = r.seq_len ? *r.seq_len : upipe_longest;
  // The largest U that reaches the planned length, with the fewest chunks it needs there.
  const plan_entry* chosen = nullptr;
  for (const plan_entry& e : out.entries) {
    if (e.strategy != strategy_kind::upipe || !e.longest || e.longest->seq_len < out.planned_seq_len) continue;
    if (!out.recommended_head_chunk || e.head_chunk > *out.recommended_head_chunk ||
        (e.head_chunk == *out.recommended_head_chunk && e.seq_chunks < out.recommended_seq_chunks)) {
      out.recommended_head_chunk = e.head_chunk;
      out.recommended_seq_chunks = e.seq_chunks;
      chosen = &e;
    }
  }
  if (out.planned_seq_len > 0 && !r.dps.empty()) {
    stage_progress progress(r, "meshes planned at S = " + std::to_string(out.planned_seq_len), 1);
    out.meshes = plan_meshes(r, out.planned_seq_len, &out.entries);
    recommend_mesh(out);
    progress.tick();
  }
  const auto with_stats = [&] {
    std::lock_guard lock(r.cache->mutex);
    out.stats = r.cache->stats;
    return out;
  };
  if (!r.try_state || chosen == nullptr) return with_stats();
  const cp_settings cp{strategy_kind::upipe, r.gpus / r.dp, chosen->head_chunk, 1, chosen->seq_chunks};
  out.state_entries = sweep_states(r, cp, chosen);
  std::int64_t longest = 0;
  for (const plan_entry& e : out.state_entries) longest = std::max(longest, e.longest ? e.longest->seq_len : 0);
  out.recommended_state = recommend_state(out.state_entries, r.seq_len ? *r.seq_len : longest);
  return with_stats();
}

plan_point fastest_fit(const plan_request& r, const cp_settings& cp, std::int64_t seq_len) {
  const auto overshoot = [&](const plan_point& p) { return upipe::overshoot(r, p); };
  std::optional<plan_point> closest;
  for (const checkpoint_policy& p : r.policy ? std::vector<checkpoint_policy>{*r.policy} : candidate_policies()) {
    plan_point point = evaluate(r, cp, seq_len, p);
    if (point.fits) return point;
    if (!closest || overshoot(point) < overshoot(*closest)) closest = std::move(point);
  }
  return *closest;
}

head_chunk_choice largest_fitting_head_chunk(const plan_request& r, cp_settings cp, std::int64_t seq_len) {
  const std::vector<int> us = valid_head_chunks(r.model.num_heads, cp.cp / std::max(cp.ring, 1));
  UPIPE_CHECK(!us.empty(), "largest_fitting_head_chunk: no valid U for H = " + std::to_string(r.model.num_heads) +
                               " and C = " + std::to_string(cp.cp));
  head_chunk_choice choice;
  for (auto u = us.rbegin(); u != us.rend(); ++u) {  // largest first
    cp.head_chunk = *u;
    choice = {*u, fastest_fit(r, cp, seq_len)};
    if (choice.point.fits) return choice;
  }
  return choice;  // the smallest U, closest to fitting
}

std::size_t gpu_context_bytes() { return context_bytes; }

double planned_arena_gib(const plan_request& r) {
  if (r.arena_gib) return *r.arena_gib;
  const double arena = (1.0 - r.margin) * static_cast<double>(r.gpu_memory) - static_cast<double>(context_bytes);
  return std::max(0.01, std::floor(arena / gib_hundredth) / 100);
}


}  // namespace upipe
