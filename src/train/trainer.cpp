#include "train/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "core/limits.hpp"
#include "model/adapter_files.hpp"
#include "model/model_step.hpp"
#include "runtime/cp_group.hpp"
#include "train/data.hpp"
#include "train/train_checkpoint.hpp"

namespace upipe {

namespace {

constexpr std::uint64_t held_out_stream = 0x9e3779b97f4a7c15ull;  // eval samples never seen in training

using clock_type = std::chrono::steady_clock;

bool uses_documents(const std::string& data, packing_mode packing) {
  return !data.empty() && packing != packing_mode::stream && document_corpus::exists(data);
}
bool uses_documents(const train_options& o) { return uses_documents(o.data_path, o.packing); }

// Where the sequences come from: the passkey task (sample = step), a corpus of documents
// (packed, shuffled per epoch) or a token file (one stream).
class data_source {
 public:
  data_source(const train_options& o) : data_source(o, o.data_path, o.min_doc_tokens) {}
  // Another file of the run's model and packing (the held-out data).
  data_source(const train_options& o, const std::string& data, std::int64_t min_doc_tokens)
      : seed_(o.seed), task_(data.empty() ? std::make_unique<passkey_task>(o.seq_len) : nullptr) {
    if (uses_documents(data, o.packing))
      corpus_ = std::make_unique<document_corpus>(data, o.model.vocab_size, min_doc_tokens, o.seed);
    else if (!data.empty())
      file_ = open_token_stream(data, o.seq_len, o.model.vocab_size);
  }
  // Sequence `index` (counted from 1 over the whole run) of the passkey task, or the data's
  // sequence at `position` (tokens consumed before it), which then moves on. A shorter
  // `length` (the short-sequence stage) takes a passkey sample of that length, or the first
  // `length` tokens of the data's window.
  packed_sequence next(std::int64_t index, std::int64_t& position, std::int64_t length) {
    packed_sequence out;
    if (task_) {
      out.tokens = length == task_->seq_len() ? task_->sample(seed_, static_cast<std::uint64_t>(index)).tokens
                                              : passkey_task(length).sample(seed_, static_cast<std::uint64_t>(index)).tokens;
      return out;
    }
    if (corpus_) {
      out = corpus_->window(position, length);
      position += length;
      return out;
    }
    out.tokens = file_->sequence(position);
    out.tokens.resize(static_cast<std::size_t>(length));
    position = file_->next_position(position);
    return out;
  }
  const passkey_task* task() const { return task_.get(); }
  double epoch(std::int64_t position) const {
    return corpus_ ? static_cast<double>(position) / static_cast<double>(corpus_->epoch_tokens()) : 0.0;
  }

 private:
  std::uint64_t seed_;
  std::unique_ptr<passkey_task> task_;
  std::unique_ptr<document_corpus> corpus_;
  std::unique_ptr<token_file> file_;
};

bool uses_lora(const train_options& o) { return o.step.lora.enabled(); }

// The base a LoRA run's adapters belong to, as adapter_config.json names it: its directory
// (absolute), or the preset's name.
std::string base_model_name(const train_options& o) {
  return o.model_dir.empty() ? o.model.name : std::filesystem::absolute(o.model_dir).lexically_normal().string();
}

// LoRA's adapters are a few MiB to a few hundred: their working weights stay whole on every
// rank (ZeRO-2) whatever --zero says of the base, their fp32 state sharded.
zero_stage adapter_stage(const train_options& o) {
  return o.zero == zero_stage::replicated ? zero_stage::replicated : zero_stage::two;
}

// Everything one rank holds for the run: one transformer per sequence length (more
// than one only under sequence-length warmup).
struct rank_context {
  const train_options& options;
  backend& be;
  communicator& comm;
  parameter_store params;                     // the model; frozen under LoRA
  std::unique_ptr<parameter_store> adapters;  // LoRA's adapters, the trained store then
  std::map<std::int64_t, std::unique_ptr<transformer>> models;

  rank_context(const train_options& o, backend& b, communicator& c)
      : options(o), be(b), comm(c),
        params(o.model, parameter_specs(o.model), b, c, o.zero,
               uses_lora(o) ? offload_options{} : offload_options{o.offload_optimizer, o.offload_params},
               uses_lora(o) ? weight_role::frozen : weight_role::trained) {
    if (uses_lora(o))
      adapters = std::make_unique<parameter_store>(o.model, lora_parameter_specs(o.model, o.step.lora), b, c,
                                                   adapter_stage(o), offload_options{o.offload_optimizer, false},
                                                   weight_role::trained);
  }

  // The store whose gradients and optimizer state the run keeps.
  parameter_store& trained() { return adapters ? *adapters : params; }

