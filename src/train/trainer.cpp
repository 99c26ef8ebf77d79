#include "train/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include <nlohmann/json.hpp>
#include <optional>

#include <unistd.h>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "core/limits.hpp"
#include "core/files.hpp"
#include "model/adapter_files.hpp"
#include "model/model_step.hpp"
#include "runtime/cp_group.hpp"
#include "train/data.hpp"
#include "train/mesh.hpp"
#include "train/phase_recorder.hpp"
#include "train/run_directory.hpp"
#include "train/run_memory.hpp"
#include "train/train_checkpoint.hpp"
#include "train/trainer_data.hpp"

namespace upipe {

namespace {

constexpr std::uint64_t held_out_stream = 0x9e3779b97f4a7c15ull;  // eval samples never seen in training

using clock_type = std::chrono::steady_clock;

bool uses_lora(const train_options& o) { return o.step.lora.enabled(); }

// LoRA's adapters are a few MiB to a few hundred: their working weights stay whole on every
// rank (ZeRO-2) whatever --zero says of the base, their fp32 state sharded.
zero_stage adapter_stage(const train_options& o) {
  return o.zero == zero_stage::replicated ? zero_stage::replicated : zero_stage::two;
}

// Everything one rank holds for the run: one transformer per sequence length (more
// than one only under sequence-length warmup). The stores are sharded over the world (every
// replica's ranks), the attention runs over the rank's CP group.
struct rank_context {
  const train_options& options;
  backend& be;
  communicator& comm;  // the world: D x C ranks
  communicator& cp;    // this rank's replica: C ranks (the world when D = 1)
  communicator& shards;  // ZeRO's: the stores' shards and saved files are numbered by it
  communicator* experts;  // expert parallelism's EP group (null without)
  parameter_store params;                     // the model; frozen under LoRA
  std::unique_ptr<parameter_store> adapters;  // LoRA's adapters, the trained store then
  std::map<std::int64_t, std::unique_ptr<transformer>> models;

  rank_context(const train_options& o, backend& b, const mesh_comms& mesh)
      : options(o), be(b), comm(mesh.world), cp(mesh.cp), shards(mesh.shards), experts(mesh.expert_peers),
        params(o.model, parameter_specs(o.model), b, mesh.shards, o.zero, uses_lora(o) ? offload_options{} : offload_of(o),
               uses_lora(o) ? weight_role::frozen : weight_role::trained, state_options_of(o), experts_of(mesh)) {
    if (uses_lora(o))
      adapters = std::make_unique<parameter_store>(o.model, lora_parameter_specs(o.model, o.step.lora), b, mesh.shards,
                                                   adapter_stage(o), offload_options{o.offload_optimizer, false},
                                                   weight_role::trained);
  }

  // This rank's replica, 0 .. D - 1.
  int replica() const { return comm.rank() / cp.size(); }

  // The store whose gradients and optimizer state the run keeps.
  parameter_store& trained() { return adapters ? *adapters : params; }

