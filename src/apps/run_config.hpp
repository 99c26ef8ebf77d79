// One run configuration: every option of `upipe train` declared once, as a row of one
// table (its flag, its key in a TOML config file, its default, its help, which commands
// take it and what a resume may do with it). `train` takes them all; step, eval, bench and
// plan register the rows they share. A value comes from, lowest first: the defaults (the
// demo's, or a fine-tune's when the run starts from pretrained weights), the checkpoint a
// --resume names, a --config-file, the flags. The resolved configuration is printed at the
// start and written into every checkpoint (trainer/run.toml).
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
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
  std::string head_chunk = "auto";
  int cp = 4, ring = 1, seq_chunks = 0, zero = 2, dp = 1, gpus_per_node = 0;
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
  std::string backend = "cpu", offload = "none", checkpoint_policy = "auto", attention_dtype = "bf16";
  std::int64_t mlp_tile = 0, loss_chunk = 0;
  double memory_gib = 8, host_memory_gib = 0;
  std::string moe_gemm = "grouped";
  double moe_capacity_factor = 0;
  // [metrics]
  std::string metrics_json;
};

// Which commands take an option.
enum command_set : unsigned { for_train = 1, for_step = 2, for_eval = 4, for_bench = 8, for_plan = 16 };

// What `train --resume DIR` does with an option that the checkpoint's configuration holds.
enum class on_resume : std::uint8_t {
  kept,      // the same run: taken from the checkpoint, and a different value is refused naming the stored one
  changes,   // taken from the checkpoint unless given; a different value is a reported change
  recorded,  // written for the record, never taken back (--epochs: the steps are stored)
  base,      // --init: recorded for a full run (its weights are the checkpoint's); kept for a LoRA run (its frozen base)
  fresh,     // this invocation's alone, never written (--resume, --stop-after, --overwrite)
};

using field_ref = std::variant<std::string*, int*, std::int64_t*, double*, bool*, std::uint64_t*,
                               std::optional<double>*, std::optional<std::int64_t>*>;

// Where an option's value came from, lowest first.
enum class value_source : std::uint8_t { demo_default, fine_tune_default, derived, checkpoint, file, flag };
const char* source_name(value_source source);

// What a row's value must be, checked once, where it is read (a flag, a --config-file, a
// checkpoint's run.toml), and refused naming the value, its source, the rule and an example
// (check_value). Numbers: a range; strings: the words they take or a parser that throws
// config_error naming what it wants. A path row is also held to what a path can be.
struct value_rule {
  double lo = -HUGE_VAL, hi = HUGE_VAL;  // a number's range, inclusive ...
  bool above = false;                    // ... but above lo, not at it: (lo, hi]
  bool minus_one = false;                // -1 also taken: the run chooses (--batch, --seq-warmup)
  const char* words = nullptr;           // the only values taken, "auto, documents, stream"
  void (*parse)(const std::string& value) = nullptr;  // throws config_error naming the rule
  const char* example = "";              // a valid value, as a flag takes it
};

struct option_row {
  const char* flag;  // "--lr"
  const char* key;   // "optimizer.lr"
  field_ref (*field)(run_config&);
  value_rule rule;
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
// "train, step and bench": the commands of a command_set, for messages.
std::string command_names(unsigned commands);
// The command of one command_set bit ("train").
const char* command_name(unsigned command);

// "upipe 0.4.0 (...)": the version, the build type and the backends compiled in.
std::string version_text();

// The closest of `candidates` to `word` (edit distance at most a third of its length, at
// least 2), or "".
std::string closest(const std::string& word, const std::vector<std::string>& candidates);

// An option's value as TOML writes it ("0.0003", "\"data/q3\"", "true"), or "" when unset.
std::string value_text(run_config& config, const option_row& row);

// How the resolved configuration is written: for the record (trainer/run.toml in every
// checkpoint: every value a resume may take back), or printed (train --print-config and the
// start of a run: a --config-file that gives the same run, each value's source beside it,
// derived values as comments, since loading the file derives them again).
enum class toml_use : std::uint8_t { record, print };

// The options of one command line: the rows a command registers and, once parsed, where
// each value came from. Register (constructor), let CLI11 parse, then run(): the sources
// layered and every value checked before the command's body runs.
class run_options {
 public:
  // Registers every row for `command` on `app`, bound to config(), and --config-file.
  run_options(CLI::App& app, unsigned command);

