// The pieces one attention call runs as on cuDNN (sdpa_cudnn.cpp): packed documents and a
// sliding window become ordinary calls on row ranges, each a causal or unmasked block with
// at most a diagonal band. Host logic only; included by sdpa_cudnn.cpp alone.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/error.hpp"
#include "ops/op_args.hpp"

namespace upipe::cuda::sdpa_pieces {

// A sliding window's diagonal band on the call's rows (top-left aligned): query row i keeps
// key row j iff i - left < j (left > 0; 0: no left bound) and j <= i + right (right >= 0;
// the causal mask is right 0, an unmasked block's band a right bound past its last key).
struct band {
  std::int64_t left = 0, right = 0;
  bool operator==(const band&) const = default;
};

// Packed documents as ordinary calls on row ranges: under the causal mask (queries and
// keys the same rows) each document is a causal call of its own; a block strictly in the
// past (ring) has at most one document that holds queries and keys, the one its first
// query is in, and the later queries see nothing. Each distinct length is a plan of its
// own. fn(q rows, k rows, mask) with rows as [first, count).
struct row_range {
  std::int64_t first = 0, count = 0;
};
template <class Fn>
void for_each_document_call(const document_mask& m, attn_mask mask, std::int64_t sq, std::int64_t skv, Fn&& fn) {
  if (!m.active()) {
    fn(row_range{0, sq}, row_range{0, skv}, mask);
    return;
  }
  if (mask == attn_mask::causal) {
    UPIPE_CHECK(m.q_first == m.k_first && sq == skv, "sdpa: documents under the causal mask need q and k on the same rows");
    std::int64_t row = 0;
    while (row < sq) {
      const std::int64_t g = m.q_first + row;
      const auto next = std::upper_bound(m.starts.begin(), m.starts.end(), g);
      const std::int64_t end = next == m.starts.end() ? sq : std::min(sq, *next - m.q_first);
      fn(row_range{row, end - row}, row_range{row, end - row}, attn_mask::causal);
      row = end;
    }
    return;
  }
  const std::int64_t start = m.start_of(m.q_first), k_last = m.k_first + skv - 1;
  if (start > k_last) return;
  const auto next = std::upper_bound(m.starts.begin(), m.starts.end(), m.q_first);
  const std::int64_t q_end = next == m.starts.end() ? sq : std::min(sq, *next - m.q_first);
  const std::int64_t k_begin = std::max<std::int64_t>(0, start - m.k_first);
  fn(row_range{0, q_end}, row_range{k_begin, skv - k_begin}, attn_mask::none);
}

// One call cuDNN runs: rows of q and k, the mask and, under a window, its band.
struct sdpa_piece {
  row_range q, k;
  attn_mask mask = attn_mask::causal;
  band bounds;
};

// A call's rows under a window W, whose rows start at global indices gq and gk, as the
// pieces cuDNN's band can express (a positive left bound, s_q <= s_kv): causal rows keep the
// band (W, 0) unless W reaches back past their first row; in a block of the past query row
// i sees key rows from i + c on (c = gq - gk - W + 1), so the key rows before c are cut
// (band (1, last key)), or the band starts at 1 - c; query rows that reach no key are left
// out (the caller has zeroed them), and more query rows than keys split.
template <class Fn>
void for_each_window_piece(std::int64_t window, std::int64_t gq, std::int64_t gk, row_range q, row_range k,
                           attn_mask mask, Fn&& fn) {
  if (q.count == 0 || k.count == 0) return;
  if (mask == attn_mask::causal) {
    fn(sdpa_piece{q, k, mask, window > 0 && window < q.count ? band{window, 0} : band{}});
    return;
  }
  const std::int64_t c = gq - gk - window + 1;
  if (window == 0 || c + q.count - 1 <= 0) {  // every query reaches every key
    fn(sdpa_piece{q, k, mask, {}});
    return;
  }
  if (c >= k.count) return;  // no query reaches a key
  const std::int64_t cut = std::max<std::int64_t>(c, 0);
  const row_range keys{k.first + cut, k.count - cut};
  const row_range queries{q.first, std::min(q.count, k.count - c)};
  if (queries.count > keys.count) {  // s_q <= s_kv: split the query rows
    for (std::int64_t i = 0; i < queries.count; i += keys.count) {
      const std::int64_t n = std::min(keys.count, queries.count - i);
      for_each_window_piece(window, gq + i, gk, row_range{q.first + i, n}, k, mask, fn);
    }
    return;
  }
  fn(sdpa_piece{queries, keys, mask, band{1 - (c - cut), keys.count - 1}});
}

// Every piece of a call: its documents' calls, each cut by the window.
template <class Args, class Fn>
void for_each_piece(const Args& a, Fn&& fn) {
  const document_mask& m = a.documents;
  for_each_document_call(m, a.mask, a.q.tokens, a.k.tokens, [&](row_range q, row_range k, attn_mask mask) {
    for_each_window_piece(a.window, m.q_first + q.first, m.k_first + k.first, q, k, mask, fn);
  });
}

// Does the call run as pieces (packed documents or a window), some of whose rows may be
// left out?
template <class Args>
bool in_pieces(const Args& a) {
  return a.documents.active() || a.window > 0;
}

template <class Args>
Args rows_of(const Args& a, const sdpa_piece& p) {
  Args sub = a;
  sub.q = a.q.token_block(p.q.first, p.q.count);
  sub.k = a.k.token_block(p.k.first, p.k.count);
  sub.v = a.v.token_block(p.k.first, p.k.count);
  sub.out = a.out.token_block(p.q.first, p.q.count);
  sub.lse = a.lse.token_block(p.q.first, p.q.count);
  sub.mask = p.mask;
  sub.documents = {};
  sub.window = 0;
  return sub;
}


}  // namespace upipe::cuda::sdpa_pieces
