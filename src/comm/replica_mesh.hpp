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

// Expert parallelism's groups over the same world (docs/design.md section 12), both null
// when ep = 1 (every rank holds every expert):
//   peers     its EP group: the ep consecutive world ranks g ep .. g ep + ep - 1, which send
//             one another the tokens routed to their experts (EP rank b = world rank mod ep);
//   replicas  the world / ep ranks at its place b in every EP group (b, ep + b, 2 ep + b,
//             ...): they hold the same experts and reduce (ZeRO-shard) their gradients.
// Loopbacks split into loopbacks. Throws config_error when ep does not divide the world.
struct expert_groups {
  std::unique_ptr<communicator> peers, replicas;
};
expert_groups split_experts(communicator& world, backend& be, int ep);

}  // namespace upipe
