// A run directory (train --save DIR): the checkpoints of one run, numbered by step, as the
// Hugging Face Trainer lays them out:
//   DIR/checkpoint-20/   a checkpoint (train_checkpoint.hpp): model directory + trainer/
//   DIR/checkpoint-40/
//   DIR/latest           "checkpoint-40": the newest complete checkpoint
//   DIR/best             "checkpoint-20": the lowest held-out loss (with --keep-best)
//   DIR/adapter_config.json, DIR/adapter_model.safetensors
//                        a LoRA run's: relative links to latest's, so that a loader that
//                        reads the directory it is given (PeftModel.from_pretrained(base,
//                        "DIR")) loads the latest adapter; each moved atomically at a save
// Each checkpoint's manifest names its run (a random id kept across resumes), so a save
// never replaces another run's checkpoints unless asked to (--overwrite). The pointers are
// written atomically after the checkpoint they name is complete.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace upipe {

// "checkpoint-20".
std::string checkpoint_name(std::int64_t step);

// The one resolver of a checkpoint's or an adapter's name, which every command that reads
// one calls (train --resume, --init, --init-adapter and --model; step --weights and
// --adapter; eval --model, --weights and --adapter; export and --merge-adapter): the path
// itself when it is a checkpoint (it holds trainer/manifest.json), the checkpoint a pointer
// names (DIR/latest, DIR/best), else the checkpoint a run directory's `latest` names. Other
// paths are returned as given (the caller's own checks name what is missing). Throws
// io_error when a pointer names a checkpoint that is not there.
std::string resolve_checkpoint(const std::string& path);

// The step a checkpoint's name says (N of DIR/checkpoint-N), or -1 for another name.
std::int64_t step_in_name(const std::string& checkpoint_dir);

// The run directory a checkpoint lies in (the parent of DIR/checkpoint-N), or "" for a
// checkpoint of another name.
std::string run_directory_of(const std::string& checkpoint_dir);

// Is `path` a run directory (it holds `latest` or checkpoint-N directories)?
bool is_run_directory(const std::string& path);

// A fresh random run id (32 hex digits).
std::string new_run_id();

// The step a checkpoint's manifest records (0 when it has none).
std::int64_t checkpoint_step(const std::string& checkpoint_dir);

// The run id a checkpoint's manifest records ("" for checkpoints before run ids).
std::string checkpoint_run_id(const std::string& checkpoint_dir);

struct saved_checkpoint {
  std::string name;  // checkpoint-N
  std::int64_t step = 0;
  std::string run_id;
  std::optional<double> eval_loss;
};
// The checkpoint-N directories of DIR with a manifest, by step.
std::vector<saved_checkpoint> list_checkpoints(const std::string& dir);

// Before step 1: DIR can hold this run's checkpoints (absent: the nearest existing path
// above it is a directory). Refused (io_error naming the path and a way out): a file, a
// directory that is neither empty nor a run directory, a single checkpoint of the earlier
// layout, or a run directory holding another run's checkpoints unless `overwrite`. Returns notes to print (this run's later checkpoints that will be
// replaced as it reaches them).
std::vector<std::string> check_run_directory(const std::string& dir, const std::string& run_id, bool overwrite,
                                             std::int64_t resumed_step);

// Makes DIR with its missing parents (mkdir -p), once every check before step 1 has passed;
// io_error naming it when it cannot be made.
void make_run_directory(const std::string& dir);

// Removes what a failed or killed save left in DIR (checkpoint-N.tmp-upipe, a pointer's
// temporary), once no rank writes into it.
void remove_unfinished_saves(const std::string& dir);

struct rotation {
  std::int64_t keep_last = 0;  // 0: keep all
  bool keep_best = false;
  bool overwrite = false;      // remove other runs' checkpoints
};
// After checkpoint-`step` of `run_id` is complete: DIR/latest (and DIR/best) name it, the
// root's adapter links follow latest (or are removed for a full run's checkpoint), then
// the checkpoints past `keep` are removed (the newest keep_last of this run, and the best;
// with overwrite, every other run's). Returns the names removed.
std::vector<std::string> publish_checkpoint(const std::string& dir, std::int64_t step, const std::string& run_id,
                                            const rotation& keep);

}  // namespace upipe
