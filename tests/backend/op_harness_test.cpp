// Every registered op (backend/op_registry.cpp) on every backend this build has without a
// device: the cpu reference against each op's float64 definition (backend/op_float64.hpp),
// the gradient ops against central finite differences of their objectives, and meta for
// shapes and allocations. tests/gpu/op_harness_test.cpp runs the same cases on cuda
// against the cpu reference.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <variant>

#include "backend/op_harness.hpp"
#include "backend/op_registry.hpp"

namespace upipe {
namespace {

memory_limits harness_limits() { return {std::size_t{512} << 20, std::size_t{16} << 20}; }

std::string op_name(const ::testing::TestParamInfo<op_entry>& info) { return info.param.name; }

class registered_op : public ::testing::TestWithParam<op_entry> {};

TEST(op_registry, names_are_unique_and_every_entry_has_cases) {
  std::set<std::string> names;
  for (const op_entry& e : op_registry()) {
    EXPECT_TRUE(names.insert(e.name).second) << e.name;
    EXPECT_FALSE(e.test_cases().empty()) << e.name;
    ASSERT_TRUE(e.perf_case) << e.name;
    for (const op_case& c : e.test_cases()) {
      EXPECT_TRUE(c.run) << e.name;
      EXPECT_EQ(c.gradients.empty(), !c.objective) << e.name << " " << c.size << ": gradients need an objective";
      EXPECT_TRUE(c.float64 || !c.gradients.empty() || !c.reference_test.empty())
          << e.name << " " << c.size << ": an op is checked against float64, by finite differences or by a named test";
    }
  }
  // Each alternative of `op` has an entry at least (swiglu and geglu share theirs), so a new
  // alternative without one shows here without a count to keep by hand.
  EXPECT_GE(names.size(), std::variant_size_v<op>);
}

TEST_P(registered_op, the_cpu_reference_matches_float64) {
  auto cpu = make_cpu_backend(harness_limits());
  std::uint64_t seed = 1;
  for (const op_case& c : GetParam().test_cases()) {
    if (!c.float64) continue;  // a gradient op: finite differences check it
    SCOPED_TRACE(c.size);
    const auto errors = compare_with_float64(*cpu, c, seed++);
    EXPECT_FALSE(errors.empty()) << "a registered case compares at least one output";
    for (const output_error& e : errors) EXPECT_TRUE(e.ok()) << e.output << " error " << e.error << " > " << e.tolerance;
  }
}

TEST_P(registered_op, gradients_match_finite_differences) {
  auto reference = make_cpu_backend(harness_limits());
  std::uint64_t seed = 11;
  for (const op_case& c : GetParam().test_cases()) {
    if (c.gradients.empty()) continue;
    SCOPED_TRACE(c.size);
    const auto errors = check_gradients(*reference, c, seed++);
    EXPECT_EQ(errors.size(), c.gradients.size());
    for (const output_error& e : errors) {
      EXPECT_TRUE(e.ok()) << e.output << " error " << e.error << " > " << e.tolerance;
    }
  }
}

TEST_P(registered_op, runs_on_meta_with_allocations_only) {
  auto meta = make_meta_backend(harness_limits());
  const std::size_t before = meta->device_arena().in_use();
  for (const op_case& c : GetParam().test_cases()) {
    SCOPED_TRACE(c.size);
    EXPECT_GT(run_shapes_only(*meta, c), 0u);
    EXPECT_EQ(meta->device_arena().in_use(), before) << "the case's tensors are freed with it";
  }
  // The benchmark size too: meta holds no data, so its arena may be as large as a GPU's.
  auto large = make_meta_backend({std::size_t{1} << 40, std::size_t{16} << 20});
  const op_case perf = GetParam().perf_case(32768, large->work_dtype());
  EXPECT_NO_THROW(run_shapes_only(*large, perf)) << perf.size;
}

INSTANTIATE_TEST_SUITE_P(every, registered_op, ::testing::ValuesIn(op_registry()), op_name);

}  // namespace
}  // namespace upipe
