#include "comm/subgroup.hpp"

#include <algorithm>
#include <string>

#include "backend/backend.hpp"
#include "comm/byte_at.hpp"
#include "core/error.hpp"

namespace upipe {

namespace {

class subgroup_communicator final : public communicator {
 public:
  subgroup_communicator(communicator& parent, backend& be, std::vector<int> members, int rank)
      : parent_(parent), be_(be), members_(std::move(members)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }

  void all_to_all(const void* send, void* recv, std::size_t chunk_bytes, std::string_view label) override {
    exchange(send, recv, chunk_bytes, true, label);
    counters_.add(collective::all_to_all, chunk_bytes * members_.size(), label);
  }

  void all_to_all_v(const void* send, std::span<const std::size_t> send_bytes, void* recv,
                    std::span<const std::size_t> recv_bytes, std::string_view label) override {
    relay_all_to_all_v(parent_, [this](int r) { return member(r); }, be_, send, send_bytes, recv, recv_bytes, label);
  }

  void all_gather(const void* send, void* recv, std::size_t chunk_bytes, std::string_view label) override {
    exchange(send, recv, chunk_bytes, false, label);
    counters_.add(collective::all_gather, chunk_bytes * members_.size(), label);
  }

  // Every rank's values gathered, then added in rank order (the same sum on every rank).
  void all_reduce_sum(float* data, std::size_t count, std::string_view label) override {
    tensor all = gathered(count, "subgroup_all_reduce");
    exchange(data, all.data(), count * sizeof(float), false, label);
    sum_chunks(all, data, count);
    counters_.add(collective::all_reduce, count * sizeof(float), label);
  }

  void reduce_scatter_sum(const float* send, float* recv, std::size_t chunk_count, std::string_view label) override {
    tensor all = gathered(chunk_count, "subgroup_reduce_scatter");
    exchange(send, all.data(), chunk_count * sizeof(float), true, label);
    sum_chunks(all, recv, chunk_count);
    counters_.add(collective::reduce_scatter, chunk_count * sizeof(float) * members_.size(), label);
  }

  void send_recv(const void* send, std::size_t send_bytes, int dst, void* recv, std::size_t recv_bytes, int src,
                 std::string_view label) override {
    relay_send_recv(parent_, send, send_bytes, send_bytes > 0 ? member(dst) : -1, recv, recv_bytes,
                    recv_bytes > 0 ? member(src) : -1, label);
  }

  void barrier() override { relay_barrier(parent_); }

 private:
  int member(int rank) const {
    UPIPE_CHECK(rank >= 0 && rank < size(), "sub-group rank " + std::to_string(rank) + " is outside the group of " +
                                                std::to_string(size()));
    return members_[static_cast<std::size_t>(rank)];
  }

  // Round k sends to the rank k places on and receives from the rank k places back:
  // chunk dst of `send` (all_to_all) or the whole of it (all_gather), into chunk src.
  void exchange(const void* send, void* recv, std::size_t chunk, bool by_chunk, std::string_view label) {
    const int n = size();
    std::byte* mine = at(recv, rank_ * chunk);
    const std::byte* own = at(send, by_chunk ? rank_ * chunk : 0);
    if (mine != own) be_.copy_bytes(mine, own, chunk);  // an all-gather in place keeps its chunk
    for (int k = 1; k < n; ++k) {
      const int dst = (rank_ + k) % n, src = (rank_ - k + n) % n;
      parent_.send_recv(at(send, by_chunk ? dst * chunk : 0), chunk, member(dst), at(recv, src * chunk), chunk,
                        member(src), label);
    }
  }

  tensor gathered(std::size_t count, const char* label) {
    return be_.allocate(mem_tag::comm, dtype::f32, {static_cast<std::int64_t>(members_.size()),
                                                    static_cast<std::int64_t>(count)}, label);
  }

  void sum_chunks(const tensor& all, float* out, std::size_t count) {
    auto* chunks = static_cast<float*>(all.data());
    be_.copy_bytes(out, chunks, count * sizeof(float));
    for (std::size_t j = 1; j < members_.size(); ++j) be_.add_f32(out, chunks == nullptr ? nullptr : chunks + j * count, count);
  }

  communicator& parent_;
  backend& be_;
  std::vector<int> members_;
  int rank_;
};

}  // namespace

std::unique_ptr<communicator> make_subgroup(communicator& parent, backend& be, std::vector<int> members) {
  const auto it = std::find(members.begin(), members.end(), parent.rank());
  if (it == members.end())
    throw config_error("rank " + std::to_string(parent.rank()) + " is not a member of the sub-group it was asked to join");
  for (std::size_t j = 0; j < members.size(); ++j)
    UPIPE_CHECK(members[j] >= 0 && members[j] < parent.size() && (j == 0 || members[j - 1] < members[j]),
                "sub-group member " + std::to_string(members[j]) + " is outside the parent group or out of order");
  if (parent.is_loopback()) return make_loopback_communicator(be, static_cast<int>(members.size()));
  if (auto native = parent.split_native(members)) return native;
  const int rank = static_cast<int>(it - members.begin());
  return std::make_unique<subgroup_communicator>(parent, be, std::move(members), rank);
}

mesh_groups split_mesh(communicator& parent, backend& be, int rings) {
  const int C = parent.size();
  if (rings < 1 || C % rings != 0)
    throw config_error("--ring " + std::to_string(rings) + " must divide the CP group's " + std::to_string(C) +
                       " ranks (R rings of A = C / R ranks each); for example --ring " +
                       std::to_string(C % 2 == 0 ? 2 : 1));
  const int A = C / rings, g = parent.rank() / A, a = parent.rank() % A;
  mesh_groups m;
  std::vector<int> group, ring;
  for (int j = 0; j < A; ++j) group.push_back(g * A + j);
  for (int j = 0; j < rings; ++j) ring.push_back(j * A + a);
  m.all_to_all = make_subgroup(parent, be, group);
  m.ring = make_subgroup(parent, be, ring);
  return m;
}

}  // namespace upipe
