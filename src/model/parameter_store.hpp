// The model's parameters on one rank, held as units (the embedding, each layer, the
// head) and, for training, sharded over the CP group (docs/design.md section 5):
// - replicated: full weights and full f32 gradients on every rank, no optimizer state
//   (the model-level entry; gradients are summed by the caller);
// - ZeRO-2: full working-dtype weights on every rank; each unit's f32 gradients exist in
//   full only while its backward runs and are then reduce-scattered; the fp32 master
//   weights and AdamW moments are sharded, so each rank updates 1/C and the updated
//   weights are all-gathered;
// - ZeRO-3: the working weights are sharded too and each unit is all-gathered just in
//   time (acquire) and freed after use (release), in forward and again in backward;
// - inference: the working weights whole on every rank and nothing else (forward only:
//   no gradients, no master weights, no moments).
// A unit's flat vector is padded to a multiple of C; rank r owns the r-th equal slice.
// A frozen store (LoRA's base) holds the working weights alone, whole or (ZeRO-3) sharded and
// gathered just in time: no gradients, no master weights, no moments; its gradient views
// are empty, so that no weight-gradient GEMM runs for it.
// AdamW's state takes a format (docs/design.md section 5, "Lean optimizer state"): f32,
// bf16 or q8 moments, an f32 master or bf16 weights with a Kahan compensation (on a bf16
// device the working shard itself is then the master), gradient shards kept in f32 or bf16
// until the update, or none kept at all (streamed: each unit is updated as its gradients
// arrive, when nothing waits for the global norm).
// With the optimizer offloaded (ZeRO-2/3), the master weights, AdamW's moments and the
// gradient shards live in host memory (tag optimizer_host, the backend's host pool: pinned
// on the GPU): each unit's gradients leave the device as soon as they are reduce-scattered,
// and the host's cores (core/host_pool) add, sum and update them with the cpu backend's
// arithmetic beside the device's work (parameter_store_offload.cpp), writing the
// working-dtype weights that go back to the device when it next needs them. With the
// master alone in host memory, the moments and gradients stay on the device, which runs
// the moments' half of AdamW and sends each element's step to the host, where the
// master's half runs (parameter_store_state.cpp). With the parameters offloaded too, the
// working-dtype weights live in host memory (tag weights_host): each unit comes to the
// device (ZeRO-3: its shard, then gathered) on the copy stream ahead of its use and leaves
// it when released. Overlapped (offload_options::overlap, the default), a step's update
// goes on beside the next step's forward, which waits for each unit's own (with the master
// alone on the host even the device's half of a unit's update is issued only when the
// next forward reaches the unit); off, adamw_step() returns with the update done.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "comm/communicator.hpp"
#include "model/config.hpp"
#include "model/hf_model.hpp"
#include "model/parameters.hpp"
#include "model/weights.hpp"
#include "ops/op_args.hpp"
#include "optim/host_optimizer.hpp"
#include "optim/optimizer.hpp"

