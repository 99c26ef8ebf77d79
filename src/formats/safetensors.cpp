#include "formats/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>

#include "core/error.hpp"
#include "core/files.hpp"

namespace upipe {
namespace {

// The data section is copied and written as raw bytes, which matches the format only on
// a little-endian host.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

using json = nlohmann::json;

// Real headers are kilobytes to a few megabytes; a larger length means a corrupt or
// foreign file, and refusing it avoids a huge allocation.
constexpr std::uint64_t max_header_bytes = std::uint64_t{100} << 20;

std::string errno_message(int err) { return std::generic_category().message(err); }

std::string shape_string(std::span<const std::int64_t> shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// ---------------------------------------------------------------------------------------
// Reading

[[noreturn]] void read_failure(const std::string& path, const std::string& problem) {
  throw io_error("cannot read safetensors file " + path + ": " + problem);
}

[[noreturn]] void tensor_failure(const std::string& path, const std::string& name, const std::string& problem) {
  read_failure(path, "tensor '" + name + "' " + problem);
}

struct stored_dtype {
  std::string_view name;
  std::uint64_t size;
};

constexpr stored_dtype supported_dtypes[] = {{"F32", 4}, {"BF16", 2}, {"F16", 2}, {"U8", 1}};

// Where one tensor's bytes lie in the data section, validated against the header.
struct tensor_location {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t numel = 1;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

// IEEE half -> f32, exact for every value: normals rebias the exponent, subnormals scale
// by 2^-24, and inf/nan keep their payload.
float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

// Reads a non-negative JSON integer; anything else (a float, a string, a negative or
// out-of-range number) yields nullopt.
std::optional<std::uint64_t> json_count(const json& value) {
  if (!value.is_number_unsigned()) return std::nullopt;
  const auto count = value.get<std::uint64_t>();
  if (count > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
  return count;
}

// The nesting depth of a JSON value, counted without recursion and only up to past `cap`.
int depth_past(const json& value, int cap) {
  std::vector<std::pair<const json*, int>> todo{{&value, 0}};
  int deepest = 0;
  while (!todo.empty()) {
    const auto [at, depth] = todo.back();
    todo.pop_back();
    if (!at->is_structured()) continue;
    deepest = std::max(deepest, depth + 1);
    if (deepest > cap) break;
    for (const auto& item : *at) todo.emplace_back(&item, depth + 1);
  }
  return deepest;
}

// A header value as an error message shows it: its JSON cut to 200 characters, or a word
// for one nested deeper than a header needs (dumping 100,000 levels would exhaust the stack).
std::string brief(const json& value) {
  if (depth_past(value, 4) > 4) return "a value nested more than 4 deep";
  const std::string text = value.dump();
  return text.size() <= 200 ? text : text.substr(0, 200) + "...";
}

const stored_dtype& parse_dtype(const std::string& path, const std::string& name, const json& entry) {
  const auto field = entry.find("dtype");
  if (field == entry.end()) tensor_failure(path, name, "has no 'dtype' field");
  if (!field->is_string()) tensor_failure(path, name, "has a 'dtype' that is not a string: " + brief(*field));
  const auto& text = field->get_ref<const std::string&>();
  for (const auto& candidate : supported_dtypes)
    if (candidate.name == text) return candidate;
  tensor_failure(path, name, "has dtype " + text + ", which upipe cannot read; supported dtypes are F32, BF16, F16, U8");
}

void parse_shape(const std::string& path, tensor_location& tensor, const json& entry) {
  const auto field = entry.find("shape");
  if (field == entry.end()) tensor_failure(path, tensor.name, "has no 'shape' field");
  if (!field->is_array()) tensor_failure(path, tensor.name, "has a 'shape' that is not an array: " + brief(*field));
  for (const auto& dim : *field) {
    if (dim.is_number_integer() && !dim.is_number_unsigned() && dim.get<std::int64_t>() < 0)
      tensor_failure(path, tensor.name, "has a negative dimension in shape " + brief(*field));
    const auto size = json_count(dim);
    if (!size) tensor_failure(path, tensor.name, "has a shape entry that is not an integer: " + brief(*field));
    if (__builtin_mul_overflow(tensor.numel, *size, &tensor.numel))
      tensor_failure(path, tensor.name, "has a shape whose element count overflows: " + brief(*field));
    tensor.shape.push_back(static_cast<std::int64_t>(*size));
  }
}

void parse_offsets(const std::string& path, tensor_location& tensor, const json& entry) {
  const auto field = entry.find("data_offsets");
  if (field == entry.end()) tensor_failure(path, tensor.name, "has no 'data_offsets' field");
  const bool pair = field->is_array() && field->size() == 2;
  const auto begin = pair ? json_count((*field)[0]) : std::nullopt;
  const auto end = pair ? json_count((*field)[1]) : std::nullopt;
  if (!begin || !end)
    tensor_failure(path, tensor.name, "needs 'data_offsets' [begin, end] of two non-negative integers, not " + field->dump());
  if (*begin > *end)
    tensor_failure(path, tensor.name, "has data_offsets " + field->dump() + " whose begin lies past its end");
  tensor.begin = *begin;
  tensor.end = *end;
}

// Checks one header entry in full: fields, types, dtype, and that its byte range lies in
// the data section and matches dtype x shape.
tensor_location parse_entry(const std::string& path, const std::string& name, const json& entry,
                            std::uint64_t data_size) {
  if (!entry.is_object()) tensor_failure(path, name, "has a header entry that is not a JSON object: " + brief(entry));
  tensor_location tensor;
  tensor.name = name;
  const stored_dtype& type = parse_dtype(path, name, entry);
  tensor.dtype = std::string(type.name);
  parse_shape(path, tensor, entry);
  parse_offsets(path, tensor, entry);
  if (tensor.end > data_size)
    tensor_failure(path, name, "ends at byte " + std::to_string(tensor.end) + " of the data section, which holds only " +
                                   std::to_string(data_size) + " bytes: the file is truncated");
  std::uint64_t expected = 0;
  if (__builtin_mul_overflow(tensor.numel, type.size, &expected) || expected != tensor.end - tensor.begin)
    tensor_failure(path, name, "has data_offsets [" + std::to_string(tensor.begin) + ", " + std::to_string(tensor.end) +
                                   "] spanning " + std::to_string(tensor.end - tensor.begin) + " bytes, but " +
                                   tensor.dtype + " x " + shape_string(tensor.shape) + " needs " +
                                   std::to_string(tensor.numel * type.size) + " bytes");
  return tensor;
}

std::map<std::string, std::string> parse_metadata(const std::string& path, const json& field) {
  if (!field.is_object()) read_failure(path, "'__metadata__' must be an object of strings, not " + brief(field));
  std::map<std::string, std::string> metadata;
  for (const auto& [key, value] : field.items()) {
    if (!value.is_string())
      read_failure(path, "'__metadata__' entry '" + key + "' must be a string, not " + brief(value));
    metadata.emplace(key, value.get<std::string>());
  }
  return metadata;
}

// Empty tensors occupy no bytes, so only non-empty ranges can collide.
void check_no_overlap(const std::string& path, std::vector<const tensor_location*> tensors) {
  std::erase_if(tensors, [](const tensor_location* t) { return t->begin == t->end; });
  std::sort(tensors.begin(), tensors.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (std::size_t i = 1; i < tensors.size(); ++i) {
    const auto& prev = *tensors[i - 1];
    const auto& next = *tensors[i];
    if (next.begin < prev.end)
      read_failure(path, "tensors '" + prev.name + "' [" + std::to_string(prev.begin) + ", " + std::to_string(prev.end) +
                             ") and '" + next.name + "' [" + std::to_string(next.begin) + ", " +
                             std::to_string(next.end) + ") overlap in the data section");
  }
}

// Elements [offset, offset + count) of a tensor stored as `dtype` at `bytes`, as f32.
void convert_to_f32(const std::string& dtype, const std::uint8_t* bytes, std::uint64_t offset, std::uint64_t count,
                    float* out) {
  if (dtype == "F32") {
    if (count > 0) std::memcpy(out, bytes + 4 * offset, count * sizeof(float));
    return;
  }
  if (dtype == "U8") {  // 8-bit codes (the q8 optimizer moments), each an exact float
    for (std::uint64_t i = 0; i < count; ++i) out[i] = static_cast<float>(bytes[offset + i]);
    return;
  }
  const bool is_bf16 = dtype == "BF16";
  const std::uint8_t* first = bytes + 2 * offset;
  for (std::uint64_t i = 0; i < count; ++i) {
    std::uint16_t bits;
    std::memcpy(&bits, first + 2 * i, 2);
    out[i] = is_bf16 ? bf16_to_float(bits) : half_to_float(bits);
  }
}

// Checks the 8-byte length prefix and parses the JSON header; data_start receives the file
// offset where the data section begins.
json parse_header(const std::string& path, const mapped_file& file, std::uint64_t& data_start) {
  if (file.size() < 8)
    read_failure(path, "it is only " + std::to_string(file.size()) +
                           " bytes long, shorter than the 8-byte header length every safetensors file starts with");
  std::uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | file.bytes()[i];
  if (header_size > max_header_bytes)
    read_failure(path, "header length " + std::to_string(header_size) +
                           " exceeds the 100 MiB limit: the file is corrupt or not a safetensors file");
  if (header_size > file.size() - 8)
    read_failure(path, "header length " + std::to_string(header_size) + " runs past the end of the file (" +
                           std::to_string(file.size()) + " bytes): the file is truncated or not a safetensors file");
  data_start = 8 + header_size;
  const auto* begin = reinterpret_cast<const char*>(file.bytes()) + 8;
  // nlohmann keeps the last of repeated keys silently; a repeated tensor name is ambiguous,
  // so the parser callback records it.
  std::set<std::string> names;
  std::optional<std::string> repeated;
  const auto note_key = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && !names.insert(parsed.get<std::string>()).second)
      repeated = parsed.get<std::string>();
    return true;
  };
  json header;
  try {
    header = json::parse(begin, begin + header_size, note_key);
  } catch (const json::parse_error& e) {
    read_failure(path, std::string("the header is not valid JSON: ") + e.what());
  }
  if (repeated) read_failure(path, "the header names '" + *repeated + "' more than once");
  if (!header.is_object()) read_failure(path, "the header is not a JSON object but " + std::string(header.type_name()));
  return header;
}

// ---------------------------------------------------------------------------------------
// Writing

[[noreturn]] void write_failure(const std::string& path, const std::string& problem, int err) {
  throw io_error("cannot write safetensors file " + path + ": " + problem + ": " + errno_message(err));
}

// The temporary file a write goes to; unless committed, it is closed and removed, so a
// failed write leaves neither a partial file nor a stray temporary behind. The target is
// the one a user means (core/files.hpp): a symbolic link's target, never a FIFO or a
// directory; a character device (/dev/null) is written in place.
class temp_file {
 public:
  explicit temp_file(const std::string& given) : target_(checked_output_file(given, "safetensors file")) {
    in_place_ = is_character_device(target_);
    if (!in_place_) remove_stale_temporaries(target_);
    path_ = in_place_ ? target_ : target_ + ".tmp-" + std::to_string(::getpid());
    fd_ = ::open(path_.c_str(), in_place_ ? O_WRONLY | O_CLOEXEC : O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) write_failure(target_, "cannot create the temporary file " + path_, errno);
  }
  ~temp_file() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_ && !in_place_) ::unlink(path_.c_str());
  }
  bool in_place() const { return in_place_; }
  temp_file(const temp_file&) = delete;
  temp_file& operator=(const temp_file&) = delete;

  // Loops because write() may store fewer bytes than asked (signals, >2 GiB requests).
  void write(const void* data, std::size_t size) {
    const auto* bytes = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t done = ::write(fd_, bytes, size);
      if (done < 0 && errno == EINTR) continue;
      if (done <= 0) write_failure(target_, "writing " + path_ + " failed", done < 0 ? errno : ENOSPC);
      bytes += done;
      size -= static_cast<std::size_t>(done);
    }
  }

