#include "model/hf_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/shape.hpp"
#include "model/parameters.hpp"
#include "core/files.hpp"
#include "formats/safetensors.hpp"

namespace upipe {

namespace fs = std::filesystem;

namespace {

constexpr const char* index_name = "model.safetensors.index.json";
constexpr const char* single_name = "model.safetensors";

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The shard files an index names, in first-seen order, and which file holds each tensor.
struct index_contents {
  std::vector<std::string> files;
  std::map<std::string, std::string> weight_map;
};

index_contents read_index(const fs::path& index) {
  const std::string text = read_text_file(index.string(), "the weights' index");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw io_error(index.string() + " is not valid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw io_error(index.string() + " has no \"weight_map\" object naming each tensor's shard file "
                                    "(is it a model.safetensors.index.json written by save_pretrained?)");
  index_contents out;
  std::set<std::string> seen;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) throw io_error(index.string() + ": the shard of " + name + " is not a file name: " + file.dump());
    const std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
      throw io_error(index.string() + ": the shard of " + name + " is '" + f +
                     "', not a file name in the model directory");
    out.weight_map.emplace(name, f);
    if (seen.insert(f).second) out.files.push_back(f);
  }
  return out;
}

// A tensor of a layer the configuration does not have means the files are for another model.
void check_layer(const model_config& config, const std::string& name, const std::string& where) {
  const std::optional<std::int64_t> layer = layer_of(name);
  if (layer && *layer < 0)
    throw io_error(where + " holds " + name.substr(0, 200) + ", whose layer is not a layer number (0 to " +
                   std::to_string(config.num_layers - 1) + " in decimal digits): the file is damaged or of another "
                   "format; save it again with save_pretrained");
  if (layer && *layer >= config.num_layers)
    throw io_error(where + " holds " + name + " but the model configuration " + config.name + " has " +
                   std::to_string(config.num_layers) + " layers: pass the configuration these weights were saved "
                   "with (--model DIR, or --config DIR/config.json)");
}

}  // namespace

void host_weight_source::read(const std::string& name, std::int64_t offset, std::int64_t count, float* out) const {
  const auto it = weights_.find(name);
  if (it == weights_.end()) throw io_error("no weights for " + name);
  UPIPE_CHECK(offset >= 0 && count >= 0 && offset + count <= static_cast<std::int64_t>(it->second.size()),
              "host_weight_source::read past the end of " + name);
  std::copy_n(it->second.begin() + offset, count, out);
}

struct hf_model_files::impl {
  std::vector<safetensors_view> views;
  std::map<std::string, std::size_t> where;  // tensor -> views index
  // The multimodal checkpoints' text model: model.language_model.X read as model.X.
  std::map<std::string, std::string> stored;  // the name read -> the name in the file, where they differ
  const std::string& file_name(const std::string& name) const {
    const auto it = stored.find(name);
    return it == stored.end() ? name : it->second;
  }
  std::set<std::string> used;                // the model's parameters (the fused tensors holding experts)
  std::map<std::string, fused_expert_place> fused;  // an expert's tensor -> its place in a fused one
};

