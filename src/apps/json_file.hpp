// Writing a command's --json result: the whole file checked once it is closed, so that a
// full disk or /dev/full is an error (exit 2), never a silent success.
#pragma once

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/files.hpp"

namespace upipe::apps {

inline void write_json_file(const std::string& path, const nlohmann::json& value, int indent = 2,
                            const std::string& flag = "--json") {
  write_file_atomically(path, value.dump(indent) + "\n", flag);
}

}  // namespace upipe::apps