  transformer& model(std::int64_t seq_len) {
    auto& m = models[seq_len];
    if (!m) m = std::make_unique<transformer>(options.model, options.cp, seq_len, be, cp_groups{&comm, &comm}, options.step);
    return *m;
  }
};

// One optimizer step over the step's sequences: gradients of every sequence accumulate
// in the shards, and the loss is the mean over all counted tokens of the step.
double run_step(rank_context& rc, const std::vector<packed_sequence>& batch, std::int64_t step, step_record& record) {
  const train_options& o = rc.options;
  std::vector<prepared_sequence> seqs;
  std::int64_t counted = 0;
  record.model_flops = 0;
  for (const auto& s : batch) {
    record.model_flops += uses_lora(o) ? lora_model_flops(o.model, o.step.lora, s.length(), s.documents)
                                       : o.model.model_flops(s.length(), s.documents);
    if (s.tokens.empty()) {  // meta: shapes only, every label but the last counted
      counted += s.length() - 1;
      continue;
    }
    seqs.push_back(prepare_sequence(s.tokens, layout_unit(o.cp), s.documents));
    counted += seqs.back().counted;
  }
  if (counted == 0)  // only documents of one token (corpora of none of two are refused at the start)
    throw config_error("step " + std::to_string(step) + "'s sequences of " + o.data_path + " hold no token to predict "
                       "(documents of one token each, and attention stays within a document): leave such documents "
                       "out with --min-doc-tokens 2, or use --packing stream");
  transformer& model = rc.model(batch.front().length());
  const auto runs = model.local_positions(rc.comm.rank());
  parameter_store& trained = rc.trained();
  trained.zero_grads();
  const bool update = trained.stage() != zero_stage::replicated;  // else forward and backward only (planner)
  if (update) record.lr = scheduled_lr(o.optim, step);
  // Offloaded, the host starts on each unit's final gradients as they land.
  const auto last_micro_batch = [&](std::size_t i) {
    if (update && i + 1 == batch.size()) trained.announce_update(o.optim, step, record.lr);
  };
  double local = 0;
  if (seqs.empty()) {
    UPIPE_CHECK(!rc.be.has_data(), "a sequence without tokens runs on the meta backend only");
    for (std::size_t i = 0; i < batch.size(); ++i) {  // no host ids: meta reads none
      last_micro_batch(i);
      local += model.forward_backward(rc.params, {{}, {}, 1.0 / static_cast<double>(counted), batch[i].documents},
                                      rc.adapters.get());
    }
  }
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const prepared_sequence& seq = seqs[i];
    const auto ids = shard_rows(seq.ids, 1, runs, model.local_tokens());
    const auto labels = shard_rows(seq.labels, 1, runs, model.local_tokens());
    last_micro_batch(i);
    local += model.forward_backward(rc.params, {ids, labels, 1.0 / static_cast<double>(counted), seq.documents},
                                    rc.adapters.get());
  }
  record.loss = sum_over_ranks(rc.comm, local, "loss_sum") / static_cast<double>(counted);
  if (!update) return record.loss;
  record.grad_norm = trained.grad_norm();
  if (!std::isfinite(record.grad_norm))
    throw config_error("the gradient norm is not finite at step " + std::to_string(step) +
                       ": training diverged; lower --lr (now " + real_text(o.optim.lr) + ")" +
                       (uses_lora(o) ? " or the adapters' scale alpha / r (now --lora " + lora_text(o.step.lora) + ")"
                                     : std::string()));
  trained.adamw_step(o.optim, step, record.lr, clip_coefficient(o.optim, record.grad_norm));
  return record.loss;
}

// The file the data's tokens are in: a corpus's PREFIX.tokens, or the token file.
std::string data_tokens_file(const train_options& o) {
  return document_corpus::exists(o.data_path) ? o.data_path + ".tokens" : o.data_path;
}

std::uint64_t file_bytes(const std::string& path) {
  std::error_code ec;
  const auto n = std::filesystem::file_size(path, ec);
  return ec ? 0 : static_cast<std::uint64_t>(n);
}

// The model as trained, for its saved config.json: the context it declares covers the
// trained length.
model_config trained_config(const train_options& o) {
  model_config c = o.model;
  c.max_position_embeddings = std::max(c.max_position_embeddings, o.seq_len);
  return c;
}

// Where the steps of this run's shape began: step 0 at position 0; for a resume of the
// saved shape, where that shape began; for a resume of another shape, the saved step.
std::pair<std::int64_t, std::int64_t> shape_begin(const train_options& o, const saved_state* resume) {
  if (resume == nullptr) return {0, 0};
  const trainer_state& st = resume->state();
  const bool same = st.batch == o.batch && st.seq_len == o.seq_len && st.seq_warmup == o.seq_warmup &&
                    st.warmup_seq_len == (o.seq_warmup > 0 ? step_seq_len(o, 1) : 0);
  return same ? std::pair{st.shape_step, st.shape_position} : std::pair{st.step, st.data_position};
}

void save(rank_context& rc, const std::string& dir, std::int64_t step, std::int64_t position,
          std::pair<std::int64_t, std::int64_t> shape) {
  if (!rc.be.has_data()) return;
  const train_options& o = rc.options;
  checkpoint_request r;
  r.config = trained_config(o);
  r.source_dir = o.model_dir;
  r.model = o.save_model;
  r.state = {step,
             position,
             o.seed,
             o.optim.total_steps,
             o.data_path.empty() ? "passkey" : o.data_path,
             o.data_path.empty() ? 0 : file_bytes(data_tokens_file(o)),
             uses_documents(o) ? "documents" : "stream",
             o.min_doc_tokens,
             o.batch,
             o.seq_len,
             o.seq_warmup,
             o.seq_warmup > 0 ? step_seq_len(o, 1) : 0,
             shape.first,
             shape.second};
  r.strategy = std::string(strategy_name(o.cp.strategy));
  r.head_chunk = o.cp.head_chunk;
  r.seq_len = o.seq_len;
  r.lora = o.step.lora;
  r.base_model = base_model_name(o);
  save_checkpoint(dir, r, rc.trained(), rc.comm);
}

// The mean held-out loss over eval_sequences windows of `length` tokens, forward only: the
// training state (weights, moments, data position) is untouched.
double held_out_loss(rank_context& rc, data_source& held_out, std::int64_t length) {
  const train_options& o = rc.options;
  transformer& model = rc.model(length);
  const auto runs = model.local_positions(rc.comm.rank());
  double local = 0;
  std::int64_t counted = 0;
  std::int64_t position = 0;
  for (int i = 0; i < o.eval_sequences; ++i) {
    const packed_sequence s = held_out.next(i + 1, position, length);
    const prepared_sequence seq = prepare_sequence(s.tokens, layout_unit(o.cp), s.documents);
    const auto ids = shard_rows(seq.ids, 1, runs, model.local_tokens());
    const auto labels = shard_rows(seq.labels, 1, runs, model.local_tokens());
    for (const float loss : model.forward_scores(rc.params, {ids, labels, 1.0, seq.documents}, {}, rc.adapters.get()).losses)
      local += loss;
    counted += seq.counted;
  }
  if (counted == 0)
    throw config_error("the held-out sequences of " + o.eval_data + " hold no token to predict (documents of one token "
                       "each): hold out documents of several tokens, or use --packing stream");
  return sum_over_ranks(rc.comm, local, "eval_loss_sum") / static_cast<double>(counted);
}

// Teacher-forced retrieval on held-out samples: the argmax at the position before each
// answer digit must be that digit.
double evaluate(rank_context& rc, const passkey_task& task) {
  double right = 0;
  transformer& model = rc.model(rc.options.seq_len);
  for (int i = 0; i < rc.options.eval_samples; ++i) {
    const passkey_sample sample = task.sample(rc.options.seed ^ held_out_stream, static_cast<std::uint64_t>(i));
    const prepared_sequence seq = prepare_sequence(sample.tokens, layout_unit(rc.options.cp));
    std::vector<std::int64_t> before_digits;
    for (std::int64_t k = 0; k < passkey_task::key_digits; ++k) before_digits.push_back(sample.answer_start + k - 1);
    right += passkey_task::digits_right(
        sample, score_sequence(model, rc.params, rc.comm, seq, before_digits, rc.adapters.get()).argmax);
  }
  return rc.options.eval_samples > 0 ? right / rc.options.eval_samples : 0.0;
}

// Where a rank's weights come from: a resumed trainer state, or the initial weights; under
// LoRA the frozen base always from `init` and the adapters from the state or `adapters`.
struct weight_sources {
  const saved_state* resume = nullptr;
  const weight_source* init = nullptr;
  const weight_source* adapters = nullptr;
};

void run_rank(const train_options& o, backend& be, communicator& comm, const weight_sources& from,
              train_summary& summary, const std::function<void(const step_record&)>& on_step,
              clock_type::time_point start) {
  rank_context rc(o, be, comm);
  std::int64_t first = 1, position = 0;
  if (from.init != nullptr && (from.resume == nullptr || rc.adapters)) rc.params.load(*from.init);
  if (from.resume != nullptr) {
    rc.trained().load_state([resume = from.resume](int u, shard_state which, std::int64_t begin, std::int64_t count,
                                                   float* out) { resume->read(u, which, begin, count, out); });
    first = from.resume->state().step + 1;
    position = from.resume->state().data_position;
  } else if (from.adapters != nullptr && rc.adapters) {
    rc.adapters->load(*from.adapters);
  }
  be.synchronize();
  comm.barrier();
  if (comm.rank() == 0) summary.load_seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  data_source data(o);
  std::unique_ptr<data_source> held_out;
  if (o.eval_every > 0) held_out = std::make_unique<data_source>(o, o.eval_data, 0);
  const std::int64_t last = o.stop_after > 0 ? o.stop_after : o.optim.total_steps;
  for (std::int64_t step = first; step <= last; ++step) {
    const auto start = clock_type::now();
    step_record record;
    record.step = step;
    record.seq_len = step_seq_len(o, step);
    record.epoch = data.epoch(position);
    std::vector<packed_sequence> batch;
    for (std::int64_t i = 0; i < o.batch; ++i)
      batch.push_back(data.next((step - 1) * o.batch + i + 1, position, record.seq_len));
    run_step(rc, batch, step, record);
    record.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
    record.tokens_per_s = static_cast<double>(record.seq_len * o.batch) / record.seconds;
    if (held_out && be.has_data() && (step % o.eval_every == 0 || step == last))
      record.eval_loss = held_out_loss(rc, *held_out, record.seq_len);
    if (comm.rank() == 0) {
      record.peak_bytes = be.ledger().peaks_by_name();
      summary.steps.push_back(record);
      if (on_step) on_step(record);
    }
    if (!o.save_dir.empty() && o.save_every > 0 && step % o.save_every == 0 && step != last)
      save(rc, o.save_dir, step, position, shape_begin(o, from.resume));
  }
  if (!o.save_dir.empty()) save(rc, o.save_dir, last, position, shape_begin(o, from.resume));
  if (data.task() != nullptr && be.has_data() && o.eval_samples > 0) {
    const double accuracy = evaluate(rc, *data.task());
    if (comm.rank() == 0) summary.retrieval_accuracy = accuracy;
  }
  summary.peak_bytes[comm.rank()] = be.ledger().peaks_by_name();
  if (comm.rank() == 0) summary.arena_high_water = be.device_arena().high_water();
}

step_memory memory_of(const backend& be) {
  step_memory m;
  m.peak_bytes = be.ledger().peaks_by_name();
  m.device_peak = be.ledger().device_peak();
  m.arena_high_water = be.device_arena().high_water();
  m.host_high_water = be.host_arena().high_water();
  m.workspace_at_end = be.ledger().current(mem_tag::workspace);
  return m;
}

std::int64_t shortest_sequence(const train_options& o) { return o.data_path.empty() ? passkey_task::min_seq_len() : 2; }

// The warmup's first length: as given, or a quarter of seq_len rounded up to the
// layout's unit (at least the passkey task's minimum, at most seq_len).
std::int64_t warmup_start(const train_options& o) {
  if (o.seq_warmup_start > 0) return o.seq_warmup_start;
  const std::int64_t unit = layout_unit(o.cp);
  return std::min(o.seq_len, (std::max(shortest_sequence(o), o.seq_len / 4) + unit - 1) / unit * unit);
}

void validate_seq_warmup(const train_options& o) {
  if (o.seq_warmup < 0 || o.seq_warmup > o.optim.total_steps)
    throw config_error("--seq-warmup " + std::to_string(o.seq_warmup) + " must lie between 0 (off) and --steps " +
                       std::to_string(o.optim.total_steps));
  if (o.seq_warmup == 0) return;
  const std::int64_t unit = layout_unit(o.cp), shortest = shortest_sequence(o), start = warmup_start(o);
  if (start < shortest || start > o.seq_len || start % unit != 0) {
    train_options fixed = o;
    fixed.seq_warmup_start = 0;
    throw config_error("--seq-warmup-start " + std::to_string(start) + " must be a multiple of " +
                       std::to_string(unit) + " (the layout's unit for " + std::string(strategy_name(o.cp.strategy)) +
                       " with --cp " + std::to_string(o.cp.cp) + ") between " + std::to_string(shortest) +
                       " and --seq-len " + std::to_string(o.seq_len) + "; use --seq-warmup-start " +
                       std::to_string(warmup_start(fixed)));
  }
  attention_config_for(o.model, o.cp, start);
}

}  // namespace

