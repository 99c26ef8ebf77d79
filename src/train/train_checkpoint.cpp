#include "train/train_checkpoint.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "core/digest.hpp"
#include "core/error.hpp"
#include "model/adapter_files.hpp"
#include "ops/cpu/cpu_ops.hpp"
#include "core/files.hpp"
#include "formats/safetensors.hpp"
#include "train/run_directory.hpp"

namespace upipe {

namespace fs = std::filesystem;

namespace {

constexpr const char* trainer_dir = "trainer";
constexpr const char* manifest_file = "manifest.json";
constexpr const char* run_config_file = "run.toml";
constexpr const char* manifest_format = "upipe-trainer-state";
constexpr int manifest_version = 2;
constexpr const char* tmp_suffix = ".tmp-upipe";

void fsync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_DIRECTORY : 0) | O_RDONLY);
  if (fd < 0) throw io_error("cannot open " + path.string() + " to sync it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw io_error("cannot sync " + path.string() + ": " + std::strerror(err));
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.flush();
  if (!out) throw io_error("cannot write " + path.string() + ": " + std::strerror(errno));
  out.close();
  fsync_path(path, false);
}

std::string rank_file(int rank, int ranks) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05d-of-%05d.safetensors", rank, ranks);
  return name;
}

std::string tensor_name(int unit, shard_state which) { return "unit." + std::to_string(unit) + "." + state_name(which); }

bool is_absmax(shard_state which) {
  return which == shard_state::exp_avg_absmax || which == shard_state::exp_avg_sq_absmax;
}

// The manifest's words for the state formats.
const char* moments_word(moment_format f) { return f == moment_format::f32 ? "f32" : f == moment_format::bf16 ? "bf16" : "q8"; }
const char* master_word(master_format f) { return f == master_format::f32 ? "f32" : "bf16-kahan"; }

bool is_checkpoint(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(dir / trainer_dir / manifest_file, ec) || fs::exists(dir / "trainer_state.json", ec);
}

// A directory without trainer/manifest.json, refused: a checkpoint of an earlier upipe, or
// no checkpoint.
[[noreturn]] void no_manifest(const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(dir / "trainer_state.json", ec))
    throw io_error("cannot resume from " + dir.string() + ": it is a checkpoint of an earlier upipe (trainer_state.json, "
                   "fp32 model.safetensors); resume it with that version, or start from its weights with --init " +
                   dir.string());
  throw io_error(dir.string() + " is not a training checkpoint: it holds no " + std::string(trainer_dir) + "/" +
                 manifest_file + " (name a checkpoint written by upipe train --save, its run directory, or the run "
                 "directory's latest or best)");
}

// The top-level files the manifest of DIR says upipe wrote (empty when there is none).
std::set<std::string> written_files(const fs::path& dir) {
  std::set<std::string> files;
  try {
    const auto j = nlohmann::json::parse(read_text_file((dir / trainer_dir / manifest_file).string(), "manifest"));
    for (const auto& f : j.at("files")) files.insert(f.get<std::string>());
  } catch (const nlohmann::json::exception&) {
  } catch (const io_error&) {
  }
  return files;
}

// Files a user added to an existing checkpoint move into the new one (hard links where the
// file system allows, else copies), so that replacing the checkpoint deletes none of them.
void carry_user_files(const fs::path& old_dir, const fs::path& tmp) {
  std::error_code ec;
  if (!fs::is_directory(old_dir, ec)) return;
  const std::set<std::string> ours = written_files(old_dir);
  for (const auto& entry : fs::directory_iterator(old_dir)) {
    const std::string name = entry.path().filename().string();
    if (name == trainer_dir || ours.count(name) || name == "trainer_state.json" || name == "optimizer.safetensors" ||
        fs::exists(tmp / name, ec))
      continue;
    fs::create_hard_link(entry.path(), tmp / name, ec);
    if (ec) fs::copy(entry.path(), tmp / name, fs::copy_options::recursive | fs::copy_options::copy_symlinks, ec);
    if (ec) throw io_error("cannot carry " + entry.path().string() + " into the new checkpoint: " + ec.message());
  }
}

// Swaps the finished temporary directory in: an atomic exchange when DIR exists.
void publish(const fs::path& tmp, const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    if (std::rename(tmp.c_str(), dir.c_str()) != 0)
      throw io_error("cannot move the checkpoint into " + dir.string() + ": " + std::strerror(errno));
  } else {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) != 0)
      throw io_error("cannot replace the checkpoint " + dir.string() + ": " + std::strerror(errno));
    fs::remove_all(tmp, ec);  // now the previous checkpoint
  }
  fsync_path(dir.has_parent_path() ? dir.parent_path() : fs::path("."), true);
}

// What a killed save or export left: DIR.tmp-upipe, and DIR.tmp-<pid> (of earlier versions,
// or of a file writer) whose process is gone.
void remove_save_leftovers(const fs::path& dir) {
  std::error_code ec;
  fs::remove_all(dir.string() + tmp_suffix, ec);
  remove_stale_temporaries(dir.string());
}

// Expert parallelism: each rank's place (its EP rank, and its rank among the ranks that hold
// the same experts), in the order of the rank files; empty without it.
std::vector<std::pair<int, int>> expert_placement(const parameter_store& params, communicator& comm) {
  const expert_sharding& e = params.experts();
  if (e.groups == 1) return {};
  const std::int32_t mine[2] = {e.group, e.replicas->rank()};
  std::vector<std::int32_t> all(2 * static_cast<std::size_t>(comm.size()));
  comm.all_gather(mine, all.data(), sizeof mine, "expert_placement");
  std::vector<std::pair<int, int>> out;
  for (std::size_t r = 0; r < all.size(); r += 2) out.emplace_back(all[r], all[r + 1]);
  return out;
}

