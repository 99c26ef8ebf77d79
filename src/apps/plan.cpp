// `upipe plan`: the longest sequence each CP strategy fits on C GPUs, the checkpoint
// policy that fits the GPU and the host, and the recommended U (meta backend only).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "apps/commands.hpp"
#include "apps/flag_checks.hpp"
#include "apps/json_file.hpp"
#include "apps/model_flags.hpp"
#include "apps/phase_table.hpp"
#include "apps/policy_flags.hpp"
#include "apps/run_config.hpp"
#include "apps/sizes.hpp"
#include "apps/state_flags.hpp"
#include "core/error.hpp"
#include "cp/strategy_table.hpp"
#include "model/config.hpp"
#include "plan/planner.hpp"

namespace upipe::apps {

namespace {

// The options plan shares with train (model, slice, LoRA, ZeRO, policy, sizes) are rows of
// the run configuration; the machine, the sweep and the step-time model's rates are plan's own.
struct plan_flags {
  std::shared_ptr<run_options> options;
  std::string gpu_memory = "80GiB", host_memory, seq_len, json_path, optimizer = "adamw", offload, moments,
              master = "fp32", grads = "fp32";
  double max_grad_norm = 1.0;
  std::vector<std::string> attention;  // default: ulysses, upipe, ring, fpdt (and hybrid on several nodes)
  std::vector<int> seq_chunks;          // default: the planner's
  std::vector<int> dps;                 // the mesh sweep's replica counts (default: every divisor of the GPUs)
  std::vector<int> eps;                 // expert parallelism tried (default: every E the GPUs and experts allow)
  throughput_rates rates;               // the step-time model's
  int gpus = 8, gpus_per_node = 0, nodes = 1;
  bool gpus_given = false, nodes_given = false;  // given on the command line (checked against each other)
  double margin = 0.05;
  const run_config& cfg() const { return options->config(); }
  // --checkpoint-policy: one policy to plan, or every policy (auto, train's default).
  std::string policy() const { return is_auto_policy(cfg().checkpoint_policy) ? "" : cfg().checkpoint_policy; }
};

constexpr const char* paper_host_memory = "1.9TiB";  // the paper's 8 x H100 machine

struct mesh_size {
  int gpus = 0, nodes = 1;
};

// The GPUs and nodes --gpus, --gpus-per-node and --nodes ask for, all three consistent:
// --gpus alone is one node; with --gpus-per-node the nodes follow (G x nodes = gpus), and
// --nodes beside both must agree. Refused with the values and a valid line otherwise.
mesh_size plan_mesh(int gpus, bool gpus_given, int per_node, int nodes, bool nodes_given) {
  if (gpus < 1 || (per_node == 0 && nodes < 1) || per_node < 0 || nodes < 1)
    throw config_error("--gpus " + std::to_string(gpus) + ", --gpus-per-node " + std::to_string(per_node) +
                       " and --nodes " + std::to_string(nodes) + " must be positive (for example --gpus 16 "
                       "--gpus-per-node 8)");
  if (per_node == 0) {
    if (nodes_given && nodes != 1)
      throw config_error("--nodes " + std::to_string(nodes) + " needs --gpus-per-node G (for example --gpus-per-node " +
                         std::to_string(std::max(1, gpus / nodes)) + " --nodes " + std::to_string(nodes) + ")");
    return {gpus, 1};
  }
  if (!gpus_given) return {per_node * nodes, nodes};
  if (gpus % per_node != 0)
    throw config_error("--gpus " + std::to_string(gpus) + " is not a whole number of nodes of --gpus-per-node " +
                       std::to_string(per_node) + ": use --gpus " + std::to_string((gpus / per_node + 1) * per_node) +
                       " or a --gpus-per-node that divides it");
  if (nodes_given && nodes * per_node != gpus)
    throw config_error("--gpus " + std::to_string(gpus) + " differs from --nodes " + std::to_string(nodes) +
                       " x --gpus-per-node " + std::to_string(per_node) + " = " + std::to_string(nodes * per_node) +
                       ": give two of the three (for example --gpus " + std::to_string(gpus) + " --gpus-per-node " +
                       std::to_string(per_node) + ")");
  return {gpus, gpus / per_node};
}

double gib(std::size_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

std::string tokens_text(std::int64_t s) {
  char buf[32];
  if (s >= (1 << 20) && s % (1 << 10) == 0)
    std::snprintf(buf, sizeof buf, "%.2fM", static_cast<double>(s) / (1 << 20));
  else if (s >= (1 << 10))
    std::snprintf(buf, sizeof buf, "%.0fK", static_cast<double>(s) / (1 << 10));
  else
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(s));
  return buf;
}

std::string u_text(const plan_entry& e) {
  return row_of(e.strategy).heads == head_stages::none ? "-" : std::to_string(e.head_chunk);
}

// The rows of the tables: one per strategy, U, mesh and optimizer placement, the entry of
// the N that reaches the longest S (ties: the fewest chunks, which move the least through
// host memory). At a requested length: the fewest chunks that fit (else the closest).
std::vector<const plan_entry*> table_rows(const std::vector<plan_entry>& entries, bool at_request) {
  std::vector<const plan_entry*> rows;
  for (const plan_entry& e : entries) {
    const auto same = [&](const plan_entry* r) {
      return r->strategy == e.strategy && r->head_chunk == e.head_chunk && r->ring == e.ring &&
             r->offload_optimizer == e.offload_optimizer && r->offload_params == e.offload_params &&
             r->offload_master == e.offload_master;
    };
    auto it = std::find_if(rows.begin(), rows.end(), same);
    if (it == rows.end()) {
      rows.push_back(&e);
      continue;
    }
    const plan_entry& best = **it;
    bool better = false;
    if (at_request) {
      const bool fits = e.at_request && e.at_request->fits, best_fits = best.at_request && best.at_request->fits;
      better = fits && (!best_fits || e.seq_chunks < best.seq_chunks);
    } else {
      const std::int64_t s = e.longest ? e.longest->seq_len : 0, b = best.longest ? best.longest->seq_len : 0;
      better = s > b || (s == b && e.seq_chunks < best.seq_chunks);
    }
    if (better) *it = &e;
  }
  return rows;
}

// "upipe", or "hybrid 2x8" (R x A: a ring of R nodes, all-to-all among A GPUs in each);
// "+host" where AdamW's state is in host memory, "+master" where its master weights alone
// are, "+w" where the weights are too.
std::string strategy_text(const plan_entry& e, int gpus) {
  std::string name(strategy_name(e.strategy));
  if (row_of(e.strategy).mesh) name += " " + std::to_string(e.ring) + "x" + std::to_string(gpus / e.ring);
  if (e.offload_optimizer) name += " +host";
  else if (e.offload_master) name += " +master";
  return e.offload_params ? name + "+w" : name;
}

// The --offload words of an entry's placement.
std::string offload_text(const plan_entry& e) {
  const std::string where = e.offload_optimizer ? "optimizer" : e.offload_master ? "master" : "none";
  return e.offload_params ? where + ",params" : where;
}

// An entry's state format as flags ("--optimizer-state 8bit --master-weights bf16-kahan --grad-dtype bf16").
std::string state_text(const optimizer_state_options& s) {
  return std::string("--optimizer-state ") + moments_flag(s.format.moments) + " --master-weights " +
         master_flag(s.format.master) + " --grad-dtype " + (s.grad_type == dtype::bf16 ? "bf16" : "fp32");
}

nlohmann::json point_json(const plan_point& p) {
  const nlohmann::json policy = {{"text", p.policy.str()},
                                 {"what", content_name(p.policy.what)},
                                 {"every", p.policy.every},
                                 {"where", location_name(p.policy.where)}};
  const nlohmann::json time = p.time ? step_time_json(*p.time) : nlohmann::json(nullptr);
  return {{"seq_len", p.seq_len},
          {"fits", p.fits},
          {"step_seconds_model", time},
          {"checkpoint_policy", policy},
          {"peak_bytes", p.memory.peak_bytes},
          {"step_device_peak_bytes", p.memory.device_peak},
          {"step_arena_high_water_bytes", p.memory.arena_high_water},
          {"cublaslt_workspace_bytes", p.overheads.cublaslt_workspace},
          {"cudnn_workspace_bytes", p.overheads.cudnn_workspace},
          {"context_bytes", p.overheads.context},
          {"arena_bytes", p.arena_bytes},
          {"gpu_bytes", p.gpu_bytes},
          {"host_bytes", p.host_bytes},
          {"host_budget_bytes", p.host_budget}};
}

// The model of a train command: --model or --config, and the slice.
std::string model_flags_text(const plan_flags& f) {
  const run_config& c = f.cfg();
  return (c.config.empty() ? "--model " + c.model : "--config " + c.config) +
         (c.layers > 0 ? " --layers " + std::to_string(c.layers) : "");
}

// "upipe" or "hybrid 2x8" for a mesh entry's CP group, "+host" as strategy_text.
std::string mesh_strategy_text(const mesh_entry& e) {
  std::string name(strategy_name(e.cp.strategy));
  if (e.cp.strategy == strategy_kind::hybrid) name += " " + std::to_string(e.cp.ring) + "x" + std::to_string(e.cp.cp / e.cp.ring);
  return e.offload_params ? name + " +host+w" : e.offload_optimizer ? name + " +host" : name;
}

// The one configuration plan recommends (recommend's rule), or a mesh row's: everything
// its train command needs.
struct planned_run {
  int dp = 1;
  cp_settings cp;
  offload_options offload;
  optimizer_state_options state;
  plan_point point;
};

planned_run run_of(const mesh_entry& e) {
  return {e.dp, e.cp, {e.offload_optimizer, e.offload_params, e.offload_master && !e.offload_optimizer}, e.state, e.point};
}

std::string gib_flag(std::size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", static_cast<double>(bytes) / (1 << 30));
  return text;
}

// The `upipe train` command that runs a planned configuration as planned: every option the
// plan assumed (mesh, strategy, U, N, length, ZeRO, placement, state format, clipping,
// checkpoint policy, the arena and the host budget), without --backend (the command is
// checked on meta by adding --backend meta, and run on the GPUs with --backend cuda).
std::string train_command(const plan_flags& f, const plan_request& r, const planned_run& e) {
  const strategy_row& row = row_of(e.cp.strategy);
  std::string c = "upipe train " + model_flags_text(f) + " --dp " + std::to_string(e.dp) + " --cp " +
                  std::to_string(e.cp.cp) + " --attention " + std::string(strategy_name(e.cp.strategy));
  if (r.ep > 1) c += " --ep " + std::to_string(r.ep);
  if (row.heads == head_stages::chosen) c += " --head-chunk " + std::to_string(e.cp.head_chunk);
  if (row.mesh) c += " --ring " + std::to_string(e.cp.ring);
  if (e.cp.seq_chunks > 1) c += " --seq-chunks " + std::to_string(e.cp.seq_chunks);
  const std::string where = e.offload.optimizer ? "optimizer" : e.offload.master ? "master" : "none";
  c += " --seq-len " + std::to_string(e.point.seq_len) + " --batch 1 --zero " + std::to_string(f.cfg().zero) + " --offload " +
       (e.offload.params ? where + ",params" : where);
  if (r.lora.enabled()) c += " --lora " + lora_text(r.lora);  // its adapters' state is f32, its own
  else c += " " + state_text(e.state);
  c += " --max-grad-norm " + real_text(r.max_grad_norm) + " --checkpoint-policy " + e.point.policy.str() +
       " --memory-gib " + gib_flag(static_cast<std::size_t>(planned_arena_gib(r) * (1 << 30))) +
       " --host-memory-gib " + gib_flag(e.point.host_budget);
  if (r.nodes > 1) c += " --gpus-per-node " + std::to_string(r.gpus / r.nodes);
  return c;
}

std::string train_command(const plan_flags& f, const plan_request& r, const mesh_entry& e) {
  return train_command(f, r, run_of(e));
}

// The mesh sweep at the planned length: per D, each strategy's fastest configuration, then
// the recommended mesh against CP over every GPU and its train command.
void print_meshes(const plan_request& r, const plan_result& plan) {
  if (plan.meshes.empty()) return;
  std::printf("\nmeshes at S = %s (D replicas, each a CP group of C = %d / D GPUs, ZeRO over all %d; each "
              "strategy's fastest U, N and policy):\n%3s %3s %-15s %4s %4s %5s %8s %8s %10s %10s  %s\n",
              tokens_text(plan.planned_seq_len).c_str(), r.gpus, r.gpus, "D", "C", "strategy", "U", "N", "fits",
              "GPU GiB", "host GiB", "step s", "tok/s/GPU", "checkpoint policy");
  std::vector<const mesh_entry*> rows;
  for (const mesh_entry& e : plan.meshes) rows.push_back(&e);
  std::stable_sort(rows.begin(), rows.end(), [](const mesh_entry* a, const mesh_entry* b) { return a->dp < b->dp; });
  for (const mesh_entry* e : rows)
    std::printf("%3d %3d %-15s %4s %4d %5s %8.1f %8.1f %10.2f %10.0f  %s\n", e->dp, e->cp.cp,
                mesh_strategy_text(*e).c_str(),
                e->cp.strategy == strategy_kind::ring ? "-" : std::to_string(e->cp.head_chunk).c_str(),
                e->cp.seq_chunks, e->point.fits ? "yes" : "no", gib(e->point.gpu_bytes), gib(e->point.host_bytes),
                e->point.time->total(), e->tokens_per_s_per_gpu(), e->point.policy.str().c_str());
  if (!plan.recommended_mesh) {
    std::printf("\nfastest mesh: none fits S = %s; shorten --seq-len or add GPUs\n",
                tokens_text(plan.planned_seq_len).c_str());
    return;
  }
  const mesh_entry& best = plan.meshes[*plan.recommended_mesh];
  std::printf("\nfastest mesh: --dp %d --cp %d, %s (U %s, N %d): %.0f tokens/s/GPU in the step-time model",
              best.dp, best.cp.cp, mesh_strategy_text(best).c_str(),
              best.cp.strategy == strategy_kind::ring ? "-" : std::to_string(best.cp.head_chunk).c_str(),
              best.cp.seq_chunks, best.tokens_per_s_per_gpu());
  if (plan.best_cp_only) {
    const mesh_entry& cp = plan.meshes[*plan.best_cp_only];
    std::printf(", %.2fx CP over all %d GPUs (%s, %.0f tokens/s/GPU)\n", best.tokens_per_s_per_gpu() / cp.tokens_per_s_per_gpu(),
                r.gpus, mesh_strategy_text(cp).c_str(), cp.tokens_per_s_per_gpu());
  } else {
    std::printf("; CP over all %d GPUs fits no configuration here\n", r.gpus);
  }
}

nlohmann::json meshes_json(const plan_flags& f, const plan_request& r, const plan_result& plan) {
  nlohmann::json rows = nlohmann::json::array();
  for (std::size_t i = 0; i < plan.meshes.size(); ++i) {
    const mesh_entry& e = plan.meshes[i];
    nlohmann::json j = point_json(e.point);
    j["dp"] = e.dp;
    j["cp"] = e.cp.cp;
    j["strategy"] = std::string(strategy_name(e.cp.strategy));
    j["head_chunk"] = e.cp.strategy == strategy_kind::ring ? nlohmann::json(nullptr) : nlohmann::json(e.cp.head_chunk);
    j["ring"] = e.cp.ring;
    j["seq_chunks"] = e.cp.seq_chunks;
    j["offload_optimizer"] = e.offload_optimizer;
    j["offload_params"] = e.offload_params;
    j["tokens_per_s_per_gpu_model"] = e.tokens_per_s_per_gpu();
    j["recommended"] = plan.recommended_mesh == i;
    j["train_command"] = train_command(f, r, e);
    if (plan.recommended_mesh == i) {
      if (plan.best_cp_only)
        j["speedup_over_cp_only"] = e.tokens_per_s_per_gpu() / plan.meshes[*plan.best_cp_only].tokens_per_s_per_gpu();
    }
    rows.push_back(j);
  }
  return rows;
}

// The one run plan recommends, by one rule: with the state formats tried (--optimizer-state
// auto), the most precise format that reaches the planned length, in the placement moving
// the least to the host; else, at the planned length (--seq-len, or the longest UPipe
// reaches), the mesh with the fastest modelled step. Its point is the plan's at that
// length (the fastest policy that fits there).
std::optional<planned_run> recommend(const plan_request& r, const plan_result& plan) {
  if (r.zero == zero_stage::replicated) return std::nullopt;  // forward and backward only: no train run
  if (plan.recommended_state) {
    const plan_entry& e = plan.state_entries[*plan.recommended_state];
    planned_run run{r.dp, {strategy_kind::upipe, r.gpus / r.dp, e.head_chunk, 1, e.seq_chunks},
                    {e.offload_optimizer, e.offload_params, e.offload_master}, e.state, *e.longest};
    if (r.seq_len) {
      plan_request with = r;
      with.offload_optimizer = e.offload_optimizer;
      with.offload_params = e.offload_params;
      with.offload_master = e.offload_master;
      with.state = e.state;
      run.point = fastest_fit(with, run.cp, *r.seq_len);
    }
    return run;
  }
  if (plan.recommended_mesh) return run_of(plan.meshes[*plan.recommended_mesh]);
  return std::nullopt;
}

std::string rule_text(const plan_request& r, const plan_result& plan) {
  const std::string length = r.seq_len ? "--seq-len " + tokens_text(*r.seq_len)
                                       : "the longest S, " + tokens_text(plan.planned_seq_len);
  return plan.recommended_state ? "the most precise AdamW state that reaches " + length +
                                      ", in the placement moving the least to the host"
                                : "at " + length + ", the mesh with the fastest modelled step";
}

// The recommendation's step in the step-time model: the seconds a step takes, and where
// they go (compute, collectives, host copies, the offloaded update and its overlap).
void print_expected_step(const step_time& t) {
  std::printf("  expected: %.1f s a step (the step-time model): compute %.1f s (GEMMs %.1f, attention %.1f, the rest "
              "%.1f, the device's AdamW %.2f), collectives %.1f, host copies %.2f",
              t.total(), t.compute(), t.gemm, t.attention, t.elementwise, t.update,
              t.all_to_all + t.ring + t.zero + t.data_parallel, t.host);
  if (t.host_adamw > 0)
    std::printf(", the offload's copies %.2f, the host's AdamW %.2f s of which the step waits %.2f (a run of one step "
                "waits for all of it: %.1f s)", t.offload_copies + t.weights_in, t.host_adamw, t.host_adamw_exposed,
                t.total() + t.lone_step_extra);
  std::printf("\n");
}

void print_recommendation(const plan_flags& f, const plan_request& r, const plan_result& plan) {
  const std::optional<planned_run> run = recommend(r, plan);
  if (!run) {
    std::printf("\nrecommended: none (%s)\n",
                r.zero == zero_stage::replicated ? "--optimizer none plans no training run"
                                                 : "no configuration fits; shorten --seq-len, add GPUs or memory");
    return;
  }
  const plan_point& p = run->point;
  std::printf("\nrecommended (the rule: %s):\n  %s\n", rule_text(r, plan).c_str(), train_command(f, r, *run).c_str());
  std::printf("  planned: arena %.2f GiB of --memory-gib %.2f (GPU %.2f GiB with the context), host %.2f GiB of "
              "--host-memory-gib %.2f (everything the process holds in host memory%s)\n",
              gib(p.arena_bytes), planned_arena_gib(r), gib(p.gpu_bytes), gib(p.host_bytes), gib(p.host_budget),
              r.nodes > 1 ? "; one process per GPU on several nodes" : "; one process runs the node's ranks");
  if (p.time) print_expected_step(*p.time);
  std::printf("  add --backend cuda to run it on the GPUs; --backend meta runs it here, shapes only, and prints its "
              "arena high water and host memory\n");
}

// Where no full fine-tune fits: LoRA (r = 16 on every projection, the base frozen, its
// adapters' state in f32 on the GPU) planned the same way, and its recommendation.
std::optional<std::string> lora_instead(const plan_flags& f, const plan_request& r, const plan_result& plan) {
  if (r.zero == zero_stage::replicated || r.lora.enabled() || recommend(r, plan)) return std::nullopt;
  plan_request lora = r;
  lora.lora = parse_lora("r=16", r.model);
  lora.try_offload = lora.try_state = lora.offload_optimizer = lora.offload_params = lora.offload_master = false;
  lora.state = {};
  lora.eval = false;
  lora.cache.reset();
  std::printf("\nno full fine-tune fits; LoRA (--lora r=16: the base frozen, only the adapters trained) planned "
              "instead:\n");
  std::fflush(stdout);
  const plan_result planned = make_plan(lora);
  print_recommendation(f, lora, planned);
  const std::optional<planned_run> run = recommend(lora, planned);
  if (!run) return std::nullopt;
  std::printf("  LoRA's longest length: S = %s\n", tokens_text(run->point.seq_len).c_str());
  return train_command(f, lora, *run);
}

// Expert parallelism: the E a plan tries for a mixture of experts (--ep's, else every
// divisor of the GPUs that divides the experts), 1 alone for a dense model.
std::vector<int> expert_parallel_choices(const plan_request& r, const std::vector<int>& given) {
  if (!given.empty()) return given;
  std::vector<int> out{1};
  if (r.model.sparse_layer_count() == 0) return out;
  for (int e = 2; e <= r.gpus; ++e)
    if (r.gpus % e == 0 && r.model.moe.experts % e == 0) out.push_back(e);
  return out;
}

// One E's plan in the sweep: how far it reaches and how fast its recommendation runs.
struct ep_outcome {
  int ep = 1;
  std::int64_t seq_len = 0;  // the planned length (requested, or UPipe's longest)
  std::optional<planned_run> run;
};

// Plans each E in full (the probes shared through the request's cache) and returns the one
// recommended: without --seq-len the E whose UPipe reaches the longest S (the faster
// recommendation on a tie), with it the fastest recommendation that fits.
int sweep_expert_parallel(const plan_flags& f, const plan_request& r, const std::vector<int>& eps) {
  std::vector<ep_outcome> outcomes;
  for (const int e : eps) {
    plan_request one = r;
    one.ep = e;
    validate(one);
    const plan_result plan = make_plan(one);
    outcomes.push_back({e, plan.planned_seq_len, recommend(one, plan)});
  }
  const auto speed = [](const ep_outcome& o) {
    return o.run && o.run->point.time ? static_cast<double>(o.run->point.seq_len) / o.run->point.time->total() /
                                            (o.run->cp.cp * o.run->dp)
                                      : 0.0;
  };
  const auto better = [&](const ep_outcome& a, const ep_outcome& b) {
    if (r.seq_len) return (a.run.has_value() != b.run.has_value()) ? a.run.has_value() : speed(a) > speed(b);
    return a.seq_len != b.seq_len ? a.seq_len > b.seq_len : speed(a) > speed(b);
  };
  const ep_outcome* best = &outcomes.front();
  for (const ep_outcome& o : outcomes)
    if (better(o, *best)) best = &o;
  std::printf("\nexpert parallelism (--ep E: each sparse layer's %d experts over EP groups of E GPUs), each E planned "
              "in full:\n%4s %12s %10s  %s\n", r.model.moe.experts, "E", r.seq_len ? "S" : "longest S", "tok/s/GPU",
              "recommended run");
  for (const ep_outcome& o : outcomes) {
    plan_request one = r;
    one.ep = o.ep;
    std::printf("%4d %12s %10.0f  %s\n", o.ep, tokens_text(o.seq_len).c_str(), speed(o),
                o.run ? train_command(f, one, *o.run).c_str() : "none fits");
  }
  std::printf("recommended: --ep %d (%s)\n", best->ep,
              r.seq_len ? "the fastest that fits the length" : "the longest S, then the fastest step");
  std::fflush(stdout);
  return best->ep;
}

// The state formats at the recommended configuration, and the command to run.
void print_states(const plan_request& r, const plan_result& plan) {
  if (plan.state_entries.empty()) return;
  const plan_entry& first = plan.state_entries.front();
  std::printf("\nAdamW's state at upipe U = %d, N = %d, each format in each placement (--optimizer-state auto):\n",
              first.head_chunk, first.seq_chunks);
  std::printf("%-76s %-18s %10s %8s %8s %10s  %s\n", "state", "--offload", "longest S", "GPU GiB", "host GiB",
              "step s", "checkpoint policy");
  for (const plan_entry& e : plan.state_entries) {
    if (!e.longest) {
      std::printf("%-76s %-18s %10s %8s %8s %10s  %s\n", state_text(e.state).c_str(), offload_text(e).c_str(), "none",
                  "-", "-", "-", "does not fit even the shortest length");
      continue;
    }
    const plan_point& p = *e.longest;
    std::printf("%-76s %-18s %10s %8.1f %8.1f %10.1f  %s\n", state_text(e.state).c_str(), offload_text(e).c_str(),
                tokens_text(p.seq_len).c_str(), gib(p.gpu_bytes), gib(p.host_bytes), p.time->total(),
                p.policy.str().c_str());
  }
  if (!plan.recommended_state) std::printf("no state format reaches S = %s\n", tokens_text(*r.seq_len).c_str());
}

int run(const plan_flags& f) {
  const auto start = std::chrono::steady_clock::now();
  plan_request r;
  r.model = load_model(f.cfg().model, f.cfg().config, f.cfg().layers);
  if (std::error_code ec; f.cfg().config.empty() && std::filesystem::is_directory(f.cfg().model, ec))
    r.model_dir = f.cfg().model;  // its weight files are mapped for the run: host memory
  const mesh_size mesh = plan_mesh(f.gpus, f.gpus_given, f.gpus_per_node, f.nodes, f.nodes_given);
  r.gpus = mesh.gpus;
  r.nodes = mesh.nodes;
  r.gpu_memory = parse_bytes(f.gpu_memory, "--gpu-memory");
  const bool host_default = f.host_memory.empty();
  r.host_memory = parse_bytes(host_default ? paper_host_memory : f.host_memory, "--host-memory");
  r.margin = f.margin;
  if (!f.seq_len.empty()) r.seq_len = parse_seq_len(f.seq_len);
  r.strategies.clear();
  // By default the table's planned rows, and the meshes across nodes.
  for (const strategy_row& row : strategy_rows())
    if (f.attention.empty() && (row.planned_by_default || (row.mesh && r.nodes > 1))) r.strategies.push_back(row.kind);
  for (const std::string& name : f.attention) r.strategies.push_back(parse_strategy_kind(name));
  r.zero = f.cfg().zero == 3 ? zero_stage::three : zero_stage::two;
  if (f.optimizer == "none") r.zero = zero_stage::replicated;
  else if (f.optimizer != "adamw")
    throw config_error("--optimizer " + f.optimizer + " is not known: use adamw (a training step, sharded per --zero) "
                       "or none (forward and backward only: full weights and f32 gradients)");
  if (!f.policy().empty()) r.policy = parse_checkpoint_policy(f.policy());
  // One GPU: every placement and state format is tried unless one is named (the machines
  // where a full fine-tune fits only with them).
  const bool one_gpu = r.gpus == 1 && r.zero != zero_stage::replicated && f.cfg().lora.empty();
  const std::string offload = f.offload.empty() ? (one_gpu ? "auto" : "none") : f.offload;
  const std::string moments = f.moments.empty() ? (one_gpu ? "auto" : "fp32") : f.moments;
  r.try_offload = offload == "auto";
  const offload_options placement = r.try_offload ? offload_options{} : parse_offload(offload);
  r.offload_optimizer = placement.optimizer;
  r.offload_params = placement.params;
  r.offload_master = placement.master;
  r.try_state = moments == "auto";
  if (!r.try_state) r.state.format = {parse_moments(moments), parse_master(f.master)};
  r.state.grad_type = parse_grad_dtype(f.grads);
  r.max_grad_norm = f.max_grad_norm;
  r.offload_overlap = f.cfg().offload_overlap == "on";
  r.mlp_tile = f.cfg().mlp_tile;
  r.loss_chunk = f.cfg().loss_chunk;
  r.attention_arithmetic = parse_attention_dtype(f.cfg().attention_dtype);
  if (!f.seq_chunks.empty()) r.seq_chunks = f.seq_chunks;
  r.dps = f.dps;
  if (r.dps.empty())  // every mesh of the GPUs
    for (int d = 1; d <= r.gpus; ++d)
      if (r.gpus % d == 0) r.dps.push_back(d);
  r.rates = f.rates;
  for (const double rate : {f.rates.gemm_tflops, f.rates.attention_tflops, f.rates.nvlink_gbytes, f.rates.network_gbits,
                            f.rates.pcie_gbytes, f.rates.host_adamw_gbytes, f.rates.elementwise_ns})
    if (!(rate > 0) || !std::isfinite(rate))
      throw config_error("the step-time model's rates (--gemm-tflops, --attention-tflops, --nvlink-gbytes, "
                         "--network-gbits, --pcie-gbytes, --host-adamw-gbytes, --elementwise-ns) must be positive and "
                         "finite, not " + std::to_string(rate) + " (for example --network-gbits 400)");
  if (!f.cfg().lora.empty()) r.lora = parse_lora(f.cfg().lora, r.model);
  // The default strategies that cannot run on this group (Ulysses and UPipe need C to
  // divide the heads: 1024 GPUs plan hybrid and ring) are left out and named; a strategy
  // asked for by name is refused instead.
  std::vector<std::string> skipped;
  if (f.attention.empty()) {
    std::vector<strategy_kind> runnable;
    for (const strategy_kind kind : r.strategies) {
      plan_request one = r;
      one.strategies = {kind};
      try {
        validate(one);
        runnable.push_back(kind);
      } catch (const config_error& e) {
        skipped.push_back(std::string(strategy_name(kind)) + " (" + e.what() + ")");
      }
    }
    if (!runnable.empty()) r.strategies = runnable;
  }
  validate(r);

  const std::string lora_text_or_none =
      r.lora.enabled() ? ", LoRA " + lora_text(r.lora) + " (base frozen, adapters trained)" : "";
  const std::string step_kind = (r.zero == zero_stage::replicated
                                     ? "forward+backward, no optimizer"
                                     : "training step, zero=" + std::to_string(f.cfg().zero) +
                                           (r.try_offload        ? ", every placement"
                                            : r.offload_params   ? ", master and weights in host memory"
                                            : r.offload_optimizer ? ", optimizer in host memory"
                                            : r.offload_master   ? ", master in host memory"
                                                                 : "") +
                                           (r.try_state ? ", every state format" : ", " + state_text(r.state)) +
                                           (r.max_grad_norm > 0 ? "" : ", no clipping")) +
                                lora_text_or_none;
  std::printf("# upipe plan  model=%s (%d layers)  gpus=%d (%d node%s of %d)  %s  gpu-memory=%.1f GiB (margin %.0f%%: "
              "%.1f GiB usable)\n",
              r.model.name.c_str(), r.model.num_layers, r.gpus, r.nodes, r.nodes == 1 ? "" : "s", r.gpus / r.nodes,
              step_kind.c_str(), gib(r.gpu_memory), 100 * r.margin, gib(r.gpu_memory) * (1 - r.margin));
  std::printf("# host-memory=%.1f GiB per node%s, shared by the node's %d ranks: everything a run holds in host memory "
              "(the pools with checkpoints and offloaded state, the weight files or a random start's copy, the "
              "process's own), as train counts it\n",
              gib(r.host_memory), host_default ? " (default: 1.9 TiB, the paper's 8 x H100 machine; set --host-memory)" : "",
              r.gpus / r.nodes);
  std::printf("# GPU bytes = the step's arena high water (meta backend, with cuBLASLt's and cuDNN's workspaces "
              "taken as on the GPU) + %.2f GiB of CUDA context\n", gib(estimate_overheads(step_memory{}).context));
  std::printf("# step s: the step-time model (plan/step_time.hpp; rates measured, plan/step_rates.hpp): GEMMs at %.0f "
              "TFLOP/s, causal attention at %.0f, the rest %.0f ns a token and layer, all-to-all inside a node at %.0f "
              "GB/s, %.0f Gb/s per GPU across nodes, host copies at %.0f GB/s (not overlapped), the host's AdamW at "
              "%.0f GB/s of state (the offload's overlap %s)\n",
              r.rates.gemm_tflops, r.rates.attention_tflops, r.rates.elementwise_ns, r.rates.nvlink_gbytes,
              r.rates.network_gbits, r.rates.pcie_gbytes, r.rates.host_adamw_gbytes, r.offload_overlap ? "on" : "off");
  for (const std::string& why : skipped) std::printf("# left out: %s\n", why.c_str());
  std::fflush(stdout);
  r.progress = [start](const std::string& stage, int done, int total) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "\rupipe plan: %d of %d %s (%.0f s)%s", done, total, stage.c_str(), seconds,
                 done == total ? "\n" : "");
  };
  r.cache = make_probe_cache();
  if (const std::vector<int> eps = expert_parallel_choices(r, f.eps); eps.size() > 1)
    r.ep = sweep_expert_parallel(f, r, eps);
  else
    r.ep = eps.front();
  validate(r);
  const plan_result plan = make_plan(r);
  // UPIPE_PLAN_STATS=1: what the plan cost, its meta probes counted.
  if (const char* stats = std::getenv("UPIPE_PLAN_STATS"); stats != nullptr && *stats != '\0' && *stats != '0')
    std::fprintf(stderr, "upipe plan: %ld training-step probes, %ld eval probes on the meta backend (%.1f s in them, "
                 "over every thread), %ld answered by the cache, the longest at S = %lld\n",
                 plan.stats.step_probes, plan.stats.eval_probes, plan.stats.probe_seconds, plan.stats.cache_hits,
                 static_cast<long long>(plan.stats.longest_probed));

