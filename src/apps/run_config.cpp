#include "apps/run_config.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <limits>
#include <sstream>

#include <toml++/toml.h>

#include "apps/flag_checks.hpp"
#include "apps/sizes.hpp"
#include "core/error.hpp"
#include "train/data_reader.hpp"
#include "core/files.hpp"
#include "cp/strategy_table.hpp"

namespace upipe::apps {

namespace {

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// The shortest text that reads back as the same double.
std::string real_text(double v) {
  char buffer[64];
  const auto [end, ec] = std::to_chars(buffer, buffer + sizeof buffer, v, std::chars_format::general);
  std::string t(buffer, ec == std::errc() ? end : buffer);
  // TOML needs a fraction or an exponent in a float.
  if (t.find_first_of(".eEn") == std::string::npos) t += ".0";
  return t;
}

std::string toml_string(const std::string& s) {
  std::ostringstream out;
  out << toml::value<std::string>(s);
  return out.str();
}

// The line of a TOML node, for messages.
std::string where(const std::string& origin, const toml::node& node) {
  const auto& begin = node.source().begin;
  return origin + (begin.line > 0 ? ":" + std::to_string(begin.line) : std::string());
}

// Sets a field from a TOML value of its type; config_error naming the key otherwise.
void set_field(const field_ref& field, const toml::node& node, const std::string& key, const std::string& at) {
  const auto refuse = [&](const char* expected) {
    throw config_error(at + ": " + key + " must be " + expected + " (as the flag " + find_row(key)->flag +
                       " takes it)");
  };
  const auto integer = [&](std::int64_t lo, std::int64_t hi) -> std::int64_t {
    const auto v = node.value_exact<std::int64_t>();
    if (!v) refuse("a whole number");
    if (*v < lo || *v > hi)
      throw config_error(at + ": " + key + " = " + std::to_string(*v) + " lies outside [" + std::to_string(lo) + ", " +
                         std::to_string(hi) + "]");
    return *v;
  };
  const auto real = [&]() -> double {
    const auto v = node.value<double>();  // an integer is a number too
    if (!v || !std::isfinite(*v)) refuse("a finite number");
    return *v;
  };
  std::visit(
      [&](auto* target) {
        using T = std::remove_pointer_t<decltype(target)>;
        if constexpr (std::is_same_v<T, std::string>) {
          // Counts and sizes may be written as numbers too: seq_len = 131072.
          if (const auto s = node.value_exact<std::string>())
            *target = *s;
          else if (const auto n = node.value_exact<std::int64_t>())
            *target = std::to_string(*n);
          else
            refuse("a string");
          if (target->empty()) refuse("a non-empty string (leave the key out for the default)");
        } else if constexpr (std::is_same_v<T, bool>) {
          const auto v = node.value_exact<bool>();
          if (!v) refuse("true or false");
          *target = *v;
        } else if constexpr (std::is_same_v<T, int>) {
          *target = static_cast<int>(integer(std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
        } else if constexpr (std::is_same_v<T, std::int64_t>) {
          *target = integer(std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max());
        } else if constexpr (std::is_same_v<T, std::uint64_t>) {
          *target = static_cast<std::uint64_t>(integer(0, std::numeric_limits<std::int64_t>::max()));
        } else if constexpr (std::is_same_v<T, double> || std::is_same_v<T, std::optional<double>>) {
          *target = real();
        } else {
          *target = integer(std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max());
        }
      },
      field);
}

std::vector<std::string> every_key() {
  std::vector<std::string> keys;
  for (const option_row& row : option_rows()) keys.emplace_back(row.key);
  return keys;
}

// Copies one option from `from` into `to`.
void copy_field(const option_row& row, run_config& from, run_config& to) {
  std::visit(
      [&](auto* target) {
        using P = std::remove_cvref_t<decltype(target)>;
        *target = *std::get<P>(row.field(from));
      },
      row.field(to));
}


// A value as a message shows it: a long one cut, its length said.
std::string shown(const std::string& value) {
  if (value.size() <= 80) return value;
  return value.substr(0, 60) + "... (" + std::to_string(value.size()) + " characters)";
}

// A bound as a message shows it: whole numbers in full (1000000000, not 1e+09).
std::string bound_text(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 0x1p62)
    return std::to_string(static_cast<std::int64_t>(v));
  return real_text(v);
}

// The range of a rule in words: "must lie between 1 and 1000000000".
std::string range_text(const value_rule& r) {
  const bool top = std::isfinite(r.hi);
  std::string text;
  if (r.above)
    text = top ? "must lie in (" + bound_text(r.lo) + ", " + bound_text(r.hi) + "]"
               : (r.lo == 0 ? "must be positive" : "must be above " + bound_text(r.lo));
  else
    text = top ? "must lie between " + bound_text(r.lo) + " and " + bound_text(r.hi)
               : (r.lo == 0 ? "must be 0 or more" : "must be at least " + bound_text(r.lo));
  return r.minus_one ? "must be -1 (the run chooses) or " + text.substr(5) : text;
}

void check_path_text(const std::string& value, const std::string& flag) {
  const std::string problem = path_problem(value);
  if (!problem.empty())
    throw config_error(flag + " " + shown(value) + " " + problem + ": give the file's real path (for example " +
                       flag + " run.toml)");
}

std::vector<std::string> split(const std::string& text, const std::string& by) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t at = text.find(by, start);
    out.push_back(text.substr(start, at - start));
    if (at == std::string::npos) return out;
    start = at + by.size();
  }
}

}  // namespace

