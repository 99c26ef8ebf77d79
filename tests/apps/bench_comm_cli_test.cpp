// `upipe bench-comm` on the cpu backend (threaded ranks): one row per collective and
// length with the message sizes of docs/design.md section 4, and refusals.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "run_upipe.hpp"

namespace {

using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::temp_dir;

TEST(bench_comm_cli, rows_carry_the_strategies_message_sizes) {
  const auto dir = temp_dir("bench_comm_cli");
  const auto path = (dir / "comm.json").string();
  const run_result r =
      run_upipe("bench-comm --model llama3.2-1b --cp 4 --head-chunk 8 --seq-len 1K,2K --repeats 2 --json " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(path);
  const nlohmann::json rows = nlohmann::json::parse(in);
  ASSERT_EQ(rows.size(), 14u);  // seven distinct messages of the table's plans (no mesh) at two lengths
  // llama3.2-1b: H = 32, K = 8, d = 64; cpu rows are f32; s = S / 4.
  const std::size_t s = 1024 / 4, d = 64, f32 = 4;
  EXPECT_EQ(rows[0]["collective"], "ulysses a2a_k/a2a_v");
  EXPECT_EQ(rows[0]["bytes"], s * 8 * d * f32);   // Ulysses: every kv head
  EXPECT_EQ(rows[1]["collective"], "ulysses a2a_q/a2a_o");
  EXPECT_EQ(rows[1]["bytes"], s * 32 * d * f32);  // Ulysses: every query head
  EXPECT_EQ(rows[2]["collective"], "upipe U=8 a2a_k/a2a_v");
  EXPECT_EQ(rows[2]["bytes"], s * 4 * d * f32);   // one kv head to each of 4 ranks
  EXPECT_EQ(rows[3]["collective"], "upipe U=8 a2a_q/a2a_o");
  EXPECT_EQ(rows[3]["bytes"], s * 8 * d * f32);   // a UPipe stage of U = 8 query heads
  EXPECT_EQ(rows[4]["collective"], "ring ring_kv");
  EXPECT_EQ(rows[4]["bytes"], 2 * s * 8 * d * f32);  // a ring step: K and V of the shard
  EXPECT_EQ(rows[5]["collective"], "fpdt N=2 a2a_k/a2a_v");
  EXPECT_EQ(rows[5]["bytes"], s / 2 * 8 * d * f32);  // Ulysses' kv heads, a chunk of the shard
  EXPECT_EQ(rows[6]["bytes"], s / 2 * 32 * d * f32);
  for (const auto& row : rows) {
    EXPECT_GT(row["time_us"].get<double>(), 0.0);
    EXPECT_GT(row["algbw_gbytes_per_s"].get<double>(), 0.0);
  }
  std::filesystem::remove_all(dir);
}

TEST(bench_comm_cli, bad_flags_are_refused_with_an_alternative) {
  for (const char* args : {"bench-comm --cp 3", "bench-comm --cp 1", "bench-comm --head-chunk 6",
                           "bench-comm --backend meta", "bench-comm --seq-len 1001", "bench-comm --comm bogus",
                           "bench-comm --backend cpu --comm nccl"}) {
    const run_result r = run_upipe(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find("upipe: error:"), std::string::npos) << args << ": " << r.output;
  }
}

}  // namespace
