// The data-parallel mesh of a training run (docs/design.md section 11): D replicas, each a
// CP group of C consecutive ranks (world rank = replica x C + its rank in the group), the
// checks that refuse a mesh the run cannot use, the meshes a job could use instead, and
// where the ranks sit.
#pragma once

#include <string>
#include <vector>

#include "runtime/cp_group.hpp"
#include "train/trainer.hpp"

namespace upipe {

// Every D x C = `ranks`, D ascending, whose CP group the run's model and strategy can split
// (its default U; hybrid's --ring where it divides C) and whose placement holds.
std::vector<mesh_shape> valid_meshes(const train_options& o, int ranks);
// "--dp 1 --cp 8, --dp 2 --cp 4, ..." (or "none").
std::string meshes_text(const std::vector<mesh_shape>& meshes);

// Throws config_error for a mesh the run cannot use, naming the valid meshes of as many
// ranks (an --ep that does not divide the mesh and the experts, naming the valid ones): --dp outside [1, 65536] or a global batch (dp x batch) past max_batch; a CP group
// whose size the strategy cannot split the heads over; with --gpus-per-node G, a CP group
// that crosses a node boundary without spanning whole nodes, or hybrid's all-to-all groups
// across nodes when its ring spans them; under a launcher with NCCL, a job that is not
// D x C processes.
void validate_mesh(const train_options& o);

// The E that --ep may take on the run's mesh: 1 and every divisor of dp x cp that divides
// the model's experts (a dense model: 1 alone).
std::vector<int> valid_expert_parallel(const train_options& o);

// Comment lines (each starting "# ") on the mesh: its shape, each replica's ranks and
// nodes (the first eight replicas), what ZeRO shards over, and the global batch.
std::string mesh_placement(const train_options& o);

}  // namespace upipe
