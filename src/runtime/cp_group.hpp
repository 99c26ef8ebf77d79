// Runs the ranks of a CP group: a backend of the asked kind per rank and the communicator
// that joins them (threads, NCCL or a loopback).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"

namespace upipe {

// Runs fn(rank, backend, communicator) on every rank of a CP group of `size`: one thread
// per rank, each with its own backend of `kind`, when the backend holds data; rank 0
// alone over a loopback communicator on meta (every rank's shapes are rank 0's), or on
// any backend with group_run::rank_zero_emulated (one GPU measures rank 0 of a group of `size`: its
// memory, compute and device copies of the bytes it would exchange). Real ranks talk
// through `comm` (see comm_kind); under a launcher this process runs its own rank only.
// Returns the backends of the ranks this process ran, so their ledgers can be read
// afterwards.
// Which ranks of the group run: all of them, or rank 0 alone against a loopback (emulated).
enum class group_run { every_rank, rank_zero_emulated };
std::vector<std::unique_ptr<backend>> run_cp_group(backend_kind kind, const memory_limits& limits, int size,
                                                   const std::function<void(int rank, backend& be, communicator& comm)>& fn,
                                                   group_run ranks = group_run::every_rank, const comm_options& comm = {});

// A data-parallel mesh: `dp` replicas, each a CP group of `cp` consecutive ranks
// (docs/design.md section 11).
struct mesh_shape {
  int dp = 1, cp = 1;
  int ep = 1;  // expert parallelism: EP groups of ep consecutive ranks (ep divides dp x cp)
  int ranks() const { return dp * cp; }
};

// What a rank of a mesh talks through: the world (D x C ranks), its replica's CP group
// (the world when D = 1) and ZeRO's group over every rank (comm/replica_mesh.hpp; the world
// when D = 1 or C = 1); with expert parallelism its EP group and the ranks holding its
// experts (split_experts; null when ep = 1).
struct mesh_comms {
  communicator& world;
  communicator& cp;
  communicator& shards;
  communicator* expert_peers = nullptr;
  communicator* expert_replicas = nullptr;
};
using mesh_rank_fn = std::function<void(int rank, backend& be, const mesh_comms& comms)>;

// run_cp_group over the mesh's D x C ranks, each rank given its groups. Emulated or on
// meta, rank 0 of the world alone over a loopback of D x C, its groups loopbacks. Under a
// launcher the job must have D x C processes (config_error naming both otherwise).
std::vector<std::unique_ptr<backend>> run_mesh(backend_kind kind, const memory_limits& limits, mesh_shape mesh,
                                               const mesh_rank_fn& fn, group_run ranks = group_run::every_rank,
                                               const comm_options& comm = {});

}  // namespace upipe