nlohmann::ordered_json manifest_json(const checkpoint_request& r, const parameter_store& params, int ranks,
                                     const std::vector<std::string>& files,
                                     const std::vector<std::pair<int, int>>& placement) {
  std::vector<std::int64_t> units;
  for (int u = 0; u < params.unit_count(); ++u) units.push_back(params.unit_numel(u));
  const char* zero = params.stage() == zero_stage::three ? "3" : "2";
  nlohmann::ordered_json j;
  j["format"] = manifest_format;
  j["version"] = manifest_version;
  j["step"] = r.state.step;
  j["data_position"] = r.state.data_position;
  j["seed"] = r.state.seed;
  j["total_steps"] = r.state.total_steps;
  j["data"] = r.state.data;
  j["data_bytes"] = r.state.data_bytes;
  j["packing"] = r.state.packing;
  j["min_doc_tokens"] = r.state.min_doc_tokens;
  j["batch"] = r.state.batch;
  j["seq_warmup"] = r.state.seq_warmup;
  j["warmup_seq_len"] = r.state.warmup_seq_len;
  j["shape_step"] = r.state.shape_step;
  j["shape_position"] = r.state.shape_position;
  if (!r.state.mixture.empty()) {
    j["mixture"] = nlohmann::ordered_json::array();
    for (const trainer_state::source_state& m : r.state.mixture)
      j["mixture"].push_back({{"data", m.data}, {"weight", m.weight}, {"data_bytes", m.data_bytes},
                              {"sequences", m.sequences}, {"position", m.position},
                              {"shape_sequences", m.shape_sequences}, {"shape_position", m.shape_position}});
  }
  j["ranks"] = ranks;
  j["zero"] = zero;
  j["strategy"] = r.strategy;
  j["head_chunk"] = r.head_chunk;
  j["seq_len"] = r.seq_len;
  j["model_dtype"] = r.lora.enabled() ? hf_dtype_name(dtype::f32) : hf_dtype_name(r.model.type);  // adapters: fp32
  if (r.lora.enabled()) {
    j["lora"] = lora_text(r.lora);
    j["base_model"] = r.base_model;
  }
  if (!r.run_id.empty()) j["run_id"] = r.run_id;
  if (r.eval_loss) j["eval_loss"] = *r.eval_loss;
  j["units"] = units;
  if (!placement.empty()) {
    // The expert units' state lies in blocks: EP rank b's experts, sharded over the rank
    // files whose place is (b, i), i = 0, 1, ... (parameter_store's expert_sharding).
    std::vector<int> expert_units;
    for (int u = 0; u < params.unit_count(); ++u)
      if (params.is_expert_unit(u)) expert_units.push_back(u);
    j["expert_parallel"] = params.experts().groups;
    j["expert_units"] = expert_units;
    j["expert_placement"] = placement;
  }
  j["files"] = files;
  const adamw_state_format& f = params.state_options().format;
  j["optimizer_state"] = {{"moments", moments_word(f.moments)}, {"master", master_word(f.master)}};
  return j;
}

// Every parameter's unit and place in it, in the model's order (parameter_specs').
std::vector<std::pair<int, const unit_parameter*>> in_model_order(const model_config& config,
                                                                  const std::vector<std::vector<unit_parameter>>& units) {
  std::map<std::string, std::pair<int, const unit_parameter*>> where;
  for (std::size_t u = 0; u < units.size(); ++u)
    for (const unit_parameter& p : units[u]) where.emplace(p.name, std::pair{static_cast<int>(u), &p});
  std::vector<std::pair<int, const unit_parameter*>> out;
  for (const parameter_spec& spec : parameter_specs(config)) out.push_back(where.at(spec.name));
  return out;
}

// The model, a unit at a time through rank 0, as a model directory in `tmp`; returns the
// files written (on rank 0).
std::vector<std::string> write_model(const fs::path& tmp, const checkpoint_request& r, parameter_store& params,
                                     communicator& comm) {
  const bool writes = comm.rank() == 0;
  std::unique_ptr<hf_model_writer> writer;
  if (writes) writer = std::make_unique<hf_model_writer>(tmp.string(), r.config, r.model);
  // The files take the tensors in the model's order, where a sparse layer's experts (a unit
  // of their own) lie between its router and its shared expert: each unit is gathered when
  // its first tensor comes (the same order on every rank) and let go after its last.
  const auto units = parameter_units(r.config);
  std::vector<std::size_t> left(units.size(), 0);
  for (std::size_t u = 0; u < units.size(); ++u) left[u] = units[u].size();
  std::map<int, std::vector<float>> held;
  for (const auto& [u, p] : in_model_order(r.config, units)) {
    auto it = held.find(u);
    if (it == held.end()) it = held.emplace(u, params.gather_unit(u)).first;
    if (writes) writer->write(p->name, std::span<const float>(it->second.data() + p->offset, static_cast<std::size_t>(p->numel)));
    if (--left[static_cast<std::size_t>(u)] == 0) held.erase(it);
  }
  if (!writes) return {};
  std::vector<std::string> files = writer->commit();
  write_hf_config(r.config, (tmp / "config.json").string(), r.source_dir, hf_dtype_name(r.model.type));
  fsync_path(tmp / "config.json", false);
  files.push_back("config.json");
  return files;
}

