// `upipe report`: SVG plots from the JSON of bench and plan, and clear refusals.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "run_upipe.hpp"

namespace {

using upipe::testing::run_result;
using upipe::testing::run_upipe;
using upipe::testing::temp_dir;

std::string read(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(report_cli, plots_bench_and_plan_results) {
  const auto dir = temp_dir("report_cli");
  const std::string bench = (dir / "bench.json").string(), plan = (dir / "plan.json").string();
  ASSERT_EQ(run_upipe("bench --backend meta --emulate-cp 8 --model llama3-8b --layers 1 --attention ulysses,upipe "
                      "--head-chunk 8,16 --seq-len 128K,512K --json " + bench).exit_code, 0);
  ASSERT_EQ(run_upipe("bench --seq-len 128,256 --attention ulysses,upipe --repeats 1 --no-check --json " +
                      (dir / "cpu.json").string()).exit_code, 0);
  ASSERT_EQ(run_upipe("plan --model llama3.2-1b --layers 2 --gpus 4 --gpu-memory 6GiB --json " + plan).exit_code, 0);
  const auto out = dir / "plots";
  const run_result r = run_upipe("report --out " + out.string() + " " + bench + " " + (dir / "cpu.json").string() +
                                 " " + plan);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* name : {"memory_breakdown.svg", "throughput_vs_s.svg", "peak_vs_s.svg", "u_ablation.svg"}) {
    const std::string svg = read(out / name);
    EXPECT_NE(svg.find("<svg"), std::string::npos) << name;
    EXPECT_NE(r.output.find(name), std::string::npos) << name;
  }
  EXPECT_NE(read(out / "memory_breakdown.svg").find("upipe U=8"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(report_cli, bad_inputs_are_refused) {
  const run_result missing = run_upipe("report /nonexistent/results.json");
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("cannot read report input '/nonexistent/results.json': no such file"), std::string::npos) << missing.output;
  const auto dir = temp_dir("report_bad");
  const auto bad = dir / "bad.json";
  std::ofstream(bad) << "{\"a\": 1}";
  const run_result wrong = run_upipe("report --out " + (dir / "p").string() + " " + bad.string());
  EXPECT_EQ(wrong.exit_code, 2) << wrong.output;
  EXPECT_NE(wrong.output.find("neither a list of benchmark rows nor a plan"), std::string::npos) << wrong.output;
  // A row without a field the plots use names the file, the row and the field; no traceback.
  std::ofstream(dir / "rows.json") << "[{\"strategy\": \"upipe\", \"seq_len\": 64}, {\"seq_len\": 64}]";
  const run_result field = run_upipe("report --out " + (dir / "p").string() + " " + (dir / "rows.json").string());
  EXPECT_EQ(field.exit_code, 2) << field.output;
  EXPECT_NE(field.output.find("rows.json: row 1: field 'strategy' is missing"), std::string::npos) << field.output;
  EXPECT_EQ(field.output.find("Traceback"), std::string::npos) << field.output;
  std::filesystem::remove_all(dir);
}

}  // namespace

namespace {

// train --metrics-json: the loss curve, a curve per run, the held-out loss where measured.
TEST(report_cli, plots_the_loss_curve_of_a_training_run) {
  const auto dir = temp_dir("report_metrics");
  const std::string metrics = (dir / "m.jsonl").string();
  ASSERT_EQ(run_upipe("train --seq-len 64 --seq-warmup 0 --steps 6 --eval-samples 0 --cp 2 --metrics-json " + metrics)
                .exit_code,
            0);
  const run_result r = run_upipe("report --out " + (dir / "plots").string() + " " + metrics);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string svg = read(dir / "plots" / "loss_curve.svg");
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("learning rate"), std::string::npos);
  // A line cut short by a killed writer is named.
  std::ofstream(metrics, std::ios::app) << "{\"step\": 7, \"lo";
  const run_result cut = run_upipe("report --out " + (dir / "plots").string() + " " + metrics);
  EXPECT_NE(cut.exit_code, 0);
  EXPECT_NE(cut.output.find("line 8 is not JSON"), std::string::npos) << cut.output;
  std::filesystem::remove_all(dir);
}

}  // namespace
