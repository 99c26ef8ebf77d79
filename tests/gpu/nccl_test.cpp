// The NCCL communicator on the GPUs this machine has (one is enough for a single-rank
// group; every GPU is one rank): each collective against what it must deliver, host
// buffers included; every strategy, a model's gradients and training steps over NCCL
// against one rank; and the watchdog, which aborts a group whose collective does not
// finish in time once it can start (two GPUs), and leaves one waiting for compute alone.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/launch.hpp"
#include "comm/nccl.hpp"
#include "core/error.hpp"
#include "model/model_step.hpp"
#include "runtime/attention_experiment.hpp"
#include "runtime/cp_group.hpp"
#include "train/trainer.hpp"

#include "../support/compare.hpp"

namespace upipe {
namespace {

int gpus() { return visible_gpus(); }

// Group sizes to try: every power of two up to 4 GPUs, or, under mpirun/srun, the job's.
std::vector<int> group_sizes() {
  if (const auto env = launcher_environment()) return {env->size};
  std::vector<int> sizes;
  for (int size = 1; size <= std::min(gpus(), 4); size *= 2) sizes.push_back(size);
  return sizes;
}

// The value rank `from` puts in element i of the chunk it sends to rank `to`.
float value(int from, int to, int i) { return static_cast<float>(1000 * from + 10 * to + i); }

TEST(gpu_nccl, collectives_deliver_what_they_promise) {
  if (gpus() < 1) GTEST_SKIP() << "no GPU";
  for (int size : group_sizes()) {
    const memory_limits limits{std::size_t{64} << 20, std::size_t{16} << 20};
    run_cp_group(
        backend_kind::cuda, limits, size,
        [&](int rank, backend& be, communicator& comm) {
          const int n = 5;
          tensor send = be.allocate(mem_tag::comm, dtype::f32, {size * n}, "send");
          tensor recv = be.allocate(mem_tag::comm, dtype::f32, {size * n}, "recv");
          std::vector<float> host(static_cast<std::size_t>(size * n)), got(host.size());
          for (int j = 0; j < size; ++j)
            for (int i = 0; i < n; ++i) host[static_cast<std::size_t>(j * n + i)] = value(rank, j, i);
          be.upload_f32(send, host.data());
          comm.all_to_all(send.data(), recv.data(), n * sizeof(float), "a2a");
          be.download_f32(got.data(), recv);
          for (int j = 0; j < size; ++j)
            for (int i = 0; i < n; ++i) EXPECT_EQ(got[static_cast<std::size_t>(j * n + i)], value(j, rank, i));
          // The same exchange in flight on the collectives' stream, waited for by the compute stream.
          be.fill_bytes(recv.data(), 0, recv.bytes());
          comm_request in_flight = comm.all_to_all_start(send.data(), recv.data(), n * sizeof(float), "a2a_async");
          in_flight.wait();
          EXPECT_FALSE(in_flight.pending());
          be.download_f32(got.data(), recv);
          for (int j = 0; j < size; ++j)
            for (int i = 0; i < n; ++i) EXPECT_EQ(got[static_cast<std::size_t>(j * n + i)], value(j, rank, i));
          // all_reduce, in place: element k sums value(r, 0, k) over the ranks.
          comm.all_reduce_sum(send.as<float>(), static_cast<std::size_t>(size * n), "ar");
          be.download_f32(got.data(), send);
          for (int k = 0; k < size * n; ++k) {
            float want = 0;
            for (int r = 0; r < size; ++r) want += value(r, k / n, k % n);
            EXPECT_EQ(got[static_cast<std::size_t>(k)], want);
          }
          // reduce_scatter of the summed buffer: this rank's chunk times size.
          tensor chunk = be.allocate(mem_tag::comm, dtype::f32, {n}, "chunk");
          comm.reduce_scatter_sum(send.as<float>(), chunk.as<float>(), n, "rs");
          std::vector<float> mine(n);
          be.download_f32(mine.data(), chunk);
          for (int i = 0; i < n; ++i) EXPECT_EQ(mine[i], size * got[static_cast<std::size_t>(rank * n + i)]);
          // all_gather of the chunks, and of a host value (staged through the device).
          comm.all_gather(chunk.data(), recv.data(), n * sizeof(float), "ag");
          be.download_f32(got.data(), recv);
          for (int i = 0; i < n; ++i) EXPECT_EQ(got[static_cast<std::size_t>(rank * n + i)], mine[i]);
          EXPECT_DOUBLE_EQ(sum_over_ranks(comm, rank + 0.5, "sum"), size * (size - 1) / 2.0 + 0.5 * size);
          // A ring step: send to the next rank, receive from the previous one.
          comm.send_recv(send.data(), n * sizeof(float), (rank + 1) % size, recv.data(), n * sizeof(float),
                         (rank + size - 1) % size, "ring");
          comm.barrier();
          EXPECT_EQ(comm.counters().calls[static_cast<std::size_t>(collective::all_to_all)], 2u);
        },
        group_run::every_rank, {comm_kind::nccl, 60});
  }
}

// Under mpirun or srun the NCCL id travels through MPI, a job of one process included
// (`mpirun -np 1`), wherever the MPI plugin was built beside the binary.
TEST(gpu_nccl, launched_jobs_bootstrap_through_mpi) {
  const auto env = launcher_environment();
  if (!env || gpus() < 1) GTEST_SKIP() << "needs a launcher (mpirun or srun) and a GPU";
  run_cp_group(
      backend_kind::cuda, {std::size_t{64} << 20, std::size_t{16} << 20}, env->size,
      [&](int rank, backend&, communicator& comm) {
        EXPECT_DOUBLE_EQ(sum_over_ranks(comm, 1.0, "ranks"), env->size);
        EXPECT_EQ(rank, env->rank);
      },
      group_run::every_rank, {comm_kind::nccl, 60});
  // The plugin is loaded with its symbols global: MPI's own answer says whether it ran.
  using query = int (*)(int*);
  const auto initialized = reinterpret_cast<query>(dlsym(RTLD_DEFAULT, "MPI_Initialized"));
  ASSERT_NE(initialized, nullptr) << "libupipe_mpi.so was not loaded: build it (scripts/gpu-check build)";
  int flag = 0;
  ASSERT_EQ(initialized(&flag), 0);
  EXPECT_EQ(flag, 1);
}

// Every strategy's attention layer, forward and backward, with a GPU per rank over NCCL
// against the float64 reference (threads mode: the ranks' outputs meet in this process).
TEST(gpu_nccl, every_strategy_over_nccl_matches_the_reference) {
  if (gpus() < 1) GTEST_SKIP() << "no GPU";
  if (launcher_environment()) GTEST_SKIP() << "needs every rank in this process";
  for (int cp : group_sizes())
    for (auto kind : {strategy_kind::ulysses, strategy_kind::upipe, strategy_kind::ring}) {
      const std::vector<int> chunks = kind == strategy_kind::upipe ? valid_head_chunks(8, cp) : std::vector<int>{0};
      for (int u : chunks) {
        attention_config c{.seq_len = 1024, .heads = 8, .kv_heads = 2, .head_dim = 64, .model_dim = 256, .cp = cp,
                           .head_chunk = u, .strategy = kind};
        experiment_options o;
        o.backend = backend_kind::cuda;
        o.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
        o.comm = {comm_kind::nccl, 60};
        const experiment_result r = run_attention_experiment(c, o);
        ASSERT_TRUE(r.max_rel_error.has_value());
        std::printf("nccl C=%d %s U=%d: max relative error %.2e\n", cp, std::string(strategy_name(kind)).c_str(), u,
                    *r.max_rel_error);
        for (const auto& [name, e] : r.rel_error)
          EXPECT_LT(e, 2e-2) << strategy_name(kind) << " C=" << cp << " U=" << u << " " << name;
        if (cp > 1) EXPECT_FALSE(r.bytes_sent.empty()) << "no collective ran";
      }
    }
}

// A whole model's loss and gradients with a GPU per rank over NCCL against the cpu
// backend on one rank, for every strategy.
TEST(gpu_nccl, model_gradients_over_nccl_match_the_cpu_backend_on_one_rank) {
  if (gpus() < 1) GTEST_SKIP() << "no GPU";
  if (launcher_environment()) GTEST_SKIP() << "needs every rank in this process";
  const int cp = group_sizes().back();
  model_step_request req;
  req.model = preset("tiny-llama");
  req.options.mlp_tile = 24;
  req.options.loss_chunk = 40;
  req.cp = {strategy_kind::ulysses, 1, 0};
  const host_weights w = random_weights(req.model, 5);
  std::vector<std::int32_t> tokens(512);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 53 + 7) % 256);
  req.limits = {std::size_t{256} << 20, std::size_t{64} << 20};
  const model_step_result cpu = run_model_step(req, w, tokens);
  for (auto kind : {strategy_kind::ulysses, strategy_kind::upipe, strategy_kind::ring}) {
    req.cp = {kind, cp, 0};
    req.backend = backend_kind::cuda;
    req.limits = {std::size_t{1} << 30, std::size_t{64} << 20};
    req.comm = {comm_kind::nccl, 60};
    const model_step_result gpu = run_model_step(req, w, tokens);
    std::printf("nccl C=%d %s: loss %.6f, cpu C=1 %.6f\n", cp, std::string(strategy_name(kind)).c_str(), gpu.loss,
                cpu.loss);
    EXPECT_LT(std::abs(gpu.loss - cpu.loss) / cpu.loss, 1e-2) << strategy_name(kind);
    for (const auto& [param, values] : cpu.grads)
      EXPECT_LT(testing::max_difference_over_max(gpu.grads.at(param), values), 5e-2) << strategy_name(kind) << " C=" << cp << " " << param;
  }
}