// LoRA: the adapters' fp32 masters, a unit at a time through rank 0, as PEFT's adapter
// directory: adapter_model.safetensors under PEFT's names and adapter_config.json.
std::vector<std::string> write_adapters(const fs::path& tmp, const checkpoint_request& r, parameter_store& adapters,
                                        communicator& comm) {
  const bool writes = comm.rank() == 0;
  std::map<std::string, std::int64_t> numel;
  std::unique_ptr<safetensors_writer> file;
  if (writes) {
    std::vector<safetensors_tensor> declared;
    for (const parameter_spec& spec : lora_parameter_specs(r.config, r.lora)) {
      declared.push_back({std::string(peft_name_prefix) + spec.name, spec.shape, {}, dtype::f32});
      numel[spec.name] = spec.shape[0] * spec.shape[1];
    }
    file = std::make_unique<safetensors_writer>((tmp / adapter_weights_file).string(), std::move(declared),
                                                std::map<std::string, std::string>{{"format", "pt"}});
  }
  for (int u = 0; u < adapters.unit_count(); ++u) {
    const std::vector<float> flat = adapters.gather_unit(u);
    if (!writes) continue;
    for (const auto& [name, offset] : adapters.unit_parameters(u))
      file->write(std::string(peft_name_prefix) + name,
                  std::span<const float>(flat.data() + offset, static_cast<std::size_t>(numel.at(name))));
  }
  if (!writes) return {};
  file->commit();
  write_adapter_config(tmp.string(), r.config, r.lora, r.base_model);
  fsync_path(tmp / adapter_config_file, false);
  return {adapter_weights_file, adapter_config_file};
}

}  // namespace

std::string run_config_path(const std::string& checkpoint_dir) {
  return (fs::path(checkpoint_dir) / trainer_dir / run_config_file).string();
}

std::optional<std::string> read_run_config(const std::string& checkpoint_dir) {
  const fs::path file = fs::path(checkpoint_dir) / trainer_dir / run_config_file;
  const fs::path manifest = fs::path(checkpoint_dir) / trainer_dir / manifest_file;
  std::error_code ec;
  if (!fs::exists(manifest, ec)) no_manifest(checkpoint_dir);
  std::string recorded;
  try {
    const auto j = nlohmann::json::parse(read_text_file(manifest.string(), "the trainer state's manifest"));
    if (j.is_object() && j.contains("run_config_sha256") && j["run_config_sha256"].is_string())
      recorded = j["run_config_sha256"].get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw io_error("cannot read " + manifest.string() + ": " + e.what());
  }
  if (!fs::exists(file, ec)) {
    if (recorded.empty()) return std::nullopt;  // a checkpoint of an upipe before run.toml
    throw io_error("cannot resume from " + checkpoint_dir + ": " + file.string() + " is missing (its manifest records "
                   "one); restore it from a copy of the checkpoint");
  }
  const std::string text = read_text_file(file.string(), "the checkpoint's run configuration");
  if (text.find_first_not_of(" \t\r\n") == std::string::npos)
    throw io_error("cannot resume from " + checkpoint_dir + ": " + file.string() + " is empty (a save writes the whole "
                   "configuration); restore it from a copy of the checkpoint");
  if (!recorded.empty() && file_sha256(file.string(), "the checkpoint's run configuration") != recorded)
    throw io_error("cannot resume from " + checkpoint_dir + ": " + file.string() + " is not the file the checkpoint "
                   "was saved with (its SHA-256 differs from trainer/manifest.json's run_config_sha256): restore it, "
                   "and give changes as flags beside --resume");
  return text;
}

std::string resolve_checkpoint_dir(const std::string& text) {
  if (text.empty()) throw config_error("an empty checkpoint directory was given: name a directory, e.g. --save run1");
  fs::path p = fs::path(text).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  std::error_code ec;
  if (fs::is_symlink(p, ec)) {
    const fs::path target = fs::canonical(p, ec);
    if (ec) throw io_error("the checkpoint directory " + text + " is a symbolic link to a path that does not exist (" +
                           ec.message() + "): make the target or name another directory");
    p = target;
  }
  return fs::absolute(p).string();
}

void check_save_dir(const std::string& text) {
  const fs::path dir = resolve_checkpoint_dir(text);
  std::error_code ec;
  const fs::path parent = dir.parent_path();
  if (!fs::is_directory(parent, ec))
    throw io_error("cannot save into " + dir.string() + ": its parent directory " + parent.string() +
                   " does not exist; create it first (mkdir -p " + parent.string() + ")");
  if (::access(parent.c_str(), W_OK) != 0)
    throw io_error("cannot save into " + dir.string() + ": the directory " + parent.string() +
                   " is not writable; choose another --save directory");
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec))
      throw io_error("refusing to save into " + dir.string() + ": it exists and is not a directory; choose another "
                     "--save directory");
    if (!fs::is_empty(dir, ec) && !is_checkpoint(dir))
      throw io_error("refusing to write a checkpoint over " + dir.string() +
                     ": it exists and is not an upipe checkpoint; choose another --save directory");
    if (::access(dir.c_str(), W_OK) != 0)
      throw io_error("cannot save into " + dir.string() + ": it is not writable; choose another --save directory");
  }
  remove_save_leftovers(dir);
}

void remove_save_temporary(const std::string& dir) {
  std::error_code ec;
  fs::remove_all(resolve_checkpoint_dir(dir) + tmp_suffix, ec);
}

