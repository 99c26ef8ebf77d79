#include "model/parameter_store.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>

#include "core/error.hpp"
#include "ops/cpu/cpu_ops.hpp"
#include "ops/ops.hpp"

namespace upipe {

struct parameter_store::unit {
  std::vector<std::size_t> params;    // indices into specs_
  std::vector<std::int64_t> offsets;  // element offset of each parameter in the flat vector
  std::int64_t numel = 0, padded = 0, shard = 0;
  tensor weights;       // (1, padded) working dtype: resident, or gathered while acquired (ZeRO-3)
  tensor weight_shard;  // ZeRO-3: (1, shard) working dtype
  int acquired = 0;
  comm_request gathering;  // ZeRO-3: the prefetched gather in flight
  tensor grads;         // (1, padded) f32: persistent when replicated, else while open
  bool reduced = false;  // ZeRO: a micro-batch of this step was reduced into grad_shard
  tensor grad_shard, master, exp_avg, exp_avg_sq;  // ZeRO: (1, shard) f32 (in host memory when offloaded)
  tensor host_weights;  // offloaded: (1, shard) working dtype, AdamW's output on its way to the device
};

namespace {

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

int unit_of(const std::string& name, int layers) {
  const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) == 0) return 1 + std::atoi(name.c_str() + prefix.size());
  return name == "model.embed_tokens.weight" ? 0 : layers + 1;
}

// fn(i) for i in [0, items) on every host core, items taken in turn.
void on_host_cores(std::size_t items, const std::function<void(std::size_t)>& fn) {
  std::atomic<std::size_t> next{0};
  const auto work = [&] {
    for (std::size_t i = next++; i < items; i = next++) fn(i);
  };
  const auto cores = static_cast<std::size_t>(std::max(1u, std::min(std::thread::hardware_concurrency(), 64u)));
  std::vector<std::thread> threads;
  for (std::size_t t = 1; t < std::min(cores, items); ++t) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
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

parameter_store::parameter_store(const model_config& config, backend& be, communicator& comm, zero_stage stage,
                                 bool offload_optimizer)
    : parameter_store(config, parameter_specs(config), be, comm, stage, offload_optimizer, weight_role::trained) {}

parameter_store::parameter_store(const model_config& config, std::vector<parameter_spec> specs, backend& be,
                                 communicator& comm, zero_stage stage, bool offload_optimizer, weight_role role)
    : config_(config), be_(be), comm_(comm), stage_(stage), offload_(offload_optimizer), role_(role),
      specs_(std::move(specs)) {
  UPIPE_CHECK(!offload_ || stage == zero_stage::two || stage == zero_stage::three,
              "the optimizer is offloaded only when it is sharded (ZeRO-2 or ZeRO-3)");
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
    if (stage == zero_stage::three) {
      u.weight_shard = be.allocate_zeroed(mem_tag::weights, be.work_dtype(), {1, u.shard}, "weight_shard");
    } else {
      u.weights = be.allocate_zeroed(mem_tag::weights, be.work_dtype(), {1, u.padded}, "weights");
    }
    if (stage == zero_stage::inference || role_ == weight_role::frozen) continue;
    if (stage == zero_stage::replicated) {
      u.grads = be.allocate_zeroed(mem_tag::grads, dtype::f32, {1, u.padded}, "grads");
      continue;
    }
    const mem_tag grads = offload_ ? mem_tag::optimizer_host : mem_tag::grads;
    const mem_tag state = offload_ ? mem_tag::optimizer_host : mem_tag::optimizer;
    u.grad_shard = be.allocate_zeroed(grads, dtype::f32, {1, u.shard}, "grad_shard");
    u.master = be.allocate_zeroed(state, dtype::f32, {1, u.shard}, "master_shard");
    u.exp_avg = be.allocate_zeroed(state, dtype::f32, {1, u.shard}, "exp_avg_shard");
    u.exp_avg_sq = be.allocate_zeroed(state, dtype::f32, {1, u.shard}, "exp_avg_sq_shard");
    if (offload_) u.host_weights = be.allocate_zeroed(state, be.work_dtype(), {1, u.shard}, "host_weight_shard");
  }
}

parameter_store::~parameter_store() = default;

parameter_store::unit& parameter_store::at(int u) const {
  UPIPE_CHECK(u >= 0 && u < static_cast<int>(units_.size()), "no parameter unit " + std::to_string(u));
  return *units_[u];
}