std::string version_text() {
  std::string text = std::string("upipe ") + UPIPE_VERSION;
#ifdef UPIPE_HAVE_CUDA
  text += " (backends: cpu, meta, cuda";
#else
  text += " (backends: cpu, meta";
#endif
#ifdef NDEBUG
  text += "; release build)";
#else
  text += "; debug build)";
#endif
  return text;
}

const char* source_name(value_source source) {
  switch (source) {
    case value_source::demo_default: return "default";
    case value_source::fine_tune_default: return "fine-tune default";
    case value_source::derived: return "derived";
    case value_source::checkpoint: return "checkpoint";
    case value_source::file: return "config file";
    case value_source::flag: return "flag";
  }
  return "?";
}

std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  std::size_t best_distance = std::max<std::size_t>(2, word.size() / 3) + 1;
  for (const std::string& c : candidates) {
    const std::size_t d = edit_distance(word, c);
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  return best;
}

std::string value_text(run_config& config, const option_row& row) {
  return std::visit(
      [](auto* v) -> std::string {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return v->empty() ? std::string() : toml_string(*v);
        } else if constexpr (std::is_same_v<T, bool>) {
          return *v ? "true" : "false";
        } else if constexpr (std::is_same_v<T, double>) {
          return real_text(*v);
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          return *v ? real_text(**v) : std::string();
        } else if constexpr (std::is_same_v<T, std::optional<std::int64_t>>) {
          return *v ? std::to_string(**v) : std::string();
        } else {
          return std::to_string(*v);
        }
      },
      row.field(config));
}

std::map<std::string, int> read_toml(const std::string& text, const std::string& origin, run_config& config) {
  toml::table table;
  try {
    table = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    throw config_error(origin + ":" + std::to_string(e.source().begin.line) + ":" +
                       std::to_string(e.source().begin.column) + ": not valid TOML: " + std::string(e.description()));
  }
  std::map<std::string, int> keys;
  for (const auto& [section, node] : table) {
    const std::string name(section.str());
    const toml::table* inner = node.as_table();
    if (inner == nullptr)
      throw config_error(where(origin, node) + ": '" + name + "' must be a section ([model], [data], [eval], "
                         "[parallel], [optimizer], [checkpoint], [system], [metrics]) holding keys");
    for (const auto& [k, value] : *inner) {
      const std::string key = name + "." + std::string(k.str());
      const option_row* row = find_row(key);
      if (row == nullptr || key.find('.') != key.rfind('.')) {
        const std::string near = closest(key, every_key());
        throw config_error(where(origin, value) + ": '" + key + "' is not an option" +
                           (near.empty() ? std::string() : "; did you mean '" + near + "'?") +
                           " (upipe train --print-config shows every key)");
      }
      set_field(row->field(config), value, key, where(origin, value));
      keys[key] = static_cast<int>(value.source().begin.line);
    }
  }
  return keys;
}