void save_checkpoint(const std::string& dir_text, const checkpoint_request& r, parameter_store& params,
                     communicator& comm) {
  const fs::path dir = resolve_checkpoint_dir(dir_text);
  const fs::path tmp = dir.string() + tmp_suffix;
  const bool writes = comm.rank() == 0;
  const int C = comm.size();
  if (writes) {
    check_save_dir(dir.string());
    std::error_code ec;
    if (!fs::create_directory(tmp, ec) || !fs::create_directory(tmp / trainer_dir, ec))
      throw io_error("cannot create " + tmp.string() + " for the checkpoint: " + ec.message() +
                     " (is the parent directory there and writable?)");
  }
  comm.barrier();
  try {
    // Every rank its own shard of the optimizer state, in parallel, streamed a unit at a
    // time: a rank never holds more than one unit's state on the host.
    std::vector<safetensors_tensor> declared;
    const adamw_state_format& format = params.state_options().format;
    for (int u = 0; u < params.unit_count(); ++u)
      for (shard_state which : state_tensors(format))
        declared.push_back({tensor_name(u, which), {is_absmax(which) ? params.unit_shard(u) / q8_block : params.unit_shard(u)},
                            {}, state_dtype(format, which)});
    const std::vector<std::pair<int, int>> placement = expert_placement(params, comm);
    std::map<std::string, std::string> metadata{{"format", "upipe-zero-shard"}, {"rank", std::to_string(comm.rank())},
                                                {"ranks", std::to_string(C)}, {"step", std::to_string(r.state.step)},
                                                {"run_id", r.run_id}};
    if (!placement.empty()) {
      metadata["expert_group"] = std::to_string(placement[static_cast<std::size_t>(comm.rank())].first);
      metadata["expert_replica"] = std::to_string(placement[static_cast<std::size_t>(comm.rank())].second);
    }
    safetensors_writer shard_file((tmp / trainer_dir / rank_file(comm.rank(), C)).string(), std::move(declared),
                                  std::move(metadata));
    for (int u = 0; u < params.unit_count(); ++u)
      for (shard_state which : state_tensors(format)) shard_file.write(tensor_name(u, which), params.shard_values(u, which));
    shard_file.commit();
    std::vector<std::string> files =
        r.lora.enabled() ? write_adapters(tmp, r, params, comm) : write_model(tmp, r, params, comm);
    comm.barrier();  // every rank's shard file is complete
    if (writes) {
      if (!r.source_dir.empty() && fs::absolute(r.source_dir) != dir)
        for (const std::string& f : copy_companion_files(r.source_dir, tmp.string())) files.push_back(f);
      else
        for (const std::string& f : copy_companion_files(dir.string(), tmp.string())) files.push_back(f);
      nlohmann::ordered_json manifest = manifest_json(r, params, C, files, placement);
      if (!r.run_config.empty()) {
        const fs::path run_toml = tmp / trainer_dir / run_config_file;
        write_text(run_toml, r.run_config);
        manifest["run_config_sha256"] = file_sha256(run_toml.string(), "the run configuration");
      }
      write_text(tmp / trainer_dir / manifest_file, manifest.dump(2) + "\n");
      fsync_path(tmp / trainer_dir, true);
      carry_user_files(dir, tmp);
      fsync_path(tmp, true);
      publish(tmp, dir);
    }
  } catch (...) {
    // A single-rank save cleans up at once; in a group, other ranks may still be writing
    // into the temporary, so the caller removes it once the group has stopped
    // (remove_save_temporary), and the next save would too.
    std::error_code ec;
    if (C == 1) fs::remove_all(tmp, ec);
    throw;
  }
  comm.barrier();
}

// ---------------------------------------------------------------------------------------
// Reading

struct saved_state::impl {
  std::vector<safetensors_view> ranks;
  std::vector<std::vector<unit_parameter>> layout;  // the units' parameters, from check_units
  std::vector<std::int64_t> units;  // unpadded sizes
  std::vector<std::int64_t> shards;  // per unit, elements per saved rank (an expert unit's per rank of its block)
  // Saved under expert parallelism over E ranks: an expert unit is E blocks (EP rank b's
  // experts), block b sharded over the rank files expert_files[b][0, 1, ...].
  int expert_parallel = 1;
  std::vector<bool> expert_unit;
  std::vector<std::vector<int>> expert_files;
};

