// The parameter store's AdamW state in its format (docs/design.md section 5, "Lean
// optimizer state"): what each unit allocates on which side, its weight-decay runs, the
// update on the device (whole, or the moments' half with the steps sent to the host for
// the master's), the gradients closed on the device (kept, or streamed into the update),
// and the state in and out of checkpoints, converted between formats when asked.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "model/parameter_unit.hpp"
#include "ops/q8_map.hpp"

namespace upipe {

namespace {

bool is_absmax(shard_state which) {
  return which == shard_state::exp_avg_absmax || which == shard_state::exp_avg_sq_absmax;
}

dtype moment_dtype(moment_format f) {
  return f == moment_format::f32 ? dtype::f32 : f == moment_format::bf16 ? dtype::bf16 : dtype::u8;
}

}  // namespace

std::vector<shard_state> state_tensors(const adamw_state_format& format) {
  std::vector<shard_state> out{shard_state::master, shard_state::exp_avg, shard_state::exp_avg_sq};
  if (format.master == master_format::bf16_kahan) out.push_back(shard_state::master_comp);
  if (format.moments == moment_format::q8) {
    out.push_back(shard_state::exp_avg_absmax);
    out.push_back(shard_state::exp_avg_sq_absmax);
  }
  return out;
}

dtype state_dtype(const adamw_state_format& format, shard_state which) {
  switch (which) {
    case shard_state::master:
      return format.master == master_format::f32 ? dtype::f32 : dtype::bf16;
    case shard_state::master_comp:
      return dtype::bf16;
    case shard_state::exp_avg:
    case shard_state::exp_avg_sq:
      return moment_dtype(format.moments);
    case shard_state::exp_avg_absmax:
    case shard_state::exp_avg_sq_absmax:
      return dtype::f32;
  }
  return dtype::f32;
}

const char* state_name(shard_state which) {
  static const char* names[] = {"master", "exp_avg", "exp_avg_sq", "master_comp", "exp_avg_absmax", "exp_avg_sq_absmax"};
  return names[static_cast<int>(which)];
}

state_element_bytes state_bytes_per_element(const optimizer_state_options& state, dtype work) {
  state_element_bytes b;
  const bool kahan = state.format.master == master_format::bf16_kahan;
  // bf16-kahan on a bf16 device: the working weights are the master; only the compensation is new.
  b.master = kahan ? (work == dtype::bf16 ? 2 : 4) : 4;
  b.moments = state.format.moments == moment_format::f32    ? 8
              : state.format.moments == moment_format::bf16 ? 4
                                                            : 2 + 8.0 / q8_block;
  b.grad = state.grads == grad_keeping::streamed ? 0 : static_cast<double>(dtype_size(state.grad_type));
  return b;
}

std::int64_t padded_unit(std::int64_t numel, int ranks, const optimizer_state_options& state) {
  const std::int64_t multiple = state.format.moments == moment_format::q8 ? ranks * q8_block : ranks;
  return (numel + multiple - 1) / multiple * multiple;
}

bool parameter_store::master_aliased() const {
  return state_.format.master == master_format::bf16_kahan && be_.work_dtype() == dtype::bf16;
}

void parameter_store::allocate_state(unit& u) {
  const mem_tag master_tag = offload_.master_on_host() ? mem_tag::optimizer_host : mem_tag::optimizer;
  const mem_tag moment_tag = offload_.moments_on_host() ? mem_tag::optimizer_host : mem_tag::optimizer;
  const mem_tag grad_tag = offload_.moments_on_host() ? mem_tag::optimizer_host : mem_tag::grads;
  const adamw_state_format& f = state_.format;
  if (state_.grads == grad_keeping::kept)
    u.grad_shard = be_.allocate_zeroed(grad_tag, state_.grad_type, {1, u.shard}, "grad_shard");
  if (!master_aliased())
    u.master = be_.allocate_zeroed(master_tag, state_dtype(f, shard_state::master), {1, u.shard}, "master_shard");
  if (f.master == master_format::bf16_kahan)
    u.master_comp = be_.allocate_zeroed(master_tag, dtype::bf16, {1, u.shard}, "master_comp_shard");
  const dtype moments = moment_dtype(f.moments);
  u.exp_avg = be_.allocate_zeroed(moment_tag, moments, {1, u.shard}, "exp_avg_shard");
  u.exp_avg_sq = be_.allocate_zeroed(moment_tag, moments, {1, u.shard}, "exp_avg_sq_shard");
  if (f.moments == moment_format::q8) {
    // A fresh first moment is the signed map's zero code (the unsigned map's is 0).
    if (be_.has_data()) be_.fill_bytes(u.exp_avg.data(), 127, u.exp_avg.bytes());
    u.exp_avg_absmax = be_.allocate_zeroed(moment_tag, dtype::f32, {1, u.shard / q8_block}, "exp_avg_absmax_shard");
    u.exp_avg_sq_absmax =
        be_.allocate_zeroed(moment_tag, dtype::f32, {1, u.shard / q8_block}, "exp_avg_sq_absmax_shard");
  }
  if (offload_.master_on_host() && !offload_.params)
    u.host_weights = be_.allocate_zeroed(master_tag, be_.work_dtype(), {1, u.shard}, "host_weight_shard");
  u.runs = decay_runs(u);
}

// This rank's part of each parameter in order, a run each, neighbours of one decay merged;
// the padding past the last parameter decays not. AdamW's weight decay applies to matrices
// and embeddings, not to norms and biases (as transformers' Trainer excludes them).
std::vector<adamw_run> parameter_store::decay_runs(const unit& u) const {
  const std::int64_t lo = u.comm->rank() * u.shard, hi = lo + u.shard;
  std::vector<adamw_run> runs;
  const auto add = [&](std::int64_t end, bool decay) {
    if (!runs.empty() && runs.back().decay == decay) runs.back().end = end;
    else runs.push_back({end, decay});
  };
  for (std::size_t k = 0; k < u.params.size(); ++k) {
    const parameter_spec& spec = specs_[u.params[k]];
    std::int64_t numel = 1;
    for (auto d : spec.shape) numel *= d;
    const std::int64_t a = std::max(lo, u.offsets[k]), b = std::min(hi, u.offsets[k] + numel);
    if (a < b)
      add(b - lo, spec.kind == param_kind::matrix || spec.kind == param_kind::embedding || spec.kind == param_kind::conv);
  }
  if (runs.empty() || runs.back().end < u.shard) add(u.shard, false);
  return runs;
}

mat_view parameter_store::working_shard(unit& u) const {
  const std::int64_t r = u.comm->rank();
  if (offload_.master_on_host() && !offload_.params) return u.host_weights.matrix();
  if (stage_ == zero_stage::three) return u.weight_shard.matrix();
  const tensor& whole = offload_.params ? u.host_copy : u.weights;
  return whole.matrix().col_block(r * u.shard, u.shard);
}

mat_view parameter_store::master_view(unit& u) const { return master_aliased() ? working_shard(u) : u.master.matrix(); }

tensor& parameter_store::state_tensor(unit& u, shard_state which) const {
  switch (which) {
    case shard_state::master:
      return u.master;
    case shard_state::master_comp:
      return u.master_comp;
    case shard_state::exp_avg:
      return u.exp_avg;
    case shard_state::exp_avg_sq:
      return u.exp_avg_sq;
    case shard_state::exp_avg_absmax:
      return u.exp_avg_absmax;
    case shard_state::exp_avg_sq_absmax:
      return u.exp_avg_sq_absmax;
  }
  throw internal_error("no such state tensor");
}

void parameter_store::update_on_device(unit& u, const mat_view& grad, const host_adamw& update) {
  const bool halves = offload_.master_on_host();
  const bool q8 = state_.format.moments == moment_format::q8;
  tensor direction;
  if (halves) direction = be_.allocate(mem_tag::grads, dtype::f32, {1, u.shard}, "direction_staging");
  const auto view = [](const tensor& t) { return t.empty() ? mat_view{} : t.matrix(); };
  const mat_view master = halves ? mat_view{} : master_view(u);
  const mat_view weights = halves || master_aliased() ? mat_view{} : working_shard(u);
  const std::vector<std::int64_t> bounds = adamw_call_bounds(u.runs, u.shard, q8 ? q8_block : 1);
  std::optional<phase_scope> phase;
  phase.emplace(be_, "adamw");
  for (std::size_t i = 0; i + 1 < bounds.size(); ++i) {
    const std::int64_t a = bounds[i], n = bounds[i + 1] - a;
    const std::vector<adamw_run> runs = runs_within(u.runs, a, a + n);
    const auto cols = [&](const mat_view& m, std::int64_t scale = 1) {
      return m.rows == 0 ? mat_view{} : m.col_block(a / scale, n / scale);  // rows 0: none
    };
    adamw_args args;
    args.part = halves ? adamw_part::moments : adamw_part::whole;
    args.master = cols(master);
    if (!halves) args.master_comp = cols(view(u.master_comp));
    args.weights = cols(weights);
    args.exp_avg = cols(view(u.exp_avg));
    args.exp_avg_sq = cols(view(u.exp_avg_sq));
    if (q8) {
      args.exp_avg_absmax = cols(view(u.exp_avg_absmax), q8_block);
      args.exp_avg_sq_absmax = cols(view(u.exp_avg_sq_absmax), q8_block);
    }
    args.grad = cols(grad);
    if (halves) args.direction = cols(view(direction));
    set_scalars(args, update);
    args.runs = runs;
    ops::adamw(be_, args);
  }
  phase.reset();
  if (!halves) return;
  // The steps go to the host in stream order; the master's half runs there once they
  // land. At most two units' steps wait in host memory.
  wait_host(u);
  while (incoming_units_.size() >= 2) {
    wait_host(*units_[static_cast<std::size_t>(incoming_units_.front())]);
    incoming_units_.pop_front();
  }
  u.direction_host = be_.allocate(mem_tag::optimizer_host, dtype::f32, {1, u.shard}, "direction_host");
  const auto index = std::find_if(units_.begin(), units_.end(), [&](const auto& p) { return p.get() == &u; });
  incoming_units_.push_back(static_cast<int>(index - units_.begin()));
  {
    const phase_scope copy(be_, "copy_out");  // on the step's stream
    be_.copy_bytes(u.direction_host.data(), direction.data(), direction.bytes());
  }
  start_master_half(u, update);
}

// The moments on the device: the reduced shard kept (f32 straight from the reduce-scatter,
// bf16 converted; a later micro-batch added), or streamed into the unit's update.
void parameter_store::close_on_device(int index) {
  unit& u = at(index);
  const bool streamed = state_.grads == grad_keeping::streamed;
  if (!streamed && !u.reduced && state_.grad_type == dtype::f32) {
    u.comm->reduce_scatter_sum(u.grads.as<float>(), u.grad_shard.as<float>(), static_cast<std::size_t>(u.shard),
                             "zero_reduce_scatter");
    u.grads.reset();
    u.reduced = true;
    return;
  }
  tensor staging = be_.allocate(mem_tag::grads, dtype::f32, {1, u.shard}, "grad_shard_staging");
  u.comm->reduce_scatter_sum(u.grads.as<float>(), staging.as<float>(), static_cast<std::size_t>(u.shard),
                           "zero_reduce_scatter");
  u.grads.reset();
  if (streamed) {
    UPIPE_CHECK(announced_, "streamed gradients update each unit as they arrive: announce_update comes first");
    UPIPE_CHECK(!u.reduced, "streamed gradients take one micro-batch a step (keep them for more)");
    u.grad_squares = ops::sum_squares(be_, staging.matrix());
    host_adamw update = *announced_;
    update.grad_scale = 1.0;
    update_on_device(u, staging.matrix(), update);
    u.updated = true;
  } else {
    // As rows of up to 1024 elements, so that a device walks them in parallel.
    std::int64_t row = 1024;
    while (u.shard % row != 0) row /= 2;
    const head_view flat = {nullptr, dtype::f32, u.shard / row, 1, row, row, row};
    head_view dst = flat, src = flat;
    dst.data = u.grad_shard.data();
    dst.type = u.grad_shard.type();
    src.data = staging.data();
    if (u.reduced) ops::add_heads(be_, dst, src);
    else ops::copy_heads(be_, dst, src);
  }
  u.reduced = true;
}

// ---------------------------------------------------------------------------------------
// The state in and out

void parameter_store::put_values(const tensor& t, const std::vector<float>& values) {
  if (t.type() != dtype::u8) return be_.upload_f32(t, values.data());
  std::vector<std::uint8_t> codes(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) codes[i] = static_cast<std::uint8_t>(std::clamp(values[i], 0.0f, 255.0f));
  be_.upload_bytes(t, codes.data(), codes.size());
}

std::vector<float> parameter_store::get_values(const tensor& t) const {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  if (!be_.has_data()) return out;
  if (t.type() != dtype::u8) {
    be_.download_f32(out.data(), t);
    return out;
  }
  std::vector<std::uint8_t> codes(out.size());
  be_.download_bytes(codes.data(), t, codes.size());
  std::copy(codes.begin(), codes.end(), out.begin());
  return out;
}

std::vector<float> parameter_store::shard_values(int index, shard_state which) {
  UPIPE_CHECK(stage_ != zero_stage::replicated, "no optimizer state when replicated");
  issue_all_updates();
  unit& u = at(index);
  wait_host(u);  // AdamW's last update is in
  if (which != shard_state::master || !master_aliased()) return get_values(state_tensor(u, which));
  // The working shard is the master: a copy of it as a tensor of its own.
  const mat_view w = working_shard(u);
  tensor copy = be_.allocate(mem_tag::workspace, w.type, {1, u.shard}, "master_copy");
  if (be_.has_data()) be_.copy_bytes(copy.data(), w.data, copy.bytes());
  return get_values(copy);
}

std::vector<float> parameter_store::gather_unit(int index) {
  issue_all_updates();
  unit& u = at(index);
  wait_host(u);
  std::vector<float> flat;
  if (stage_ == zero_stage::replicated) {
    flat.resize(static_cast<std::size_t>(u.padded));
    if (be_.has_data()) be_.download_f32(flat.data(), u.weights);
  } else if (state_.format.master == master_format::f32) {
    flat = gather_flat(u, u.master);
  } else {
    // bf16-kahan: the master's value is the weight plus its compensation.
    std::vector<float> value = shard_values(index, shard_state::master);
    const std::vector<float> comp = shard_values(index, shard_state::master_comp);
    for (std::size_t i = 0; i < value.size(); ++i) value[i] += comp[i];
    tensor mine = be_.allocate(mem_tag::workspace, dtype::f32, {1, u.shard}, "master_f32");
    if (be_.has_data()) be_.upload_f32(mine, value.data());
    flat = gather_flat(u, mine);
  }
  return u.canonical_numel == u.numel ? flat : gather_experts(u, flat);
}

// An expert unit under expert parallelism: every EP rank's block of experts, in EP order.
std::vector<float> parameter_store::gather_experts(const unit& u, const std::vector<float>& block) {
  tensor mine = be_.allocate(mem_tag::workspace, dtype::f32, {1, u.numel}, "expert_block");
  tensor all = be_.allocate(mem_tag::workspace, dtype::f32, {1, u.canonical_numel}, "expert_blocks");
  if (be_.has_data()) be_.upload_f32(mine, block.data());
  experts_.peers->all_gather(mine.data(), all.data(), mine.bytes(), "gather_experts");
  std::vector<float> flat(static_cast<std::size_t>(u.canonical_numel));
  if (be_.has_data()) be_.download_f32(flat.data(), all);
  return flat;
}

namespace {

// Elements [lo, hi) of a unit's saved state `which`, the part past the unit's end zero.
std::vector<float> read_range(const parameter_store::state_reader& read, int unit, shard_state which, std::int64_t lo,
                              std::int64_t hi, std::int64_t length) {
  std::vector<float> out(static_cast<std::size_t>(hi - lo), 0.0f);
  const std::int64_t end = std::min(hi, length);
  if (lo < end) read(unit, which, lo, end - lo, out.data());
  return out;
}

// A saved moment or master of [lo, hi) decoded to f32 from its saved format.
std::vector<float> decoded(const parameter_store::state_reader& read, const adamw_state_format& saved, int unit,
                           shard_state which, std::int64_t lo, std::int64_t hi, std::int64_t numel) {
  std::vector<float> values = read_range(read, unit, which, lo, hi, numel);
  if (which == shard_state::master) {
    if (saved.master == master_format::bf16_kahan) {
      const std::vector<float> comp = read_range(read, unit, shard_state::master_comp, lo, hi, numel);
      for (std::size_t i = 0; i < values.size(); ++i) values[i] += comp[i];
    }
    return values;
  }
  if (saved.moments != moment_format::q8) return values;
  const bool first = which == shard_state::exp_avg;
  const q8_map& map = first ? q8_signed_map() : q8_unsigned_map();
  const std::int64_t b0 = lo / q8_block, b1 = (hi + q8_block - 1) / q8_block;
  const std::vector<float> absmax =
      read_range(read, unit, first ? shard_state::exp_avg_absmax : shard_state::exp_avg_sq_absmax, b0, b1,
                 (numel + q8_block - 1) / q8_block);
  for (std::int64_t i = lo; i < std::min(hi, numel); ++i) {
    float& v = values[static_cast<std::size_t>(i - lo)];
    v = map.code[static_cast<int>(v)] * absmax[static_cast<std::size_t>(i / q8_block - b0)];
  }
  return values;
}

// f32 moments in a format: as they are, rounded to bf16, or q8 codes with each block's
// absmax (whole blocks: a q8 store's shard is).
void encode_moment(std::vector<float>& values, std::vector<float>& absmax, moment_format f, bool first) {
  if (f == moment_format::bf16)
    for (float& v : values) v = round_to_bf16(v);
  if (f != moment_format::q8) return;
  const q8_map& map = first ? q8_signed_map() : q8_unsigned_map();
  absmax.assign(values.size() / q8_block, 0.0f);
  for (std::size_t b = 0; b < absmax.size(); ++b) {
    float* block = values.data() + b * q8_block;
    float a = 0.0f;
    for (std::int64_t j = 0; j < q8_block; ++j) a = std::fabs(block[j]) > a ? std::fabs(block[j]) : a;
    absmax[b] = a;
    for (std::int64_t j = 0; j < q8_block; ++j) block[j] = q8_code(map.mid, q8_scaled(block[j], q8_inverse(a)));
  }
}

}  // namespace

void parameter_store::load_state(const state_reader& read_all, const adamw_state_format& saved) {
  UPIPE_CHECK(stage_ != zero_stage::replicated, "no optimizer state when replicated");
  wait_all_host();  // the pending updates issued too
  for (auto& up : units_) up->stale = false;
  if (!be_.has_data()) return;
  for (int i = 0; i < unit_count(); ++i) {
    unit& u = *units_[static_cast<std::size_t>(i)];
    const std::int64_t r = u.comm->rank(), lo = r * u.shard, hi = lo + u.shard;
    // An expert unit under expert parallelism: this rank's experts are a block of the
    // whole unit as saved (q8's absmax blocks align with it: check_expert_sharding).
    const state_reader read = [&outer = read_all, &u](int unit, shard_state which, std::int64_t begin,
                                                      std::int64_t count, float* out) {
      outer(unit, which, begin + (is_absmax(which) ? u.canonical_offset / q8_block : u.canonical_offset), count, out);
    };
    std::vector<float> master;
    if (saved == state_.format) {
      for (shard_state which : state_tensors(saved)) {
        const bool blocks = is_absmax(which);
        std::vector<float> values = read_range(read, i, which, blocks ? lo / q8_block : lo, blocks ? hi / q8_block : hi,
                                               blocks ? (u.numel + q8_block - 1) / q8_block : u.numel);
        if (which == shard_state::master) {
          check_finite(u, values, lo, "the saved master weights");
          master = values;
        }
        if (which == shard_state::master && master_aliased()) continue;  // written with the weights below
        put_values(state_tensor(u, which), values);
      }
    } else {
      load_converted(u, i, read, saved);
      master = decoded(read, saved, i, shard_state::master, lo, hi, u.numel);
      if (state_.format.master == master_format::bf16_kahan)
        for (float& v : master) v = round_to_bf16(v);
    }
    // The working weights from the master (bf16-kahan: the master itself where aliased).
    if (stage_ == zero_stage::three) {
      be_.upload_f32(u.weight_shard, master.data());
    } else {
      // The other ranks' slices as this rank's: the stored master (bf16-kahan: its
      // weights), or converted as load_converted converts.
      std::vector<float> whole = saved == state_.format ? read_range(read, i, shard_state::master, 0, u.padded, u.numel)
                                                        : decoded(read, saved, i, shard_state::master, 0, u.padded, u.numel);
      if (saved != state_.format && state_.format.master == master_format::bf16_kahan)
        for (float& v : whole) v = round_to_bf16(v);
      std::copy(master.begin(), master.end(), whole.begin() + lo);
      be_.upload_f32(offload_.params ? u.host_copy : u.weights, whole.data());
    }
    if (!u.host_weights.empty()) be_.upload_f32(u.host_weights, master.data());
  }
}

// A saved state of another format: decoded to f32, encoded in this store's.
void parameter_store::load_converted(unit& u, int index, const state_reader& read, const adamw_state_format& saved) {
  const std::int64_t lo = u.comm->rank() * u.shard, hi = lo + u.shard;
  std::vector<float> master = decoded(read, saved, index, shard_state::master, lo, hi, u.numel);
  check_finite(u, master, lo, "the saved master weights");
  if (state_.format.master == master_format::bf16_kahan) {
    std::vector<float> comp(master.size());
    for (std::size_t k = 0; k < master.size(); ++k) {
      const float w = round_to_bf16(master[k]);
      comp[k] = round_to_bf16(master[k] - w);
      master[k] = w;
    }
    put_values(u.master_comp, comp);
  }
  if (!master_aliased()) put_values(u.master, master);
  for (const bool first : {true, false}) {
    const shard_state which = first ? shard_state::exp_avg : shard_state::exp_avg_sq;
    std::vector<float> values = decoded(read, saved, index, which, lo, hi, u.numel);
    check_finite(u, values, lo, first ? "AdamW's saved first moment" : "AdamW's saved second moment");
    std::vector<float> absmax;
    encode_moment(values, absmax, state_.format.moments, first);
    put_values(first ? u.exp_avg : u.exp_avg_sq, values);
    if (!absmax.empty()) put_values(first ? u.exp_avg_absmax : u.exp_avg_sq_absmax, absmax);
  }
}

}  // namespace upipe