void check_value(run_config& config, const option_row& row, const std::string& where) {
  const value_rule& rule = row.rule;
  const std::string as_toml = value_text(config, row);
  if (as_toml.empty()) return;  // unset
  const bool text = std::holds_alternative<std::string*>(row.field(config));
  // As a flag writes it: the text itself, a number without TOML's ".0".
  const std::string plain = text                   ? *std::get<std::string*>(row.field(config))
                            : as_toml.ends_with(".0") ? as_toml.substr(0, as_toml.size() - 2)
                                                    : as_toml;
  const std::string key = row.key, name = key.substr(key.find('.') + 1);
  // From a flag: "--lr 0 must ..."; from a file: "FILE:LINE: optimizer.lr = 0.0 must ...".
  const std::string subject =
      where.empty() ? std::string(row.flag) + " " + shown(plain) : where + ": " + key + " = " + shown(as_toml);
  const auto refuse = [&](const std::string& what) {
    const std::string example = where.empty() ? std::string(row.flag) + " " + rule.example
                                              : name + " = " + (text ? toml_string(rule.example) : rule.example);
    throw config_error(subject + " " + what + " (" + (where.empty() ? "" : "the flag " + std::string(row.flag) + "; ") +
                       "for example " + example + ")");
  };
  if (row.path) {
    const bool list = key == "data.data" || key == "eval.data";  // sources, comma-separated
    for (const std::string& one : list ? split(plain, ",") : std::vector<std::string>{plain})
      if (const std::string problem = path_problem(one); !problem.empty()) refuse(problem);
  }
  if (rule.words != nullptr) {
    const std::vector<std::string> taken = split(rule.words, ", ");
    if (std::find(taken.begin(), taken.end(), plain) == taken.end())
      refuse(std::string("is not one of: ") + rule.words);
  }
  if (rule.parse != nullptr) {
    try {
      rule.parse(plain);
    } catch (const config_error& e) {
      const std::string message = e.what();
      throw config_error(where.empty() && message.rfind(std::string(row.flag) + " ", 0) == 0 ? message
                                                                                            : subject + ": " + message);
    }
  }
  if (text || std::holds_alternative<bool*>(row.field(config)) || !(std::isfinite(rule.lo) || std::isfinite(rule.hi)))
    return;
  const double v = std::stod(as_toml);
  if (rule.minus_one && v == -1) return;
  if (!((rule.above ? v > rule.lo : v >= rule.lo) && v <= rule.hi)) refuse(range_text(rule));
}

// The defaults a command keeps where they differ from train's (shown by its --help).
void command_defaults(run_config& c, unsigned command) {
  if (command == for_train || command == for_eval) c.model.clear();  // from --resume, --init or the adapter; else tiny-llama
  if (command == for_plan) c.model = "llama3-8b";
  if (command == for_plan || command == for_bench) c.zero = 3;
  if (command == for_step) c.seq_len = "256";
  if (command == for_eval) c.cp = 1;
}

run_options::run_options(CLI::App& app, unsigned command) : app_(app), command_(command) {
  command_defaults(config_, command);
  for (const option_row& row : option_rows()) {
    if (!takes(row)) continue;
    rows_.push_back(&row);
    CLI::Option* opt = std::visit(
        [&](auto* target) -> CLI::Option* {
          using T = std::remove_pointer_t<decltype(target)>;
          if constexpr (std::is_same_v<T, bool>)
            return app.add_flag(row.flag, *target, row.help);
          else
            return app.add_option(row.flag, *target, row.help);
        },
        row.field(config_));
    if (!row.switch_) opt->capture_default_str();
    // The strategies' help is their table's (cp/strategy_table.hpp), so a new row shows.
    if (std::string_view(row.key) == "parallel.attention") opt->description("the CP strategy: " + strategy_help());
    options_[row.key] = opt;
  }
  app.add_option("--config-file", config_file_,
                 "a TOML file of options ([model] model = ..., [optimizer] lr = ...; upipe train --print-config "
                 "writes one, and loads back as the same run); flags override it; a key the command does not "
                 "take is refused");
}

value_source run_options::source(const option_row& row) const {
  const auto it = sources_.find(row.key);
  return it == sources_.end() ? value_source::demo_default : it->second;
}

bool run_options::set_anywhere(const char* key) const {
  const auto it = sources_.find(key);
  return it != sources_.end() &&
         (it->second == value_source::flag || it->second == value_source::file || it->second == value_source::checkpoint);
}

bool run_options::from_user(const char* key) const {
  const auto it = sources_.find(key);
  return it != sources_.end() && (it->second == value_source::flag || it->second == value_source::file);
}