  transformer& model(std::int64_t seq_len) {
    auto& m = models[seq_len];
    if (!m)
      m = std::make_unique<transformer>(options.model, options.cp, seq_len, be, cp_groups{&cp, &cp}, options.step,
                                        experts);
    return *m;
  }
};

// One optimizer step over the step's sequences (this replica's): gradients of every
// sequence accumulate in the shards, and the loss is the mean over all counted targets of
// the step, every replica's (the gradient scale 1 / targets, as transformers' mean over
// labels that are not -100; ZeRO's reduce-scatter sums the replicas' gradients). A sequence
// with no target adds nothing and is not run, except beside other replicas, which run as
// many micro-batches as it does; a step with none anywhere is skipped (no update, the data
// moves on).
double run_step(rank_context& rc, const std::vector<packed_sequence>& batch, std::int64_t step, step_record& record) {
  const train_options& o = rc.options;
  std::vector<prepared_sequence> seqs;
  std::int64_t counted = 0;
  record.model_flops = 0;
  record.empty_sequences = 0;
  for (const auto& s : batch) {
    record.model_flops += uses_lora(o) ? lora_model_flops(o.model, o.step.lora, s.length(), s.documents)
                                       : o.model.model_flops(s.length(), s.documents);
    if (s.tokens.empty()) {  // meta: shapes only, every label but the last counted
      counted += s.length() - 1;
      continue;
    }
    prepared_sequence p = prepare_sequence(s.tokens, layout_unit(o.cp), s.documents, s.targets);
    if (s.source < static_cast<int>(record.sources.size())) record.sources[s.source].targets += p.counted;
    counted += p.counted;
    if (p.counted == 0) ++record.empty_sequences;
    // Beside other replicas a sequence without targets still runs (adding nothing): every
    // replica takes part in ZeRO's collectives of each micro-batch.
    if (p.counted > 0 || o.dp > 1) seqs.push_back(std::move(p));
  }
  // Every replica's count, each given once (by its CP group's rank 0), exact in fp64; a
  // loopback world emulates replicas that all count as rank 0's does.
  if (o.dp > 1 && rc.comm.is_loopback()) counted *= o.dp;
  else if (o.dp > 1)
    counted = static_cast<std::int64_t>(
        sum_over_ranks(rc.comm, rc.cp.rank() == 0 ? static_cast<double>(counted) : 0.0, "counted"));
  record.targets = counted;
  transformer& model = rc.model(batch.front().length());
  const auto runs = model.local_positions(rc.cp.rank());
  parameter_store& trained = rc.trained();
  const bool update = trained.stage() != zero_stage::replicated;  // else forward and backward only (planner)
  if (update) record.lr = scheduled_lr(o.optim, step);
  if (counted == 0) {  // every target masked: nothing to learn from (run_rank names the documents)
    record.skipped = true;
    record.loss = std::nan("");
    return record.loss;
  }
  trained.zero_grads();
  const std::size_t micro_batches = seqs.empty() ? batch.size() : seqs.size();
  // Offloaded, the host starts on each unit's final gradients as they land.
  const auto last_micro_batch = [&](std::size_t i) {
    if (update && i + 1 == micro_batches) trained.announce_update(o.optim, step, record.lr);
  };
  double local = 0, aux_local = 0;
  // A mixture of experts' load-balancing loss is each sequence's own (over its tokens): the
  // step's is their mean, over every replica's sequences.
  const double aux_scale = 1.0 / static_cast<double>(micro_batches * static_cast<std::size_t>(std::max(o.dp, 1)));
  if (seqs.empty()) {
    UPIPE_CHECK(!rc.be.has_data(), "a sequence without tokens runs on the meta backend only");
    for (std::size_t i = 0; i < batch.size(); ++i) {  // no host ids: meta reads none
      last_micro_batch(i);
      local += model.forward_backward(rc.params, {{}, {}, 1.0 / static_cast<double>(counted), batch[i].documents,
                                                   0, aux_scale},
                                      rc.adapters.get());
    }
  }
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const prepared_sequence& seq = seqs[i];
    const auto ids = shard_rows(seq.ids, 1, runs, model.local_tokens());
    const auto labels = shard_rows(seq.labels, 1, runs, model.local_tokens());
    last_micro_batch(i);
    local += model.forward_backward(rc.params, {ids, labels, 1.0 / static_cast<double>(counted), seq.documents,
                                                 seq.tokens, aux_scale},
                                    rc.adapters.get());
    aux_local += aux_scale * model.aux_loss();
  }
  record.lm_loss = sum_over_ranks(rc.comm, local, "loss_sum") / static_cast<double>(counted);
  // The same on every rank of a CP group: given once, by its rank 0 (a loopback world's
  // replicas count as rank 0's).
  record.aux_loss = sum_over_ranks(rc.comm, rc.cp.rank() == 0 ? aux_local : 0.0, "aux_loss") *
                    (o.dp > 1 && rc.comm.is_loopback() ? o.dp : 1);
  record.aux_on = model.aux_loss_on();
  record.loss = record.lm_loss + (record.aux_on ? o.model.moe.router_aux_loss_coef * record.aux_loss : 0.0);
  if (!update) return record.loss;
  rc.be.set_stage("update");
  record.grad_norm = trained.grad_norm();
  if (!std::isfinite(record.grad_norm))
    throw config_error("the gradient norm is not finite at step " + std::to_string(step) +
                       ": training diverged; lower --lr (now " + real_text(o.optim.lr) + ")" +
                       (uses_lora(o) ? " or the adapters' scale alpha / r (now --lora " + lora_text(o.step.lora) + ")"
                                     : std::string()));
  trained.adamw_step(o.optim, step, record.lr, clip_coefficient(o.optim, record.grad_norm));
  return record.loss;
}

// The documents of a step's sequences, for the message that skips a step without targets.
std::string describe_documents(const std::vector<packed_sequence>& batch, const data_reader* reader) {
  std::string out;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const packed_sequence& s = batch[i];
    out += (i ? "; " : "") + std::string("sequence ") + std::to_string(i + 1) + ": ";
    if (s.sources.empty()) {
      out += "a window of " + (reader ? reader->spec(static_cast<std::size_t>(s.source)).path : std::string("the data"));
      continue;
    }
    out += "document";
    for (std::size_t d = 0; d < s.sources.size() && d < 8; ++d) out += (d ? ", " : s.sources.size() > 1 ? "s " : " ") + std::to_string(s.sources[d]);
    if (s.sources.size() > 8) out += ", ...";
    if (reader) out += " of " + reader->spec(static_cast<std::size_t>(s.source)).path;
  }
  return out;
}

