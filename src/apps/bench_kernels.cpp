// `upipe bench-kernels`: single-op timings on one backend (the GEMMs of a Llama layer,
// fused attention, memory-bound kernels beside a device-to-device copy), nccl-tests
// style rows and JSON; scripts/bench_torch.py measures PyTorch on the same shapes.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/commands.hpp"
#include "apps/flag_checks.hpp"
#include "apps/json_file.hpp"
#include "apps/sizes.hpp"
#include "backend/op_harness.hpp"
#include "bench/kernel_bench.hpp"
#include "bench/moe_gemm_bench.hpp"
#include "core/error.hpp"
#include "core/limits.hpp"
#include "cp/attention_config.hpp"

namespace upipe::apps {

namespace {

struct kernel_flags {
  std::string backend = "cuda", tokens = "32K", json_path;
  int repeats = 5;
  double memory_gib = 40;
  bool registry = false;
  std::vector<std::string> attention_lengths;  // --attention-dtypes: the bf16 against fp8 sweep
  std::vector<std::string> moe_tokens;         // --moe: the expert GEMMs at these token counts
  double moe_skew = 0.3;
  std::vector<std::string> gdn_lengths;        // --gdn: Gated DeltaNet beside full attention
  std::string gdn_model = "qwen3.5-27b";
  double gdn_workspace_gib = 4;
};

// The expert GEMMs of Qwen3-30B-A3B and Mixtral at each token count: every form through the
// per-expert loop and each grouped engine, beside a dense GEMM of the same FLOPs.
int run_moe_gemms(backend& be, const kernel_flags& f) {
  if (!(f.moe_skew >= 0.0 && f.moe_skew <= 8.0))
    throw config_error("--moe-skew " + real_text(f.moe_skew) + " must lie between 0 (uniform routing) and 8; for "
                       "example --moe-skew 0.3");
  std::printf("# expert GEMMs: token t's k experts drawn by Gumbel top-k over (1 + e)^-%.2f (seeded); TFLOP/s over the "
              "routed rows; vs_dense = over a dense GEMM of the same FLOPs in this run\n",
              f.moe_skew);
  std::printf("%-14s %8s %-12s %-8s %9s %9s %8s %10s %10s %9s\n", "model", "tokens", "form", "engine", "rows",
              "busiest", "idle", "time_ms", "TFLOP/s", "vs_dense");
  nlohmann::json rows = nlohmann::json::array();
  for (const std::string& text : f.moe_tokens) {
    const std::int64_t tokens = parse_seq_len(text, "--moe");
    for (const moe_gemm_shape& shape : moe_gemm_shapes())
      for (const moe_gemm_timing& t : run_moe_gemm_bench(be, shape, tokens, f.repeats, f.moe_skew)) {
        std::printf("%-14s %8lld %-12s %-8s %9lld %9lld %8lld %10.3f %10.1f %8.2fx\n", t.model.c_str(),
                    static_cast<long long>(t.tokens), t.form.c_str(), t.engine.c_str(), static_cast<long long>(t.rows),
                    static_cast<long long>(t.busiest), static_cast<long long>(t.idle), t.ms, t.tflops, t.vs_dense);
        rows.push_back({{"model", t.model}, {"tokens", t.tokens}, {"form", t.form}, {"engine", t.engine},
                        {"rows", t.rows}, {"busiest_expert_rows", t.busiest}, {"idle_experts", t.idle},
                        {"time_ms", t.ms}, {"tflops", t.tflops}, {"vs_dense", t.vs_dense}, {"skew", f.moe_skew}});
      }
  }
  if (!f.json_path.empty()) write_json_file(f.json_path, rows);
  return 0;
}

// The gated delta rule of one Gated DeltaNet layer beside the fused attention of one
// full-attention layer of the same model, at each length: one row each.
int run_gdn(backend& be, const kernel_flags& f, const kernel_bench_options& o) {
  const gdn_bench_model* model = find_gdn_bench_model(f.gdn_model);
  if (model == nullptr)
    throw config_error("--gdn-model '" + f.gdn_model + "' is not one of " + gdn_bench_model_names() +
                       " (for example --gdn-model qwen3.5-27b)");
  UPIPE_CHECK(f.gdn_workspace_gib > 0, "--gdn-workspace-gib " + std::to_string(f.gdn_workspace_gib) +
                                           " must be positive (for example 4)");
  std::vector<std::int64_t> lengths;
  for (const std::string& text : f.gdn_lengths) lengths.push_back(parse_seq_len(text, "--gdn"));
  std::printf("# %s: a Gated DeltaNet layer (gated delta rule, H_k %d, H_v %d, d %d, chunk 64, fp32 state) beside a "
              "full-attention layer (causal, %d query heads, %d kv heads, d %d), forward+backward; TFLOP/s counts the "
              "chunked stages' FLOPs and attention's 3.5 x 2 s^2 h d\n",
              model->name, model->k_heads, model->v_heads, model->head_dim, model->attn_heads, model->attn_kv_heads,
              model->attn_dim);
  std::printf("%10s %8s %10s %10s %9s %10s %10s %9s %8s\n", "S", "passes", "gdn_fwd", "gdn_bwd", "TFLOP/s", "attn_fwd",
              "attn_bwd", "TFLOP/s", "gdn/attn");
  nlohmann::json rows = nlohmann::json::array();
  for (const gdn_timing& t : run_gdn_bench(be, lengths, *model, o.repeats, f.gdn_workspace_gib)) {
    const double gdn = t.forward_ms + t.backward_ms, attn = t.attn_forward_ms + t.attn_backward_ms;
    const long long chunks = (t.tokens + 63) / 64, passes = (chunks + t.pass_chunks - 1) / t.pass_chunks;
    std::printf("%10lld %8lld %10.3f %10.3f %9.2f %10.3f %10.3f %9.1f %8.3f\n", static_cast<long long>(t.tokens), passes,
                t.forward_ms, t.backward_ms, t.tflops, t.attn_forward_ms, t.attn_backward_ms, t.attn_tflops, gdn / attn);
    rows.push_back({{"tokens", t.tokens}, {"model", model->name}, {"passes", passes}, {"gdn_forward_ms", t.forward_ms},
                    {"gdn_backward_ms", t.backward_ms}, {"gdn_tflops", t.tflops}, {"attn_forward_ms", t.attn_forward_ms},
                    {"attn_backward_ms", t.attn_backward_ms}, {"attn_tflops", t.attn_tflops},
                    {"gdn_over_attention", gdn / attn}});
  }
  std::printf("# times in ms, each the mean of %d runs after one warm-up\n", o.repeats);
  if (!f.json_path.empty()) write_json_file(f.json_path, rows);
  return 0;
}

// Fused attention in bf16 and fp8 at each length: one row each, the speedup over bf16.
int run_attention_dtypes(backend& be, const kernel_flags& f, const kernel_bench_options& o) {
  std::vector<std::int64_t> lengths;
  for (const std::string& text : f.attention_lengths) lengths.push_back(parse_seq_len(text, "--attention-dtypes"));
  std::printf("# fused attention, bf16 against fp8 (causal, d 128, %d query heads, %d kv heads; TFLOP/s counts "
              "bf16's FLOPs)\n",
              o.heads, o.kv_heads);
  std::printf("%10s %6s %12s %12s %12s %10s %8s\n", "S", "dtype", "fwd_ms", "bwd_ms", "fwd+bwd_ms", "TFLOP/s",
              "speedup");
  nlohmann::json rows = nlohmann::json::array();
  double bf16_ms = 0;
  for (const attention_dtype_timing& t : run_attention_dtype_bench(be, lengths, o)) {
    const double total = t.forward_ms + t.backward_ms;
    if (t.arithmetic == attention_dtype::bf16) bf16_ms = total;
    const std::string name(attention_dtype_name(t.arithmetic));
    std::printf("%10lld %6s %12.3f %12.3f %12.3f %10.1f %7.2fx\n", static_cast<long long>(t.tokens), name.c_str(),
                t.forward_ms, t.backward_ms, total, t.tflops, bf16_ms / total);
    rows.push_back({{"tokens", t.tokens}, {"attention_dtype", name}, {"forward_ms", t.forward_ms},
                    {"backward_ms", t.backward_ms}, {"tflops", t.tflops}, {"speedup_over_bf16", bf16_ms / total}});
  }
  if (!f.json_path.empty()) write_json_file(f.json_path, rows);
  return 0;
}

int run(const kernel_flags& f) {
  const backend_kind kind = parse_backend_kind(f.backend);
  require_within(f.repeats, 1, limits::repeats, "--repeats", "5");
  kernel_bench_options o;
  o.tokens = parse_seq_len(f.tokens, "--tokens");
  o.repeats = f.repeats;
  const std::size_t arena = kind == backend_kind::meta ? std::size_t{1} << 50 : static_cast<std::size_t>(f.memory_gib * (1 << 30));
  auto be = make_backend(kind, {arena, 0});
  std::printf("# upipe bench-kernels  backend=%s (%s)  tokens=%lld  repeats=%d  (Llama3-8B layer shapes)\n",
              f.backend.c_str(), be->library_versions().c_str(), static_cast<long long>(o.tokens), o.repeats);
  if (!f.attention_lengths.empty()) return run_attention_dtypes(*be, f, o);
  if (!f.moe_tokens.empty()) return run_moe_gemms(*be, f);
  if (!f.gdn_lengths.empty()) return run_gdn(*be, f, o);
  if (f.registry) {
    // Every registered op's perf case (backend/op_registry.cpp), against the device copy
    // bandwidth and the GEMM's rate.
    const perf_peaks peaks = measure_peaks(*be, o.tokens, o.repeats);
    print_op_timings(stdout, time_registered_ops(*be, o.tokens, o.repeats, peaks), peaks);
    return 0;
  }
  std::printf("%-40s %12s %10s %10s\n", "op", "time_ms", "TFLOP/s", "GB/s");
  nlohmann::json rows = nlohmann::json::array();
  for (const kernel_timing& t : run_kernel_bench(*be, o)) {
    std::printf("%-40s %12.3f %10.1f %10.1f\n", t.name.c_str(), t.ms, t.tflops, t.gbytes_per_s);
    rows.push_back({{"op", t.name}, {"time_ms", t.ms}, {"tflops", t.tflops}, {"gbytes_per_s", t.gbytes_per_s},
                    {"tokens", o.tokens}, {"backend", f.backend}});
  }
  be->synchronize();
  const std::size_t capacity = be->device_arena().capacity(), driver = be->driver_peak_bytes();
  std::printf("# memory: arena %.1f MiB (high water %.1f MiB; %.1f MiB of it library workspaces); driver in use at "
              "most %.1f MiB, %.1f MiB of it outside the arena (CUDA context, cuBLASLt and cuDNN handles, staging)\n",
              capacity / 1048576.0, be->device_arena().high_water() / 1048576.0,
              be->ledger().peak(mem_tag::workspace) / 1048576.0, driver / 1048576.0,
              driver > capacity ? (driver - capacity) / 1048576.0 : 0.0);
  rows.push_back({{"op", "memory"}, {"arena_bytes", capacity}, {"arena_high_water_bytes", be->device_arena().high_water()},
                  {"driver_peak_bytes", driver}});
  if (!f.json_path.empty()) write_json_file(f.json_path, rows);
  return 0;
}

}  // namespace

command_runner add_bench_kernels(CLI::App& app) {
  auto f = std::make_shared<kernel_flags>();
  app.add_option("--backend", f->backend, "cuda or cpu")->capture_default_str();
  app.add_option("--tokens", f->tokens, "tokens s of the shapes (K and M suffixes)")->capture_default_str();
  app.add_option("--repeats", f->repeats, "timed repeats after one warm-up")->capture_default_str();
  app.add_option("--memory-gib", f->memory_gib, "arena, GiB")->capture_default_str();
  app.add_flag("--ops", f->registry, "time every registered op instead (op, size, time, GB/s, TFLOP/s, % of peak)");
  app.add_option("--attention-dtypes", f->attention_lengths,
                 "time fused attention forward+backward (causal, d 128, Llama3-8B heads) in bf16 and in fp8 at these "
                 "lengths instead (comma list, K and M suffixes: 32K,128K,512K,1M)")
      ->delimiter(',');
  app.add_option("--moe", f->moe_tokens,
                 "time a mixture of experts' GEMMs instead, at Qwen3-30B-A3B's and Mixtral's expert shapes and these "
                 "token counts (comma list, K suffix: 16K,32K,64K): the per-expert loop, CUTLASS's and cuBLAS's grouped "
                 "GEMMs and a dense GEMM of the same FLOPs")
      ->delimiter(',');
  app.add_option("--moe-skew", f->moe_skew, "--moe's routing skew s: expert e drawn with weight (1 + e)^-s")
      ->capture_default_str();
  app.add_option("--gdn", f->gdn_lengths,
                 "time a Gated DeltaNet layer's gated delta rule forward+backward beside its model's full-attention "
                 "layer at these lengths instead (comma list, K and M suffixes: 32K,128K,512K,1M)")
      ->delimiter(',');
  app.add_option("--gdn-model", f->gdn_model, "the model of --gdn's shapes: qwen3.5-27b or qwen3-next-80b")
      ->capture_default_str();
  app.add_option("--gdn-workspace-gib", f->gdn_workspace_gib,
                 "--gdn: the gated delta rule's workspace, GiB (the longer its passes, the fewer)")
      ->capture_default_str();
  app.add_option("--json", f->json_path, "write the rows as JSON")->check(output_file_flag("--json"));
  return [f] { return run(*f); };
}

}  // namespace upipe::apps
