#include "core/error.hpp"

namespace upipe {

void throw_internal(const char* expr, const char* file, int line, const std::string& what) {
  throw internal_error(std::string("internal check failed: ") + expr + " at " + file + ":" +
                       std::to_string(line) + (what.empty() ? "" : ": " + what));
}

namespace {
thread_local int rank_of_thread = -1;
thread_local int layer_of_thread = -1;
}

int current_rank() { return rank_of_thread; }
void set_current_rank(int rank) { rank_of_thread = rank; }
int current_layer() { return layer_of_thread; }
void set_current_layer(int layer) { layer_of_thread = layer; }

}  // namespace upipe
