// The training loop: data, forward and backward on every rank of the CP group, sharded
// AdamW, checkpoints and resume, metrics and the retrieval evaluation.
#pragma once

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

namespace upipe {

// How a corpus of documents becomes sequences: documents (attention masked and positions
// restarted at each document, the target across a boundary dropped), stream (one token
// stream, as a flat file), automatic (documents when there is an index).
enum class packing_mode : std::uint8_t { automatic, documents, stream };

// The most sequences one optimizer step accumulates.
constexpr std::int64_t max_batch = std::int64_t{1} << 16;

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
  std::string data_path;    // a prepared corpus (PREFIX) or a flat uint32 token file; empty: the passkey task
  packing_mode packing = packing_mode::automatic;
  std::int64_t min_doc_tokens = 0;  // documents shorter than this are left out of a corpus
  std::int64_t seq_len = 128;
  std::int64_t batch = 1;   // sequences per optimizer step (gradients accumulated)
  // Short-sequence stage: steps 1..seq_warmup train on sequences of seq_warmup_start
  // tokens (0: a quarter of seq_len), the rest on seq_len; seq_warmup 0: every step at
  // seq_len.
  std::int64_t seq_warmup = 0, seq_warmup_start = 0;
  cp_settings cp{strategy_kind::upipe, 4, 0};
  zero_stage zero = zero_stage::two;
  bool offload_optimizer = false;  // master weights, moments and gradient shards in host memory; AdamW on the host
  bool offload_params = false;     // the working-dtype weights in host memory too (with offload_optimizer)
  step_options step;
  adamw_config optim;            // optim.total_steps is --steps
  std::int64_t stop_after = 0;   // stop once this step is done; 0: at total_steps
  std::uint64_t seed = 1;
  std::string save_dir;
  std::int64_t save_every = 0;
  std::string resume_dir;
  backend_kind backend = backend_kind::cpu;
  memory_limits limits;
  comm_options comm;      // how real ranks talk (threads, NCCL)
  int eval_samples = 32;  // held-out passkey samples for the retrieval accuracy
  // Held-out loss during training: every eval_every steps, eval_sequences windows of the
  // step's length from eval_data (a corpus or token file), forward only.
  std::int64_t eval_every = 0;
  std::string eval_data;
  int eval_sequences = 4;
};

struct step_record {
  std::int64_t step = 0, seq_len = 0;
  double epoch = 0;  // corpora: how many passes over the documents, at the step's first sequence
  double model_flops = 0;  // of the step's sequences, attention counted over the attended pairs only
  std::optional<double> eval_loss;  // held-out loss after this step (--eval-every)
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, seconds = 0;
  std::map<std::string, std::size_t> peak_bytes;  // rank 0
};

struct train_summary {
  std::vector<step_record> steps;             // the steps run in this call
  std::optional<double> retrieval_accuracy;   // passkey task only
  std::vector<std::map<std::string, std::size_t>> peak_bytes;  // per rank, tag -> bytes
  std::int64_t seq_len = 0;                   // after padding
  double seconds = 0;
  double load_seconds = 0;                    // from the start until every rank holds its weights
  std::size_t arena_high_water = 0;           // rank 0's device arena, bytes
};

// One optimizer step's memory on rank 0 of the meta backend (zero tokens, no data).
struct step_memory {
  std::map<std::string, std::size_t> peak_bytes;  // tag -> bytes
  std::size_t device_peak = 0;       // all device tags together, at their highest
  std::size_t arena_high_water = 0;  // the device arena's highest end offset (with fragmentation)
  std::size_t host_high_water = 0;   // the host arena's (checkpoints offloaded to the host)
  std::size_t workspace_at_end = 0;  // workspace tag live after the step: the libraries' cached workspaces
};

// Checks the options as a whole (throws config_error naming the flag, the rule and a
// valid alternative) before anything runs.
void validate(const train_options& options);

// The sequence length of a step under the options' sequence-length warmup.
std::int64_t step_seq_len(const train_options& options, std::int64_t step);

// Runs one step of `options` on the meta backend (the planner's probe); with
// zero_stage::replicated, forward and backward only (full weights and f32 gradients, no
// optimizer state).
step_memory measure_step_memory(const train_options& options);

// Timed steps for benchmarks: one warm-up step at warmup_len tokens (0: none), then
// `repeats` steps at options.seq_len on random tokens, each timed on rank 0 between device
// synchronizations. With `emulate`, rank 0 alone over a loopback communicator (one GPU
// measures rank 0 of a group of options.cp.cp).
struct step_timing {
  std::vector<double> seconds;  // per timed step
  std::vector<double> losses;
  std::vector<double> grad_norms;  // per timed step, before clipping (0 without an optimizer)
  step_memory memory;           // rank 0, over the whole run
  std::size_t driver_peak = 0;  // rank 0's device, bytes the driver reported in use (0: not a GPU)
  std::map<std::string, double> phases_ms;  // with `phases`: rank 0's fastest step by phase
};
// Times `repeats` steps after one warm-up step of warmup_len tokens (0: none), on every rank
// or on rank 0 alone (emulated); by_phase: also the fastest step's time by phase
// (backend::take_phase_ms).
enum class phase_timing { off, by_phase };
step_timing time_steps(const train_options& options, std::int64_t warmup_len, int repeats, group_run ranks,
                       phase_timing phases = phase_timing::off);

// Runs training; on_step is called on rank 0 after every step (progress, metrics).
train_summary train(const train_options& options, const std::function<void(const step_record&)>& on_step);

}  // namespace upipe
