#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "formats/npy.hpp"

namespace upipe {
namespace {

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
