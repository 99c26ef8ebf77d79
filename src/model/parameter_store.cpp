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

// The unit of a sparse layer's routed experts: after the head, in layer order.
int expert_unit(const model_config& config, int layer) {
  int sparse_below = 0;
  for (int l = 0; l < layer; ++l) sparse_below += config.sparse_layer(l) ? 1 : 0;
  return config.num_layers + 2 + sparse_below;
}

int unit_of(const model_config& config, const std::string& name) {
  const int layers = config.num_layers;
  if (const std::optional<expert_place> expert = expert_of(config, name)) return expert_unit(config, expert->layer);
  if (const std::optional<std::int64_t> layer = layer_of(name)) {
    UPIPE_CHECK(*layer >= 0 && *layer < layers, "parameter " + name + " lies outside the model's layers");
    return 1 + static_cast<int>(*layer);
  }
  return name == "model.embed_tokens.weight" ? 0 : layers + 1;
}

// The units of `specs`: the embedding, the layers, the head, and the routed experts of each
// sparse layer where the specs hold experts.
int unit_total(const model_config& config, const std::vector<parameter_spec>& specs) {
  const bool experts =
      std::any_of(specs.begin(), specs.end(), [&](const parameter_spec& p) { return expert_of(config, p.name).has_value(); });
  return config.num_layers + 2 + (experts ? config.sparse_layer_count() : 0);
}

// A (1, count) view at element `offset` of a (1, n) tensor.
mat_view slice(const tensor& t, std::int64_t offset, std::int64_t count) {
  return t.matrix().col_block(offset, count);
}

}  // namespace