saved_state::saved_state(const std::string& text) : impl_(std::make_unique<impl>()) {
  const fs::path dir = resolve_checkpoint_dir(text);
  dir_ = dir.string();
  const fs::path manifest = dir / trainer_dir / manifest_file;
  std::error_code ec;
  if (!fs::exists(manifest, ec)) no_manifest(dir);
  const std::string manifest_text = read_text_file(manifest.string(), "the trainer state's manifest");
  try {
    const auto j = nlohmann::json::parse(manifest_text);
    if (!j.is_object() || j.value("format", "") != manifest_format || j.value("version", 0) != manifest_version)
      throw io_error(manifest.string() + " is not an upipe trainer state of version " + std::to_string(manifest_version));
    // Whole numbers as written (nlohmann's get<> would truncate 3.5 and wrap 2^64).
    const auto whole = [&](const char* key, bool optional = false) -> std::int64_t {
      if (optional && !j.contains(key)) return 0;
      const auto& v = j.at(key);
      if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<std::uint64_t>() > INT64_MAX))
        throw io_error(manifest.string() + " is damaged: " + key + " = " + v.dump().substr(0, 40) +
                       " is not a whole number of 0 or more");
      return v.get<std::int64_t>();
    };
    const auto& seed = j.at("seed");
    const auto& data_bytes = j.at("data_bytes");
    if (!seed.is_number_unsigned() || !data_bytes.is_number_unsigned())
      throw io_error(manifest.string() + " is damaged: seed and data_bytes must be whole numbers of 0 or more");
    state_ = {whole("step"), whole("data_position"), seed.get<std::uint64_t>(), whole("total_steps"),
              j.at("data").get<std::string>(), data_bytes.get<std::uint64_t>(), j.at("packing").get<std::string>(),
              whole("min_doc_tokens")};
    const std::int64_t ranks = whole("ranks");
    ranks_ = ranks < 1 || ranks > (1 << 20) ? -1 : static_cast<int>(ranks);
    zero_ = j.at("zero").get<std::string>();
    if (j.contains("run_id") && j["run_id"].is_string()) run_id_ = j["run_id"].get<std::string>();
    for (const auto& n : j.at("units")) {
      if (!n.is_number_integer()) throw io_error(manifest.string() + " is damaged: units holds " + n.dump().substr(0, 40));
      impl_->units.push_back(n.is_number_unsigned() && n.get<std::uint64_t>() > INT64_MAX ? -1 : n.get<std::int64_t>());
    }
    state_.seq_len = whole("seq_len");
    if (j.contains("lora")) lora_ = j.at("lora").get<std::string>();
    shape_recorded_ = j.contains("batch");  // saves of earlier versions did not record the steps' shape
    state_.batch = whole("batch", true);
    state_.seq_warmup = whole("seq_warmup", true);
    state_.warmup_seq_len = whole("warmup_seq_len", true);
    state_.shape_step = whole("shape_step", true);
    state_.shape_position = whole("shape_position", true);
    if (j.contains("optimizer_state")) {  // absent: a save of an upipe without lean formats (f32)
      const auto& f = j.at("optimizer_state");
      const std::string moments = f.at("moments").get<std::string>(), master = f.at("master").get<std::string>();
      if ((moments != "f32" && moments != "bf16" && moments != "q8") || (master != "f32" && master != "bf16-kahan"))
        throw io_error(manifest.string() + " is damaged: optimizer_state names moments '" + moments + "' and master '" +
                       master + "' (upipe writes f32, bf16 or q8, and f32 or bf16-kahan)");
      format_.moments = moments == "f32" ? moment_format::f32 : moments == "bf16" ? moment_format::bf16 : moment_format::q8;
      format_.master = master == "f32" ? master_format::f32 : master_format::bf16_kahan;
    }
    read_mixture(j, manifest.string());
    read_expert_placement(j, manifest.string());
  } catch (const nlohmann::json::exception& e) {
    throw io_error("cannot read " + manifest.string() + ": " + e.what());
  }
  check_manifest_ranges(manifest.string());
  const int E = impl_->expert_parallel;
  for (std::size_t u = 0; u < impl_->units.size(); ++u) {
    const std::int64_t n = impl_->units[u];
    if (!impl_->expert_unit[u]) {
      impl_->shards.push_back(padded_unit(n, ranks_, {format_}) / ranks_);
      continue;
    }
    if (n % E != 0 || (format_.moments == moment_format::q8 && n / E % q8_block != 0))
      throw io_error(manifest.string() + " is damaged: expert unit " + std::to_string(u) + " of " + std::to_string(n) +
                     " elements does not split into " + std::to_string(E) + " EP blocks" +
                     (format_.moments == moment_format::q8 ? " of whole 8-bit blocks" : ""));
    impl_->shards.push_back(padded_unit(n / E, ranks_ / E, {format_}) / (ranks_ / E));
  }
  for (int r = 0; r < ranks_; ++r) {
    const fs::path file = dir / trainer_dir / rank_file(r, ranks_);
    if (!fs::exists(file, ec))
      throw io_error("cannot read the trainer state of " + dir_ + ": " + file.string() + " is missing (the manifest names " +
                     std::to_string(ranks_) + " ranks)");
    impl_->ranks.emplace_back(file.string());
    check_shard_rank(impl_->ranks.back(), file.string(), r);
    for (std::size_t u = 0; u < impl_->units.size(); ++u)
      for (shard_state which : state_tensors(format_)) {
        const std::int64_t want = is_absmax(which) ? impl_->shards[u] / q8_block : impl_->shards[u];
        const safetensors_info* info = impl_->ranks.back().find(tensor_name(static_cast<int>(u), which));
        if (!info || info->numel != static_cast<std::uint64_t>(want))
          throw io_error(file.string() + " lacks " + tensor_name(static_cast<int>(u), which) + " of " +
                         std::to_string(want) + " elements: the trainer state is damaged");
      }
  }
}

saved_state::~saved_state() = default;

// A shard says which rank wrote it (its metadata): one under another's name (shards swapped,
// or copied from another run of another size) would resume every rank on the wrong part
// of the state. Shards of versions before the metadata carry none and are not checked.
void saved_state::check_shard_rank(const safetensors_view& shard, const std::string& file, int rank) const {
  const auto& meta = shard.metadata();
  const auto said = [&](const char* key) {
    const auto it = meta.find(key);
    return it == meta.end() ? std::optional<std::string>() : std::optional<std::string>(it->second);
  };
  const std::optional<std::string> written_rank = said("rank"), written_ranks = said("ranks");
  if (!written_rank && !written_ranks) return;
  if (written_rank != std::to_string(rank) || written_ranks != std::to_string(ranks_))
    throw io_error(file + " was written by rank " + written_rank.value_or("?") + " of " + written_ranks.value_or("?") +
                   " (its metadata), not by rank " + std::to_string(rank) + " of " + std::to_string(ranks_) +
                   " as its name says: the shards were renamed or mixed; restore the checkpoint's trainer/ directory");
  // Shards since run ids say their step and run: one copied from another checkpoint would
  // resume this rank's part of the state from another point of training.
  const std::optional<std::string> written_step = said("step"), written_run = said("run_id");
  if (written_step && *written_step != std::to_string(state_.step))
    throw io_error(file + " was written at step " + *written_step + " (its metadata), but " + dir_ +
                   "/trainer/manifest.json is at step " + std::to_string(state_.step) +
                   ": the shard comes from another checkpoint; restore the checkpoint's trainer/ directory");
  if (written_run && !run_id_.empty() && *written_run != run_id_)
    throw io_error(file + " was written by run " + *written_run + " (its metadata), but " + dir_ +
                   "/trainer/manifest.json names run " + run_id_ +
                   ": the shard comes from another run's checkpoint; restore the checkpoint's trainer/ directory");
}

