// The attention backward with its input normed a tile of rows at a time (what the model
// does at long shards) gives the gradients of the whole normed input, for every strategy,
// with tiles that do not divide the shard.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "backend/ops.hpp"
#include "comm/communicator.hpp"
#include "cp/attention_layer.hpp"
#include "runtime/cp_group.hpp"

#include "../support/compare.hpp"

namespace upipe {
namespace {

std::vector<float> random_values(std::size_t n, std::mt19937& rng, float mean, float spread) {
  std::normal_distribution<float> dist(mean, spread);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

tensor uploaded(backend& be, mem_tag tag, const shape& dims, const std::vector<float>& values, const char* label) {
  tensor t = be.allocate(tag, be.work_dtype(), dims, label);
  be.upload_f32(t, values.data());
  return t;
}

std::vector<float> downloaded(backend& be, const tensor& t) {
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  be.download_f32(v.data(), t);
  return v;
}

// The gradients of one backward: d_x, then dWq, dWk, dWv, dWo.
using gradients = std::vector<std::vector<float>>;

void expect_tiles_match_whole(strategy_kind kind, int cp, int head_chunk) {
  attention_config c;
  c.seq_len = 40;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.model_dim = 12;
  c.cp = cp;
  c.head_chunk = head_chunk;
  c.strategy = kind;
  c.rope.theta = 10000;
  validate(c);
  const std::int64_t s = c.local_tokens(), D = c.model_dim, Hd = c.heads * c.head_dim, Kd = c.kv_heads * c.head_dim;
  const float eps = 1e-5f;
  run_cp_group(
      backend_kind::cpu, {std::size_t{64} << 20, std::size_t{1} << 20}, cp,
      [&](int rank, backend& be, communicator& comm) {
        std::mt19937 rng(17 + rank);  // weights differ per rank below; re-seeded for them
        const std::vector<float> residual_values = random_values(static_cast<std::size_t>(s * D), rng, 0.3f, 1.0f);
        const std::vector<float> d_y_values = random_values(static_cast<std::size_t>(s * D), rng, 0.0f, 1.0f);
        std::mt19937 shared(5);  // every rank holds the same weights
        const tensor residual = uploaded(be, mem_tag::activations, {s, D}, residual_values, "residual");
        const tensor norm = uploaded(be, mem_tag::weights, {1, D},
                                     random_values(static_cast<std::size_t>(D), shared, 1.0f, 0.2f), "norm");
        const tensor wq = uploaded(be, mem_tag::weights, {Hd, D},
                                   random_values(static_cast<std::size_t>(Hd * D), shared, 0.0f, 0.3f), "wq");
        const tensor wk = uploaded(be, mem_tag::weights, {Kd, D},
                                   random_values(static_cast<std::size_t>(Kd * D), shared, 0.05f, 0.3f), "wk");
        const tensor wv = uploaded(be, mem_tag::weights, {Kd, D},
                                   random_values(static_cast<std::size_t>(Kd * D), shared, -0.05f, 0.3f), "wv");
        const tensor wo = uploaded(be, mem_tag::weights, {D, Hd},
                                   random_values(static_cast<std::size_t>(D * Hd), shared, 0.0f, 0.3f), "wo");
        const attention_weights w = {wq.matrix(), wk.matrix(), wv.matrix(), wo.matrix(), {}, {}};
        tensor h = be.allocate(mem_tag::activations, be.work_dtype(), {s, D}, "h");
        tensor rstd = be.allocate(mem_tag::activations, dtype::f32, {s, 1}, "rstd");
        ops::rmsnorm_forward(be, {residual.matrix(), norm.matrix(), h.matrix(), rstd.matrix(), eps});
        const tensor d_y = uploaded(be, mem_tag::activations, {s, D}, d_y_values, "d_y");
        // A layer whose plan norms the backward's input `tile` rows at a time (0: whole).
        auto backward = [&](std::int64_t tile) {
          attention_config tiled = c;
          tiled.input_tile = tile;
          attention_layer layer(tiled, be, {&comm, &comm});
          const tensor y = be.allocate(mem_tag::activations, be.work_dtype(), {s, D}, "y");
          const attention_layer::context ctx = layer.forward(h.matrix(), w, y.matrix());
          const tensor d_x = be.allocate_zeroed(mem_tag::activations, dtype::f32, {s, D}, "d_x");
          std::vector<tensor> g;
          for (const tensor* weight : {&wq, &wk, &wv, &wo})
            g.push_back(be.allocate_zeroed(mem_tag::grads, dtype::f32, weight->dims(), "grad"));
          const normed_input x = tile == 0 ? normed_input(h.matrix())
                                           : normed_input::of_tiles(residual.matrix(), norm.matrix(), eps, tile);
          layer.backward(ctx, x, w, d_y.matrix(), d_x.matrix(),
                         {g[0].matrix(), g[1].matrix(), g[2].matrix(), g[3].matrix(), {}, {}});
          gradients out = {downloaded(be, d_x)};
          for (const tensor& t : g) out.push_back(downloaded(be, t));
          return out;
        };
        const gradients whole = backward(0);
        for (std::int64_t tile : {std::int64_t{3}, std::int64_t{7}}) {
          const gradients tiled = backward(tile);
          const char* names[] = {"d_x", "dWq", "dWk", "dWv", "dWo"};
          for (std::size_t i = 0; i < whole.size(); ++i)
            EXPECT_LT(testing::max_difference_over_max(tiled[i], whole[i]), 1e-5)
                << strategy_name(kind) << " C=" << cp << " U=" << c.head_chunk << " tile " << tile << " rank " << rank
                << ": " << names[i];
        }
      });
}

TEST(normed_input_tiles, give_the_gradients_of_the_whole_input) {
  expect_tiles_match_whole(strategy_kind::ulysses, 1, 0);
  expect_tiles_match_whole(strategy_kind::ulysses, 2, 0);
  expect_tiles_match_whole(strategy_kind::upipe, 2, 2);
  expect_tiles_match_whole(strategy_kind::ring, 2, 0);
}

}  // namespace
}  // namespace upipe
