// safetensors files (the Hugging Face weight format): an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}} and
// the raw little-endian data. upipe reads F32, BF16, F16 and U8 into f32 and writes F32,
// BF16 or U8 (the 8-bit codes of quantized optimizer moments), atomically (temporary
// file, fsync, rename), so a failed write never leaves a half-written file in place of a
// good one.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace upipe {

struct safetensors_entry {
  std::string dtype;  // "F32", "BF16", "F16" or "U8" (as stored)
  std::vector<std::int64_t> shape;
  std::vector<float> values;  // converted to f32
};

struct safetensors_file {
  std::map<std::string, safetensors_entry> tensors;
  std::map<std::string, std::string> metadata;
};

struct safetensors_info {
  std::string dtype;  // "F32", "BF16" or "F16" (as stored)
  std::vector<std::int64_t> shape;
  std::uint64_t numel = 0;
};

// A file mapped read-only with its header checked in full; values are converted to f32
// on request, any range of a tensor at a time, so that a reader touches only the bytes it
// keeps (a rank's shard) and never holds a second copy of the file.
class safetensors_view {
 public:
  // Throws io_error as read_safetensors does.
  explicit safetensors_view(const std::string& path);
  ~safetensors_view();
  safetensors_view(safetensors_view&&) noexcept;
  safetensors_view& operator=(safetensors_view&&) noexcept;

  const std::string& path() const;
  const std::map<std::string, safetensors_info>& tensors() const;
  const std::map<std::string, std::string>& metadata() const;
  const safetensors_info* find(const std::string& name) const;  // nullptr when absent
  // Elements [offset, offset + count) of the flattened tensor, as f32.
  void read(const std::string& name, std::uint64_t offset, std::uint64_t count, float* out) const;
  // The same, where every value must be finite (weights, adapters): a NaN or an Inf is an
  // io_error naming the file, the tensor and the element.
  void read_finite(const std::string& name, std::uint64_t offset, std::uint64_t count, float* out) const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

// Throws io_error naming the file and the problem: missing or unreadable file, a
// header length past the end, malformed JSON, an unknown dtype, offsets out of range,
// overlapping or not matching dtype x shape, a truncated data section.
safetensors_file read_safetensors(const std::string& path);

// One tensor to write: f32 values stored as `type` (f32; bf16, rounded to nearest even; u8,
// codes 0..255 held as floats).
struct safetensors_tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::span<const float> values;
  dtype type = dtype::f32;
};

// Writes atomically: PATH.tmp-<pid>, fsync, rename over PATH, fsync of the directory.
// Throws io_error (disk full, unwritable directory) and leaves any existing PATH intact.
void write_safetensors(const std::string& path, std::span<const safetensors_tensor> tensors,
                       const std::map<std::string, std::string>& metadata = {});

// A file written as a stream: the header is laid out from the declared tensors (their
// values unused), then the values arrive in the declared order, a tensor in as many
// pieces as the caller likes, so that a model of any size is written a unit at a time.
// Nothing appears at PATH before commit(); destroyed uncommitted, it leaves nothing behind.
class safetensors_writer {
 public:
  safetensors_writer(const std::string& path, std::vector<safetensors_tensor> declared,
                     const std::map<std::string, std::string>& metadata = {});
  ~safetensors_writer();
  safetensors_writer(const safetensors_writer&) = delete;
  safetensors_writer& operator=(const safetensors_writer&) = delete;

  // The next values of tensor `name`, which must be the one the declared order is at.
  void write(const std::string& name, std::span<const float> values);
  // Every tensor written in full: fsync, rename onto PATH, fsync of the directory.
  void commit();

 private:
  void skip_finished();
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace upipe