namespace upipe {

enum class zero_stage : std::uint8_t { replicated, two, three, inference };

// The units a model's parameters are held in: the embedding, each layer, then the final
// norm with the head, then each sparse layer's routed experts (expert by expert: gate, up,
// down), which expert parallelism shards otherwise than the rest. Each lists its
// parameters (Hugging Face name, element offset in the unit's flat vector, element count)
// in parameter_specs order.
struct unit_parameter {
  std::string name;
  std::int64_t offset = 0, numel = 0;
};
std::vector<std::vector<unit_parameter>> parameter_units(const model_config& config);

// What of a sharded store lives in host memory (--offload).
struct offload_options {
  bool optimizer = false;  // master weights, AdamW's moments, gradient shards; AdamW on the host
  bool params = false;     // the working-dtype weights too (with the master)
  bool master = false;     // the master weights alone (the moments and gradients stay on the device)
  // The update beside the next step's work (docs/design.md section 5): each unit's update
  // goes on while the next forward runs, which waits for that unit's alone; a weight copy
  // starts once its update is done, never holding up the issue of the compute. Off: the
  // step's update is done when adamw_step() returns (the step without overlap).
  bool overlap = true;
  bool master_on_host() const { return optimizer || master; }
  bool moments_on_host() const { return optimizer; }
};

// Whether a step keeps its gradient shards until the update (for the global norm of
// clipping, or to add a later micro-batch), or streams them: each unit updated as its
// gradients arrive, nothing kept (no clipping, one micro-batch a step).
enum class grad_keeping : std::uint8_t { kept, streamed };

// How a trained store holds AdamW's state (--optimizer-state, --master-weights, --grad-dtype).
struct optimizer_state_options {
  adamw_state_format format;
  dtype grad_type = dtype::f32;  // the kept gradient shards: f32 or bf16
  grad_keeping grads = grad_keeping::kept;
  bool operator==(const optimizer_state_options&) const = default;
};

// The bytes of one element of a shard's state on each side: the master's (the master and
// its compensation, less what the working copy is), the moments' (with q8's absmax), the
// kept gradient's. What the store allocates, per element.
struct state_element_bytes {
  double master = 0, moments = 0, grad = 0;
};
state_element_bytes state_bytes_per_element(const optimizer_state_options& state, dtype work);

// The host memory one rank's fully offloaded fp32 optimizer holds: per unit, its shard of
// the fp32 master weights, the two moments and the gradients, and the working-dtype
// weights on their way to the device.
std::size_t offloaded_optimizer_bytes(const model_config& config, int ranks, dtype work);
// All the host memory one rank's offload holds: the state the offload puts there (the
// master side's and, with the optimizer, the moments' and kept gradients', in `state`'s
// format), the working copy on its way to the device (unless the parameters live on the
// host anyway, or it is the master); the working-dtype weights, this rank's shard (ZeRO-3)
// or whole (ZeRO-2), with `offload.params`; the gradient shards or steps of the two
// largest units on their way (a later micro-batch's, streamed gradients, the master's
// half's steps).
std::size_t offloaded_bytes(const model_config& config, int ranks, dtype work, zero_stage stage,
                            offload_options offload, std::int64_t micro_batches,
                            const optimizer_state_options& state = {});
// A unit's padded length: a multiple of the ranks (and of q8_block ranks with q8 moments,
// so that every rank's shard is whole blocks).
std::int64_t padded_unit(std::int64_t numel, int ranks, const optimizer_state_options& state);

// The sharded optimizer state of a unit: the master weights and AdamW's moments, and what
// the lean formats add: bf16-kahan's compensation and q8's absmax per block (its
// elements are blocks).
enum class shard_state : std::uint8_t { master, exp_avg, exp_avg_sq, master_comp, exp_avg_absmax, exp_avg_sq_absmax };
// The state tensors a format has, and how each is stored (f32, bf16, u8).
std::vector<shard_state> state_tensors(const adamw_state_format& format);
dtype state_dtype(const adamw_state_format& format, shard_state which);
const char* state_name(shard_state which);

// Whether a store's weights are trained (gradients and, sharded, optimizer state) or frozen.
enum class weight_role : std::uint8_t { trained, frozen };

// Expert parallelism (docs/design.md section 12): the store holds its EP rank's routed
// experts alone, [group L, (group + 1) L) of each sparse layer's (L = experts / groups),
// each layer's experts one unit (the whole layer's, as parameter_units lists it, is the
// EP ranks' blocks in EP order), sharded over `replicas`, the ranks that hold the same
// experts, instead of the store's group; `peers` (the EP group) gathers a unit whole.
// With groups = 1 every rank holds every expert and the expert units shard as any other.
struct expert_sharding {
  int groups = 1, group = 0;
  communicator* peers = nullptr;     // the EP group (rank = group)
  communicator* replicas = nullptr;  // the ranks holding this rank's experts
};
// Throws config_error when the model's experts do not split over `groups` (internal_error
// when the groups are not this rank's).
void check_expert_sharding(const model_config& config, const expert_sharding& experts);

class parameter_store {
 public:
  parameter_store(const model_config& config, backend& be, communicator& comm, zero_stage stage,
                  offload_options offload = {}, const optimizer_state_options& state = {},
                  const expert_sharding& experts = {});
  // A store of the parameters `specs` (units by layer as above: the embedding's and the
  // head's units hold those of their names, possibly none), e.g. LoRA's adapters.
  parameter_store(const model_config& config, std::vector<parameter_spec> specs, backend& be, communicator& comm,
                  zero_stage stage, offload_options offload, weight_role role,
                  const optimizer_state_options& state = {}, const expert_sharding& experts = {});
  ~parameter_store();  // waits for the host's work on the shards

