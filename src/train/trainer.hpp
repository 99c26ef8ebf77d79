// The training loop: data, forward and backward on every rank of the CP group, sharded
// AdamW, checkpoints and resume, metrics and the retrieval evaluation.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "model/hf_model.hpp"
#include "model/parameter_store.hpp"
#include "model/transformer.hpp"
#include "optim/optimizer.hpp"
#include "runtime/cp_group.hpp"
#include "train/data_reader.hpp"

namespace upipe {

// Where a run's tokens come from: its data (a corpus, a token file, or the passkey task when
// none is given), or random ids (benchmarks and the planner's probes, time_steps).
enum class token_source : std::uint8_t { data, random };

// The most sequences one optimizer step accumulates.
constexpr std::int64_t max_batch = std::int64_t{1} << 16;
// The longest schedule: a billion steps (years at a step a second); beyond it a typo.
constexpr std::int64_t max_train_steps = 1'000'000'000;

struct train_options {
  model_config model;
  std::string init_path;    // weights to start from (a model directory or a .safetensors file); empty: random
  // LoRA (step.lora enabled): the base is frozen and only adapters train. Their start: a
  // PEFT adapter directory, or empty for PEFT's default initialization from `seed`.
  std::string init_adapter;
  std::string model_dir;    // the input model directory: the base of the saved config.json and the source of
                            // the tokenizer files (empty for presets)
  // Without init_path the first weights are model_dir's: required there (--model DIR), or
  // random where it holds none (--config: a config alone is a model of random weights).
  enum class model_dir_weights { required, optional };
  model_dir_weights weights_in_model_dir = model_dir_weights::required;
  hf_save_options save_model;  // the saved weights' dtype and shard size
  // --data: a prepared corpus (PREFIX), a flat uint32 token file, or a mixture of them by
  // weight ("A:0.7,B:0.3", parse_data_sources); empty: the passkey task.
  std::string data_path;
  token_source tokens = token_source::data;  // random: time_steps' ids, no task to satisfy
  packing_mode packing = packing_mode::automatic;
  std::int64_t min_doc_tokens = 0;  // documents shorter than this are left out of a corpus
  // Data tokenized with another tokenizer than the model directory's is refused unless set.
  bool allow_tokenizer_mismatch = false;
  std::int64_t seq_len = 128;
  std::int64_t batch = 1;   // sequences per optimizer step and replica (gradients accumulated)
  // Data parallelism (docs/design.md section 11): dp replicas, each a CP group of cp.cp
  // ranks reading its own sequences; ZeRO shards over all dp x cp ranks. A step takes
  // dp x batch sequences (global_batch).
  int dp = 1;
  // Expert parallelism (docs/design.md section 12): each sparse layer's routed experts split
  // over EP groups of ep consecutive ranks of the dp x cp mesh (ep divides dp x cp and the
  // model's experts); the ranks at one place of every EP group hold the same experts.
  int ep = 1;
  // GPUs per node, for the mesh's placement check (a CP group inside a node, or whole
  // nodes); 0: every rank on one node.
  int gpus_per_node = 0;
  // Short-sequence stage: steps 1..seq_warmup train on sequences of seq_warmup_start
  // tokens (0: a quarter of seq_len), the rest on seq_len; seq_warmup 0: every step at
  // seq_len.
  std::int64_t seq_warmup = 0, seq_warmup_start = 0;
  cp_settings cp{strategy_kind::upipe, 4, 0};
  zero_stage zero = zero_stage::two;
  bool offload_optimizer = false;  // master weights, moments and gradient shards in host memory; AdamW on the host
  bool offload_params = false;     // the working-dtype weights in host memory too (with the master there)
  bool offload_master = false;     // the master weights alone in host memory (the moments on the GPU)
  // The offloaded update beside the next step's forward (offload_options::overlap); off:
  // each step's update is done within the step (--offload-overlap off).
  bool offload_overlap = true;
  // Rank 0's phase table of every step (step_record::phases; --phases): the step's stream
  // timed by stage, its waits and copies, the side copies and the host's work.
  bool phases = false;
  // AdamW's state (docs/design.md section 5, "Lean optimizer state"): the moments' and the
  // master's formats, and the kept gradient shards' dtype. Without clipping and with one
  // sequence a step no gradient shard is kept: each unit is updated as its gradients arrive.
  adamw_state_format state_format;
  dtype grad_type = dtype::f32;
  bool convert_state = false;  // a resume from a checkpoint of another state format converts it
  step_options step;
  adamw_config optim;            // optim.total_steps is --steps
  std::int64_t stop_after = 0;   // stop once this step is done; 0: at total_steps
  std::uint64_t seed = 1;
  std::string save_dir;          // the run directory: DIR/checkpoint-STEP, DIR/latest (train/run_directory.hpp)
  std::int64_t save_every = 0;
  std::int64_t keep_last = 0;    // keep the newest N of the run's checkpoints (0: all)
  bool keep_best = false;        // and the one of the lowest held-out loss
  bool overwrite = false;        // remove another run's checkpoints in save_dir after the first save
  std::string resume_dir;        // a checkpoint (a run directory's latest already resolved)
  std::string run_config;        // the resolved configuration (TOML), written into every checkpoint
  std::string run_id;            // empty: the resumed checkpoint's, or a new one
  // Set by a signal handler to the signal's number: every rank finishes the step it is in,
  // the group agrees, the run saves (with save_dir) and stops.
  const std::atomic<int>* stop_signal = nullptr;
  backend_kind backend = backend_kind::cpu;
  memory_limits limits;
  // --host-memory-gib: everything the process may hold in host memory, which the pools were
  // sized from (0: none given); the start-up check counts it whole (train/run_memory.hpp).
  double host_memory_gib = 0;
  comm_options comm;      // how real ranks talk (threads, NCCL)
  int eval_samples = 32;  // held-out passkey samples for the retrieval accuracy
  // Held-out loss during training: every eval_every steps, eval_sequences windows of the
  // step's length from each source of eval_data (corpora or token files, comma-separated),
  // forward only.
  std::int64_t eval_every = 0;
  std::string eval_data;
  int eval_sequences = 4;
};

// A step's phase table (docs/design.md section 5, "The offloaded step's phases"): the step's
// stream cut at every change of stage and phase and summed by stage, the waits and the
// copies on the stream apart (backend::take_phases), the side copies beside it, and the
// host's work on the shards (parameter_store::take_host_times: the pieces that ended within
// the step, so that with the overlap a step's row holds the previous step's update's rest and
// the part of its own that ended before its end). The stages sum to span_ms, the stream's
// time between the step's first and last marks; wall_ms is the step's clock.
struct step_phases {
  double wall_ms = 0, span_ms = 0;
  std::map<std::string, double> stages_ms;
  std::map<std::string, backend::side_copy_time> side_copies;
  std::map<std::string, host_work_log::times> host;
  // The wall time the stages do not account for (launches before the first mark, the host
  // after the last).
  double rest_ms() const { return wall_ms - span_ms; }
  // The GPU's own work: the stages but the waits and the copies on the step's stream.
  double gpu_ms() const;
  bool empty() const { return stages_ms.empty(); }
};
// Adds a take of the backend's phase timing (a stage's, or the rest of a step's).
void add_phases(step_phases& into, const backend::phase_times& take);

struct step_record {
  std::int64_t step = 0, seq_len = 0;
  double epoch = 0;  // passes over the data at the step's start (a mixture: its most-read source's)
  // The sources (--data paths) this step read past the end of, for the first time in the run:
  // from here their data repeats.
  std::vector<std::string> past_end;
  double model_flops = 0;  // of the step's sequences, attention counted over the attended pairs only
  std::optional<double> eval_loss;  // held-out loss after this step (--eval-every), over every eval source
  std::map<std::string, double> eval_losses;  // ... and per --eval-data source
  std::int64_t targets = 0;          // the step's counted targets (its loss is their mean)
  std::int64_t empty_sequences = 0;  // sequences whose every target is masked: they add nothing and are not run
  bool skipped = false;              // no target in the whole step: no update (loss NaN), the data moves on
  // Per source of --data, in its order: this step's sequences and targets, and the passes
  // over it (its documents, or a token file's tokens) at the step's start.
  struct source_counts {
    std::int64_t sequences = 0, targets = 0;
    double epoch = 0;
  };
  std::vector<source_counts> sources;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, seconds = 0;
  // A mixture of experts with the load-balancing loss on: loss = lm_loss +
  // router_aux_loss_coef x aux_loss (aux_loss the mean of the sequences').
  bool aux_on = false;
  double lm_loss = 0, aux_loss = 0;
  std::map<std::string, std::size_t> peak_bytes;  // rank 0
  step_phases phases;  // rank 0's, with train_options::phases
};

struct train_summary {
  std::vector<step_record> steps;             // the steps run in this call
  std::optional<double> retrieval_accuracy;   // passkey task only
  std::vector<std::map<std::string, std::size_t>> peak_bytes;  // per rank, tag -> bytes
  std::int64_t seq_len = 0;                   // after padding
  double seconds = 0;
  double load_seconds = 0;                    // from the start until every rank holds its weights
  std::size_t arena_high_water = 0;           // rank 0's device arena, bytes
  std::size_t host_high_water = 0;            // rank 0's host pool, bytes
  // The process's host memory (train/run_memory.hpp): what lies beside the pools and each
  // rank's pool, whole where it is taken at start (the GPU's pinned pool), else at its high
  // water (meta: what the GPU run's pools must hold).
  std::size_t host_bytes = 0;
  int stopped_by_signal = 0;                  // the signal that stopped the run early, or 0
  std::string last_checkpoint;                // the newest checkpoint saved (empty: none)
  std::string run_id;                         // the run's id, kept across resumes
};

// One optimizer step's memory on rank 0 of the meta backend (zero tokens, no data).
struct step_memory {
  std::map<std::string, std::size_t> peak_bytes;  // tag -> bytes
  std::size_t device_peak = 0;       // all device tags together, at their highest
  std::size_t arena_high_water = 0;  // the device arena's highest end offset (with fragmentation)
  std::size_t host_high_water = 0;   // the host arena's (checkpoints offloaded to the host)
  std::size_t workspace_at_end = 0;  // workspace tag live after the step: the libraries' cached workspaces
};

// Sequences per optimizer step over every replica: dp x batch.
inline std::int64_t global_batch(const train_options& o) { return o.dp * o.batch; }

// Checks the options as a whole (throws config_error naming the flag, the rule and a
// valid alternative) before anything runs.
void validate(const train_options& options);

// Where the trained store's state lives, and how it is held (streamed gradients when
// nothing waits for the global norm and a step is one sequence).
offload_options offload_of(const train_options& options);
optimizer_state_options state_options_of(const train_options& options);

// The sequence length of a step under the options' sequence-length warmup.
std::int64_t step_seq_len(const train_options& options, std::int64_t step);

// Runs one step of `options` on the meta backend (the planner's probe); with
// zero_stage::replicated, forward and backward only (full weights and f32 gradients, no
// optimizer state).
step_memory measure_step_memory(const train_options& options);

// Timed steps for benchmarks: one warm-up step at warmup_len tokens (0: none), then
// `repeats` steps at options.seq_len on random tokens (one sequence per replica), each timed
// on rank 0 between device synchronizations. An offloaded update belongs to its step; with
// the overlap on it goes on beside the next step's forward, and the last step waits for
// its own. With `emulate`, rank 0 alone over loopback
// communicators (one GPU measures rank 0 of a mesh of options.dp x options.cp.cp).
struct step_timing {
  std::vector<double> seconds;  // per timed step
  std::vector<double> losses;
  std::vector<double> grad_norms;  // per timed step, before clipping (0 without an optimizer)
  step_memory memory;           // rank 0, over the whole run
  std::size_t driver_peak = 0;  // rank 0's device, bytes the driver reported in use (0: not a GPU)
  std::map<std::string, double> phases_ms;  // with `phases`: rank 0's fastest step by phase
  step_phases step;                          // ... and its phase table
  // Rank 0's bytes sent over its CP group in its last timed step, by label (the attention's
  // a2a_q or ring_kv, the hybrids' delta_summary, ...).
  std::map<std::string, std::uint64_t> sent_bytes_by_label;
};
// Times `repeats` steps after one warm-up step of warmup_len tokens (0: none), on every rank
// or on rank 0 alone (emulated); by_phase: also the fastest step's time by phase
// (backend::take_phase_ms). With target_fraction < 1 only the last part of each sequence
// is a target of the loss (the shape of a fine-tuning example: a long prompt, a short
// answer), the rest masked.
enum class phase_timing { off, by_phase };
step_timing time_steps(const train_options& options, std::int64_t warmup_len, int repeats, group_run ranks,
                       phase_timing phases = phase_timing::off, double target_fraction = 1.0);

// Runs training; on_step is called on rank 0 after every step (progress, metrics).
train_summary train(const train_options& options, const std::function<void(const step_record&)>& on_step);

}  // namespace upipe