// Three optimizer steps over NCCL (in either launch mode) against the same steps on one
// rank: the first loss checks the forward, the later ones the gradients' reduction and
// the sharded update.
TEST(gpu_nccl, training_steps_over_nccl_equal_the_steps_on_one_rank) {
  if (gpus() < 1) GTEST_SKIP() << "no GPU";
  const int cp = group_sizes().back();
  for (strategy_kind kind : {strategy_kind::ulysses, strategy_kind::upipe, strategy_kind::ring})
  for (bool overlap : {false, true}) {
    if (kind == strategy_kind::ring && (cp == 1 || overlap)) continue;
    train_options o;
    o.model = preset("tiny-llama");
    o.seq_len = 256;
    o.cp = {kind, cp, 0};
    o.zero = zero_stage::three;
    o.optim.total_steps = 3;
    o.optim.lr = 1e-2;
    o.eval_samples = 0;
    o.backend = backend_kind::cuda;
    o.limits = {std::size_t{512} << 20, std::size_t{64} << 20};
    o.comm = {comm_kind::nccl, 60};
    o.step.overlap_comm = overlap;
    o.step.prefetch_weights = overlap;
    const step_timing nccl = time_steps(o, 0, 3, group_run::every_rank);
    train_options one = o;  // the reference: the same steps on one rank
    one.cp = {strategy_kind::ulysses, 1, 0};
    one.comm = {comm_kind::threads, 60};
    const step_timing single = time_steps(one, 0, 3, group_run::every_rank);
    if (nccl.losses.empty()) continue;  // a rank other than 0 under a launcher keeps no results
    ASSERT_EQ(nccl.losses.size(), 3u);
    for (std::size_t i = 0; i < 3; ++i) {
      std::printf("nccl C=%d %s overlap=%d step %zu: loss %.6f, one rank %.6f; |g| %.6f, one rank %.6f\n", cp,
                  std::string(strategy_name(kind)).c_str(), overlap, i + 1, nccl.losses[i], single.losses[i],
                  nccl.grad_norms[i], single.grad_norms[i]);
      EXPECT_LT(std::abs(nccl.losses[i] - single.losses[i]) / single.losses[i], 1e-2)
          << strategy_name(kind) << " C=" << cp << " overlap=" << overlap << " step " << i + 1;
      // AdamW's step hardly depends on the gradients' scale, so the losses alone would miss
      // a reduction off by a factor (a sum for a mean, a rank left out): the norm does not.
      EXPECT_LT(std::abs(nccl.grad_norms[i] - single.grad_norms[i]) / single.grad_norms[i], 2e-2)
          << strategy_name(kind) << " C=" << cp << " overlap=" << overlap << " step " << i + 1;
    }
  }
}

