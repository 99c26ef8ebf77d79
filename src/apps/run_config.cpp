#include "apps/run_config.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <limits>
#include <sstream>

#include <toml++/toml.h>

#include "apps/sizes.hpp"
#include "core/error.hpp"
#include "train/data_reader.hpp"
#include "core/files.hpp"
#include "cp/strategy_table.hpp"

namespace upipe::apps {

namespace {

constexpr unsigned model_commands = for_train | for_step | for_eval | for_bench | for_plan;
constexpr unsigned run_commands = for_train | for_step | for_eval | for_bench;  // those that run ranks

#define UPIPE_FIELD(name) [](run_config& c) -> field_ref { return &c.name; }

std::vector<option_row> make_rows() {
  using r = on_resume;
  return {
      // [model]
      {"--model", "model.model", UPIPE_FIELD(model),
       "preset (upipe model-config --list) or a Hugging Face model directory (config.json and safetensors weights, "
       "one file or shards); a run directory of checkpoints means its latest",
       model_commands, r::kept, true},
      {"--config", "model.config", UPIPE_FIELD(config), "a Hugging Face config.json (or its directory) instead of --model",
       model_commands, r::kept, true},
      {"--layers", "model.layers", UPIPE_FIELD(layers), "a slice: the first N layers only", model_commands, r::kept},
      {"--init", "model.init", UPIPE_FIELD(init),
       "weights to start from: a model directory (one file or shards) or a .safetensors file (default: the --model "
       "directory's weights, else random)",
       for_train, r::recorded, true},
      {"--lora", "model.lora", UPIPE_FIELD(lora),
       "train LoRA adapters on a frozen base: r=N[,alpha=A][,targets=q,k,v,o,gate,up,down][,dropout=0] (alpha "
       "defaults to r, targets to all seven projections); saves a PEFT adapter directory",
       for_train | for_step | for_bench | for_plan, r::kept},
      {"--router-aux-loss", "model.router_aux_loss", UPIPE_FIELD(router_aux_loss),
       "a mixture of experts' load-balancing loss (router_aux_loss_coef x transformers' load_balancing_loss_func) in "
       "the loss: config (as config.json's output_router_logits says), on or off",
       for_train | for_step, r::kept},
      {"--init-adapter", "model.init_adapter", UPIPE_FIELD(init_adapter),
       "LoRA: continue from this adapter directory (upipe's --save or PEFT's save_pretrained); its "
       "adapter_config.json gives --lora",
       for_train, r::recorded, true},
      {"--rope-theta", "model.rope_theta", UPIPE_FIELD(rope_theta), "RoPE base (the model's unless given)", for_train,
       r::changes},
      {"--rope-scaling", "model.rope_scaling", UPIPE_FIELD(rope_scaling),
       "RoPE scaling as transformers computes it: type=llama3|linear|yarn|default then key=value pairs (factor, "
       "original_max_position_embeddings, low_freq_factor, high_freq_factor, beta_fast, beta_slow, mscale, "
       "mscale_all_dim, attention_factor, truncate), e.g. type=yarn,factor=4 (replaces the model's, said aloud)",
       for_train, r::changes},
      {"--max-position-embeddings", "model.max_position_embeddings", UPIPE_FIELD(max_position_embeddings),
       "the context the saved config declares (default: the model's, or the extended one)", for_train, r::changes},
      // [data]
      {"--data", "data.data", UPIPE_FIELD(data),
       "a corpus PREFIX from upipe prepare-data (PREFIX.tokens, .index, .json, and .mask for chat data), a flat "
       "little-endian uint32 token file, or a mixture by weight, A:0.7,B:0.3 (default: the synthetic passkey task; "
       "eval: several sources, comma-separated, each scored)",
       for_train | for_eval, r::kept, true},
      {"--packing", "data.packing", UPIPE_FIELD(packing),
       "documents (attention masked and positions restarted at each document; the default with an index) or stream",
       for_train | for_eval, r::kept},
      {"--min-doc-tokens", "data.min_doc_tokens", UPIPE_FIELD(min_doc_tokens),
       "leave out documents shorter than this (a long-context mix)", for_train, r::kept},
      {"--seq-len", "data.seq_len", UPIPE_FIELD(seq_len),
       "tokens per sequence (K and M suffixes; fine-tune default: the model's context up to 4K)", for_train | for_step,
       r::changes},
      {"--batch", "data.batch", UPIPE_FIELD(batch),
       "sequences per optimizer step, gradients accumulated (default: 4 on the passkey task, 1 with --data)",
       for_train, r::changes},
      {"--seq-warmup", "data.seq_warmup", UPIPE_FIELD(seq_warmup),
       "steps trained on short sequences before --seq-len (default: 9/10 of --steps on the passkey task, 0 with "
       "--data)",
       for_train, r::changes},
      {"--seq-warmup-start", "data.seq_warmup_start", UPIPE_FIELD(seq_warmup_start),
       "tokens per sequence during --seq-warmup (default: a quarter of --seq-len)", for_train, r::changes},
      {"--epochs", "data.epochs", UPIPE_FIELD(epochs),
       "passes over --data that set --steps (fine-tune default 1; the demo counts --steps)", for_train, r::recorded},
      {"--allow-tokenizer-mismatch", "data.allow_tokenizer_mismatch", UPIPE_FIELD(allow_tokenizer_mismatch),
       "train on data tokenized with another tokenizer than the model directory's (refused otherwise)", for_train,
       r::changes, false, true},
      // [eval]
      {"--eval-every", "eval.every", UPIPE_FIELD(eval_every),
       "held-out loss every N steps (and at the last), into the metrics", for_train, r::changes},
      {"--eval-data", "eval.data", UPIPE_FIELD(eval_data),
       "held-out data for --eval-every: corpus PREFIXes or token files, comma-separated, each evaluated", for_train,
       r::changes, true},
      {"--eval-sequences", "eval.sequences", UPIPE_FIELD(eval_sequences), "held-out sequences per evaluation",
       for_train, r::changes},
      {"--eval-samples", "eval.samples", UPIPE_FIELD(eval_samples),
       "held-out passkey samples for the retrieval accuracy", for_train, r::changes},
      // [parallel]
      {"--attention", "parallel.attention", UPIPE_FIELD(attention),
       "the CP strategy (its help is the strategy table's: cp/strategy_table.hpp)",
       for_train | for_step | for_eval, r::changes},
      {"--cp", "parallel.cp", UPIPE_FIELD(cp),
       "ranks in the CP group (threads on the cpu backend, virtual ranks on one GPU)",
       run_commands & ~for_bench, r::changes},
      {"--head-chunk", "parallel.head_chunk", UPIPE_FIELD(head_chunk),
       "U, query heads per stage: upipe (default C), hybrid (a multiple of C / R; default H, Ulysses inside)",
       for_train | for_step | for_eval, r::changes},
      {"--ring", "parallel.ring", UPIPE_FIELD(ring), "hybrid: R, the ring of all-to-all groups (R divides C)",
       for_train | for_step | for_eval, r::changes},
      {"--seq-chunks", "parallel.seq_chunks", UPIPE_FIELD(seq_chunks),
       "N sequence chunks for upipe, ulysses and fpdt: the attention holds S / N tokens at a time, earlier chunks' "
       "K/V in host memory (0: 1, fpdt chunks of 64K tokens)",
       for_train | for_step | for_eval, r::changes},
      {"--dp", "parallel.dp", UPIPE_FIELD(dp),
       "data-parallel replicas, each a CP group of --cp ranks reading its own --batch sequences (D x C ranks in all, "
       "ZeRO over every one; a step takes dp x batch sequences)",
       for_train, r::changes},
      {"--gpus-per-node", "parallel.gpus_per_node", UPIPE_FIELD(gpus_per_node),
       "GPUs per node, for the mesh's placement check: a CP group inside a node or over whole nodes (0: every rank "
       "on one node)",
       for_train, r::changes},
      {"--zero", "parallel.zero", UPIPE_FIELD(zero), "2: shard optimizer state and gradients; 3: shard weights too",
       for_train | for_bench | for_plan, r::changes},
      {"--comm", "parallel.comm", UPIPE_FIELD(comm),
       "how ranks talk: auto (NCCL with a GPU per rank, else threads), threads, nccl", for_train | for_bench,
       r::changes},
      {"--comm-timeout", "parallel.comm_timeout", UPIPE_FIELD(comm_timeout),
       "seconds before a stuck collective aborts every rank (NCCL)", for_train | for_bench, r::changes},
      {"--overlap-comm", "parallel.overlap_comm", UPIPE_FIELD(overlap_comm),
       "keep each attention stage's output all-to-all in flight while the next stage projects (NCCL)",
       for_train | for_bench, r::changes, false, true},
      {"--prefetch-weights", "parallel.prefetch_weights", UPIPE_FIELD(prefetch_weights),
       "ZeRO-3: gather the next layer's weights while this layer computes", for_train | for_bench, r::changes, false,
       true},
      // [optimizer]
      {"--steps", "optimizer.steps", UPIPE_FIELD(steps),
       "length of the learning-rate schedule (fine-tune default: --epochs over --data)", for_train, r::changes},
      {"--stop-after", "optimizer.stop_after", UPIPE_FIELD(stop_after),
       "stop once this step is done (the schedule stays --steps long)", for_train, r::fresh},
      {"--lr", "optimizer.lr", UPIPE_FIELD(lr), "peak learning rate (fine-tune default 2e-5, 2e-4 with --lora)",
       for_train, r::changes},
      {"--warmup", "optimizer.warmup", UPIPE_FIELD(warmup), "linear warmup steps (or --warmup-ratio)", for_train,
       r::changes},
      {"--warmup-ratio", "optimizer.warmup_ratio", UPIPE_FIELD(warmup_ratio),
       "linear warmup as a fraction of --steps (fine-tune default 0.03); replaces --warmup", for_train, r::changes},
      {"--min-lr-ratio", "optimizer.min_lr_ratio", UPIPE_FIELD(min_lr_ratio),
       "the cosine decays to lr x this at --steps (fine-tune default 0)", for_train, r::changes},
      {"--weight-decay", "optimizer.weight_decay", UPIPE_FIELD(weight_decay), "AdamW weight decay on matrices",
       for_train, r::changes},
      {"--max-grad-norm", "optimizer.max_grad_norm", UPIPE_FIELD(max_grad_norm), "global-norm clipping (0: off)",
       for_train, r::changes},
      {"--seed", "optimizer.seed", UPIPE_FIELD(seed), "seed of the initialization and the data",
       model_commands & ~for_plan, r::kept},
      {"--optimizer-state", "optimizer.state", UPIPE_FIELD(optimizer_state),
       "AdamW's moments: fp32, bf16 (round to nearest even), or 8bit (block-wise quantized, 256 a block with an f32 "
       "absmax each, bitsandbytes' AdamW8bit); a resume in another format needs --convert-optimizer-state",
       for_train, r::changes},
      {"--master-weights", "optimizer.master_weights", UPIPE_FIELD(master_weights),
       "fp32, or bf16-kahan: the bf16 weights are the master, a bf16 compensation keeps what rounding lost (4 bytes a "
       "parameter instead of 6 on the GPU)",
       for_train, r::changes},
      {"--grad-dtype", "optimizer.grad_dtype", UPIPE_FIELD(grad_dtype),
       "the gradient shards kept for the norm or a later micro-batch: fp32 or bf16 (none are kept without clipping "
       "at --batch 1)",
       for_train, r::changes},
      {"--convert-optimizer-state", "optimizer.convert_state", UPIPE_FIELD(convert_optimizer_state),
       "--resume from a checkpoint of another state format: decode it to fp32 and encode it in this run's (else "
       "refused)",
       for_train, r::fresh, false, true},
      // [checkpoint]
      {"--save", "checkpoint.save", UPIPE_FIELD(save),
       "the run directory: checkpoints DIR/checkpoint-STEP (Hugging Face model directories with the trainer state in "
       "trainer/), DIR/latest naming the newest",
       for_train, r::changes, true},
      {"--save-every", "checkpoint.save_every", UPIPE_FIELD(save_every), "also save every N steps", for_train,
       r::changes},
      {"--keep-last", "checkpoint.keep_last", UPIPE_FIELD(keep_last),
       "keep the newest N checkpoints of the run, removing older ones after each save (0: keep all)", for_train,
       r::changes},
      {"--keep-best", "checkpoint.keep_best", UPIPE_FIELD(keep_best),
       "with --eval-every: also keep the checkpoint of the lowest held-out loss (DIR/best names it)", for_train,
       r::changes, false, true},
      {"--overwrite", "checkpoint.overwrite", UPIPE_FIELD(overwrite),
       "let --save replace another run's checkpoints in DIR (removed once this run's first save is complete)",
       for_train, r::fresh, false, true},
      {"--save-dtype", "checkpoint.save_dtype", UPIPE_FIELD(save_dtype), "dtype of the saved weights: bf16 or fp32",
       for_train, r::changes},
      {"--max-shard-size", "checkpoint.max_shard_size", UPIPE_FIELD(max_shard_size),
       "largest weight file of a save (bytes, or KB/MB/GB)", for_train, r::changes},
      {"--resume", "checkpoint.resume", UPIPE_FIELD(resume),
       "continue a run: a checkpoint, or a run directory (its latest); every option not given again is the "
       "checkpoint's, at any --cp and --zero (the state is resharded)",
       for_train, r::fresh, true},
      // [system]
      {"--backend", "system.backend", UPIPE_FIELD(backend), "cpu, cuda (bf16, virtual ranks on one GPU) or meta",
       model_commands & ~for_plan, r::changes},
      {"--memory-gib", "system.memory_gib", UPIPE_FIELD(memory_gib), "arena per rank (cpu or GPU memory), GiB",
       run_commands, r::changes},
      {"--host-memory-gib", "system.host_memory_gib", UPIPE_FIELD(host_memory_gib), host_memory_gib_help,
       for_train | for_step | for_bench, r::changes},
      {"--offload", "system.offload", UPIPE_FIELD(offload), offload_help, for_train, r::changes},  // plan's adds auto
      {"--checkpoint-policy", "system.checkpoint_policy", UPIPE_FIELD(checkpoint_policy),
       "auto (the planner's fastest that fits --memory-gib and --host-memory-gib) or "
       "what=input|input+attention,every=K,where=device|host-pinned|host-pageable",
       for_train | for_step | for_bench | for_plan, r::changes},
      {"--mlp-tile", "system.mlp_tile", UPIPE_FIELD(mlp_tile), mlp_tile_help, model_commands, r::changes},
      {"--loss-chunk", "system.loss_chunk", UPIPE_FIELD(loss_chunk), loss_chunk_help, model_commands, r::changes},
      // [metrics]
      {"--metrics-json", "metrics.json", UPIPE_FIELD(metrics_json),
       "one JSON object per step (with its time), then a final one; appended to on --resume", for_train, r::changes,
       true},
  };
}

#undef UPIPE_FIELD

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// The shortest text that reads back as the same double.
std::string real_text(double v) {
  char buffer[64];
  const auto [end, ec] = std::to_chars(buffer, buffer + sizeof buffer, v, std::chars_format::general);
  std::string t(buffer, ec == std::errc() ? end : buffer);
  // TOML needs a fraction or an exponent in a float.
  if (t.find_first_of(".eEn") == std::string::npos) t += ".0";
  return t;
}

std::string toml_string(const std::string& s) {
  std::ostringstream out;
  out << toml::value<std::string>(s);
  return out.str();
}

// The line of a TOML node, for messages.
std::string where(const std::string& origin, const toml::node& node) {
  const auto& begin = node.source().begin;
  return origin + (begin.line > 0 ? ":" + std::to_string(begin.line) : std::string());
}

// Sets a field from a TOML value of its type; config_error naming the key otherwise.
void set_field(const field_ref& field, const toml::node& node, const std::string& key, const std::string& at) {
  const auto refuse = [&](const char* expected) {
    throw config_error(at + ": " + key + " must be " + expected + " (as the flag " + find_row(key)->flag +
                       " takes it)");
  };
  const auto integer = [&](std::int64_t lo, std::int64_t hi) -> std::int64_t {
    const auto v = node.value_exact<std::int64_t>();
    if (!v) refuse("a whole number");
    if (*v < lo || *v > hi)
      throw config_error(at + ": " + key + " = " + std::to_string(*v) + " lies outside [" + std::to_string(lo) + ", " +
                         std::to_string(hi) + "]");
    return *v;
  };
  const auto real = [&]() -> double {
    const auto v = node.value<double>();  // an integer is a number too
    if (!v || !std::isfinite(*v)) refuse("a finite number");
    return *v;
  };
  std::visit(
      [&](auto* target) {
        using T = std::remove_pointer_t<decltype(target)>;
        if constexpr (std::is_same_v<T, std::string>) {
          // Counts and sizes may be written as numbers too: seq_len = 131072.
          if (const auto s = node.value_exact<std::string>())
            *target = *s;
          else if (const auto n = node.value_exact<std::int64_t>())
            *target = std::to_string(*n);
          else
            refuse("a string");
          if (target->empty()) refuse("a non-empty string (leave the key out for the default)");
        } else if constexpr (std::is_same_v<T, bool>) {
          const auto v = node.value_exact<bool>();
          if (!v) refuse("true or false");
          *target = *v;
        } else if constexpr (std::is_same_v<T, int>) {
          *target = static_cast<int>(integer(std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
        } else if constexpr (std::is_same_v<T, std::int64_t>) {
          *target = integer(std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max());
        } else if constexpr (std::is_same_v<T, std::uint64_t>) {
          *target = static_cast<std::uint64_t>(integer(0, std::numeric_limits<std::int64_t>::max()));
        } else if constexpr (std::is_same_v<T, double> || std::is_same_v<T, std::optional<double>>) {
          *target = real();
        } else {
          *target = integer(std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max());
        }
      },
      field);
}

std::vector<std::string> every_key() {
  std::vector<std::string> keys;
  for (const option_row& row : option_rows()) keys.emplace_back(row.key);
  return keys;
}

// Copies one option from `from` into `to`.
void copy_field(const option_row& row, run_config& from, run_config& to) {
  std::visit(
      [&](auto* target) {
        using P = std::remove_cvref_t<decltype(target)>;
        *target = *std::get<P>(row.field(from));
      },
      row.field(to));
}

}  // namespace

std::string version_text() {
  std::string text = std::string("upipe ") + UPIPE_VERSION;
#ifdef UPIPE_HAVE_CUDA
  text += " (backends: cpu, meta, cuda";
#else
  text += " (backends: cpu, meta";
#endif
#ifdef NDEBUG
  text += "; release build)";
#else
  text += "; debug build)";
#endif
  return text;
}

const char* source_name(value_source source) {
  switch (source) {
    case value_source::demo_default: return "default";
    case value_source::fine_tune_default: return "fine-tune default";
    case value_source::derived: return "derived";
    case value_source::checkpoint: return "checkpoint";
    case value_source::file: return "config file";
    case value_source::flag: return "flag";
  }
  return "?";
}

const std::vector<option_row>& option_rows() {
  static const std::vector<option_row> rows = make_rows();
  return rows;
}

const option_row* find_row(const std::string& name) {
  for (const option_row& row : option_rows())
    if (name == row.flag || name == row.key) return &row;
  return nullptr;
}

std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  std::size_t best_distance = std::max<std::size_t>(2, word.size() / 3) + 1;
  for (const std::string& c : candidates) {
    const std::size_t d = edit_distance(word, c);
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  return best;
}

std::string value_text(run_config& config, const option_row& row) {
  return std::visit(
      [](auto* v) -> std::string {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return v->empty() ? std::string() : toml_string(*v);
        } else if constexpr (std::is_same_v<T, bool>) {
          return *v ? "true" : "false";
        } else if constexpr (std::is_same_v<T, double>) {
          return real_text(*v);
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          return *v ? real_text(**v) : std::string();
        } else if constexpr (std::is_same_v<T, std::optional<std::int64_t>>) {
          return *v ? std::to_string(**v) : std::string();
        } else {
          return std::to_string(*v);
        }
      },
      row.field(config));
}

std::set<std::string> read_toml(const std::string& text, const std::string& origin, run_config& config) {
  toml::table table;
  try {
    table = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    throw config_error(origin + ":" + std::to_string(e.source().begin.line) + ":" +
                       std::to_string(e.source().begin.column) + ": not valid TOML: " + std::string(e.description()));
  }
  std::set<std::string> keys;
  for (const auto& [section, node] : table) {
    const std::string name(section.str());
    const toml::table* inner = node.as_table();
    if (inner == nullptr)
      throw config_error(where(origin, node) + ": '" + name + "' must be a section ([model], [data], [eval], "
                         "[parallel], [optimizer], [checkpoint], [system], [metrics]) holding keys");
    for (const auto& [k, value] : *inner) {
      const std::string key = name + "." + std::string(k.str());
      const option_row* row = find_row(key);
      if (row == nullptr || key.find('.') != key.rfind('.')) {
        const std::string near = closest(key, every_key());
        throw config_error(where(origin, value) + ": '" + key + "' is not an option" +
                           (near.empty() ? std::string() : "; did you mean '" + near + "'?") +
                           " (upipe train --print-config shows every key)");
      }
      set_field(row->field(config), value, key, where(origin, value));
      keys.insert(key);
    }
  }
  return keys;
}

// The defaults a command keeps where they differ from train's (shown by its --help).
void command_defaults(run_config& c, unsigned command) {
  if (command == for_train || command == for_eval) c.model.clear();  // from --resume, --init or the adapter; else tiny-llama
  if (command == for_plan) c.model = "llama3-8b";
  if (command == for_plan || command == for_bench) c.zero = 3;
  if (command == for_step) c.seq_len = "256";
  if (command == for_eval) c.cp = 1;
}

run_options::run_options(CLI::App& app, unsigned command) : app_(app), command_(command) {
  command_defaults(config_, command);
  for (const option_row& row : option_rows()) {
    if (!takes(row)) continue;
    rows_.push_back(&row);
    CLI::Option* opt = std::visit(
        [&](auto* target) -> CLI::Option* {
          using T = std::remove_pointer_t<decltype(target)>;
          if constexpr (std::is_same_v<T, bool>)
            return app.add_flag(row.flag, *target, row.help);
          else
            return app.add_option(row.flag, *target, row.help);
        },
        row.field(config_));
    if (!row.switch_) opt->capture_default_str();
    // The strategies' help is their table's (cp/strategy_table.hpp), so a new row shows.
    if (std::string_view(row.key) == "parallel.attention") opt->description("the CP strategy: " + strategy_help());
    options_[row.key] = opt;
  }
  app.add_option("--config-file", config_file_,
                 "a TOML file of options ([model] model = ..., [optimizer] lr = ...; upipe train --print-config "
                 "writes one); flags override it");
}

value_source run_options::source(const option_row& row) const {
  const auto it = sources_.find(row.key);
  return it == sources_.end() ? value_source::demo_default : it->second;
}

bool run_options::set_anywhere(const char* key) const {
  const auto it = sources_.find(key);
  return it != sources_.end() &&
         (it->second == value_source::flag || it->second == value_source::file || it->second == value_source::checkpoint);
}

void run_options::apply_flags_and_file() {
  for (const option_row* row : rows_)
    if (options_.at(row->key)->count() > 0) sources_[row->key] = value_source::flag;
  if (config_file_.empty()) return;
  run_config from_file;
  const std::string text = read_text_file(config_file_, "--config-file");
  for (const std::string& key : read_toml(text, config_file_, from_file)) {
    const option_row& row = *find_row(key);
    if (!takes(row) || source(row) == value_source::flag) continue;  // another command's key, or a flag over it
    copy_field(row, from_file, config_);
    sources_[row.key] = value_source::file;
  }
}

std::vector<std::string> run_options::apply_stored(const std::string& stored_text, const std::string& origin) {
  run_config stored;
  const std::set<std::string> keys = read_toml(stored_text, origin, stored);
  std::vector<std::string> notes;
  for (const option_row* row : rows_) {
    if (row->resume == on_resume::fresh || row->resume == on_resume::recorded) continue;
    const std::string was = keys.count(row->key) ? value_text(stored, *row) : std::string();
    if (!set_anywhere(row->key)) {
      copy_field(*row, stored, config_);
      sources_[row->key] = value_source::checkpoint;
      continue;
    }
    const std::string now = value_text(config_, *row);
    if (now == was) continue;
    const std::string shown = was.empty() ? "unset" : was;
    if (row->resume == on_resume::kept)
      throw config_error(std::string(row->flag) + " " + (now.empty() ? "(unset)" : now) + " differs from the run in " +
                         origin + ", which has " + row->key + " = " + shown + ": a resumed run continues that run; "
                         "drop " + row->flag + " (or give the stored value), or start a new run from its weights "
                         "with --init");
    notes.push_back(std::string(row->key) + ": " + shown + " -> " + (now.empty() ? "unset" : now) + " (" +
                    source_name(source(*row)) + ")");
  }
  return notes;
}

// --data and --eval-data list sources, each PATH or PATH:WEIGHT: each path resolved alone.
std::string absolute_data_sources(const std::string& text, const char* flag) {
  std::string out;
  for (data_source_spec source : parse_data_sources(text, flag)) {
    std::error_code ec;
    const auto absolute = std::filesystem::absolute(source.path, ec);
    if (!ec) source.path = absolute.lexically_normal().string();
    while (source.path.size() > 1 && source.path.back() == '/') source.path.pop_back();
    out += (out.empty() ? "" : ",") + data_source_text(source);
  }
  return out;
}

void run_options::resolve_paths() {
  for (const option_row* row : rows_) {
    if (!row->path) continue;
    std::string& value = *std::get<std::string*>(row->field(config_));
    if (row->key == std::string("data.data") || row->key == std::string("eval.data")) {
      value = absolute_data_sources(value, row->flag);
      continue;
    }
    // A preset's name stays a name.
    if (value.empty() || (row->key == std::string("model.model") && value.find('/') == std::string::npos &&
                          !std::filesystem::exists(value)))
      continue;
    std::error_code ec;
    const auto absolute = std::filesystem::absolute(value, ec);
    if (!ec) value = absolute.lexically_normal().string();
    while (value.size() > 1 && value.back() == '/') value.pop_back();
  }
}

std::string run_options::toml(bool with_sources) {
  std::ostringstream out;
  std::string section;
  for (const option_row* row : rows_) {
    if (row->resume == on_resume::fresh) continue;
    const std::string value = value_text(config_, *row);
    if (value.empty()) continue;
    const std::string key = row->key, head = key.substr(0, key.find('.'));
    if (head != section) {
      out << (section.empty() ? "" : "\n") << "[" << head << "]\n";
      section = head;
    }
    out << key.substr(key.find('.') + 1) << " = " << value;
    if (with_sources && source(*row) != value_source::demo_default) out << "  # " << source_name(source(*row));
    out << "\n";
  }
  return out.str();
}

std::string run_options::explain(const std::string& message) const {
  for (const option_row* row : rows_) {
    const value_source s = source(*row);
    if (s != value_source::file && s != value_source::checkpoint) continue;
    const std::string flag = std::string(row->flag) + " ";
    if (message.find(flag) == std::string::npos) continue;
    return message + " (" + row->flag + " came from " +
           (s == value_source::file ? "--config-file " + config_file_ + ", key " + row->key
                                    : std::string("the checkpoint's configuration, key ") + row->key) +
           ")";
  }
  return message;
}

}  // namespace upipe::apps
