#include "cp/strategy.hpp"

#include "backend/ops.hpp"
#include "core/error.hpp"
#include "cp/strategy_table.hpp"

namespace upipe {

std::vector<position_run> contiguous_positions(std::int64_t seq_len, int cp, int rank) {
  const std::int64_t s = seq_len / cp;
  return {{0, rank * s, s}};
}

std::vector<position_run> zigzag_positions(std::int64_t seq_len, int cp, int rank) {
  const std::int64_t c = seq_len / (2 * cp);
  return {{0, rank * c, c}, {c, (2 * cp - 1 - rank) * c, c}};
}

std::vector<position_run> document_positions(const std::vector<position_run>& layout,
                                             std::span<const std::int64_t> starts) {
  if (starts.size() <= 1) return layout;
  std::vector<position_run> out;
  for (const position_run& run : layout) {
    std::int64_t done = 0;
    while (done < run.count) {
      const std::int64_t g = run.position_begin + done;
      const auto next = std::upper_bound(starts.begin(), starts.end(), g);
      const std::int64_t start = *(next - 1);
      const std::int64_t end = next == starts.end() ? run.position_begin + run.count
                                                    : std::min(*next, run.position_begin + run.count);
      out.push_back({run.token_begin + done, g - start, end - g});
      done += end - g;
    }
  }
  return out;
}

normed_input normed_input::of_tiles(const mat_view& residual, const mat_view& norm_weight, float eps,
                                    std::int64_t tile, float weight_offset) {
  UPIPE_CHECK(tile > 0, "normed input tiles need a positive row count");
  normed_input x(mat_view{});
  x.tiled = true;
  x.residual = residual;
  x.norm_weight = norm_weight;
  x.eps = eps;
  x.weight_offset = weight_offset;
  x.tile = tile;
  return x;
}

normed_input normed_input::rows(std::int64_t first, std::int64_t count) const {
  if (!tiled) return normed_input(whole.row_block(first, count));
  return of_tiles(residual.row_block(first, count), norm_weight, eps, tile, weight_offset);
}

void for_each_input_tile(backend& be, const normed_input& x, const input_tile_fn& fn, const mat_view& rstd) {
  if (!x.tiled) {
    fn(0, x.whole);
    return;
  }
  const std::int64_t s = x.residual.rows, n = std::min(x.tile, s);
  const bool keep_rstd = rstd.rows > 0;
  UPIPE_CHECK(!keep_rstd || rstd.rows == s, "the 1/rms output needs a row per input row");
  tensor rows = be.allocate(mem_tag::attention, be.work_dtype(), {n, x.residual.cols}, "attn_norm_tile");
  tensor scratch = keep_rstd ? tensor() : be.allocate(mem_tag::attention, dtype::f32, {n, 1}, "attn_norm_tile_rstd");
  for (std::int64_t first = 0; first < s; first += n) {
    const std::int64_t count = std::min(n, s - first);
    const mat_view out = rows.matrix().row_block(0, count);
    const mat_view tile_rstd = keep_rstd ? rstd.row_block(first, count) : scratch.matrix().row_block(0, count);
    ops::rmsnorm_forward(be, {x.residual.row_block(first, count), x.norm_weight, out, tile_rstd, x.eps, x.weight_offset});
    fn(first, out);
  }
}

std::unique_ptr<attention_strategy> make_strategy(attention_config config, backend& be, const cp_groups& groups) {
  validate(config);
  return row_of(config.strategy).make(config, be, groups);
}

}  // namespace upipe