  // Beside each: the longest length `upipe eval` reaches (forward only, weights alone).
  const auto eval_text = [](const plan_entry& e) {
    return e.longest_eval ? tokens_text(e.longest_eval->seq_len) : std::string("none");
  };
  std::printf("\n%-15s %4s %4s %12s %8s %8s %10s %10s %12s  %s\n", "strategy", "U", "N", "longest S", "GPU GiB",
              "host GiB", "step s", "tok/s/GPU", "eval S", "checkpoint policy");
  for (const plan_entry* row : table_rows(plan.entries, false)) {
    const plan_entry& e = *row;
    if (!e.longest) {
      std::printf("%-15s %4s %4d %12s %8s %8s %10s %10s %12s  %s\n", strategy_text(e, r.gpus).c_str(),
                  u_text(e).c_str(), e.seq_chunks, "none", "-", "-", "-", "-", eval_text(e).c_str(),
                  "does not fit even the shortest length");
      continue;
    }
    const plan_point& p = *e.longest;
    const double step = p.time->total();
    std::printf("%-15s %4s %4d %12s %8.1f %8.1f %10.1f %10.0f %12s  %s\n", strategy_text(e, r.gpus).c_str(),
                u_text(e).c_str(), e.seq_chunks, tokens_text(p.seq_len).c_str(), gib(p.gpu_bytes), gib(p.host_bytes),
                step, static_cast<double>(p.seq_len) / step / r.gpus, eval_text(e).c_str(), p.policy.str().c_str());
  }
  std::printf("(N: sequence chunks, the one of --seq-chunks that reaches the longest S; the JSON holds every N)\n");
  std::printf("(eval S: the longest length upipe eval fits, forward only with the weights alone%s)\n",
              r.try_offload || r.offload_optimizer || r.offload_master
                  ? "; +host: AdamW's state in host memory, --offload optimizer; +master: its master weights alone, "
                    "--offload master; +w: the weights too, --offload ...,params"
                  : "");
  if (r.seq_len) {
    std::printf("\nat S = %s:\n%-15s %4s %4s %6s %8s %8s %10s %10s  %s\n", tokens_text(*r.seq_len).c_str(), "strategy",
                "U", "N", "fits", "GPU GiB", "host GiB", "step s", "tok/s/GPU",
                "checkpoint policy (the fastest that fits, else the closest to fitting)");
    for (const plan_entry* row : table_rows(plan.entries, true)) {
      const plan_entry& e = *row;
      const plan_point& p = *e.at_request;
      const double step = p.time->total();
      std::printf("%-15s %4s %4d %6s %8.1f %8.1f %10.1f %10.0f  %s\n", strategy_text(e, r.gpus).c_str(),
                  u_text(e).c_str(), e.seq_chunks, p.fits ? "yes" : "no", gib(p.gpu_bytes), gib(p.host_bytes), step,
                  static_cast<double>(p.seq_len) / step / r.gpus, p.policy.str().c_str());
    }
  }
  const bool upipe_planned =
      std::find(r.strategies.begin(), r.strategies.end(), strategy_kind::upipe) != r.strategies.end();
  if (upipe_planned && plan.recommended_head_chunk)
    std::printf("\nupipe: U = %d%s is the largest U that fits S = %s with the margin (a larger U runs "
                "fewer, larger stages)\n",
                *plan.recommended_head_chunk,
                plan.recommended_seq_chunks > 1 ? (" and N = " + std::to_string(plan.recommended_seq_chunks)).c_str() : "",
                tokens_text(plan.planned_seq_len).c_str());
  else if (upipe_planned)
    std::printf("\nupipe fits no U at S = %s\n",
                tokens_text(plan.planned_seq_len).c_str());
  print_meshes(r, plan);
  print_states(r, plan);
  print_recommendation(f, r, plan);
  const std::optional<std::string> lora_command = lora_instead(f, r, plan);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("# planned in %.1f s\n", seconds);

