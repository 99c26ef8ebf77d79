// Training checkpoints. A checkpoint directory is a Hugging Face model directory that
// transformers, vLLM and PEFT load as it is:
//   config.json                 the input's config.json, changed only where training changed it
//   model.safetensors           the weights (bf16 by default), or model-0000N-of-0000M shards
//   model.safetensors.index.json   with shards
//   tokenizer files, generation_config.json   copied from the input model directory
//   trainer/manifest.json       the run: step, data position, seed, ranks, ZeRO stage, strategy, run id
//   trainer/run.toml            the run's resolved configuration (train --resume DIR needs nothing else)
//   trainer/rank-0000R-of-0000C.safetensors   rank R's shard of the master weights and AdamW's moments,
//                               in the run's state format (the manifest's optimizer_state)
// A LoRA run's checkpoint is a PEFT adapter directory instead of a model directory
// (adapter_config.json, adapter_model.safetensors in fp32: what PeftModel.from_pretrained
// loads on the base), its trainer/ holding the adapters' masters and moments.
// Each rank writes its own shard file, in parallel; a resume at another rank count or ZeRO
// stage reshards from them. The directory is built under DIR.tmp-upipe and swapped in
// atomically, carrying over the files a user put into DIR, so that an existing checkpoint
// is never left half-written and nothing a user added is lost.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "comm/communicator.hpp"
#include "model/config.hpp"
#include "model/hf_model.hpp"
#include "model/lora.hpp"
#include "model/parameter_store.hpp"

namespace upipe {

struct trainer_state {
  std::int64_t step = 0;           // steps done
  std::int64_t data_position = 0;  // the data position (data_reader.hpp: a token file's counts its passes)
  std::uint64_t seed = 0;          // data and initialization seed
  std::int64_t total_steps = 0;    // the schedule's length when saved
  std::string data = "passkey";    // "passkey" or the token file's path
  std::uint64_t data_bytes = 0;    // the token file's size when saved
  std::string packing = "stream";  // "documents" or "stream": how the data became sequences
  std::int64_t min_doc_tokens = 0;
  // The shape of the steps since step shape_step, at data position shape_position (where
  // the run, or a resume of another shape, began), which the data position follows from
  // (batch 0: a save of an earlier upipe, which did not record them).
  std::int64_t batch = 0, seq_len = 0, seq_warmup = 0, warmup_seq_len = 0;
  std::int64_t shape_step = 0, shape_position = 0;
  // A mixture of several sources (--data A:0.7,B:0.3; empty for one): each one's path and
  // weight as given, its token file's size, and its sequences and position now and at
  // shape_step. data is then the mixture's text, data_position and shape_position the sums.
  struct source_state {
    std::string data;
    double weight = 1;
    std::uint64_t data_bytes = 0;
    std::int64_t sequences = 0, position = 0, shape_sequences = 0, shape_position = 0;
  };
  std::vector<source_state> mixture = {};
};

struct checkpoint_request {
  model_config config;     // as trained: RoPE and max_position_embeddings as the run used them
  std::string source_dir;  // the input model directory (its config.json and tokenizer), or empty
  hf_save_options model;   // the weights' dtype and shard size
  trainer_state state;
  std::string strategy;    // recorded for the reader; a resume may use another
  int head_chunk = 0;
  std::int64_t seq_len = 0;
  lora_config lora;        // enabled: the store saved holds the adapters (an adapter directory)
  std::string base_model;  // LoRA: the base's directory or preset, for adapter_config.json
  std::string run_id;      // the run this checkpoint belongs to (run_directory.hpp)
  std::optional<double> eval_loss;  // the held-out loss at this step, when one was measured
  std::string run_config;  // the resolved run configuration (TOML), written as trainer/run.toml
};

// The run configuration file inside a checkpoint: CHECKPOINT/trainer/run.toml.
std::string run_config_path(const std::string& checkpoint_dir);

// The configuration a checkpoint was saved with (its trainer/run.toml), or nullopt for a
// checkpoint of an earlier upipe that wrote none. Throws io_error naming the file when it is
// missing, empty, or not the file the manifest records (its run_config_sha256).
std::optional<std::string> read_run_config(const std::string& checkpoint_dir);

// Resolves a --save or --resume path as a user means it: a trailing slash is dropped and a
// symbolic link is followed (the link stays; its target is written).
std::string resolve_checkpoint_dir(const std::string& dir);

// Checks before step 1 that DIR can take a checkpoint: its parent exists and is writable,
// and DIR is absent, empty or an upipe checkpoint. Throws io_error naming the path and a
// way out. Removes what a killed save left behind (DIR.tmp-upipe, DIR.tmp-<dead pid>).
void check_save_dir(const std::string& dir);

// Collective over the CP group: every rank writes its shard, rank 0 the model (or the
// adapters) and the manifest. Throws io_error (full disk, unwritable directory); DIR is
// then untouched.
void save_checkpoint(const std::string& dir, const checkpoint_request& request, parameter_store& params,
                     communicator& comm);

// Removes the temporary a failed save_checkpoint left, once no rank writes into it.
void remove_save_temporary(const std::string& dir);

class safetensors_view;

// A saved checkpoint's trainer state: the manifest and every rank's shard file, mapped.
class saved_state {
 public:
  // Throws io_error when DIR holds no trainer/manifest.json or a shard file is missing.
  explicit saved_state(const std::string& dir);
  ~saved_state();

