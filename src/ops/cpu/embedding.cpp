// Reference embedding: a row gather (times a scale) in forward and a scatter-add into the
// fp32 table gradient in backward. Every id is checked before anything is written, so an id
// outside the vocabulary leaves the outputs as they were.
#include <algorithm>
#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "ops/cpu/cpu_ops.hpp"

namespace upipe::cpu {

namespace {

const float* row_of(const mat_view& m, std::int64_t i) { return static_cast<const float*>(m.data) + i * m.ld; }
float* mutable_row_of(const mat_view& m, std::int64_t i) { return static_cast<float*>(m.data) + i * m.ld; }

std::int32_t id_at(const mat_view& ids, std::int64_t row) {
  return static_cast<const std::int32_t*>(ids.data)[row * ids.ld];
}

// The entry cannot see device data, so the range of the ids is checked here.
void check_ids(const char* op, const mat_view& ids, std::int64_t vocab) {
  for (std::int64_t r = 0; r < ids.rows; ++r) {
    const std::int32_t id = id_at(ids, r);
    UPIPE_CHECK(id >= 0 && id < vocab, std::string("cpu::") + op + ": id " + std::to_string(id) + " at row " +
                                           std::to_string(r) + " is outside the vocabulary [0, " +
                                           std::to_string(vocab) + ")");
  }
}

}  // namespace

void run(const embedding_forward_args& args) {
  check_ids("embedding_forward", args.ids, args.table.rows);
  const std::int64_t dim = args.table.cols;
  for (std::int64_t r = 0; r < args.ids.rows; ++r) {
    const float* src = row_of(args.table, id_at(args.ids, r));
    float* dst = mutable_row_of(args.out, r);
    for (std::int64_t j = 0; j < dim; ++j) dst[j] = src[j] * args.scale;
  }
}

// Rows are added in order, so repeated ids accumulate deterministically.
void run(const embedding_backward_args& args) {
  check_ids("embedding_backward", args.ids, args.d_table.rows);
  const std::int64_t dim = args.d_table.cols;
  for (std::int64_t r = 0; r < args.ids.rows; ++r) {
    const std::int32_t id = id_at(args.ids, r);
    if (id == args.padding_id) continue;
    const float* src = row_of(args.d_out, r);
    float* dst = mutable_row_of(args.d_table, id);
    for (std::int64_t j = 0; j < dim; ++j) dst[j] += src[j] * args.scale;
  }
}

}  // namespace upipe::cpu
