// The parameter store with its optimizer (and optionally its weights) in host memory
// (docs/design.md section 5). The rank's own thread only issues: each unit's gradient
// shard leaves the device in stream order as its backward ends, and the host's work on it
// (a later micro-batch's add, the block sums of the norm, AdamW) starts from a device
// callback when it has landed and runs on the host pool. With clipping, AdamW waits for
// the global norm and then runs unit by unit in forward order while the next step's
// forward starts: a unit's weights go back to the device only when the device asks for
// them (acquire), which waits for that unit's update alone. Without clipping a unit is
// updated as soon as its gradients land, beside the rest of the backward. With the
// overlap off, adamw_step waits for the host (the step measured without overlap). Every host
// value is the cpu backend's (same ops, elementwise or in fixed blocks), so where AdamW
// runs changes no bit. Which collective runs when never depends on the host's progress:
// waits are for values, never for a choice.
#include <algorithm>
#include <cstdio>

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "model/parameter_unit.hpp"

namespace upipe {

namespace {

// The gradient shards of at most this many units wait on the host to be added.
constexpr std::size_t incoming_in_flight = 2;

}  // namespace

host_shard parameter_store::host_shard_of(unit& u) const {
  host_shard s;
  s.n = u.shard;
  s.runs = u.runs;
  const auto view = [](const tensor& t) { return t.empty() ? nullptr : t.data(); };
  // The master's side (always on the host here).
  const mat_view master = master_view(u);
  s.master = master.data;
  s.master_type = master.type;
  s.master_comp = static_cast<std::uint16_t*>(view(u.master_comp));
  s.weights = master_aliased() ? nullptr : working_shard(u).data;
  s.weights_type = be_.work_dtype();
  s.direction = static_cast<const float*>(view(u.direction_host));
  if (!offload_.moments_on_host()) return s;
  // The moments' side; streamed gradients arrive in `incoming`.
  s.grad = state_.grads == grad_keeping::streamed ? view(u.incoming) : view(u.grad_shard);
  s.grad_type = state_.grads == grad_keeping::streamed ? dtype::f32 : state_.grad_type;
  s.exp_avg = view(u.exp_avg);
  s.exp_avg_sq = view(u.exp_avg_sq);
  s.moment_type = u.exp_avg.type();
  s.exp_avg_absmax = static_cast<float*>(view(u.exp_avg_absmax));
  s.exp_avg_sq_absmax = static_cast<float*>(view(u.exp_avg_sq_absmax));
  return s;
}

void parameter_store::start_master_half(unit& u, const host_adamw& update) {
  host_work work;
  work.adamw = update;
  work.part = adamw_part::master;
  if (be_.has_data()) start_host_work(u, work, true);
}

void parameter_store::wait_host(unit& u) const {
  if (u.task) {
    if (u.task->done()) {
      u.task->wait();  // its error, if any
    } else {  // the step's stream runs dry while this thread waits: the phase table's wait_host
      const phase_scope wait(be_, "wait_host");
      u.task->wait();
    }
    u.task.reset();
  }
  u.incoming.reset();
  u.direction_host.reset();
}

void parameter_store::wait_all_host() noexcept {
  try {
    issue_all_updates();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "upipe: the update of a parameter unit could not be issued: %s\n", e.what());
    pending_updates_.clear();
  }
  for (auto& up : units_) {
    if (!up->task) continue;
    try {
      // Work still waiting for its device callback: let the device reach it.
      if (!up->task->done()) be_.synchronize();
      up->task->wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "upipe: the host's work on a parameter unit failed: %s\n", e.what());
    }
    up->task.reset();
  }
}

// after_device: the work reads what the device is still writing (the gradients on their
// way), so it starts from the device's callback; else it starts now.
void parameter_store::start_host_work(unit& u, const host_work& work, bool after_device) {
  u.task = std::make_unique<host_batch>();
  const host_shard s = host_shard_of(u);
  host_work timed = work;
  timed.log = host_timing_ ? &host_log_ : nullptr;
  if (!after_device) {
    submit_host_work(*u.task, s, timed);
    return;
  }
  host_batch* task = u.task.get();
  task->hold();
  be_.when_done([task, s, timed] {
    submit_host_work(*task, s, timed);
    task->unhold();
  });
}