namespace {

// An expert's tensor absent from the files but held in transformers 5's fused layout
// (gate_up_proj (E, 2I, D), down_proj (E, D, I)): read from its place there.
bool find_fused_expert(const model_config& config, const parameter_spec& spec, hf_model_files::impl& files,
                       const std::string& where) {
  const std::optional<std::int64_t> layer = layer_of(spec.name);
  if (!layer || *layer < 0 || !config.sparse_layer(static_cast<int>(*layer))) return false;
  const int l = static_cast<int>(*layer);
  const std::string prefix = layer_prefix(l) + config.traits().moe_block + ".experts.";
  if (!spec.name.starts_with(prefix)) return false;
  const std::string rest = spec.name.substr(prefix.size());
  const int e = std::atoi(rest.c_str());
  int role = 0;
  while (role < 3 && expert_name(config, l, e, role) != spec.name) ++role;
  if (role == 3) return false;
  const fused_expert_place place = fused_expert(config, l, e, role);
  const auto it = files.where.find(place.name);
  if (it == files.where.end()) return false;
  const std::int64_t E = config.moe.experts, D = config.hidden_size, I = config.moe.expert_width;
  const std::vector<std::int64_t> want =
      role == 2 ? std::vector<std::int64_t>{E, D, I} : std::vector<std::int64_t>{E, 2 * I, D};
  const safetensors_info& info = *files.views[it->second].find(files.file_name(place.name));
  if (info.shape != want)
    throw io_error(where + ": tensor " + place.name + " has shape " + shape_text(info.shape) + " but " + config.name +
                   " needs " + shape_text(want) + " (experts, rows, columns): pass the matching configuration");
  files.fused.emplace(spec.name, place);
  files.used.insert(place.name);
  return true;
}

}  // namespace

hf_model_files::hf_model_files(const std::string& path, const model_config& config) : impl_(std::make_unique<impl>()) {
  std::error_code ec;
  fs::path dir, index;
  std::vector<std::string> names;  // the files to open
  index_contents contents;
  if (fs::is_directory(path, ec)) {
    dir = path;
    if (fs::exists(dir / index_name, ec)) {
      index = dir / index_name;
    } else if (fs::exists(dir / single_name, ec)) {
      names.push_back(single_name);
    } else {
      const bool bin = fs::exists(dir / "pytorch_model.bin", ec) || fs::exists(dir / "pytorch_model.bin.index.json", ec);
      throw io_error("the model directory " + path + " holds neither " + single_name + " nor " + index_name +
                     (bin ? ": it has PyTorch .bin weights, which upipe does not read; save them as safetensors "
                            "(model.save_pretrained(dir, safe_serialization=True))"
                          : ": pass a directory written by save_pretrained, or a .safetensors file"));
    }
  } else if (ends_with(path, ".index.json")) {
    index = path;
    dir = fs::path(path).parent_path();
  } else {
    dir = fs::path(path).parent_path();
    names.push_back(fs::path(path).filename().string());
  }
  if (!index.empty()) {
    contents = read_index(index);
    names = contents.files;
  }
  for (const std::string& name : names) {
    const fs::path file = dir / name;
    if (!index.empty() && !fs::exists(file, ec))
      throw io_error(index.string() + " names the shard " + name + ", which is missing from " + dir.string() +
                     ": copy every shard the index lists");
    impl_->views.emplace_back(file.string());
    files_.push_back(file.string());
  }
  if (!index.empty()) {
    std::map<std::string, std::size_t> file_index;
    for (std::size_t i = 0; i < names.size(); ++i) file_index.emplace(names[i], i);
    for (const auto& [tensor, file] : contents.weight_map) {
      const std::size_t v = file_index.at(file);
      if (!impl_->views[v].find(tensor))
        throw io_error(index.string() + " places " + tensor + " in " + file + ", which does not hold it: the shard "
                                                                               "and the index are of different saves");
      impl_->where.emplace(tensor, v);
    }
  } else {
    for (const auto& [tensor, info] : impl_->views[0].tensors()) impl_->where.emplace(tensor, 0);
  }
  // A multimodal checkpoint (the Hub's Qwen3.5) holds its text model under
  // model.language_model.*: read as the text model's names, as transformers' PrefixChange does.
  constexpr std::string_view text_prefix = "model.language_model.";
  for (auto it = impl_->where.begin(); it != impl_->where.end();) {
    if (!it->first.starts_with(text_prefix) || !config.traits().multimodal_type) {
      ++it;
      continue;
    }
    const std::string name = "model." + it->first.substr(text_prefix.size());
    impl_->stored.emplace(name, it->first);
    impl_->where.emplace(name, it->second);
    it = impl_->where.erase(it);
  }
  const std::string where = index.empty() ? files_[0] : index.string();
  std::set<std::string>& used = impl_->used;
  for (const parameter_spec& spec : parameter_specs(config)) {
    const auto it = impl_->where.find(spec.name);
    if (it == impl_->where.end() && find_fused_expert(config, spec, *impl_, where)) continue;
    if (it == impl_->where.end())
      throw io_error(where + " has no tensor " + spec.name + " (shape " + shape_text(spec.shape) + "), which " +
                     config.name + " needs: are these weights for another model? (pass their config.json: --model DIR)");
    const safetensors_info& info = *impl_->views[it->second].find(impl_->file_name(spec.name));
    if (info.shape != spec.shape)
      throw io_error(impl_->views[it->second].path() + ": tensor " + spec.name + " has shape " + shape_text(info.shape) +
                     " but " + config.name + " needs " + shape_text(spec.shape) + ": pass the matching configuration");
    used.insert(spec.name);
  }
  for (const auto& [tensor, v] : impl_->where) {
    if (used.count(tensor)) continue;
    check_layer(config, tensor, where);
    unused_.push_back(tensor);
  }
}

