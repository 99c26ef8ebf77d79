// Paths as a user means them (core/files.hpp) and the checked sizes (core/limits.hpp).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.hpp"
#include "core/files.hpp"
#include "core/limits.hpp"

namespace upipe {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("upipe_files_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string contents(const fs::path& p) {
  std::ifstream in(p);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The message of the io_error `f` throws ("" when it throws none).
template <class fn>
std::string refusal(const fn& f) {
  try {
    f();
  } catch (const io_error& e) {
    return e.what();
  }
  return "";
}

TEST(files, inputs_are_regular_files_named_in_every_refusal) {
  const fs::path dir = fresh_dir("inputs");
  std::ofstream(dir / "config.json") << "{\"a\": 1}";
  EXPECT_EQ(read_text_file((dir / "config.json").string(), "model config"), "{\"a\": 1}");
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  fs::create_directory(dir / "sub");
  fs::create_symlink("loop_b", dir / "loop_a");
  fs::create_symlink("loop_a", dir / "loop_b");
  // A FIFO is refused without waiting for a writer; each refusal names what the path is.
  EXPECT_NE(refusal([&] { read_text_file((dir / "fifo").string(), "model config"); }).find("it is a FIFO"),
            std::string::npos);
  EXPECT_NE(refusal([&] { read_text_file((dir / "sub").string(), "model config"); }).find("directory"),
            std::string::npos);
  EXPECT_NE(refusal([&] { read_text_file((dir / "loop_a").string(), "x"); }).find("symbolic link loop"),
            std::string::npos);
  EXPECT_NE(refusal([&] { read_text_file((dir / "none").string(), "x"); }).find("no such file"), std::string::npos);
  EXPECT_NE(refusal([&] { read_text_file("", "x"); }).find("empty path"), std::string::npos);
  std::ofstream(dir / "big") << std::string(2048, ' ');
  EXPECT_NE(refusal([&] { read_text_file((dir / "big").string(), "x", 1024); }).find("2048 bytes"), std::string::npos);
  EXPECT_EQ(describe_path((dir / "fifo").string()), "a FIFO");
  EXPECT_EQ(describe_path((dir / "loop_a").string()), "a symbolic link loop");
  // The mapped reader (token files, safetensors) opens through the same checks.
  EXPECT_NE(refusal([&] { mapped_file((dir / "fifo").string(), "token file"); }).find("it is a FIFO"),
            std::string::npos);
  EXPECT_NE(refusal([&] { mapped_file((dir / "loop_a").string(), "token file"); }).find("symbolic link loop"),
            std::string::npos);
  const mapped_file mapped((dir / "config.json").string(), "model config");
  ASSERT_EQ(mapped.size(), 8u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(mapped.bytes()), 8), "{\"a\": 1}");
  fs::remove_all(dir);
}

TEST(files, outputs_never_replace_a_link_a_device_or_a_fifo) {
  const fs::path dir = fresh_dir("outputs");
  // A link is written through; it stays a link, and the file behind it holds the text.
  std::ofstream(dir / "real.json") << "old";
  fs::create_symlink("real.json", dir / "link.json");
  write_file_atomically((dir / "link.json").string(), "new", "--json");
  EXPECT_TRUE(fs::is_symlink(dir / "link.json"));
  EXPECT_EQ(contents(dir / "real.json"), "new");
  // A dangling link's target is created; the link stays.
  fs::create_symlink("made.json", dir / "dangling.json");
  write_file_atomically((dir / "dangling.json").string(), "made", "--json");
  EXPECT_TRUE(fs::is_symlink(dir / "dangling.json"));
  EXPECT_EQ(contents(dir / "made.json"), "made");
  // A character device is written in place and stays a device.
  write_file_atomically("/dev/null", "discarded", "--json");
  EXPECT_TRUE(is_character_device("/dev/null"));
  // A FIFO, a directory, a trailing slash and a missing directory are refused before any write.
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  EXPECT_NE(refusal([&] { checked_output_file((dir / "fifo").string(), "--json"); }).find("it is a FIFO"),
            std::string::npos);
  EXPECT_NE(refusal([&] { checked_output_file(dir.string(), "--json"); }).find("a directory"), std::string::npos);
  EXPECT_NE(refusal([&] { checked_output_file(dir.string() + "/x/", "--json"); }).find("ends in '/'"),
            std::string::npos);
  EXPECT_NE(refusal([&] { checked_output_file((dir / "no" / "x.json").string(), "--json"); }).find("mkdir -p"),
            std::string::npos);
  struct stat info {};
  ASSERT_EQ(::lstat((dir / "fifo").c_str(), &info), 0);
  EXPECT_TRUE(S_ISFIFO(info.st_mode));
  fs::remove_all(dir);
}

TEST(files, a_write_removes_the_temporaries_of_dead_writers_only) {
  const fs::path dir = fresh_dir("stale");
  std::ofstream(dir / "out.json.tmp-999999999") << "left by a killed write";
  const std::string alive = "out.json.tmp-1";  // init's: alive
  std::ofstream(dir / alive) << "in progress";
  std::ofstream(dir / "out.json.tmp-notapid") << "not ours";
  write_file_atomically((dir / "out.json").string(), "{}", "--json");
  EXPECT_EQ(contents(dir / "out.json"), "{}");
  EXPECT_FALSE(fs::exists(dir / "out.json.tmp-999999999"));
  EXPECT_TRUE(fs::exists(dir / alive));
  EXPECT_TRUE(fs::exists(dir / "out.json.tmp-notapid"));
  fs::remove_all(dir);
}

TEST(limits, values_outside_the_limits_and_overflowing_products_are_refused_by_name) {
  require_within(4096, 1, limits::hidden_size, "hidden_size D", "4096");
  try {
    require_within(std::int64_t{1} << 20, 1, limits::hidden_size, "hidden_size D", "4096");
    ADD_FAILURE() << "2^20 passed";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("hidden_size D = 1048576 must lie between 1 and 131072"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(checked_mul(std::int64_t{1} << 31, std::int64_t{1} << 31, "S x D"), std::int64_t{1} << 62);
  EXPECT_THROW(checked_mul(std::int64_t{1} << 32, std::int64_t{1} << 31, "S x D"), config_error);
  EXPECT_THROW(checked_add(INT64_MAX, 1, "the parameter count"), config_error);
}

}  // namespace
}  // namespace upipe
