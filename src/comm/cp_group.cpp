#include "backend/backend.hpp"
#include "comm/communicator.hpp"

namespace upipe {

double sum_over_ranks(communicator& comm, double value, std::string_view label) {
  std::vector<double> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather(&value, all.data(), sizeof(double), label);
  double total = 0;
  for (double v : all) total += v;
  return total;
}

std::vector<std::unique_ptr<backend>> run_cp_group(backend_kind kind, const memory_limits& limits, int size,
                                                   const std::function<void(int rank, backend& be, communicator& comm)>& fn,
                                                   bool emulate) {
  std::vector<std::unique_ptr<backend>> backends;
  const bool alone = emulate || kind == backend_kind::meta;
  const int ranks = alone ? 1 : size;
  for (int r = 0; r < ranks; ++r) backends.push_back(make_backend(kind, limits));
  if (alone) {
    auto comm = make_loopback_communicator(*backends[0], size);
    fn(0, *backends[0], *comm);
    return backends;
  }
  std::vector<backend*> raw;
  for (auto& b : backends) raw.push_back(b.get());
  run_threads(raw, [&](int rank, communicator& comm) { fn(rank, *raw[rank], comm); });
  return backends;
}

}  // namespace upipe
