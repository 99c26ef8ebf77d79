// Flags written as comma-separated key=value items (--lora r=16,alpha=32,targets=q,v;
// --rope-scaling type=yarn,factor=4; --checkpoint-policy what=input,every=2), read by one
// set of rules: every item is key=value; a key not in the flag's table is refused naming
// the keys it has; a key given twice (under any of its names) is refused, since which one
// wins would be a guess; a list key takes the bare items after it (targets=q,k,v). Numbers
// are read strictly: a whole number is decimal digits (0x4, 4.0, 1e3 and 4294967300 where
// an int is meant are refused, never truncated), a real number is finite.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace upipe {

// A key of a flag: its name as messages write it and the other spellings it accepts.
struct option_key {
  enum class takes { one_value, list };  // list: the bare items after it join its value
  std::string_view name;
  std::vector<std::string_view> aliases = {};
  takes values = takes::one_value;
};

class key_values {
 public:
  // Splits `text` by the rules above. `flag` and `example` complete the messages
  // ("--lora key 'size' is not known: the keys are r, alpha, dropout, targets; for example
  // --lora r=16,alpha=32"). Throws config_error.
  key_values(std::string_view text, std::string flag, std::initializer_list<option_key> keys, std::string example);

  // The value given for `name` (under any of its spellings), if any; a list key's items
  // joined by commas.
  std::optional<std::string> find(std::string_view name) const;
  bool has(std::string_view name) const { return find(name).has_value(); }

  // The value of `name` as a whole number in [lo, hi], or as a finite real number. Throws
  // config_error naming the flag, the item, the rule and `example`.
  std::int64_t whole_number(std::string_view name, std::int64_t lo, std::int64_t hi, std::string_view example) const;
  double real_number(std::string_view name, std::string_view example) const;

  const std::string& flag() const { return flag_; }

 private:
  std::string flag_, example_;
  std::vector<std::pair<std::string, std::string>> items_;  // (name, value) in the order given
};

// `text` as a whole number written in decimal digits (an optional sign), or nothing when it
// is not one or does not fit 64 bits.
std::optional<std::int64_t> parse_whole_number(std::string_view text);
// `text` as a finite real number (decimal, optionally with an exponent), or nothing.
std::optional<double> parse_finite_real(std::string_view text);

}  // namespace upipe
