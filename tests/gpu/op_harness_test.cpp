// Every registered op (backend/op_registry.cpp) on the cuda backend against the cpu
// reference, one test per op: the same seeded inputs (bf16-rounded where the GPU stores
// bf16), every compared output's normalized error within its tolerance. A new op is
// compared the day it is registered. Skipped when no CUDA device is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "backend/op_harness.hpp"
#include "backend/op_registry.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

std::string op_name(const ::testing::TestParamInfo<op_entry>& info) { return info.param.name; }

class gpu_registered_op : public cpu_and_gpu<::testing::TestWithParam<op_entry>, 1024> {};

TEST_P(gpu_registered_op, matches_the_cpu_reference) {
  std::uint64_t seed = 1;
  for (const op_case& c : GetParam().test_cases()) {
    SCOPED_TRACE(c.size);
    for (const output_error& e : compare_with_reference(*cpu_, *gpu_, c, seed++))
      EXPECT_TRUE(e.ok()) << e.output << " error " << e.error << " > " << e.tolerance;
  }
}

INSTANTIATE_TEST_SUITE_P(every, gpu_registered_op, ::testing::ValuesIn(op_registry()), op_name);

}  // namespace
}  // namespace upipe