  // fsync before rename so that the name never points at data still in the page cache.
  void commit() {
    if (!in_place_ && ::fsync(fd_) != 0) write_failure(target_, "fsync of " + path_ + " failed", errno);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) write_failure(target_, "closing " + path_ + " failed", errno);
    if (in_place_) {
      committed_ = true;
      return;
    }
    if (::rename(path_.c_str(), target_.c_str()) != 0)
      write_failure(target_, "renaming " + path_ + " over it failed", errno);
    committed_ = true;
  }

 private:
  std::string target_;
  std::string path_;
  int fd_ = -1;
  bool committed_ = false;
  bool in_place_ = false;
};

// Makes the rename itself durable: without it a crash could bring back the old entry.
void sync_directory(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) write_failure(path, "cannot open directory " + dir + " to fsync it", errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) write_failure(path, "fsync of directory " + dir + " failed", err);
}

std::uint64_t numel_of(const safetensors_tensor& t) {
  std::uint64_t numel = 1;
  for (auto d : t.shape) numel *= static_cast<std::uint64_t>(d);
  return numel;
}

// Checks the caller's invariants, which are programming errors rather than I/O problems:
// names, types, shapes, (with_values) the value counts, and no name twice.
std::span<const safetensors_tensor* const> checked(const std::string& path,
                                                   std::span<const safetensors_tensor* const> tensors,
                                                   bool with_values) {
  std::set<std::string> names;
  for (const auto* t : tensors) {
    const std::string where = "write_safetensors(" + path + "): tensor '" + t->name + "' ";
    if (t->name.empty()) throw internal_error("write_safetensors(" + path + "): a tensor has an empty name");
    if (t->name == "__metadata__") throw internal_error(where + "uses the name reserved for metadata");
    if (t->type != dtype::f32 && t->type != dtype::bf16 && t->type != dtype::u8)
      throw internal_error(where + "has a type other than f32, bf16 or u8");
    std::uint64_t numel = 1;
    for (auto d : t->shape) {
      if (d < 0) throw internal_error(where + "has a negative dimension in " + shape_string(t->shape));
      if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(d), &numel))
        throw internal_error(where + "has a shape whose element count overflows: " + shape_string(t->shape));
    }
    if (with_values && numel != t->values.size())
      throw internal_error(where + "has shape " + shape_string(t->shape) + " (" + std::to_string(numel) +
                           " elements) but " + std::to_string(t->values.size()) + " values");
    if (!names.insert(t->name).second)
      throw internal_error("write_safetensors(" + path + "): tensor name '" + t->name + "' appears twice");
  }
  return tensors;
}

