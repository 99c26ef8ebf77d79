// The first layer of input validation, applied to every option of every command at once:
// a value is never empty, a whole number is written in decimal (CLI11 would read 010 as
// octal 8, 0x10 as 16, and -1 into an unsigned seed as 2^64 - 1), and a real number is
// finite. What a value means (a range, a product that must fit) is checked where the
// command builds its options (validate()); this only guarantees that the text is a number.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <string>

#include <CLI/CLI.hpp>

#include "core/error.hpp"
#include "core/files.hpp"

namespace upipe::apps {

namespace flag_checks_detail {

inline std::string shown(const std::string& value) { return value.empty() ? "''" : "'" + value + "'"; }

// "+007" -> "7", "-010" -> "-10"; an error text when `value` is no decimal whole number.
inline std::string decimal_integer(std::string& value, bool allow_negative) {
  std::size_t digits = 0;
  std::string sign;
  if (!value.empty() && (value[0] == '+' || value[0] == '-')) {
    sign = value[0] == '-' ? "-" : "";
    digits = 1;
  }
  const std::string body = value.substr(digits);
  if (body.empty() || body.find_first_not_of("0123456789") != std::string::npos)
    return shown(value) + " is not a whole number: write it in decimal digits, for example 4";
  if (sign == "-" && !allow_negative)
    return shown(value) + " is negative: this flag takes a whole number of 0 or more, for example 1";
  const std::size_t first = body.find_first_not_of('0');
  value = sign + (first == std::string::npos ? "0" : body.substr(first));
  if (value == "-0") value = "0";
  // CLI11 would saturate a number past 64 bits to the largest one (--steps 99999999999999999999
  // ran as 2^63 - 1); the flag's own check then sees what was typed.
  std::int64_t as_signed = 0;
  std::uint64_t as_unsigned = 0;
  const char* end = value.data() + value.size();
  const bool fits = allow_negative ? std::from_chars(value.data(), end, as_signed).ec == std::errc()
                                   : std::from_chars(value.data(), end, as_unsigned).ec == std::errc();
  if (!fits)
    return shown(value) + " does not fit in 64 bits: give a whole number up to " +
           (allow_negative ? std::string("9223372036854775807") : std::string("18446744073709551615")) +
           " (see --help for the flag's range)";
  return "";
}

inline std::string finite_real(const std::string& value) {
  char* end = nullptr;
  const double v = value.empty() ? 0 : std::strtod(value.c_str(), &end);
  if (value.empty() || end != value.c_str() + value.size())
    return shown(value) + " is not a number, for example 0.5 or 3e-4";
  if (!std::isfinite(v)) return shown(value) + " is not a finite number: give a finite value, for example 0.5";
  return "";
}

}  // namespace flag_checks_detail

// What a path can be (Linux: PATH_MAX 4096 with its NUL, NAME_MAX 255): "" when `value` is
// one, else what it is not (a longer one fails in the kernel with ENAMETOOLONG, far from
// the flag that gave it).
inline std::string path_problem(const std::string& value) {
  for (const char c : value)
    if (static_cast<unsigned char>(c) < 0x20) return "holds a control character, which no path here has";
  if (value.size() > 4095) return "is " + std::to_string(value.size()) + " characters long, and a path is at most 4095";
  std::size_t start = 0;
  while (start <= value.size()) {
    const std::size_t end = std::min(value.find('/', start), value.size());
    if (end - start > 255)
      return "has a name of " + std::to_string(end - start) + " characters, and a name in a path is at most 255";
    start = end + 1;
  }
  return "";
}

// A flag naming a file or directory to read (--weights, --tokens, --adapter): what a path can be.
inline CLI::Validator path_flag() {
  return CLI::Validator(
      [](const std::string& value) -> std::string {
        const std::string problem = path_problem(value);
        return problem.empty() ? "" : "the path " + problem + " (" + value.substr(0, 60) + "...)";
      },
      "PATH", "");
}

// A flag naming a file to write (--json, --metrics-json, --save-grads): checked when the
// command line is read, before any work, so that a run never ends unable to write its
// result (core/files.hpp says what is refused).
inline CLI::Validator output_file_flag(const char* flag, missing_parents parents = missing_parents::refused) {
  return CLI::Validator(
      [flag, parents](const std::string& value) -> std::string {
        if (const std::string problem = path_problem(value); !problem.empty())
          return std::string(flag) + " " + value.substr(0, 60) + "... " + problem;
        try {
          checked_output_file(value, flag, parents);
        } catch (const io_error& e) {
          return e.what();
        }
        return "";
      },
      "FILE", "");
}

// Adds the checks to every option of `app` and of its subcommands, by the option's type.
inline void check_every_flag(CLI::App& app) {
  using namespace flag_checks_detail;
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_items_expected_max() == 0) continue;  // a flag without a value
    const std::string type = opt->get_type_name();
    const bool is_int = type.rfind("INT", 0) == 0, is_uint = type.rfind("UINT", 0) == 0;
    const bool is_real = type.rfind("FLOAT", 0) == 0;
    opt->transform(CLI::Validator(
        [is_int, is_uint, is_real](std::string& value) -> std::string {
          if (is_int || is_uint) return decimal_integer(value, is_int);
          if (is_real) return finite_real(value);
          if (value.empty()) return "an empty value names nothing: give one (see --help)";
          return "";
        },
        "", ""));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) check_every_flag(*sub);
}

}  // namespace upipe::apps
