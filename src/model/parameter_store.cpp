#include "model/parameter_store.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "model/parameters.hpp"
#include "model/parameter_unit.hpp"

namespace upipe {

namespace {

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

int unit_of(const std::string& name, int layers) {
  if (const std::optional<std::int64_t> layer = layer_of(name)) {
    UPIPE_CHECK(*layer >= 0 && *layer < layers, "parameter " + name + " lies outside the model's layers");
    return 1 + static_cast<int>(*layer);
  }
  return name == "model.embed_tokens.weight" ? 0 : layers + 1;
}

// AdamW's weight decay applies to matrices and embeddings, not to norms and biases (as
// transformers' Trainer excludes biases and norm weights).
bool decays(param_kind kind) { return kind == param_kind::matrix || kind == param_kind::embedding; }

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
    units[u].push_back({spec.name, sizes[u], numel_of(spec.shape)});
    sizes[u] += numel_of(spec.shape);
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
                            offload_options offload, std::int64_t micro_batches) {
  if (!offload.optimizer) return 0;
  std::size_t bytes = 0, largest = 0;
  for (const auto& unit : parameter_units(config)) {
    std::int64_t numel = 0;
    for (const unit_parameter& p : unit) numel += p.numel;
    const auto shard = static_cast<std::size_t>((numel + ranks - 1) / ranks);
    bytes += shard * 4 * sizeof(float);
    if (!offload.params) bytes += shard * dtype_size(work);
    else bytes += (stage == zero_stage::three ? shard : shard * static_cast<std::size_t>(ranks)) * dtype_size(work);
    largest = std::max(largest, shard);
  }
  if (micro_batches > 1) bytes += 2 * largest * sizeof(float);
  return bytes;
}

parameter_store::parameter_store(const model_config& config, backend& be, communicator& comm, zero_stage stage,
                                 offload_options offload)
    : parameter_store(config, parameter_specs(config), be, comm, stage, offload, weight_role::trained) {}

parameter_store::parameter_store(const model_config& config, std::vector<parameter_spec> specs, backend& be,
                                 communicator& comm, zero_stage stage, offload_options offload, weight_role role)
    : config_(config), be_(be), comm_(comm), stage_(stage), offload_(offload), role_(role), specs_(std::move(specs)) {
  UPIPE_CHECK(!offload.optimizer || stage == zero_stage::two || stage == zero_stage::three,
              "the optimizer is offloaded only when it is sharded (ZeRO-2 or ZeRO-3)");
  UPIPE_CHECK(!offload.params || offload.optimizer, "the parameters are offloaded only with the optimizer");
  for (int u = 0; u < config.num_layers + 2; ++u) units_.push_back(std::make_unique<unit>());
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    unit& u = *units_[unit_of(specs_[i].name, config.num_layers)];
    u.params.push_back(i);
    u.offsets.push_back(u.numel);
    u.numel += numel_of(specs_[i].shape);
  }
  const int C = comm.size();
  for (auto& up : units_) {
    unit& u = *up;
    u.padded = (u.numel + C - 1) / C * C;
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
    const mem_tag grads = offload.optimizer ? mem_tag::optimizer_host : mem_tag::grads;
    const mem_tag state = offload.optimizer ? mem_tag::optimizer_host : mem_tag::optimizer;
    u.grad_shard = be.allocate_zeroed(grads, dtype::f32, {1, u.shard}, "grad_shard");
    u.master = be.allocate_zeroed(state, dtype::f32, {1, u.shard}, "master_shard");
    u.exp_avg = be.allocate_zeroed(state, dtype::f32, {1, u.shard}, "exp_avg_shard");
    u.exp_avg_sq = be.allocate_zeroed(state, dtype::f32, {1, u.shard}, "exp_avg_sq_shard");
    if (offload.optimizer && !offload.params)
      u.host_weights = be.allocate_zeroed(state, be.work_dtype(), {1, u.shard}, "host_weight_shard");
  }
}

parameter_store::~parameter_store() { wait_all_host(); }

parameter_store::unit& parameter_store::at(int u) const {
  UPIPE_CHECK(u >= 0 && u < static_cast<int>(units_.size()), "no parameter unit " + std::to_string(u));
  return *units_[u];
}