std::int64_t step_seq_len(const train_options& o, std::int64_t step) {
  return step <= o.seq_warmup ? warmup_start(o) : o.seq_len;
}

void validate(const train_options& o) {
  validate(o.model);
  require_within(o.optim.total_steps, 1, limits::steps, "--steps", "--steps 200");
  if (o.stop_after < 0 || o.stop_after > o.optim.total_steps)
    throw config_error("--stop-after " + std::to_string(o.stop_after) + " must lie between 1 and --steps " +
                       std::to_string(o.optim.total_steps) + " (it stops a run early; --steps is the schedule's length)");
  if (o.offload_params && !o.offload_optimizer)
    throw config_error("the weights go to host memory only with the optimizer (AdamW writes them there): use "
                       "--offload optimizer,params");
  if (o.offload_params && o.step.lora.enabled())
    throw config_error("--offload optimizer,params with --lora: a LoRA run's frozen base stays in GPU memory (under "
                       "ZeRO-3 sharded over the CP group) and its adapters' state may go to the host; use --offload "
                       "optimizer");
  if (o.batch < 1 || o.batch > max_batch)
    throw config_error("--batch " + std::to_string(o.batch) + " must lie between 1 and " + std::to_string(max_batch) +
                       " (sequences per optimizer step, their gradients accumulated; for example --batch 8)");
  if (o.save_every < 0 || (o.save_every > 0 && o.save_dir.empty()))
    throw config_error("--save-every " + std::to_string(o.save_every) + " needs --save DIR (where to write)");
  if (!o.resume_dir.empty() && !o.init_path.empty() && !uses_lora(o))
    throw config_error("--resume and --init contradict each other: a resumed run takes its weights from the checkpoint; "
                       "drop --init");
  if (uses_lora(o)) validate(o.step.lora, o.model);
  if (!o.init_adapter.empty() && !uses_lora(o))
    throw config_error("--init-adapter " + o.init_adapter + " needs LoRA: pass --lora with the adapter's settings");
  if (!o.init_adapter.empty() && !o.resume_dir.empty())
    throw config_error("--resume and --init-adapter contradict each other: a resumed run takes its adapters from the "
                       "checkpoint; drop --init-adapter");
  if (!(o.optim.lr > 0) || !std::isfinite(o.optim.lr))
    throw config_error("--lr " + std::to_string(o.optim.lr) + " must be a positive number (for example 3e-3)");
  // Decoupled decay multiplies each matrix by 1 - lr * wd per step: beyond 1 it flips signs.
  if (!(o.optim.weight_decay >= 0) || !(o.optim.lr * o.optim.weight_decay < 1)) {
    char text[160];
    std::snprintf(text, sizeof text, "--weight-decay %g with --lr %g decays the weights by lr x wd = %g per step",
                  o.optim.weight_decay, o.optim.lr, o.optim.lr * o.optim.weight_decay);
    throw config_error(std::string(text) + ", which must lie in [0, 1) (for example --weight-decay 0.1)");
  }
  // The step's sequences exist on the host first (tokens, padded ids and labels, each
  // rank's shard: 24 bytes a token); meta holds none.
  if (o.backend != backend_kind::meta)
    require_host_memory(static_cast<std::size_t>(o.batch) * static_cast<std::size_t>(o.seq_len) * 24,
                        "the host copies of a step's --batch " + std::to_string(o.batch) + " sequences of --seq-len " +
                            std::to_string(o.seq_len) + " tokens");
  if (o.data_path.empty() && o.model.vocab_size < passkey_task::vocab_needed)
    throw config_error("the passkey task needs a vocabulary of at least " + std::to_string(passkey_task::vocab_needed) +
                       " tokens and " + o.model.name + " has " + std::to_string(o.model.vocab_size) + "; use --data FILE");
  if (o.data_path.empty() && o.seq_len < passkey_task::min_seq_len())
    passkey_task check(o.seq_len);  // throws with the minimum
  if (o.seq_len < 2) throw config_error("--seq-len must be at least 2");
  if (o.eval_every < 0 || (o.eval_every > 0 && o.eval_data.empty()))
    throw config_error("--eval-every " + std::to_string(o.eval_every) +
                       " needs --eval-data PREFIX (held-out data: upipe prepare-data --heldout-fraction writes it)");
  if (o.eval_every == 0 && !o.eval_data.empty())
    throw config_error("--eval-data " + o.eval_data + " is given without --eval-every N, so it would never be read; "
                       "add --eval-every 100 (held-out loss every 100 steps), or drop --eval-data");
  if (o.eval_every > 0 && o.eval_sequences < 1)
    throw config_error("--eval-sequences " + std::to_string(o.eval_sequences) + " must be at least 1 (e.g. 4)");
  if (o.seq_len % layout_unit(o.cp) != 0) {
    const std::int64_t unit = layout_unit(o.cp), fixed = (o.seq_len / unit + 1) * unit;
    throw config_error("--seq-len " + std::to_string(o.seq_len) + " must be a multiple of " + std::to_string(unit) +
                       " for " + std::string(strategy_name(o.cp.strategy)) + " with --cp " + std::to_string(o.cp.cp) +
                       " in training (every step has the same shape); use --seq-len " + std::to_string(fixed));
  }
  attention_config_for(o.model, o.cp, o.seq_len);
  validate_seq_warmup(o);
}

