#include "train/run_directory.hpp"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/files.hpp"
#include "model/adapter_files.hpp"

namespace upipe {

namespace fs = std::filesystem;

namespace {

constexpr const char* prefix = "checkpoint-";
constexpr const char* manifest_path = "trainer/manifest.json";

bool is_checkpoint_dir(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(dir / manifest_path, ec);
}

// N of "checkpoint-N", or -1.
std::int64_t step_of(const std::string& name) {
  if (name.rfind(prefix, 0) != 0) return -1;
  const std::string digits = name.substr(std::string(prefix).size());
  std::int64_t step = -1;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  return ec == std::errc() && end == digits.data() + digits.size() && step >= 0 ? step : -1;
}

nlohmann::json read_manifest(const fs::path& checkpoint) {
  try {
    return nlohmann::json::parse(read_text_file((checkpoint / manifest_path).string(), "the trainer state's manifest"));
  } catch (const nlohmann::json::exception&) {
    return nlohmann::json::object();
  } catch (const io_error&) {
    return nlohmann::json::object();
  }
}

std::string pointer(const fs::path& dir, const char* name) {
  std::error_code ec;
  if (!fs::exists(dir / name, ec)) return "";
  std::string text = read_text_file((dir / name).string(), std::string("the run directory's ") + name, 4096);
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

void write_pointer(const fs::path& dir, const char* name, const std::string& target) {
  write_file_atomically((dir / name).string(), target + "\n", std::string("the run directory's ") + name);
}

// The adapter files a LoRA run directory's root links to, for loaders that read a directory
// as given (PeftModel.from_pretrained(base, "run1")).
constexpr const char* root_adapter_files[] = {adapter_config_file, adapter_weights_file};

// DIR/FILE made a relative symbolic link to `target` (checkpoint-N/FILE), atomically: a
// link made under a temporary name, then renamed over the old one.
void link_atomically(const fs::path& dir, const std::string& file, const std::string& target) {
  const fs::path link = dir / file;
  remove_stale_temporaries(link.string());
  const fs::path tmp = dir / (file + ".tmp-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::remove(tmp, ec);
  fs::create_symlink(target, tmp, ec);
  if (!ec) fs::rename(tmp, link, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw io_error("cannot link " + link.string() + " to " + target + ": " + ec.message());
  }
}

// The run directory's root adapter links follow its newest checkpoint: links to its adapter
// files when it is an adapter directory, none otherwise (a full run saved over a LoRA run's
// directory). A regular file of that name is the user's, left alone and said once.
void update_root_adapter_links(const fs::path& dir, const std::string& checkpoint) {
  for (const char* file : root_adapter_files) {
    const fs::path link = dir / file;
    std::error_code ec;
    const bool ours = fs::is_symlink(link, ec), there = ours || fs::exists(link, ec);
    if (there && !ours) {
      std::fprintf(stderr, "upipe: warning: %s is not a link upipe made; it is left as it is (remove it to have the "
                   "run directory load as its latest adapter)\n", link.string().c_str());
      continue;
    }
    if (fs::exists(dir / checkpoint / file, ec))
      link_atomically(dir, file, checkpoint + "/" + file);
    else if (ours)
      fs::remove(link, ec);
  }
}

}  // namespace

std::string checkpoint_name(std::int64_t step) { return prefix + std::to_string(step); }

std::int64_t step_in_name(const std::string& checkpoint_dir) {
  fs::path p = fs::path(checkpoint_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return step_of(p.filename().string());
}

std::string run_directory_of(const std::string& checkpoint_dir) {
  if (step_in_name(checkpoint_dir) < 0) return "";
  fs::path p = fs::path(checkpoint_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.parent_path().string();
}

bool is_run_directory(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return false;
  if (fs::exists(fs::path(path) / "latest", ec)) return true;
  for (const auto& entry : fs::directory_iterator(path, ec))
    if (step_of(entry.path().filename().string()) >= 0 && is_checkpoint_dir(entry.path())) return true;
  return false;
}

namespace {

// The checkpoint a pointer file (DIR/latest, DIR/best) names, or "" when `path` is no
// pointer: a small regular file in a run directory.
std::string pointed_checkpoint(const fs::path& path) {
  std::error_code ec;
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  if (!fs::is_regular_file(path, ec) || fs::file_size(path, ec) > 4096 || !is_run_directory(dir.string())) return "";
  const std::string file = path.filename().string(), name = pointer(dir, file.c_str());
  if (file != "latest" && file != "best" && step_of(name) < 0) return "";  // another file of the run directory
  if (step_of(name) < 0 || !is_checkpoint_dir(dir / name))
    throw io_error(path.string() + " names '" + name + "', which is not a complete checkpoint in " + dir.string() +
                   ": name one of its checkpoint-N directories instead (ls " + dir.string() + ")");
  return (dir / name).string();
}

// A checkpoint being removed: renamed to ".checkpoint-N.removed-upipe" first, so that a kill
// during the removal leaves no half checkpoint under its name, and the next save finishes
// what it left.
constexpr const char* trash_suffix = ".removed-upipe";

bool is_trash(const std::string& name) {
  return name.rfind(std::string(".") + prefix, 0) == 0 && name.ends_with(trash_suffix);
}

void remove_all_quietly(const fs::path& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
}

void remove_checkpoint(const fs::path& dir, const std::string& name) {
  const fs::path trash = dir / ("." + name + trash_suffix);
  std::error_code ec;
  fs::remove_all(trash, ec);  // a leftover of the same name
  fs::rename(dir / name, trash, ec);
  if (!ec) fs::remove_all(trash, ec);
  if (ec) throw io_error("cannot remove the old checkpoint " + (dir / name).string() + ": " + ec.message());
}

}  // namespace

std::string resolve_checkpoint(const std::string& path) {
  if (path.empty() || is_checkpoint_dir(path)) return path;
  if (const std::string pointed = pointed_checkpoint(fs::path(path)); !pointed.empty()) return pointed;
  std::error_code ec;
  if (!fs::is_directory(path, ec) || !fs::exists(fs::path(path) / "latest", ec)) return path;
  const std::string latest = pointed_checkpoint(fs::path(path) / "latest");
  if (latest.empty())
    throw io_error(path + "/latest is not a file naming one of its checkpoints (upipe writes \"checkpoint-N\"): "
                   "name a checkpoint-N directory instead (ls " + path + ")");
  return latest;
}

std::string new_run_id() {
  std::random_device device;
  char text[33];
  std::snprintf(text, sizeof text, "%08x%08x%08x%08x", device(), device(), device(), device());
  return text;
}

std::int64_t checkpoint_step(const std::string& checkpoint_dir) {
  const nlohmann::json m = read_manifest(checkpoint_dir);
  return m.is_object() && m.contains("step") && m["step"].is_number_integer() ? m["step"].get<std::int64_t>() : 0;
}

std::string checkpoint_run_id(const std::string& checkpoint_dir) {
  const nlohmann::json m = read_manifest(checkpoint_dir);
  return m.is_object() && m.contains("run_id") && m["run_id"].is_string() ? m["run_id"].get<std::string>() : "";
}

std::vector<saved_checkpoint> list_checkpoints(const std::string& dir) {
  std::vector<saved_checkpoint> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const std::int64_t step = step_of(name);
    if (step < 0 || !is_checkpoint_dir(entry.path())) continue;
    saved_checkpoint c{name, step, "", std::nullopt};
    const nlohmann::json m = read_manifest(entry.path());
    if (m.is_object() && m.contains("run_id") && m["run_id"].is_string()) c.run_id = m["run_id"].get<std::string>();
    if (m.is_object() && m.contains("eval_loss") && m["eval_loss"].is_number()) c.eval_loss = m["eval_loss"].get<double>();
    out.push_back(c);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

void make_run_directory(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw io_error("cannot save into " + dir + ": cannot make the directory (" + ec.message() +
                   "); choose another --save directory");
}

void remove_unfinished_saves(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if ((name.rfind(prefix, 0) == 0 && name.ends_with(".tmp-upipe")) || is_trash(name)) fs::remove_all(entry.path(), ec);
  }
  remove_stale_temporaries((fs::path(dir) / "latest").string());
  remove_stale_temporaries((fs::path(dir) / "best").string());
  for (const char* file : root_adapter_files) remove_stale_temporaries((fs::path(dir) / file).string());
}

std::vector<std::string> check_run_directory(const std::string& dir, const std::string& run_id, bool overwrite,
                                             std::int64_t resumed_step) {
  std::error_code ec;
  const fs::path path(dir);
  if (!fs::exists(path, ec)) {
    // make_run_directory makes it with its missing parents (mkdir -p) in the nearest
    // directory that exists.
    fs::path existing = path.parent_path();
    while (!fs::exists(existing, ec) && existing.has_parent_path() && existing != existing.parent_path())
      existing = existing.parent_path();
    if (!fs::is_directory(existing, ec))
      throw io_error("cannot save into " + dir + ": " + existing.string() + " is not a directory; choose another "
                     "--save directory");
    return {};
  }
  if (!fs::is_directory(path, ec))
    throw io_error("refusing to save into " + dir + ": it exists and is not a directory; choose another --save "
                   "directory");
  if (::access(path.c_str(), W_OK) != 0)
    throw io_error("cannot save into " + dir + ": it is not writable; choose another --save directory");
  remove_unfinished_saves(dir);  // a killed save's temporaries are this layout's own: cleared first
  if (is_checkpoint_dir(path))
    throw io_error("refusing to save into " + dir + ": it is a single checkpoint (trainer/ at its top, the layout "
                   "before run directories), which --save would mix with numbered ones; resume it with --resume " +
                   dir + " and save into a new directory, e.g. --save " + dir + "-run");
  if (!fs::is_empty(path, ec) && !is_run_directory(dir))
    throw io_error("refusing to write checkpoints into " + dir +
                   ": it is neither empty nor a run directory of upipe checkpoints; choose another --save directory");
  std::vector<std::string> notes;
  std::vector<std::string> others, later;
  for (const saved_checkpoint& c : list_checkpoints(dir)) {
    if (c.run_id != run_id)
      others.push_back(c.name);
    else if (c.step > resumed_step)
      later.push_back(c.name);
  }
  if (!others.empty() && !overwrite)
    throw io_error("refusing to save into " + dir + ": it holds another run's checkpoints (" + others.front() +
                   (others.size() > 1 ? " and " + std::to_string(others.size() - 1) + " more" : std::string()) +
                   "); continue that run with --resume " + dir + ", choose another --save directory, or pass "
                   "--overwrite to remove them once this run's first checkpoint is complete");
  if (!others.empty())
    notes.push_back("--overwrite: " + std::to_string(others.size()) + " checkpoint(s) of another run in " + dir +
                    " will be removed once this run's first checkpoint is complete");
  if (!later.empty())
    notes.push_back(dir + " holds this run's checkpoints past step " + std::to_string(resumed_step) + " (" +
                    later.front() + (later.size() > 1 ? ", ..." : "") +
                    "): each is replaced when the resumed run saves that step again");
  return notes;
}

std::vector<std::string> publish_checkpoint(const std::string& dir, std::int64_t step, const std::string& run_id,
                                            const rotation& keep) {
  const fs::path path(dir);
  write_pointer(path, "latest", checkpoint_name(step));
  update_root_adapter_links(path, checkpoint_name(step));
  const std::vector<saved_checkpoint> all = list_checkpoints(dir);
  std::vector<saved_checkpoint> ours;
  for (const saved_checkpoint& c : all)
    if (c.run_id == run_id) ours.push_back(c);
  std::string best;
  if (keep.keep_best) {
    std::optional<double> lowest;
    for (const saved_checkpoint& c : ours)
      if (c.eval_loss && (!lowest || *c.eval_loss < *lowest)) {
        lowest = c.eval_loss;
        best = c.name;
      }
    if (!best.empty()) write_pointer(path, "best", best);
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(path, ec))  // what a killed removal left
    if (is_trash(entry.path().filename().string())) remove_all_quietly(entry.path());
  std::vector<std::string> removed;
  // The new checkpoint is complete whatever happens here: a removal that fails is said, and
  // the next save tries again.
  const auto remove = [&](const std::string& name) {
    try {
      remove_checkpoint(path, name);
      removed.push_back(name);
    } catch (const io_error& e) {
      std::fprintf(stderr, "upipe: warning: %s; the next save tries again\n", e.what());
    }
  };
  if (keep.overwrite)
    for (const saved_checkpoint& c : all)
      if (c.run_id != run_id) remove(c.name);
  if (keep.keep_last > 0 && static_cast<std::int64_t>(ours.size()) > keep.keep_last)
    for (std::size_t i = 0; i + static_cast<std::size_t>(keep.keep_last) < ours.size(); ++i)
      if (ours[i].name != best && ours[i].step != step) remove(ours[i].name);
  return removed;
}

}  // namespace upipe