// The model as trained, for its saved config.json: the context it declares covers the
// trained length.
model_config trained_config(const train_options& o) {
  model_config c = o.model;
  c.max_position_embeddings = std::max(c.max_position_embeddings, o.seq_len);
  return c;
}

// Where the steps of this run's shape began: step 0 at the data's start; for a resume of
// the saved shape, where that shape began; for a resume of another shape, the saved step.
std::pair<std::int64_t, data_position> shape_begin(const train_options& o, const run_data& data,
                                                   const saved_state* resume) {
  if (resume == nullptr) return {0, data.start()};
  const trainer_state& st = resume->state();
  const bool same = st.batch == global_batch(o) && st.seq_len == o.seq_len && st.seq_warmup == o.seq_warmup &&
                    st.warmup_seq_len == (o.seq_warmup > 0 ? step_seq_len(o, 1) : 0);
  return same ? std::pair{st.shape_step, saved_position(st, true)} : std::pair{st.step, saved_position(st, false)};
}

// Saves checkpoint-`step` into the run directory, then (rank 0) points latest at it and
// rotates the older ones. `source` is the directory whose config.json and tokenizer the
// checkpoint carries on. Returns the checkpoint's path.
std::string save(rank_context& rc, const run_data& data, std::int64_t step, const data_position& position,
                 const std::pair<std::int64_t, data_position>& shape, std::optional<double> eval_loss,
                 const std::string& source) {
  const train_options& o = rc.options;
  const std::string path = (std::filesystem::path(o.save_dir) / checkpoint_name(step)).string();
  if (!rc.be.has_data()) return path;
  checkpoint_request r;
  r.config = trained_config(o);
  r.source_dir = source;
  r.model = o.save_model;
  r.state.step = step;
  r.state.seed = o.seed;
  r.state.total_steps = o.optim.total_steps;
  record_data(o, data, position, shape.second, r.state);
  r.state.batch = global_batch(o);  // every replica's
  r.state.seq_len = o.seq_len;
  r.state.seq_warmup = o.seq_warmup;
  r.state.warmup_seq_len = o.seq_warmup > 0 ? step_seq_len(o, 1) : 0;
  r.state.shape_step = shape.first;
  r.strategy = std::string(strategy_name(o.cp.strategy));
  r.head_chunk = o.cp.head_chunk;
  r.seq_len = o.seq_len;
  r.lora = o.step.lora;
  r.base_model = base_model_name(o);
  r.run_id = o.run_id;
  r.eval_loss = eval_loss;
  r.run_config = o.run_config;
  if (rc.comm.rank() == 0) {
    std::error_code ec;
    std::filesystem::create_directories(o.save_dir, ec);
    if (ec) throw io_error("cannot create the run directory " + o.save_dir + ": " + ec.message());
  }
  save_checkpoint(path, r, rc.trained(), rc.shards);
  if (rc.comm.rank() == 0) {
    const auto removed = publish_checkpoint(o.save_dir, step, o.run_id, {o.keep_last, o.keep_best, o.overwrite});
    std::string text;
    for (const std::string& name : removed) text += (text.empty() ? " (removed " : ", ") + name;
    std::printf("%ssaved %s%s%s\n", ::isatty(STDOUT_FILENO) ? "\n" : "", path.c_str(), text.c_str(),
                text.empty() ? "" : ")");
    std::fflush(stdout);
  }
  rc.comm.barrier();
  return path;
}

// Has any rank been asked to stop (SIGTERM, SIGINT, SIGUSR1)? Every rank gets the same
// answer, so the group stops after the same step.
bool group_stop(rank_context& rc) {
  if (rc.options.stop_signal == nullptr) return false;
  const bool asked = rc.options.stop_signal->load() != 0;
  return sum_over_ranks(rc.comm, asked ? 1.0 : 0.0, "stop_requested") > 0;
}