// The gradients are reduced on the device into a staging shard, which goes to the host
// in stream order (the device holds one unit's shard only while it travels). Kept, the
// first micro-batch of a step lands in the host shard itself (bf16 shards converted on
// the device first), a later one beside it and is added there by the host; streamed, it
// lands beside the state and the host updates the unit from it at once.
void parameter_store::close_offloaded(int index) {
  unit& u = at(index);
  const bool streamed = state_.grads == grad_keeping::streamed;
  tensor staging = be_.allocate(mem_tag::grads, dtype::f32, {1, u.shard}, "grad_shard_staging");
  u.comm->reduce_scatter_sum(u.grads.as<float>(), staging.as<float>(), static_cast<std::size_t>(u.shard),
                           "zero_reduce_scatter");
  u.grads.reset();
  wait_host(u);  // the host no longer reads this shard (the last update, the last add)
  host_work work;
  const auto copy_out = [&](void* dst, const tensor& src) {  // on the step's stream
    const phase_scope copy(be_, "copy_out");
    be_.copy_bytes(dst, src.data(), src.bytes());
  };
  if (!u.reduced && !streamed) {
    if (state_.grad_type == dtype::f32) {
      copy_out(u.grad_shard.data(), staging);
    } else {
      tensor half = be_.allocate(mem_tag::grads, dtype::bf16, {1, u.shard}, "grad_shard_bf16");
      ops::copy_heads(be_, ops::as_heads(half.matrix()), ops::as_heads(staging.matrix()));
      copy_out(u.grad_shard.data(), half);
    }
  } else {
    UPIPE_CHECK(!streamed || (announced_ && !u.reduced),
                "streamed gradients take one micro-batch a step, announced first (announce_update)");
    while (incoming_units_.size() >= incoming_in_flight) {
      wait_host(*units_[incoming_units_.front()]);
      incoming_units_.pop_front();
    }
    u.incoming = be_.allocate(mem_tag::optimizer_host, dtype::f32, {1, u.shard}, "grad_shard_incoming");
    incoming_units_.push_back(index);
    copy_out(u.incoming.data(), staging);
    if (!streamed) work.incoming = u.incoming.as<float>();
  }
  staging.reset();
  u.reduced = true;
  u.summed = u.updated = false;
  if (announced_) {  // the step's last micro-batch: these are the step's gradients
    u.block_sums.assign(static_cast<std::size_t>(sum_blocks(u.shard)), 0.0);
    work.block_sums = u.block_sums.data();
    u.summed = true;
    if (announced_->config.max_grad_norm <= 0 || streamed) {
      work.adamw = *announced_;
      u.updated = true;
    }
  }
  if (be_.has_data() && (work.incoming != nullptr || work.block_sums != nullptr || work.adamw))
    start_host_work(u, work, true);
}

double parameter_store::offloaded_grad_norm() {
  std::vector<unit*> missing;
  for (auto& up : units_) {
    if (up->numel == 0) continue;  // a unit with no parameters (LoRA's embedding and head units)
    UPIPE_CHECK(up->reduced, "grad_norm before every unit's gradients were closed");
    wait_host(*up);
    if (!up->summed) missing.push_back(up.get());
  }
  incoming_units_.clear();
  // Without announce_update, the sums are taken now, every unit at once.
  for (unit* u : missing) {
    u->block_sums.assign(static_cast<std::size_t>(sum_blocks(u->shard)), 0.0);
    host_work work;
    work.block_sums = u->block_sums.data();
    if (be_.has_data()) start_host_work(*u, work, false);
    u->summed = true;
  }
  for (unit* u : missing) wait_host(*u);
  // Per unit as the cpu backend sums a shard, then in unit order.
  double local = 0;
  for (auto& up : units_) local += add_blocks(up->block_sums);
  return local;
}

void parameter_store::announce_update(const adamw_config& config, std::int64_t step, double lr) {
  announced_ = host_adamw{config, step, lr, 1.0};
}

void parameter_store::offloaded_adamw_step(const adamw_config& config, std::int64_t step, double lr,
                                           double grad_scale) {
  const host_adamw update{config, step, lr, grad_scale};
  for (auto& up : units_) {  // forward order: the next step's forward waits for the first ones first
    unit& u = *up;
    if (u.numel == 0) continue;
    UPIPE_CHECK(u.reduced, "adamw_step before every unit's gradients were closed");
    if (u.updated) {
      UPIPE_CHECK(announced_ && announced_->step == step && announced_->lr == lr && grad_scale == 1.0,
                  "an early update ran with another step, learning rate or scale than adamw_step's");
    } else {
      UPIPE_CHECK(state_.grads == grad_keeping::kept, "streamed gradients update each unit as they arrive");
      wait_host(u);
      host_work work;
      work.adamw = update;
      if (be_.has_data()) start_host_work(u, work, false);
      u.updated = true;
    }
    u.stale = true;
  }
  announced_.reset();
  if (!offload_.overlap) finish_host_work();  // the step without overlap: its update done here
}

void parameter_store::finish_host_work() {
  issue_all_updates();
  for (auto& up : units_) wait_host(*up);
  incoming_units_.clear();
}