  if (!f.json_path.empty()) {
    nlohmann::json entries = nlohmann::json::array();
    for (const plan_entry& e : plan.entries) {
      nlohmann::json j = {{"strategy", std::string(strategy_name(e.strategy))},
                          {"ring", e.ring},
                          {"seq_chunks", e.seq_chunks},
                          {"offload_optimizer", e.offload_optimizer},
                          {"offload_params", e.offload_params},
                          {"offload_master", e.offload_master},
                          {"optimizer_state", state_text(e.state)},
                          {"head_chunk", row_of(e.strategy).heads == head_stages::none ? nlohmann::json(nullptr)
                                                                                        : nlohmann::json(e.head_chunk)},
                          {"max_seq_len", e.longest ? e.longest->seq_len : 0}};
      if (e.longest) {
        const nlohmann::json p = point_json(*e.longest);
        for (const auto& [key, value] : p.items())
          if (key != "seq_len") j[key] = value;
      }
      if (e.at_request) j["at_seq_len"] = point_json(*e.at_request);
      if (e.longest_eval)
        j["eval"] = {{"max_seq_len", e.longest_eval->seq_len},
                     {"peak_bytes", e.longest_eval->peak_bytes},
                     {"arena_bytes", e.longest_eval->arena_bytes},
                     {"gpu_bytes", e.longest_eval->gpu_bytes}};
      entries.push_back(j);
    }
    nlohmann::json doc = {
        {"model", r.model.name},
        {"layers", r.model.num_layers},
        {"gpus", r.gpus},
        {"nodes", r.nodes},
        {"zero", r.zero == zero_stage::replicated ? nlohmann::json(nullptr) : nlohmann::json(f.cfg().zero)},
        {"optimizer", f.optimizer},
        {"lora", r.lora.enabled() ? nlohmann::json(lora_text(r.lora)) : nlohmann::json(nullptr)},
        {"gpu_memory_bytes", r.gpu_memory},
        {"host_memory_bytes", r.host_memory},
        {"host_memory_default", host_default},
        {"margin", r.margin},
        {"planned_seq_len", plan.planned_seq_len},
        {"ep", r.ep},
        {"recommended_head_chunk",
         plan.recommended_head_chunk ? nlohmann::json(*plan.recommended_head_chunk) : nlohmann::json(nullptr)},
        {"recommended_seq_chunks", plan.recommended_seq_chunks},
        {"entries", entries},
        {"meshes", meshes_json(f, r, plan)}};
    if (!plan.state_entries.empty()) {
      nlohmann::json states = nlohmann::json::array();
      for (const plan_entry& e : plan.state_entries)
        states.push_back({{"optimizer_state", state_text(e.state)},
                          {"offload", offload_text(e)},
                          {"max_seq_len", e.longest ? e.longest->seq_len : 0},
                          {"longest", e.longest ? point_json(*e.longest) : nlohmann::json(nullptr)}});
      doc["states"] = states;
    }
    const std::optional<planned_run> run = recommend(r, plan);
    doc["recommendation_rule"] = rule_text(r, plan);
    doc["recommended_command"] = run ? nlohmann::json(train_command(f, r, *run)) : nlohmann::json(nullptr);
    doc["lora_command"] = lora_command ? nlohmann::json(*lora_command) : nlohmann::json(nullptr);
    doc["recommended"] = run ? point_json(run->point) : nlohmann::json(nullptr);
    if (run) doc["recommended"]["host_memory_gib"] = gib(run->point.host_budget);
    if (run) doc["recommended"]["memory_gib"] = planned_arena_gib(r);
    write_json_file(f.json_path, doc, 1);
  }
  return 0;
}

}  // namespace