  zero_stage stage() const { return stage_; }
  weight_role role() const { return role_; }
  bool params_offloaded() const { return offload_.params; }
  const optimizer_state_options& state_options() const { return state_; }
  int embedding_unit() const { return 0; }
  int layer_unit(int layer) const { return 1 + layer; }
  int head_unit() const { return config_.num_layers + 1; }
  // Expert parallelism: the sharding, this rank's experts of each sparse layer, and whether
  // unit u holds routed experts. A sparse layer's unit carries its experts' unit along:
  // acquire, release, prefetch and the gradients' open and close of the layer do both.
  const expert_sharding& experts() const { return experts_; }
  expert_range local_experts() const;
  bool is_expert_unit(int u) const;

  // Full weights of a unit: resident unless ZeRO-3, which gathers them here and frees
  // them in release(). Calls nest (a tied embedding is both input and head).
  void acquire(int unit);
  void release(int unit);
  // ZeRO-3: starts gathering a unit that acquire() will ask for next, so the gather runs
  // beside the current unit's compute (its full weights are held from here); with the
  // parameters offloaded, starts its copy to the device. A no-op otherwise, or when the
  // unit is already gathered or on its way.
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
  // Any parameter by name: its acquired weights, its open gradients (empty when frozen).
  mat_view weight(const std::string& name) const { return named(name, false); }
  mat_view grad(const std::string& name) const { return named(name, true); }

  // Host values in and out, under Hugging Face names. load() fills the weights (and the
  // master copy); every rank passes the same source and reads from it only what it keeps:
  // its shard of every unit under ZeRO-3, every unit in full otherwise.
  void load(const weight_source& source);
  void load(const host_weights& weights) { load(host_weight_source(weights)); }

  // The units as saved state sees them: their unpadded sizes (an expert unit's whole, all
  // EP ranks' experts), this rank's shard of a unit's optimizer state (shard elements,
  // padding included; an expert unit's of its own experts' block), and the parameters of a
  // unit with their offsets in its flat vector (this rank's).
  int unit_count() const { return static_cast<int>(units_.size()); }
  std::int64_t unit_numel(int u) const;
  std::int64_t unit_shard(int u) const;
  // One state tensor of this rank's shard as stored (codes and bf16 values as floats; the
  // absmax by block); offloaded: after the host's update.
  std::vector<float> shard_values(int u, shard_state which);
  std::vector<std::pair<std::string, std::int64_t>> unit_parameters(int u) const;
  // Loads the optimizer state and the weights from a saved state of any rank count:
  // read(unit, which, begin, count, out) gives elements [begin, begin + count) of the
  // unit's unpadded flat state as saved (for q8's absmax, blocks of the unit's vector).
  // Saved in this store's format, the values are taken as they are; saved in another,
  // they are decoded to f32 and encoded in this store's format (an explicit conversion:
  // the caller asks for it).
  using state_reader = std::function<void(int, shard_state, std::int64_t, std::int64_t, float*)>;
  void load_state(const state_reader& read, const adamw_state_format& saved = {});
  // Collective: the unit's master (the weights when replicated) in f32, padded, on every
  // rank (bf16-kahan: the weights plus their compensation); an expert unit's under expert
  // parallelism whole, every EP rank's experts (unpadded).
  std::vector<float> gather_unit(int u);
  host_weights local_grads();  // replicated only: this rank's full gradients

  // The global gradient norm (fp64 over this rank's shards, summed over ranks exactly
  // enough for clipping), then AdamW on the shards and the weights' refresh.
  double grad_norm();
  void adamw_step(const adamw_config& config, std::int64_t step, double lr, double grad_scale);
  void zero_grads();

  // The step's last micro-batch comes next and its update is AdamW at (step, lr).
  // Offloaded, the host then sums each unit's gradient squares as soon as they land and,
  // without clipping (max_grad_norm <= 0, so nothing waits for the global norm), updates
  // the unit there and then, beside the rest of the backward. With streamed gradients
  // (required there) every unit is updated as its gradients arrive, wherever its state
  // is. adamw_step() must follow with the same step and lr.
  void announce_update(const adamw_config& config, std::int64_t step, double lr);
  // Offloaded: AdamW runs on the host after adamw_step() returns, each unit's weights
  // going back when the device next asks for them (with the master alone on the host and
  // the overlap on, even the device's half of a unit's update is issued only as the next
  // forward reaches the unit); this issues what is left and waits until the host is done
  // (benchmarks time a step with its update). Nothing needs it for correctness.
  void finish_host_work();

