// The start-up memory check as a user meets it: a run whose host need passes what the
// machine offers (pretended with UPIPE_MEMORY_LIMIT) exits 3 before its first step, naming
// the parts and a way out; the same run within the machine trains.
#include <gtest/gtest.h>

#include <string>

#include "run_upipe.hpp"

namespace {

using upipe::testing::run_result;
using upipe::testing::run_upipe_env;

TEST(memory_cli, a_run_past_the_machines_host_memory_exits_3_before_its_first_step) {
  // llama3.2-1b's random first weights alone hold 4.6 GiB of f32 on the host.
  const run_result big = run_upipe_env("UPIPE_MEMORY_LIMIT=1G", "train --model llama3.2-1b --steps 1 --seq-len 256 --checkpoint-policy what=input,every=1,where=device", 120);
  EXPECT_EQ(big.exit_code, 3) << big.output;
  EXPECT_NE(big.output.find("upipe: error: this run needs"), std::string::npos) << big.output;
  EXPECT_NE(big.output.find("of host memory and the machine offers 0.95 GiB (UPIPE_MEMORY_LIMIT"), std::string::npos)
      << big.output;
  EXPECT_NE(big.output.find("the random first weights' f32 host copy 4."), std::string::npos) << big.output;
  EXPECT_NE(big.output.find("--lora"), std::string::npos) << big.output;
  EXPECT_EQ(big.output.find("step 1/"), std::string::npos) << big.output;

  // A budget past the machine is refused whatever it holds.
  const run_result budget = run_upipe_env("UPIPE_MEMORY_LIMIT=2G", "train --steps 1 --host-memory-gib 4", 120);
  EXPECT_EQ(budget.exit_code, 3) << budget.output;
  EXPECT_NE(budget.output.find("the rest of --host-memory-gib"), std::string::npos) << budget.output;
  EXPECT_NE(budget.output.find("a smaller --host-memory-gib"), std::string::npos) << budget.output;

  // A budget too small for the offloaded state beside the weights: exit 3 with the budget that fits.
  const run_result small =
      run_upipe_env("", "train --steps 1 --offload optimizer --host-memory-gib 0.01", 120);
  EXPECT_EQ(small.exit_code, 3) << small.output;
  EXPECT_NE(small.output.find("give --host-memory-gib"), std::string::npos) << small.output;

  const run_result fits = run_upipe_env("UPIPE_MEMORY_LIMIT=4G", "train --steps 1 --host-memory-gib 1 --eval-samples 0", 300);
  EXPECT_EQ(fits.exit_code, 0) << fits.output;
}

}  // namespace
