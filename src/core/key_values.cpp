#include "core/key_values.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "core/error.hpp"

namespace upipe {

std::optional<std::int64_t> parse_whole_number(std::string_view text) {
  std::string_view digits = text;
  const bool plus = !digits.empty() && digits.front() == '+';
  if (plus) digits.remove_prefix(1);
  if (digits.empty() || (digits.front() == '-' && (plus || digits.size() == 1))) return std::nullopt;  // "+-4", "-"
  const std::string_view body = digits.front() == '-' ? digits.substr(1) : digits;
  if (body.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  std::int64_t value = 0;
  const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (err != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return value;
}

std::optional<double> parse_finite_real(std::string_view text) {
  // Decimal only: strtod would also read hexadecimal (0x4), "inf" and "nan".
  if (text.empty() || text.find_first_not_of("0123456789+-.eE") != std::string_view::npos) return std::nullopt;
  const std::string copy(text);
  char* end = nullptr;
  const double value = std::strtod(copy.c_str(), &end);
  if (end != copy.c_str() + copy.size() || !std::isfinite(value)) return std::nullopt;
  return value;
}

namespace {

std::string key_list(std::initializer_list<option_key> keys) {
  std::string out;
  for (const option_key& k : keys) out += (out.empty() ? "" : ", ") + std::string(k.name);
  return out;
}

}  // namespace

key_values::key_values(std::string_view text, std::string flag, std::initializer_list<option_key> keys,
                       std::string example)
    : flag_(std::move(flag)), example_(std::move(example)) {
  const option_key* list = nullptr;  // the list key whose bare items follow
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    const std::string item(text.substr(start, comma - start));
    start = comma + 1;
    if (item.empty()) continue;
    const std::size_t eq = item.find('=');
    if (eq == std::string::npos) {
      if (!list)
        throw config_error(flag_ + " item '" + item + "' must be key=value (the keys are " + key_list(keys) +
                           "); for example " + flag_ + " " + example_);
      std::string& joined = items_.back().second;
      joined += (joined.empty() ? "" : ",") + item;
      continue;
    }
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    const auto known = std::find_if(keys.begin(), keys.end(), [&](const option_key& k) {
      return k.name == key || std::find(k.aliases.begin(), k.aliases.end(), key) != k.aliases.end();
    });
    if (known == keys.end())
      throw config_error(flag_ + " key '" + key + "' is not known: the keys are " + key_list(keys) + "; for example " +
                         flag_ + " " + example_);
    if (has(known->name))
      throw config_error(flag_ + " gives " + std::string(known->name) + " twice ('" + std::string(text) +
                         "'): give each key once; for example " + flag_ + " " + example_);
    items_.emplace_back(std::string(known->name), value);
    list = known->values == option_key::takes::list ? &*known : nullptr;
  }
}

std::optional<std::string> key_values::find(std::string_view name) const {
  for (const auto& [key, value] : items_)
    if (key == name) return value;
  return std::nullopt;
}

std::int64_t key_values::whole_number(std::string_view name, std::int64_t lo, std::int64_t hi,
                                      std::string_view example) const {
  const std::string value = find(name).value_or("");
  const std::string item = flag_ + " " + std::string(name) + "=" + value;
  const std::optional<std::int64_t> v = parse_whole_number(value);
  if (!v)
    throw config_error(item + " is not a whole number written in decimal digits; for example " + std::string(name) +
                       "=" + std::string(example));
  if (*v < lo || *v > hi)
    throw config_error(item + " must be a whole number between " + std::to_string(lo) + " and " + std::to_string(hi) +
                       "; for example " + std::string(name) + "=" + std::string(example));
  return *v;
}

double key_values::real_number(std::string_view name, std::string_view example) const {
  const std::string value = find(name).value_or("");
  const std::optional<double> v = parse_finite_real(value);
  if (!v)
    throw config_error(flag_ + " " + std::string(name) + "=" + value + " is not a number (a finite decimal one); for "
                       "example " + std::string(name) + "=" + std::string(example));
  return *v;
}

}  // namespace upipe
