#include "model/model_step.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "model/hf_model.hpp"
#include "runtime/cp_group.hpp"

namespace upipe {

prepared_sequence prepare_sequence(std::span<const std::int32_t> tokens, std::int64_t unit,
                                   std::span<const std::int64_t> documents, std::span<const std::uint8_t> targets) {
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (!targets.empty() && static_cast<std::int64_t>(targets.size()) != n)
    throw config_error("the loss mask holds " + std::to_string(targets.size()) + " bytes for a sequence of " +
                       std::to_string(n) + " tokens; it needs one per token");
  const std::int64_t padded = (n + unit - 1) / unit * unit;
  for (std::size_t i = 0; i < documents.size(); ++i)
    if ((i == 0 && documents[0] != 0) || (i > 0 && documents[i] <= documents[i - 1]) || documents[i] >= std::max<std::int64_t>(n, 1))
      throw config_error("document start " + std::to_string(documents[i]) + " (number " + std::to_string(i) +
                         ") is invalid: starts must begin at 0 and increase below the sequence length " +
                         std::to_string(n));
  prepared_sequence p;
  p.ids.assign(static_cast<std::size_t>(padded), 0);
  p.labels.assign(static_cast<std::size_t>(padded), masked_label);
  std::size_t next_doc = 1;  // the next document start after token i
  for (std::int64_t i = 0; i < n; ++i) {
    p.ids[i] = tokens[i];
    while (next_doc < documents.size() && documents[next_doc] <= i) ++next_doc;
    const bool crosses = next_doc < documents.size() && documents[next_doc] == i + 1;
    if (i + 1 < n && !crosses && (targets.empty() || targets[i + 1] != 0)) {
      p.labels[i] = tokens[i + 1];
      ++p.counted;
    }
  }
  if (documents.size() > 1) p.documents.assign(documents.begin(), documents.end());
  p.tokens = n;
  return p;
}

std::int64_t layout_unit(const cp_settings& cp) {
  attention_config c;
  c.strategy = cp.strategy;
  c.cp = cp.cp;
  return c.layout_unit();
}

namespace {

struct rank_result {
  double loss_sum = 0;
  double aux_loss = 0;  // the load-balancing loss (the CP group's, the same on every rank)
  host_weights grads;
};

void run_rank(const model_step_request& req, const prepared_sequence& seq, std::int64_t seq_len,
              const host_weights& weights, const host_weights& adapter_weights, backend& be, const mesh_comms& mesh,
              rank_result& out, model_step_result* measured) {
  const lora_config& lora = req.options.lora;
  communicator& comm = mesh.cp;
  parameter_store params(req.model, parameter_specs(req.model), be, mesh.shards, zero_stage::replicated, {},
                         lora.enabled() ? weight_role::frozen : weight_role::trained, {}, experts_of(mesh));
  params.load(weights);
  std::unique_ptr<parameter_store> adapters;
  if (lora.enabled()) {
    adapters = std::make_unique<parameter_store>(req.model, lora_parameter_specs(req.model, lora), be, mesh.shards,
                                                 zero_stage::replicated, offload_options{}, weight_role::trained);
    adapters->load(adapter_weights);
  }
  transformer model(req.model, req.cp, seq_len, be, {&comm, &comm}, req.options, mesh.expert_peers);
  const auto runs = model.local_positions(comm.rank());
  const bool host_ids = be.has_data();  // meta reads no ids
  const auto ids = host_ids ? shard_rows(seq.ids, 1, runs, model.local_tokens()) : std::vector<std::int32_t>{};
  const auto labels = host_ids ? shard_rows(seq.labels, 1, runs, model.local_tokens()) : std::vector<std::int32_t>{};
  const double scale = seq.counted > 0 ? 1.0 / static_cast<double>(seq.counted) : 0.0;
  be.ledger().record_timeline(measured != nullptr && req.record_timeline);
  mesh.world.barrier();
  const auto start = std::chrono::steady_clock::now();
  const backend::gemm_flops before = be.gemm_count();
  out.loss_sum = model.forward_backward(params, {ids, labels, scale, seq.documents, seq.tokens}, adapters.get());
  out.aux_loss = model.aux_loss();
  be.synchronize();
  mesh.world.barrier();
  if (measured != nullptr) {
    measured->gemm_flops = {be.gemm_count().all - before.all, be.gemm_count().left_transposed - before.left_transposed};
    measured->time_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    measured->peak_bytes = be.ledger().peaks_by_name();
    measured->device_peak_bytes = be.ledger().device_peak();
    measured->timeline = be.ledger().timeline();
  }
  if (be.has_data()) out.grads = (adapters ? *adapters : params).local_grads();
}

}  // namespace

expert_sharding experts_of(const mesh_comms& mesh) {
  if (mesh.expert_peers == nullptr) return {};
  return {mesh.expert_peers->size(), mesh.expert_peers->rank(), mesh.expert_peers, mesh.expert_replicas};
}

std::size_t peak_of_labels(const std::vector<ledger_event>& timeline, std::initializer_list<std::string_view> prefixes) {
  std::int64_t live = 0, peak = 0;
  for (const ledger_event& e : timeline) {
    bool match = false;
    for (std::string_view p : prefixes) match = match || std::string_view(e.label).substr(0, p.size()) == p;
    if (!match) continue;
    live += e.delta;
    peak = std::max(peak, live);
  }
  return static_cast<std::size_t>(peak);
}

model_step_result run_model_step(const model_step_request& req, const host_weights& weights,
                                 std::span<const std::int32_t> tokens, const host_weights& adapters) {
  validate(req.model);
  if (req.options.lora.enabled()) validate(req.options.lora, req.model);
  const host_weights initial = req.options.lora.enabled() && adapters.empty() && req.backend != backend_kind::meta
                                   ? initial_adapters(req.model, req.options.lora, 1)
                                   : host_weights{};
  const std::int64_t unit = layout_unit(req.cp);
  prepared_sequence seq;
  model_step_result result;
  if (req.shape_only > 0) {
    UPIPE_CHECK(req.backend == backend_kind::meta && tokens.empty(), "a shape-only step runs on meta, without tokens");
    seq.counted = req.shape_only - 1;
    result.seq_len = (req.shape_only + unit - 1) / unit * unit;
  } else {
    seq = prepare_sequence(tokens, unit, req.documents, req.targets);
    result.seq_len = static_cast<std::int64_t>(seq.ids.size());
  }
  result.counted = seq.counted;
  attention_config_for(req.model, req.cp, result.seq_len);  // refuse a bad CP shape before any thread starts
  const mesh_shape mesh{req.dp, req.cp.cp, req.ep};
  std::vector<rank_result> per_rank(static_cast<std::size_t>(mesh.ranks()));
  run_mesh(req.backend, req.limits, mesh, [&](int rank, backend& be, const mesh_comms& comms) {
    run_rank(req, seq, result.seq_len, weights, adapters.empty() ? initial : adapters, be, comms, per_rank[rank],
             rank == 0 ? &result : nullptr);
  }, group_run::every_rank, req.comm);
  // Every replica ran the sequence: the sums over all ranks are dp times one replica's (an
  // expert's gradient lies on the ranks that hold it, each the part of its EP group's tokens).
  double loss_sum = 0;
  for (rank_result& r : per_rank) {
    loss_sum += r.loss_sum;
    for (auto& [name, values] : r.grads) {
      auto [it, fresh] = result.grads.try_emplace(name, std::move(values));
      if (!fresh)
        for (std::size_t i = 0; i < values.size(); ++i) it->second[i] += values[i];
    }
  }
  if (req.dp > 1) {
    loss_sum /= req.dp;
    for (auto& [name, values] : result.grads)
      for (float& v : values) v /= static_cast<float>(req.dp);
  }
  result.lm_loss = seq.counted > 0 ? loss_sum / static_cast<double>(seq.counted) : 0.0;
  result.aux_loss = per_rank.front().aux_loss;
  result.loss = result.lm_loss + req.model.moe.router_aux_loss_coef * result.aux_loss;
  return result;
}

namespace {

// The meta backend's evaluation of one length: the forward's allocations, no host copy of
// the sequence (the planner probes lengths up to 2^30).
eval_result evaluate_shapes(const model_step_request& req, std::int64_t seq_len) {
  UPIPE_CHECK(req.backend == backend_kind::meta, "a sequence without tokens is evaluated on the meta backend only");
  attention_config_for(req.model, req.cp, seq_len);
  eval_result result;
  run_cp_group(req.backend, req.limits, req.cp.cp, [&](int, backend& be, communicator& comm) {
    parameter_store params(req.model, be, comm, zero_stage::inference);
    transformer model(req.model, req.cp, seq_len, be, {&comm, &comm}, req.options);
    model.forward_scores(params, {{}, {}, 1.0, {}});  // no host ids: meta reads none
    result.peak_bytes = be.ledger().peaks_by_name();
    result.arena_high_water = be.device_arena().high_water();
  }, group_run::every_rank, req.comm);
  return result;
}

}  // namespace

sequence_scores score_sequence(transformer& model, parameter_store& params, communicator& comm,
                               const prepared_sequence& seq, std::span<const std::int64_t> argmax_at,
                               parameter_store* adapters) {
  const int C = comm.size();
  const std::int64_t s = model.local_tokens();
  const auto runs = model.local_positions(comm.rank());
  // The local rows of the wanted positions this rank holds.
  std::vector<std::int64_t> rows;
  std::vector<std::size_t> wanted;
  for (std::size_t j = 0; j < argmax_at.size(); ++j)
    for (const position_run& run : runs)
      if (argmax_at[j] >= run.position_begin && argmax_at[j] < run.position_begin + run.count) {
        rows.push_back(run.token_begin + argmax_at[j] - run.position_begin);
        wanted.push_back(j);
      }
  const auto ids = shard_rows(seq.ids, 1, runs, s);
  const auto labels = shard_rows(seq.labels, 1, runs, s);
  const transformer::scores local = model.forward_scores(params, {ids, labels, 1.0, seq.documents}, rows, adapters);
  std::vector<float> all(static_cast<std::size_t>(s * C));
  comm.all_gather(local.losses.data(), all.data(), local.losses.size() * sizeof(float), "eval_losses");
  sequence_scores out;
  out.losses.resize(seq.ids.size());
  for (int r = 0; r < C; ++r)
    for (const position_run& run : model.local_positions(r))
      std::copy_n(all.begin() + r * s + run.token_begin, run.count, out.losses.begin() + run.position_begin);
  if (argmax_at.empty()) return out;
  // Each position lives on one rank; the others contribute -1.
  std::vector<std::int32_t> mine(argmax_at.size(), -1), every(argmax_at.size() * static_cast<std::size_t>(C));
  for (std::size_t i = 0; i < rows.size(); ++i) mine[wanted[i]] = local.argmax[i];
  comm.all_gather(mine.data(), every.data(), mine.size() * sizeof(std::int32_t), "eval_argmax");
  out.argmax.assign(argmax_at.size(), -1);
  for (int r = 0; r < C; ++r)
    for (std::size_t j = 0; j < argmax_at.size(); ++j)
      out.argmax[j] = std::max(out.argmax[j], every[static_cast<std::size_t>(r) * argmax_at.size() + j]);
  return out;
}

eval_result evaluate(const model_step_request& req, const weight_source& weights,
                     const std::vector<eval_sequence>& sequences, const eval_hooks& hooks, const weight_source* adapters) {
  validate(req.model);
  eval_result result;
  if (sequences.empty()) return result;
  const std::int64_t unit = layout_unit(req.cp);
  if (sequences.front().tokens.empty() && sequences.front().shape_only > 0)
    return evaluate_shapes(req, (sequences.front().shape_only + unit - 1) / unit * unit);
  UPIPE_CHECK(req.options.lora.enabled() == (adapters != nullptr), "evaluate: LoRA needs its adapters, and only LoRA");
  std::vector<prepared_sequence> seqs;
  for (const eval_sequence& s : sequences) seqs.push_back(prepare_sequence(s.tokens, unit, s.documents, s.targets));
  const auto seq_len = static_cast<std::int64_t>(seqs.front().ids.size());
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    UPIPE_CHECK(static_cast<std::int64_t>(seqs[i].ids.size()) == seq_len, "evaluate takes sequences of one length");
    for (const std::int64_t p : sequences[i].argmax_at)
      UPIPE_CHECK(p >= 0 && p < static_cast<std::int64_t>(sequences[i].tokens.size()),
                  "argmax position " + std::to_string(p) + " is outside the sequence");
  }
  attention_config_for(req.model, req.cp, seq_len);
  result.target_loss.resize(sequences.size());
  result.argmax.resize(sequences.size());
  const auto start = std::chrono::steady_clock::now();
  run_cp_group(req.backend, req.limits, req.cp.cp, [&](int rank, backend& be, communicator& comm) {
    parameter_store params(req.model, be, comm, zero_stage::inference);
    params.load(weights);
    std::unique_ptr<parameter_store> lora;  // the adapters, whole on every rank
    if (adapters != nullptr) {
      lora = std::make_unique<parameter_store>(req.model, lora_parameter_specs(req.model, req.options.lora), be, comm,
                                               zero_stage::inference, offload_options{}, weight_role::frozen);
      lora->load(*adapters);
    }
    transformer model(req.model, req.cp, seq_len, be, {&comm, &comm}, req.options);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      // Every rank learns whether any was asked to stop, so that all stop at one sequence.
      std::int32_t stop = hooks.stop && hooks.stop() ? 1 : 0;
      std::vector<std::int32_t> stops(static_cast<std::size_t>(comm.size()));
      comm.all_gather(&stop, stops.data(), sizeof(stop), "eval_stop");
      if (std::find(stops.begin(), stops.end(), 1) != stops.end()) break;
      const sequence_scores scored = score_sequence(model, params, comm, seqs[i], sequences[i].argmax_at, lora.get());
      if (rank != 0) continue;
      result.completed = i + 1;
      if (be.has_data()) {
        const std::size_t n = sequences[i].tokens.size();
        auto& out = result.target_loss[i];
        out.resize(n > 0 ? n - 1 : 0);
        for (std::size_t t = 0; t + 1 < n; ++t)
          out[t] = seqs[i].labels[t] == masked_label ? std::nanf("") : scored.losses[t];
        result.argmax[i] = scored.argmax;
      }
      if (hooks.progress) hooks.progress(i + 1);
    }
    if (rank == 0) {
      result.peak_bytes = be.ledger().peaks_by_name();
      result.arena_high_water = be.device_arena().high_water();
    }
  }, group_run::every_rank, req.comm);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace upipe