std::vector<std::vector<unit_parameter>> parameter_units(const model_config& config) {
  const std::vector<parameter_spec> specs = parameter_specs(config);
  std::vector<std::vector<unit_parameter>> units(static_cast<std::size_t>(unit_total(config, specs)));
  std::vector<std::int64_t> sizes(units.size(), 0);
  for (const parameter_spec& spec : specs) {
    const int u = unit_of(config, spec.name);
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
                                 offload_options offload, const optimizer_state_options& state,
                                 const expert_sharding& experts)
    : parameter_store(config, parameter_specs(config), be, comm, stage, offload, weight_role::trained, state, experts) {}

parameter_store::parameter_store(const model_config& config, std::vector<parameter_spec> specs, backend& be,
                                 communicator& comm, zero_stage stage, offload_options offload, weight_role role,
                                 const optimizer_state_options& state, const expert_sharding& experts)
    : config_(config), be_(be), comm_(comm), stage_(stage), offload_(offload), state_(state), role_(role),
      experts_(experts) {
  UPIPE_CHECK(!offload.master_on_host() || stage == zero_stage::two || stage == zero_stage::three,
              "the optimizer is offloaded only when it is sharded (ZeRO-2 or ZeRO-3)");
  UPIPE_CHECK(!offload.params || offload.master_on_host(), "the parameters are offloaded only with the master weights");
  UPIPE_CHECK(state.grad_type == dtype::f32 || state.grad_type == dtype::bf16,
              "gradient shards are kept in f32 or bf16");
  const bool trains = role == weight_role::trained && (stage == zero_stage::two || stage == zero_stage::three);
  if (!trains) state_ = {};  // no optimizer state: the format has nothing to hold
  check_expert_sharding(config, experts_);
  // Under expert parallelism the store holds its EP rank's experts alone.
  const expert_range mine = local_experts();
  for (parameter_spec& spec : specs) {
    const std::optional<expert_place> expert = expert_of(config, spec.name);
    if (!expert || mine.count < 0 || (expert->expert >= mine.first && expert->expert < mine.first + mine.count))
      specs_.push_back(std::move(spec));
  }
  for (int u = unit_total(config, specs_); u > 0; --u) units_.push_back(std::make_unique<unit>());
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    unit& u = *units_[unit_of(config, specs_[i].name)];
    u.params.push_back(i);
    u.offsets.push_back(u.numel);
    u.numel += element_count(specs_[i].shape);
  }
  for (int l = 0; l < config.num_layers; ++l)
    if (config.sparse_layer(l) && units_.size() > static_cast<std::size_t>(config.num_layers + 2))
      units_[static_cast<std::size_t>(layer_unit(l))]->companion = expert_unit(config, l);
  for (std::size_t i = 0; i < units_.size(); ++i) {
    unit& u = *units_[i];
    const bool routed = static_cast<int>(i) >= config.num_layers + 2;
    u.comm = routed && experts_.replicas != nullptr ? experts_.replicas : &comm;
    u.canonical_numel = routed ? u.numel * experts_.groups : u.numel;
    u.canonical_offset = routed ? u.numel * experts_.group : 0;
    // q8's absmax blocks of a saved unit must not straddle two EP ranks' experts.
    if (routed && experts_.groups > 1 && state_.format.moments == moment_format::q8 && u.numel % q8_block != 0)
      throw config_error("--optimizer-state 8bit with --ep " + std::to_string(experts_.groups) + ": a rank's " +
                         std::to_string(u.numel) + " expert parameters of a layer are not whole blocks of " +
                         std::to_string(q8_block) + "; use --optimizer-state bf16, or --ep 1");
    const int C = u.comm->size();
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

void check_expert_sharding(const model_config& config, const expert_sharding& e) {
  if (e.groups == 1) return;
  UPIPE_CHECK(e.groups > 1 && e.group >= 0 && e.group < e.groups && e.peers != nullptr && e.replicas != nullptr &&
                  e.peers->size() == e.groups && e.peers->rank() == e.group,
              "expert sharding over " + std::to_string(e.groups) + " groups needs this rank's EP group and replicas");
  if (config.sparse_layer_count() == 0 || config.moe.experts % e.groups != 0)
    throw config_error("--ep " + std::to_string(e.groups) + " must divide the model's " +
                       std::to_string(config.moe.experts) + " experts (" + config.name +
                       (config.sparse_layer_count() == 0 ? " has no sparse layer: use --ep 1)" : ")"));
}

expert_range parameter_store::local_experts() const {
  if (experts_.groups == 1) return {};
  const int count = config_.moe.experts / experts_.groups;
  return {experts_.group * count, count};
}

bool parameter_store::is_expert_unit(int u) const { return u >= config_.num_layers + 2 && u < unit_count(); }

parameter_store::~parameter_store() { wait_all_host(); }

parameter_store::unit& parameter_store::at(int u) const {
  UPIPE_CHECK(u >= 0 && u < static_cast<int>(units_.size()), "no parameter unit " + std::to_string(u));
  return *units_[u];
}

void parameter_store::acquire(int index) {
  // One unit ahead: its update's host half runs while this one computes.
  if (!pending_updates_.empty()) issue_updates_through(update_bound(index, 1));
  for (unit* u : with_companion(index)) {
    if (offload_.master_on_host()) acquire_offloaded(*u);
    else gather_on_first_acquire(*u);
  }
}

// The last unit whose pending update must be issued before unit `index` (and `ahead` more)
// is used: a sparse layer's experts live in a unit numbered after the layers and the head,
// so their update, and those queued before it, go with the layer's.
int parameter_store::update_bound(int index, int ahead) const {
  const int bound = std::min(index + ahead, unit_count() - 1);
  const int companion = at(index).companion;
  return companion < 0 ? bound : std::max(bound, companion);
}

std::vector<parameter_store::unit*> parameter_store::with_companion(int index) const {
  unit& u = at(index);
  if (u.companion < 0) return {&u};
  return {&u, &at(u.companion)};
}

void parameter_store::gather_on_first_acquire(unit& u) {
  if (stage_ != zero_stage::three || u.acquired++ > 0) return;
  if (!u.weights.empty()) {  // prefetched
    u.gathering.wait();
    return;
  }
  u.weights = be_.allocate(mem_tag::weights, be_.work_dtype(), {1, u.padded}, "gathered_weights");
  u.comm->all_gather(u.weight_shard.data(), u.weights.data(), u.weight_shard.bytes(), "zero3_all_gather");
}

void parameter_store::prefetch(int index) {
  if (!pending_updates_.empty()) issue_updates_through(update_bound(index, 0));
  for (unit* up : with_companion(index)) {
    unit& u = *up;
    if (offload_.master_on_host()) {
      prefetch_offloaded(u);
      continue;
    }
    if (stage_ != zero_stage::three || u.acquired > 0 || !u.weights.empty()) continue;
    u.weights = be_.allocate(mem_tag::weights, be_.work_dtype(), {1, u.padded}, "gathered_weights");
    u.gathering =
        u.comm->all_gather_start(u.weight_shard.data(), u.weights.data(), u.weight_shard.bytes(), "zero3_all_gather");
  }
}

void parameter_store::release(int index) {
  for (unit* up : with_companion(index)) {
    unit& u = *up;
    if (offload_.params) {
      release_offloaded(u);
      continue;
    }
    if (stage_ != zero_stage::three) continue;
    UPIPE_CHECK(u.acquired > 0, "release of a unit that was not acquired");
    if (--u.acquired == 0) u.weights.reset();
  }
}

void parameter_store::open_grads(int index) {
  UPIPE_CHECK(stage_ != zero_stage::inference, "an inference store has no gradients");
  if (stage_ == zero_stage::replicated || role_ == weight_role::frozen) return;
  for (unit* u : with_companion(index)) {
    UPIPE_CHECK(u->grads.empty(), "a unit's gradients open once per micro-batch");
    u->grads = be_.allocate_zeroed(mem_tag::grads, dtype::f32, {1, u->padded}, "unit_grads");
  }
}

// Each unit's gradients are complete once its backward is done: reduce-scatter them in
// fp32 into this rank's shard (kept, on the device or the host) or into an update
// (streamed), and free the full copy.
void parameter_store::close_grads(int index) {
  if (stage_ == zero_stage::replicated || role_ == weight_role::frozen) return;
  issue_all_updates();  // the last step's update reads the kept shard this overwrites
  const int companion = at(index).companion;
  for (const int i : {index, companion}) {
    if (i < 0) continue;
    UPIPE_CHECK(!at(i).grads.empty(), "close of gradients that are not open");
    if (offload_.moments_on_host()) close_offloaded(i);
    else close_on_device(i);
  }
}

bool parameter_store::grads_open(int index) const {
  if (stage_ == zero_stage::replicated || role_ == weight_role::frozen) return true;
  for (const unit* u : with_companion(index))
    if (u->grads.empty()) return false;
  return true;
}

mat_view parameter_store::param_view(const unit& u, const tensor& flat, std::size_t k) const {
  const auto& shape = specs_[u.params[k]].shape;
  const std::int64_t rows = shape.size() == 1 ? 1 : shape[0], cols = shape.back();
  const mat_view v = slice(flat, u.offsets[k], rows * cols);
  return {v.data, v.type, rows, cols, cols};
}

mat_view parameter_store::named(const std::string& name, bool grad) const {
  if (grad && role_ == weight_role::frozen) return {};
  const unit& u = at(unit_of(config_, name));
  for (std::size_t k = 0; k < u.params.size(); ++k) {
    if (specs_[u.params[k]].name != name) continue;
    const tensor& flat = grad ? u.grads : u.weights;
    UPIPE_CHECK(!flat.empty(), name + (grad ? ": gradients not open" : ": weights not acquired"));
    return param_view(u, flat, k);
  }
  throw internal_error("no parameter named " + name);
}

layer_params parameter_store::layer(int l) const {
  return make_layer_params(config_, l, [&](const std::string& n) { return named(n, false); }, local_experts());
}
layer_params parameter_store::layer_grads(int l) const {
  return make_layer_params(config_, l, [&](const std::string& n) { return named(n, true); }, local_experts());
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
  for (auto& up : units_) {
    unit& u = *up;
    const std::int64_t r = u.comm->rank();
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

std::int64_t parameter_store::unit_numel(int u) const { return at(u).canonical_numel; }
std::int64_t parameter_store::unit_shard(int u) const { return at(u).shard; }

std::vector<std::pair<std::string, std::int64_t>> parameter_store::unit_parameters(int u) const {
  const unit& x = at(u);
  std::vector<std::pair<std::string, std::int64_t>> out;
  for (std::size_t k = 0; k < x.params.size(); ++k) out.emplace_back(specs_[x.params[k]].name, x.offsets[k]);
  return out;
}

std::vector<float> parameter_store::gather_flat(const unit& u, const tensor& shard) {
  tensor full = be_.allocate(mem_tag::workspace, dtype::f32, {1, u.padded}, "gathered_state");
  u.comm->all_gather(shard.data(), full.data(), shard.bytes(), "gather_state");
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
  void* mine = u.weights.data() == nullptr ? nullptr : static_cast<char*>(u.weights.data()) + u.comm->rank() * bytes;
  u.comm->all_gather(mine, u.weights.data(), bytes, "zero2_all_gather");
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
