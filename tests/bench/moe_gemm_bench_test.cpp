// `upipe bench-kernels --moe`'s rows (bench/moe_gemm_bench.hpp) on the cpu backend at a tiny
// expert shape: every form through every engine and the dense GEMM, over the routed rows
// (k a token), the skew drawing more rows to the low experts as it grows.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include "bench/moe_gemm_bench.hpp"

namespace upipe {
namespace {

TEST(moe_gemm_bench, times_every_form_and_engine_over_the_routed_rows) {
  auto be = make_cpu_backend({std::size_t{256} << 20, std::size_t{16} << 20});
  const moe_gemm_shape tiny{"tiny", 8, 2, 64, 32};
  const std::vector<moe_gemm_timing> rows = run_moe_gemm_bench(*be, tiny, 300, 1, 0.3);
  ASSERT_EQ(rows.size(), 16u);  // 4 forms x (dense, loop, cutlass, cublas)
  std::map<std::string, std::set<std::string>> engines;
  for (const moe_gemm_timing& r : rows) {
    engines[r.form].insert(r.engine);
    EXPECT_EQ(r.rows, 300 * 2);
    EXPECT_GT(r.tflops, 0.0);
    EXPECT_GT(r.vs_dense, 0.0);
    if (r.engine == "dense") EXPECT_DOUBLE_EQ(r.vs_dense, 1.0);
  }
  EXPECT_EQ(engines.size(), 4u);
  for (const auto& [form, names] : engines) EXPECT_EQ(names, (std::set<std::string>{"cublas", "cutlass", "dense", "loop"}));
}

TEST(moe_gemm_bench, a_larger_skew_loads_the_busiest_expert_more) {
  auto be = make_cpu_backend({std::size_t{256} << 20, std::size_t{16} << 20});
  const moe_gemm_shape tiny{"tiny", 16, 2, 16, 16};
  const auto busiest = [&](double skew) { return run_moe_gemm_bench(*be, tiny, 2000, 1, skew).front().busiest; };
  const std::int64_t uniform = busiest(0.0), skewed = busiest(2.0);
  EXPECT_LT(uniform, 2000 * 2 / 16 * 3 / 2);  // near the mean of 250
  EXPECT_GT(skewed, 2 * uniform);
}

}  // namespace
}  // namespace upipe
