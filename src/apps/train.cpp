// `upipe train`: training under context parallelism. With no flags: a tiny Llama learns
// the synthetic passkey task on the CPU, 4 threaded CP ranks, UPipe.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "apps/moe_flags.hpp"
#include "apps/commands.hpp"
#include "apps/flag_checks.hpp"
#include "apps/cp_flags.hpp"
#include "apps/comm_flags.hpp"
#include "apps/model_flags.hpp"
#include "apps/policy_flags.hpp"
#include "apps/run_config.hpp"
#include "apps/sizes.hpp"
#include "apps/state_flags.hpp"
#include "core/error.hpp"
#include "model/adapter_files.hpp"
#include "plan/planner.hpp"
#include "train/data.hpp"
#include "train/data_reader.hpp"
#include "train/mesh.hpp"
#include "train/run_directory.hpp"
#include "train/train_checkpoint.hpp"
#include "train/trainer.hpp"

namespace upipe::apps {

namespace {

// The command's own switch beside the run configuration.
struct train_command {
  std::shared_ptr<run_options> options;
  bool print_config = false;
};

// Exit status of a run stopped by SIGTERM, SIGINT or SIGUSR1 after saving a checkpoint
// (sysexits' EX_TEMPFAIL: try again, with --resume). Without --save, 128 + the signal.
constexpr int exit_stopped_and_saved = 75;

// The first SIGTERM, SIGINT or SIGUSR1 asks the run to stop after the step it is in (every
// rank agrees, then it saves); a second SIGINT ends the process at once.
std::atomic<int> stop_requested{0};
extern "C" void on_stop_signal(int signal) {
  if (signal == SIGINT && stop_requested.load() != 0) ::_exit(128 + SIGINT);
  stop_requested.store(signal);
  const char text[] = "\nupipe: stop requested: finishing this step, then saving (a second Ctrl-C aborts)\n";
  [[maybe_unused]] const auto n = ::write(STDERR_FILENO, text, sizeof text - 1);
}

// The signal handlers for the run, restored when it ends.
class stop_handlers {
 public:
  stop_handlers() {
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    for (std::size_t i = 0; i < std::size(signals_); ++i) ::sigaction(signals_[i], &action, &previous_[i]);
  }
  ~stop_handlers() {
    for (std::size_t i = 0; i < std::size(signals_); ++i) ::sigaction(signals_[i], &previous_[i], nullptr);
  }
  stop_handlers(const stop_handlers&) = delete;
  stop_handlers& operator=(const stop_handlers&) = delete;

