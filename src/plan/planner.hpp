// The planner: for a model on C GPUs with a memory budget per GPU and a host memory
// budget per node, the per-rank peak of one training step for each CP strategy (and each
// valid U of UPipe), the longest sequence each fits, the checkpoint policy that fits both
// budgets, and the recommended U. Every number comes from the meta backend running the
// real step (the same allocator and ledger as the GPU), plus what lies outside the
// step's own allocations on a GPU: the libraries' workspaces (reserved by the probe as
// the CUDA backend reserves them) and the CUDA context.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/checkpoint_store.hpp"
#include "model/parameter_store.hpp"
#include "plan/step_time.hpp"
#include "train/trainer.hpp"

namespace upipe {

struct probe_cache;  // the meta probes a plan has run (planner.cpp)

struct plan_request {
  model_config model;
  int gpus = 8;                        // every GPU: gpus / nodes per node
  int nodes = 1;                       // M; hybrid's ring is one all-to-all group per node
  int dp = 1;                          // replicas: each a CP group of C = gpus / dp GPUs, ZeRO over all
  // Expert parallelism of the planned runs (--ep E: a sparse layer's experts over EP groups of
  // E ranks; E divides the GPUs and the experts). `upipe plan` sweeps it for a mixture of
  // experts (each E a plan of its own) and recommends the E that reaches furthest.
  int ep = 1;
  // The replica counts D the mesh sweep tries at the planned length (plan_meshes); empty:
  // no sweep (`upipe plan` asks for every divisor of gpus unless --dp says otherwise).
  std::vector<int> dps;
  std::size_t gpu_memory = 0;          // bytes per GPU
  // Bytes per node, shared by its gpus / nodes ranks: everything a run may hold in host
  // memory (the pools with the offloaded state and the checkpoints, and what lies beside
  // them: the weights' files or host copy, the sequences, the process's own).
  std::size_t host_memory = 0;
  std::optional<double> arena_gib;     // the arena a run takes, GiB (default: planned_arena_gib's)
  std::string model_dir;               // --model DIR: its weight files, mapped for the run, count as host memory
  double margin = 0.05;                // fraction of gpu_memory kept free
  std::optional<std::int64_t> seq_len;  // also report every configuration at this length
  std::vector<strategy_kind> strategies{strategy_kind::ulysses, strategy_kind::upipe, strategy_kind::ring};
  // The sequence chunks N tried, ascending, until one reaches no further than the best
  // before it: upipe with each, fpdt with each of at least 2; the other strategies run
  // unchunked. Two chunks hold about what one does (the merge's f32 accumulator and the
  // prefetched part); from four on the attention's working set falls as 1/N.
  std::vector<int> seq_chunks{1, 4, 16, 64};
  zero_stage zero = zero_stage::three;
  bool offload_optimizer = false;      // --offload optimizer: its state in the node's host memory
  lora_config lora;                    // LoRA: the base frozen, only these adapters trained
  bool offload_params = false;         // --offload optimizer,params: the working weights there too
  bool try_offload = false;            // --offload auto: every configuration with nothing, the master, the
                                       // optimizer, and each of the last two with the weights in host memory
  bool offload_master = false;         // --offload master: the master weights alone in host memory
  optimizer_state_options state;       // AdamW's state format and kept gradients' dtype (grads from max_grad_norm)
  double max_grad_norm = 1.0;          // as train's: 0 keeps no gradient shard (each unit updated as it arrives)
  bool offload_overlap = true;         // as train's --offload-overlap: the update beside the next forward
  // --optimizer-state auto: after the sweep (at the leanest format; with try_offload, in
  // the placement that leaves the GPU the most), every format of state_ladder() in every
  // placement at the recommended configuration.
  bool try_state = false;
  std::int64_t mlp_tile = 0, loss_chunk = 0;  // as for training (0: defaults)
  attention_dtype attention_arithmetic = attention_dtype::bf16;  // --attention-dtype: fp8's buffers in the probe
  std::optional<checkpoint_policy> policy;    // only this policy (default: candidate_policies())
  bool eval = true;                           // also the longest length `upipe eval` fits
  throughput_rates rates;                     // the step-time model's compute rates and links
  // The probes already run, shared by the copies of one plan's request (make_plan makes
  // it): the mesh sweep and the state sweep meet many of the sweep's points again.
  std::shared_ptr<probe_cache> cache;
  // Called as each search of a stage ends (the sweep's configurations, the meshes, the
  // state formats' placements), from the thread that ran it, one call at a time: `done` of
  // `total` in the stage named. plan's progress line on stderr.
  std::function<void(const std::string& stage, int done, int total)> progress;
};

// The libraries' share of a GPU: their workspaces (in the arena, reserved by the meta
// probe at the moments the CUDA backend takes them) and the context outside it.
struct gpu_overheads {
  std::size_t cublaslt_workspace = 0;  // in the arena
  std::size_t cudnn_workspace = 0;     // in the arena: the attention plans' workspaces, all kept
  std::size_t context = 0;             // outside the arena: CUDA context, handles, staging
};

// One configuration at one length under one checkpoint policy.
struct plan_point {
  std::int64_t seq_len = 0;
  checkpoint_policy policy;
  step_memory memory;             // meta: the step's own allocations
  gpu_overheads overheads;
  std::size_t arena_bytes = 0;    // predicted arena high water on the GPU (the probe's, workspaces included)
  std::size_t gpu_bytes = 0;      // arena + context: what the GPU must hold
  std::size_t host_bytes = 0;     // host memory of the node: its ranks' pools at their high water and what lies
                                  // beside them (train/run_memory.hpp), per process on several nodes
  std::size_t host_budget = 0;    // the --host-memory-gib the command gets: host_bytes with each pool's
                                  // alignment headroom, rounded up to 0.01 GiB
  bool fits = false;
  std::optional<step_time> time;  // the step-time model's, on the entries' final points
};

// Forward-only evaluation (`upipe eval`) at one length: the weights alone (bf16, whole
// on every rank), no checkpoints, gradients or optimizer state.
struct eval_point {
  std::int64_t seq_len = 0;
  std::map<std::string, std::size_t> peak_bytes;  // meta: tag -> bytes
  std::size_t arena_bytes = 0;  // predicted arena high water on the GPU, workspaces included
  std::size_t gpu_bytes = 0;    // arena + context
  bool fits = false;
};

struct plan_entry {
  strategy_kind strategy = strategy_kind::upipe;
  int head_chunk = 0;                 // U (upipe, hybrid), H (ulysses), 0 (ring)
  int ring = 1;                       // hybrid's R (the nodes)
  int seq_chunks = 1;                 // N
  bool offload_optimizer = false;     // AdamW's state in host memory
  bool offload_params = false;        // the working weights too
  bool offload_master = false;        // the master weights alone in host memory
  optimizer_state_options state;      // AdamW's state format
  std::optional<plan_point> longest;  // at the longest length that fits (none: nothing fits)
  std::optional<eval_point> longest_eval;  // the longest evaluable length (with plan_request::eval)
  // Each policy's longest length where its search ran (0: not even one granule fits; -1:
  // not searched): where a neighbour's searches start.
  std::vector<std::int64_t> searched;
  std::optional<plan_point> at_request;  // at the requested length: the fastest policy that fits, or the
                                         // smallest footprint when none does
};

// One data-parallel mesh at the planned length (plan_meshes): D replicas of a CP group of
// C = gpus / D ranks running `cp`, at the fastest checkpoint policy that fits (else the
// closest), with the fewest sequence chunks that fit.
struct mesh_entry {
  int dp = 1;
  cp_settings cp;
  bool offload_optimizer = false, offload_params = false, offload_master = false;
  optimizer_state_options state;  // AdamW's state format it was planned with
  plan_point point;  // its time is the step-time model's (one sequence per replica)
  // Every replica trains a sequence of S tokens on its C GPUs in a step.
  double tokens_per_s_per_gpu() const {
    return point.time ? static_cast<double>(point.seq_len) / point.time->total() / cp.cp : 0.0;
  }
};

// What a plan cost: the meta steps it ran (each a probe not found in its cache), the
// probes the cache answered, and the seconds the meta steps took (summed over threads).
struct plan_stats {
  long step_probes = 0;        // training steps run on the meta backend
  long eval_probes = 0;        // forward-only steps (eval) run on the meta backend
  long cache_hits = 0;         // probes answered by the plan's cache
  double probe_seconds = 0;    // in the meta steps, every thread's summed
  std::int64_t longest_probed = 0;  // the longest S a probe ran at
};

struct plan_result {
  plan_stats stats;  // what the plan cost (its probes); lora_instead's plan has its own
  std::vector<plan_entry> entries;  // CP over every GPU (D = 1)
  std::vector<mesh_entry> meshes;   // every D of the sweep at planned_seq_len, each strategy's fastest
  std::optional<std::size_t> recommended_mesh;  // index into meshes: the fastest that fits
  std::optional<std::size_t> best_cp_only;      // the fastest that fits with D = 1 (CP over every GPU)
  // --optimizer-state auto: every format and placement at the recommended configuration,
  // and the one recommended there: the most precise format (state_ladder's order) that
  // reaches the requested length (else the longest any reaches), the fewest bytes moved
  // to the host among its placements that do.
  std::vector<plan_entry> state_entries;
  std::optional<std::size_t> recommended_state;
  std::optional<int> recommended_head_chunk;  // the largest U that fits at the planned length
  int recommended_seq_chunks = 1;             // and the fewest sequence chunks it needs there
  std::int64_t planned_seq_len = 0;           // the requested length, or UPipe's longest
};

// The checkpoint policies the planner tries, fastest first.
std::vector<checkpoint_policy> candidate_policies();

// AdamW's state formats the planner tries, the most precise first: fp32; fp32 with bf16
// gradient shards; bf16 moments; 8-bit moments; 8-bit moments and bf16-kahan master (the
// last three with bf16 gradient shards).
std::vector<optimizer_state_options> state_ladder();
// The placements (--offload) the planner tries: none, master, optimizer, master,params,
// optimizer,params (without the weights' under LoRA, whose base stays on the GPU).
std::vector<offload_options> placements(bool lora);

// A point's larger need over the budget it must keep to (at most 1: it fits): its GPU
// bytes against the GPU's, its host memory (the node's, or every process's budget on
// several nodes) against the host's, each less the margin.
double overshoot(const plan_request& request, const plan_point& point);

// The libraries' share of a probe's memory, and the context.
gpu_overheads estimate_overheads(const step_memory& memory);

// One configuration at one length and policy.
plan_point evaluate(const plan_request& request, const cp_settings& cp, std::int64_t seq_len,
                    const checkpoint_policy& policy);

// Forward-only evaluation at one length (the meta backend running upipe eval's forward).
eval_point evaluate_forward(const plan_request& request, const cp_settings& cp, std::int64_t seq_len);

// Throws config_error for a bad request (naming the flag, the rule and a valid value).
void validate(const plan_request& request);

plan_result make_plan(const plan_request& request);

// An empty cache of meta probes, to share between plans of one model and machine (make_plan
// makes one where the request has none).
std::shared_ptr<probe_cache> make_probe_cache();

// The configurations a request plans on its CP groups of gpus / dp ranks: ulysses, upipe
// at every valid U (sequence chunks at the smallest), fpdt, ring, and hybrid where a CP
// group spans nodes (its ring over them).
std::vector<cp_settings> plan_configurations(const plan_request& request);

// The step-time model at one point of a configuration (plan/step_time.hpp).
step_time model_step_time(const plan_request& request, const cp_settings& cp, const plan_point& point);
// ... and of a run's options (its resolved checkpoint policy; one node of gpus_per_node,
// or 8, GPUs unless the options say): what train and bench print beside a measured step.
step_time model_step_time(const train_options& options);

// Every mesh of the request's sweep (each D of its dps, ascending, whose CP group of
// C = gpus / D sits inside a node or over whole nodes) at `seq_len`: per D and strategy (and
// U, ring and offload), the fewest sequence chunks that fit and the policy with the
// shortest modelled step (plan/mesh_plan.cpp). The sweep stops after a D where nothing
// fits (more replicas hold more per GPU). `cp_only`, the plan of the request's own D, leaves
// out at that D the configurations whose longest length falls short of seq_len.
std::vector<mesh_entry> plan_meshes(const plan_request& request, std::int64_t seq_len,
                                    const std::vector<plan_entry>* cp_only = nullptr);

// The fastest mesh that fits, and the fastest that fits with D = 1.
void recommend_mesh(plan_result& result);

// The fastest of the request's policies (request.policy, else candidate_policies())
// whose step at `seq_len` fits the request's budgets; when none does, the one closest to
// fitting, whose larger need (GPU or host) over its budget is smallest (its `fits` is
// false). What `plan --seq-len` reports and `--checkpoint-policy auto` runs with.
plan_point fastest_fit(const plan_request& request, const cp_settings& cp, std::int64_t seq_len);

// The arena (--memory-gib) a plan's GPU gets: the GPU's memory less the margin and the
// context, rounded down to 0.01 GiB (what the probe sizes its tile and chunk for, and what
// the printed command asks for).
double planned_arena_gib(const plan_request& request);
// --head-chunk auto, for a strategy that chooses U: the largest U (valid_head_chunks of its
// all-to-all group) whose step at seq_len fits the request's budgets at fastest_fit's
// policy; when none does, the smallest U and its closest point (fits false).
struct head_chunk_choice {
  int head_chunk = 0;
  plan_point point;
};
head_chunk_choice largest_fitting_head_chunk(const plan_request& request, cp_settings cp, std::int64_t seq_len);

// What the planner adds to a step's arena on a GPU: the CUDA context and the libraries'
// handles outside it.
std::size_t gpu_context_bytes();

}  // namespace upipe