// The watchdog times a collective from when it can start: one queued behind compute that
// outlasts the timeout (a layer at millions of tokens) is not a hang.
TEST(gpu_nccl, watchdog_does_not_time_a_collective_waiting_for_compute) {
  if (gpus() < 1) GTEST_SKIP() << "no GPU";
  const memory_limits limits{std::size_t{64} << 20, std::size_t{16} << 20};
  std::vector<float> got(16);
  run_cp_group(
      backend_kind::cuda, limits, 1,
      [&](int, backend& be, communicator& comm) {
        tensor x = be.allocate(mem_tag::comm, dtype::f32, {16}, "x");
        const std::vector<float> ones(16, 1.0f);
        be.upload_f32(x, ones.data());
        // The compute stream sleeps for 4 s before the collective can start: past the 1 s timeout.
        auto* stream = static_cast<cudaStream_t>(be.native_stream());
        ASSERT_EQ(cudaLaunchHostFunc(
                      stream, [](void*) { std::this_thread::sleep_for(std::chrono::seconds(4)); }, nullptr),
                  cudaSuccess);
        comm.all_reduce_sum(x.as<float>(), 16, "behind_compute");
        be.download_f32(got.data(), x);
      },
      group_run::every_rank, {comm_kind::nccl, 1.0});
  EXPECT_EQ(got, std::vector<float>(16, 1.0f));
}