hf_model_files::~hf_model_files() = default;

bool has_weight_files(const std::string& dir) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(fs::path(dir) / index_name, ec)) ||
         fs::exists(fs::symlink_status(fs::path(dir) / single_name, ec));
}

void hf_model_files::read(const std::string& name, std::int64_t offset, std::int64_t count, float* out) const {
  if (const auto fused = impl_->fused.find(name); fused != impl_->fused.end()) {
    read(fused->second.name, fused->second.offset + offset, count, out);
    return;
  }
  const auto it = impl_->where.find(name);
  if (it == impl_->where.end()) throw io_error("the model files hold no tensor " + name);
  const safetensors_view& view = impl_->views[it->second];
  view.read_finite(impl_->file_name(name), static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(count), out);
}

std::string hf_model_files::stored_dtype() const {
  std::set<std::string> types;
  for (const std::string& name : impl_->used)
    types.insert(impl_->views[impl_->where.at(name)].find(impl_->file_name(name))->dtype);
  return types.size() == 1 ? *types.begin() : "mixed";
}

host_weights read_all_weights(const weight_source& source, const model_config& config) {
  host_weights out;
  for (const parameter_spec& spec : parameter_specs(config)) {
    std::vector<float> v(static_cast<std::size_t>(element_count(spec.shape)));
    source.read(spec.name, 0, static_cast<std::int64_t>(v.size()), v.data());
    out.emplace(spec.name, std::move(v));
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Writing

struct hf_model_writer::impl {
  fs::path dir;
  dtype type;
  std::vector<std::vector<safetensors_tensor>> shards;  // declared tensors per shard
  std::vector<std::string> file_names;
  std::map<std::string, std::size_t> shard_of;
  std::uint64_t total_bytes = 0, total_parameters = 0;
  std::size_t open_shard = 0;
  std::unique_ptr<safetensors_writer> writer;
};

hf_model_writer::hf_model_writer(const std::string& dir, const model_config& config, const hf_save_options& options)
    : impl_(std::make_unique<impl>()) {
  UPIPE_CHECK(options.type == dtype::bf16 || options.type == dtype::f32, "hf_model_writer writes bf16 or f32");
  impl_->dir = dir;
  impl_->type = options.type;
  std::uint64_t shard_bytes = 0;
  for (const parameter_spec& spec : parameter_specs(config)) {
    const std::uint64_t bytes = static_cast<std::uint64_t>(element_count(spec.shape)) * dtype_size(options.type);
    if (impl_->shards.empty() || (shard_bytes > 0 && shard_bytes + bytes > options.max_shard_bytes)) {
      impl_->shards.emplace_back();
      shard_bytes = 0;
    }
    impl_->shards.back().push_back({spec.name, spec.shape, {}, options.type});
    impl_->shard_of.emplace(spec.name, impl_->shards.size() - 1);
    shard_bytes += bytes;
    impl_->total_bytes += bytes;
    impl_->total_parameters += static_cast<std::uint64_t>(element_count(spec.shape));
  }
  const std::size_t n = impl_->shards.size();
  for (std::size_t i = 0; i < n; ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, n);
    impl_->file_names.push_back(n == 1 ? single_name : name);
  }
}

hf_model_writer::~hf_model_writer() = default;

void hf_model_writer::write(const std::string& name, std::span<const float> values) {
  const auto it = impl_->shard_of.find(name);
  UPIPE_CHECK(it != impl_->shard_of.end(), "hf_model_writer: " + name + " is not a parameter of the model");
  if (!impl_->writer || it->second != impl_->open_shard) {
    UPIPE_CHECK(!impl_->writer || it->second == impl_->open_shard + 1, "hf_model_writer: " + name + " out of order");
    if (impl_->writer) impl_->writer->commit();
    impl_->open_shard = it->second;
    impl_->writer = std::make_unique<safetensors_writer>((impl_->dir / impl_->file_names[it->second]).string(),
                                                         impl_->shards[it->second],
                                                         std::map<std::string, std::string>{{"format", "pt"}});
  }
  impl_->writer->write(name, values);
}

std::vector<std::string> hf_model_writer::commit() {
  UPIPE_CHECK(impl_->writer && impl_->open_shard + 1 == impl_->shards.size(), "hf_model_writer: committed early");
  impl_->writer->commit();
  impl_->writer.reset();
  std::vector<std::string> written = impl_->file_names;
  if (impl_->shards.size() > 1) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_parameters", impl_->total_parameters}, {"total_size", impl_->total_bytes}};
    nlohmann::ordered_json map = nlohmann::ordered_json::object();
    for (std::size_t s = 0; s < impl_->shards.size(); ++s)
      for (const auto& t : impl_->shards[s]) map[t.name] = impl_->file_names[s];
    index["weight_map"] = map;
    const fs::path path = impl_->dir / index_name;
    std::ofstream out(path, std::ios::trunc);
    out << index.dump(2) << "\n";
    out.flush();
    if (!out) throw io_error("cannot write " + path.string() + " (disk full?)");
    written.push_back(index_name);
  }
  return written;
}

