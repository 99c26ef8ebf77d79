#include "model/parameter_store.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "backend/ops.hpp"
#include "core/shape.hpp"
#include "core/error.hpp"
#include "model/parameters.hpp"
#include "model/parameter_unit.hpp"

namespace upipe {

namespace {

int unit_of(const std::string& name, int layers) {
  if (const std::optional<std::int64_t> layer = layer_of(name)) {
    UPIPE_CHECK(*layer >= 0 && *layer < layers, "parameter " + name + " lies outside the model's layers");
    return 1 + static_cast<int>(*layer);
  }
  return name == "model.embed_tokens.weight" ? 0 : layers + 1;
}

// A (1, count) view at element `offset` of a (1, n) tensor.
mat_view slice(const tensor& t, std::int64_t offset, std::int64_t count) {
  return t.matrix().col_block(offset, count);
}

}  // namespace

std::vector<std::vector<unit_parameter>> parameter_units(const model_config& config) {
  std::vector<std::vector<unit_parameter>> units(static_cast<std::size_t>(config.num_layers + 2));
  std::vector<std::int64_t> sizes(units.size(), 0);
  for (const parameter_spec& spec : parameter_specs(config)) {
    const int u = unit_of(spec.name, config.num_layers);
    units[u].push_back({spec.name, sizes[u], element_count(spec.shape)});
    sizes[u] += element_count(spec.shape);
  }
  return units;
}

std::size_t offloaded_optimizer_bytes(const model_config& config, int ranks, dtype work) {
  std::size_t bytes = 0;
  for (const auto& unit : parameter_units(config)) {
    std::int64_t numel = 0;
    for (const unit_parameter& p : unit) numel += p.numel;
    const auto shard = static_cast<std::size_t>((numel + ranks - 1) / ranks);
    bytes += shard * (4 * sizeof(float) + dtype_size(work));
  }
  return bytes;
}

std::size_t offloaded_bytes(const model_config& config, int ranks, dtype work, zero_stage stage,
                            offload_options offload, std::int64_t micro_batches, const optimizer_state_options& state) {
  if (!offload.master_on_host()) return 0;
  const state_element_bytes per = state_bytes_per_element(state, work);
  double bytes = 0;
  std::size_t largest = 0;
  for (const auto& unit : parameter_units(config)) {
    std::int64_t numel = 0;
    for (const unit_parameter& p : unit) numel += p.numel;
    const auto shard = static_cast<double>(padded_unit(numel, ranks, state) / ranks);
    bytes += shard * per.master;
    if (offload.moments_on_host()) bytes += shard * (per.moments + per.grad);
    // The working copy: on its way to the device (the master itself when aliased), or all
    // of the weights with the parameters.
    if (!offload.params) bytes += shard * static_cast<double>(dtype_size(work));
    else bytes += (stage == zero_stage::three ? shard : shard * ranks) * static_cast<double>(dtype_size(work));
    largest = std::max(largest, static_cast<std::size_t>(shard));
  }
  // f32 buffers of two units on their way: a later micro-batch's or streamed gradients
  // (the moments on the host), or the steps of the master's half (the moments on the device).
  const bool in_flight = offload.moments_on_host() ? micro_batches > 1 || state.grads == grad_keeping::streamed : true;
  if (in_flight) bytes += static_cast<double>(2 * largest * sizeof(float));
  return static_cast<std::size_t>(bytes);
}

parameter_store::parameter_store(const model_config& config, backend& be, communicator& comm, zero_stage stage,
                                 offload_options offload, const optimizer_state_options& state)
    : parameter_store(config, parameter_specs(config), be, comm, stage, offload, weight_role::trained, state) {}

parameter_store::parameter_store(const model_config& config, std::vector<parameter_spec> specs, backend& be,
                                 communicator& comm, zero_stage stage, offload_options offload, weight_role role,
                                 const optimizer_state_options& state)
    : config_(config), be_(be), comm_(comm), stage_(stage), offload_(offload), state_(state), role_(role),
      specs_(std::move(specs)) {
  UPIPE_CHECK(!offload.master_on_host() || stage == zero_stage::two || stage == zero_stage::three,
              "the optimizer is offloaded only when it is sharded (ZeRO-2 or ZeRO-3)");
  UPIPE_CHECK(!offload.params || offload.master_on_host(), "the parameters are offloaded only with the master weights");
  UPIPE_CHECK(state.grad_type == dtype::f32 || state.grad_type == dtype::bf16,
              "gradient shards are kept in f32 or bf16");
  const bool trains = role == weight_role::trained && (stage == zero_stage::two || stage == zero_stage::three);
  if (!trains) state_ = {};  // no optimizer state: the format has nothing to hold
  for (int u = 0; u < config.num_layers + 2; ++u) units_.push_back(std::make_unique<unit>());
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    unit& u = *units_[unit_of(specs_[i].name, config.num_layers)];
    u.params.push_back(i);
    u.offsets.push_back(u.numel);
    u.numel += element_count(specs_[i].shape);
  }
  const int C = comm.size();
  for (auto& up : units_) {
    unit& u = *up;
    u.padded = padded_unit(u.numel, C, state_);
    u.shard = u.padded / C;
    const mem_tag weights = offload.params ? mem_tag::weights_host : mem_tag::weights;
    if (stage == zero_stage::three) {
      u.weight_shard = be.allocate_zeroed(weights, be.work_dtype(), {1, u.shard}, "weight_shard");
    } else if (offload.params) {
      u.host_copy = be.allocate_zeroed(weights, be.work_dtype(), {1, u.padded}, "host_weights_whole");
    } else {
      u.weights = be.allocate_zeroed(weights, be.work_dtype(), {1, u.padded}, "weights");
    }
    if (stage == zero_stage::inference || role_ == weight_role::frozen) continue;
    if (stage == zero_stage::replicated) {
      u.grads = be.allocate_zeroed(mem_tag::grads, dtype::f32, {1, u.padded}, "grads");
      continue;
    }
    allocate_state(u);
  }
}

