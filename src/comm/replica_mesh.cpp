#include "comm/replica_mesh.hpp"

#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "comm/byte_at.hpp"
#include "comm/subgroup.hpp"
#include "core/error.hpp"

namespace upipe {

namespace {

// The world renumbered CP-major (shard rank k = c D + d is world rank d C + c), with the
// reductions and gathers in two levels over the CP group (the caller's, which the attention
// also runs on) and the DP group (its own).
class shard_communicator final : public communicator {
 public:
  shard_communicator(communicator& world, communicator& cp, std::unique_ptr<communicator> dp, backend& be)
      : world_(world), cp_(cp), dp_owned_(std::move(dp)), dp_(*dp_owned_), be_(be) {}

  int rank() const override { return cp_.rank() * dp_.size() + dp_.rank(); }
  int size() const override { return world_.size(); }
  bool is_loopback() const override { return world_.is_loopback(); }

  // Chunk k of `send` (k = c' D + d') belongs to shard rank k: the CP group's reduce-scatter
  // gives CP rank c the D chunks c D .. c D + D - 1 summed over its replica, and the DP
  // group's gives replica d the d-th of them summed over the replicas, in replica order.
  void reduce_scatter_sum(const float* send, float* recv, std::size_t chunk_count, std::string_view label) override {
    const std::int64_t D = dp_.size();
    tensor part = be_.allocate(mem_tag::comm, dtype::f32, {D, static_cast<std::int64_t>(chunk_count)},
                               "shard_reduce_scatter");
    cp_.reduce_scatter_sum(send, part.as<float>(), static_cast<std::size_t>(D) * chunk_count, label);
    dp_.reduce_scatter_sum(part.as<float>(), recv, chunk_count, label);
    counters_.add(collective::reduce_scatter, chunk_count * sizeof(float) * static_cast<std::size_t>(size()), label);
  }

  // Across the replicas into this CP rank's block of D chunks, then the blocks over the CP
  // group, in place.
  void all_gather(const void* send, void* recv, std::size_t chunk_bytes, std::string_view label) override {
    std::byte* block = at(recv, static_cast<std::size_t>(cp_.rank() * dp_.size()) * chunk_bytes);
    dp_.all_gather(send, block, chunk_bytes, label);
    cp_.all_gather(block, recv, chunk_bytes * static_cast<std::size_t>(dp_.size()), label);
    counters_.add(collective::all_gather, chunk_bytes * static_cast<std::size_t>(size()), label);
  }

  // The second level reads what the first wrote: the first is joined before the second
  // starts (on a GPU without blocking the host), so only the second runs beside the compute.
  comm_request all_gather_start(const void* send, void* recv, std::size_t chunk_bytes,
                                std::string_view label) override {
    std::byte* block = at(recv, static_cast<std::size_t>(cp_.rank() * dp_.size()) * chunk_bytes);
    dp_.all_gather_start(send, block, chunk_bytes, label).wait();
    comm_request r = cp_.all_gather_start(block, recv, chunk_bytes * static_cast<std::size_t>(dp_.size()), label);
    counters_.add(collective::all_gather, chunk_bytes * static_cast<std::size_t>(size()), label);
    return r;
  }

  void all_reduce_sum(float* data, std::size_t count, std::string_view label) override {
    world_.all_reduce_sum(data, count, label);
    counters_.add(collective::all_reduce, count * sizeof(float), label);
  }

  // Rounds of the world's point-to-point sends, as a sub-group's all-to-all.
  void all_to_all(const void* send, void* recv, std::size_t chunk_bytes, std::string_view label) override {
    const int n = size(), me = rank();
    be_.copy_bytes(at(recv, me * chunk_bytes), at(send, me * chunk_bytes), chunk_bytes);
    for (int k = 1; k < n; ++k) {
      const int dst = (me + k) % n, src = (me - k + n) % n;
      world_.send_recv(at(send, dst * chunk_bytes), chunk_bytes, world_rank(dst), at(recv, src * chunk_bytes),
                       chunk_bytes, world_rank(src), label);
    }
    counters_.add(collective::all_to_all, chunk_bytes * static_cast<std::size_t>(n), label);
  }

  void all_to_all_v(const void* send, std::span<const std::size_t> send_bytes, void* recv,
                    std::span<const std::size_t> recv_bytes, std::string_view label) override {
    relay_all_to_all_v(world_, [this](int r) { return world_rank(r); }, be_, send, send_bytes, recv, recv_bytes, label);
  }

  void send_recv(const void* send, std::size_t send_bytes, int dst, void* recv, std::size_t recv_bytes, int src,
                 std::string_view label) override {
    relay_send_recv(world_, send, send_bytes, send_bytes > 0 ? world_rank(dst) : -1, recv, recv_bytes,
                    recv_bytes > 0 ? world_rank(src) : -1, label);
  }

  void barrier() override { relay_barrier(world_); }

 private:
  int world_rank(int shard_rank) const {
    UPIPE_CHECK(shard_rank >= 0 && shard_rank < size(),
                "shard rank " + std::to_string(shard_rank) + " is outside the mesh of " + std::to_string(size()));
    const int D = dp_.size(), C = cp_.size();
    return shard_rank % D * C + shard_rank / D;
  }

  communicator& world_;
  communicator& cp_;
  std::unique_ptr<communicator> dp_owned_;
  communicator& dp_;
  backend& be_;
};

}  // namespace

replica_groups split_replicas(communicator& world, backend& be, int cp) {
  const int W = world.size();
  if (cp < 1 || W % cp != 0)
    throw config_error("--cp " + std::to_string(cp) + " must divide the " + std::to_string(W) +
                       " ranks of the data-parallel mesh (D replicas of C ranks each); for example --cp " +
                       std::to_string(W) + " --dp 1");
  replica_groups g;
  if (cp == W) return g;  // one replica: the world is its CP group and ZeRO's
  const int replica = world.rank() / cp, place = world.rank() % cp;
  std::vector<int> group, across;
  for (int j = 0; j < cp; ++j) group.push_back(replica * cp + j);
  for (int j = 0; j < W / cp; ++j) across.push_back(j * cp + place);
  g.cp = make_subgroup(world, be, group);
  if (cp == 1) return g;  // replicas of one rank: the world reduces across them itself
  g.shards = std::make_unique<shard_communicator>(world, *g.cp, make_subgroup(world, be, across), be);
  return g;
}

expert_groups split_experts(communicator& world, backend& be, int ep) {
  const int W = world.size();
  if (ep < 1 || W % ep != 0)
    throw config_error("--ep " + std::to_string(ep) + " must divide the " + std::to_string(W) +
                       " ranks of the mesh (dp x cp); for example --ep 1");
  expert_groups g;
  if (ep == 1) return g;
  const int group = world.rank() / ep, place = world.rank() % ep;
  std::vector<int> peers, replicas;
  for (int j = 0; j < ep; ++j) peers.push_back(group * ep + j);
  for (int j = 0; j < W / ep; ++j) replicas.push_back(j * ep + place);
  g.peers = make_subgroup(world, be, peers);
  g.replicas = make_subgroup(world, be, replicas);
  return g;
}

}  // namespace upipe
