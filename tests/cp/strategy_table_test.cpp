// The strategy table: every row names itself once, parses back, builds a stage plan for a
// valid configuration of its own (its defaults filled as the row says) and refuses what it
// does not take, with the message naming the rule.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "core/error.hpp"
#include "cp/stage_plan.hpp"
#include "cp/strategy_table.hpp"

namespace upipe {
namespace {

attention_config config_of(const strategy_row& row) {
  attention_config c;
  c.seq_len = 64;
  c.heads = 8;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.model_dim = 32;
  c.cp = 4;
  c.ring = row.mesh ? 2 : 1;
  c.strategy = row.kind;
  return c;
}

TEST(strategy_table, every_row_is_named_once_and_parses_back) {
  std::set<std::string_view> names;
  for (const strategy_row& row : strategy_rows()) {
    EXPECT_TRUE(names.insert(row.name).second) << row.name;
    EXPECT_EQ(parse_strategy_kind(row.name), row.kind);
    EXPECT_EQ(strategy_name(row.kind), row.name);
    EXPECT_EQ(&row_of(row.kind), &row);
    EXPECT_NE(strategy_help().find(std::string(row.name) + " ("), std::string::npos) << row.name;
    EXPECT_NE(strategy_names().find(row.name), std::string::npos) << row.name;
    EXPECT_NE(row.make, nullptr);
    EXPECT_NE(row.plan, nullptr);
  }
  try {
    row_named("bogus");
    ADD_FAILURE() << "accepted an unknown strategy";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find(strategy_names()), std::string::npos) << e.what();
  }
}

// Each row's defaults are filled as the row says, and its plan is built for them.
TEST(strategy_table, defaults_follow_the_row) {
  for (const strategy_row& row : strategy_rows()) {
    attention_config c = config_of(row);
    validate(c);
    const int A = c.all_to_all_size();
    switch (row.heads) {
      case head_stages::none: EXPECT_EQ(c.head_chunk, 0) << row.name; break;
      case head_stages::all: EXPECT_EQ(c.head_chunk, c.heads) << row.name; break;
      case head_stages::chosen:
        EXPECT_EQ(c.head_chunk, row.head_default == head_chunk_default::group ? A : c.heads) << row.name;
        break;
    }
    EXPECT_EQ(c.seq_chunks > 1, row.chunks == sequence_chunking::required) << row.name;
    EXPECT_EQ(c.layout_unit(), row.layout == sequence_layout::zigzag ? 2 * c.cp : c.cp) << row.name;
    EXPECT_EQ(c.staged(), row.heads != head_stages::none) << row.name;
    const stage_plan p = make_stage_plan(c, 1);
    EXPECT_FALSE(p.forward.events().empty()) << row.name;
    EXPECT_FALSE(p.backward.events().empty()) << row.name;
    EXPECT_EQ(p.stages.empty(), row.heads == head_stages::none) << row.name;
  }
}

// What a row does not take is refused: sequence chunks, a ring, a head chunk.
TEST(strategy_table, a_row_refuses_what_it_does_not_take) {
  for (const strategy_row& row : strategy_rows()) {
    const auto refused = [&](attention_config c, const std::string& says) {
      try {
        validate(c);
        ADD_FAILURE() << row.name << " accepted: " << says;
      } catch (const config_error& e) {
        EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      }
    };
    attention_config c = config_of(row);
    if (row.chunks == sequence_chunking::none) {
      c.seq_chunks = 2;
      refused(c, "not " + std::string(row.name));
    }
    c = config_of(row);
    if (!row.mesh) {
      c.ring = 2;
      refused(c, "--ring 2 applies to");
    }
    c = config_of(row);
    c.head_chunk = 3;
    refused(c, "head chunk U = 3");
  }
}

}  // namespace
}  // namespace upipe