step_memory measure_step_memory(const train_options& o) {
  UPIPE_CHECK(o.backend == backend_kind::meta, "measure_step_memory runs on the meta backend");
  return time_steps(o, 0, 1, group_run::every_rank).memory;
}

step_timing time_steps(const train_options& o, std::int64_t warmup_len, int repeats, group_run ranks,
                       phase_timing phases) {
  validate(o);
  UPIPE_CHECK(repeats >= 1, "time_steps needs at least one timed step");
  // Random ids where there is data; zeros on meta, which never reads them.
  const auto tokens = [&](const backend& be, std::int64_t n, std::uint64_t stream) {
    packed_sequence s;
    if (!be.has_data()) {
      s.shape_only = n;
      return s;
    }
    s.tokens.resize(static_cast<std::size_t>(n));
    std::uint64_t x = o.seed * 0x9e3779b97f4a7c15ull + stream;
    for (auto& id : s.tokens) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      id = static_cast<std::int32_t>((x >> 33) % static_cast<std::uint64_t>(o.model.vocab_size));
    }
    return s;
  };
  step_timing out;
  // Random weights wherever there is data: a step over zeros would time multiplications of
  // zeros (which draw less power) and its loss would be log(vocab) whatever the strategy.
  const host_weights init = o.backend == backend_kind::meta ? host_weights{} : random_weights(o.model, o.seed);
  const host_weights adapters = o.backend == backend_kind::meta || !uses_lora(o)
                                    ? host_weights{}
                                    : initial_adapters(o.model, o.step.lora, o.seed);
  run_cp_group(
      o.backend, o.limits, o.cp.cp,
      [&](int rank, backend& be, communicator& comm) {
        rank_context rc(o, be, comm);
        rc.params.load(init);
        if (rc.adapters) rc.adapters->load(adapters);
        step_record record;
        if (warmup_len > 0) run_step(rc, {tokens(be, warmup_len, 0)}, 1, record);
        for (int i = 0; i < repeats; ++i) {
          const std::vector<packed_sequence> batch{tokens(be, o.seq_len, 1 + static_cast<std::uint64_t>(i))};
          be.synchronize();
          comm.barrier();
          be.set_phase_timing(phases == phase_timing::by_phase);
          const auto start = clock_type::now();
          run_step(rc, batch, 1 + i, record);
          rc.params.finish_host_work();  // an offloaded update belongs to its step
          be.synchronize();
          comm.barrier();
          const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
          std::map<std::string, double> by_phase = be.take_phase_ms();
          be.set_phase_timing(false);
          if (rank == 0) {
            if (out.seconds.empty() || seconds < *std::min_element(out.seconds.begin(), out.seconds.end()))
              out.phases_ms = std::move(by_phase);
            out.seconds.push_back(seconds);
            out.losses.push_back(record.loss);
            out.grad_norms.push_back(record.grad_norm);
          }
        }
        if (rank != 0) return;
        out.memory = memory_of(be);
        out.driver_peak = be.driver_peak_bytes();
      },
      ranks, o.comm);
  return out;
}

