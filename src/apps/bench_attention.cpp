// `upipe bench-attention`: the attention layer under CP, one row per configuration
// (strategy x sequence length x head chunk), nccl-tests style; correctness is checked
// after timing against the float64 reference.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/commands.hpp"
#include "apps/flag_checks.hpp"
#include "apps/json_file.hpp"
#include "apps/sizes.hpp"
#include "runtime/attention_experiment.hpp"
#include "core/limits.hpp"
#include "core/error.hpp"
#include "cp/stage_plan.hpp"
#include "cp/strategy_table.hpp"

namespace upipe::apps {

namespace {

struct bench_flags {
  std::string backend = "cpu";
  std::vector<std::string> strategies = {"ulysses", "upipe", "ring"};
  int heads = 8, kv_heads = 2, head_dim = 64, model_dim = 0, cp = 4, ring = 2;
  std::vector<std::string> head_chunks;
  std::vector<int> seq_chunks;  // N per row (empty: the strategy's default)
  std::vector<std::string> seq_lens = {"512"};
  std::vector<std::int64_t> windows = {0};  // sliding windows W per row (0: global attention)
  unsigned long long seed = 1;
  std::string json_path, dump_dir;
  double memory_gib = 8;
  bool no_check = false;
  double rope_theta = 500000;
  bool rope_llama3 = false;
  bool qk_norm = false;
  std::string attention_dtype = "bf16";
};

// The head chunks to run for one strategy: the flag's values, "all" for every valid U,
// or the strategy's default.
std::vector<int> chunks_for(const bench_flags& f, const strategy_row& row) {
  if (f.head_chunks.empty()) return {0};
  // "all" alone sweeps each strategy's valid chunks: ring has none, ulysses only H.
  if (f.head_chunks == std::vector<std::string>{"all"} && row.heads != head_stages::chosen) return {0};
  if (row.heads == head_stages::none)
    throw config_error("--head-chunk is not allowed with --strategy " + std::string(row.name) +
                       ", which has no head stages; leave it out, or use --strategy upipe");
  const int group = row.mesh ? f.cp / std::max(f.ring, 1) : f.cp;
  std::vector<int> chunks;
  for (const std::string& v : f.head_chunks) {
    if (v == "all") {
      const auto all = head_chunk_choices(row, f.heads, group);
      chunks.insert(chunks.end(), all.begin(), all.end());
    } else {
      chunks.push_back(parse_int_count(v, "--head-chunk"));
    }
  }
  return chunks;
}

// The shape flags within the limits every model passes (core/limits.hpp), before H * d or
// any buffer is computed from them.
void check_shape_flags(const bench_flags& f) {
  require_within(f.heads, 1, limits::heads, "--heads", "32");
  require_within(f.kv_heads, 1, limits::heads, "--kv-heads", "8");
  require_within(f.head_dim, 1, limits::head_dim, "--head-dim", "128");
  require_within(f.model_dim, 0, limits::hidden_size, "--model-dim", "4096 (0: H x d)");
  if (!(f.rope_theta > 1 && f.rope_theta <= 1e12))
    throw config_error("--rope-theta " + real_text(f.rope_theta) +
                       " must lie in (1, 1e12] (RoPE's wavelengths grow from 2 pi to 2 pi theta); for example 500000");
}

// --seq-chunks sweeps the rows of the strategies that chunk the sequence; given to none of
// them it would be ignored, and is refused instead.
void check_seq_chunks_apply(const bench_flags& f) {
  if (std::all_of(f.seq_chunks.begin(), f.seq_chunks.end(), [](int n) { return n == 1; })) return;
  for (const std::string& name : f.strategies)
    if (row_named(name).chunks != sequence_chunking::none) return;
  std::string listed, chunking;
  for (const std::string& name : f.strategies) listed += (listed.empty() ? "" : ",") + name;
  for (const strategy_row& row : strategy_rows())
    if (row.chunks != sequence_chunking::none) chunking += (chunking.empty() ? "" : ", ") + std::string(row.name);
  throw config_error("--seq-chunks applies to " + chunking + ", and --strategy " + listed +
                     " lists none of them: leave --seq-chunks out, or add --strategy upipe");
}

std::vector<attention_config> configurations(const bench_flags& f) {
  check_shape_flags(f);
  check_seq_chunks_apply(f);
  std::vector<attention_config> configs;
  for (const std::string& name : f.strategies) {
    const strategy_row& row = row_named(name);
    const strategy_kind kind = row.kind;
    const bool chunked = row.chunks != sequence_chunking::none;
    std::vector<int> seq_chunks = f.seq_chunks.empty() || !chunked ? std::vector<int>{0} : f.seq_chunks;
    // A list for several strategies: a row that requires chunks takes its N >= 2 (N = 1 is
    // another row's).
    if (row.chunks == sequence_chunking::required &&
        std::any_of(seq_chunks.begin(), seq_chunks.end(), [](int n) { return n >= 2; }))
      std::erase_if(seq_chunks, [](int n) { return n == 1; });
    for (const std::string& s : f.seq_lens)
      for (int chunk : chunks_for(f, row))
        for (int n : seq_chunks)
          for (const std::int64_t window : f.windows) {
        attention_config c;
        c.strategy = kind;
        c.seq_len = parse_seq_len(s, "--seq-len");
        c.heads = f.heads;
        c.kv_heads = f.kv_heads;
        c.head_dim = f.head_dim;
        c.model_dim = f.model_dim != 0 ? f.model_dim : f.heads * f.head_dim;
        c.cp = f.cp;
        c.head_chunk = chunk;
        c.ring = row.mesh ? f.ring : 1;
        c.seq_chunks = n;
        c.window = window;
        c.rope.theta = f.rope_theta;
        c.rope.scaling.kind = f.rope_llama3 ? rope_kind::llama3 : rope_kind::none;
        c.qk_norm = f.qk_norm;
        c.arithmetic = parse_attention_dtype(f.attention_dtype);
        validate(c);  // every configuration is checked before the first one runs
        configs.push_back(c);
      }
  }
  return configs;
}

nlohmann::json to_json(const experiment_result& r, bool wrong) {
  const attention_config& c = r.config;
  nlohmann::json j = {{"strategy", strategy_name(c.strategy)}, {"ring", c.ring},
                      {"backend", backend_name(r.backend)},
                      {"seq_len", c.seq_len},
                      {"heads", c.heads},
                      {"kv_heads", c.kv_heads},
                      {"head_dim", c.head_dim},
                      {"model_dim", c.model_dim},
                      {"cp", c.cp},
                      {"head_chunk", c.staged() ? nlohmann::json(c.head_chunk) : nlohmann::json(nullptr)},
                      {"seq_chunks", c.seq_chunks},
                      {"window", c.window},
                      {"time_ms", r.time_ms},
                      {"tokens_per_s", r.time_ms > 0 ? static_cast<double>(c.seq_len) / (r.time_ms * 1e-3) : 0.0},
                      {"peak_bytes", r.peak_bytes},
                      {"device_peak_bytes", r.device_peak_bytes},
                      {"arena_high_water_bytes", r.arena_high_water},
                      {"driver_peak_bytes", r.driver_peak_bytes},
                      {"attention_peak_bytes", r.attention_peak_bytes},
                      {"attention_forward_peak_bytes", r.attention_forward_peak},
                      {"attention_backward_peak_bytes", r.attention_backward_peak},
                      {"attention_host_peak_bytes", r.attention_host_peak},
                      {"plan_forward_peak_bytes", r.plan_forward_peak},
                      {"plan_backward_peak_bytes", r.plan_backward_peak},
                      {"plan_host_peak_bytes", r.plan_host_peak},
                      {"plan_bytes_by_label", r.plan_bytes_by_label},
                      {"plan_bytes_by_link", r.plan_bytes_by_link},
                      {"plan_saved_bytes_by_label", r.plan_saved_bytes_by_label},
                      {"bytes_sent", r.bytes_sent},
                      {"bytes_sent_by_label", r.bytes_sent_by_label},
                      {"wrong", wrong}};
  j["rel_error"] = r.max_rel_error ? nlohmann::json(r.rel_error) : nlohmann::json(nullptr);
  j["max_rel_error"] = r.max_rel_error ? nlohmann::json(*r.max_rel_error) : nlohmann::json(nullptr);
  return j;
}

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

void print_row(const experiment_result& r, bool wrong) {
  const attention_config& c = r.config;
  std::uint64_t sent = 0;
  for (const auto& [name, bytes] : r.bytes_sent)
    if (name != "recv") sent += bytes;
  char err[32] = "-";
  if (r.max_rel_error) std::snprintf(err, sizeof err, "%.2e", *r.max_rel_error);
  const std::size_t plan_peak = std::max(r.plan_forward_peak, r.plan_backward_peak);
  std::uint64_t saved = 0;
  for (const auto& [label, bytes] : r.plan_saved_bytes_by_label) saved += bytes;
  const double tokens_per_s = r.time_ms > 0 ? static_cast<double>(c.seq_len) / (r.time_ms * 1e-3) : 0.0;
  std::printf("%-8s %-5s %9lld %4d %4d %4d %3d %4s %3d %7lld %11.2f %11.0f %12.2f %12.2f %12.2f %11.2f %11.2f %11.2f %9s "
              "%6d\n",
              std::string(strategy_name(c.strategy)).c_str(), std::string(backend_name(r.backend)).c_str(),
              static_cast<long long>(c.seq_len), c.heads, c.kv_heads, c.head_dim, c.cp,
              c.staged() ? std::to_string(c.head_chunk).c_str() : "-", c.seq_chunks, static_cast<long long>(c.window),
              r.time_ms, tokens_per_s, mib(static_cast<double>(r.attention_peak_bytes)),
              mib(static_cast<double>(plan_peak)), mib(static_cast<double>(r.attention_host_peak)),
              mib(static_cast<double>(r.device_peak_bytes)), mib(static_cast<double>(sent)),
              mib(static_cast<double>(saved)), err, wrong ? 1 : 0);
  std::fflush(stdout);
}

int run(const bench_flags& f) {
  const backend_kind kind = parse_backend_kind(f.backend);
  const std::vector<attention_config> configs = configurations(f);
  experiment_options options;
  options.backend = kind;
  options.seed = f.seed;
  options.check = !f.no_check;
  // The host pool only stages; checkpoints are not used here.
  options.limits = run_limits(kind, f.memory_gib, checkpoint_location::device);
  // fp32 (cpu) or bf16 storage (cuda) against the float64 reference; FP8 attention within
  // one E5M2 step of its gradients (the op registry's fp8 tolerance), which the exact
  // reference does not round.
  const bool fp8 = parse_attention_dtype(f.attention_dtype) == attention_dtype::fp8;
  const double tolerance = fp8 ? 0.35 : kind == backend_kind::cuda ? 2e-2 : 1e-5;
  std::printf("# upipe bench-attention  backend=%s  D=%d  seed=%llu  (time: forward+backward of rank 0; tok/s: S "
              "over it, the group's rate; memory and bytes: rank 0's; saved_MiB: what its plan sends and copies "
              "less than without the window W)\n",
              f.backend.c_str(), configs.empty() ? 0 : configs[0].model_dim, f.seed);
  std::printf("%-8s %-5s %9s %4s %4s %4s %3s %4s %3s %7s %11s %11s %12s %12s %12s %11s %11s %11s %9s %6s\n", "strategy",
              "back", "S", "H", "K", "d", "C", "U", "N", "W", "time_ms", "tok/s", "attn_MiB", "plan_MiB", "host_MiB",
              "peak_MiB", "sent_MiB", "saved_MiB", "max_err", "#wrong");
  nlohmann::json rows = nlohmann::json::array();
  int wrong_rows = 0;
  for (std::size_t i = 0; i < configs.size(); ++i) {
    experiment_options o = options;
    // Sequence chunks keep K/V in the host pool: it grows by what the plan keeps there.
    if (configs[i].chunked() && kind != backend_kind::meta)
      o.limits.host_bytes += make_stage_plan(configs[i], 0).host_peak(kind == backend_kind::cpu ? dtype::f32 : dtype::bf16) +
                             (std::size_t{64} << 20);
    if (!f.dump_dir.empty())
      o.dump_dir = configs.size() == 1 ? f.dump_dir : f.dump_dir + "/config" + std::to_string(i);
    const experiment_result r = run_attention_experiment(configs[i], o);
    const bool wrong = r.max_rel_error && !(*r.max_rel_error < tolerance);
    wrong_rows += wrong ? 1 : 0;
    print_row(r, wrong);
    rows.push_back(to_json(r, wrong));
  }
  if (!f.json_path.empty()) write_json_file(f.json_path, rows);
  std::printf("# %zu configurations, %d wrong (tolerance %.0e on max|a-b|/max|b|%s)\n", configs.size(), wrong_rows,
              tolerance, kind == backend_kind::meta ? "; meta has no data, so nothing was checked" : "");
  return wrong_rows == 0 ? 0 : 1;
}

}  // namespace

command_runner add_bench_attention(CLI::App& app) {
  auto f = std::make_shared<bench_flags>();
  app.add_option("--backend", f->backend,
                 "cpu (fp32 reference, threads as ranks), cuda (bf16, virtual ranks on one GPU) or meta (shapes only, rank 0)")
      ->capture_default_str();
  // --attention as in train, step, bench and plan, so that a message naming it names a flag
  // of this command too.
  app.add_option("--strategy,--attention", f->strategies, "comma-separated list of: " + strategy_help())
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--heads", f->heads, "query heads H")->capture_default_str();
  app.add_option("--kv-heads", f->kv_heads, "kv heads K")->capture_default_str();
  app.add_option("--head-dim", f->head_dim, "head dim d")->capture_default_str();
  app.add_option("--model-dim", f->model_dim, "layer width D (default H*d)");
  app.add_option("--cp", f->cp, "ranks C in the CP group")->capture_default_str();
  app.add_option("--ring", f->ring, "hybrid rows: R rings of all-to-all groups of C / R ranks")->capture_default_str();
  app.add_option("--head-chunk", f->head_chunks,
                 "query heads per stage U for upipe (default C; 'all' for every valid U); must equal H for ulysses")
      ->delimiter(',');
  app.add_option("--seq-chunks", f->seq_chunks,
                 "N sequence chunks for ulysses, upipe and fpdt (comma list; default 1, fpdt 64K-token chunks)")
      ->delimiter(',');
  app.add_option("--seq-len", f->seq_lens, "global sequence lengths S (comma list; K and M suffixes: 128K, 1M)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--window", f->windows,
                 "sliding windows W (comma list; 0: global attention): a token attends to the W keys up to itself")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--attention-dtype", f->attention_dtype,
                 "the fused attention's arithmetic: bf16, or fp8 (docs/design.md section 6, \"FP8 attention\")")
      ->capture_default_str();
  app.add_option("--seed", f->seed, "seed of the random inputs and weights")->capture_default_str();
  app.add_option("--json", f->json_path, "write one JSON object per configuration to this file")->check(output_file_flag("--json"));
  app.add_option("--dump", f->dump_dir, "write inputs, weights, outputs and gradients as .npy files here");
  app.add_option("--memory-gib", f->memory_gib, "arena per rank (cpu or GPU memory), GiB")->capture_default_str();
  app.add_flag("--no-check", f->no_check, "skip the float64 reference (long sequences on cpu)");
  app.add_option("--rope-theta", f->rope_theta, "RoPE base")->capture_default_str();
  app.add_flag("--rope-llama3", f->rope_llama3, "Llama 3 RoPE frequency scaling (factor 8, original 8192)");
  app.add_flag("--qk-norm", f->qk_norm, "Qwen3's per-head RMSNorm on q and k before RoPE");
  return [f] { return run(*f); };
}

}  // namespace upipe::apps
