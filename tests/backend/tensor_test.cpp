#include <gtest/gtest.h>

#include <string>

#include "backend/backend.hpp"
#include "core/error.hpp"

namespace upipe {
namespace {

TEST(tensor, move_only_and_freed_into_the_ledger) {
  auto be = make_cpu_backend({std::size_t{16} << 20, std::size_t{1} << 20});
  {
    tensor a = be->allocate(mem_tag::attention, dtype::f32, {10, 4}, "a");
    EXPECT_EQ(be->ledger().current(mem_tag::attention), 160u);
    tensor b = std::move(a);
    EXPECT_TRUE(a.empty());
    EXPECT_EQ(b.numel(), 40);
    EXPECT_EQ(be->ledger().current(mem_tag::attention), 160u);
    b.as<float>()[39] = 2.5f;
  }
  EXPECT_EQ(be->ledger().current(mem_tag::attention), 0u);
  EXPECT_EQ(be->device_arena().in_use(), 0u);
}

TEST(tensor, views_slice_rows_columns_tokens_heads) {
  auto be = make_cpu_backend({std::size_t{16} << 20, std::size_t{1} << 20});
  tensor t = be->allocate(mem_tag::activations, dtype::f32, {6, 3, 4}, "t");
  for (int i = 0; i < 72; ++i) t.as<float>()[i] = static_cast<float>(i);
  const head_view h = t.heads().token_block(2, 3).head_block(1, 2);
  EXPECT_EQ(static_cast<float*>(h.data)[0], 2 * 12 + 1 * 4);
  EXPECT_EQ(h.tokens, 3);
  EXPECT_EQ(h.heads, 2);
  const mat_view m = t.matrix().row_block(1, 2).col_block(4, 8);
  EXPECT_EQ(static_cast<float*>(m.data)[0], 16.0f);
  EXPECT_EQ(m.ld, 12);
  EXPECT_THROW(t.matrix().row_block(5, 2), internal_error);
}

TEST(backend, out_of_memory_names_tag_bytes_and_breakdown) {
  auto be = make_meta_backend({std::size_t{1} << 20, std::size_t{1} << 20});
  tensor keep = be->allocate(mem_tag::weights, dtype::bf16, {1000}, "w");
  try {
    be->allocate(mem_tag::attention, dtype::bf16, {1 << 20}, "attn_q_send");
    FAIL();
  } catch (const out_of_memory_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("attn_q_send"), std::string::npos);
    EXPECT_NE(m.find("tag attention"), std::string::npos);
    EXPECT_NE(m.find("2097152 bytes"), std::string::npos);
    EXPECT_NE(m.find("weights=2000"), std::string::npos);
    EXPECT_NE(m.find("upipe plan"), std::string::npos);
  }
}

TEST(backend, meta_has_no_data_but_the_same_arena) {
  auto meta = make_meta_backend({std::size_t{1} << 30, std::size_t{1} << 20});
  auto cpu = make_cpu_backend({std::size_t{1} << 30, std::size_t{1} << 20});
  tensor a = meta->allocate(mem_tag::attention, dtype::bf16, {1000, 3}, "a");
  tensor b = cpu->allocate(mem_tag::attention, dtype::bf16, {1000, 3}, "a");
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_NE(b.data(), nullptr);
  EXPECT_EQ(meta->device_arena().in_use(), cpu->device_arena().in_use());
  EXPECT_THROW(parse_backend_kind("tpu"), config_error);
}

}  // namespace
}  // namespace upipe