// A collective that a rank never joins aborts the group past the timeout, with a message
// naming the rank, the collective, its label and the layer; no rank is left waiting.
TEST(gpu_nccl, watchdog_aborts_a_collective_a_rank_never_joins_and_names_it) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs: a group of one cannot wait for a peer";
  if (launcher_environment()) GTEST_SKIP() << "needs every rank in this process";
  const memory_limits limits{std::size_t{64} << 20, std::size_t{16} << 20};
  std::string message;
  try {
    run_cp_group(
        backend_kind::cuda, limits, 2,
        [&](int rank, backend& be, communicator& comm) {
          if (rank == 1) return;  // never joins
          tensor x = be.allocate(mem_tag::comm, dtype::f32, {16}, "x");
          set_current_layer(7);
          comm.all_reduce_sum(x.as<float>(), 16, "stuck_grads");
          set_current_layer(-1);
          comm.barrier();  // waits on the host, until the watchdog aborts the group
        },
        group_run::every_rank, {comm_kind::nccl, 1.0});
  } catch (const comm_aborted& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("rank 0: all_reduce 'stuck_grads' in layer 7 did not complete within 1 s"), std::string::npos)
      << message;
}

// The watchdog aborts the group while a rank thread keeps issuing collectives on the same
// communicator (the race of issue #23): rank 0 enqueues collectives that can never finish,
// with no host wait, and without a bound it would sit inside an NCCL launch, behind a full
// launch queue, when ncclCommAbort runs on another thread. With non-blocking communicators,
// the lock around every call and the bound on collectives in flight, the rank sees
// comm_aborted and the group ends, round after round, without a crash or a hang.
TEST(gpu_nccl, watchdog_aborts_while_a_rank_issues_collectives) {
  if (gpus() < 2) GTEST_SKIP() << "needs two GPUs: a group of one cannot wait for a peer";
  if (launcher_environment()) GTEST_SKIP() << "needs every rank in this process";
  const memory_limits limits{std::size_t{64} << 20, std::size_t{16} << 20};
  for (int round = 0; round < 3; ++round) {
    std::atomic<long> issued{0};
    std::string message;
    try {
      run_cp_group(
          backend_kind::cuda, limits, 2,
          [&](int rank, backend& be, communicator& comm) {
            if (rank == 1) return;  // never joins
            tensor send = be.allocate(mem_tag::comm, dtype::f32, {64}, "send");
            tensor recv = be.allocate(mem_tag::comm, dtype::f32, {128}, "recv");
            for (long i = 0; i < 1000000; ++i) {
              comm_request r = comm.all_gather_start(send.data(), recv.data(), 64 * sizeof(float), "racing");
              r.wait();  // the compute stream waits for it; the host does not
              issued.fetch_add(1);
            }
          },
          group_run::every_rank, {comm_kind::nccl, 0.5});
    } catch (const comm_aborted& e) {
      message = e.what();
    }
    EXPECT_NE(message.find("all_gather 'racing'"), std::string::npos) << "round " << round << ": " << message;
    EXPECT_NE(message.find("did not complete within"), std::string::npos) << message;
    EXPECT_GT(issued.load(), 1) << "round " << round;  // the rank was issuing when the abort came
  }
}

}  // namespace
}  // namespace upipe
