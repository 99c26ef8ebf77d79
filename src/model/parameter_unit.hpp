// One unit of the parameter store, as parameter_store.cpp and parameter_store_offload.cpp
// both see it (private to the two).
#pragma once

#include <memory>
#include <vector>

#include "core/host_pool.hpp"
#include "model/parameter_store.hpp"

namespace upipe {

struct parameter_store::unit {
  std::vector<std::size_t> params;    // indices into specs_
  std::vector<std::int64_t> offsets;  // element offset of each parameter in the flat vector
  std::int64_t numel = 0, padded = 0, shard = 0;
  communicator* comm = nullptr;  // the ranks it is sharded over: the store's, or (experts under EP) their replicas
  int companion = -1;            // a sparse layer's unit: its routed experts' unit
  // This rank's elements are [canonical_offset, canonical_offset + numel) of the unit as
  // saved (canonical_numel): all of it, but for an expert unit under expert parallelism.
  std::int64_t canonical_offset = 0, canonical_numel = 0;
  tensor weights;       // (1, padded) working dtype on the device: resident, or while acquired (ZeRO-3, offloaded params)
  tensor weight_shard;  // ZeRO-3: (1, shard) working dtype (in host memory with the parameters offloaded)
  int acquired = 0;
  comm_request gathering;  // ZeRO-3: the prefetched gather in flight
  tensor grads;         // (1, padded) f32: persistent when replicated, else while open
  bool reduced = false;  // ZeRO: a micro-batch of this step was reduced into grad_shard
  // ZeRO, each (1, shard) on its side (in host memory where offloaded):
  tensor grad_shard;   // kept gradients, f32 or bf16, beside the moments; none when streamed
  tensor master;       // f32, or bf16 (bf16-kahan); none where the working shard is the master
  tensor master_comp;  // bf16-kahan: bf16, beside the master
  tensor exp_avg, exp_avg_sq;                // f32, bf16 or u8 (q8)
  tensor exp_avg_absmax, exp_avg_sq_absmax;  // q8: (1, shard / q8_block) f32
  std::vector<adamw_run> runs;  // the shard's weight-decay runs (a parameter's part each; the padding none)
  double grad_squares = 0;      // streamed on the device: this step's gradient squares, summed

  // Offloaded.
  tensor host_weights;  // optimizer alone: (1, shard) working dtype, AdamW's output on its way to the device
  tensor host_copy;     // parameters, ZeRO-2: (1, padded) working dtype, the weights whole in host memory
  tensor incoming;      // gradients on their way into the host's work (a later micro-batch's, or streamed)
  tensor direction_host;  // master on the host, moments on the device: the steps for the master's half
  std::unique_ptr<host_batch> task;  // the host's work on this unit's shard in flight (one at a time)
  std::vector<double> block_sums;    // the gradient's squares by block (cpu::sum_squares_block)
  bool summed = false;        // block_sums hold this step's final gradients
  bool updated = false;       // AdamW ran, or runs, on this step's gradients
  bool stale = false;         // the device holds the weights from before AdamW's last update
  // Parameters: the side copies bringing the unit to the device, and (ZeRO-2, after an
  // update) taking the gathered unit back to host_copy, as points to join (0: none).
  std::uint64_t arriving = 0, leaving = 0;
};

}  // namespace upipe