 private:
  static constexpr int signals_[] = {SIGTERM, SIGINT, SIGUSR1};
  struct sigaction previous_[3];
};

// The LoRA adapter directory a run continues (--init-adapter, or a LoRA run's --resume), or "".
std::string continued_adapter(const run_config& f) {
  if (!f.init_adapter.empty()) return f.init_adapter;
  return !f.resume.empty() && is_adapter_directory(f.resume) ? f.resume : std::string();
}

// The model: --model or --config as given; with neither, the base a continued adapter
// names, the model a --resume or --init directory holds, else tiny-llama. Returns the
// directory it came from.
std::string choose_model(const run_config& f, model_config& model) {
  std::string from = f.model;
  if (from.empty() && f.config.empty()) {
    if (const std::string adapter = continued_adapter(f); !adapter.empty()) {
      from = adapter_base_model(adapter);
      if (from.empty())
        throw config_error(adapter + "/" + adapter_config_file + " names no base model (base_model_name_or_path): pass "
                           "the base it was trained on as --model");
    } else if (!f.resume.empty() && is_model_directory(f.resume))
      from = f.resume;
    else if (!f.init.empty() && is_model_directory(f.init))
      from = f.init;
    else
      from = "tiny-llama";
  }
  model = load_model(from, f.config, f.layers);
  return model_directory(from, f.config);
}

// LoRA's settings: --lora, or those of the adapter directory the run continues, which a
// --lora given beside it must repeat.
lora_config choose_lora(const run_config& f, const model_config& model) {
  std::optional<lora_config> flag;
  if (!f.lora.empty()) flag = parse_lora(f.lora, model);
  const std::string adapter = continued_adapter(f);
  if (adapter.empty()) return flag.value_or(lora_config{});
  const adapter_settings saved = read_adapter_config(adapter, model);
  if (flag && !(*flag == saved.lora))
    throw config_error("--lora " + lora_text(*flag) + " differs from the adapters in " + adapter + " (" +
                       lora_text(saved.lora) + "); drop --lora to continue them as they are, or start new adapters "
                       "without --init-adapter");
  if (!flag && saved.dropout != 0) {
    std::ostringstream p;
    p << saved.dropout;
    throw config_error(adapter + " was trained with lora_dropout " + p.str() + " and upipe trains without dropout: to "
                       "continue without it, say so with --lora " + lora_text(saved.lora) + ",dropout=0");
  }
  return saved.lora;
}

// Where the run's starting weights come from when they are pretrained (the fine-tune
// defaults then apply), or "".
std::string pretrained_source(const run_config& f) {
  if (!f.init.empty()) return "--init " + f.init;
  if (!f.init_adapter.empty()) return "--init-adapter " + f.init_adapter;
  if (!f.config.empty() || f.model.empty() || !is_model_directory(f.model)) return "";
  std::error_code ec;
  const std::filesystem::path dir(f.model);
  if (std::filesystem::exists(dir / "model.safetensors", ec) || std::filesystem::exists(dir / "model.safetensors.index.json", ec))
    return "--model " + f.model;
  return "";
}

// The fine-tune set as --help shows it beside each option's demo default (the values are
// apply_fine_tune_defaults'; --seq-len and --steps follow from the model and the data).
struct fine_tune_help {
  const char* flag;
  const char* value;
};
constexpr fine_tune_help fine_tune_helps[] = {
    {"--lr", "2e-5 (2e-4 with --lora)"}, {"--warmup-ratio", "0.03"}, {"--warmup", "0 (--warmup-ratio instead)"},
    {"--min-lr-ratio", "0"}, {"--epochs", "1 over --data"}, {"--steps", "from --epochs"}, {"--cp", "1"},
    {"--seq-len", "the model's context up to 4K"},
};

// "(fine-tune default ...)" after each option's help that does not say it already, and
// the footer's list, from the one table.
void show_fine_tune_defaults(CLI::App& app) {
  std::string listed;
  for (const fine_tune_help& h : fine_tune_helps) {
    listed += std::string(listed.empty() ? "" : ", ") + h.flag + " " + h.value;
    CLI::Option* option = app.get_option_no_throw(h.flag);
    if (option != nullptr && option->get_description().find("fine-tune") == std::string::npos)
      option->description(option->get_description() + " (fine-tune default " + h.value + ")");
  }
  app.footer("Defaults: the demo's as shown; a run that starts from pretrained weights (--model DIR with weights, "
             "--init, --init-adapter) takes a fine-tune's: " + listed + ".\n"
             "Exit status: 0 done; 2 bad input; 3 out of memory; 75 stopped by SIGTERM, SIGINT or SIGUSR1 after "
             "saving a checkpoint (continue with --resume DIR); 128 + the signal when stopped with nothing saved.");
}

// The fine-tune set, for options that no flag, file or checkpoint gave (docs: README,
// "Fine-tuning defaults"); the rest (--seq-len, --steps) follow from the model and the data.
void apply_fine_tune_defaults(run_options& opts) {
  const bool lora = !opts.config().lora.empty() || !opts.config().init_adapter.empty();
  opts.set_default("optimizer.lr", lora ? 2e-4 : 2e-5, value_source::fine_tune_default);
  opts.set_default("optimizer.min_lr_ratio", 0.0, value_source::fine_tune_default);
  opts.set_default("parallel.cp", 1, value_source::fine_tune_default);
  if (!opts.set_anywhere("optimizer.warmup")) {
    opts.set_default("optimizer.warmup_ratio", 0.03, value_source::fine_tune_default);
    opts.set_default("optimizer.warmup", std::int64_t{0}, value_source::fine_tune_default);
  }
  if (!opts.set_anywhere("optimizer.steps")) opts.set_default("data.epochs", 1.0, value_source::fine_tune_default);
}

// Tokens one pass over the data holds (documents kept by --min-doc-tokens; a mixture's
// sources together), for --epochs.
std::int64_t data_tokens(const train_options& o) {
  if (o.data_path.empty()) return 0;
  std::int64_t tokens = 0;
  for (const data_source_spec& s : parse_data_sources(o.data_path, "--data")) {
    if (o.packing != packing_mode::stream && document_corpus::exists(s.path)) {
      tokens += document_corpus(s.path, o.model.vocab_size, o.min_doc_tokens, o.seed).epoch_tokens();
      continue;
    }
    std::error_code ec;
    const std::string file = document_corpus::exists(s.path) ? s.path + ".tokens" : s.path;
    const auto bytes = std::filesystem::file_size(file, ec);
    tokens += ec ? 0 : static_cast<std::int64_t>(bytes / 4);
  }
  return tokens;
}

std::string number_text(double v) {
  std::ostringstream text;
  text << v;
  return text.str();
}

// The steps --epochs makes of --data: every replica's sequences of --seq-len a step.
std::int64_t steps_of_epochs(const run_config& f, const train_options& o) {
  const double per_step = static_cast<double>(o.seq_len) * static_cast<double>(global_batch(o));
  const double steps = std::ceil(f.epochs * static_cast<double>(data_tokens(o)) / per_step);
  if (steps > static_cast<double>(max_train_steps))
    throw config_error("--epochs " + number_text(f.epochs) + " over --data " + o.data_path + " is " +
                       number_text(steps) + " steps, more than " + std::to_string(max_train_steps) + "; use fewer");
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(steps));
}

// --steps from --epochs over the data, and the warm-up from --warmup-ratio. One idea given
// two ways by this invocation is taken where both agree (a checkpoint's run.toml given as
// --config-file holds both) and refused where they do not; a derived value is recorded as
// derived, and printed as a comment, since loading the printed file derives it again. The
// values themselves were checked where they were read (their rows' rules).
void derive_schedule(run_options& opts, train_options& o) {
  run_config& f = opts.config();
  const bool with_data = f.epochs > 0 && !o.data_path.empty();
  if (opts.from_user("optimizer.steps") && opts.from_user("data.epochs") && f.epochs > 0) {
    const std::int64_t derived = with_data ? steps_of_epochs(f, o) : 0;
    if (derived != f.steps)
      throw config_error("--steps " + std::to_string(f.steps) + " and --epochs " + number_text(f.epochs) +
                         (with_data ? " (" + std::to_string(derived) + " steps over --data)" : std::string()) +
                         " both set the schedule's length and disagree: give one (--epochs counts passes over --data)");
  } else if (with_data && (opts.from_user("data.epochs") || !opts.set_anywhere("optimizer.steps"))) {
    opts.set_derived("optimizer.steps", steps_of_epochs(f, o));
  }
  const auto warmup_of_ratio = [&] {
    return static_cast<std::int64_t>(std::llround(f.warmup_ratio * static_cast<double>(f.steps)));
  };
  if (f.warmup_ratio != 0 && opts.from_user("optimizer.warmup")) {
    if (opts.from_user("optimizer.warmup_ratio") && f.warmup != warmup_of_ratio())
      throw config_error("--warmup " + std::to_string(f.warmup) + " and --warmup-ratio " + number_text(f.warmup_ratio) +
                         " (" + std::to_string(warmup_of_ratio()) + " of --steps " + std::to_string(f.steps) +
                         ") both set the warm-up and disagree: give one");
    if (!opts.from_user("optimizer.warmup_ratio"))
      opts.set_derived("optimizer.warmup_ratio", 0.0);  // a warm-up in steps now replaces a stored or default ratio
  }
  if (f.warmup_ratio > 0) opts.set_derived("optimizer.warmup", warmup_of_ratio());
  o.optim.total_steps = f.steps;
  o.optim.warmup_steps = std::min(f.warmup, f.steps);
  o.optim.min_lr_ratio = f.min_lr_ratio;
}

// The longest of the model's context and 4K, rounded down to the layout's unit: a
// fine-tune's sequence length when none is given.
std::int64_t fine_tune_seq_len(const train_options& o) {
  const std::int64_t unit = layout_unit(o.cp);
  const std::int64_t context = o.model.max_position_embeddings > 0 ? o.model.max_position_embeddings : 4096;
  return std::max(unit, std::min<std::int64_t>(context, 4096) / unit * unit);
}

train_options to_options(run_options& opts, bool fine_tune) {
  run_config& f = opts.config();
  train_options o;
  if (f.keep_last > 0 && f.save.empty())
    throw config_error("--keep-last " + std::to_string(f.keep_last) + " needs --save DIR (the run directory it rotates)");
  if (f.keep_best && (f.save.empty() || f.eval_every == 0))
    throw config_error("--keep-best needs --save DIR and --eval-every N (it keeps the checkpoint of the lowest "
                       "held-out loss)");
  o.model_dir = choose_model(f, o.model);
  if (!f.config.empty()) o.weights_in_model_dir = train_options::model_dir_weights::optional;
  // The model the run chose (an adapter's base, the --init directory, tiny-llama) is recorded.
  if (f.model.empty() && f.config.empty())
    opts.set_default("model.model", o.model_dir.empty() ? o.model.name : o.model_dir, value_source::derived);
  for (const std::string& note : apply_rope(f, o.model)) std::fprintf(stderr, "upipe: note: %s\n", note.c_str());
  const lora_config lora = choose_lora(f, o.model);
  // A full run's checkpoint carries its config.json and tokenizer on; a LoRA run's base stays the base.
  if (!f.resume.empty() && !lora.enabled()) o.model_dir = f.resume;
  o.init_adapter = f.init_adapter;
  o.save_model = {f.save_dtype == "bf16" ? dtype::bf16 : dtype::f32, parse_bytes(f.max_shard_size, "--max-shard-size")};
  o.init_path = f.init;
  o.data_path = f.data;
  // PREFIX.tokens of a corpus means the corpus: its index and manifest lie beside it.
  std::vector<data_source_spec> sources = parse_data_sources(f.data, "--data");
  for (data_source_spec& s : sources)
    if (const std::string suffix = ".tokens"; s.path.size() > suffix.size() && s.path.ends_with(suffix) &&
                                              document_corpus::exists(s.path.substr(0, s.path.size() - suffix.size())))
      s.path.resize(s.path.size() - suffix.size());
  o.data_path = sources.empty() ? std::string() : data_sources_text(sources);
  o.packing = f.packing == "documents" ? packing_mode::documents
              : f.packing == "stream"  ? packing_mode::stream
                                       : packing_mode::automatic;
  o.min_doc_tokens = f.min_doc_tokens;
  o.allow_tokenizer_mismatch = f.allow_tokenizer_mismatch;
  o.cp = cp_of(f);
  o.dp = f.dp;
  o.gpus_per_node = f.gpus_per_node;
  if (fine_tune) {
    opts.set_default("data.seq_len", std::to_string(fine_tune_seq_len(o)), value_source::fine_tune_default);
  }
  o.seq_len = parse_seq_len(f.seq_len);
  o.batch = f.batch != -1 ? f.batch : (f.data.empty() ? 4 : 1);
  o.seed = f.seed;
  derive_schedule(opts, o);
  o.seq_warmup = f.seq_warmup >= 0 ? f.seq_warmup : (f.data.empty() ? f.steps * 9 / 10 : 0);
  o.seq_warmup_start = f.seq_warmup_start;
  o.zero = f.zero == 3 ? zero_stage::three : zero_stage::two;
  o.step = {f.mlp_tile, f.loss_chunk,
            is_auto_policy(f.checkpoint_policy) ? checkpoint_policy{} : parse_checkpoint_policy(f.checkpoint_policy)};
  apply_comm(f, o.step);
  o.step.attention_arithmetic = parse_attention_dtype(f.attention_dtype);
  o.step.lora = lora;
  o.step.router_aux = parse_router_aux_loss(f.router_aux_loss);
  apply_moe(f, o.step);
  o.optim.lr = f.lr;
  o.optim.weight_decay = f.weight_decay;
  o.optim.max_grad_norm = f.max_grad_norm;
  o.stop_after = f.stop_after;
  o.save_dir = f.save;
  o.save_every = f.save_every;
  o.keep_last = f.keep_last;
  o.keep_best = f.keep_best;
  o.overwrite = f.overwrite;
  o.resume_dir = f.resume;
  o.backend = parse_backend_kind(f.backend);
  o.comm = comm_of(f);
  const offload_options offload = parse_offload(f.offload);
  o.offload_optimizer = offload.optimizer;
  o.offload_params = offload.params;
  o.offload_master = offload.master;
  o.state_format = {parse_moments(f.optimizer_state), parse_master(f.master_weights)};
  o.grad_type = parse_grad_dtype(f.grad_dtype);
  o.convert_state = f.convert_optimizer_state;
  size_step(o, f);
  o.eval_samples = f.eval_samples;
  o.eval_every = f.eval_every;
  o.eval_data = f.eval_data;
  o.eval_sequences = f.eval_sequences;
  return o;
}

std::string clock_text(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%ld:%02ld", s / 60, s % 60);
  return buf;
}

// One progress line per step on a terminal (redrawn), about twenty lines otherwise. The
// ETA counts the tokens left at the rate so far (steps differ in length during the
// short-sequence stage).
class progress {
 public:
  progress(const train_options& o, std::int64_t first, std::int64_t last)
      : options_(o), first_(first), last_(last), tty_(::isatty(STDOUT_FILENO)) {}
  void operator()(const step_record& r) {
    done_seconds_ += r.seconds;
    done_tokens_ += static_cast<double>(r.seq_len * global_batch(options_));
    // Steps left in the short stage at its length, the rest at the full length.
    const std::int64_t left = last_ - r.step;
    const std::int64_t short_left = std::clamp<std::int64_t>(std::min(last_, options_.seq_warmup) - r.step, 0, left);
    const double left_tokens = static_cast<double>(global_batch(options_)) *
                               static_cast<double>(short_left * step_seq_len(options_, 1) +
                                                   (left - short_left) * options_.seq_len);
    const double eta = done_tokens_ > 0 ? done_seconds_ / done_tokens_ * left_tokens : 0;
    const std::int64_t every = std::max<std::int64_t>(1, (last_ - first_ + 1) / 20);
    if (!tty_ && r.step != last_ && (r.step - first_) % every != 0) return;
    const int width = 24, filled = static_cast<int>(width * (r.step - first_ + 1) / std::max<std::int64_t>(1, last_ - first_ + 1));
    char held_out[48] = "";
    if (r.eval_loss) std::snprintf(held_out, sizeof held_out, "  eval %.4f", *r.eval_loss);
    if (r.skipped) std::snprintf(held_out, sizeof held_out, " (skipped: no target)");
    char terms[48] = "";  // a mixture of experts' two terms
    if (r.aux_on && !r.skipped) std::snprintf(terms, sizeof terms, " (lm %.4f, aux %.4f)", r.lm_loss, r.aux_loss);
    std::printf("%s[%s%s] step %lld/%lld  S %lld  loss %.4f%s%s  lr %.2e  |g| %.3f  %.0f tok/s  ETA %s%s", tty_ ? "\r" : "",
                std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                static_cast<long long>(r.step), static_cast<long long>(last_), static_cast<long long>(r.seq_len), r.loss,
                terms, held_out, r.lr, r.grad_norm, r.tokens_per_s, clock_text(eta).c_str(),
                tty_ ? (r.step == last_ ? "\n" : "") : "\n");
    std::fflush(stdout);
  }

