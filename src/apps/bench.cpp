// `upipe bench`: whole training steps (or forward+backward) of a model or a slice of its
// first layers over strategy x U x S, with a warm-up at a small size, timed repeats,
// nccl-tests-style rows, a correctness check after timing, and JSON with tokens/s/GPU,
// model TFLOP/s and MFU (docs/design.md section 7), the peak by tag and the arena high water.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/moe_flags.hpp"
#include "apps/commands.hpp"
#include "apps/flag_checks.hpp"
#include "apps/json_file.hpp"
#include "apps/comm_flags.hpp"
#include "apps/model_flags.hpp"
#include "apps/phase_table.hpp"
#include "apps/policy_flags.hpp"
#include "apps/run_config.hpp"
#include "apps/sizes.hpp"
#include "apps/state_flags.hpp"
#include "core/error.hpp"
#include "core/limits.hpp"
#include "cp/strategy_table.hpp"
#include "model/config.hpp"
#include "model/model_step.hpp"
#include "plan/planner.hpp"
#include "train/trainer.hpp"

namespace upipe::apps {

namespace {

// The options bench shares with train (model, slice, comm, ZeRO, policy, sizes, seed,
// LoRA) are rows of the run configuration; the sweep's lists and the timing are bench's own.
struct bench_flags {
  std::shared_ptr<run_options> options;
  std::string optimizer = "adamw", json_path;
  std::string single_pass_from = "1M", warmup_len;
  std::vector<std::string> attention{"ulysses", "upipe"}, head_chunks, seq_lens{"512"};
  int cp = 0, emulate_cp = 0, dp = 1, repeats = 3;
  double peak_tflops = 778, datasheet_tflops = 989, targets = 1;
  bool no_check = false, phases = false;
  const run_config& cfg() const { return options->config(); }
};

struct row {
  std::string strategy, checkpoint_policy;
  int head_chunk = 0, cp = 0, layers = 0, repeats = 0;
  std::int64_t seq_len = 0;
  double step_ms = 0, layer_ms = 0, tokens_per_s_per_gpu = 0, tflops = 0, mfu = 0, mfu_datasheet = 0;
  step_memory memory;
  std::size_t driver_peak = 0;
  std::optional<double> check_rel_diff, check_grad_rel_diff;  // the loss's and the worst gradient's
  std::int64_t check_seq_len = 0;
  std::string check_worst_grad;
  bool check_pass = true;
  std::string check_error;  // why the check could not run, if it could not
  std::map<std::string, double> phases_ms;  // --phases: the fastest step by phase
  step_phases step;                          // ... and its phase table
  step_time model;                           // the step-time model's prediction for the row
  std::map<std::string, std::uint64_t> sent_bytes;  // rank 0's bytes sent over the CP group a step, by label
};

double gib(std::size_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

// One line under a row: the bytes rank 0 sent over its CP group in a step, by label, most first.
void print_sent_bytes(const std::map<std::string, std::uint64_t>& sent) {
  std::vector<std::pair<std::string, std::uint64_t>> sorted(sent.begin(), sent.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  std::printf("#   sent (MiB a step):");
  for (const auto& [label, bytes] : sorted) std::printf(" %s %.2f", label.c_str(), static_cast<double>(bytes) / (1 << 20));
  std::printf("\n");
}

// One line under a row: the fastest step's time by phase, longest first, and its share.
void print_phases(const std::map<std::string, double>& phases) {
  std::vector<std::pair<std::string, double>> sorted(phases.begin(), phases.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  double total = 0;
  for (const auto& p : sorted) total += p.second;
  std::printf("#   phases (ms, %% of the step):");
  for (const auto& [name, ms] : sorted) std::printf("  %s %.2f (%.1f%%)", name.c_str(), ms, 100.0 * ms / total);
  std::printf("\n");
  // A mixture of experts' step in four (five under expert parallelism): its expert GEMMs
  // (and activations), the routing around them (router, dispatch, permute, combine,
  // statistics), the exchange with the experts' ranks, attention, the rest.
  double experts = 0, routing = 0, exchange = 0, attention = 0;
  for (const auto& [name, ms] : sorted) {
    if (name == "moe_experts") experts += ms;
    if (name == "moe_routing") routing += ms;
    if (name == "moe_exchange") exchange += ms;
    if (name.rfind("attn_", 0) == 0) attention += ms;
  }
  if (experts + routing > 0 && total > 0) {
    std::printf("#   shares: expert GEMMs %.1f%%, routing/permute %.1f%%, ", 100.0 * experts / total,
                100.0 * routing / total);
    if (exchange > 0) std::printf("expert exchange %.1f%%, ", 100.0 * exchange / total);
    std::printf("attention %.1f%%, the rest %.1f%%\n", 100.0 * attention / total,
                100.0 * (total - experts - routing - exchange - attention) / total);
  }
}

// With data parallelism (which run_model_step does not run): the loss of step 1 on a short sequence under `o`'s strategy and mesh with every rank
// real, against C = 1 with the replicas' sequences as one batch on the same backend:
// relative difference (the check after timing; an emulated run's own loss is not the
// model's, since rank 0 receives its own bytes).
double loss_against_cp1(train_options o, std::int64_t check_len) {
  o.seq_len = check_len;
  train_options one = o;  // C = 1 runs alone afterwards: the whole arenas, as timed
  one.cp = {strategy_kind::ulysses, 1, 0};
  one.dp = 1;
  one.batch = global_batch(o);
  // Every rank is real here, and on a GPU they share it: each gets 1/(D C) of the arenas.
  o.limits.device_bytes /= static_cast<std::size_t>(o.dp * o.cp.cp);
  o.limits.host_bytes /= static_cast<std::size_t>(o.dp * o.cp.cp);
  const double got = time_steps(o, 0, 1, group_run::every_rank).losses.front();
  const double want = time_steps(one, 0, 1, group_run::every_rank).losses.front();
  return std::abs(got - want) / std::abs(want);
}

// The check after timing (as nccl-tests checks what it timed): one forward and backward
// of the same random weights and tokens under `o`'s strategy with every rank real, and at
// C = 1 on the same backend; the loss and every gradient compared.
struct step_check {
  std::int64_t seq_len = 0;
  double loss_rel_diff = 0;  // |loss - loss_1| / |loss_1|
  double grad_rel_diff = 0;  // the worst tensor's max|g - g_1| / max|g_1|
  std::string worst_grad;    // its name
};

model_step_result check_step(const train_options& o, const cp_settings& cp, std::int64_t len, int sharing) {
  model_step_request req;
  req.model = o.model;
  req.cp = cp;
  req.options = o.step;
  req.backend = o.backend;
  req.comm = o.comm;
  // Every rank is real here, and on a GPU they share it: each gets 1/C of the arenas.
  req.limits = o.limits;
  req.limits.device_bytes /= static_cast<std::size_t>(sharing);
  req.limits.host_bytes /= static_cast<std::size_t>(sharing);
  const host_weights weights = random_weights(o.model, o.seed);
  const host_weights adapters = o.step.lora.enabled() ? initial_adapters(o.model, o.step.lora, o.seed) : host_weights{};
  return run_model_step(req, weights, random_tokens(len, o.model.vocab_size, o.seed + 1), adapters);
}

step_check compare_with_cp1(const train_options& o, std::int64_t len) {
  const model_step_result got = check_step(o, o.cp, len, o.cp.cp);
  const model_step_result want = check_step(o, {strategy_kind::ulysses, 1, 0}, len, 1);  // the whole arenas, as timed
  step_check c;
  c.seq_len = len;
  c.loss_rel_diff = std::abs(got.loss - want.loss) / std::abs(want.loss);
  for (const auto& [name, g1] : want.grads) {
    const std::vector<float>& g = got.grads.at(name);
    double diff = 0, scale = 0;
    for (std::size_t i = 0; i < g1.size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::abs(g[i] - g1[i])));
      scale = std::max(scale, static_cast<double>(std::abs(g1[i])));
    }
    const double rel = scale > 0 ? diff / scale : diff;  // a zero gradient (LoRA's A at B = 0) must stay zero
    if (rel >= c.grad_rel_diff) {
      c.grad_rel_diff = rel;
      c.worst_grad = name;
    }
  }
  return c;
}

// At the timed length when the C = 1 step fits in its memory, else at `short_len`.
step_check check_against_cp1(const train_options& o, std::int64_t short_len) {
  if (o.dp > 1) {
    step_check c;
    c.seq_len = std::min(o.seq_len, short_len);
    c.loss_rel_diff = loss_against_cp1(o, c.seq_len);
    return c;
  }
  if (o.seq_len > short_len) {
    try {
      return compare_with_cp1(o, o.seq_len);
    } catch (const out_of_memory_error& e) {
      std::fprintf(stderr, "upipe bench: the check at the timed S = %lld does not fit (%s); checking S = %lld\n",
                   static_cast<long long>(o.seq_len), e.what(), static_cast<long long>(short_len));
    }
  }
  return compare_with_cp1(o, std::min(o.seq_len, short_len));
}

// Model FLOPs of a step (docs/design.md section 7), a LoRA step's without the base's weight gradients.
double step_flops(const model_config& m, const lora_config& lora, std::int64_t seq_len) {
  return lora.enabled() ? lora_model_flops(m, lora, seq_len) : m.model_flops(seq_len);
}

std::vector<int> chunks_for(const bench_flags& f, const model_config& m, int C) {
  if (f.head_chunks.empty() || (f.head_chunks.size() == 1 && f.head_chunks[0] == "auto")) return {0};  // auto
  if (f.head_chunks.size() == 1 && f.head_chunks[0] == "all") return valid_head_chunks(m.num_heads, C);
  std::vector<int> out;
  for (const std::string& t : f.head_chunks) out.push_back(parse_int_count(t, "--head-chunk"));
  return out;
}

int run(const bench_flags& f) {
  if ((f.cp > 0) == (f.emulate_cp > 0) && !(f.cp == 0 && f.emulate_cp == 0))
    throw config_error("--cp " + std::to_string(f.cp) + " and --emulate-cp " + std::to_string(f.emulate_cp) +
                       " contradict each other: --cp C runs every rank, --emulate-cp C runs rank 0 of C alone; give one");
  const bool emulate = f.emulate_cp > 0;
  const int C = emulate ? f.emulate_cp : (f.cp > 0 ? f.cp : 4);
  const model_config whole = load_model(f.cfg().model, f.cfg().config);
  const model_config m = slice_layers(whole, f.cfg().layers);
  const int model_layers = whole.num_layers;
  require_within(f.repeats, 1, limits::repeats, "--repeats", "3");
  if (!(f.targets > 0 && f.targets <= 1))
    throw config_error("--targets " + std::to_string(f.targets) + " must lie in (0, 1]: the fraction of each sequence "
                       "that is a target of the loss (e.g. 0.0625: an answer after a prompt 15 times longer)");
  if (f.optimizer != "adamw" && f.optimizer != "none")
    throw config_error("--optimizer " + f.optimizer + " is not known: use adamw or none (forward and backward only)");
  if (f.optimizer == "none" && f.cfg().offload != "none")
    throw config_error("--offload " + f.cfg().offload + " with --optimizer none: forward and backward alone keep no "
                       "optimizer state to offload; drop --offload or time a training step (--optimizer adamw)");
  const backend_kind kind = parse_backend_kind(f.cfg().backend);
  const bool auto_policy = is_auto_policy(f.cfg().checkpoint_policy);
  const checkpoint_policy fixed_policy = auto_policy ? checkpoint_policy{} : parse_checkpoint_policy(f.cfg().checkpoint_policy);
  const std::int64_t single_from = parse_seq_len(f.single_pass_from, "--single-pass-from");
  std::vector<std::int64_t> lengths;
  for (const std::string& t : f.seq_lens) lengths.push_back(parse_seq_len(t, "--seq-len"));
  const lora_config lora = f.cfg().lora.empty() ? lora_config{} : parse_lora(f.cfg().lora, m);

  std::vector<row> rows;
  // Rewritten after every row, so a run cut short (a time limit, a crash) keeps its rows.
  const auto write_json = [&] {
    if (f.json_path.empty()) return;
    nlohmann::json all = nlohmann::json::array();
    const bool timed = kind != backend_kind::meta;
    for (const row& r : rows)
      all.push_back({{"strategy", r.strategy},
                     {"head_chunk", r.head_chunk == 0 ? nlohmann::json(nullptr) : nlohmann::json(r.head_chunk)},
                     {"cp", r.cp},
                     {"dp", f.dp},
                     {"emulated", emulate},
                     {"backend", f.cfg().backend},
                     {"model", m.name},
                     {"layers", r.layers},
                     {"seq_len", r.seq_len},
                     {"repeats", r.repeats},
                     {"checkpoint_policy", r.checkpoint_policy},
                     {"step_ms", timed ? nlohmann::json(r.step_ms) : nlohmann::json(nullptr)},
                     {"layer_ms", timed ? nlohmann::json(r.layer_ms) : nlohmann::json(nullptr)},
                     {"tokens_per_s_per_gpu", timed ? nlohmann::json(r.tokens_per_s_per_gpu) : nlohmann::json(nullptr)},
                     {"model_tflops", timed ? nlohmann::json(r.tflops) : nlohmann::json(nullptr)},
                     {"model_flops_per_step", step_flops(m, lora, r.seq_len)},
                     {"lora", lora.enabled() ? nlohmann::json(lora_text(lora)) : nlohmann::json(nullptr)},
                     {"targets", f.targets},
                     {"mfu", timed ? nlohmann::json(r.mfu) : nlohmann::json(nullptr)},
                     {"mfu_datasheet", timed ? nlohmann::json(r.mfu_datasheet) : nlohmann::json(nullptr)},
                     {"peak_bytes", r.memory.peak_bytes},
                     {"device_peak_bytes", r.memory.device_peak},
                     {"arena_high_water_bytes", r.memory.arena_high_water},
                     {"driver_peak_bytes", r.driver_peak},
                     {"check_rel_diff", r.check_rel_diff ? nlohmann::json(*r.check_rel_diff) : nlohmann::json(nullptr)},
                     {"check_grad_rel_diff",
                      r.check_grad_rel_diff ? nlohmann::json(*r.check_grad_rel_diff) : nlohmann::json(nullptr)},
                     {"check_worst_grad", r.check_worst_grad.empty() ? nlohmann::json(nullptr)
                                                                     : nlohmann::json(r.check_worst_grad)},
                     {"check_seq_len", r.check_seq_len == 0 ? nlohmann::json(nullptr) : nlohmann::json(r.check_seq_len)},
                     {"check_pass", r.check_pass},
                     {"check_error", r.check_error.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.check_error)},
                     {"phases_ms", r.phases_ms.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.phases_ms)},
                     {"step_phases", r.step.empty() ? nlohmann::json(nullptr) : step_phases_json(r.step)},
                     {"step_seconds_model", step_time_json(r.model)},
                     {"step_rates", rates_json(throughput_rates{})},
                     {"zero", f.cfg().zero},
                     {"offload", f.cfg().offload},
                     {"offload_overlap", f.cfg().offload_overlap},
                     {"optimizer_state", f.cfg().optimizer_state},
                     {"master_weights", f.cfg().master_weights},
                     {"grad_dtype", f.cfg().grad_dtype},
                     {"max_grad_norm", f.cfg().max_grad_norm},
                     {"sent_bytes_by_label", r.sent_bytes}});
    write_json_file(f.json_path, all, 1);
  };
  std::printf("# upipe bench  model=%s  layers=%d of %d (a slice: per-layer time and working set)  backend=%s  %s "
              "D=%d x C=%d  %s  repeats=%d (1 pass from S=%s)\n",
              m.name.c_str(), m.num_layers, model_layers,
              f.cfg().backend.c_str(), emulate ? "emulated (rank 0 alone, loopback)" : "every rank", f.dp, C,
              f.optimizer == "none" ? "forward+backward" : ("training step, zero=" + std::to_string(f.cfg().zero)).c_str(),
              f.repeats, f.single_pass_from.c_str());
  std::printf("# MFU against %.0f TFLOP/s (measured bf16 GEMM peak) and, in the JSON, %.0f (datasheet)\n",
              f.peak_tflops, f.datasheet_tflops);
  if (f.targets < 1)
    std::printf("# loss mask: the last %.4g of each sequence's tokens are targets, the rest masked (--targets)\n",
                f.targets);
  std::printf("%-8s %4s %9s %6s %3s %3s %4s %11s %10s %11s %8s %6s %9s %9s %8s\n", "strategy", "U", "S", "layers", "D",
              "C", "reps", "step_ms", "layer_ms", "tok/s/GPU", "TFLOP/s", "MFU", "peak_GiB", "arena_GiB", "check");
  std::fflush(stdout);