void parameter_store::acquire(int index) {
  unit& u = at(index);
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
  if (stage_ != zero_stage::three || u.acquired > 0 || !u.weights.empty()) return;
  u.weights = be_.allocate(mem_tag::weights, be_.work_dtype(), {1, u.padded}, "gathered_weights");
  u.gathering =
      comm_.all_gather_start(u.weight_shard.data(), u.weights.data(), u.weight_shard.bytes(), "zero3_all_gather");
}

void parameter_store::release(int index) {
  unit& u = at(index);
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
  if (offload_) {
    // Reduced on the device, then straight to the host shard (added there for a later
    // micro-batch of the step); the device holds one unit's shard only while it travels.
    tensor staging = be_.allocate(mem_tag::grads, dtype::f32, {1, u.shard}, "grad_shard_staging");
    comm_.reduce_scatter_sum(u.grads.as<float>(), staging.as<float>(), static_cast<std::size_t>(u.shard),
                             "zero_reduce_scatter");
    u.grads.reset();
    if (!u.reduced) {
      be_.copy_bytes(u.grad_shard.data(), staging.data(), staging.bytes());
    } else if (be_.has_data()) {
      std::vector<float> part(static_cast<std::size_t>(u.shard));
      be_.download_f32(part.data(), staging);
      float* into = u.grad_shard.as<float>();
      constexpr std::size_t piece = std::size_t{1} << 20;
      on_host_cores((part.size() + piece - 1) / piece, [&](std::size_t p) {
        for (std::size_t i = p * piece; i < std::min(part.size(), (p + 1) * piece); ++i) into[i] += part[i];
      });
    }
    u.reduced = true;
    return;
  }
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
    be_.upload_f32(u.weights, flat.data());
    if (!u.master.empty()) be_.upload_f32(u.master, flat.data() + r * u.shard);
  }
}

std::int64_t parameter_store::unit_numel(int u) const { return at(u).numel; }
std::int64_t parameter_store::unit_shard(int u) const { return at(u).shard; }

std::vector<float> parameter_store::shard_values(int u, shard_state which) const {
  UPIPE_CHECK(stage_ != zero_stage::replicated, "no optimizer state when replicated");
  const unit& x = at(u);
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
      be_.upload_f32(u.weights, range(shard_state::master, 0, u.padded).data());
  }
}

std::vector<float> parameter_store::gather_unit(int u) {
  unit& x = at(u);
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
  if (offload_) {
    // The host shards, summed per unit as the cpu backend sums them, in unit order.
    be_.synchronize();  // the last units' gradients have arrived
    if (be_.has_data())
      for (auto& up : units_) local += cpu::sum_squares(up->grad_shard.matrix());
  } else {
    for (auto& up : units_) local += ops::sum_squares(be_, up->grad_shard.matrix());
  }
  return std::sqrt(sum_over_ranks(comm_, local, "grad_norm"));
}

// AdamW over the host shards on every core (elementwise, so any split gives the same
// values as one pass), then each unit's new working weights to the device.
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
        pieces.push_back({&u, x, end, specs_[u.params[k]].shape.size() == 2});
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

// AdamW over the host shards on every core (elementwise, so any split gives the same
// values as one pass), then each unit's new working weights to the device.
void parameter_store::adamw_on_host(const adamw_config& config, std::int64_t step, double lr, double grad_scale) {
  be_.synchronize();
  const std::vector<adamw_piece> pieces = adamw_pieces(std::int64_t{1} << 20);
  if (be_.has_data())
    on_host_cores(pieces.size(), [&](std::size_t i) {
      const adamw_piece& p = pieces[i];
      const std::int64_t at = p.a - comm_.rank() * p.u->shard;
      cpu::adamw(adamw_of(p, slice(p.u->host_weights, at, p.b - p.a), config, step, lr, grad_scale));
    });
  for (auto& up : units_) {
    unit& u = *up;
    if (stage_ == zero_stage::three) {
      be_.copy_bytes(u.weight_shard.data(), u.host_weights.data(), u.host_weights.bytes());
      continue;
    }
    char* weights = static_cast<char*>(u.weights.data());
    be_.copy_bytes(weights == nullptr ? nullptr : weights + comm_.rank() * u.host_weights.bytes(),
                   u.host_weights.data(), u.host_weights.bytes());
    share_weight_slice(u);
  }
}

void parameter_store::adamw_step(const adamw_config& config, std::int64_t step, double lr, double grad_scale) {
  UPIPE_CHECK(stage_ != zero_stage::replicated, "the optimizer needs sharded state");
  if (offload_) return adamw_on_host(config, step, lr, grad_scale);
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
    tensor& g = stage_ == zero_stage::replicated ? up->grads : up->grad_shard;
    if (be_.has_data()) be_.fill_bytes(g.data(), 0, g.bytes());
  }
}

}  // namespace upipe
