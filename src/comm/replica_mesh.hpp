// The communicators of a data-parallel mesh (docs/design.md section 11): D replicas of C
// consecutive world ranks each (world rank w = d C + c: replica d, CP rank c), so that a CP
// group sits inside a node whenever C divides the node's GPUs.
#pragma once

#include <memory>

#include "comm/communicator.hpp"

namespace upipe {

// This rank's groups. Each is null where the world serves: both when D = 1, `shards` when
// C = 1.
//   cp      its replica's C ranks (the attention's group);
//   shards  ZeRO's group: all D x C ranks, numbered CP-major (this rank is c D + d), whose
//           reduce-scatter sums over the CP group first and then across the replicas (over
//           the D ranks at its place c in every replica: c, C + c, 2C + c, ...), and
//           whose all-gather gathers across the replicas and then over the CP group. So a
//           unit's shards still span every rank, the replicas' sum is added in replica
//           order onto each replica's own (as one rank adds its micro-batches), and the
//           traffic across replicas, often across nodes, is 1/C of the unit.
struct replica_groups {
  std::unique_ptr<communicator> cp, shards;
};

// Splits the world (every rank calls it at once) into D = world.size() / cp replicas.
// Loopbacks split into loopbacks. Throws config_error when cp does not divide the world.
replica_groups split_replicas(communicator& world, backend& be, int cp);

}  // namespace upipe
