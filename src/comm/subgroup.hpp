// Sub-groups of a group of ranks (the groups of a data-parallel mesh, comm/replica_mesh.hpp,
// are made of them), and hybrid's 2-D mesh of a CP group: C = R x A ranks, the A ranks of
// one all-to-all group consecutive (a node's GPUs), and the R groups joined by a ring
// (across nodes).
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.hpp"

namespace upipe {

// A communicator over some ranks of `parent` (`members`: their parent ranks, ascending,
// this rank among them). Every parent rank calls it at once, each with its own group's
// members. A loopback parent gives a loopback of the group's size; a parent that splits
// natively (NCCL) gives its own communicator; otherwise the collectives are rounds of the
// parent's point-to-point send_recv (an all-to-all of n ranks is n - 1 rounds, as NCCL's
// own all-to-all is grouped sends and receives), its own chunk a local copy on `be`, and
// its barrier the parent's (every parent rank calls it together). Its counters count its
// own traffic. Throws config_error when this rank is not a member.
std::unique_ptr<communicator> make_subgroup(communicator& parent, backend& be, std::vector<int> members);

// The mesh's two groups for this rank: `all_to_all` over the A = C / R ranks of its group
// (ranks g A .. g A + A - 1), `ring` over the R ranks at its place in each group
// (ranks a, A + a, 2A + a, ...). A loopback parent (rank 0 alone) gives loopbacks of
// those sizes. Throws config_error when R does not divide C.
struct mesh_groups {
  std::unique_ptr<communicator> all_to_all, ring;
};
mesh_groups split_mesh(communicator& parent, backend& be, int rings);

}  // namespace upipe