// Expert parallelism at save (absent: none): E, the expert units and each rank file's place,
// every (EP rank, replica rank) once.
void saved_state::read_expert_placement(const nlohmann::json& j, const std::string& manifest) {
  impl_->expert_unit.assign(impl_->units.size(), false);
  if (!j.contains("expert_parallel")) return;
  const auto damaged = [&](const std::string& what) {
    throw io_error(manifest + " is damaged: " + what + "; restore the checkpoint, or start from its weights with --init " +
                   dir_);
  };
  const auto& ep = j.at("expert_parallel");
  if (!ep.is_number_integer() || ep.get<std::int64_t>() < 2 || ranks_ < 1 || ranks_ % ep.get<std::int64_t>() != 0)
    damaged("expert_parallel = " + ep.dump().substr(0, 40) + " does not divide its " + std::to_string(ranks_) + " ranks");
  const int E = static_cast<int>(ep.get<std::int64_t>()), M = ranks_ / E;
  impl_->expert_parallel = E;
  for (const auto& u : j.at("expert_units")) {
    if (!u.is_number_integer() || u.get<std::int64_t>() < 0 || u.get<std::uint64_t>() >= impl_->units.size())
      damaged("expert_units holds " + u.dump().substr(0, 40));
    impl_->expert_unit[u.get<std::size_t>()] = true;
  }
  const auto& places = j.at("expert_placement");
  if (!places.is_array() || places.size() != static_cast<std::size_t>(ranks_))
    damaged("expert_placement must give each of the " + std::to_string(ranks_) + " rank files its place");
  impl_->expert_files.assign(static_cast<std::size_t>(E), std::vector<int>(static_cast<std::size_t>(M), -1));
  for (int r = 0; r < ranks_; ++r) {
    const auto& p = places[static_cast<std::size_t>(r)];
    const bool pair = p.is_array() && p.size() == 2 && p[0].is_number_integer() && p[1].is_number_integer();
    const std::int64_t b = pair ? p[0].get<std::int64_t>() : -1, i = pair ? p[1].get<std::int64_t>() : -1;
    if (b < 0 || b >= E || i < 0 || i >= M || impl_->expert_files[b][i] >= 0)
      damaged("expert_placement[" + std::to_string(r) + "] = " + p.dump().substr(0, 40) + " is not a free place (EP rank < " +
              std::to_string(E) + ", replica < " + std::to_string(M) + ")");
    impl_->expert_files[b][i] = r;
  }
}

// A mixture's sources as the manifest lists them, every number checked as the others are.
void saved_state::read_mixture(const nlohmann::json& j, const std::string& manifest) {
  if (!j.contains("mixture")) return;
  const auto& list = j.at("mixture");
  if (!list.is_array() || list.size() < 2 || list.size() > max_saved_sources)
    throw io_error(manifest + " is damaged: mixture must list 2 to " + std::to_string(max_saved_sources) + " sources");
  for (const auto& m : list) {
    const auto count = [&](const char* key) -> std::int64_t {
      const auto& v = m.at(key);
      if (!v.is_number_integer() || v.get<std::int64_t>() < 0 || (v.is_number_unsigned() && v.get<std::uint64_t>() > INT64_MAX))
        throw io_error(manifest + " is damaged: mixture's " + key + " = " + v.dump().substr(0, 40) +
                       " is not a whole number of 0 or more");
      return v.get<std::int64_t>();
    };
    const auto& weight = m.at("weight");
    if (!weight.is_number() || !(weight.get<double>() > 0) || !std::isfinite(weight.get<double>()))
      throw io_error(manifest + " is damaged: a mixture weight of " + weight.dump().substr(0, 40) + " is not positive");
    state_.mixture.push_back({m.at("data").get<std::string>(), weight.get<double>(),
                              static_cast<std::uint64_t>(count("data_bytes")), count("sequences"), count("position"),
                              count("shape_sequences"), count("shape_position")});
  }
}

// Every number of the manifest within what a save writes, before any is used to size or
// index anything.
void saved_state::check_manifest_ranges(const std::string& manifest) const {
  const auto damaged = [&](const std::string& field, std::int64_t value, const std::string& rule) {
    throw io_error(manifest + " is damaged: " + field + " = " + std::to_string(value) + " " + rule +
                   "; restore the checkpoint, or start from its weights with --init " + dir_);
  };
  if (ranks_ < 1) damaged("ranks", ranks_, "must lie between 1 and 2^20 (the CP group that wrote it)");
  const std::pair<const char*, std::int64_t> counts[] = {
      {"step", state_.step},           {"data_position", state_.data_position}, {"total_steps", state_.total_steps},
      {"min_doc_tokens", state_.min_doc_tokens}, {"batch", state_.batch},  {"seq_len", state_.seq_len},
      {"seq_warmup", state_.seq_warmup}, {"warmup_seq_len", state_.warmup_seq_len},
      {"shape_step", state_.shape_step}, {"shape_position", state_.shape_position}};
  for (const auto& [field, value] : counts)
    if (value < 0) damaged(field, value, "must not be negative");
  // A save records the schedule it ran (--steps, at least 1), which its step never passes.
  if (state_.total_steps < 1) damaged("total_steps", state_.total_steps, "must be at least 1 (the schedule's steps)");
  if (state_.step > state_.total_steps)
    damaged("step", state_.step, "lies past total_steps = " + std::to_string(state_.total_steps));
  if (state_.shape_step > state_.step)
    damaged("shape_step", state_.shape_step, "lies past step = " + std::to_string(state_.step));
  if (const std::int64_t named = step_in_name(dir_); named >= 0 && named != state_.step)
    damaged("step", state_.step, "differs from the step its directory's name says (" + checkpoint_name(named) + ")");
  if (state_.seq_len > max_saved_seq_len || state_.warmup_seq_len > max_saved_seq_len)
    damaged("seq_len", std::max(state_.seq_len, state_.warmup_seq_len), "is beyond the 2^30 tokens a run trains");
  if (state_.batch > max_saved_batch) damaged("batch", state_.batch, "is beyond the 65536 sequences a step takes");
  if (shape_recorded_ && state_.batch < 1) damaged("batch", state_.batch, "must be at least 1 (a step's sequences)");
  if (shape_recorded_ && state_.seq_len < 1) damaged("seq_len", state_.seq_len, "must be at least 1 (a sequence's tokens)");
  for (std::size_t u = 0; u < impl_->units.size(); ++u)
    if (impl_->units[u] < 0 || impl_->units[u] > max_saved_unit)
      damaged("units[" + std::to_string(u) + "]", impl_->units[u], "must lie between 0 and 2^40 parameters");
}

