// The lean AdamW state's golden reference (scripts/make_optimizer_fixtures.py,
// tests/golden/optim/): its hyperparameters and runs, and one mode's state as tensors on
// any backend, so that the cpu tests (tests/optim) and the GPU tests (tests/gpu) hold
// every backend to the same six steps, bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.hpp"
#include "backend/ops.hpp"
#include "core/error.hpp"
#include "formats/safetensors.hpp"

namespace upipe::adamw_fixture {

struct state_mode {
  moment_format moments = moment_format::f32;
  master_format master = master_format::f32;
  std::string key() const {
    return std::string(moments == moment_format::f32 ? "f32" : moments == moment_format::bf16 ? "bf16" : "q8") + "." +
           (master == master_format::f32 ? "f32" : "bf16_kahan");
  }
};

inline std::vector<state_mode> all_modes() {
  std::vector<state_mode> out;
  for (master_format w : {master_format::f32, master_format::bf16_kahan})
    for (moment_format m : {moment_format::f32, moment_format::bf16, moment_format::q8}) out.push_back({m, w});
  return out;
}

struct fixture {
  safetensors_file file;
  std::int64_t n = 0, steps = 0;
  float beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  std::vector<float> lr, grad_scale;
  std::vector<adamw_run> runs;

  const std::vector<float>& get(const std::string& name) const {
    const auto it = file.tensors.find(name);
    UPIPE_CHECK(it != file.tensors.end(), "the optimizer fixture has no tensor " + name);
    return it->second.values;
  }
  std::string name(const state_mode& m, std::int64_t step, const char* what) const {
    return m.key() + "." + std::to_string(step) + "." + what;
  }
};

inline fixture load() {
  const std::string dir = std::string(UPIPE_SOURCE_DIR) + "/tests/golden/optim/";
  fixture f;
  f.file = read_safetensors(dir + "adamw_modes.safetensors");
  std::ifstream in(dir + "adamw_modes.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  f.n = j.at("n");
  f.steps = j.at("steps");
  f.beta1 = j.at("beta1");
  f.beta2 = j.at("beta2");
  f.eps = j.at("eps");
  f.weight_decay = j.at("weight_decay");
  for (double x : j.at("lr")) f.lr.push_back(static_cast<float>(x));
  for (double x : j.at("grad_scale")) f.grad_scale.push_back(static_cast<float>(x));
  for (const auto& r : j.at("runs")) f.runs.push_back({r.at("end").get<std::int64_t>(), r.at("decay").get<bool>()});
  return f;
}

// Values in and out of a tensor of any state dtype (u8 codes as floats).
inline void put(backend& be, const tensor& t, const std::vector<float>& values) {
  if (t.type() != dtype::u8) return be.upload_f32(t, values.data());
  std::vector<std::uint8_t> codes(values.begin(), values.end());
  be.upload_bytes(t, codes.data(), codes.size());
}
inline std::vector<float> take(backend& be, const tensor& t) {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  if (t.type() != dtype::u8) {
    be.download_f32(out.data(), t);
    return out;
  }
  std::vector<std::uint8_t> codes(out.size());
  be.download_bytes(codes.data(), t, codes.size());
  std::copy(codes.begin(), codes.end(), out.begin());
  return out;
}

// One mode's state, fresh (the fixture's start, zero moments), on a backend. The working
// copy is in the backend's dtype.
struct mode_state {
  state_mode mode;
  tensor master, comp, m, v, m_absmax, v_absmax, grad, weights, direction;

  mode_state(backend& be, const fixture& f, state_mode md, dtype grad_type = dtype::f32) : mode(md) {
    const std::int64_t n = f.n;
    const bool kahan = md.master == master_format::bf16_kahan;
    master = be.allocate(mem_tag::optimizer, kahan ? dtype::bf16 : dtype::f32, {1, n}, "master");
    put(be, master, f.get("start"));
    if (kahan) comp = be.allocate_zeroed(mem_tag::optimizer, dtype::bf16, {1, n}, "master_comp");
    const dtype mt = md.moments == moment_format::q8 ? dtype::u8 : md.moments == moment_format::bf16 ? dtype::bf16
                                                                                                      : dtype::f32;
    m = be.allocate_zeroed(mem_tag::optimizer, mt, {1, n}, "exp_avg");
    v = be.allocate_zeroed(mem_tag::optimizer, mt, {1, n}, "exp_avg_sq");
    if (md.moments == moment_format::q8) {
      put(be, m, std::vector<float>(static_cast<std::size_t>(n), 127.0f));  // the signed map's 0
      m_absmax = be.allocate_zeroed(mem_tag::optimizer, dtype::f32, {1, n / q8_block}, "exp_avg_absmax");
      v_absmax = be.allocate_zeroed(mem_tag::optimizer, dtype::f32, {1, n / q8_block}, "exp_avg_sq_absmax");
    }
    grad = be.allocate(mem_tag::grads, grad_type, {1, n}, "grad");
    weights = be.allocate_zeroed(mem_tag::weights, be.work_dtype(), {1, n}, "weights");
    direction = be.allocate_zeroed(mem_tag::optimizer, dtype::f32, {1, n}, "direction");
  }

  // Step t (from 0) over elements [a, b) as one call of `part`; runs as the fixture's,
  // cut to the range (storage for them in `runs`).
  adamw_args args(const fixture& f, std::int64_t t, adamw_part part, std::int64_t a, std::int64_t b,
                  std::vector<adamw_run>& runs) const {
    const auto cols = [&](const tensor& x, std::int64_t scale = 1) {
      return x.empty() ? mat_view{} : x.matrix().col_block(a / scale, (b - a) / scale);
    };
    adamw_args r;
    if (part != adamw_part::moments) {
      r.master = cols(master);
      r.master_comp = cols(comp);
      r.weights = cols(weights);
    }
    if (part != adamw_part::master) {
      r.exp_avg = cols(m);
      r.exp_avg_sq = cols(v);
      r.exp_avg_absmax = cols(m_absmax, q8_block);
      r.exp_avg_sq_absmax = cols(v_absmax, q8_block);
      r.grad = cols(grad);
    }
    if (part != adamw_part::whole) r.direction = cols(direction);
    r.part = part;
    r.lr = f.lr[static_cast<std::size_t>(t)];
    r.beta1 = f.beta1;
    r.beta2 = f.beta2;
    r.eps = f.eps;
    r.weight_decay = f.weight_decay;
    r.grad_scale = f.grad_scale[static_cast<std::size_t>(t)];
    r.step = t + 1;
    runs.clear();
    std::int64_t begin = 0;
    for (const adamw_run& run : f.runs) {
      const std::int64_t lo = std::max(begin, a), hi = std::min(run.end, b);
      if (lo < hi) runs.push_back({hi - a, run.decay});
      begin = run.end;
    }
    r.runs = runs;
    return r;
  }

  // The state as the fixture names it, read back.
  std::map<std::string, std::vector<float>> values(backend& be) const {
    std::map<std::string, std::vector<float>> out{{"master", take(be, master)}, {"exp_avg", take(be, m)},
                                                  {"exp_avg_sq", take(be, v)}};
    if (!comp.empty()) out["master_comp"] = take(be, comp);
    if (!m_absmax.empty()) {
      out["exp_avg_absmax"] = take(be, m_absmax);
      out["exp_avg_sq_absmax"] = take(be, v_absmax);
    }
    return out;
  }
};

// Elements where two float vectors differ in their bits, and the first of them ("" when
// none).
inline std::string first_difference(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return "sizes " + std::to_string(got.size()) + " and " + std::to_string(want.size());
  std::int64_t count = 0, first = -1;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && count++ == 0) first = static_cast<std::int64_t>(i);
  if (count == 0) return "";
  return std::to_string(count) + " elements differ, the first at " + std::to_string(first) + ": " +
         std::to_string(got[static_cast<std::size_t>(first)]) + " against " +
         std::to_string(want[static_cast<std::size_t>(first)]);
}

}  // namespace upipe::adamw_fixture
