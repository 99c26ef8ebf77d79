// What this machine can give a run: the host memory the kernel reports available now
// (within the cgroup's limit where one is set), and a GPU's free memory, so that a run
// that would need more is refused before it allocates rather than killed midway.
#pragma once

#include <cstddef>
#include <string>

namespace upipe {

// The host memory a run may take now, and where the figure comes from.
struct host_offer {
  std::size_t bytes = 0;  // 0 when unknown (no limit is applied)
  std::string source;     // "MemAvailable", "the cgroup's limit less its use", "UPIPE_MEMORY_LIMIT"
};

// The least of MemAvailable (/proc/meminfo), the cgroup's memory limit less what the
// cgroup uses besides reclaimable file pages (v2 memory.max, v1 memory.limit_in_bytes), and
// the environment's UPIPE_MEMORY_LIMIT (bytes, or with a K, M, G or T suffix: a share of a
// machine that others use, or a test's pretended machine).
host_offer available_host_memory();
std::size_t available_memory_bytes();  // available_host_memory().bytes

// A GPU's free memory as the environment's UPIPE_GPU_MEMORY_FREE states it (bytes, or with
// a suffix: a test's pretended GPU); 0 when unset.
std::size_t gpu_memory_override();

// GPU `device`'s free memory now (UPIPE_GPU_MEMORY_FREE where set, for tests); 0 when
// unknown or in a build without CUDA (defined by the backends).
std::size_t gpu_free_bytes(int device);

// "3G" -> 3 GiB, "512M", "1000000"; 0 for anything else.
std::size_t parse_memory_size(const char* text);

}  // namespace upipe
