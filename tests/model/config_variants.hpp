// Hand-written variants of a fixture's config.json, for the tests of the family table
// (family_test.cpp, moe_family_test.cpp): the fixture's file with some keys changed or
// removed, written into a scratch directory of the test.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

namespace upipe::testing {

class config_variants : public ::testing::Test {
 protected:
  // `fixtures`: the directory holding the fixtures' model directories.
  explicit config_variants(std::string fixtures) : fixtures_(std::move(fixtures)) {}
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("upipe_config_variants_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // A fixture's config.json with `changes` applied (null removes a key).
  std::string variant(const std::string& name, const nlohmann::json& changes) {
    std::ifstream in(fixtures_ + "/" + name + "/config.json");
    nlohmann::json j = nlohmann::json::parse(in);
    for (const auto& [key, value] : changes.items()) {
      if (value.is_null())
        j.erase(key);
      else
        j[key] = value;
    }
    const std::filesystem::path file = dir_ / (name + "-" + std::to_string(count_++) + ".json");
    std::ofstream(file) << j.dump(2);
    return file.string();
  }
  std::filesystem::path dir_;

 private:
  std::string fixtures_;
  int count_ = 0;
};

}  // namespace upipe::testing