 private:
  const train_options& options_;
  std::int64_t first_, last_;
  bool tty_;
  double done_seconds_ = 0, done_tokens_ = 0;
};

nlohmann::json record_json(const train_options& o, const step_record& r) {
  nlohmann::json j = {{"step", r.step}, {"seq_len", r.seq_len}, {"epoch", r.epoch},
                      {"loss", r.skipped ? nlohmann::json(nullptr) : nlohmann::json(r.loss)}, {"lr", r.lr},
                      {"grad_norm", r.grad_norm}, {"model_tflops_per_s", r.model_flops / std::max(r.seconds, 1e-9) / 1e12},
                      {"eval_loss", r.eval_loss ? nlohmann::json(*r.eval_loss) : nlohmann::json(nullptr)},
                      {"tokens_per_s", r.tokens_per_s}, {"targets", r.targets}, {"empty_sequences", r.empty_sequences},
                      {"skipped", r.skipped}, {"peak_bytes", r.peak_bytes}};
  if (!r.eval_losses.empty()) j["eval_losses"] = r.eval_losses;
  if (r.aux_on) {  // both terms of a mixture of experts' loss
    j["lm_loss"] = r.lm_loss;
    j["aux_loss"] = r.aux_loss;
  }
  // Per source of --data: the step's sequences and targets, and the passes over it so far.
  if (!r.sources.empty()) {
    const std::vector<data_source_spec> specs = parse_data_sources(o.data_path, "--data");
    nlohmann::json data = nlohmann::json::object();
    for (std::size_t i = 0; i < r.sources.size() && i < specs.size(); ++i)
      data[specs[i].path] = {{"sequences", r.sources[i].sequences}, {"targets", r.sources[i].targets},
                             {"epoch", r.sources[i].epoch}};
    j["data"] = data;
  }
  return j;
}

// The losses of the steps that measured one: a skipped step (no target anywhere) has none.
std::vector<double> measured_losses(const train_summary& s) {
  std::vector<double> out;
  for (const step_record& r : s.steps)
    if (!r.skipped) out.push_back(r.loss);
  return out;
}

void print_summary(const train_options& o, const train_summary& s) {
  if (s.steps.empty()) return;
  const std::vector<double> losses = measured_losses(s);
  const std::size_t skipped = s.steps.size() - losses.size();
  std::printf("\nsummary: %zu steps in %s (%s)", s.steps.size(), clock_text(s.seconds).c_str(),
              o.data_path.empty() ? "passkey task" : o.data_path.c_str());
  if (!losses.empty()) {
    const std::size_t n = std::min<std::size_t>(10, losses.size());
    double tail = 0;
    for (std::size_t i = losses.size() - n; i < losses.size(); ++i) tail += losses[i];
    std::printf("  loss %.4f -> %.4f (mean of the last %zu measured: %.4f)", losses.front(), losses.back(), n,
                tail / static_cast<double>(n));
  }
  if (skipped > 0) std::printf("  (%zu skipped: no target, no loss)", skipped);
  std::printf("\n");
  if (s.retrieval_accuracy)
    std::printf("retrieval accuracy %.3f on %d held-out samples (key digits right; chance 0.1)\n", *s.retrieval_accuracy,
                o.eval_samples);
  std::printf("weights loaded on every rank in %.3f s (from the start: checks, files mapped, shards read)\n",
              s.load_seconds);
  std::printf("rank 0's device arena high water: %.2f MiB\n", static_cast<double>(s.arena_high_water) / (1 << 20));
  std::printf("host memory of the process: %.2f MiB (its pools, rank 0's high water %.2f MiB, and what lies beside "
              "them)\n", static_cast<double>(s.host_bytes) / (1 << 20), static_cast<double>(s.host_high_water) / (1 << 20));
  // Every rank on data backends; rank 0 alone on meta (the loopback emulation).
  std::vector<std::size_t> ranks;
  for (std::size_t r = 0; r < s.peak_bytes.size(); ++r)
    if (!s.peak_bytes[r].empty()) ranks.push_back(r);
  std::printf("peak memory by tag per rank (MiB):\n  %-20s", "tag");
  for (std::size_t r : ranks) std::printf(" %9s", ("rank" + std::to_string(r)).c_str());
  std::printf("\n");
  for (const auto& [tag, bytes] : s.peak_bytes[0]) {
    std::printf("  %-20s", tag.c_str());
    for (std::size_t r : ranks) {
      const auto it = s.peak_bytes[r].find(tag);
      std::printf(" %9.2f", it == s.peak_bytes[r].end() ? 0.0 : static_cast<double>(it->second) / (1 << 20));
    }
    std::printf("\n");
  }
}

// "2026-12-03T06:40:12.345Z": the metrics' wall-clock time, UTC.
std::string utc_now() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm utc{};
  gmtime_r(&t, &utc);
  char text[40];
  std::snprintf(text, sizeof text, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", utc.tm_year + 1900, utc.tm_mon + 1,
                utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, static_cast<int>(ms));
  return text;
}

