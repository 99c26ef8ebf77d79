// safetensors files (the Hugging Face weight format): an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}} and
// the raw little-endian data. upipe reads F32, BF16 and F16 into f32 and writes F32 or
// BF16, atomically (temporary file, fsync, rename), so a failed write never leaves a
// half-written file in place of a good one.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace upipe {

struct safetensors_entry {
  std::string dtype;  // "F32", "BF16" or "F16" (as stored)
  std::vector<std::int64_t> shape;
  std::vector<float> values;  // converted to f32
};

struct safetensors_file {
  std::map<std::string, safetensors_entry> tensors;
  std::map<std::string, std::string> metadata;
};

// Throws io_error naming the file and the problem: missing or unreadable file, a
// header length past the end, malformed JSON, an unknown dtype, offsets out of range,
// overlapping or not matching dtype x shape, a truncated data section.
safetensors_file read_safetensors(const std::string& path);

// One tensor to write: f32 values stored as `type` (f32 or bf16, rounded to nearest even).
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

}  // namespace upipe