const std::vector<std::string>& companion_file_names() {
  static const std::vector<std::string> names = {
      "tokenizer.json",    "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
      "vocab.json",        "merges.txt",            "added_tokens.json",       "chat_template.jinja",
      "chat_template.json", "generation_config.json"};
  return names;
}

void check_companion_files(const std::string& dir) {
  std::error_code ec;
  for (const std::string& name : companion_file_names()) {
    const fs::path file = fs::path(dir) / name;
    if (!fs::exists(fs::symlink_status(file, ec)) || fs::is_regular_file(file, ec)) continue;
    throw io_error("the model directory " + dir + " holds " + name + " as " + describe_path(file.string()) +
                   ", not a regular file: replace it by the file (or remove it) and run again");
  }
}

std::vector<std::string> copy_companion_files(const std::string& from_dir, const std::string& to_dir) {
  std::vector<std::string> copied;
  std::error_code ec;
  check_companion_files(from_dir);
  for (const std::string& name : companion_file_names()) {
    const fs::path from = fs::path(from_dir) / name;
    if (!fs::is_regular_file(from, ec)) continue;
    fs::copy_file(from, fs::path(to_dir) / name, fs::copy_options::overwrite_existing, ec);
    if (ec) throw io_error("cannot copy " + from.string() + " into " + to_dir + ": " + ec.message());
    copied.push_back(name);
  }
  return copied;
}

std::string hf_dtype_name(dtype type) { return type == dtype::bf16 ? "bfloat16" : "float32"; }

}  // namespace upipe