// The configuration every source gave, resolved: the checkpoint's under a resume, then the
// defaults of the set in force. Returns the notes a resume reports and says which set.
struct resolved_run {
  train_options options;
  std::vector<std::string> resume_notes;
  std::string defaults;  // "demo" or "fine-tune (...)"
};

resolved_run resolve_run(run_options& opts) {
  run_config& f = opts.config();
  resolved_run out;
  if (!f.resume.empty()) {
    f.resume = resolve_checkpoint(resolve_checkpoint_dir(f.resume));
    const std::string stored = run_config_path(f.resume);
    std::error_code ec;
    if (const std::optional<std::string> text = read_run_config(f.resume))
      out.resume_notes = opts.apply_stored(*text, stored, is_adapter_directory(f.resume), run_directory_of(f.resume));
    else
      out.resume_notes.push_back(f.resume + " holds no run configuration (a checkpoint of an earlier upipe): the "
                                 "options not given now take their defaults");
    // The checkpoint is a model directory itself: a full run whose input directory is gone
    // continues from the checkpoint's own config.json and tokenizer.
    if (f.lora.empty() && !f.model.empty() && f.model.find('/') != std::string::npos &&
        !std::filesystem::exists(f.model, ec)) {
      out.resume_notes.push_back("the run's model directory " + f.model + " is gone; the checkpoint's own config.json "
                                 "and tokenizer stand in for it");
      f.model = f.resume;
    }
  }
  // A run directory means its latest checkpoint, wherever a checkpoint is read.
  f.init = resolve_checkpoint(f.init);
  f.init_adapter = resolve_checkpoint(f.init_adapter);
  if (f.config.empty() && !f.model.empty()) f.model = resolve_checkpoint(f.model);
  const std::string pretrained = pretrained_source(f);
  if (!pretrained.empty()) apply_fine_tune_defaults(opts);
  out.defaults = pretrained.empty() ? "demo (the passkey task's; README: Fine-tuning defaults)"
                                    : "fine-tune (the run starts from pretrained weights: " + pretrained + ")";
  opts.resolve_paths();
  out.options = to_options(opts, !pretrained.empty());
  validate(out.options);
  out.options.run_config = opts.toml(toml_use::record);
  return out;
}

