// The model-level entry used by tests and tools: given a configuration, weights, one
// token sequence and a CP configuration, run forward and backward on every rank (threads
// on the cpu backend, loopback rank 0 on meta) and return the loss and every weight
// gradient under Hugging Face names.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "runtime/cp_group.hpp"

namespace upipe {

// A sequence prepared for CP: labels shifted before sharding (label i = token i+1; the
// last is masked), padded with masked positions to a multiple of `unit`. With packed
// documents (`documents`: where each begins, the first 0) the label that would predict
// a document's first token from the previous document's end is masked too. With a loss
// mask (`targets`, a byte per token, 1 for a target; empty: every token) label i is
// masked where token i + 1 is not a target, as transformers' labels of -100.
struct prepared_sequence {
  std::vector<std::int32_t> ids, labels;  // padded length
  std::int64_t counted = 0;               // unmasked labels
  std::vector<std::int64_t> documents;    // as given (empty: one document)
  std::int64_t tokens = 0;                // before padding
};
constexpr std::int32_t masked_label = -100;
prepared_sequence prepare_sequence(std::span<const std::int32_t> tokens, std::int64_t unit,
                                   std::span<const std::int64_t> documents = {},
                                   std::span<const std::uint8_t> targets = {});
// The layout unit of a strategy: C for ulysses and upipe, 2C for the zigzag halves of ring and hybrid.
std::int64_t layout_unit(const cp_settings& cp);

struct model_step_request {
  model_config model;
  cp_settings cp;
  // A mesh of dp replicas of the CP group, each running the same sequence (the result is
  // their mean), with expert parallelism over EP groups of ep ranks (ep divides dp x cp).
  int dp = 1, ep = 1;
  step_options options;
  backend_kind backend = backend_kind::cpu;
  memory_limits limits;
  bool record_timeline = false;  // keep rank 0's ledger timeline in the result
  comm_options comm;             // how the ranks talk (threads in one process unless told)
  std::vector<std::int64_t> documents;  // packed documents: where each begins (empty: one)
  std::vector<std::uint8_t> targets;    // the loss mask, a byte per token (empty: every token a target)
  // meta: a sequence of this many tokens, with no host copy (run_model_step's tokens empty),
  // so that a step at 2^30 tokens costs the host nothing.
  std::int64_t shape_only = 0;
};

struct model_step_result {
  double loss = 0;            // lm_loss, plus router_aux_loss_coef x aux_loss where that loss is on
  double lm_loss = 0;         // mean cross-entropy over unmasked labels of all ranks
  double aux_loss = 0;        // a mixture of experts' load-balancing loss (0 when off)
  std::int64_t counted = 0;   // unmasked labels
  std::int64_t seq_len = 0;   // after padding
  host_weights grads;         // summed over a replica's ranks (empty on meta); with LoRA the adapters'
  backend::gemm_flops gemm_flops;  // rank 0's GEMMs in forward + backward
  std::map<std::string, std::size_t> peak_bytes;  // rank 0, tag -> bytes
  std::size_t device_peak_bytes = 0;              // rank 0
  double time_ms = 0;                             // rank 0, forward + backward
  std::vector<ledger_event> timeline;             // rank 0, when asked for
};

// A mesh rank's expert sharding for its stores: its EP group's place (mesh.expert_peers),
// or every expert where there is none.
expert_sharding experts_of(const mesh_comms& mesh);

// The highest sum of live bytes, over a timeline, of the allocations whose label starts
// with one of `prefixes` (the working set of one part of the step, such as "mlp_").
std::size_t peak_of_labels(const std::vector<ledger_event>& timeline, std::initializer_list<std::string_view> prefixes);

// One prepared sequence scored by every rank of a CP group, forward only: the loss of
// each target t (the cross-entropy of token t + 1 given tokens 0..t; 0 where masked) in
// global order, and the argmax prediction at the global positions `argmax_at` (the token
// predicted for position p + 1), both on every rank.
struct sequence_scores {
  std::vector<float> losses;          // the padded length
  std::vector<std::int32_t> argmax;   // argmax_at.size()
};
sequence_scores score_sequence(transformer& model, parameter_store& params, communicator& comm,
                               const prepared_sequence& seq, std::span<const std::int64_t> argmax_at = {},
                               parameter_store* adapters = nullptr);

// Forward-only evaluation of sequences of one length (a store of weights alone: no
// checkpoints, gradients or optimizer state). target_loss[i][t] is sequence i's
// cross-entropy of token t + 1 given tokens 0..t, NaN where the target is not counted (it
// crosses a document boundary, or the loss mask leaves it out); argmax[i][j] is the model's prediction at position
// argmax_at[j] (for token argmax_at[j] + 1).
struct eval_sequence {
  std::vector<std::int32_t> tokens;
  std::vector<std::int64_t> documents;  // where each begins (empty: one document)
  std::vector<std::int64_t> argmax_at;  // positions whose argmax prediction is wanted
  std::int64_t shape_only = 0;          // meta: no tokens, this length only (the planner's probe)
  std::vector<std::uint8_t> targets = {};  // the loss mask (empty: every token a target); NaN where masked
};
struct eval_result {
  std::vector<std::vector<float>> target_loss;
  std::vector<std::vector<std::int32_t>> argmax;
  std::size_t completed = 0;                      // sequences scored (fewer when stopped)
  std::map<std::string, std::size_t> peak_bytes;  // rank 0
  std::size_t arena_high_water = 0;               // rank 0
  double seconds = 0;
};
// Between sequences: `progress(done)` runs on rank 0 after each, and the ranks stop
// together (result.completed < sequences.size()) once `stop()` has returned true on any.
struct eval_hooks {
  std::function<void(std::size_t done)> progress;
  std::function<bool()> stop;
};
// With LoRA (request.options.lora), `adapters` holds the adapters under lora_parameter_specs'
// names, applied beside the base as the merged model's weights would be (upipe eval --adapter).
eval_result evaluate(const model_step_request& request, const weight_source& weights,
                     const std::vector<eval_sequence>& sequences, const eval_hooks& hooks = {},
                     const weight_source* adapters = nullptr);

// Throws io_error if a weight is missing (weights may be empty on meta). With LoRA
// (request.options.lora), the base is frozen, `adapters` holds the adapters under
// lora_parameter_specs' names (PEFT's default initialization when empty) and the result's
// gradients are theirs.
model_step_result run_model_step(const model_step_request& request, const host_weights& weights,
                                 std::span<const std::int32_t> tokens, const host_weights& adapters = {});

}  // namespace upipe
