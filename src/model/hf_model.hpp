// Hugging Face model directories, as save_pretrained writes them: config.json, the
// weights in one model.safetensors or in shards listed by model.safetensors.index.json
// (BF16, F16 or F32), the tokenizer's files and generation_config.json.
//
// Reading maps the files and converts only the ranges a caller asks for, so that each
// rank reads the bytes it keeps (its ZeRO-3 shard, or each unit once) and loading never
// holds a second full-precision copy of the model. Writing streams the tensors in
// parameter order into shards of at most max_shard_bytes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "model/config.hpp"
#include "model/weights.hpp"

namespace upipe {

// Weights under Hugging Face names, read a range at a time (row-major, flattened).
class weight_source {
 public:
  virtual ~weight_source() = default;
  // Elements [offset, offset + count) of tensor `name`, as f32. Safe to call from several
  // threads at once.
  virtual void read(const std::string& name, std::int64_t offset, std::int64_t count, float* out) const = 0;
};

// Does `dir` hold weight files (model.safetensors or its sharded index, in any form: a
// broken one is then refused by name when read)?
bool has_weight_files(const std::string& dir);

// Host weights (random initialization, tests) as a source.
class host_weight_source final : public weight_source {
 public:
  explicit host_weight_source(const host_weights& weights) : weights_(weights) {}
  void read(const std::string& name, std::int64_t offset, std::int64_t count, float* out) const override;

 private:
  const host_weights& weights_;
};

// The weight files of a model directory, checked against `config`: every parameter
// present with its shape, a supported dtype, no layer the configuration lacks, every
// shard the index names present and holding what the index says. Tensors the model
// does not use (rotary_emb.inv_freq, say) are listed in unused(). `path` is the
// directory, its index file, or one .safetensors file. Throws io_error naming the file
// and the tensor.
class hf_model_files final : public weight_source {
 public:
  hf_model_files(const std::string& path, const model_config& config);
  ~hf_model_files() override;
  void read(const std::string& name, std::int64_t offset, std::int64_t count, float* out) const override;

  const std::vector<std::string>& unused() const { return unused_; }
  const std::vector<std::string>& files() const { return files_; }
  std::string stored_dtype() const;  // "BF16", "F16", "F32" or "mixed"

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
  std::vector<std::string> unused_, files_;
};

// Every weight of `config` from a source, in full (for a single-process step or tests).
host_weights read_all_weights(const weight_source& source, const model_config& config);

// Writing. Shards are cut between tensors once a shard would pass max_shard_bytes
// (transformers' rule); one shard is written as model.safetensors without an index.
struct hf_save_options {
  dtype type = dtype::bf16;                     // bf16 or f32
  std::uint64_t max_shard_bytes = 5'000'000'000;  // save_pretrained's 5 GB
};

class hf_model_writer {
 public:
  hf_model_writer(const std::string& dir, const model_config& config, const hf_save_options& options);
  ~hf_model_writer();
  // The next values of the next parameter in parameter_specs order, in as many pieces as
  // the caller likes.
  void write(const std::string& name, std::span<const float> values);
  // Commits every shard and writes the index; returns the file names written.
  std::vector<std::string> commit();

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

// The files of the tokenizer and generation_config.json that a model directory may hold.
const std::vector<std::string>& companion_file_names();
// Copies those of them that `from_dir` holds into `to_dir`; returns the names copied.
std::vector<std::string> copy_companion_files(const std::string& from_dir, const std::string& to_dir);
// Every companion file present in `dir` is a regular file (through links): a FIFO, a
// directory or a symbolic link loop in a tokenizer's place is refused by name (io_error),
// before a run that would copy it at its first save. Absent ones are fine.
void check_companion_files(const std::string& dir);

// "bfloat16" or "float32", as config.json names the dtype.
std::string hf_dtype_name(dtype type);

}  // namespace upipe
