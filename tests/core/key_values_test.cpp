// The one parser of key=value flags (core/key_values.hpp): duplicates, unknown keys, list
// keys and strict numbers.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "core/key_values.hpp"

namespace upipe {
namespace {

key_values parse(std::string_view text) {
  return key_values(text, "--x", {{"r", {"rank"}}, {"alpha"}, {"targets", {}, option_key::takes::list}}, "r=16");
}

// The config_error message of parsing `text` and reading r and alpha ("" when none).
std::string refusal(std::string_view text) {
  try {
    const key_values items = parse(text);
    if (items.has("r")) items.whole_number("r", 1, 1 << 20, "16");
    if (items.has("alpha")) items.real_number("alpha", "32");
  } catch (const config_error& e) {
    return e.what();
  }
  return "";
}

TEST(key_values, reads_keys_aliases_and_list_items) {
  const key_values items = parse("rank=8,targets=q,k,v,alpha=16.5");
  EXPECT_EQ(items.whole_number("r", 1, 100, "16"), 8);
  EXPECT_EQ(items.find("targets"), "q,k,v");
  EXPECT_DOUBLE_EQ(items.real_number("alpha", "32"), 16.5);
  EXPECT_FALSE(parse("r=4").has("alpha"));
  EXPECT_EQ(parse("r=4,targets=").find("targets"), "");
}

TEST(key_values, refuses_duplicates_unknown_keys_and_loose_numbers_by_name) {
  EXPECT_NE(refusal("r=4,r=8").find("--x gives r twice"), std::string::npos) << refusal("r=4,r=8");
  EXPECT_NE(refusal("r=4,rank=8").find("gives r twice"), std::string::npos);
  EXPECT_NE(refusal("beta=1").find("key 'beta' is not known: the keys are r, alpha, targets"), std::string::npos);
  EXPECT_NE(refusal("q").find("item 'q' must be key=value"), std::string::npos);
  for (const char* r : {"0x4", "4.9", "1e3", "+-4", "-", "", "99999999999999999999"})
    EXPECT_NE(refusal(std::string("r=") + r).find(std::string("r=") + r + " is not a whole number"),
              std::string::npos) << r << ": " << refusal(std::string("r=") + r);
  EXPECT_NE(refusal("r=4294967300").find("must be a whole number between 1 and 1048576"), std::string::npos);
  EXPECT_NE(refusal("r=-4").find("between 1 and"), std::string::npos);
  for (const char* alpha : {"nan", "inf", "0x10", "1e400", "x"})
    EXPECT_NE(refusal(std::string("r=4,alpha=") + alpha).find("is not a number"), std::string::npos) << alpha;
  EXPECT_EQ(refusal("r=+4,alpha=-1e3"), "");  // a sign is a number's; the caller's range check follows
}

TEST(key_values, whole_and_real_numbers_are_decimal_and_fit) {
  EXPECT_EQ(parse_whole_number("9223372036854775807"), INT64_MAX);
  EXPECT_FALSE(parse_whole_number("9223372036854775808"));
  EXPECT_EQ(parse_whole_number("-12"), -12);
  EXPECT_EQ(parse_whole_number("+12"), 12);
  EXPECT_FALSE(parse_whole_number(" 12"));
  EXPECT_EQ(parse_finite_real("1.5e2"), 150.0);
  EXPECT_FALSE(parse_finite_real("1e999"));
  EXPECT_FALSE(parse_finite_real("0x1p3"));
}

}  // namespace
}  // namespace upipe
