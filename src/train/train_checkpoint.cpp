#include "train/train_checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "train/safetensors.hpp"

namespace upipe {

namespace fs = std::filesystem;

namespace {

constexpr const char* state_file = "trainer_state.json";

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

void write_moments(const fs::path& path, const model_config& config, const train_checkpoint& c) {
  std::vector<safetensors_tensor> tensors;
  for (const parameter_spec& p : parameter_specs(config)) {
    tensors.push_back({p.name + ".exp_avg", p.shape, c.exp_avg.at(p.name), dtype::f32});
    tensors.push_back({p.name + ".exp_avg_sq", p.shape, c.exp_avg_sq.at(p.name), dtype::f32});
  }
  write_safetensors(path.string(), tensors, {{"format", "upipe-adamw"}});
}

void write_all(const fs::path& tmp, const train_checkpoint& c) {
  write_hf_config(c.config, (tmp / "config.json").string());
  fsync_path(tmp / "config.json", false);
  write_weights(c.config, c.weights, (tmp / "model.safetensors").string(), dtype::f32);
  write_moments(tmp / "optimizer.safetensors", c.config, c);
  const nlohmann::json state = {{"format", 1},           {"step", c.state.step},   {"data_position", c.state.data_position},
                                {"seed", c.state.seed},  {"total_steps", c.state.total_steps},
                                {"data", c.state.data},  {"model", c.config.name}};
  write_text(tmp / state_file, state.dump(2) + "\n");
  fsync_path(tmp, true);
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

}  // namespace

void save_train_checkpoint(const std::string& dir_text, const train_checkpoint& c) {
  const fs::path dir = fs::absolute(dir_text);
  std::error_code ec;
  if (fs::exists(dir, ec) && (!fs::is_directory(dir) || (!fs::is_empty(dir) && !fs::exists(dir / state_file))))
    throw io_error("refusing to write a checkpoint over " + dir.string() +
                   ": it exists and is not an upipe checkpoint; choose another --save directory");
  const fs::path tmp = dir.string() + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec))
    throw io_error("cannot create " + tmp.string() + " for the checkpoint: " + ec.message() +
                   " (is the parent directory there and writable?)");
  try {
    write_all(tmp, c);
    publish(tmp, dir);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

train_checkpoint load_train_checkpoint(const std::string& dir_text, const model_config& config) {
  const fs::path dir(dir_text);
  if (!fs::exists(dir / state_file))
    throw io_error("cannot resume from " + dir.string() + ": it holds no " + state_file +
                   " (is it a directory written by upipe train --save?)");
  train_checkpoint c;
  c.config = read_hf_config((dir / "config.json").string());
  const bool same = c.config.family == config.family && c.config.vocab_size == config.vocab_size &&
                    c.config.hidden_size == config.hidden_size && c.config.intermediate_size == config.intermediate_size &&
                    c.config.num_layers == config.num_layers && c.config.num_heads == config.num_heads &&
                    c.config.num_kv_heads == config.num_kv_heads && c.config.head_dim == config.head_dim &&
                    c.config.tie_embeddings == config.tie_embeddings;
  if (!same)
    throw config_error("cannot resume " + config.name + " from " + dir.string() + ": that checkpoint is of another model (L=" +
                       std::to_string(c.config.num_layers) + " D=" + std::to_string(c.config.hidden_size) + " H=" +
                       std::to_string(c.config.num_heads) + " V=" + std::to_string(c.config.vocab_size) +
                       "); pass its configuration (--config " + (dir / "config.json").string() + ")");
  c.config.name = config.name;
  c.weights = read_weights(config, (dir / "model.safetensors").string());
  safetensors_file moments = read_safetensors((dir / "optimizer.safetensors").string());
  for (const parameter_spec& p : parameter_specs(config))
    for (auto [suffix, target] : {std::pair{".exp_avg", &c.exp_avg}, std::pair{".exp_avg_sq", &c.exp_avg_sq}}) {
      auto it = moments.tensors.find(p.name + suffix);
      if (it == moments.tensors.end() || it->second.shape != p.shape)
        throw io_error(dir.string() + "/optimizer.safetensors lacks " + p.name + suffix + " of the right shape");
      target->emplace(p.name, std::move(it->second.values));
    }
  std::ifstream in(dir / state_file);
  try {
    const auto j = nlohmann::json::parse(in);
    c.state = {j.at("step").get<std::int64_t>(), j.at("data_position").get<std::int64_t>(),
               j.at("seed").get<std::uint64_t>(), j.at("total_steps").get<std::int64_t>(), j.at("data").get<std::string>()};
  } catch (const nlohmann::json::exception& e) {
    throw io_error("cannot read " + (dir / state_file).string() + ": " + e.what());
  }
  return c;
}

}  // namespace upipe