// The start's short summary beside the "# upipe train" line: the defaults in force, where
// the run saves, and where the whole configuration is (--print-config; every checkpoint's
// trainer/run.toml).
void print_start(const train_options& o, const std::string& defaults) {
  std::printf("# defaults: %s; every option: --print-config\n", defaults.c_str());
  if (o.save_dir.empty())
    std::printf("# saves nothing (no --save DIR)\n");
  else
    std::printf("# saves into %s%s, with the run's configuration as trainer/run.toml in each checkpoint\n",
                o.save_dir.c_str(),
                o.save_every > 0 ? (" every " + std::to_string(o.save_every) + " steps and at the end").c_str()
                                 : " at the end");
}

int run(train_command& command) {
  run_options& opts = *command.options;
  run_config& f = opts.config();
  resolved_run resolved = resolve_run(opts);
  train_options& o = resolved.options;
  if (is_auto_head_chunk(f.head_chunk))
    std::printf("%s", choose_head_chunk(o, f, is_auto_policy(f.checkpoint_policy)).c_str());
  if (is_auto_policy(f.checkpoint_policy)) {
    const plan_point chosen = choose_checkpoint_policy(o, f);
    std::printf("# checkpoint policy %s (auto: the fastest that fits; predicted arena high water %.2f GiB)\n",
                chosen.policy.str().c_str(), static_cast<double>(chosen.arena_bytes) / (1 << 30));
  }
  if (command.print_config) {
    std::printf("# defaults: %s\n# resolved configuration (the source of each value not at the demo default):\n%s",
                resolved.defaults.c_str(), opts.toml(toml_use::print).c_str());
    return 0;
  }
  for (const std::string& note : resolved.resume_notes)
    std::fprintf(stderr, "upipe: note: resumed with %s\n", note.c_str());
  if (o.seq_len > o.model.max_position_embeddings && o.model.max_position_embeddings > 0)
    std::fprintf(stderr, "upipe: note: --seq-len %lld is past the %lld tokens the model declares; the saved "
                 "config.json declares max_position_embeddings = %lld\n", static_cast<long long>(o.seq_len),
                 static_cast<long long>(o.model.max_position_embeddings), static_cast<long long>(o.seq_len));
  std::ofstream metrics;
  if (!f.metrics_json.empty()) {
    const std::string target = checked_output_file(f.metrics_json, "--metrics-json", missing_parents::made);
    make_parent_directories(target, "--metrics-json");  // runs/NAME.jsonl in a fresh directory
    if (!is_character_device(target)) remove_stale_temporaries(target);  // a killed writer's, as for every output
    // A resumed run goes on in the same file: its earlier steps stay.
    metrics.open(target, f.resume.empty() ? std::ios::trunc : std::ios::app);
    if (!metrics) throw io_error("cannot write --metrics-json " + f.metrics_json + ": check the directory");
  }
  std::printf("# upipe train  model=%s (%lld parameters)  %s  S=%lld x %lld per step  %scp=%d %s  zero=%d  steps=%lld  "
              "lr=%g  backend=%s\n",
              o.model.name.c_str(), static_cast<long long>(o.model.parameter_count()),
              o.data_path.empty() ? "passkey task" : o.data_path.c_str(), static_cast<long long>(o.seq_len),
              static_cast<long long>(global_batch(o)), o.dp > 1 ? ("dp=" + std::to_string(o.dp) + " ").c_str() : "",
              o.cp.cp, mesh_text(f).c_str(), f.zero,
              static_cast<long long>(o.optim.total_steps), o.optim.lr, f.backend.c_str());
  print_start(o, resolved.defaults);
  if (o.dp > 1 || o.gpus_per_node > 0) std::printf("%s", mesh_placement(o).c_str());
  if (o.step.lora.enabled())
    std::printf("# LoRA %s: %lld adapter parameters trained, the base frozen (no gradients, masters or moments)\n",
                lora_text(o.step.lora).c_str(), static_cast<long long>(lora_parameter_count(o.model, o.step.lora)));
  if (o.offload_optimizer)
    std::printf("# in host memory: %s; AdamW on the host's cores %s\n",
                o.offload_params ? "AdamW's state and the weights" : "AdamW's state",
                o.optim.max_grad_norm > 0 ? "after the norm, beside the next forward" : "beside the backward");
  if (o.offload_master)
    std::printf("# in host memory: the master weights%s; the GPU runs the moments' half of AdamW, the host the "
                "master's\n", o.offload_params ? " and the working weights" : "");
  if (!(o.state_format == adamw_state_format{}) || o.grad_type != dtype::f32)
    std::printf("# AdamW state: moments %s, master %s, gradient shards %s\n", moments_flag(o.state_format.moments),
                master_flag(o.state_format.master),
                state_options_of(o).grads == grad_keeping::streamed ? "none (each unit updated as they arrive)"
                                                                    : (o.grad_type == dtype::bf16 ? "bf16" : "fp32"));
  if (o.seq_warmup > 0)
    std::printf("# steps 1-%lld on sequences of %lld tokens, then %lld (--seq-warmup, --seq-warmup-start)\n",
                static_cast<long long>(o.seq_warmup), static_cast<long long>(step_seq_len(o, 1)),
                static_cast<long long>(o.seq_len));
  std::fflush(stdout);
  const std::int64_t first = f.resume.empty() ? 1 : checkpoint_step(f.resume) + 1;
  const std::int64_t last = o.stop_after > 0 ? o.stop_after : o.optim.total_steps;
  progress bar(o, first, last);
  const auto started = std::chrono::steady_clock::now();
  stop_requested.store(0);
  o.stop_signal = &stop_requested;
  train_summary s;
  {
    const stop_handlers handlers;
    s = train(o, [&](const step_record& r) {
      bar(r);
      if (!metrics.is_open()) return;
      nlohmann::json line = record_json(o, r);
      line["time"] = utc_now();
      line["elapsed_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      metrics << line.dump() << "\n" << std::flush;
    });
  }
  print_summary(o, s);
  if (metrics.is_open()) {
    nlohmann::json last_record = {{"final", true}, {"steps", s.steps.size()}, {"seconds", s.seconds},
                                  {"peak_bytes_per_rank", s.peak_bytes}, {"arena_high_water_bytes", s.arena_high_water},
                                  {"host_bytes", s.host_bytes}, {"host_high_water_bytes", s.host_high_water},
                                  {"time", utc_now()}, {"run_id", s.run_id}};
    last_record["loss"] = s.steps.empty() ? nlohmann::json(nullptr) : nlohmann::json(s.steps.back().loss);
    last_record["retrieval_accuracy"] = s.retrieval_accuracy ? nlohmann::json(*s.retrieval_accuracy) : nlohmann::json(nullptr);
    if (s.stopped_by_signal) last_record["stopped_by_signal"] = s.stopped_by_signal;
    metrics << last_record.dump() << "\n";
    if (!metrics) throw io_error("writing --metrics-json " + f.metrics_json + " failed");
  }
  if (s.stopped_by_signal != 0) {
    if (s.last_checkpoint.empty()) {
      std::fprintf(stderr, "upipe: stopped by signal %d after step %lld; nothing saved (no --save)\n",
                   s.stopped_by_signal, s.steps.empty() ? 0LL : static_cast<long long>(s.steps.back().step));
      return 128 + s.stopped_by_signal;
    }
    std::fprintf(stderr, "upipe: stopped by signal %d; saved %s; continue with: upipe train --resume %s\n",
                 s.stopped_by_signal, s.last_checkpoint.c_str(), o.save_dir.c_str());
    return exit_stopped_and_saved;
  }
  return 0;
}

}  // namespace

// A path flag given as "" would silently mean "none" (a fresh run for --resume ""): refused.
const CLI::Validator non_empty(
    [](const std::string& value) { return value.empty() ? std::string("an empty path is not a file or directory") : ""; },
    "PATH");

command_runner add_train(CLI::App& app) {
  auto command = std::make_shared<train_command>();
  command->options = std::make_shared<run_options>(app, for_train);
  for (const char* flag : {"--init", "--init-adapter", "--data", "--save", "--resume", "--eval-data", "--config-file"})
    app.get_option(flag)->check(non_empty);
  app.get_option("--metrics-json")->check(output_file_flag("--metrics-json", missing_parents::made));
  app.add_flag("--print-config", command->print_config,
               "print the resolved configuration as TOML (a --config-file to start from) and exit");
  show_fine_tune_defaults(app);
  return [command] { return command->options->run([&] { return run(*command); }); };
}

}  // namespace upipe::apps