void saved_state::check_units(const model_config& config, const lora_config& lora) const {
  std::vector<std::int64_t> sizes;
  if (lora.enabled()) {
    // The adapters' units: none in the embedding's and the head's, a layer's in each layer's.
    sizes.assign(static_cast<std::size_t>(config.num_layers) + 2, 0);
    for (int l = 0; l < config.num_layers; ++l) sizes[1 + l] = lora_layer_parameter_count(config, lora, l);
  } else {
    for (const auto& unit : parameter_units(config)) {
      std::int64_t n = 0;
      for (const auto& p : unit) n += p.numel;
      sizes.push_back(n);
    }
  }
  const bool same = sizes == impl_->units;
  const auto sum = [](const std::vector<std::int64_t>& v) { return std::accumulate(v.begin(), v.end(), std::int64_t{0}); };
  if (!same && !lora.enabled() && config.sparse_layer_count() > 0 && sum(sizes) == sum(impl_->units))
    throw config_error("cannot resume " + config.name + " from " + dir_ + ": it was saved by an upipe that kept a "
                       "sparse layer's experts in the layer's unit (before expert parallelism); start from its weights "
                       "with --init " + dir_ + " (the optimizer state starts afresh)");
  if (!same)
    throw config_error("cannot resume " + config.name + " from " + dir_ +
                       ": its trainer state holds parameter units of another model; pass that model (--model " + dir_ + ")");
  if (!lora.enabled()) impl_->layout = parameter_units(config);  // the adapters' values are named by unit alone
}

void saved_state::bad_value(int unit, shard_state which, std::int64_t rank, std::int64_t element, float value) const {
  static const char* kind[] = {"the master weights",           "AdamW's first moment",
                               "AdamW's second moment",        "the master weights' compensation",
                               "the first moment's block absmax", "the second moment's block absmax"};
  std::string where = std::string(kind[static_cast<int>(which)]) + ", tensor " + tensor_name(unit, which) + " (element " +
                      std::to_string(element) + ")";
  if (static_cast<std::size_t>(unit) < impl_->layout.size() && !is_absmax(which))
    for (const unit_parameter& p : impl_->layout[static_cast<std::size_t>(unit)])
      if (element >= p.offset && element < p.offset + p.numel)
        where = std::string(kind[static_cast<int>(which)]) + " of " + p.name + " (element " +
                std::to_string(element - p.offset) + ", tensor " + tensor_name(unit, which) + ")";
  const std::string file = (fs::path(dir_) / trainer_dir / rank_file(static_cast<int>(rank), ranks_)).string();
  if (std::isfinite(value))
    throw io_error(file + " holds " + std::to_string(value) + " in " + where + ", which is never negative in a state "
                   "a run wrote: the trainer state is damaged; restore the checkpoint, or start from an earlier one");
  throw io_error(file + " holds " + (std::isnan(value) ? std::string("NaN") : std::string(value > 0 ? "+Inf" : "-Inf")) +
                 " in " + where + ": the trainer state is damaged or the run that wrote it diverged; restore the "
                 "checkpoint, or start from an earlier one");
}

void saved_state::read(int unit, shard_state which, std::int64_t begin, std::int64_t count, float* out) const {
  const bool blocks = is_absmax(which);
  UPIPE_CHECK(unit >= 0 && unit < static_cast<int>(impl_->units.size()) && begin >= 0, "saved_state::read outside unit");
  const std::int64_t length = blocks ? (impl_->units[unit] + q8_block - 1) / q8_block : impl_->units[unit];
  UPIPE_CHECK(begin + count <= length, "saved_state::read outside unit " + std::to_string(unit));
  const auto present = state_tensors(format_);
  UPIPE_CHECK(std::find(present.begin(), present.end(), which) != present.end(),
              std::string("saved_state::read of ") + state_name(which) + ", which this format has not");
  const std::int64_t shard = blocks ? impl_->shards[unit] / q8_block : impl_->shards[unit];
  const std::string name = tensor_name(unit, which);
  // An expert unit saved under expert parallelism: its EP blocks, each over its own files.
  const bool by_blocks = impl_->expert_unit[static_cast<std::size_t>(unit)] && impl_->expert_parallel > 1;
  const std::int64_t block = by_blocks ? length / impl_->expert_parallel : length;
  while (count > 0) {
    const std::int64_t b = begin / block, within = begin % block;
    const std::int64_t offset = within % shard, n = std::min({count, shard - offset, block - within});
    const std::int64_t r = by_blocks ? impl_->expert_files[static_cast<std::size_t>(b)][static_cast<std::size_t>(within / shard)]
                                     : begin / shard;
    impl_->ranks[r].read(name, offset, n, out);
    // A second moment (a mean of squares) and a block's absmax (a largest magnitude) are
    // never negative in a state a run wrote.
    const bool signless = which == shard_state::exp_avg_sq || blocks;
    const float* bad = std::find_if(out, out + n, [&](float v) { return !std::isfinite(v) || (signless && v < 0); });
    if (bad != out + n) bad_value(unit, which, r, begin + (bad - out), *bad);
    begin += n;
    count -= n;
    out += n;
  }
}