parameter_store::~parameter_store() { wait_all_host(); }

parameter_store::unit& parameter_store::at(int u) const {
  UPIPE_CHECK(u >= 0 && u < static_cast<int>(units_.size()), "no parameter unit " + std::to_string(u));
  return *units_[u];
}

void parameter_store::acquire(int index) {
  unit& u = at(index);
  // One unit ahead: its update's host half runs while this one computes.
  if (!pending_updates_.empty()) issue_updates_through(std::min(index + 1, unit_count() - 1));
  if (offload_.master_on_host()) return acquire_offloaded(u);
  gather_on_first_acquire(u);
}

void parameter_store::gather_on_first_acquire(unit& u) {
  if (stage_ != zero_stage::three || u.acquired++ > 0) return;
  if (!u.weights.empty()) {  // prefetched
    u.gathering.wait();
    return;
  }
  u.weights = be_.allocate(mem_tag::weights, be_.work_dtype(), {1, u.padded}, "gathered_weights");
  comm_.all_gather(u.weight_shard.data(), u.weights.data(), u.weight_shard.bytes(), "zero3_all_gather");
}

void parameter_store::prefetch(int index) {
  unit& u = at(index);
  if (!pending_updates_.empty()) issue_updates_through(index);
  if (offload_.master_on_host()) return prefetch_offloaded(u);
  if (stage_ != zero_stage::three || u.acquired > 0 || !u.weights.empty()) return;
  u.weights = be_.allocate(mem_tag::weights, be_.work_dtype(), {1, u.padded}, "gathered_weights");
  u.gathering =
      comm_.all_gather_start(u.weight_shard.data(), u.weights.data(), u.weight_shard.bytes(), "zero3_all_gather");
}

void parameter_store::release(int index) {
  unit& u = at(index);
  if (offload_.params) return release_offloaded(u);
  if (stage_ != zero_stage::three) return;
  UPIPE_CHECK(u.acquired > 0, "release of a unit that was not acquired");
  if (--u.acquired == 0) u.weights.reset();
}

