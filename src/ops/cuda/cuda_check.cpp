// The failure path of UPIPE_CUDA_CHECK and UPIPE_LIBRARY_CHECK: one report on stderr
// (the library, its message, the call, file:line, the device and the CP rank), then
// abort, since a failed device call leaves nothing to recover.
#include "ops/cuda/cuda_check.hpp"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#include "core/error.hpp"

namespace upipe::cuda {

void fail(const char* library, const char* call, const char* message, const char* file, int line) {
  int device = -1;
  // The device of the failed call; after a sticky error this query may fail too.
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  std::fprintf(stderr, "upipe: %s error: %s\n  in %s\n  at %s:%d, device %d, rank %d\n", library, message, call, file,
               line, device, upipe::current_rank());
  std::fflush(stderr);
  std::abort();
}

const char* cuda_message(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace upipe::cuda