void check_same_model(const model_config& s, const model_config& c, const std::string& dir) {
  const bool same = s.family == c.family && s.vocab_size == c.vocab_size && s.hidden_size == c.hidden_size &&
                    s.intermediate_size == c.intermediate_size && s.num_layers == c.num_layers &&
                    s.num_heads == c.num_heads && s.num_kv_heads == c.num_kv_heads && s.head_dim == c.head_dim &&
                    s.tie_embeddings == c.tie_embeddings && s.biases == c.biases;
  if (!same)
    throw config_error("cannot resume " + c.name + " from " + dir + ": that checkpoint is of another model (L=" +
                       std::to_string(s.num_layers) + " D=" + std::to_string(s.hidden_size) + " H=" +
                       std::to_string(s.num_heads) + " V=" + std::to_string(s.vocab_size) +
                       "); pass its configuration (--model " + dir + ")");
}

namespace {

// Writes an export's directory: `fill` writes into a temporary beside OUT, which then
// replaces OUT (absent or empty); nothing is left behind when it throws.
void write_export(const std::string& out_text, const std::function<void(const fs::path& tmp)>& fill) {
  const fs::path out = resolve_checkpoint_dir(out_text);
  std::error_code ec;
  if (fs::exists(out, ec) && (!fs::is_directory(out, ec) || !fs::is_empty(out, ec)))
    throw io_error("refusing to export into " + out.string() + ": it exists and is not empty; name a new directory");
  make_parent_directories(out.string(), "the export");  // out/NAME in a fresh directory
  const fs::path tmp = out.string() + tmp_suffix;
  remove_save_leftovers(out);  // what a killed export left
  if (!fs::create_directory(tmp, ec)) throw io_error("cannot create " + tmp.string() + ": " + ec.message());
  try {
    fill(tmp);
    fsync_path(tmp, true);
    fs::remove(out, ec);  // an empty directory
    if (std::rename(tmp.c_str(), out.c_str()) != 0)
      throw io_error("cannot move the export into " + out.string() + ": " + std::strerror(errno));
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

}  // namespace

std::string export_checkpoint(const std::string& given, const std::string& out_text, const hf_save_options& options) {
  const std::string checkpoint_dir = resolve_checkpoint(given);  // a run directory: its latest
  if (is_adapter_directory(checkpoint_dir))
    throw config_error(checkpoint_dir + " is a LoRA adapter directory, not a model: merge it into the base it was "
                       "trained on with upipe export BASE " + out_text + " --merge-adapter " + checkpoint_dir);
  const saved_state saved(checkpoint_dir);
  const model_config config = read_hf_config(saved.dir());
  saved.check_units(config);
  write_export(out_text, [&](const fs::path& tmp) {
    hf_model_writer writer(tmp.string(), config, options);
    const auto units = parameter_units(config);
    for (const auto& [u, p] : in_model_order(config, units)) {
      std::vector<float> values(static_cast<std::size_t>(p->numel));
      saved.read(u, shard_state::master, p->offset, p->numel, values.data());  // checks finiteness
      if (saved.state_format().master == master_format::bf16_kahan) {  // the weights plus their compensation
        std::vector<float> comp(values.size());
        saved.read(u, shard_state::master_comp, p->offset, p->numel, comp.data());
        for (std::size_t i = 0; i < values.size(); ++i) values[i] += comp[i];
      }
      writer.write(p->name, values);
    }
    writer.commit();
    write_hf_config(config, (tmp / "config.json").string(), saved.dir(), hf_dtype_name(options.type));
    copy_companion_files(saved.dir(), tmp.string());
  });
  return saved.dir();
}

std::string merge_adapter(const std::string& base_dir, const std::string& given_adapter, const std::string& out_text,
                          const hf_save_options& options) {
  const std::string adapter_dir = resolve_checkpoint(given_adapter);  // a LoRA run directory: its latest
  if (!is_model_directory(base_dir))
    throw io_error("cannot merge into " + base_dir + ": it is not a model directory (config.json and weights); pass "
                   "the base model directory the adapter was trained on");
  if (!is_adapter_directory(adapter_dir))
    throw io_error("--merge-adapter " + adapter_dir + " holds no " + adapter_config_file +
                   ": pass a LoRA adapter directory (upipe train --lora ... --save, or PEFT's save_pretrained)");
  const model_config config = read_hf_config(base_dir);
  const adapter_settings settings = read_adapter_config(adapter_dir, config);
  host_weights adapters = read_adapter_weights(adapter_dir, config, settings.lora);  // GEMM operands: not const
  const hf_model_files base(base_dir, config);
  const float scale = settings.lora.scale();
  write_export(out_text, [&](const fs::path& tmp) {
    hf_model_writer writer(tmp.string(), config, options);
    for (const parameter_spec& spec : parameter_specs(config)) {
      std::int64_t numel = 1;
      for (std::int64_t d : spec.shape) numel *= d;
      std::vector<float> w(static_cast<std::size_t>(numel));
      base.read(spec.name, 0, numel, w.data());
      const std::string stem = spec.name.substr(0, spec.name.size() - std::string(".weight").size());
      const auto a = spec.kind == param_kind::matrix ? adapters.find(stem + ".lora_A.weight") : adapters.end();
      if (a != adapters.end()) {
        // W (out, in) += s B (out, r) A (r, in), in fp32 with the cpu backend's GEMM.
        std::vector<float>& b = adapters.at(stem + ".lora_B.weight");
        const std::int64_t out = spec.shape[0], in = spec.shape[1], r = settings.lora.rank;
        cpu::run(gemm_args{{b.data(), dtype::f32, out, r, r}, transpose::none,
                           {a->second.data(), dtype::f32, r, in, in}, transpose::none,
                           {w.data(), dtype::f32, out, in, in}, scale, 1.0f});
      }
      writer.write(spec.name, w);
    }
    writer.commit();
    write_hf_config(config, (tmp / "config.json").string(), base_dir, hf_dtype_name(options.type));
    copy_companion_files(base_dir, tmp.string());
  });
  return adapter_dir;
}

}  // namespace upipe
