#include <gtest/gtest.h>

#include "core/ledger.hpp"

namespace upipe {
namespace {

TEST(memory_ledger, current_and_peak_per_tag) {
  memory_ledger l;
  l.on_alloc(mem_tag::weights, 100, "w");
  l.on_alloc(mem_tag::attention, 50, "q");
  l.on_free(mem_tag::attention, 50, "q");
  l.on_alloc(mem_tag::attention, 30, "k");
  EXPECT_EQ(l.current(mem_tag::attention), 30u);
  EXPECT_EQ(l.peak(mem_tag::attention), 50u);
  EXPECT_EQ(l.device_peak(), 150u);
  EXPECT_EQ(l.device_current(), 130u);
}

TEST(memory_ledger, host_tags_are_not_device_memory) {
  memory_ledger l;
  l.on_alloc(mem_tag::checkpoints_host, 1000, "ckpt");
  l.on_alloc(mem_tag::checkpoints_device, 10, "ckpt");
  EXPECT_EQ(l.device_current(), 10u);
  EXPECT_EQ(l.peak(mem_tag::checkpoints_host), 1000u);
}

TEST(memory_ledger, window_peak_starts_at_current) {
  memory_ledger l;
  l.on_alloc(mem_tag::attention, 500, "a");
  l.on_free(mem_tag::attention, 500, "a");
  l.on_alloc(mem_tag::attention, 20, "b");
  l.reset_window();
  EXPECT_EQ(l.window_peak(mem_tag::attention), 20u);
  l.on_alloc(mem_tag::attention, 40, "c");
  l.on_free(mem_tag::attention, 40, "c");
  EXPECT_EQ(l.window_peak(mem_tag::attention), 60u);
  EXPECT_EQ(l.peak(mem_tag::attention), 500u);
}

TEST(memory_ledger, timeline_records_when_enabled) {
  memory_ledger l;
  l.on_alloc(mem_tag::comm, 8, "before");
  l.record_timeline(true);
  l.on_alloc(mem_tag::comm, 16, "x");
  l.on_free(mem_tag::comm, 16, "x");
  ASSERT_EQ(l.timeline().size(), 2u);
  EXPECT_EQ(l.timeline()[0].delta, 16);
  EXPECT_EQ(l.timeline()[0].device_total, 24u);
  EXPECT_EQ(l.timeline()[1].delta, -16);
  EXPECT_EQ(l.timeline()[1].label, "x");
  EXPECT_LT(l.timeline()[0].seq, l.timeline()[1].seq);
}

TEST(memory_ledger, names) {
  EXPECT_EQ(mem_tag_name(mem_tag::checkpoints_host), "checkpoints_host");
  EXPECT_EQ(mem_tag_name(mem_tag::attention), "attention");
}

}  // namespace
}  // namespace upipe