// The JSON header, padded with spaces so that the data section starts 8-byte aligned;
// the data section holds the tensors in the given order.
std::string build_header(const std::string& path, std::span<const safetensors_tensor* const> order,
                         const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  std::uint64_t offset = 0;
  for (const auto* t : order) {
    const std::uint64_t bytes = numel_of(*t) * dtype_size(t->type);
    header[t->name] = {{"dtype", t->type == dtype::f32 ? "F32" : t->type == dtype::u8 ? "U8" : "BF16"},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::type_error& e) {
    throw internal_error("write_safetensors(" + path + "): a name or metadata string is not valid UTF-8: " + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

void write_values(temp_file& file, std::span<const float> values, dtype type) {
  if (type == dtype::f32) {
    file.write(values.data(), values.size_bytes());
    return;
  }
  // Converts in bounded chunks so that a multi-GB tensor needs no full-size bf16 copy.
  constexpr std::size_t chunk = std::size_t{1} << 20;
  if (type == dtype::u8) {  // codes 0..255 held as floats
    std::vector<std::uint8_t> codes(std::min(chunk, values.size()));
    for (std::size_t start = 0; start < values.size(); start += chunk) {
      const std::size_t count = std::min(chunk, values.size() - start);
      for (std::size_t i = 0; i < count; ++i)
        codes[i] = static_cast<std::uint8_t>(std::clamp(values[start + i], 0.0f, 255.0f));
      file.write(codes.data(), count);
    }
    return;
  }
  std::vector<std::uint16_t> bits(std::min(chunk, values.size()));
  for (std::size_t start = 0; start < values.size(); start += chunk) {
    const std::size_t count = std::min(chunk, values.size() - start);
    for (std::size_t i = 0; i < count; ++i) bits[i] = float_to_bf16(values[start + i]);
    file.write(bits.data(), count * sizeof(std::uint16_t));
  }
}

}  // namespace

struct safetensors_view::impl {
  impl(const std::string& p) : path(p), file(p, "safetensors file", mapped_file::access::sequential) {}
  std::string path;
  mapped_file file;
  const std::uint8_t* data = nullptr;  // the data section
  std::map<std::string, tensor_location> locations;
  std::map<std::string, safetensors_info> infos;
  std::map<std::string, std::string> metadata;
};

safetensors_view::safetensors_view(const std::string& path) : impl_(std::make_unique<impl>(path)) {
  std::uint64_t data_start = 0;
  const json header = parse_header(path, impl_->file, data_start);
  const std::uint64_t data_size = impl_->file.size() - data_start;
  impl_->data = impl_->file.bytes() + data_start;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      impl_->metadata = parse_metadata(path, entry);
      continue;
    }
    tensor_location t = parse_entry(path, name, entry, data_size);
    impl_->infos[name] = {t.dtype, t.shape, t.numel};
    impl_->locations.emplace(name, std::move(t));
  }
  std::vector<const tensor_location*> by_offset;
  for (const auto& [name, t] : impl_->locations) by_offset.push_back(&t);
  check_no_overlap(path, std::move(by_offset));
}

safetensors_view::~safetensors_view() = default;
safetensors_view::safetensors_view(safetensors_view&&) noexcept = default;
safetensors_view& safetensors_view::operator=(safetensors_view&&) noexcept = default;

const std::string& safetensors_view::path() const { return impl_->path; }
const std::map<std::string, safetensors_info>& safetensors_view::tensors() const { return impl_->infos; }
const std::map<std::string, std::string>& safetensors_view::metadata() const { return impl_->metadata; }

const safetensors_info* safetensors_view::find(const std::string& name) const {
  const auto it = impl_->infos.find(name);
  return it == impl_->infos.end() ? nullptr : &it->second;
}

void safetensors_view::read_finite(const std::string& name, std::uint64_t offset, std::uint64_t count,
                                   float* out) const {
  read(name, offset, count, out);
  const float* bad = std::find_if(out, out + count, [](float v) { return !std::isfinite(v); });
  if (bad != out + count)
    throw io_error(path() + " holds " + (std::isnan(*bad) ? std::string("NaN") : std::string(*bad > 0 ? "+Inf" : "-Inf")) +
                   " in " + name + " (element " + std::to_string(offset + static_cast<std::uint64_t>(bad - out)) +
                   "): the file is damaged or the run that wrote it diverged; start from an earlier checkpoint");
}

void safetensors_view::read(const std::string& name, std::uint64_t offset, std::uint64_t count, float* out) const {
  const auto it = impl_->locations.find(name);
  if (it == impl_->locations.end()) read_failure(impl_->path, "it holds no tensor '" + name + "'");
  const tensor_location& t = it->second;
  UPIPE_CHECK(offset <= t.numel && count <= t.numel - offset,
              "safetensors_view::read past the end of " + name + " in " + impl_->path);
  convert_to_f32(t.dtype, impl_->data + t.begin, offset, count, out);
}

safetensors_file read_safetensors(const std::string& path) {
  const safetensors_view view(path);
  safetensors_file result;
  result.metadata = view.metadata();
  for (const auto& [name, info] : view.tensors()) {
    safetensors_entry& entry = result.tensors[name];
    entry.dtype = info.dtype;
    entry.shape = info.shape;
    entry.values.resize(info.numel);
    view.read(name, 0, info.numel, entry.values.data());
  }
  return result;
}

struct safetensors_writer::impl {
  impl(const std::string& p) : path(p), file(p) {}
  std::string path;
  temp_file file;
  std::vector<safetensors_tensor> order;  // the data section's order; values unused
  std::size_t current = 0;                // the tensor being written
  std::uint64_t written = 0;              // its elements written so far
};

safetensors_writer::safetensors_writer(const std::string& path, std::vector<safetensors_tensor> tensors,
                                       const std::map<std::string, std::string>& metadata) {
  std::vector<const safetensors_tensor*> order;
  for (const auto& t : tensors) order.push_back(&t);
  const std::string header = build_header(path, checked(path, order, false), metadata);
  impl_ = std::make_unique<impl>(path);
  impl_->order = std::move(tensors);
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(header.size() >> (8 * i));
  impl_->file.write(length, sizeof(length));
  impl_->file.write(header.data(), header.size());
}

safetensors_writer::~safetensors_writer() = default;

// Moves past the tensors written in full (an empty one needs no write).
void safetensors_writer::skip_finished() {
  while (impl_->current < impl_->order.size() && impl_->written == numel_of(impl_->order[impl_->current])) {
    ++impl_->current;
    impl_->written = 0;
  }
}

void safetensors_writer::write(const std::string& name, std::span<const float> values) {
  while (impl_->current < impl_->order.size() && impl_->order[impl_->current].name != name &&
         impl_->written == numel_of(impl_->order[impl_->current])) {
    ++impl_->current;
    impl_->written = 0;
  }
  UPIPE_CHECK(impl_->current < impl_->order.size(), "safetensors_writer(" + impl_->path + "): " + name +
                                                        " written after every declared tensor");
  const safetensors_tensor& t = impl_->order[impl_->current];
  UPIPE_CHECK(t.name == name, "safetensors_writer(" + impl_->path + "): " + name + " written where " + t.name +
                                  " comes next");
  UPIPE_CHECK(values.size() <= numel_of(t) - impl_->written,
              "safetensors_writer(" + impl_->path + "): more values than " + name + " has");
  write_values(impl_->file, values, t.type);
  impl_->written += values.size();
}

void safetensors_writer::commit() {
  skip_finished();
  UPIPE_CHECK(impl_->current == impl_->order.size(),
              "safetensors_writer(" + impl_->path + "): committed before " + impl_->order[impl_->current].name +
                  " was written in full");
  impl_->file.commit();
  if (!impl_->file.in_place()) sync_directory(impl_->path);
}

void write_safetensors(const std::string& path, std::span<const safetensors_tensor> tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<const safetensors_tensor*> sorted;
  for (const auto& t : tensors) sorted.push_back(&t);
  checked(path, sorted, true);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->name < b->name; });
  std::vector<safetensors_tensor> declared;
  for (const auto* t : sorted) declared.push_back({t->name, t->shape, {}, t->type});
  safetensors_writer writer(path, std::move(declared), metadata);
  for (const auto* t : sorted) writer.write(t->name, t->values);
  writer.commit();
}

}  // namespace upipe