void parameter_store::acquire(int index) {
  unit& u = at(index);
  if (offload_.optimizer) return acquire_offloaded(u);
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
  if (offload_.optimizer) return prefetch_offloaded(u);
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
// fp32 straight into this rank's shard and free the full copy.
void parameter_store::close_grads(int index) {
  unit& u = at(index);
  if (stage_ == zero_stage::replicated || role_ == weight_role::frozen) return;
  UPIPE_CHECK(!u.grads.empty(), "close of gradients that are not open");
  if (offload_.optimizer) return close_offloaded(index);
  if (!u.reduced) {
    comm_.reduce_scatter_sum(u.grads.as<float>(), u.grad_shard.as<float>(), static_cast<std::size_t>(u.shard),
                             "zero_reduce_scatter");
  } else {
    // A later micro-batch of the same step: reduce into a scratch shard and add.
    tensor part = be_.allocate(mem_tag::grads, dtype::f32, {1, u.shard}, "micro_batch_grad_shard");
    comm_.reduce_scatter_sum(u.grads.as<float>(), part.as<float>(), static_cast<std::size_t>(u.shard),
                             "zero_reduce_scatter");
    // As rows of up to 1024 elements, so that a device walks them in parallel.
    std::int64_t row = 1024;
    while (u.shard % row != 0) row /= 2;
    const head_view flat = {nullptr, dtype::f32, u.shard / row, 1, row, row, row};
    head_view dst = flat, src = flat;
    dst.data = u.grad_shard.data();
    src.data = part.data();
    ops::add_heads(be_, dst, src);
  }
  u.grads.reset();
  u.reduced = true;
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
    const std::int64_t begin = u.offsets[k], end = begin + numel_of(specs_[u.params[k]].shape);
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
    const std::int64_t begin = u.offsets[k], end = begin + numel_of(specs_[u.params[k]].shape);
    if (at < begin || at >= end) continue;
    throw config_error(std::string(what) + " of " + specs_[u.params[k]].name + " holds " + std::to_string(*bad) +
                       " at element " + std::to_string(at - begin) +
                       ": the file is damaged or the run that wrote it diverged; start from an earlier checkpoint");
  }
}

host_weights parameter_store::split(const unit& u, const std::vector<float>& flat) const {
  host_weights out;
  for (std::size_t k = 0; k < u.params.size(); ++k) {
    const auto n = numel_of(specs_[u.params[k]].shape);
    out.emplace(specs_[u.params[k]].name, std::vector<float>(flat.begin() + u.offsets[k], flat.begin() + u.offsets[k] + n));
  }
  return out;
}

void parameter_store::load(const weight_source& source) {
  wait_all_host();
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
      continue;
    }
    const std::vector<float> flat = unit_range(u, source, 0, u.padded);
    check_finite(u, flat, 0, "the weights");
    be_.upload_f32(offload_.params ? u.host_copy : u.weights, flat.data());
    if (!u.master.empty()) be_.upload_f32(u.master, flat.data() + r * u.shard);
  }
}

std::int64_t parameter_store::unit_numel(int u) const { return at(u).numel; }
std::int64_t parameter_store::unit_shard(int u) const { return at(u).shard; }

std::vector<float> parameter_store::shard_values(int u, shard_state which) const {
  UPIPE_CHECK(stage_ != zero_stage::replicated, "no optimizer state when replicated");
  unit& x = at(u);
  wait_host(x);  // AdamW's last update is in
  const tensor& t = which == shard_state::master ? x.master : which == shard_state::exp_avg ? x.exp_avg : x.exp_avg_sq;
  std::vector<float> out(static_cast<std::size_t>(x.shard));
  if (be_.has_data()) be_.download_f32(out.data(), t);
  return out;
}

std::vector<std::pair<std::string, std::int64_t>> parameter_store::unit_parameters(int u) const {
  const unit& x = at(u);
  std::vector<std::pair<std::string, std::int64_t>> out;
  for (std::size_t k = 0; k < x.params.size(); ++k) out.emplace_back(specs_[x.params[k]].name, x.offsets[k]);
  return out;
}

void parameter_store::load_state(const state_reader& read) {
  UPIPE_CHECK(stage_ != zero_stage::replicated, "no optimizer state when replicated");
  wait_all_host();
  for (auto& up : units_) up->stale = false;
  if (!be_.has_data()) return;
  const std::int64_t r = comm_.rank();
  for (int i = 0; i < unit_count(); ++i) {
    unit& u = *units_[i];
    // [lo, hi) of the padded vector, the part past numel left zero.
    const auto range = [&](shard_state which, std::int64_t lo, std::int64_t hi) {
      std::vector<float> out(static_cast<std::size_t>(hi - lo), 0.0f);
      const std::int64_t end = std::min(hi, u.numel);
      if (lo < end) read(i, which, lo, end - lo, out.data());
      return out;
    };
    const std::vector<float> master = range(shard_state::master, r * u.shard, (r + 1) * u.shard);
    const std::vector<float> exp_avg = range(shard_state::exp_avg, r * u.shard, (r + 1) * u.shard);
    const std::vector<float> exp_avg_sq = range(shard_state::exp_avg_sq, r * u.shard, (r + 1) * u.shard);
    check_finite(u, master, r * u.shard, "the saved master weights");
    check_finite(u, exp_avg, r * u.shard, "AdamW's saved first moment");
    check_finite(u, exp_avg_sq, r * u.shard, "AdamW's saved second moment");
    be_.upload_f32(u.master, master.data());
    be_.upload_f32(u.exp_avg, exp_avg.data());
    be_.upload_f32(u.exp_avg_sq, exp_avg_sq.data());
    if (stage_ == zero_stage::three)
      be_.upload_f32(u.weight_shard, master.data());
    else
      be_.upload_f32(offload_.params ? u.host_copy : u.weights, range(shard_state::master, 0, u.padded).data());
  }
}

