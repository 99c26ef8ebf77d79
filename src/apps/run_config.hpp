// One run configuration: every option of `upipe train` declared once, as a row of one
// table (its flag, its key in a TOML config file, its default, its help, which commands
// take it and what a resume may do with it). `train` takes them all; step, eval, bench and
// plan register the rows they share. A value comes from, lowest first: the defaults (the
// demo's, or a fine-tune's when the run starts from pretrained weights), the checkpoint a
// --resume names, a --config-file, the flags. The resolved configuration is printed at the
// start and written into every checkpoint (trainer/run.toml).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include <CLI/CLI.hpp>

namespace upipe::apps {

struct run_config {
  // [model]
  std::string model = "tiny-llama", config, init, lora, init_adapter, rope_scaling, router_aux_loss = "config";
  int layers = 0;
  std::optional<double> rope_theta;
  std::optional<std::int64_t> max_position_embeddings;
  // [data]
  std::string data, packing = "auto", seq_len = "128";
  std::int64_t min_doc_tokens = 0, batch = -1, seq_warmup = -1, seq_warmup_start = 0;
  double epochs = 0;
  bool allow_tokenizer_mismatch = false;
  // [eval]
  std::string eval_data;
  std::int64_t eval_every = 0;
  int eval_sequences = 4, eval_samples = 32;
  // [parallel]
  std::string attention = "upipe", comm = "auto";
  int cp = 4, head_chunk = 0, ring = 1, seq_chunks = 0, zero = 2, dp = 1, gpus_per_node = 0;
  double comm_timeout = 600;
  bool overlap_comm = false, prefetch_weights = false;
  // [optimizer]
  std::int64_t steps = 3300, stop_after = 0, warmup = 20;
  double lr = 1e-3, warmup_ratio = 0, min_lr_ratio = 0.1, weight_decay = 0.01, max_grad_norm = 1.0;
  std::uint64_t seed = 1;
  std::string optimizer_state = "fp32", master_weights = "fp32", grad_dtype = "fp32";
  bool convert_optimizer_state = false;
  // [checkpoint]
  std::string save, save_dtype = "bf16", max_shard_size = "5GB", resume;
  std::int64_t save_every = 0, keep_last = 0;
  bool keep_best = false, overwrite = false;
  // [system]
  std::string backend = "cpu", offload = "none", checkpoint_policy = "auto";
  std::int64_t mlp_tile = 0, loss_chunk = 0;
  double memory_gib = 8, host_memory_gib = 0;
  // [metrics]
  std::string metrics_json;
};

// Which commands take an option.
enum command_set : unsigned { for_train = 1, for_step = 2, for_eval = 4, for_bench = 8, for_plan = 16 };

// What `train --resume DIR` does with an option that the checkpoint's configuration holds.
enum class on_resume : std::uint8_t {
  kept,      // the same run: taken from the checkpoint, and a different value is refused naming the stored one
  changes,   // taken from the checkpoint unless given; a different value is a reported change
  recorded,  // written for the record, never taken back (--init: a resumed run's weights are the checkpoint's)
  fresh,     // this invocation's alone, never written (--resume, --stop-after, --overwrite)
};

using field_ref = std::variant<std::string*, int*, std::int64_t*, double*, bool*, std::uint64_t*,
                               std::optional<double>*, std::optional<std::int64_t>*>;

// Where an option's value came from, lowest first.
enum class value_source : std::uint8_t { demo_default, fine_tune_default, derived, checkpoint, file, flag };
const char* source_name(value_source source);

struct option_row {
  const char* flag;  // "--lr"
  const char* key;   // "optimizer.lr"
  field_ref (*field)(run_config&);
  const char* help;
  unsigned commands = for_train;
  on_resume resume = on_resume::changes;
  bool path = false;     // stored resolved (absolute), so that a resume works from any directory
  bool switch_ = false;  // takes no value on the command line (--overlap-comm)
};

// The table, in the order the resolved configuration is printed.
const std::vector<option_row>& option_rows();
// The row of a flag ("--lr") or key ("optimizer.lr"), or nullptr.
const option_row* find_row(const std::string& flag_or_key);

// "upipe 0.4.0 (...)": the version, the build type and the backends compiled in.
std::string version_text();

// The closest of `candidates` to `word` (edit distance at most a third of its length, at
// least 2), or "".
std::string closest(const std::string& word, const std::vector<std::string>& candidates);

// An option's value as TOML writes it ("0.0003", "\"data/q3\"", "true"), or "" when unset.
std::string value_text(run_config& config, const option_row& row);

// The options of one command line: the rows a command registers and, once parsed, where
// each value came from. Register (constructor), let CLI11 parse, then layer the sources.
class run_options {
 public:
  // Registers every row for `command` on `app`, bound to config(), and --config-file.
  run_options(CLI::App& app, unsigned command);

  run_config& config() { return config_; }
  unsigned command() const { return command_; }
  const std::vector<const option_row*>& rows() const { return rows_; }
  bool takes(const option_row& row) const { return (row.commands & command_) != 0; }
  // The option's source: flag, file, checkpoint, or a default.
  value_source source(const option_row& row) const;
  bool set_anywhere(const char* key) const;  // given by a flag, the file or the checkpoint

  // Call once after parsing: the flags' sources, then the --config-file under them. Throws
  // config_error naming the file, the line, the key and the rule.
  void apply_flags_and_file();
  // train --resume: the checkpoint's configuration (its run.toml text) under the file and
  // the flags; a kept option given otherwise is refused, a changed one reported (returned as
  // notes). `origin` names the file in messages.
  std::vector<std::string> apply_stored(const std::string& stored_text, const std::string& origin);
  // Sets an option that no source gave (a default of the fine-tune set, or a value derived
  // from others). Returns false, changing nothing, when a source gave it.
  template <class T>
  bool set_default(const char* key, T value, value_source source) {
    const option_row* row = find_row(key);
    if (row == nullptr || set_anywhere(key)) return false;
    *std::get<T*>(row->field(config_)) = value;
    sources_[row->key] = source;
    return true;
  }
  // Paths resolved to absolute, so that the stored configuration works from anywhere.
  void resolve_paths();

  // The resolved configuration as TOML; with `sources`, each value's source as a comment.
  // Rows that a resume never takes back (fresh) are left out.
  std::string toml(bool sources);
  // A config_error's text, plus where its flag's value came from when not a flag.
  std::string explain(const std::string& message) const;

 private:
  CLI::App& app_;
  unsigned command_;
  run_config config_;
  std::string config_file_;
  std::vector<const option_row*> rows_;
  std::map<std::string, CLI::Option*> options_;   // by key
  std::map<std::string, value_source> sources_;   // by key, for values not at the demo default
};

// Reads TOML text into `config`: every key must be a row's (unknown keys are refused naming
// the closest) and of its type. Returns the keys read. Throws config_error naming `origin`,
// the line and the key.
std::set<std::string> read_toml(const std::string& text, const std::string& origin, run_config& config);

}  // namespace upipe::apps