// The held-out loss over eval_sequences windows of `length` tokens of each --eval-data
// source (from its start; fewer where it holds fewer whole windows, as upipe eval reads
// them, so that the two agree on the same weights), forward only: the training state
// (weights, moments, data position) is untouched. Every replica scores the same windows (the sharded weights are
// gathered over the world, so all take part). Per source, and over the targets of all of them together.
std::map<std::string, double> held_out_loss(rank_context& rc, const data_reader& held_out, std::int64_t length,
                                            double& overall) {
  const train_options& o = rc.options;
  transformer& model = rc.model(length);
  const auto runs = model.local_positions(rc.cp.rank());
  std::map<std::string, double> out;
  double all_sum = 0;
  std::int64_t all_counted = 0;
  for (std::size_t d = 0; d < held_out.size(); ++d) {
    double local = 0;
    std::int64_t counted = 0;
    const std::int64_t windows = held_out.whole_windows(d, length, o.eval_sequences);
    for (std::int64_t i = 0; i < windows; ++i) {
      const packed_sequence s = held_out.read(d, i * length, length);
      const prepared_sequence seq = prepare_sequence(s.tokens, layout_unit(o.cp), s.documents, s.targets);
      const auto ids = shard_rows(seq.ids, 1, runs, model.local_tokens());
      const auto labels = shard_rows(seq.labels, 1, runs, model.local_tokens());
      for (const float loss : model.forward_scores(rc.params, {ids, labels, 1.0, seq.documents}, {}, rc.adapters.get()).losses)
        local += loss;
      counted += seq.counted;
    }
    const double sum = sum_over_ranks(rc.cp, local, "eval_loss_sum");
    out[held_out.spec(d).path] = sum / static_cast<double>(std::max<std::int64_t>(counted, 1));
    all_sum += sum;
    all_counted += counted;
  }
  overall = all_sum / static_cast<double>(std::max<std::int64_t>(all_counted, 1));
  return out;
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
        sample, score_sequence(model, rc.params, rc.cp, seq, before_digits, rc.adapters.get()).argmax);
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

// This replica's sequences of a step: the global batch is dp x batch sequences in data
// order, replica r taking the r-th run of `batch`; `position` moves past all of them, and
// `record` counts every replica's sequences by source.
std::vector<packed_sequence> replica_batch(const train_options& o, const run_data& data, int replica,
                                           std::int64_t step, data_position& position, step_record& record) {
  std::vector<packed_sequence> batch;
  const std::int64_t global = global_batch(o), mine = replica * o.batch;
  for (std::int64_t j = 0; j < global; ++j) {
    int source = 0;
    if (j >= mine && j < mine + o.batch) {
      batch.push_back(data.next((step - 1) * global + j + 1, position, record.seq_len));
      source = batch.back().source;
    } else {
      source = data.skip(position, record.seq_len);
    }
    if (data.reader() != nullptr) ++record.sources[static_cast<std::size_t>(source)].sequences;
  }
  return batch;
}

// A source whose position passed one pass over it in this step: the run is past its data,
// said once (the step's `past_end`, and a line from rank 0).
void note_past_end(const data_reader* reader, const data_position& after, step_record& record, bool say) {
  for (std::size_t i = 0; reader != nullptr && i < reader->size(); ++i) {
    const double now = reader->epoch(after, i);
    if (record.sources[i].epoch > 1.0 || now <= 1.0) continue;
    record.past_end.push_back(reader->spec(i).path);
    if (say)
      std::fprintf(stderr, "upipe: note: step %lld reads past the end of --data %s (%lld tokens a pass; epoch %.2f "
                   "after it): from here the data repeats (--epochs sets --steps from the data)\n",
                   static_cast<long long>(record.step), reader->spec(i).path.c_str(),
                   static_cast<long long>(reader->epoch_tokens(i)), now);
  }
}

