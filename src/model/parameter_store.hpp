// The model's parameters on one rank, held as units (the embedding, each layer, the
// head) and, for training, sharded over the CP group (DESIGN.md section 5):
// - replicated: full weights and full f32 gradients on every rank, no optimizer state
//   (the model-level entry; gradients are summed by the caller);
// - ZeRO-2: full working-dtype weights on every rank; each unit's f32 gradients exist in
//   full only while its backward runs and are then reduce-scattered; the fp32 master
//   weights and AdamW moments are sharded, so each rank updates 1/C and the updated
//   weights are all-gathered;
// - ZeRO-3: the working weights are sharded too and each unit is all-gathered just in
//   time (acquire) and freed after use (release), in forward and again in backward.
// A unit's flat vector is padded to a multiple of C; rank r owns the r-th equal slice.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/config.hpp"
#include "model/parameters.hpp"
#include "model/weights.hpp"
#include "train/optimizer.hpp"

namespace upipe {

enum class zero_stage : std::uint8_t { replicated, two, three };

class parameter_store {
 public:
  parameter_store(const model_config& config, backend& be, communicator& comm, zero_stage stage);
  ~parameter_store();

  zero_stage stage() const { return stage_; }
  int embedding_unit() const { return 0; }
  int layer_unit(int layer) const { return 1 + layer; }
  int head_unit() const { return config_.num_layers + 1; }

  // Full weights of a unit: resident unless ZeRO-3, which gathers them here and frees
  // them in release(). Calls nest (a tied embedding is both input and head).
  void acquire(int unit);
  void release(int unit);
  // ZeRO-3: starts gathering a unit that acquire() will ask for next, so the gather runs
  // beside the current unit's compute (its full weights are held from here). A no-op
  // otherwise, or when the unit is already gathered or on its way.
  void prefetch(int unit);
  // Full f32 gradients of a unit: zeroed here (persistent when replicated); close_grads
  // reduce-scatters them into this rank's shard and frees them (ZeRO-2/3).
  void open_grads(int unit);
  void close_grads(int unit);
  bool grads_open(int unit) const;

  // Views of acquired weights and open gradients.
  layer_params layer(int l) const;
  layer_params layer_grads(int l) const;
  mat_view embedding() const;
  mat_view embedding_grad() const;
  mat_view final_norm() const;
  mat_view final_norm_grad() const;
  mat_view lm_head() const;  // the embedding when tied
  mat_view lm_head_grad() const;

  // Host values in and out, under Hugging Face names. load() fills the weights (and the
  // master copy); every rank passes the same map.
  void load(const host_weights& weights);
  // Collectives: every rank must call them together.
  host_weights gather_weights();  // fp32 master (ZeRO) or the weights (replicated)
  host_weights gather_moments(int which);  // 0: exp_avg, 1: exp_avg_sq (ZeRO only)
  void load_moments(const host_weights& exp_avg, const host_weights& exp_avg_sq);
  host_weights local_grads();  // replicated only: this rank's full gradients

  // The global gradient norm (fp64 over this rank's shards, summed over ranks exactly
  // enough for clipping), then AdamW on the shards and the weights' refresh.
  double grad_norm();
  void adamw_step(const adamw_config& config, std::int64_t step, double lr, double grad_scale);
  void zero_grads();

 private:
  struct unit;
  unit& at(int u) const;
  mat_view param_view(const unit& u, const tensor& flat, std::size_t index) const;
  mat_view named(const std::string& name, bool grad) const;
  std::vector<float> unit_values(const unit& u, const host_weights& weights) const;
  host_weights split(const unit& u, const std::vector<float>& flat) const;
  std::vector<float> gather_flat(const unit& u, const tensor& shard);

  const model_config config_;
  backend& be_;
  communicator& comm_;
  zero_stage stage_;
  std::vector<parameter_spec> specs_;
  std::vector<std::unique_ptr<unit>> units_;
};

}  // namespace upipe
