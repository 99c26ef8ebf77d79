// One error check for CUDA, cuBLAS(Lt) and cuDNN calls: on failure it prints the call,
// the library's message, file:line, the device and the CP rank, and aborts (a device
// failure leaves nothing to recover).
#pragma once

#include <cstdio>
#include <cstdlib>

#include "core/error.hpp"

namespace upipe::cuda {
[[noreturn]] void fail(const char* library, const char* call, const char* message, const char* file, int line);
const char* cuda_message(int code);
}  // namespace upipe::cuda

#define UPIPE_CUDA_CHECK(call)                                                                       \
  do {                                                                                               \
    const auto upipe_status_ = (call);                                                               \
    if (static_cast<int>(upipe_status_) != 0)                                                        \
      ::upipe::cuda::fail("CUDA", #call, ::upipe::cuda::cuda_message(static_cast<int>(upipe_status_)), \
                          __FILE__, __LINE__);                                                       \
  } while (0)

#define UPIPE_LIBRARY_CHECK(library, call, message_of)                                      \
  do {                                                                                      \
    const auto upipe_status_ = (call);                                                      \
    if (static_cast<int>(upipe_status_) != 0)                                               \
      ::upipe::cuda::fail(library, #call, message_of(upipe_status_), __FILE__, __LINE__);   \
  } while (0)
