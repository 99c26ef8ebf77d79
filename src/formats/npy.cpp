#include "formats/npy.hpp"

#include <cstring>
#include <fstream>
#include <regex>

#include "core/error.hpp"

namespace upipe {

void write_npy(const std::string& path, std::span<const std::int64_t> shape, std::span<const float> values) {
  std::string dims;
  std::int64_t count = 1;
  for (auto d : shape) {
    dims += std::to_string(d) + ", ";
    count *= d;
  }
  if (shape.size() > 1) dims.resize(dims.size() - 2);
  if (count != static_cast<std::int64_t>(values.size()))
    throw internal_error("npy shape does not match the value count for " + path);
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Magic (6) + version (2) + length (2) + header, padded with spaces to 64 bytes and
  // ended by a newline, as the format asks.
  const std::size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw io_error("cannot open " + path + " for writing: check that the directory exists and is writable");
  const unsigned char preamble[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  const std::uint16_t length = static_cast<std::uint16_t>(header.size());
  out.write(reinterpret_cast<const char*>(preamble), 8);
  out.write(reinterpret_cast<const char*>(&length), 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size_bytes()));
  out.flush();
  if (!out) throw io_error("writing " + path + " failed (disk full?)");
}

std::vector<float> read_npy(const std::string& path, std::vector<std::int64_t>* shape) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw io_error("cannot open " + path);
  char preamble[10];
  in.read(preamble, 10);
  if (!in || std::memcmp(preamble, "\x93NUMPY", 6) != 0 || preamble[6] != 1)
    throw io_error(path + " is not a version 1 .npy file");
  std::uint16_t length;
  std::memcpy(&length, preamble + 8, 2);
  std::string header(length, '\0');
  in.read(header.data(), length);
  if (header.find("'<f4'") == std::string::npos || header.find("'fortran_order': False") == std::string::npos)
    throw io_error(path + " must hold little-endian float32 in C order");
  std::smatch m;
  if (!std::regex_search(header, m, std::regex(R"(\(([0-9, ]*)\))"))) throw io_error(path + ": no shape in header");
  std::vector<std::int64_t> dims;
  std::int64_t count = 1;
  const std::string list = m[1];
  const std::regex number("[0-9]+");
  for (std::sregex_iterator it(list.begin(), list.end(), number), end; it != end; ++it) {
    dims.push_back(std::stoll(it->str()));
    count *= dims.back();
  }
  std::vector<float> values(static_cast<std::size_t>(count));
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(float)));
  if (!in) throw io_error(path + " is truncated");
  if (shape) *shape = dims;
  return values;
}

}  // namespace upipe
