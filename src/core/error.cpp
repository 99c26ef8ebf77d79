#include "core/error.hpp"

namespace upipe {

void throw_internal(const char* expr, const char* file, int line, const std::string& what) {
  throw internal_error(std::string("internal check failed: ") + expr + " at " + file + ":" +
                       std::to_string(line) + (what.empty() ? "" : ": " + what));
}

}  // namespace upipe
