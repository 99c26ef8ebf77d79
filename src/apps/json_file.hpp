// Writing a command's --json result: the whole file checked once it is closed, so that a
// full disk or /dev/full is an error (exit 2), never a silent success.
#pragma once

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace upipe::apps {

inline void write_json_file(const std::string& path, const nlohmann::json& value, int indent = 2) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw io_error("cannot write --json " + path + ": check that the directory exists and is writable");
  out << value.dump(indent) << "\n";
  out.close();
  if (out.fail()) throw io_error("writing --json " + path + " failed (a full disk?)");
}

}  // namespace upipe::apps
