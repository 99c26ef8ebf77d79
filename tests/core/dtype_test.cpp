#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/npy.hpp"

namespace upipe {
namespace {

TEST(bf16, round_to_nearest_even) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 lies exactly halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  EXPECT_EQ(float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  // Just above halfway rounds up.
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(std::numeric_limits<float>::infinity())), std::numeric_limits<float>::infinity());
  EXPECT_EQ(round_to_bf16(3.140625f), 3.140625f);  // exactly representable
}

TEST(npy, round_trip) {
  const std::string path = (std::filesystem::temp_directory_path() / "upipe_npy_test.npy").string();
  const std::vector<float> v = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f};
  const std::vector<std::int64_t> shape = {2, 3};
  write_npy(path, shape, v);
  std::vector<std::int64_t> got_shape;
  EXPECT_EQ(read_npy(path, &got_shape), v);
  EXPECT_EQ(got_shape, shape);
  EXPECT_EQ(std::filesystem::file_size(path) % 64, 24u);  // 64-byte aligned header + 24 bytes of data
  std::filesystem::remove(path);
  EXPECT_THROW(write_npy("/nonexistent-dir/x.npy", shape, v), io_error);
}

}  // namespace
}  // namespace upipe
