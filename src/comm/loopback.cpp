// The loopback communicator: rank 0 of a group of `size` alone. Each collective moves
// rank 0's own bytes into the shapes it would receive and counts the bytes a real
// group would put on the wire, so memory, compute and counters are exactly rank 0's.
#include <algorithm>
#include <cstdint>
#include <vector>
#include <memory>
#include <stdexcept>
#include <string>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"

namespace upipe {

namespace {

// `offset` bytes past base; stays nullptr on the meta backend, where buffers have no data.
std::byte* byte_at(void* base, std::size_t offset) {
  return base == nullptr ? nullptr : static_cast<std::byte*>(base) + offset;
}

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  if (a == nullptr || b == nullptr || a_bytes == 0 || b_bytes == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

class loopback_communicator final : public communicator {
 public:
  loopback_communicator(backend& be, int size) : be_(be), size_(size) {}

  int rank() const override { return 0; }
  int size() const override { return size_; }

  void all_to_all(const void* send, void* recv, std::size_t chunk_bytes, std::string_view label) override {
    const std::size_t total = chunk_bytes * size_;
    UPIPE_CHECK(!overlaps(send, total, recv, total), "all_to_all: send and recv overlap");
    be_.copy_bytes(recv, send, total);
    counters_.add(collective::all_to_all, total, label);
  }

  // Chunk j of recv takes chunk j of send. A real group's sizes come from an exchange of
  // them, which here returns rank 0's own, so they agree; where a caller sizes the receive
  // otherwise (the meta backend's planning bound of expert parallelism, which moves no
  // data) the common part moves.
  void all_to_all_v(const void* send, std::span<const std::size_t> send_bytes, void* recv,
                    std::span<const std::size_t> recv_bytes, std::string_view label) override {
    const std::vector<std::size_t> out = chunk_offsets(send_bytes, size_), in = chunk_offsets(recv_bytes, size_);
    UPIPE_CHECK(!overlaps(send, out.back(), recv, in.back()), "all_to_all_v: send and recv overlap");
    UPIPE_CHECK(!be_.has_data() || send_bytes.size() == 0 ||
                    std::equal(send_bytes.begin(), send_bytes.end(), recv_bytes.begin()),
                "loopback all_to_all_v: rank 0 alone receives its own chunks, so each receive must be the size it "
                "sends");
    for (int j = 0; j < size_; ++j) {
      const std::size_t n = std::min(send_bytes[j], recv_bytes[j]);
      if (n > 0) be_.copy_bytes(byte_at(recv, in[j]), byte_at(const_cast<void*>(send), out[j]), n);
    }
    counters_.add(collective::all_to_all_v, out.back(), label);
  }

  void all_reduce_sum(float* /*data*/, std::size_t count, std::string_view label) override {
    counters_.add(collective::all_reduce, count * sizeof(float), label);
  }

  void reduce_scatter_sum(const float* send, float* recv, std::size_t chunk_count, std::string_view label) override {
    const std::size_t chunk_bytes = chunk_count * sizeof(float);
    UPIPE_CHECK(!overlaps(send, chunk_bytes * size_, recv, chunk_bytes), "reduce_scatter_sum: send and recv overlap");
    be_.copy_bytes(recv, send, chunk_bytes);
    counters_.add(collective::reduce_scatter, chunk_bytes * size_, label);
  }

  void all_gather(const void* send, void* recv, std::size_t chunk_bytes, std::string_view label) override {
    for (int j = 0; j < size_; ++j) be_.copy_bytes(byte_at(recv, j * chunk_bytes), send, chunk_bytes);
    counters_.add(collective::all_gather, chunk_bytes * size_, label);
  }

  void send_recv(const void* send, std::size_t send_bytes, int dst, void* recv, std::size_t recv_bytes, int src,
                 std::string_view label) override {
    // A one-sided step (a sliding window's) moves nothing here; a two-sided one receives
    // rank 0's own message, so both sides must be the same size.
    UPIPE_CHECK(send_bytes == recv_bytes || send_bytes == 0 || recv_bytes == 0,
                "loopback send_recv sends " + std::to_string(send_bytes) + " bytes but receives " +
                    std::to_string(recv_bytes) + "; rank 0 alone can only receive its own message");
    if (send_bytes > 0) check_peer(dst, "destination");
    if (recv_bytes > 0) check_peer(src, "source");
    if (send_bytes > 0 && recv_bytes > 0) be_.copy_bytes(recv, send, send_bytes);
    if (send_bytes > 0) counters_.add(collective::send, send_bytes, label);
    if (recv_bytes > 0) counters_.add(collective::recv, recv_bytes, label);
  }

  void barrier() override { counters_.add(collective::barrier, 0, ""); }
  bool is_loopback() const override { return true; }

 private:
  void check_peer(int peer, const char* role) const {
    UPIPE_CHECK(peer >= 0 && peer < size_, "send_recv: " + std::string(role) + " rank " + std::to_string(peer) +
                                               " is outside the group of " + std::to_string(size_));
  }

  backend& be_;
  const int size_;
};

}  // namespace

std::unique_ptr<communicator> make_loopback_communicator(backend& be, int size) {
  UPIPE_CHECK(size >= 1, "a loopback communicator needs a group size of at least 1, not " + std::to_string(size));
  return std::make_unique<loopback_communicator>(be, size);
}

}  // namespace upipe