  run_config& config() { return config_; }
  const run_config& config() const { return config_; }
  unsigned command() const { return command_; }
  const std::vector<const option_row*>& rows() const { return rows_; }
  bool takes(const option_row& row) const { return (row.commands & command_) != 0; }
  // Whether a --config-file may give the row: the command's rows, and for plan, which plans
  // a train run, train's too (carried into the train command it prints).
  bool reads_from_file(const option_row& row) const;
  // Whether the --config-file gave the row (plan: a train row it has no flag for).
  bool from_file(const char* key) const;
  // The option's source: flag, file, checkpoint, or a default.
  value_source source(const option_row& row) const;
  bool set_anywhere(const char* key) const;  // given by a flag, the file or the checkpoint
  bool from_user(const char* key) const;     // given by a flag or the file (this invocation)

  // The flags' sources, then the --config-file under them, every value given checked by its
  // row's rule, and a key the command does not take refused. Throws config_error naming the
  // file, the line, the key and the rule.
  void apply_flags_and_file();
  // apply_flags_and_file(), then the command's body; a config_error it throws about a value
  // from the file or a checkpoint is completed with where that value came from (explain).
  int run(const std::function<int()>& body);
  // train --resume: the checkpoint's configuration (its run.toml text) under the file and
  // the flags; a kept option given otherwise is refused, a changed one reported (returned as
  // notes). `origin` names the file in messages; `adapters`: a LoRA run's checkpoint.
  // `run_directory` is the run directory the checkpoint lies in now ("" for one outside a
  // run directory): the stored paths inside the run directory it was saved into follow it
  // there (a copied run directory is a run of its own), and a checkpoint outside one saves
  // only where --save says.
  std::vector<std::string> apply_stored(const std::string& stored_text, const std::string& origin, bool adapters,
                                        const std::string& run_directory);
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
  // Sets a value the run derives from others (--steps from --epochs), whatever gave it
  // before, unless this invocation's flags or file did.
  template <class T>
  void set_derived(const char* key, T value) {
    const option_row* row = find_row(key);
    if (row == nullptr || from_user(key)) return;
    *std::get<T*>(row->field(config_)) = value;
    sources_[row->key] = value_source::derived;
  }
  // Paths resolved to absolute, so that the stored configuration works from anywhere.
  void resolve_paths();

  // The resolved configuration as TOML (toml_use says which rows and how).
  std::string toml(toml_use use);
  // A config_error's text, plus where its flag's value came from when not a flag.
  std::string explain(const std::string& message) const;

 private:
  void check_given_values();

  CLI::App& app_;
  unsigned command_;
  run_config config_;
  std::string config_file_;
  std::vector<const option_row*> rows_;
  std::map<std::string, CLI::Option*> options_;   // by key
  std::map<std::string, value_source> sources_;   // by key, for values not at the demo default
  std::map<std::string, std::string> origins_;    // by key: "FILE:LINE" of a value from a file or checkpoint
};

// Reads TOML text into `config`: every key must be a row's (unknown keys are refused naming
// the closest) and of its type. Returns the keys read, each with its line. Throws
// config_error naming `origin`, the line and the key.
std::map<std::string, int> read_toml(const std::string& text, const std::string& origin, run_config& config);

// Holds a row's value to the row's rule (and a path row's to what a path can be); throws
// config_error naming the value and `where` it came from: "" for a flag (the message then
// reads "--lr 0 must ..."), else "FILE:LINE" (it reads "FILE:LINE: optimizer.lr = 0.0 must ...").
void check_value(run_config& config, const option_row& row, const std::string& where);

}  // namespace upipe::apps
