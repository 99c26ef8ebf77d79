#include "formats/safetensors.hpp"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/error.hpp"

namespace upipe {
namespace {

namespace fs = std::filesystem;

// A whole safetensors file from its parts: the 8-byte little-endian length, the header
// text as given (padding included) and the data bytes.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out;
  for (int i = 0; i < 8; ++i) out += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string f32_bytes(std::initializer_list<float> values) {
  std::string out;
  for (float v : values) {
    const auto bits = std::bit_cast<std::uint32_t>(v);
    for (int i = 0; i < 4; ++i) out += static_cast<char>((bits >> (8 * i)) & 0xff);
  }
  return out;
}

std::string u16_bytes(std::initializer_list<std::uint16_t> values) {
  std::string out;
  for (auto v : values) {
    out += static_cast<char>(v & 0xff);
    out += static_cast<char>(v >> 8);
  }
  return out;
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::vector<std::string> directory_listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

bool same_bits(float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b); }

class safetensors_io : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("upipe_safetensors_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add, ignored);
    fs::remove_all(dir_, ignored);
  }

  // Reads `path` expecting an io_error whose message names the file and contains `fragment`.
  void expect_read_error(const fs::path& path, const std::string& fragment) {
    try {
      read_safetensors(path.string());
      ADD_FAILURE() << "reading " << path << " did not throw; expected: " << fragment;
    } catch (const io_error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(path.string()), std::string::npos) << message;
      EXPECT_NE(message.find(fragment), std::string::npos) << "expected '" << fragment << "' in: " << message;
    }
  }

  // Writes a hand-built file and expects reading it to fail with `fragment`.
  void expect_corrupt(const std::string& name, const std::string& bytes, const std::string& fragment) {
    SCOPED_TRACE(name);
    const fs::path path = dir_ / (name + ".safetensors");
    write_bytes(path, bytes);
    expect_read_error(path, fragment);
  }

  fs::path dir_;
};

TEST_F(safetensors_io, round_trip_f32_and_bf16_with_scalar_empty_and_metadata) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> weight = {1.5f, -2.25f, 1e-30f, 3.4e38f, inf, -0.0f};
  // 1 + 2^-8 ties to even (1.0); 1 + 3 * 2^-8 ties up to 1 + 2^-6; 0.1 rounds to 0.10009765625.
  const std::vector<float> bias = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 0.1f, -3.0f};
  const std::vector<float> scalar = {42.0f};
  const std::vector<float> empty;
  const safetensors_tensor tensors[] = {
      {.name = "w", .shape = {2, 3}, .values = weight, .type = dtype::f32},
      {.name = "b", .shape = {4}, .values = bias, .type = dtype::bf16},
      {.name = "scale", .shape = {}, .values = scalar, .type = dtype::f32},
      {.name = "empty", .shape = {0, 4}, .values = empty, .type = dtype::bf16},
  };
  const fs::path path = dir_ / "model.safetensors";
  write_safetensors(path.string(), tensors, {{"format", "pt"}, {"step", "12"}});

  const safetensors_file file = read_safetensors(path.string());
  ASSERT_EQ(file.tensors.size(), 4u);
  EXPECT_EQ(file.metadata, (std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}));
  const auto& w = file.tensors.at("w");
  EXPECT_EQ(w.dtype, "F32");
  EXPECT_EQ(w.shape, (std::vector<std::int64_t>{2, 3}));
  ASSERT_EQ(w.values.size(), weight.size());
  for (std::size_t i = 0; i < weight.size(); ++i) EXPECT_TRUE(same_bits(w.values[i], weight[i])) << i;
  const auto& b = file.tensors.at("b");
  EXPECT_EQ(b.dtype, "BF16");
  EXPECT_EQ(b.shape, (std::vector<std::int64_t>{4}));
  EXPECT_EQ(b.values, (std::vector<float>{1.0f, 1.0f + 0x1p-6f, 0.10009765625f, -3.0f}));
  const auto& s = file.tensors.at("scale");
  EXPECT_TRUE(s.shape.empty());
  EXPECT_EQ(s.values, scalar);
  const auto& e = file.tensors.at("empty");
  EXPECT_EQ(e.dtype, "BF16");
  EXPECT_EQ(e.shape, (std::vector<std::int64_t>{0, 4}));
  EXPECT_TRUE(e.values.empty());
}