bool run_options::from_file(const char* key) const {
  const auto it = sources_.find(key);
  return it != sources_.end() && it->second == value_source::file;
}

bool run_options::reads_from_file(const option_row& row) const {
  return takes(row) || (command_ == for_plan && (row.commands & for_train) != 0);
}

// "FILE:LINE: KEY is not an option of upipe eval: only upipe train takes it (--keep-last)".
std::string not_taken(const option_row& row, unsigned command, const std::string& at, const std::string& file) {
  return at + ": " + row.key + " is not an option of upipe " + command_name(command) + ": only upipe " +
         command_names(row.commands) + (__builtin_popcount(row.commands) == 1 ? " takes" : " take") + " it (" +
         row.flag + ((row.commands & for_train) != 0 ? "; upipe plan reads it too, planning a train run" : "") +
         "); remove it from " + file + ", or give this file to a command that takes it";
}

void run_options::apply_flags_and_file() {
  for (const option_row* row : rows_)
    if (options_.at(row->key)->count() > 0) sources_[row->key] = value_source::flag;
  if (!config_file_.empty()) {
    check_path_text(config_file_, "--config-file");
    run_config from_file;
    const std::string text = read_text_file(config_file_, "--config-file");
    for (const auto& [key, line] : read_toml(text, config_file_, from_file)) {
      const option_row& row = *find_row(key);
      const std::string at = config_file_ + ":" + std::to_string(line);
      if (!reads_from_file(row)) throw config_error(not_taken(row, command_, at, config_file_));
      if (source(row) == value_source::flag) continue;  // a flag over it
      copy_field(row, from_file, config_);
      sources_[row.key] = value_source::file;
      origins_[row.key] = at;
    }
  }
  check_given_values();
}

// Every value a flag or the file gave, by its row's rule; a flag's first (a file's value
// under a flag was never taken).
void run_options::check_given_values() {
  for (const option_row& row : option_rows()) {
    const value_source s = source(row);
    if (s == value_source::flag) check_value(config_, row, "");
  }
  for (const option_row& row : option_rows())
    if (source(row) == value_source::file) check_value(config_, row, origins_.at(row.key));
}

int run_options::run(const std::function<int()>& body) {
  apply_flags_and_file();  // its refusals name their source already
  try {
    return body();
  } catch (const config_error& e) {
    throw config_error(explain(e.what()));
  }
}

namespace {

// The stored paths of a checkpoint that lies in `now`, a run directory other than the one it
// was saved into: those inside that one follow it (notes say so). Outside a run directory
// the stored run directory is not taken back.
void relocate_stored_paths(const std::vector<const option_row*>& rows, run_config& stored, const std::string& now,
                           bool save_given, std::vector<std::string>& notes) {
  std::string& saved_into = stored.save;
  if (saved_into.empty()) return;
  if (now.empty()) {
    if (save_given) return;
    notes.push_back("checkpoint.save: " + saved_into + " not taken, nor its save_every, keep_last and keep_best (the "
                    "checkpoint lies outside that run directory; --save DIR saves this run)");
    saved_into.clear();
    stored.save_every = 0;
    stored.keep_last = 0;
    stored.keep_best = false;
    return;
  }
  std::error_code ec;
  if (saved_into == now || std::filesystem::equivalent(saved_into, now, ec)) return;
  const std::string from = saved_into;
  for (const option_row* row : rows) {
    if (!row->path || row->key == std::string("data.data") || row->key == std::string("eval.data")) continue;
    std::string& value = *std::get<std::string*>(row->field(stored));
    if (value == from || value.starts_with(from + "/")) value = now + value.substr(from.size());
  }
  notes.push_back("the run directory " + now + " (it was saved into " + from + "; the paths inside it follow)");
  // A copy (the original is still there): a metrics file outside it is the original run's.
  const std::string& metrics = stored.metrics_json;
  if (std::filesystem::exists(from, ec) && !metrics.empty() && !metrics.starts_with(now + "/")) {
    notes.push_back("metrics.json: " + metrics + " not taken (the metrics of the run in " + from +
                    "); --metrics-json FILE writes this run's");
    stored.metrics_json.clear();
  }
}

}  // namespace

