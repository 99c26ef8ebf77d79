// `upipe train`: training under context parallelism. With no flags: a tiny Llama learns
// the synthetic passkey task on the CPU, 4 threaded CP ranks, UPipe.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "apps/commands.hpp"
#include "apps/flag_checks.hpp"
#include "apps/cp_flags.hpp"
#include "apps/comm_flags.hpp"
#include "apps/model_flags.hpp"
#include "apps/policy_flags.hpp"
#include "apps/sizes.hpp"
#include "core/error.hpp"
#include "model/adapter_files.hpp"
#include "plan/planner.hpp"
#include "train/data.hpp"
#include "train/trainer.hpp"

namespace upipe::apps {

namespace {

struct train_flags {
  std::string model, config_path, init_path, data_path, save_dir, resume_dir, metrics_path;
  std::string save_dtype = "bf16", max_shard_size = "5GB", packing = "auto";
  std::string lora, init_adapter;
  std::int64_t min_doc_tokens = 0, eval_every = 0;
  std::string eval_data;
  int eval_sequences = 4;
  rope_flags rope;
  comm_flags comm;
  std::string backend = "cpu", policy = "auto", seq_len = "128", offload = "none";
  cp_flags mesh{"upipe", 4};
  int zero = 2, layers = 0, eval_samples = 32;
  std::int64_t batch = -1, seq_warmup = -1, seq_warmup_start = 0, steps = 3300, stop_after = 0, save_every = 0, warmup = 20, mlp_tile = 0, loss_chunk = 0;
  double lr = 1e-3, weight_decay = 0.01, max_grad_norm = 1.0, memory_gib = 8, host_memory_gib = 0;
  unsigned long long seed = 1;
};


// The LoRA adapter directory a run continues (--init-adapter, or a LoRA run's --resume), or "".
std::string continued_adapter(const train_flags& f) {
  if (!f.init_adapter.empty()) return f.init_adapter;
  return !f.resume_dir.empty() && is_adapter_directory(f.resume_dir) ? f.resume_dir : std::string();
}

// The model: --model or --config as given; with neither, the base a continued adapter
// names, the model a --resume or --init directory holds, else tiny-llama. Returns the
// directory it came from.
std::string choose_model(const train_flags& f, model_config& model) {
  std::string from = f.model;
  if (from.empty() && f.config_path.empty()) {
    if (const std::string adapter = continued_adapter(f); !adapter.empty()) {
      from = adapter_base_model(adapter);
      if (from.empty())
        throw config_error(adapter + "/" + adapter_config_file + " names no base model (base_model_name_or_path): pass "
                           "the base it was trained on as --model");
    } else if (!f.resume_dir.empty() && is_model_directory(f.resume_dir))
      from = f.resume_dir;
    else if (!f.init_path.empty() && is_model_directory(f.init_path))
      from = f.init_path;
    else
      from = "tiny-llama";
  }
  model = load_model(from, f.config_path, f.layers);
  return model_directory(from, f.config_path);
}

// LoRA's settings: --lora, or those of the adapter directory the run continues, which a
// --lora given beside it must repeat.
lora_config choose_lora(const train_flags& f, const model_config& model) {
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

train_options to_options(const train_flags& f) {
  train_options o;
  // The numbers the sizing below divides by or trusts, checked first.
  const auto num = [](double v) {
    std::ostringstream text;
    text << v;
    return text.str();
  };
  require_within(f.steps, 1, limits::steps, "--steps", "--steps 200");  // before steps * 9 / 10 below
  if (f.batch != -1 && f.batch < 1)
    throw config_error("--batch " + std::to_string(f.batch) + " must be at least 1 (sequences per optimizer step)");
  if (!(f.weight_decay >= 0) || !std::isfinite(f.weight_decay))
    throw config_error("--weight-decay " + num(f.weight_decay) + " must be a finite number >= 0 (e.g. 0.1)");
  if (!(f.max_grad_norm >= 0) || !std::isfinite(f.max_grad_norm))
    throw config_error("--max-grad-norm " + num(f.max_grad_norm) +
                       " must be a finite number >= 0 (0 turns clipping off; e.g. 1.0)");
  if (!(f.lr > 0) || !(f.lr <= 1))
    throw config_error("--lr " + num(f.lr) + " must be a positive number at most 1 (for example 3e-4)");
  o.model_dir = choose_model(f, o.model);
  if (!f.config_path.empty()) o.weights_in_model_dir = train_options::model_dir_weights::optional;
  f.rope.apply(o.model);
  const lora_config lora = choose_lora(f, o.model);
  // A full run's checkpoint carries its config.json and tokenizer on; a LoRA run's base stays the base.
  if (!f.resume_dir.empty() && !lora.enabled()) o.model_dir = f.resume_dir;
  o.init_adapter = f.init_adapter;
  if (f.save_dtype != "bf16" && f.save_dtype != "fp32")
    throw config_error("--save-dtype " + f.save_dtype + " is not supported: use bf16 (the default, as released "
                       "models are stored) or fp32");
  o.save_model = {f.save_dtype == "bf16" ? dtype::bf16 : dtype::f32, parse_bytes(f.max_shard_size, "--max-shard-size")};
  if (f.zero != 2 && f.zero != 3)
    throw config_error("--zero " + std::to_string(f.zero) + " is not supported: use --zero 2 (sharded optimizer and "
                       "gradients) or --zero 3 (weights sharded too)");
  o.init_path = f.init_path;
  o.data_path = f.data_path;
  // PREFIX.tokens of a corpus means the corpus: its index and manifest lie beside it.
  if (const std::string suffix = ".tokens"; o.data_path.size() > suffix.size() && o.data_path.ends_with(suffix) &&
                                            document_corpus::exists(o.data_path.substr(0, o.data_path.size() - suffix.size())))
    o.data_path.resize(o.data_path.size() - suffix.size());
  if (f.packing != "auto" && f.packing != "documents" && f.packing != "stream")
    throw config_error("--packing " + f.packing + " is not known: use documents (attention within each document, "
                       "the default with a document index) or stream (one token stream)");
  o.packing = f.packing == "documents" ? packing_mode::documents
              : f.packing == "stream"  ? packing_mode::stream
                                       : packing_mode::automatic;
  if (f.min_doc_tokens < 0)
    throw config_error("--min-doc-tokens " + std::to_string(f.min_doc_tokens) + " must be 0 or more (e.g. 32768 keeps "
                       "only long documents)");
  o.min_doc_tokens = f.min_doc_tokens;
  o.seq_len = parse_seq_len(f.seq_len);
  o.batch = f.batch != -1 ? f.batch : (f.data_path.empty() ? 4 : 1);
  o.seq_warmup = f.seq_warmup >= 0 ? f.seq_warmup : (f.data_path.empty() ? f.steps * 9 / 10 : 0);
  o.seq_warmup_start = f.seq_warmup_start;
  o.cp = f.mesh.settings();
  o.zero = f.zero == 3 ? zero_stage::three : zero_stage::two;
  o.step = {f.mlp_tile, f.loss_chunk, is_auto_policy(f.policy) ? checkpoint_policy{} : parse_checkpoint_policy(f.policy)};
  f.comm.apply(o.step);
  o.step.lora = lora;
  o.optim.lr = f.lr;
  o.optim.weight_decay = f.weight_decay;
  o.optim.max_grad_norm = f.max_grad_norm;
  o.optim.total_steps = f.steps;
  o.optim.warmup_steps = std::min(f.warmup, f.steps);
  o.stop_after = f.stop_after;
  o.seed = f.seed;
  o.save_dir = f.save_dir;
  o.save_every = f.save_every;
  o.resume_dir = f.resume_dir;
  o.backend = parse_backend_kind(f.backend);
  o.comm = f.comm.options();
  const offload_options offload = parse_offload(f.offload);
  o.offload_optimizer = offload.optimizer;
  o.offload_params = offload.params;
  const resolved_step resolved = resolve_step(sizes_of(o, f.memory_gib, f.host_memory_gib));
  o.step = resolved.step;
  o.limits = resolved.limits;
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
    done_tokens_ += static_cast<double>(r.seq_len * options_.batch);
    // Steps left in the short stage at its length, the rest at the full length.
    const std::int64_t left = last_ - r.step;
    const std::int64_t short_left = std::clamp<std::int64_t>(std::min(last_, options_.seq_warmup) - r.step, 0, left);
    const double left_tokens = static_cast<double>(options_.batch) *
                               static_cast<double>(short_left * step_seq_len(options_, 1) +
                                                   (left - short_left) * options_.seq_len);
    const double eta = done_tokens_ > 0 ? done_seconds_ / done_tokens_ * left_tokens : 0;
    const std::int64_t every = std::max<std::int64_t>(1, (last_ - first_ + 1) / 20);
    if (!tty_ && r.step != last_ && (r.step - first_) % every != 0) return;
    const int width = 24, filled = static_cast<int>(width * (r.step - first_ + 1) / std::max<std::int64_t>(1, last_ - first_ + 1));
    char held_out[32] = "";
    if (r.eval_loss) std::snprintf(held_out, sizeof held_out, "  eval %.4f", *r.eval_loss);
    std::printf("%s[%s%s] step %lld/%lld  S %lld  loss %.4f%s  lr %.2e  |g| %.3f  %.0f tok/s  ETA %s%s", tty_ ? "\r" : "",
                std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                static_cast<long long>(r.step), static_cast<long long>(last_), static_cast<long long>(r.seq_len), r.loss,
                held_out, r.lr, r.grad_norm, r.tokens_per_s, clock_text(eta).c_str(),
                tty_ ? (r.step == last_ ? "\n" : "") : "\n");
    std::fflush(stdout);
  }

 private:
  const train_options& options_;
  std::int64_t first_, last_;
  bool tty_;
  double done_seconds_ = 0, done_tokens_ = 0;
};

nlohmann::json record_json(const step_record& r) {
  return {{"step", r.step}, {"seq_len", r.seq_len}, {"epoch", r.epoch}, {"loss", r.loss}, {"lr", r.lr},
          {"grad_norm", r.grad_norm}, {"model_tflops_per_s", r.model_flops / std::max(r.seconds, 1e-9) / 1e12},
          {"eval_loss", r.eval_loss ? nlohmann::json(*r.eval_loss) : nlohmann::json(nullptr)},
          {"tokens_per_s", r.tokens_per_s}, {"peak_bytes", r.peak_bytes}};
}

void print_summary(const train_options& o, const train_summary& s) {
  if (s.steps.empty()) return;
  double tail = 0;
  const std::size_t n = std::min<std::size_t>(10, s.steps.size());
  for (std::size_t i = s.steps.size() - n; i < s.steps.size(); ++i) tail += s.steps[i].loss;
  std::printf("\nsummary: %zu steps in %s (%s)  loss %.4f -> %.4f (mean of the last %zu: %.4f)\n", s.steps.size(),
              clock_text(s.seconds).c_str(), o.data_path.empty() ? "passkey task" : o.data_path.c_str(),
              s.steps.front().loss, s.steps.back().loss, n, tail / static_cast<double>(n));
  if (s.retrieval_accuracy)
    std::printf("retrieval accuracy %.3f on %d held-out samples (key digits right; chance 0.1)\n", *s.retrieval_accuracy,
                o.eval_samples);
  std::printf("weights loaded on every rank in %.3f s (from the start: checks, files mapped, shards read)\n",
              s.load_seconds);
  std::printf("rank 0's device arena high water: %.2f MiB\n", static_cast<double>(s.arena_high_water) / (1 << 20));
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

int run(const train_flags& f) {
  train_options o = to_options(f);
  validate(o);
  if (is_auto_policy(f.policy)) {
    const plan_point chosen = choose_checkpoint_policy(o, f.memory_gib, f.host_memory_gib);
    std::printf("# checkpoint policy %s (auto: the fastest that fits; predicted arena high water %.2f GiB)\n",
                chosen.policy.str().c_str(), static_cast<double>(chosen.arena_bytes) / (1 << 30));
  }
  std::ofstream metrics;
  if (!f.metrics_path.empty()) {
    const std::string target = checked_output_file(f.metrics_path, "--metrics-json");
    if (!is_character_device(target)) remove_stale_temporaries(target);  // a killed writer's, as for every output
    metrics.open(target, std::ios::trunc);
    if (!metrics) throw io_error("cannot write --metrics-json " + f.metrics_path + ": check the directory");
  }
  std::printf("# upipe train  model=%s (%lld parameters)  %s  S=%lld x %lld per step  cp=%d %s  zero=%d  steps=%lld  "
              "lr=%g  backend=%s\n",
              o.model.name.c_str(), static_cast<long long>(o.model.parameter_count()),
              o.data_path.empty() ? "passkey task" : o.data_path.c_str(), static_cast<long long>(o.seq_len),
              static_cast<long long>(o.batch), o.cp.cp, f.mesh.describe().c_str(), f.zero,
              static_cast<long long>(o.optim.total_steps), o.optim.lr, f.backend.c_str());
  if (o.step.lora.enabled())
    std::printf("# LoRA %s: %lld adapter parameters trained, the base frozen (no gradients, masters or moments)\n",
                lora_text(o.step.lora).c_str(), static_cast<long long>(lora_parameter_count(o.model, o.step.lora)));
  if (o.offload_optimizer)
    std::printf("# in host memory: %s; AdamW on the host's cores %s\n",
                o.offload_params ? "AdamW's state and the weights" : "AdamW's state",
                o.optim.max_grad_norm > 0 ? "after the norm, beside the next forward" : "beside the backward");
  if (o.seq_warmup > 0)
    std::printf("# steps 1-%lld on sequences of %lld tokens, then %lld (--seq-warmup, --seq-warmup-start)\n",
                static_cast<long long>(o.seq_warmup), static_cast<long long>(step_seq_len(o, 1)),
                static_cast<long long>(o.seq_len));
  std::fflush(stdout);
  const std::int64_t last = o.stop_after > 0 ? o.stop_after : o.optim.total_steps;
  progress bar(o, 1, last);
  const train_summary s = train(o, [&](const step_record& r) {
    bar(r);
    if (metrics.is_open()) metrics << record_json(r).dump() << "\n" << std::flush;
  });
  print_summary(o, s);
  if (metrics.is_open()) {
    nlohmann::json last_record = {{"final", true}, {"steps", s.steps.size()}, {"seconds", s.seconds},
                                  {"peak_bytes_per_rank", s.peak_bytes}, {"arena_high_water_bytes", s.arena_high_water}};
    last_record["loss"] = s.steps.empty() ? nlohmann::json(nullptr) : nlohmann::json(s.steps.back().loss);
    last_record["retrieval_accuracy"] = s.retrieval_accuracy ? nlohmann::json(*s.retrieval_accuracy) : nlohmann::json(nullptr);
    metrics << last_record.dump() << "\n";
    if (!metrics) throw io_error("writing --metrics-json " + f.metrics_path + " failed");
  }
  return 0;
}

}  // namespace

// A path flag given as "" would silently mean "none" (a fresh run for --resume ""): refused.
const CLI::Validator non_empty(
    [](const std::string& value) { return value.empty() ? std::string("an empty path is not a file or directory") : ""; },
    "PATH");

command_runner add_train(CLI::App& app) {
  auto f = std::make_shared<train_flags>();
  add_model_flags(app, f->model, f->config_path);
  f->rope.add(app);
  app.add_option("--init", f->init_path,
                 "weights to start from: a model directory (one file or shards) or a .safetensors file (default: the "
                 "--model directory's weights, else random)")->check(non_empty);
  app.add_option("--lora", f->lora,
                 "train LoRA adapters on a frozen base: r=N[,alpha=A][,targets=q,k,v,o,gate,up,down][,dropout=0] "
                 "(alpha defaults to r, targets to all seven projections); saves a PEFT adapter directory");
  app.add_option("--init-adapter", f->init_adapter,
                 "LoRA: continue from this adapter directory (upipe's --save or PEFT's save_pretrained); its "
                 "adapter_config.json gives --lora")->check(non_empty);
  app.add_option("--data", f->data_path,
                 "a corpus PREFIX from upipe prepare-data (PREFIX.tokens, .index, .json), or a flat little-endian "
                 "uint32 token file (default: the synthetic passkey task)")->check(non_empty);
  app.add_option("--packing", f->packing,
                 "documents (attention masked and positions restarted at each document; the default with an index) "
                 "or stream")
      ->capture_default_str();
  app.add_option("--min-doc-tokens", f->min_doc_tokens, "leave out documents shorter than this (a long-context mix)");
  app.add_option("--seq-len", f->seq_len, "tokens per sequence (K and M suffixes)")->capture_default_str();
  app.add_option("--batch", f->batch,
                 "sequences per optimizer step, gradients accumulated (default: 4 on the passkey task, 1 with --data)");
  app.add_option("--seq-warmup", f->seq_warmup,
                 "steps trained on short sequences before --seq-len (default: 9/10 of --steps on the "
                 "passkey task, 0 with --data)");
  app.add_option("--seq-warmup-start", f->seq_warmup_start,
                 "tokens per sequence during --seq-warmup (default: a quarter of --seq-len)");
  add_cp_flags(app, f->mesh, "ranks in the CP group (threads on the cpu backend)");
  app.add_option("--steps", f->steps, "length of the learning-rate schedule")->capture_default_str();
  app.add_option("--stop-after", f->stop_after, "stop once this step is done (the schedule stays --steps long)");
  app.add_option("--lr", f->lr, "peak learning rate")->capture_default_str();
  app.add_option("--warmup", f->warmup, "linear warmup steps")->capture_default_str();
  app.add_option("--weight-decay", f->weight_decay, "AdamW weight decay on matrices")->capture_default_str();
  app.add_option("--max-grad-norm", f->max_grad_norm, "global-norm clipping (0: off)")->capture_default_str();
  app.add_option("--seed", f->seed, "seed of the initialization and the data")->capture_default_str();
  app.add_option("--save", f->save_dir,
                 "write a checkpoint here at the end (and every --save-every steps): a Hugging Face model directory "
                 "with the trainer state in DIR/trainer/")->check(non_empty);
  app.add_option("--save-dtype", f->save_dtype, "dtype of the saved weights: bf16 or fp32")->capture_default_str();
  app.add_option("--max-shard-size", f->max_shard_size, "largest weight file of a save (bytes, or KB/MB/GB)")
      ->capture_default_str();
  app.add_option("--save-every", f->save_every, "also save every N steps");
  app.add_option("--resume", f->resume_dir,
                 "continue from this checkpoint (at any --cp and --zero: the state is resharded)")->check(non_empty);
  app.add_option("--zero", f->zero, "2: shard optimizer state and gradients; 3: shard weights too")->capture_default_str();
  app.add_option("--checkpoint-policy", f->policy, checkpoint_policy_help())->capture_default_str();
  app.add_option("--mlp-tile", f->mlp_tile, mlp_tile_help);
  app.add_option("--loss-chunk", f->loss_chunk, loss_chunk_help);
  app.add_option("--layers", f->layers, "train a slice: the first N layers only");
  app.add_option("--backend", f->backend, "cpu, cuda (bf16, virtual ranks on one GPU) or meta")->capture_default_str();
  add_comm_flags(app, f->comm, true);
  app.add_option("--memory-gib", f->memory_gib, "arena per rank (cpu or GPU memory), GiB")->capture_default_str();
  app.add_option("--host-memory-gib", f->host_memory_gib, host_memory_gib_help);
  app.add_option("--offload", f->offload, offload_help)->capture_default_str();
  app.add_option("--eval-samples", f->eval_samples, "held-out passkey samples for the retrieval accuracy")->capture_default_str();
  app.add_option("--eval-every", f->eval_every, "held-out loss every N steps (and at the last), into the metrics");
  app.add_option("--eval-data", f->eval_data, "held-out data for --eval-every: a corpus PREFIX or a token file")->check(non_empty);
  app.add_option("--eval-sequences", f->eval_sequences, "held-out sequences per evaluation")->capture_default_str();
  app.add_option("--metrics-json", f->metrics_path, "one JSON object per step, then a final one")
      ->check(output_file_flag("--metrics-json"));
  return [f] { return run(*f); };
}

}  // namespace upipe::apps
