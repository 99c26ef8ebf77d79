// Errors: configuration and I/O problems throw (tests provoke them); device and
// collective failures abort with the rank and the call site.
#pragma once

#include <stdexcept>
#include <string>

namespace upipe {

// A user-facing configuration problem: the message names the value, the rule and a
// valid alternative.
class config_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A file or stream problem (missing file, bad format, full disk).
class io_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A broken internal invariant: a bug, never a user error.
class internal_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

[[noreturn]] void throw_internal(const char* expr, const char* file, int line, const std::string& what);

// The CP rank the calling thread works for (-1 outside a group), for error messages.
int current_rank();
void set_current_rank(int rank);
// The layer the calling thread's step is in (-1 outside the layers), for messages about
// failed collectives.
int current_layer();
void set_current_layer(int layer);

}  // namespace upipe

// Checks an internal invariant; message is a std::string expression.
#define UPIPE_CHECK(cond, msg)                                          \
  do {                                                                  \
    if (!(cond)) ::upipe::throw_internal(#cond, __FILE__, __LINE__, (msg)); \
  } while (0)