void parameter_store::open_grads(int index) {
  unit& u = at(index);
  UPIPE_CHECK(stage_ != zero_stage::inference, "an inference store has no gradients");
  if (stage_ == zero_stage::replicated || role_ == weight_role::frozen) return;
  UPIPE_CHECK(u.grads.empty(), "a unit's gradients open once per micro-batch");
  u.grads = be_.allocate_zeroed(mem_tag::grads, dtype::f32, {1, u.padded}, "unit_grads");
}

// Each unit's gradients are complete once its backward is done: reduce-scatter them in
// fp32 into this rank's shard (kept, on the device or the host) or into an update
// (streamed), and free the full copy.
void parameter_store::close_grads(int index) {
  unit& u = at(index);
  if (stage_ == zero_stage::replicated || role_ == weight_role::frozen) return;
  UPIPE_CHECK(!u.grads.empty(), "close of gradients that are not open");
  issue_all_updates();  // the last step's update reads the kept shard this overwrites
  if (offload_.moments_on_host()) return close_offloaded(index);
  close_on_device(index);
}

bool parameter_store::grads_open(int index) const {
  return stage_ == zero_stage::replicated || role_ == weight_role::frozen || !at(index).grads.empty();
}

mat_view parameter_store::param_view(const unit& u, const tensor& flat, std::size_t k) const {
  const auto& shape = specs_[u.params[k]].shape;
  const std::int64_t rows = shape.size() == 1 ? 1 : shape[0], cols = shape.back();
  const mat_view v = slice(flat, u.offsets[k], rows * cols);
  return {v.data, v.type, rows, cols, cols};
}

mat_view parameter_store::named(const std::string& name, bool grad) const {
  if (grad && role_ == weight_role::frozen) return {};
  const unit& u = at(unit_of(name, config_.num_layers));
  for (std::size_t k = 0; k < u.params.size(); ++k) {
    if (specs_[u.params[k]].name != name) continue;
    const tensor& flat = grad ? u.grads : u.weights;
    UPIPE_CHECK(!flat.empty(), name + (grad ? ": gradients not open" : ": weights not acquired"));
    return param_view(u, flat, k);
  }
  throw internal_error("no parameter named " + name);
}

layer_params parameter_store::layer(int l) const {
  return make_layer_params(config_, l, [&](const std::string& n) { return named(n, false); });
}
layer_params parameter_store::layer_grads(int l) const {
  return make_layer_params(config_, l, [&](const std::string& n) { return named(n, true); });
}
mat_view parameter_store::embedding() const { return named("model.embed_tokens.weight", false); }
mat_view parameter_store::embedding_grad() const { return named("model.embed_tokens.weight", true); }
mat_view parameter_store::final_norm() const { return named("model.norm.weight", false); }
mat_view parameter_store::final_norm_grad() const { return named("model.norm.weight", true); }
mat_view parameter_store::lm_head() const {
  return config_.tie_embeddings ? embedding() : named("lm_head.weight", false);
}
mat_view parameter_store::lm_head_grad() const {
  return config_.tie_embeddings ? embedding_grad() : named("lm_head.weight", true);
}

// Elements [lo, hi) of the unit's padded flat vector from the source (zeros past numel).
std::vector<float> parameter_store::unit_range(const unit& u, const weight_source& source, std::int64_t lo,
                                               std::int64_t hi) const {
  std::vector<float> out(static_cast<std::size_t>(hi - lo), 0.0f);
  for (std::size_t k = 0; k < u.params.size(); ++k) {
    const std::int64_t begin = u.offsets[k], end = begin + element_count(specs_[u.params[k]].shape);
    const std::int64_t a = std::max(lo, begin), b = std::min(hi, end);
    if (a < b) source.read(specs_[u.params[k]].name, a - begin, b - a, out.data() + (a - lo));
  }
  return out;
}

