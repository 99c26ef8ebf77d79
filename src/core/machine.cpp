#include "core/machine.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace upipe {

namespace {

// A file's first number, or 0 (a missing file, "max": no limit).
std::size_t read_number(const char* path) {
  std::ifstream in(path);
  unsigned long long value = 0;
  return in >> value ? static_cast<std::size_t>(value) : 0;
}

// A key's value in a "key value" file (memory.stat), or 0.
std::size_t read_key(const char* path, const std::string& key) {
  std::ifstream in(path);
  std::string name;
  unsigned long long value = 0;
  while (in >> name >> value)
    if (name == key) return static_cast<std::size_t>(value);
  return 0;
}

// What the cgroup lets this process take: its limit less its use (file pages it could drop
// not counted as use); 0 without a limit.
std::size_t cgroup_room() {
  struct layout {
    const char *limit, *usage, *stat, *inactive_file;
  };
  for (const layout& l : {layout{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
                                 "/sys/fs/cgroup/memory.stat", "inactive_file"},
                          layout{"/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                                 "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"}}) {
    const std::size_t limit = read_number(l.limit);
    if (limit == 0 || limit >= (std::size_t{1} << 60)) continue;  // "max", or v1's "no limit"
    const std::size_t usage = read_number(l.usage), inactive = read_key(l.stat, l.inactive_file);
    const std::size_t used = usage > inactive ? usage - inactive : 0;
    return limit > used ? limit - used : 1;  // 1: full (0 would mean no limit)
  }
  return 0;
}

}  // namespace

std::size_t parse_memory_size(const char* text) {
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (end == text || !(value > 0) || value > 0x1p60) return 0;
  const char unit = *end == '\0' ? '\0' : static_cast<char>(*end | 0x20);
  const double scale = unit == 'k' ? 0x1p10 : unit == 'm' ? 0x1p20 : unit == 'g' ? 0x1p30 : unit == 't' ? 0x1p40 : 1;
  if (unit != '\0' && scale == 1) return 0;
  return static_cast<std::size_t>(std::min(value * scale, 0x1p60));
}

host_offer available_host_memory() {
  host_offer offer;
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    std::size_t kib = 0;
    while (std::fgets(line, sizeof line, f) != nullptr)
      if (std::strncmp(line, "MemAvailable:", 13) == 0 && std::sscanf(line + 13, "%zu", &kib) == 1) break;
    std::fclose(f);
    offer = {kib * 1024, "MemAvailable"};
  }
  const auto cap = [&](std::size_t bytes, const char* source) {
    if (bytes > 0 && (offer.bytes == 0 || bytes < offer.bytes)) offer = {bytes, source};
  };
  cap(cgroup_room(), "the cgroup's memory limit less its use");
  if (const char* limit = std::getenv("UPIPE_MEMORY_LIMIT")) cap(parse_memory_size(limit), "UPIPE_MEMORY_LIMIT");
  return offer;
}

std::size_t available_memory_bytes() { return available_host_memory().bytes; }

std::size_t gpu_memory_override() {
  const char* text = std::getenv("UPIPE_GPU_MEMORY_FREE");
  return text == nullptr ? 0 : parse_memory_size(text);
}

}  // namespace upipe