  // The host's work on the shards timed for the step's phase table: while on, every piece
  // is logged; take_host_times() hands over those that ended since the last take, by kind
  // (host_adamw, host_adamw_master, host_grad_sums, and "host" for all).
  void set_host_timing(bool on) { host_timing_ = on; }
  std::map<std::string, host_work_log::times> take_host_times() { return host_log_.take(); }

 private:
  struct unit;
  unit& at(int u) const;
  std::vector<unit*> with_companion(int u) const;  // the unit, and a sparse layer's experts
  std::vector<float> gather_experts(const unit& u, const std::vector<float>& block);
  mat_view param_view(const unit& u, const tensor& flat, std::size_t index) const;
  mat_view named(const std::string& name, bool grad) const;
  std::vector<float> unit_range(const unit& u, const weight_source& source, std::int64_t lo, std::int64_t hi) const;
  // Throws config_error naming the parameter and element of the first value of `values`
  // (elements [lo, ...) of the unit's flat vector) that is not finite.
  void check_finite(const unit& u, const std::vector<float>& values, std::int64_t lo, const char* what) const;
  host_weights split(const unit& u, const std::vector<float>& flat) const;
  std::vector<float> gather_flat(const unit& u, const tensor& shard);
  // ZeRO-2: this rank's slice of a unit's updated weights, in place, to every rank.
  void share_weight_slice(unit& u);

  // The state (parameter_store_state.cpp).
  void allocate_state(unit& u);
  std::vector<adamw_run> decay_runs(const unit& u) const;
  mat_view working_shard(unit& u) const;  // the shard of working weights AdamW writes (the master when aliased)
  mat_view master_view(unit& u) const;    // the master: its own tensor, or the working shard
  bool master_aliased() const;
  tensor& state_tensor(unit& u, shard_state which) const;
  // AdamW on a unit on the device, from `grad` (the kept shard or a streamed staging):
  // whole, or (master on the host) the moments' half with the steps sent to the host.
  void update_on_device(unit& u, const mat_view& grad, const host_adamw& update);
  void put_values(const tensor& t, const std::vector<float>& values);
  std::vector<float> get_values(const tensor& t) const;
  void load_converted(unit& u, int index, const state_reader& read, const adamw_state_format& saved);

  // The gradients on the device (parameter_store_state.cpp): kept, or streamed into an
  // update as they arrive.
  void close_on_device(int index);
  // The offload (parameter_store_offload.cpp).
  void close_offloaded(int index);
  void acquire_offloaded(unit& u);
  // ZeRO-3, weights on the device: the unit's weights at its first acquire, all-gathered
  // from the shards or waited for where a prefetch gathered them.
  void gather_on_first_acquire(unit& u);
  void prefetch_offloaded(unit& u);
  void release_offloaded(unit& u);
  void bring_params(unit& u);    // params: the unit's copy to the device, on the copy stream
  void return_weights(unit& u);  // optimizer only: AdamW's output to the device weights
  void wait_host(unit& u) const;  // the host's work on the unit done, its incoming gradients freed
  void start_host_work(unit& u, const host_work& work, bool after_device);
  host_shard host_shard_of(unit& u) const;
  // Master on the host, moments on the device: the master's half on the host from the steps
  // in u.direction_host, once they have landed.
  void start_master_half(unit& u, const host_adamw& update);
  double offloaded_grad_norm();
  // Master on the host, moments on the device, kept gradients, overlap on: adamw_step()
  // leaves each unit's update to be issued when the next forward reaches it; this issues
  // those of the units up to `index` (all: unit_count() - 1) in order.
  void issue_updates_through(int index);
  int update_bound(int index, int ahead) const;
  void issue_all_updates() { issue_updates_through(unit_count() - 1); }
  void offloaded_adamw_step(const adamw_config& config, std::int64_t step, double lr, double grad_scale);
  void wait_all_host() noexcept;

  const model_config config_;
  backend& be_;
  communicator& comm_;
  zero_stage stage_;
  offload_options offload_;
  optimizer_state_options state_;
  weight_role role_ = weight_role::trained;
  expert_sharding experts_;
  std::optional<host_adamw> announced_;  // announce_update's, until adamw_step
  std::deque<int> incoming_units_;  // units whose host buffers (gradients, steps) are in flight, oldest first
  std::deque<int> pending_updates_;  // units whose update waits to be issued (issue_updates_through), in order
  host_adamw pending_update_;        // ... and that update
  bool host_timing_ = false;
  host_work_log host_log_;
  std::vector<parameter_spec> specs_;
  std::vector<std::unique_ptr<unit>> units_;
};

}  // namespace upipe
