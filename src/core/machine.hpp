// What this machine can give a run: the memory the kernel reports available now, so that
// a run that would need more is refused before it allocates rather than killed midway.
#pragma once

#include <cstddef>

namespace upipe {

// MemAvailable of /proc/meminfo, bytes, or less where the environment's UPIPE_MEMORY_LIMIT
// says so (bytes, or with a K, M, G or T suffix: a share of a machine that others use, or a
// test's budget); 0 when unknown (no limit is applied).
std::size_t available_memory_bytes();

}  // namespace upipe