void parameter_store::check_finite(const unit& u, const std::vector<float>& values, std::int64_t lo,
                                   const char* what) const {
  const auto bad = std::find_if(values.begin(), values.end(), [](float v) { return !std::isfinite(v); });
  if (bad == values.end()) return;
  const std::int64_t at = lo + (bad - values.begin());
  for (std::size_t k = 0; k < u.params.size(); ++k) {
    const std::int64_t begin = u.offsets[k], end = begin + element_count(specs_[u.params[k]].shape);
    if (at < begin || at >= end) continue;
    throw config_error(std::string(what) + " of " + specs_[u.params[k]].name + " holds " + std::to_string(*bad) +
                       " at element " + std::to_string(at - begin) +
                       ": the file is damaged or the run that wrote it diverged; start from an earlier checkpoint");
  }
}

host_weights parameter_store::split(const unit& u, const std::vector<float>& flat) const {
  host_weights out;
  for (std::size_t k = 0; k < u.params.size(); ++k) {
    const auto n = element_count(specs_[u.params[k]].shape);
    out.emplace(specs_[u.params[k]].name, std::vector<float>(flat.begin() + u.offsets[k], flat.begin() + u.offsets[k] + n));
  }
  return out;
}

void parameter_store::load(const weight_source& source) {
  wait_all_host();  // the pending updates issued too
  for (auto& up : units_) up->stale = false;
  if (!be_.has_data()) return;
  const std::int64_t r = comm_.rank();
  for (auto& up : units_) {
    unit& u = *up;
    if (stage_ == zero_stage::three) {
      const std::vector<float> mine = unit_range(u, source, r * u.shard, (r + 1) * u.shard);
      check_finite(u, mine, r * u.shard, "the weights");
      be_.upload_f32(u.weight_shard, mine.data());
      if (!u.master.empty()) be_.upload_f32(u.master, mine.data());
      if (!u.host_weights.empty() && master_aliased()) be_.upload_f32(u.host_weights, mine.data());
      continue;
    }
    const std::vector<float> flat = unit_range(u, source, 0, u.padded);
    check_finite(u, flat, 0, "the weights");
    be_.upload_f32(offload_.params ? u.host_copy : u.weights, flat.data());
    if (!u.master.empty()) be_.upload_f32(u.master, flat.data() + r * u.shard);
    // bf16-kahan with the master on the host: the working copy there is the master.
    if (!u.host_weights.empty() && master_aliased()) be_.upload_f32(u.host_weights, flat.data() + r * u.shard);
  }
}

std::int64_t parameter_store::unit_numel(int u) const { return at(u).numel; }
std::int64_t parameter_store::unit_shard(int u) const { return at(u).shard; }

std::vector<std::pair<std::string, std::int64_t>> parameter_store::unit_parameters(int u) const {
  const unit& x = at(u);
  std::vector<std::pair<std::string, std::int64_t>> out;
  for (std::size_t k = 0; k < x.params.size(); ++k) out.emplace_back(specs_[x.params[k]].name, x.offsets[k]);
  return out;
}

std::vector<float> parameter_store::gather_flat(const unit& u, const tensor& shard) {
  tensor full = be_.allocate(mem_tag::workspace, dtype::f32, {1, u.padded}, "gathered_state");
  comm_.all_gather(shard.data(), full.data(), shard.bytes(), "gather_state");
  std::vector<float> flat(static_cast<std::size_t>(u.padded));
  be_.download_f32(flat.data(), full);
  return flat;
}

host_weights parameter_store::local_grads() {
  UPIPE_CHECK(stage_ == zero_stage::replicated, "full local gradients exist only when replicated");
  host_weights out;
  for (auto& up : units_) {
    std::vector<float> flat(static_cast<std::size_t>(up->padded));
    be_.download_f32(flat.data(), up->grads);
    out.merge(split(*up, flat));
  }
  return out;
}