TEST_F(safetensors_io, written_header_is_sorted_contiguous_and_aligned) {
  const std::vector<float> three = {1, 2, 3}, one = {4};
  const safetensors_tensor tensors[] = {
      {.name = "zeta", .shape = {3}, .values = three, .type = dtype::bf16},
      {.name = "alpha", .shape = {1}, .values = one, .type = dtype::f32},
      {.name = "mid", .shape = {3}, .values = three, .type = dtype::f32},
  };
  const fs::path path = dir_ / "layout.safetensors";
  write_safetensors(path.string(), tensors);
  const std::string bytes = read_bytes(path);
  std::uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ((8 + header_size) % 8, 0u) << "data section must start 8-byte aligned";
  const auto header = nlohmann::json::parse(bytes.substr(8, header_size));
  EXPECT_FALSE(header.contains("__metadata__")) << "no metadata given, none written";
  EXPECT_EQ(header["alpha"]["data_offsets"], nlohmann::json({0, 4}));
  EXPECT_EQ(header["mid"]["data_offsets"], nlohmann::json({4, 16}));
  EXPECT_EQ(header["zeta"]["data_offsets"], nlohmann::json({16, 22}));
  EXPECT_EQ(header["zeta"]["dtype"], "BF16");
  EXPECT_EQ(bytes.size(), 8 + header_size + 22);
  // The data bytes themselves: alpha, then mid, then zeta in bf16.
  EXPECT_EQ(bytes.substr(8 + header_size), f32_bytes({4}) + f32_bytes({1, 2, 3}) + u16_bytes({0x3f80, 0x4000, 0x4040}));
}

TEST_F(safetensors_io, reads_hand_built_f16_file) {
  // 1, -2, 1/3 rounded (0x3555), smallest subnormal 2^-24, largest subnormal 1023 * 2^-24,
  // largest normal 65504, +inf, -inf, nan, -0. The header is deliberately unpadded, so the
  // data section starts at an odd offset.
  const std::string header = R"({"h":{"dtype":"F16","shape":[2,5],"data_offsets":[0,20]}})";
  const std::string data =
      u16_bytes({0x3c00, 0xc000, 0x3555, 0x0001, 0x03ff, 0x7bff, 0x7c00, 0xfc00, 0x7e00, 0x8000});
  const fs::path path = dir_ / "half.safetensors";
  write_bytes(path, raw_file(header, data));

  const auto file = read_safetensors(path.string());
  ASSERT_EQ(file.tensors.count("h"), 1u);
  const auto& h = file.tensors.at("h");
  EXPECT_EQ(h.dtype, "F16");
  EXPECT_EQ(h.shape, (std::vector<std::int64_t>{2, 5}));
  ASSERT_EQ(h.values.size(), 10u);
  EXPECT_EQ(h.values[0], 1.0f);
  EXPECT_EQ(h.values[1], -2.0f);
  EXPECT_EQ(h.values[2], 0.333251953125f);
  EXPECT_EQ(h.values[3], 5.9604644775390625e-08f);  // 2^-24
  EXPECT_EQ(h.values[4], 6.097555160522461e-05f);   // 1023 * 2^-24
  EXPECT_EQ(h.values[5], 65504.0f);
  EXPECT_EQ(h.values[6], std::numeric_limits<float>::infinity());
  EXPECT_EQ(h.values[7], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(h.values[8]));
  EXPECT_EQ(h.values[9], 0.0f);
  EXPECT_TRUE(std::signbit(h.values[9]));
  EXPECT_TRUE(file.metadata.empty());
}