command_runner add_plan(CLI::App& app) {
  auto f = std::make_shared<plan_flags>();
  f->options = std::make_shared<run_options>(app, for_plan);
  CLI::Option* gpus = app.add_option("--gpus", f->gpus, "GPUs in all (one node unless --gpus-per-node)")
                          ->capture_default_str();
  app.add_option("--gpus-per-node", f->gpus_per_node, "GPUs per node: --gpus / G nodes (or with --nodes)");
  CLI::Option* nodes = app.add_option("--nodes", f->nodes, "nodes (hybrid's ring runs across them; host memory is per "
                                      "node)")->capture_default_str();
  app.add_option("--gpu-memory", f->gpu_memory, "memory per GPU (80GiB, 141GB, ...)")->capture_default_str();
  app.add_option("--host-memory", f->host_memory,
                 "host memory of the node, everything a run may hold there (default 1.9TiB, the paper's machine)");
  app.add_option("--seq-len", f->seq_len, "also plan this length (K and M suffixes)");
  app.add_option("--attention", f->attention,
                 "strategies to plan, a comma list of: " + strategy_help() +
                     " (default ulysses, upipe, ring, fpdt, and hybrid on several nodes)")
      ->delimiter(',');
  app.add_option("--seq-chunks", f->seq_chunks,
                 "sequence chunks N to try for upipe and fpdt, ascending until one reaches no further "
                 "(comma list; default 1,4,16,64)")
      ->delimiter(',');
  app.add_option("--dp", f->dps,
                 "replica counts D the mesh sweep tries at the planned length, each a CP group of gpus / D "
                 "(comma list; default every divisor of the GPUs)")
      ->delimiter(',');
  app.add_option("--ep", f->eps,
                 "expert parallelism E to plan for a mixture of experts, each a plan of its own; the E that reaches "
                 "furthest is recommended (comma list; default every divisor of the GPUs that divides the experts)")
      ->delimiter(',');
  app.add_option("--optimizer", f->optimizer, "adamw (a training step) or none (forward and backward only)")
      ->capture_default_str();
  app.add_option("--margin", f->margin, "fraction of GPU and host memory kept free")->capture_default_str();
  app.add_option("--offload", f->offload,
                 std::string(offload_help) + "; auto: each configuration in each placement (the default on one GPU, "
                 "else none)");
  app.add_option("--optimizer-state", f->moments,
                 "AdamW's moments: fp32, bf16, 8bit, or auto: after the sweep, every state format in every placement "
                 "at the recommended U, and the command of the most precise that reaches the length (the default "
                 "on one GPU, else fp32)");
  app.add_option("--master-weights", f->master, "fp32 or bf16-kahan (with a named --optimizer-state)")
      ->capture_default_str();
  app.add_option("--grad-dtype", f->grads, "the kept gradient shards: fp32 or bf16 (with a named --optimizer-state)")
      ->capture_default_str();
  app.add_option("--max-grad-norm", f->max_grad_norm,
                 "as train's: 0 (no clipping) keeps no gradient shard, each unit updated as it arrives")
      ->capture_default_str();
  app.add_option("--json", f->json_path, "write the plan as JSON")->check(output_file_flag("--json"));
  app.add_option("--gemm-tflops", f->rates.gemm_tflops, "step-time model: bf16 GEMM rate per GPU")->capture_default_str();
  app.add_option("--attention-tflops", f->rates.attention_tflops,
                 "step-time model: causal fused attention rate (forward + backward) per GPU")
      ->capture_default_str();
  app.add_option("--nvlink-gbytes", f->rates.nvlink_gbytes, "step-time model: all-to-all bus bandwidth in a node, GB/s")
      ->capture_default_str();
  app.add_option("--network-gbits", f->rates.network_gbits, "step-time model: bandwidth per GPU across nodes, Gb/s")
      ->capture_default_str();
  app.add_option("--pcie-gbytes", f->rates.pcie_gbytes, "step-time model: host <-> device copies, GB/s each way")
      ->capture_default_str();
  app.add_option("--host-adamw-gbytes", f->rates.host_adamw_gbytes,
                 "step-time model: the host's AdamW over its cores, GB/s of state read and written")
      ->capture_default_str();
  app.add_option("--elementwise-ns", f->rates.elementwise_ns,
                 "step-time model: the memory-bound rest of a layer, ns per token and layer")
      ->capture_default_str();
  return [f, gpus, nodes] {
    f->gpus_given = gpus->count() > 0;
    f->nodes_given = nodes->count() > 0;
    return f->options->run([&] { return run(*f); });
  };
}

}  // namespace upipe::apps