namespace {

// The data position a save records follows from the steps before it (their batch and
// lengths); one that does not is a damaged or edited state. A run of another shape
// continues from the saved position, and says so.
void check_resumed_position(const train_options& o, const saved_state& saved) {
  const trainer_state& st = saved.state();
  if (!saved.shape_recorded()) return;  // a save of an earlier upipe
  if (st.batch != o.batch || st.seq_len != o.seq_len)
    std::fprintf(stderr, "upipe: note: the checkpoint trained --batch %lld --seq-len %lld; this run takes --batch %lld "
                 "--seq-len %lld, continuing from its data position %lld\n", static_cast<long long>(st.batch),
                 static_cast<long long>(st.seq_len), static_cast<long long>(o.batch),
                 static_cast<long long>(o.seq_len), static_cast<long long>(st.data_position));
  // The tokens the steps since the shape began consumed; each sequence moves a token file on
  // by a whole seq_len, and a corpus by the sequence's length.
  const __int128 steps = st.step - st.shape_step;
  const __int128 warm = std::clamp<std::int64_t>(st.seq_warmup - st.shape_step, 0, st.step - st.shape_step);
  __int128 expected = 0;
  if (st.data == "passkey")
    expected = 0;
  else if (st.packing == "documents")
    expected = st.shape_position + __int128{st.batch} * (warm * st.warmup_seq_len + (steps - warm) * st.seq_len);
  else if (st.data_bytes >= 4)
    expected = (st.shape_position + __int128{st.batch} * steps * st.seq_len) % static_cast<__int128>(st.data_bytes / 4);
  if (expected != st.data_position)
    throw io_error("the trainer state in " + saved.dir() + " is damaged: its data position " +
                   std::to_string(st.data_position) + " does not follow from its " +
                   std::to_string(st.step - st.shape_step) + " steps of " + std::to_string(st.batch) + " x " + std::to_string(st.seq_len) +
                   " tokens; restore the checkpoint, or start a new run from its weights with --init " + saved.dir());
}

// A LoRA run resumes a LoRA run's adapters of the same shape and settings (the base is the
// run's --model, frozen: not part of the trainer state).
void check_resumed_adapters(const train_options& o, const saved_state& saved) {
  if (!is_adapter_directory(saved.dir()))
    throw config_error("cannot resume LoRA from " + o.resume_dir + ": it holds a full model's trainer state (no " +
                       adapter_config_file + "); start LoRA on its weights with --model " + o.resume_dir +
                       " and no --resume, or resume it without --lora");
  const adapter_settings settings = read_adapter_config(saved.dir(), o.model);
  // The manifest records the adapters the state was trained as; an adapter_config.json that
  // says otherwise was edited (or copied from another run).
  if (!saved.lora().empty() && saved.lora() != lora_text(settings.lora))
    throw config_error("cannot resume from " + o.resume_dir + ": its " + adapter_config_file + " says --lora " +
                       lora_text(settings.lora) + " but its trainer state was saved as --lora " + saved.lora() +
                       " (trainer/manifest.json): the file was edited or replaced; restore it");
  if (!(settings.lora == o.step.lora))
    throw config_error("cannot resume from " + o.resume_dir + ": its adapters are --lora " + lora_text(settings.lora) +
                       ", not " + lora_text(o.step.lora) + "; pass --lora " + lora_text(settings.lora));
  saved.check_units(o.model, o.step.lora);
  // The base is not in the checkpoint: another one of the same shape is allowed, and said aloud.
  const std::string base = base_model_name(o);
  if (!settings.base_model.empty() && settings.base_model != base)
    std::fprintf(stderr, "upipe: note: the adapters in %s were trained on %s; they continue on %s\n",
                 o.resume_dir.c_str(), settings.base_model.c_str(), base.c_str());
}

// A full run resumes a full run of the same model; the RoPE and epsilon it may change on
// purpose (context extension) are said aloud.
void check_resumed_model(const train_options& o, const saved_state& saved) {
  if (is_adapter_directory(saved.dir()))
    throw config_error("cannot resume from " + o.resume_dir + ": it holds LoRA adapters (" + adapter_config_file +
                       "); resume it with --lora as it was trained (its " + adapter_config_file + " says which) and "
                       "its base as --model");
  const model_config saved_model = read_hf_config(saved.dir());
  check_same_model(saved_model, o.model, saved.dir());
  saved.check_units(o.model);
  if (!(saved_model.rope == o.model.rope))
    std::fprintf(stderr, "upipe: note: the RoPE differs from the checkpoint's config.json (theta %g, %s scaling); "
                 "the run continues with theta %g, %s scaling\n", saved_model.rope.theta,
                 rope_kind_name(saved_model.rope.scaling.kind), o.model.rope.theta,
                 rope_kind_name(o.model.rope.scaling.kind));
  if (saved_model.rms_norm_eps != o.model.rms_norm_eps)
    std::fprintf(stderr, "upipe: note: rms_norm_eps is %g, the checkpoint's config.json has %g\n", o.model.rms_norm_eps,
                 saved_model.rms_norm_eps);
}

// A resumed run must continue the saved one: the same model and the same data.
void check_resume(const train_options& o, const saved_state& saved) {
  if (uses_lora(o))
    check_resumed_adapters(o, saved);
  else
    check_resumed_model(o, saved);
  const trainer_state& st = saved.state();
  if (st.seed != o.seed)
    throw config_error("cannot resume from " + o.resume_dir + ": it was trained with --seed " + std::to_string(st.seed) +
                       " (the order of its data and its held-out samples), not " + std::to_string(o.seed) +
                       "; pass --seed " + std::to_string(st.seed));
  // What a resume may change on purpose, said aloud: the schedule's length.
  if (st.total_steps != 0 && st.total_steps != o.optim.total_steps)
    std::fprintf(stderr, "upipe: note: the schedule now runs to step %lld (it ran to %lld when saved): the learning "
                 "rate from step %lld follows the new schedule\n", static_cast<long long>(o.optim.total_steps),
                 static_cast<long long>(st.total_steps), static_cast<long long>(st.step + 1));
  if (st.step >= (o.stop_after > 0 ? o.stop_after : o.optim.total_steps))
    throw config_error("the checkpoint in " + o.resume_dir + " is at step " + std::to_string(st.step) +
                       ", past the last step asked for; raise --steps or --stop-after");
  const std::string data = o.data_path.empty() ? "passkey" : o.data_path;
  if ((st.data == "passkey") != (data == "passkey") ||
      (data != "passkey" && std::filesystem::weakly_canonical(st.data) != std::filesystem::weakly_canonical(data)))
    throw config_error("cannot resume from " + o.resume_dir + ": it was trained on " +
                       (st.data == "passkey" ? std::string("the passkey task") : "--data " + st.data) + ", not " +
                       (data == "passkey" ? std::string("the passkey task") : "--data " + data) + "; pass " +
                       (st.data == "passkey" ? std::string("no --data") : "--data " + st.data));
  const std::uint64_t bytes = data == "passkey" ? 0 : file_bytes(data_tokens_file(o));
  if (data != "passkey" && st.data_bytes != 0 && bytes != st.data_bytes)
    throw config_error("cannot resume from " + o.resume_dir + ": the data file " + data_tokens_file(o) + " holds " +
                       std::to_string(bytes) + " bytes but held " + std::to_string(st.data_bytes) +
                       " when the checkpoint was saved; resume on the same data, or start a new run with --init " +
                       o.resume_dir);
  const std::string packing = uses_documents(o) ? "documents" : "stream";
  if (data != "passkey" && (st.packing != packing || st.min_doc_tokens != o.min_doc_tokens))
    throw config_error("cannot resume from " + o.resume_dir + ": it packed the data as --packing " + st.packing +
                       " --min-doc-tokens " + std::to_string(st.min_doc_tokens) + ", not --packing " + packing +
                       " --min-doc-tokens " + std::to_string(o.min_doc_tokens) +
                       " (another order of sequences); pass those");
  check_resumed_position(o, saved);
}

// Where the first step's weights come from: --init, else the --model directory, else random.
std::unique_ptr<weight_source> initial_weights(const train_options& o, host_weights& random) {
  const std::string path = !o.init_path.empty() ? o.init_path : o.model_dir;
  const bool none_there = o.init_path.empty() && !o.model_dir.empty() && !has_weight_files(o.model_dir) &&
                          o.weights_in_model_dir == train_options::model_dir_weights::optional;
  if (path.empty() || none_there) {
    random = random_weights(o.model, o.seed);
    return std::make_unique<host_weight_source>(random);
  }
  auto files = std::make_unique<hf_model_files>(path, o.model);
  if (!files->unused().empty()) {
    std::string names;
    for (std::size_t i = 0; i < files->unused().size() && i < 8; ++i) names += (i ? ", " : "") + files->unused()[i];
    if (files->unused().size() > 8) names += ", ...";
    std::fprintf(stderr, "upipe: warning: %s holds %zu tensor(s) the model does not use, ignored: %s\n", path.c_str(),
                 files->unused().size(), names.c_str());
  }
  return files;
}

}  // namespace

