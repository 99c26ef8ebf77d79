// `upipe bench` as a user runs it: rows per strategy, U and length, JSON with the
// measures docs/design.md section 7 names, the check after timing, and refusals.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "run_upipe.hpp"

namespace {

using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::temp_dir;

TEST(bench_cli, rows_json_and_checks_on_the_cpu) {
  const auto dir = temp_dir("bench_cli");
  const auto path = (dir / "bench.json").string();
  const run_result r = run_upipe("bench --cp 4 --attention ulysses,upipe,ring --head-chunk all --seq-len 128,256 "
                                 "--repeats 2 --json " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("0 wrong"), std::string::npos) << r.output;
  std::ifstream in(path);
  const nlohmann::json rows = nlohmann::json::parse(in);
  ASSERT_EQ(rows.size(), (1u + 1u + 1u) * 2u);  // ulysses, upipe U = 4 (H = 4, C = 4), ring; two lengths
  for (const auto& row : rows) {
    for (const char* key : {"tokens_per_s_per_gpu", "model_tflops", "mfu", "peak_bytes", "arena_high_water_bytes",
                            "check_rel_diff", "layer_ms"})
      EXPECT_TRUE(row.contains(key)) << key;
    EXPECT_GT(row["tokens_per_s_per_gpu"].get<double>(), 0.0);
    EXPECT_TRUE(row["check_pass"].get<bool>());
    EXPECT_LT(row["check_rel_diff"].get<double>(), 1e-4);
    EXPECT_EQ(row["repeats"], 2);
  }
  std::filesystem::remove_all(dir);
}

TEST(bench_cli, emulated_rank_zero_on_meta_reports_memory_only) {
  const auto dir = temp_dir("bench_meta");
  const auto path = (dir / "bench.json").string();
  const run_result r = run_upipe("bench --backend meta --emulate-cp 8 --model llama3-8b --layers 1 --attention "
                                 "ulysses,upipe --head-chunk 8 --seq-len 128K,2M --json " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(path);
  const nlohmann::json rows = nlohmann::json::parse(in);
  ASSERT_EQ(rows.size(), 4u);
  for (const auto& row : rows) {
    EXPECT_TRUE(row["step_ms"].is_null());
    EXPECT_TRUE(row["emulated"].get<bool>());
    EXPECT_GT(row["arena_high_water_bytes"].get<double>(), 0.0);
  }
  // At 2M tokens one timed pass (stated in the header) and UPipe's peak below Ulysses'.
  EXPECT_EQ(rows[1]["repeats"], 1);
  EXPECT_LT(rows[3]["device_peak_bytes"].get<double>(), rows[1]["device_peak_bytes"].get<double>());
  std::filesystem::remove_all(dir);
}

// Issue 45's slice: Qwen3-30B-A3B's first layers (its per-layer sparse list cut with them),
// rank 0 of 8 emulated, the model FLOPs those of its active parameters (8 of 128 experts).
TEST(bench_cli, a_slice_of_a_mixture_of_experts_on_meta) {
  const auto dir = temp_dir("bench_moe");
  const auto path = (dir / "bench.json").string();
  const run_result r = run_upipe("bench --backend meta --emulate-cp 8 --model qwen3-30b-a3b --layers 2 --attention "
                                 "upipe --seq-len 128K,512K --memory-gib 70 --moe-gemm grouped --json " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(path);
  const nlohmann::json rows = nlohmann::json::parse(in);
  ASSERT_EQ(rows.size(), 2u);
  for (const auto& row : rows) {
    EXPECT_EQ(row["layers"], 2);
    EXPECT_GT(row["arena_high_water_bytes"].get<double>(), 0.0);
  }
  // 6 N_active S + 6 L H d S^2: per layer q, k, v, o (2048 x (4096 + 512 + 512 + 4096)), the
  // router (128 x 2048) and 8 experts' gate, up and down (3 x 768 x 2048), and the lm head.
  const double S = 131072, layer = 2048.0 * 9216 + 128.0 * 2048 + 8.0 * 3 * 768 * 2048;
  const double active = 2 * layer + 151936.0 * 2048;
  const double want = 6 * active * S + 6.0 * 2 * 32 * 128 * S * S;
  EXPECT_NEAR(rows[0]["model_flops_per_step"].get<double>() / want, 1.0, 1e-9);
  std::filesystem::remove_all(dir);
}

// --checkpoint-policy auto: each row runs the planner's fastest policy that fits the GPU
// arena (meta predicts the GPU's choice), names it, and keeps it in the JSON; at a length no
// policy fits the row is measured with the default policy and says why, with the way out.
TEST(bench_cli, auto_policy_is_chosen_per_row_and_recorded) {
  const auto dir = temp_dir("bench_auto");
  const auto path = (dir / "bench.json").string();
  const std::string common = "bench --backend meta --emulate-cp 8 --model llama3-8b --layers 2 --attention upipe "
                             "--head-chunk 8 --checkpoint-policy auto --memory-gib 20 ";
  const run_result r = run_upipe(common + "--seq-len 128K --json " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoint policy what=input+attention,every=1,where=device (auto"), std::string::npos)
      << r.output;
  std::ifstream in(path);
  const nlohmann::json rows = nlohmann::json::parse(in);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0]["checkpoint_policy"], "what=input+attention,every=1,where=device");
  EXPECT_LT(rows[0]["arena_high_water_bytes"].get<double>(), 20.0 * (1 << 30));
  const run_result none = run_upipe(common + "--seq-len 16M");
  EXPECT_EQ(none.exit_code, 0) << none.output;
  EXPECT_NE(none.output.find("checkpoint policy what=input,every=1,where=device (the default: auto found none that "
                             "fits: no checkpoint policy fits S = 16777216 in an arena of 20 GiB per rank: raise "
                             "--memory-gib"),
            std::string::npos)
      << none.output;
  std::filesystem::remove_all(dir);
}

TEST(bench_cli, contradictory_flags_are_refused) {
  const run_result r = run_upipe("bench --cp 4 --emulate-cp 8");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("contradict"), std::string::npos) << r.output;
  const run_result o = run_upipe("bench --optimizer sgd");
  EXPECT_EQ(o.exit_code, 2) << o.output;
}

}  // namespace
