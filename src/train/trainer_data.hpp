// The trainer's side of its data: where a run's sequences come from (the passkey task, or a
// data_reader over --data), its position as a checkpoint records it, and the checks that a
// resumed run reads on from where the saved one stopped.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "train/data_reader.hpp"
#include "train/train_checkpoint.hpp"
#include "train/trainer.hpp"

namespace upipe {

// The sequences of a run.
class run_data {
 public:
  explicit run_data(const train_options& o);
  // Sequence `index` (counted from 1 over the run) of the passkey task, or the data's next
  // sequence at `at`, which then moves on. A shorter `length` (the short-sequence stage)
  // takes a passkey sample of that length, or the first `length` tokens of the data's window.
  packed_sequence next(std::int64_t index, data_position& at, std::int64_t length) const;
  // Moves `at` past the sequence next() would return (another replica's) without reading
  // it; returns its source.
  int skip(data_position& at, std::int64_t length) const;
  const passkey_task* task() const { return task_.get(); }
  const data_reader* reader() const { return reader_.get(); }
  data_position start() const;

 private:
  std::uint64_t seed_;
  std::unique_ptr<passkey_task> task_;
  std::unique_ptr<data_reader> reader_;
};

// How a run reads its data files (and the held-out data: min_doc_tokens 0).
data_reader::options reader_options(const train_options& o, std::int64_t min_doc_tokens);

// "documents" where every source is packed as documents, else "stream" (a checkpoint records it).
std::string packing_name(const data_reader* reader);

// The data fields of a checkpoint's trainer state at `at`, whose steps of this shape began at `shape_at`.
void record_data(const train_options& o, const run_data& data, const data_position& at, const data_position& shape_at,
                 trainer_state& st);
// The position a saved state records (`shape`: where its shape began), for `sources` sources.
data_position saved_position(const trainer_state& st, bool shape);

// A resume must read the saved run's data (the same sources, weights, sizes and packing:
// config_error naming both and the flag to pass), from a position that follows from its steps
// (io_error for a damaged state; a run of another shape continues from it, and says so).
void check_resumed_data(const train_options& o, const saved_state& saved);

// A resumed run must continue the saved one: the same model or adapters, the optimizer
// state's format (or --convert-optimizer-state), the seed, a step before the last, the data.
void check_resume(const train_options& o, const saved_state& saved);

// The base a LoRA run's adapters belong to, as adapter_config.json names it: its directory
// (absolute), or the preset's name.
std::string base_model_name(const train_options& o);

}  // namespace upipe