train_summary train(const train_options& o, const std::function<void(const step_record&)>& on_step) {
  validate(o);
  // Everything that can be checked before the first step is: the save directory, the
  // checkpoint or the weights against the model, the data file's ids.
  const auto start = clock_type::now();
  if (!o.save_dir.empty()) check_save_dir(o.save_dir);
  std::unique_ptr<saved_state> resume;
  std::unique_ptr<weight_source> init, adapter_init;
  host_weights random, random_adapters;
  if (!o.resume_dir.empty()) {
    resume = std::make_unique<saved_state>(o.resume_dir);
    check_resume(o, *resume);
  }
  // The frozen base of a LoRA run is never in its trainer state.
  if (o.backend != backend_kind::meta && (!resume || uses_lora(o))) init = initial_weights(o, random);
  if (o.backend != backend_kind::meta && !resume && uses_lora(o)) {
    if (!o.init_adapter.empty()) {
      adapter_init = std::make_unique<adapter_files>(o.init_adapter, o.model, o.step.lora);
    } else {
      random_adapters = initial_adapters(o.model, o.step.lora, o.seed);
      adapter_init = std::make_unique<host_weight_source>(random_adapters);
    }
  }
  if (o.eval_every > 0) {
    if (uses_documents(o.eval_data, o.packing)) {
      const document_corpus held_out(o.eval_data, o.model.vocab_size, 0, o.seed);
      held_out.check_ids();
      held_out.check_documents_predict();
    }
    else
      open_token_stream(o.eval_data, o.seq_len, o.model.vocab_size)->check_ids();
  }
  if (!o.data_path.empty()) {
    if (o.packing == packing_mode::documents && !document_corpus::exists(o.data_path))
      throw config_error("--packing documents needs a document index: " + o.data_path +
                         ".index is missing (upipe prepare-data writes PREFIX.tokens, PREFIX.index and PREFIX.json; "
                         "pass --data PREFIX), or use --packing stream for a flat token file");
    if (uses_documents(o)) {
      const document_corpus corpus(o.data_path, o.model.vocab_size, o.min_doc_tokens, o.seed);
      corpus.check_ids();
      corpus.check_documents_predict();
    }
    else
      open_token_stream(o.data_path, o.seq_len, o.model.vocab_size)->check_ids();
  }
  train_summary summary;
  summary.seq_len = o.seq_len;
  summary.peak_bytes.resize(static_cast<std::size_t>(o.cp.cp));
  try {
    run_cp_group(
        o.backend, o.limits, o.cp.cp,
        [&](int, backend& be, communicator& comm) {
          run_rank(o, be, comm, {resume.get(), init.get(), adapter_init.get()}, summary, on_step, start);
        },
        group_run::every_rank, o.comm);
  } catch (...) {
    if (!o.save_dir.empty()) remove_save_temporary(o.save_dir);
    throw;
  }
  summary.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  return summary;
}

}  // namespace upipe
