// Parsing of counts with binary suffixes (128K = 131072, 1M = 1048576) for flags.
#pragma once

#include <cstdint>
#include <string>

#include "core/error.hpp"

namespace upipe::apps {

// Throws config_error naming the flag, the value and an example.
inline std::int64_t parse_count(const std::string& text, const char* flag) {
  std::size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::int64_t unit = 1;
  const std::string suffix = used == 0 ? text : text.substr(used);
  if (suffix == "K" || suffix == "k") unit = 1024;
  else if (suffix == "M" || suffix == "m") unit = 1024 * 1024;
  else if (!suffix.empty() || used == 0)
    throw config_error(std::string(flag) + " '" + text + "' is not a count: use an integer, optionally with K or M "
                       "(for example 4096, 128K or 1M)");
  return value * unit;
}

}  // namespace upipe::apps
