// Training checkpoints: a directory with config.json and model.safetensors (Hugging Face
// names and layout, fp32 master weights, so transformers loads it), optimizer.safetensors
// (AdamW moments) and trainer_state.json (step, data position, seed, schedule). The
// directory is written whole under a temporary name and swapped in atomically, so an
// existing checkpoint is never left half-written.
#pragma once

#include <cstdint>
#include <string>

#include "model/config.hpp"
#include "model/weights.hpp"

namespace upipe {

struct trainer_state {
  std::int64_t step = 0;           // steps done
  std::int64_t data_position = 0;  // next token-file position (token files only)
  std::uint64_t seed = 0;          // data and initialization seed
  std::int64_t total_steps = 0;    // the schedule's length when saved
  std::string data = "passkey";    // "passkey" or the token file's path
};

struct train_checkpoint {
  model_config config;
  host_weights weights, exp_avg, exp_avg_sq;
  trainer_state state;
};

// Writes DIR atomically (DIR.tmp-<pid>, then an atomic exchange). Throws io_error naming
// the path and the cause (unwritable directory, full disk); DIR is then untouched. An
// existing DIR that is not an upipe checkpoint is never replaced.
void save_train_checkpoint(const std::string& dir, const train_checkpoint& checkpoint);

// Reads DIR and checks it is a checkpoint of `config` (same architecture and sizes);
// a checkpoint of another model is a config_error naming both.
train_checkpoint load_train_checkpoint(const std::string& dir, const model_config& config);

}  // namespace upipe