// The fp64 partial sums are added exactly, in rank order, on every rank.
double parameter_store::grad_norm() {
  UPIPE_CHECK(stage_ != zero_stage::replicated, "grad_norm needs sharded gradients");
  issue_all_updates();
  const phase_scope phase(be_, "grad_norm");
  double local = 0;
  if (offload_.moments_on_host()) {
    local = offloaded_grad_norm();
  } else if (state_.grads == grad_keeping::streamed) {
    for (auto& up : units_) {  // summed as they arrived
      UPIPE_CHECK(up->numel == 0 || up->reduced, "grad_norm before every unit's gradients were closed");
      local += up->grad_squares;
    }
  } else {
    for (auto& up : units_) local += ops::sum_squares(be_, up->grad_shard.matrix());
  }
  return std::sqrt(sum_over_ranks(comm_, local, "grad_norm"));
}

void parameter_store::share_weight_slice(unit& u) {
  const std::size_t bytes = static_cast<std::size_t>(u.shard) * dtype_size(u.weights.type());
  void* mine = u.weights.data() == nullptr ? nullptr : static_cast<char*>(u.weights.data()) + comm_.rank() * bytes;
  comm_.all_gather(mine, u.weights.data(), bytes, "zero2_all_gather");
}

void parameter_store::adamw_step(const adamw_config& config, std::int64_t step, double lr, double grad_scale) {
  UPIPE_CHECK(stage_ != zero_stage::replicated, "the optimizer needs sharded state");
  if (offload_.moments_on_host()) return offloaded_adamw_step(config, step, lr, grad_scale);
  issue_all_updates();
  const host_adamw update{config, step, lr, grad_scale};
  // The master alone on the host, overlapped: each unit's update is issued as the next
  // forward reaches it (issue_updates_through), in forward order.
  const bool defer = offload_.master_on_host() && offload_.overlap;
  for (int index = 0; index < unit_count(); ++index) {
    unit& u = *units_[static_cast<std::size_t>(index)];
    if (u.numel == 0) continue;  // a unit with no parameters (LoRA's embedding and head units)
    UPIPE_CHECK(u.reduced, "adamw_step before every unit's gradients were closed");
    if (u.updated) {  // streamed: updated as its gradients arrived
      UPIPE_CHECK(announced_ && announced_->step == step && announced_->lr == lr && grad_scale == 1.0,
                  "an early update ran with another step, learning rate or scale than adamw_step's");
    } else if (defer) {
      pending_updates_.push_back(index);
    } else {
      update_on_device(u, u.grad_shard.matrix(), update);
    }
    u.updated = false;
    if (offload_.master_on_host()) u.stale = true;  // the host writes the working copy
  }
  pending_update_ = update;
  announced_.reset();
  if (stage_ == zero_stage::two && !offload_.master_on_host())
    for (auto& up : units_) share_weight_slice(*up);
  if (offload_.master_on_host() && !offload_.overlap) finish_host_work();  // the step without overlap
}

void parameter_store::issue_updates_through(int index) {
  while (!pending_updates_.empty() && pending_updates_.front() <= index) {
    unit& u = *units_[static_cast<std::size_t>(pending_updates_.front())];
    pending_updates_.pop_front();
    update_on_device(u, u.grad_shard.matrix(), pending_update_);
  }
}

void parameter_store::zero_grads() {
  for (int index = 0; index < unit_count(); ++index) {
    const auto& up = units_[static_cast<std::size_t>(index)];
    up->reduced = false;
    // Offloaded: the first micro-batch's gradients overwrite the host shard (close_grads);
    // so do they a kept device shard that the last step's pending update still reads.
    if (offload_.moments_on_host()) continue;
    if (std::find(pending_updates_.begin(), pending_updates_.end(), index) != pending_updates_.end()) continue;
    tensor& g = stage_ == zero_stage::replicated ? up->grads : up->grad_shard;
    if (be_.has_data() && !g.empty()) be_.fill_bytes(g.data(), 0, g.bytes());
  }
}

}  // namespace upipe