std::vector<float> parameter_store::gather_unit(int u) {
  unit& x = at(u);
  wait_host(x);
  if (stage_ != zero_stage::replicated) return gather_flat(x, x.master);
  std::vector<float> flat(static_cast<std::size_t>(x.padded));
  if (be_.has_data()) be_.download_f32(flat.data(), x.weights);
  return flat;
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
  double local = 0;
  if (offload_.optimizer) {
    local = offloaded_grad_norm();
  } else {
    for (auto& up : units_) local += ops::sum_squares(be_, up->grad_shard.matrix());
  }
  return std::sqrt(sum_over_ranks(comm_, local, "grad_norm"));
}

// This rank's part of each parameter, in pieces of at most max_elements.
std::vector<parameter_store::adamw_piece> parameter_store::adamw_pieces(std::int64_t max_elements) const {
  const std::int64_t r = comm_.rank();
  std::vector<adamw_piece> pieces;
  for (const auto& up : units_) {
    unit& u = *up;
    const std::int64_t lo = r * u.shard, hi = std::min(lo + u.shard, u.numel);
    for (std::size_t k = 0; k < u.params.size(); ++k) {
      const std::int64_t a = std::max(lo, u.offsets[k]);
      const std::int64_t b = std::min(hi, u.offsets[k] + numel_of(specs_[u.params[k]].shape));
      for (std::int64_t x = a; x < b;) {
        const std::int64_t end = b - x > max_elements ? x + max_elements : b;
        pieces.push_back({&u, x, end, decays(specs_[u.params[k]].kind)});
        x = end;
      }
    }
  }
  return pieces;
}

adamw_args parameter_store::adamw_of(const adamw_piece& p, const mat_view& weights, const adamw_config& config,
                                     std::int64_t step, double lr, double grad_scale) const {
  const unit& u = *p.u;
  const std::int64_t at = p.a - comm_.rank() * u.shard, n = p.b - p.a;
  return {slice(u.master, at, n), slice(u.exp_avg, at, n), slice(u.exp_avg_sq, at, n), slice(u.grad_shard, at, n),
          weights, static_cast<float>(lr), static_cast<float>(config.beta1), static_cast<float>(config.beta2),
          static_cast<float>(config.eps), static_cast<float>(p.matrix ? config.weight_decay : 0.0),
          static_cast<float>(grad_scale), step};
}

void parameter_store::share_weight_slice(unit& u) {
  const std::size_t bytes = static_cast<std::size_t>(u.shard) * dtype_size(u.weights.type());
  void* mine = u.weights.data() == nullptr ? nullptr : static_cast<char*>(u.weights.data()) + comm_.rank() * bytes;
  comm_.all_gather(mine, u.weights.data(), bytes, "zero2_all_gather");
}

void parameter_store::adamw_step(const adamw_config& config, std::int64_t step, double lr, double grad_scale) {
  UPIPE_CHECK(stage_ != zero_stage::replicated, "the optimizer needs sharded state");
  if (offload_.optimizer) return offloaded_adamw_step(config, step, lr, grad_scale);
  const std::int64_t r = comm_.rank();
  // One call per parameter overlapping this rank's slice.
  for (const adamw_piece& p : adamw_pieces(std::numeric_limits<std::int64_t>::max())) {
    const unit& u = *p.u;
    const mat_view weights = stage_ == zero_stage::three ? slice(u.weight_shard, p.a - r * u.shard, p.b - p.a)
                                                         : slice(u.weights, p.a, p.b - p.a);
    ops::adamw(be_, adamw_of(p, weights, config, step, lr, grad_scale));
  }
  if (stage_ == zero_stage::two)
    for (auto& up : units_) share_weight_slice(*up);
}

void parameter_store::zero_grads() {
  for (auto& up : units_) {
    up->reduced = false;
    // Offloaded: the first micro-batch's gradients overwrite the host shard (close_grads).
    if (offload_.optimizer) continue;
    tensor& g = stage_ == zero_stage::replicated ? up->grads : up->grad_shard;
    if (be_.has_data()) be_.fill_bytes(g.data(), 0, g.bytes());
  }
}

}  // namespace upipe
