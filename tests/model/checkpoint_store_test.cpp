// The checkpoint store on the cpu backend: items offloaded early or late, and prefetched
// or taken cold, come back with their bytes; the ledger moves them between tags.
#include <gtest/gtest.h>

#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "model/checkpoint_store.hpp"

namespace upipe {
namespace {

using item = checkpoint_store::item;

tensor filled(backend& be, float first) {
  tensor t = be.allocate(mem_tag::activations, dtype::f32, {4, 3}, "layer_input");
  std::vector<float> v(12);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = first + static_cast<float>(i);
  be.upload_f32(t, v.data());
  return t;
}

std::vector<float> values(backend& be, const tensor& t) {
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  be.download_f32(v.data(), t);
  return v;
}

TEST(checkpoint_store, host_items_come_back_whether_offloaded_early_and_prefetched_or_not) {
  auto be = make_backend(backend_kind::cpu, {std::size_t{1} << 20, std::size_t{1} << 20});
  checkpoint_store store(*be, parse_checkpoint_policy("where=host-pinned"), 3);
  tensor early = filled(*be, 10), late = filled(*be, 100);
  const std::vector<float> want_early = values(*be, early), want_late = values(*be, late);
  store.start_offload(1, item::input, early);
  store.save(1, item::input, std::move(early));
  store.save(2, item::input, std::move(late));
  EXPECT_TRUE(early.empty());
  EXPECT_EQ(be->ledger().current(mem_tag::checkpoints_host), 2 * 12 * sizeof(float));
  EXPECT_EQ(be->ledger().current(mem_tag::activations), 0u);
  store.prefetch(2, item::input, mem_tag::activations);
  EXPECT_EQ(be->ledger().current(mem_tag::activations), 12 * sizeof(float));
  const tensor back_late = store.take(2, item::input, mem_tag::activations);
  const tensor back_early = store.take(1, item::input, mem_tag::activations);
  EXPECT_EQ(values(*be, back_late), want_late);
  EXPECT_EQ(values(*be, back_early), want_early);
  EXPECT_EQ(be->ledger().current(mem_tag::checkpoints_host), 0u);
  EXPECT_FALSE(store.has(1, item::input));
  EXPECT_THROW(store.take(1, item::input, mem_tag::activations), std::exception);
}

TEST(checkpoint_store, device_items_stay_where_they_are) {
  auto be = make_backend(backend_kind::cpu, {std::size_t{1} << 20, std::size_t{1} << 20});
  checkpoint_store store(*be, parse_checkpoint_policy("where=device"), 2);
  tensor t = filled(*be, 1);
  const void* data = t.data();
  store.start_offload(1, item::input, t);  // nothing to do on the device
  store.save(1, item::input, std::move(t));
  EXPECT_EQ(be->ledger().current(mem_tag::checkpoints_device), 12 * sizeof(float));
  store.prefetch(1, item::input, mem_tag::activations);
  const tensor back = store.take(1, item::input, mem_tag::activations);
  EXPECT_EQ(back.data(), data);
  EXPECT_EQ(be->ledger().current(mem_tag::checkpoints_device), 0u);
}

}  // namespace
}  // namespace upipe
