// NumPy .npy files (format 1.0, little-endian float32, C order): the --dump format
// that lets an independent reference check a run.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace upipe {

// Throws io_error when the file cannot be written completely.
void write_npy(const std::string& path, std::span<const std::int64_t> shape, std::span<const float> values);

// Reads a float32 file written by write_npy (or NumPy); throws io_error otherwise.
std::vector<float> read_npy(const std::string& path, std::vector<std::int64_t>* shape = nullptr);

}  // namespace upipe