  for (const std::string& name : f.attention) {
    const strategy_row& table_row = row_named(name);
    const strategy_kind strategy = table_row.kind;
    const std::vector<int> us = table_row.heads == head_stages::chosen ? chunks_for(f, m, C)
                                                                       : head_chunk_choices(table_row, m.num_heads, C);
    for (int u : us)
      for (std::int64_t s : lengths) {
        train_options o;
        o.model = m;
        o.seq_len = s;
        o.cp = {strategy, C, u};
        o.dp = f.dp;
        o.zero = f.optimizer == "none" ? zero_stage::replicated : (f.cfg().zero == 3 ? zero_stage::three : zero_stage::two);
        o.step = {f.cfg().mlp_tile, f.cfg().loss_chunk, fixed_policy};
        apply_comm(f.cfg(), o.step);
        o.step.attention_arithmetic = parse_attention_dtype(f.cfg().attention_dtype);
        o.step.lora = lora;
        apply_moe(f.cfg(), o.step);
        o.optim.total_steps = 1 + f.repeats;
        o.optim.warmup_steps = 0;
        o.seed = f.cfg().seed;
        o.eval_samples = 0;
        o.backend = kind;
        o.comm = comm_of(f.cfg());
        const offload_options offload = parse_offload(f.cfg().offload);
        o.offload_optimizer = offload.optimizer;
        o.offload_params = offload.params;
        o.offload_master = offload.master;
        o.offload_overlap = f.cfg().offload_overlap == "on";
        o.state_format = {parse_moments(f.cfg().optimizer_state), parse_master(f.cfg().master_weights)};
        o.grad_type = parse_grad_dtype(f.cfg().grad_dtype);
        o.optim.max_grad_norm = f.cfg().max_grad_norm;
        size_step(o, f.cfg());
        if (u == 0) {  // --head-chunk auto: "# head chunk U = ..." under the row's name
          const std::string why = choose_head_chunk(o, f.cfg(), auto_policy);
          if (!why.empty()) std::printf("# %s S=%lld: %s", name.c_str(), static_cast<long long>(s), why.c_str() + 2);
        }
        if (auto_policy)
          o.step.policy = auto_policy_or_default(o, f.cfg(), name + " U=" + std::to_string(o.cp.head_chunk) +
                                                                 " S=" + std::to_string(s) + ": ");
        const std::int64_t unit = layout_unit(o.cp);
        const std::int64_t warmup =
            f.warmup_len.empty() ? std::min<std::int64_t>(s, unit * 256) : parse_seq_len(f.warmup_len, "--warmup-seq-len", true);
        const int repeats = s >= single_from ? 1 : f.repeats;
        const step_timing t = time_steps(o, warmup, repeats,
                                         emulate ? group_run::rank_zero_emulated : group_run::every_rank,
                                         f.phases ? phase_timing::by_phase : phase_timing::off, f.targets);
        row r;
        r.strategy = name;
        r.checkpoint_policy = o.step.policy.str();
        r.head_chunk = table_row.heads == head_stages::none ? 0 : o.cp.head_chunk;
        r.cp = C;
        r.layers = m.num_layers;
        r.repeats = repeats;
        r.seq_len = s;
        // The fastest repeat: the step's own time, free of one-off stalls.
        const double seconds = *std::min_element(t.seconds.begin(), t.seconds.end());
        r.step_ms = 1e3 * seconds;
        r.layer_ms = r.step_ms / m.num_layers;
        r.tokens_per_s_per_gpu = static_cast<double>(s) / seconds / C;
        r.tflops = step_flops(m, lora, s) / seconds / C / 1e12;
        r.mfu = r.tflops / f.peak_tflops;
        r.mfu_datasheet = r.tflops / f.datasheet_tflops;
        r.memory = t.memory;
        r.driver_peak = t.driver_peak;
        r.phases_ms = t.phases_ms;
        r.step = t.step;
        r.model = model_step_time(o);
        r.sent_bytes = t.sent_bytes_by_label;
        if (!f.no_check && kind != backend_kind::meta) {
          // A check that cannot run (memory, say) fails its row but keeps the timing.
          try {
            // Dropless: a capacity drops tokens per rank's tile, which C = 1 tiles otherwise.
            train_options checked = o;
            checked.step.moe.capacity_factor = 0;
            const step_check c = check_against_cp1(checked, unit * 64);
            r.check_seq_len = c.seq_len;
            r.check_rel_diff = c.loss_rel_diff;
            r.check_grad_rel_diff = c.grad_rel_diff;
            r.check_worst_grad = c.worst_grad;
            // f32 on the cpu; bf16 elsewhere, as the GPU tests hold losses and gradients
            const bool f32 = kind == backend_kind::cpu;
            r.check_pass = c.loss_rel_diff < (f32 ? 1e-4 : 2e-2) && c.grad_rel_diff < (f32 ? 1e-4 : 5e-2);
          } catch (const std::exception& e) {
            r.check_error = e.what();
            r.check_pass = false;
            std::fprintf(stderr, "upipe bench: the check of %s at S = %lld could not run: %s\n", name.c_str(),
                         static_cast<long long>(s), e.what());
          }
        }
        char check[32] = "-";
        if (r.check_rel_diff)
          std::snprintf(check, sizeof check, "%s %.1e", r.check_pass ? "ok" : "WRONG",
                        std::max(*r.check_rel_diff, r.check_grad_rel_diff.value_or(0)));
        if (!r.check_error.empty()) std::snprintf(check, sizeof check, "ERROR");
        // Times exist only where ops run (not on meta).
        char times[96] = "          -          -           -        -      -";
        if (kind != backend_kind::meta)
          std::snprintf(times, sizeof times, "%11.2f %10.2f %11.0f %8.1f %6.3f", r.step_ms, r.layer_ms,
                        r.tokens_per_s_per_gpu, r.tflops, r.mfu);
        std::printf("%-8s %4s %9lld %6d %3d %3d %4d %s %9.2f %9.2f %8s\n", name.c_str(),
                    table_row.heads == head_stages::none ? "-" : std::to_string(o.cp.head_chunk).c_str(), static_cast<long long>(s),
                    r.layers, f.dp, C, repeats, times, gib(r.memory.device_peak), gib(r.memory.arena_high_water), check);
        std::fflush(stdout);
        if (!r.phases_ms.empty()) print_phases(r.phases_ms);
        if (!r.step.empty()) print_step_phases(r.step, r.model);
        if (f.phases && !r.sent_bytes.empty()) print_sent_bytes(r.sent_bytes);
        rows.push_back(std::move(r));
        write_json();
      }
  }
  int wrong = 0;
  for (const row& r : rows) wrong += r.check_pass ? 0 : 1;
  std::printf("# %zu configurations, %d wrong (after timing: the loss and every gradient against C = 1, at the timed "
              "length where C = 1 fits; check = the larger relative error)\n",
              rows.size(), wrong);
  return wrong == 0 ? 0 : 1;
}

}  // namespace