  const std::string& dir() const { return dir_; }
  const trainer_state& state() const { return state_; }
  int ranks() const { return ranks_; }
  const std::string& zero() const { return zero_; }
  // Whether the manifest records the steps' shape (batch, lengths; saves of earlier
  // versions do not), against which the data position is checked.
  bool shape_recorded() const { return shape_recorded_; }
  // A LoRA run's --lora as saved (lora_text), empty for a full run's state.
  const std::string& lora() const { return lora_; }
  // The format the optimizer state was saved in (f32 for a manifest that names none).
  const adamw_state_format& state_format() const { return format_; }
  const std::string& run_id() const { return run_id_; }  // "" for a checkpoint before run ids
  // Checks the units against the run's model, or its adapters (config_error naming both
  // otherwise), and keeps a full model's parameter names for read()'s messages.
  void check_units(const model_config& config, const lora_config& lora = {}) const;
  // Elements [begin, begin + count) of a unit's unpadded flat state as saved (for q8's
  // absmax, blocks of the unit), from whichever of the saved ranks hold them
  // (parameter_store::state_reader). A NaN or an Inf, or a negative second moment or block
  // absmax, is an io_error naming the rank file, the parameter (once check_units has run)
  // and the element.
  void read(int unit, shard_state which, std::int64_t begin, std::int64_t count, float* out) const;

 private:
  static constexpr std::int64_t max_saved_seq_len = std::int64_t{1} << 30, max_saved_batch = std::int64_t{1} << 16,
                                max_saved_unit = std::int64_t{1} << 40;
  static constexpr std::size_t max_saved_sources = 1024;
  void check_manifest_ranges(const std::string& manifest) const;
  void check_shard_rank(const safetensors_view& shard, const std::string& file, int rank) const;
  void read_mixture(const nlohmann::json& manifest, const std::string& path);
  void read_expert_placement(const nlohmann::json& manifest, const std::string& path);
  [[noreturn]] void bad_value(int unit, shard_state which, std::int64_t rank, std::int64_t element, float value) const;

  struct impl;
  std::unique_ptr<impl> impl_;
  std::string dir_;
  trainer_state state_;
  int ranks_ = 0;
  std::string zero_, lora_;
  adamw_state_format format_;
  std::string run_id_;
  bool shape_recorded_ = false;
};

// A resumed run's model must be the saved one: config_error naming both otherwise.
void check_same_model(const model_config& saved, const model_config& run, const std::string& dir);

// `upipe export`: the checkpoint's fp32 master weights as a model directory in `options`'
// dtype, with its config.json and tokenizer, without the trainer state. CHECKPOINT may be a
// run directory or its latest or best pointer (resolve_checkpoint). OUT must be absent or
// empty (its missing parents are made); it is written atomically. Returns the checkpoint
// read.
std::string export_checkpoint(const std::string& checkpoint_dir, const std::string& out_dir,
                              const hf_save_options& options);

// `upipe export BASE OUT --merge-adapter ADAPTER`: the base model directory with every
// adapted weight replaced by W + (alpha / r) B A (in fp32, then `options`' dtype), as a
// plain model directory transformers loads: BASE's config.json and tokenizer. ADAPTER is
// any LoRA adapter directory (upipe's or PEFT's). OUT must be absent or empty. Returns the
// adapter directory read (a run directory's checkpoint).
std::string merge_adapter(const std::string& base_dir, const std::string& adapter_dir, const std::string& out_dir,
                          const hf_save_options& options);

}  // namespace upipe
