// The `upipe bench-attention` command as a user runs it: rows, JSON, dumps checked by an
// independent NumPy reference, and clear refusals of bad flags.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "run_upipe.hpp"

namespace {

using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::temp_dir;

TEST(bench_attention_cli, default_run_checks_every_strategy) {
  const run_result r = run_upipe("bench-attention --seq-len 64 --head-dim 16");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* s : {"ulysses", "upipe", "ring"}) EXPECT_NE(r.output.find(s), std::string::npos);
  EXPECT_NE(r.output.find("3 configurations, 0 wrong"), std::string::npos) << r.output;
}

TEST(bench_attention_cli, json_has_the_promised_fields) {
  const auto dir = temp_dir("json");
  const auto path = dir / "out.json";
  const run_result r = run_upipe("bench-attention --backend cpu --strategy upipe,ring --heads 8 --kv-heads 4 --cp 2 "
                                 "--head-chunk 2 --seq-len 32 --head-dim 8 --seed 5 --json " + path.string());
  // --head-chunk with ring is refused, so ask for upipe alone with every U instead.
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("not allowed with --strategy ring"), std::string::npos) << r.output;
  const run_result ok = run_upipe("bench-attention --strategy upipe --heads 8 --kv-heads 4 --cp 2 --head-chunk all "
                                  "--seq-len 32,48 --head-dim 8 --json " + path.string());
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  std::ifstream in(path);
  const auto rows = nlohmann::json::parse(in);
  ASSERT_EQ(rows.size(), 6u);  // U in {2, 4, 8} x two lengths
  for (const auto& row : rows) {
    for (const char* key : {"strategy", "backend", "seq_len", "heads", "kv_heads", "head_dim", "cp", "head_chunk",
                            "time_ms", "peak_bytes", "attention_peak_bytes", "plan_forward_peak_bytes", "plan_backward_peak_bytes",
                            "bytes_sent", "rel_error", "max_rel_error"})
      EXPECT_TRUE(row.contains(key)) << key;
    EXPECT_LT(row["max_rel_error"].get<double>(), 1e-5);
    EXPECT_TRUE(row["rel_error"].contains("d_wq"));
    EXPECT_TRUE(row["peak_bytes"].contains("attention"));
    EXPECT_GT(row["bytes_sent"]["all_to_all"].get<double>(), 0);
  }
  std::filesystem::remove_all(dir);
}

TEST(bench_attention_cli, meta_backend_reports_memory_without_data) {
  const auto dir = temp_dir("meta");
  const auto path = dir / "meta.json";
  const run_result r = run_upipe("bench-attention --backend meta --strategy ulysses,upipe --heads 64 --kv-heads 8 "
                                 "--head-dim 128 --cp 8 --seq-len 1M --json " + path.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(path);
  const auto rows = nlohmann::json::parse(in);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_TRUE(rows[0]["max_rel_error"].is_null());
  EXPECT_TRUE(rows[0]["rel_error"].is_null());
  const double ulysses = rows[0]["attention_peak_bytes"], upipe = rows[1]["attention_peak_bytes"];
  EXPECT_LE(upipe / ulysses, 1.0 / 3.0 + 1e-3);  // tests/cp/memory_test.cpp: 96 sd against 288 sd
  std::filesystem::remove_all(dir);
}

TEST(bench_attention_cli, dump_is_checked_by_an_independent_numpy_reference) {
  if (std::system("python3 -c 'import numpy' >/dev/null 2>&1") != 0) GTEST_SKIP() << "NumPy is not installed";
  const auto dir = temp_dir("dump");
  const run_result r = run_upipe("bench-attention --strategy upipe --heads 8 --kv-heads 2 --cp 4 --head-chunk 4 "
                                 "--seq-len 64 --head-dim 16 --model-dim 24 --rope-llama3 --rope-theta 10000 --qk-norm --dump " +
                                 dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* f : {"x", "wq", "wk", "wv", "wo", "d_y", "y", "attn_out", "d_x", "d_wq", "d_wk", "d_wv", "d_wo",
                        "q_norm", "d_q_norm", "d_k_norm"})
    EXPECT_TRUE(std::filesystem::exists(dir / (std::string(f) + ".npy"))) << f;
  const std::string check = "python3 " + std::string(UPIPE_SOURCE_DIR) + "/scripts/check_dump.py " + dir.string();
  EXPECT_EQ(std::system(check.c_str()), 0);
  std::filesystem::remove_all(dir);
}

TEST(bench_attention_cli, bad_flags_exit_non_zero_with_a_clear_message) {
  const std::pair<const char*, const char*> cases[] = {
      {"--strategy upipe --cp 4 --head-chunk 6 --heads 8 --kv-heads 2 --seq-len 64", "U must be a multiple of C"},
      {"--strategy upipe --cp 3 --heads 8 --kv-heads 2 --seq-len 48", "must divide query heads"},
      {"--strategy upipe --cp 4 --heads 12 --kv-heads 3 --seq-len 48", "C must divide K or K must divide C"},
      {"--strategy upipe --cp 4 --seq-len 66", "use S = 68"},
      {"--strategy ring --cp 4 --seq-len 36", "divisible by 2C = 8"},
      {"--strategy ulysses --head-chunk 4", "not allowed for ulysses"},
      {"--seq-len 0", "--seq-len 0 must be at least 1"},
      {"--heads -8", "--heads = -8 must lie between 1 and 4096"},
      {"--seq-len 12Q", "is not a count"},
      {"--strategy zigzag", "must be one of ulysses, upipe, ring"},
      {"--backend tpu", "must be one of cpu, meta, cuda"},
      {"--heads eight", "eight"},
      {"--dump /proc/forbidden/dir --seq-len 32 --strategy ulysses", "cannot create dump directory"},
  };
  for (const auto& [args, message] : cases) {
    const run_result r = run_upipe(std::string("bench-attention ") + args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
  }
}

}  // namespace