command_runner add_bench(CLI::App& app) {
  auto f = std::make_shared<bench_flags>();
  f->options = std::make_shared<run_options>(app, for_bench);
  app.add_option("--cp", f->cp, "ranks in the CP group, every one run (default 4)");
  app.add_option("--emulate-cp", f->emulate_cp, "run rank 0 of a group of C alone (loopback), as on one GPU");
  app.add_option("--dp", f->dp,
                 "data-parallel replicas of the CP group (D x C ranks, ZeRO over all; with --emulate-cp rank 0 of "
                 "D x C alone, ZeRO's collectives on the loopback); tok/s/GPU counts each replica's sequence")
      ->capture_default_str();
  app.add_option("--attention", f->attention, "strategies, a comma list of: " + strategy_help())
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--head-chunk", f->head_chunks, "U values for the strategies that choose U (default auto: the largest whose step fits --memory-gib; 'all' "
                 "for every valid U)")
      ->delimiter(',');
  app.add_option("--seq-len", f->seq_lens, "lengths (K and M suffixes)")->delimiter(',')->capture_default_str();
  app.add_option("--optimizer", f->optimizer, "adamw (training step) or none (forward and backward only)")
      ->capture_default_str();
  app.add_option("--repeats", f->repeats, "timed steps per configuration (the fastest is reported)")->capture_default_str();
  app.add_option("--single-pass-from", f->single_pass_from, "one timed step from this length on")->capture_default_str();
  app.add_option("--warmup-seq-len", f->warmup_len, "length of the warm-up step (default 256 layout units)");
  app.add_flag("--no-check", f->no_check, "skip the correctness check after timing");
  app.add_flag("--phases", f->phases,
               "also time each phase of the fastest step (attention parts, the linear layers', MLP, loss) and print its "
               "phase table (the GPU's forward, loss, backward and update, its waits on the host and on copies, the "
               "copies each way, the host's AdamW) beside the step-time model's, and the bytes rank 0 sent over the CP "
               "group, by label");
  app.add_option("--peak-tflops", f->peak_tflops, "the card's measured bf16 GEMM peak, for MFU")->capture_default_str();
  app.add_option("--targets", f->targets,
                 "the fraction of each sequence that is a target of the loss, its last tokens (fine-tuning's shape: a "
                 "prompt, then the answer); the rest masked")
      ->capture_default_str();
  app.add_option("--json", f->json_path, "write one object per configuration")->check(output_file_flag("--json"));
  return [f] { return f->options->run([&] { return run(*f); }); };
}

}  // namespace upipe::apps