// Optimizer alone: the device's copy of the weights takes AdamW's output (ZeRO-2: this
// rank's slice, then the all-gather). In stream order; the host waits for this unit's
// update only.
void parameter_store::return_weights(unit& u) {
  wait_host(u);
  u.stale = false;
  {
    const phase_scope copy(be_, "copy_in");  // on the step's stream
    if (stage_ == zero_stage::three) {
      be_.copy_bytes(u.weight_shard.data(), u.host_weights.data(), u.host_weights.bytes());
      return;
    }
    char* weights = static_cast<char*>(u.weights.data());
    be_.copy_bytes(weights == nullptr ? nullptr : weights + u.comm->rank() * u.host_weights.bytes(),
                   u.host_weights.data(), u.host_weights.bytes());
  }
  share_weight_slice(u);
}

// Parameters: the unit's device copy, filled on the copy stream: this rank's shard into
// its slot (ZeRO-3, gathered in acquire; ZeRO-2 after an update, all-gathered there), or
// the whole unit (ZeRO-2 otherwise).
void parameter_store::bring_params(unit& u) {
  wait_host(u);  // AdamW has written the host copy
  u.weights = be_.allocate(mem_tag::weights, be_.work_dtype(), {1, u.padded}, "offloaded_weights");
  if (!be_.has_data()) return;
  const std::size_t slice = static_cast<std::size_t>(u.shard) * dtype_size(be_.work_dtype());
  char* device = static_cast<char*>(u.weights.data()) + u.comm->rank() * slice;
  if (stage_ == zero_stage::three)
    be_.copy_bytes_side(device, u.weight_shard.data(), slice, "weights_in");
  else if (u.stale)
    be_.copy_bytes_side(device, static_cast<char*>(u.host_copy.data()) + u.comm->rank() * slice, slice, "weights_in");
  else
    be_.copy_bytes_side(u.weights.data(), u.host_copy.data(), u.host_copy.bytes(), "weights_in");
  u.arriving = be_.side_point();
}

void parameter_store::acquire_offloaded(unit& u) {
  if (!offload_.params) {
    if (u.stale) return_weights(u);
    gather_on_first_acquire(u);
    return;
  }
  if (u.acquired++ > 0) return;
  if (u.weights.empty()) bring_params(u);
  if (u.arriving != 0) be_.join_side_point(u.arriving);  // the compute reads the weights once their copy is in
  u.arriving = 0;
  if (stage_ == zero_stage::three) {
    const std::size_t slice = u.weight_shard.bytes();
    void* mine = u.weights.data() == nullptr ? nullptr : static_cast<char*>(u.weights.data()) + u.comm->rank() * slice;
    u.comm->all_gather(mine, u.weights.data(), slice, "zero3_all_gather");
  } else if (u.stale) {
    share_weight_slice(u);
    // The other ranks' slices back into the host copy, beside the compute.
    if (be_.has_data()) {
      be_.copy_bytes_side(u.host_copy.data(), u.weights.data(), u.weights.bytes(), "weights_out");
      u.leaving = be_.side_point();
    }
  }
  u.stale = false;
}

// The collectives issued are deterministic on every rank (they depend on the flags and the
// units' states alone, never on how far the host has come), so that the ranks stay in
// step; with the parameters offloaded, only whether a copy starts here or at acquire()
// depends on the host: overlapped, a unit whose update is still running comes at
// acquire(), so that this thread never waits here ahead of the current unit's compute.
void parameter_store::prefetch_offloaded(unit& u) {
  if (!offload_.params) {
    if (stage_ != zero_stage::three || u.acquired > 0 || !u.weights.empty()) return;
    if (u.stale && offload_.overlap) return;  // its update comes back at acquire(), after the compute issued so far
    if (u.stale) return_weights(u);
    u.weights = be_.allocate(mem_tag::weights, be_.work_dtype(), {1, u.padded}, "gathered_weights");
    u.gathering =
        u.comm->all_gather_start(u.weight_shard.data(), u.weights.data(), u.weight_shard.bytes(), "zero3_all_gather");
    return;
  }
  if (u.acquired > 0 || !u.weights.empty()) return;
  if (offload_.overlap && u.task && !u.task->done()) return;  // still updating: copied at acquire()
  bring_params(u);
}

void parameter_store::release_offloaded(unit& u) {
  UPIPE_CHECK(u.acquired > 0, "release of a unit that was not acquired");
  if (--u.acquired > 0) return;
  if (u.leaving != 0) be_.join_side_point(u.leaving);  // the device bytes are read until the copy back is done
  u.leaving = 0;
  u.weights.reset();
}

}  // namespace upipe
