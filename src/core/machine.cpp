#include "core/machine.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace upipe {

namespace {

// "3G" -> 3 GiB, "512M", "1000000"; 0 for anything else.
std::size_t parse_limit(const char* text) {
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (end == text || !(value > 0) || value > 0x1p60) return 0;
  const char unit = *end == '\0' ? '\0' : static_cast<char>(*end | 0x20);
  const double scale = unit == 'k' ? 0x1p10 : unit == 'm' ? 0x1p20 : unit == 'g' ? 0x1p30 : unit == 't' ? 0x1p40 : 1;
  if (unit != '\0' && scale == 1) return 0;
  return static_cast<std::size_t>(std::min(value * scale, 0x1p60));
}

}  // namespace

std::size_t available_memory_bytes() {
  std::size_t available = 0;
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    std::size_t kib = 0;
    while (std::fgets(line, sizeof line, f) != nullptr)
      if (std::strncmp(line, "MemAvailable:", 13) == 0 && std::sscanf(line + 13, "%zu", &kib) == 1) break;
    std::fclose(f);
    available = kib * 1024;
  }
  if (const char* limit = std::getenv("UPIPE_MEMORY_LIMIT")) {
    const std::size_t cap = parse_limit(limit);
    if (cap > 0) available = available == 0 ? cap : std::min(available, cap);
  }
  return available;
}

}  // namespace upipe