std::vector<std::string> run_options::apply_stored(const std::string& stored_text, const std::string& origin,
                                                   bool adapters, const std::string& run_directory) {
  run_config stored;
  const std::map<std::string, int> keys = read_toml(stored_text, origin, stored);
  std::vector<std::string> notes;
  relocate_stored_paths(rows_, stored, run_directory, set_anywhere("checkpoint.save"), notes);
  for (const option_row* row : rows_) {
    const on_resume kind =
        row->resume != on_resume::base ? row->resume : adapters ? on_resume::kept : on_resume::recorded;
    if (kind == on_resume::fresh || kind == on_resume::recorded) continue;
    const auto line = keys.find(row->key);
    const std::string was = line != keys.end() ? value_text(stored, *row) : std::string();
    if (!set_anywhere(row->key)) {
      copy_field(*row, stored, config_);
      sources_[row->key] = value_source::checkpoint;
      if (line == keys.end()) continue;
      origins_[row->key] = origin + ":" + std::to_string(line->second);
      check_value(config_, *row, origins_[row->key]);
      continue;
    }
    const std::string now = value_text(config_, *row);
    if (now == was) continue;
    const std::string shown = was.empty() ? "unset" : was;
    if (kind == on_resume::kept)
      throw config_error(std::string(row->flag) + " " + (now.empty() ? "(unset)" : now) + " differs from the run in " +
                         origin + ", which has " + row->key + " = " + shown + ": a resumed run continues that run; "
                         "drop " + row->flag + " (or give the stored value), or start a new run from its weights "
                         "with --init");
    notes.push_back(std::string(row->key) + ": " + shown + " -> " + (now.empty() ? "unset" : now) + " (" +
                    source_name(source(*row)) + ")");
  }
  return notes;
}

// --data and --eval-data list sources, each PATH or PATH:WEIGHT: each path resolved alone.
std::string absolute_data_sources(const std::string& text, const char* flag) {
  std::string out;
  for (data_source_spec source : parse_data_sources(text, flag)) {
    std::error_code ec;
    const auto absolute = std::filesystem::absolute(source.path, ec);
    if (!ec) source.path = absolute.lexically_normal().string();
    while (source.path.size() > 1 && source.path.back() == '/') source.path.pop_back();
    out += (out.empty() ? "" : ",") + data_source_text(source);
  }
  return out;
}

void run_options::resolve_paths() {
  for (const option_row* row : rows_) {
    if (!row->path) continue;
    std::string& value = *std::get<std::string*>(row->field(config_));
    if (row->key == std::string("data.data") || row->key == std::string("eval.data")) {
      value = absolute_data_sources(value, row->flag);
      continue;
    }
    // A preset's name stays a name.
    if (value.empty() || (row->key == std::string("model.model") && value.find('/') == std::string::npos &&
                          !std::filesystem::exists(value)))
      continue;
    std::error_code ec;
    const auto absolute = std::filesystem::absolute(value, ec);
    if (!ec) value = absolute.lexically_normal().string();
    while (value.size() > 1 && value.back() == '/') value.pop_back();
  }
}

std::string run_options::toml(toml_use use) {
  const bool print = use == toml_use::print;
  std::ostringstream out;
  std::string section;
  for (const option_row* row : rows_) {
    const value_source from = source(*row);
    // This invocation's alone: printed when given (a --resume loads back as one), never recorded.
    if (row->resume == on_resume::fresh && (!print || from == value_source::demo_default)) continue;
    const std::string value = value_text(config_, *row);
    if (value.empty()) continue;
    const std::string key = row->key, head = key.substr(0, key.find('.'));
    if (head != section) {
      out << (section.empty() ? "" : "\n") << "[" << head << "]\n";
      section = head;
    }
    // A derived value is shown, not given: loading the file derives it again.
    out << (print && from == value_source::derived ? "# " : "") << key.substr(key.find('.') + 1) << " = " << value;
    if (print && from != value_source::demo_default) out << "  # " << source_name(from);
    out << "\n";
  }
  return out.str();
}

std::string run_options::explain(const std::string& message) const {
  for (const option_row* row : rows_) {
    const value_source s = source(*row);
    if (s != value_source::file && s != value_source::checkpoint) continue;
    const auto origin = origins_.find(row->key);
    if (origin == origins_.end() || message.find(origin->second) != std::string::npos) continue;  // named already
    if (message.find(std::string(row->flag) + " ") == std::string::npos) continue;
    return message + " (" + row->flag + " came from " + origin->second + ", key " + row->key + ")";
  }
  return message;
}

}  // namespace upipe::apps
