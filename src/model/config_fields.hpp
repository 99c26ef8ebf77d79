// Typed reads of config.json's optional fields, shared by the readers of the families' own
// fields (model/moe_config.cpp, model/hybrid_config.cpp): an absent or null field takes the
// fallback, a field of the wrong type is a format problem of the file (io_error naming the
// file and the field).
#pragma once

#include <cmath>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace upipe::config_fields {

// The field, or nullptr when absent or null.
inline const nlohmann::json* find(const nlohmann::json& root, const char* key) {
  const auto it = root.find(key);
  return it == root.end() || it->is_null() ? nullptr : &*it;
}

inline io_error type_error(const std::string& path, const char* key, const char* expected, const nlohmann::json& value) {
  return io_error("model config '" + path + "': field \"" + key + "\" must be " + expected + ", found " +
                  value.type_name() + " " + value.dump());
}

inline int int_field(const nlohmann::json& value, const std::string& path, const char* key) {
  const bool integral = value.is_number_integer() ||
                        (value.is_number_float() && std::isfinite(value.get<double>()) &&
                         value.get<double>() == std::floor(value.get<double>()));
  if (!integral) throw type_error(path, key, "an integer", value);
  const double v = value.get<double>();
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
    throw config_error("model config '" + path + "': field \"" + key + "\" = " + value.dump() + " is out of range");
  return static_cast<int>(v);
}

inline int int_or(const nlohmann::json& root, const std::string& path, const char* key, int fallback) {
  const nlohmann::json* v = find(root, key);
  return v == nullptr ? fallback : int_field(*v, path, key);
}

inline bool bool_or(const nlohmann::json& root, const std::string& path, const char* key, bool fallback) {
  const nlohmann::json* v = find(root, key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) throw type_error(path, key, "true or false", *v);
  return v->get<bool>();
}

inline double number_or(const nlohmann::json& root, const std::string& path, const char* key, double fallback) {
  const nlohmann::json* v = find(root, key);
  if (v == nullptr) return fallback;
  if (!v->is_number()) throw type_error(path, key, "a number", *v);
  return v->get<double>();
}

}  // namespace upipe::config_fields