TEST_F(safetensors_io, reads_unsorted_names_padding_and_reordered_data) {
  // Names out of order in the header, data in yet another order, metadata in the middle,
  // and space padding up to an 8-byte boundary.
  std::string header =
      R"({"z_last":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("__metadata__":{"source":"hand"},)"
      R"("a_first":{"data_offsets":[8,12],"shape":[1,2],"dtype":"BF16"}})";
  header.append((8 - (8 + header.size()) % 8) % 8 + 8, ' ');
  const std::string data = f32_bytes({0.5f, -7.0f}) + u16_bytes({0x3f80, 0xc040});
  const fs::path path = dir_ / "unsorted.safetensors";
  write_bytes(path, raw_file(header, data));

  const auto file = read_safetensors(path.string());
  ASSERT_EQ(file.tensors.size(), 2u);
  EXPECT_EQ(file.tensors.at("z_last").values, (std::vector<float>{0.5f, -7.0f}));
  EXPECT_EQ(file.tensors.at("a_first").values, (std::vector<float>{1.0f, -3.0f}));
  EXPECT_EQ(file.tensors.at("a_first").shape, (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(file.metadata.at("source"), "hand");
}

TEST_F(safetensors_io, missing_short_and_oversized_files_are_io_errors) {
  expect_read_error(dir_ / "absent.safetensors", "no such file");
  expect_read_error(dir_, "not a regular file");
  expect_corrupt("short", std::string("\x05\x00\x00", 3), "shorter than the 8-byte header length");
  expect_corrupt("past_eof", std::string("\x08\0\0\0\0\0\0\0", 8) + "{}", "header length 8 runs past the end of the file (10 bytes)");
  std::string huge(8, '\0');
  huge[5] = 1;  // 2^40
  expect_corrupt("huge", huge + "{}", "exceeds the 100 MiB limit");
}

TEST_F(safetensors_io, malformed_headers_are_io_errors) {
  const std::string f32x2 = f32_bytes({1, 2});
  expect_corrupt("garbage", raw_file("{\"a\": [1, 2", f32x2), "the header is not valid JSON");
  expect_corrupt("empty_header", raw_file("", f32x2), "the header is not valid JSON");
  expect_corrupt("array", raw_file("[1, 2]", ""), "the header is not a JSON object but array");
  expect_corrupt("entry_not_object", raw_file(R"({"a": 3})", ""), "tensor 'a' has a header entry that is not a JSON object");
  expect_corrupt("no_dtype", raw_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", f32x2), "tensor 'a' has no 'dtype' field");
  expect_corrupt("no_shape", raw_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", f32x2), "tensor 'a' has no 'shape' field");
  expect_corrupt("no_offsets", raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", f32x2), "tensor 'a' has no 'data_offsets' field");
  expect_corrupt("dtype_type", raw_file(R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", f32x2), "'dtype' that is not a string");
  expect_corrupt("shape_type", raw_file(R"({"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", f32x2), "'shape' that is not an array");
  expect_corrupt("dim_type", raw_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", f32x2), "shape entry that is not an integer");
  expect_corrupt("negative_dim", raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32x2), "negative dimension");
  expect_corrupt("offsets_type", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", f32x2), "two non-negative integers");
  expect_corrupt("i64", raw_file(R"({"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", f32x2),
                 "tensor 'a' has dtype I64, which upipe cannot read; supported dtypes are F32, BF16, F16");
  expect_corrupt("metadata_type", raw_file(R"({"__metadata__":{"step":12}})", ""), "'__metadata__' entry 'step' must be a string");
  expect_corrupt("repeated", raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f32x2),
                 "names 'a' more than once");
}

TEST_F(safetensors_io, bad_offsets_are_io_errors) {
  const std::string f32x3 = f32_bytes({1, 2, 3});
  expect_corrupt("truncated", raw_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f32x3),
                 "tensor 'a' ends at byte 16 of the data section, which holds only 12 bytes: the file is truncated");
  expect_corrupt("begin_after_end", raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", f32x3),
                 "begin lies past its end");
  expect_corrupt("size_mismatch", raw_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", f32x3),
                 "tensor 'a' has data_offsets [0, 12] spanning 12 bytes, but F32 x [2, 2] needs 16 bytes");
  expect_corrupt("bf16_mismatch", raw_file(R"({"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,12]}})", f32x3),
                 "BF16 x [3] needs 6 bytes");
  expect_corrupt("overlap", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", f32x3),
                 "tensors 'a' [0, 8) and 'b' [4, 12) overlap");
}

TEST_F(safetensors_io, empty_tensor_inside_another_range_is_not_an_overlap) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})";
  const fs::path path = dir_ / "empty_inside.safetensors";
  write_bytes(path, raw_file(header, f32_bytes({1, 2})));
  const auto file = read_safetensors(path.string());
  EXPECT_TRUE(file.tensors.at("e").values.empty());
  EXPECT_EQ(file.tensors.at("a").values, (std::vector<float>{1, 2}));
}

TEST_F(safetensors_io, invalid_tensors_to_write_are_internal_errors) {
  const std::vector<float> two = {1, 2};
  const std::string path = (dir_ / "bad.safetensors").string();
  const auto expect_rejected = [&](std::vector<safetensors_tensor> tensors, const std::string& fragment) {
    try {
      write_safetensors(path, tensors);
      ADD_FAILURE() << "no internal_error for: " << fragment;
    } catch (const internal_error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_rejected({{.name = "", .shape = {2}, .values = two}}, "empty name");
  expect_rejected({{.name = "a", .shape = {2}, .values = two}, {.name = "a", .shape = {2}, .values = two}}, "'a' appears twice");
  expect_rejected({{.name = "a", .shape = {3}, .values = two}}, "has shape [3] (3 elements) but 2 values");
  expect_rejected({{.name = "a", .shape = {-1, -2}, .values = two}}, "negative dimension");
  expect_rejected({{.name = "a", .shape = {2}, .values = two, .type = static_cast<dtype>(7)}}, "other than f32, bf16 or u8");
  expect_rejected({{.name = "__metadata__", .shape = {2}, .values = two}}, "reserved");
  EXPECT_TRUE(directory_listing(dir_).empty()) << "a rejected write creates no file";
}

TEST_F(safetensors_io, writing_into_a_missing_directory_is_an_io_error) {
  const std::vector<float> one = {1};
  const safetensors_tensor tensors[] = {{.name = "a", .shape = {1}, .values = one}};
  const std::string path = (dir_ / "no_such_dir" / "model.safetensors").string();
  try {
    write_safetensors(path, tensors);
    FAIL() << "expected io_error";
  } catch (const io_error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find("does not exist; create it first"), std::string::npos) << message;
  }
}

TEST_F(safetensors_io, overwrite_replaces_content_and_leaves_no_temporary) {
  const std::vector<float> first = {1, 2}, second = {3, 4, 5};
  const std::string path = (dir_ / "model.safetensors").string();
  const safetensors_tensor old_tensors[] = {{.name = "a", .shape = {2}, .values = first}};
  const safetensors_tensor new_tensors[] = {{.name = "b", .shape = {3}, .values = second, .type = dtype::bf16}};
  write_safetensors(path, old_tensors);
  write_safetensors(path, new_tensors, {{"v", "2"}});
  const auto file = read_safetensors(path);
  EXPECT_EQ(file.tensors.count("a"), 0u);
  EXPECT_EQ(file.tensors.at("b").values, second);
  EXPECT_EQ(file.metadata.at("v"), "2");
  EXPECT_EQ(directory_listing(dir_), std::vector<std::string>{"model.safetensors"});
}

// A directory as the target is refused before anything is written (a rename over it would
// fail), and is left as it was, with no temporary beside it.
TEST_F(safetensors_io, a_directory_as_the_target_is_refused_and_left_as_it_was) {
  const fs::path target = dir_ / "model.safetensors";
  fs::create_directory(target);
  write_bytes(target / "keep", "precious");
  const std::vector<float> one = {1};
  const safetensors_tensor tensors[] = {{.name = "a", .shape = {1}, .values = one}};
  try {
    write_safetensors(target.string(), tensors);
    FAIL() << "expected io_error";
  } catch (const io_error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(target.string()), std::string::npos) << message;
    EXPECT_NE(message.find("it is a directory"), std::string::npos) << message;
  }
  EXPECT_EQ(read_bytes(target / "keep"), "precious");
  EXPECT_EQ(directory_listing(dir_), std::vector<std::string>{"model.safetensors"});
}

// RLIMIT_FSIZE makes writes past a size fail with EFBIG, for root too: a reliable stand-in
// for a full disk. The limit and the SIGXFSZ disposition are restored before asserting.
TEST_F(safetensors_io, short_write_leaves_previous_file_intact) {
  const std::string path = (dir_ / "model.safetensors").string();
  const std::vector<float> old_values(16384, 0.25f), new_values(16384, 0.5f);
  const safetensors_tensor old_tensors[] = {{.name = "a", .shape = {16384}, .values = old_values}};
  const safetensors_tensor new_tensors[] = {{.name = "a", .shape = {16384}, .values = new_values}};
  write_safetensors(path, old_tensors);
  const std::string before = read_bytes(path);

  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit small = saved;
  small.rlim_cur = 4096;
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::optional<std::string> error;
  try {
    write_safetensors(path, new_tensors);
  } catch (const io_error& e) {
    error = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, old_handler);

  ASSERT_TRUE(error.has_value()) << "the write past RLIMIT_FSIZE did not fail";
  EXPECT_NE(error->find(path), std::string::npos) << *error;
  EXPECT_NE(error->find("File too large"), std::string::npos) << *error;
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(directory_listing(dir_), std::vector<std::string>{"model.safetensors"});
}

TEST_F(safetensors_io, read_only_directory_leaves_previous_file_intact) {
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions; the rename and short-write tests cover this";
  const std::string path = (dir_ / "model.safetensors").string();
  const std::vector<float> old_values = {1, 2}, new_values = {3};
  const safetensors_tensor old_tensors[] = {{.name = "a", .shape = {2}, .values = old_values}};
  const safetensors_tensor new_tensors[] = {{.name = "a", .shape = {1}, .values = new_values}};
  write_safetensors(path, old_tensors);
  const std::string before = read_bytes(path);
  fs::permissions(dir_, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                            fs::perms::group_exec | fs::perms::others_read | fs::perms::others_exec);
  try {
    write_safetensors(path, new_tensors);
    ADD_FAILURE() << "expected io_error";
  } catch (const io_error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find("Permission denied"), std::string::npos) << message;
  }
  fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add);
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(directory_listing(dir_), std::vector<std::string>{"model.safetensors"});
}

}  // namespace
}  // namespace upipe