void run_rank(const train_options& o, backend& be, const mesh_comms& mesh, const weight_sources& from,
              train_summary& summary, const std::function<void(const step_record&)>& on_step,
              clock_type::time_point start) {
  rank_context rc(o, be, mesh);
  communicator& comm = mesh.world;
  const run_data data(o);
  std::int64_t first = 1;
  data_position position = data.start();
  if (from.init != nullptr && (from.resume == nullptr || rc.adapters)) rc.params.load(*from.init);
  if (from.resume != nullptr) {
    rc.trained().load_state([resume = from.resume](int u, shard_state which, std::int64_t begin, std::int64_t count,
                                                   float* out) { resume->read(u, which, begin, count, out); },
                            from.resume->state_format());
    first = from.resume->state().step + 1;
    if (data.reader() != nullptr) position = saved_position(from.resume->state(), false);
  } else if (from.adapters != nullptr && rc.adapters) {
    rc.adapters->load(*from.adapters);
  }
  be.synchronize();
  comm.barrier();
  if (comm.rank() == 0) summary.load_seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  std::unique_ptr<data_reader> held_out;
  if (o.eval_every > 0)
    held_out = std::make_unique<data_reader>(parse_data_sources(o.eval_data, "--eval-data"), reader_options(o, 0));
  const data_reader* reader = data.reader();
  const std::int64_t last = o.stop_after > 0 ? o.stop_after : o.optim.total_steps;
  std::int64_t saved_step = -1, done = first - 1;
  std::optional<double> eval_loss;
  // A resumed full run carries its checkpoint's config.json and tokenizer on. Once this run
  // has saved, its newest checkpoint is their source: rotation may remove the resumed one.
  std::string source = o.model_dir;
  const auto save_now = [&](std::int64_t step) {
    const std::string path = save(rc, data, step, position, shape_begin(o, data, from.resume), eval_loss, source);
    if (comm.rank() == 0) summary.last_checkpoint = path;
    std::error_code ec;
    if (!source.empty() && std::filesystem::equivalent(std::filesystem::path(source).parent_path(), o.save_dir, ec))
      source = path;
    saved_step = step;
  };
  phase_recorder phases(rc.be, rc.trained(), o.phases && comm.rank() == 0);
  for (std::int64_t step = first; step <= last; ++step) {
    const auto start = clock_type::now();
    phases.begin(step);
    step_record record;
    record.step = step;
    record.seq_len = step_seq_len(o, step);
    record.sources.resize(reader ? reader->size() : 0);
    for (std::size_t i = 0; i < record.sources.size(); ++i) {
      record.sources[i].epoch = reader->epoch(position, i);
      record.epoch = std::max(record.epoch, record.sources[i].epoch);
    }
    const std::vector<packed_sequence> batch = replica_batch(o, data, rc.replica(), step, position, record);
    note_past_end(reader, position, record, comm.rank() == 0);
    run_step(rc, batch, step, record);
    if (record.skipped && comm.rank() == 0)
      std::fprintf(stderr, "upipe: note: step %lld has no target (the loss mask leaves out every token of its %s); "
                   "skipped: no update, the data moves on\n", static_cast<long long>(step),
                   describe_documents(batch, reader).c_str());
    // An offloaded update goes on beside the next step's forward; the last step's is its own.
    if (step == last) rc.trained().finish_host_work();
    phases.end(record);
    record.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
    record.phases.wall_ms = record.phases.empty() ? 0 : 1e3 * record.seconds;
    record.tokens_per_s = static_cast<double>(record.seq_len * global_batch(o)) / record.seconds;
    eval_loss.reset();
    if (held_out && be.has_data() && (step % o.eval_every == 0 || step == last)) {
      double overall = 0;
      record.eval_losses = held_out_loss(rc, *held_out, record.seq_len, overall);
      eval_loss = record.eval_loss = overall;
    }
    if (comm.rank() == 0) {
      record.peak_bytes = be.ledger().peaks_by_name();
      summary.steps.push_back(record);
      if (on_step) on_step(record);
    }
    done = step;
    if (!o.save_dir.empty() && o.save_every > 0 && step % o.save_every == 0 && step != last) save_now(step);
    if (step != last && group_stop(rc)) {
      if (comm.rank() == 0) summary.stopped_by_signal = o.stop_signal->load();
      break;
    }
  }
  if (!o.save_dir.empty() && saved_step != done && done >= first) save_now(done);
  const bool stopped = done < last;
  if (!stopped && data.task() != nullptr && be.has_data() && o.eval_samples > 0) {
    const double accuracy = evaluate(rc, *data.task());
    if (comm.rank() == 0) summary.retrieval_accuracy = accuracy;
  }
  summary.peak_bytes[comm.rank()] = be.ledger().peaks_by_name();
  if (comm.rank() == 0) summary.arena_high_water = be.device_arena().high_water();
  if (comm.rank() == 0) summary.host_high_water = be.host_arena().high_water();
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

std::int64_t shortest_sequence(const train_options& o) {
  return o.data_path.empty() && o.tokens == token_source::data ? passkey_task::min_seq_len() : 2;
}

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

std::string base_model_name(const train_options& o) {
  return o.model_dir.empty() ? o.model.name : std::filesystem::absolute(o.model_dir).lexically_normal().string();
}

std::int64_t step_seq_len(const train_options& o, std::int64_t step) {
  return step <= o.seq_warmup ? warmup_start(o) : o.seq_len;
}

offload_options offload_of(const train_options& o) {
  return {o.offload_optimizer, o.offload_params, o.offload_master && !o.offload_optimizer, o.offload_overlap};
}

optimizer_state_options state_options_of(const train_options& o) {
  optimizer_state_options s;
  s.format = o.state_format;
  s.grad_type = o.grad_type;
  // Nothing waits for the norm and no later micro-batch adds in: each unit's update runs
  // as its gradients arrive, from the reduced shard itself.
  if (o.optim.max_grad_norm <= 0 && o.batch == 1) s.grads = grad_keeping::streamed;
  return s;
}

void validate(const train_options& o) {
  validate(o.model);
  validate_mesh(o);
  if (o.optim.total_steps < 1 || o.optim.total_steps > max_train_steps)
    throw config_error("--steps " + std::to_string(o.optim.total_steps) + " must lie between 1 and " +
                       std::to_string(max_train_steps) + " (for example --steps 200)");
  if (o.stop_after < 0 || o.stop_after > o.optim.total_steps)
    throw config_error("--stop-after " + std::to_string(o.stop_after) + " must lie between 1 and --steps " +
                       std::to_string(o.optim.total_steps) + " (it stops a run early; --steps is the schedule's length)");
  if (o.offload_params && !o.offload_optimizer && !o.offload_master)
    throw config_error("the weights go to host memory only with the master weights (AdamW writes them there): use "
                       "--offload optimizer,params or --offload master,params");
  if (uses_lora(o) && (o.offload_master || !(o.state_format == adamw_state_format{}) || o.grad_type != dtype::f32))
    throw config_error("--lora keeps its adapters' AdamW state in f32 (a few MiB): drop --optimizer-state, "
                       "--master-weights, --grad-dtype and --offload master (use --offload optimizer)");
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
  if (!(o.optim.lr > 0 && o.optim.lr <= 1))  // as the --lr row of apps/run_config holds it
    throw config_error("--lr " + real_text(o.optim.lr) + " must lie in (0, 1] (for example --lr 3e-4)");
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
  const bool passkey = o.data_path.empty() && o.tokens == token_source::data;
  if (passkey && o.model.vocab_size < passkey_task::vocab_needed)
    throw config_error("the passkey task needs a vocabulary of at least " + std::to_string(passkey_task::vocab_needed) +
                       " tokens and " + o.model.name + " has " + std::to_string(o.model.vocab_size) + "; use --data FILE");
  if (passkey && o.seq_len < passkey_task::min_seq_len())
    passkey_task check(o.seq_len);  // throws with the minimum
  if (o.seq_len < 2) throw config_error("--seq-len must be at least 2");
  if (o.eval_every < 0 || (o.eval_every > 0 && o.eval_data.empty()))
    throw config_error("--eval-every " + std::to_string(o.eval_every) +
                       " needs --eval-data PREFIX (held-out data: upipe prepare-data --heldout-fraction writes it)");
  if (o.eval_every == 0 && !o.eval_data.empty())
    throw config_error("--eval-data " + o.eval_data + " is given without --eval-every N, so it would never be read; "
                       "add --eval-every 100 (held-out loss every 100 steps), or drop --eval-data");
  parse_data_sources(o.data_path, "--data");  // a mixture's weights, before anything opens a file
  for (const data_source_spec& s : parse_data_sources(o.eval_data, "--eval-data"))
    if (s.weight != 1.0)
      throw config_error("--eval-data " + o.eval_data + ": each held-out source is evaluated on its own, so a weight (" +
                         s.path + ":" + std::to_string(s.weight) + ") means nothing; list them without weights, e.g. "
                         "--eval-data chat-heldout,books-heldout");
  if (o.eval_every > 0 && o.eval_sequences < 1)
    throw config_error("--eval-sequences " + std::to_string(o.eval_sequences) + " must be at least 1 (e.g. 4)");
  if (o.seq_len % layout_unit(o.cp) != 0) {
    const std::int64_t unit = layout_unit(o.cp), fixed = (o.seq_len / unit + 1) * unit, lower = o.seq_len / unit * unit;
    throw config_error("--seq-len " + std::to_string(o.seq_len) + " must be a multiple of " + std::to_string(unit) +
                       " for " + std::string(strategy_name(o.cp.strategy)) + " with --cp " + std::to_string(o.cp.cp) +
                       " in training (every step has the same shape); use --seq-len " + std::to_string(fixed) +
                       (lower >= std::max<std::int64_t>(unit, 2) ? " (or " + std::to_string(lower) + ")" : std::string()));
  }
  attention_config_for(o.model, o.cp, o.seq_len);
  validate_seq_warmup(o);
}

step_memory measure_step_memory(const train_options& o) {
  UPIPE_CHECK(o.backend == backend_kind::meta, "measure_step_memory runs on the meta backend");
  return time_steps(o, 0, 1, group_run::every_rank).memory;
}

step_timing time_steps(const train_options& options, std::int64_t warmup_len, int repeats, group_run ranks, phase_timing phases,
                       double target_fraction) {
  train_options o = options;
  o.tokens = token_source::random;
  validate(o);
  require_run_memory(run_memory_of(o, ranks == group_run::rank_zero_emulated ? 1 : 0), o.backend);
  UPIPE_CHECK(repeats >= 1, "time_steps needs at least one timed step");
  UPIPE_CHECK(target_fraction > 0 && target_fraction <= 1, "time_steps' target fraction lies in (0, 1]");
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
    if (target_fraction < 1) {  // a prompt, then the answer: its last ceil(f n) tokens
      const auto answer = static_cast<std::int64_t>(std::ceil(target_fraction * static_cast<double>(n)));
      s.targets.assign(static_cast<std::size_t>(n), 0);
      std::fill(s.targets.end() - answer, s.targets.end(), std::uint8_t{1});
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
  run_mesh(
      o.backend, o.limits, {o.dp, o.cp.cp, o.ep},
      [&](int rank, backend& be, const mesh_comms& mesh) {
        rank_context rc(o, be, mesh);
        communicator& comm = mesh.world;
        rc.params.load(init);
        if (rc.adapters) rc.adapters->load(adapters);
        step_record record;
        if (warmup_len > 0) {
          run_step(rc, {tokens(be, warmup_len, 0)}, 1, record);
          // Overlapped, the warm-up's update goes on beside the first timed step, as each
          // step's beside the next; a lone timed step is timed with its own update alone.
          if (repeats == 1) rc.trained().finish_host_work();
        }
        for (int i = 0; i < repeats; ++i) {
          // Step i's global batch is sequences i G .. i G + G - 1 of the stream (G = dp x batch),
          // replica r taking its run of `batch`: one rank with dp x batch reads the same.
          std::vector<packed_sequence> batch;
          for (std::int64_t k = 0; k < o.batch; ++k)
            batch.push_back(tokens(be, o.seq_len,
                                   1 + static_cast<std::uint64_t>(i * global_batch(o) + rc.replica() * o.batch + k)));
          be.synchronize();
          comm.barrier();
          mesh.cp.reset_counters();
          const bool timed = phases == phase_timing::by_phase;
          // The step's clock holds its phase timing: it starts before the first mark and
          // stops after the last.
          const auto start = clock_type::now();
          be.set_phase_timing(timed);
          rc.trained().set_host_timing(timed);
          run_step(rc, batch, 1 + i, record);
          // An offloaded update belongs to its step, and overlapped goes on beside the next
          // timed step's forward (as the previous one's beside this one's): the last waits.
          if (i + 1 == repeats || !o.offload_overlap) rc.trained().finish_host_work();
          be.synchronize();
          comm.barrier();
          step_phases table;
          const backend::phase_times take = be.take_phases();
          const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
          add_phases(table, take);
          table.wall_ms = 1e3 * seconds;
          table.host = rc.trained().take_host_times();
          be.set_phase_timing(false);
          rc.trained().set_host_timing(false);
          if (rank == 0) {
            if (out.seconds.empty() || seconds < *std::min_element(out.seconds.begin(), out.seconds.end())) {
              out.phases_ms = take.phases_ms;
              out.step = std::move(table);
            }
            out.seconds.push_back(seconds);
            out.sent_bytes_by_label = {mesh.cp.counters().bytes_by_label.begin(), mesh.cp.counters().bytes_by_label.end()};
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

// One pass over the data must hold at least one sequence: a shorter corpus would be
// repeated within the sequence. The --seq-len suggested is one training takes: the
// longest multiple of the layout unit (2 x cp for a zigzag layout) the data holds.
void check_data_length(const train_options& o, std::int64_t tokens, const std::string& data, const char* flag) {
  if (tokens >= o.seq_len) return;
  const std::int64_t unit = layout_unit(o.cp), longest = tokens / unit * unit;
  const std::string what = std::string(flag) + " " + data + " holds " + std::to_string(tokens) +
                           " tokens (in the documents kept), fewer than one sequence of --seq-len " +
                           std::to_string(o.seq_len);
  if (longest < std::max<std::int64_t>(unit, 2))
    throw config_error(what + ": give more data (training at --cp " + std::to_string(o.cp.cp) +
                       " takes sequences of a multiple of " + std::to_string(unit) + " tokens)");
  throw config_error(what + ": give more data, or --seq-len " + std::to_string(longest) +
                     (longest == tokens ? std::string() : " (a multiple of " + std::to_string(unit) + " for --cp " +
                                                              std::to_string(o.cp.cp) + ")"));
}

// A stream's length (a token file, or a corpus read as one) checked before its reader opens
// it, whose own refusal would suggest any --seq-len up to its tokens, which training at
// --cp > 1 may not take.
void check_stream_lengths(const train_options& o, const std::string& sources, const char* flag) {
  for (const data_source_spec& s : parse_data_sources(sources, flag)) {
    const bool corpus = document_corpus::exists(s.path);
    if (corpus && o.packing != packing_mode::stream) continue;  // its documents: check_data_length after
    std::error_code ec;
    const std::string file = corpus ? s.path + ".tokens" : s.path;
    if (!std::filesystem::is_regular_file(file, ec)) continue;  // the reader names what it is
    const auto bytes = std::filesystem::file_size(file, ec);
    if (!ec && bytes > 0 && bytes % 4 == 0) check_data_length(o, static_cast<std::int64_t>(bytes / 4), s.path, flag);
  }
}

// --eval-data as --data is checked (the tokenizer, the ids, one sequence at least), and
// where it holds fewer whole windows of --seq-len than --eval-sequences, said: each token is
// scored once, as upipe eval scores it, never a window wrapped around to the data's start.
void check_held_out_data(const train_options& o) {
  check_stream_lengths(o, o.eval_data, "--eval-data");
  const data_reader held_out(parse_data_sources(o.eval_data, "--eval-data"), reader_options(o, 0));
  for (std::size_t i = 0; i < held_out.size(); ++i) {
    check_data_tokenizer(o.model_dir, held_out.spec(i).path, "--eval-data", o.allow_tokenizer_mismatch);
    check_data_length(o, held_out.epoch_tokens(i), held_out.spec(i).path, "--eval-data");
    const std::int64_t windows = held_out.whole_windows(i, o.seq_len, o.eval_sequences);
    if (windows < o.eval_sequences)
      std::fprintf(stderr, "upipe: note: --eval-data %s holds %lld tokens, %lld whole window(s) of --seq-len %lld, not "
                   "--eval-sequences %d: each token is scored once\n", held_out.spec(i).path.c_str(),
                   static_cast<long long>(held_out.epoch_tokens(i)), static_cast<long long>(windows),
                   static_cast<long long>(o.seq_len), o.eval_sequences);
  }
  held_out.check_ids();
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

train_summary train(const train_options& options, const std::function<void(const step_record&)>& on_step) {
  validate(options);
  // Everything that can be checked before the first step is: the save directory, the
  // checkpoint or the weights against the model, the data file's ids.
  const auto start = clock_type::now();
  train_options o = options;
  // A run directory means its latest checkpoint, wherever a checkpoint is read.
  o.resume_dir = resolve_checkpoint(o.resume_dir);
  if (!o.save_dir.empty()) o.save_dir = resolve_checkpoint_dir(o.save_dir);  // a trailing slash, a symbolic link
  o.init_path = resolve_checkpoint(o.init_path);
  o.init_adapter = resolve_checkpoint(o.init_adapter);
  // Before anything is read, pinned or allocated: the whole run against the machine.
  require_run_memory(run_memory_of(o), o.backend);
  std::unique_ptr<saved_state> resume;
  std::unique_ptr<weight_source> init, adapter_init;
  host_weights random, random_adapters;
  if (!o.resume_dir.empty()) {
    resume = std::make_unique<saved_state>(o.resume_dir);
    check_resume(o, *resume);
  }
  // A resumed run keeps its id, so that it saves into its own run directory.
  if (o.run_id.empty()) o.run_id = resume && !resume->run_id().empty() ? resume->run_id() : new_run_id();
  if (!o.save_dir.empty())
    for (const std::string& note :
         check_run_directory(o.save_dir, o.run_id, o.overwrite, resume ? resume->state().step : 0))
      std::fprintf(stderr, "upipe: note: %s\n", note.c_str());
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
  for (const data_source_spec& source : parse_data_sources(o.data_path, "--data"))
    check_data_tokenizer(o.model_dir, source.path, "--data", o.allow_tokenizer_mismatch);
  if (o.eval_every > 0) check_held_out_data(o);
  check_stream_lengths(o, o.data_path, "--data");
  if (const run_data data(o); data.reader() != nullptr) {
    const data_reader& reader = *data.reader();
    reader.check_ids();
    for (std::size_t i = 0; i < reader.size(); ++i)
      check_data_length(o, reader.epoch_tokens(i), reader.spec(i).path, "--data");
  }
  if (!o.save_dir.empty()) make_run_directory(o.save_dir);  // every check has passed
  train_summary summary;
  summary.seq_len = o.seq_len;
  summary.run_id = o.run_id;
  summary.peak_bytes.resize(static_cast<std::size_t>(o.dp * o.cp.cp));
  try {
    run_mesh(
        o.backend, o.limits, {o.dp, o.cp.cp, o.ep},
        [&](int, backend& be, const mesh_comms& mesh) {
          run_rank(o, be, mesh, {resume.get(), init.get(), adapter_init.get()}, summary, on_step, start);
        },
        group_run::every_rank, o.comm);
  } catch (...) {
    if (!o.save_dir.empty()) remove_unfinished_saves(o.save_dir);
    throw;
  }
  summary.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  summary.host_bytes = run_host_bytes(o, summary.host_high_water);
  return summary;
}

}  // namespace upipe
