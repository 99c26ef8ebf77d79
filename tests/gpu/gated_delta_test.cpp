// The Gated DeltaNet ops on the GPU: every registered case (tests/gpu/op_harness_test.cpp
// runs them) and, here, the gated delta rule at Qwen3.5-27B's and Qwen3-Next-80B's head
// shapes against the cpu backend, which runs the same chunked stages on the host; and two
// runs of the GPU giving the same bits (no atomics: a race would show as a difference).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "backend/op_cases.hpp"
#include "backend/op_harness.hpp"
#include "gpu_support.hpp"

namespace upipe {
namespace {

class gpu_gated_delta : public cpu_and_gpu<::testing::Test, 2048> {};

TEST_F(gpu_gated_delta, model_shapes_match_the_cpu_reference) {
  std::uint64_t seed = 101;
  for (const op_case& c : op_cases::gated_delta_model_cases()) {
    SCOPED_TRACE(c.size);
    const auto errors = compare_with_reference(*cpu_, *gpu_, c, seed++);
    EXPECT_FALSE(errors.empty());
    for (const output_error& e : errors) EXPECT_TRUE(e.ok()) << e.output << " error " << e.error << " > " << e.tolerance;
  }
}

std::vector<std::vector<float>> run_and_fetch(backend& be, const op_case& c, std::uint64_t seed) {
  const case_tensors t = make_case_tensors(be, c, seed);
  if (c.prepare) c.prepare(be, t);
  c.run(be, t);
  be.synchronize();
  std::vector<std::vector<float>> outputs;
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    if (c.tensors[i].bf16_tolerance <= 0) continue;
    std::vector<float> values(static_cast<std::size_t>(t.list()[i].numel()));
    be.download_f32(values.data(), t.list()[i]);
    outputs.push_back(std::move(values));
  }
  return outputs;
}

TEST_F(gpu_gated_delta, two_runs_give_the_same_bits) {
  for (const op_case& c : op_cases::gated_delta_model_cases()) {
    SCOPED_TRACE(c.size);
    const auto first = run_and_fetch(*gpu_, c, 7), second = run_and_fetch(*gpu_, c, 7);
    ASSERT_EQ(first.size(), second.size());
    for (std::size_t i = 0; i < first.size(); ++i)
      EXPECT_EQ(0, std::memcmp(first[i].data(), second[i].data(), first[i].size() * sizeof(float))) << "output " << i;
  }
}

}  // namespace
}  // namespace upipe
