// Every strategy of the strategy table equals the float64 single-device reference on every
// supported shape of the sweep (H, K, C, U, N, d, S), with random asymmetric weights: the
// cases come from the table's rows, so a new row is swept the day it is added.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "core/error.hpp"
#include "cp/strategy_table.hpp"
#include "runtime/attention_experiment.hpp"

namespace upipe {
namespace {

struct group_shape {
  int heads, kv_heads, cp;
};

std::vector<group_shape> supported_shapes() {
  std::vector<group_shape> shapes;
  for (int H : {4, 8, 12, 16})
    for (int K : {1, 2, 4, H}) {
      if (H % K != 0 || (K == H && K <= 4)) continue;  // K = H already listed
      for (int C : {1, 2, 3, 4})
        if (H % C == 0 && (K % C == 0 || C % K == 0)) shapes.push_back({H, K, C});
    }
  return shapes;
}

class strategy_sweep : public ::testing::TestWithParam<group_shape> {};

// The sweep's layer: a width unlike H*d, so a transposed weight cannot pass.
attention_config sweep_config(const group_shape& g, strategy_kind kind, int chunk, int d, std::int64_t S) {
  attention_config c;
  c.seq_len = S;
  c.heads = g.heads;
  c.kv_heads = g.kv_heads;
  c.head_dim = d;
  c.model_dim = 20;
  c.cp = g.cp;
  c.head_chunk = chunk;
  c.strategy = kind;
  c.rope.theta = 10000;
  return c;
}

// A row of the table at one U and N (N 0: the row's default).
struct sweep_case {
  strategy_kind kind;
  int head_chunk, seq_chunks;
};

// Every row but the meshes (hybrid_sweep below) at every U it takes over C ranks, with
// its default N, or with each N of `chunks` it accepts (a row that requires chunks takes
// those of 2 or more).
std::vector<sweep_case> table_cases(const group_shape& g, const std::vector<int>& chunks = {0}) {
  std::vector<sweep_case> cases;
  for (const strategy_row& row : strategy_rows()) {
    if (row.mesh) continue;
    for (int u : head_chunk_choices(row, g.heads, g.cp))
      for (int n : chunks) {
        if (n > 1 && row.chunks == sequence_chunking::none) continue;
        if (n == 1 && row.chunks == sequence_chunking::required) continue;
        cases.push_back({row.kind, row.heads == head_stages::chosen ? u : 0, n});
      }
  }
  return cases;
}

// Does S divide into the row's layout (C, or 2C for zigzag halves) and its N chunks?
bool fits(const group_shape& g, const sweep_case& k, std::int64_t S) {
  attention_config c;
  c.cp = g.cp;
  c.strategy = k.kind;
  const std::int64_t unit = c.layout_unit();
  return S % unit == 0 && k.seq_chunks <= S / g.cp;
}

experiment_result run(const attention_config& c) {
  experiment_options o;
  o.seed = 1000 + c.heads * 100 + c.kv_heads * 10 + c.cp;
  o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
  return run_attention_experiment(c, o);
}

TEST_P(strategy_sweep, matches_reference) {
  const group_shape g = GetParam();
  int runs = 0;
  for (int d : {8, 16})
    for (std::int64_t S : {24, 36, 48})
      for (const sweep_case& k : table_cases(g)) {
        if (!fits(g, k, S)) continue;
        attention_config c = sweep_config(g, k.kind, k.head_chunk, d, S);
        c.seq_chunks = k.seq_chunks;
        c.rope.scaling.kind = S == 36 ? rope_kind::llama3 : rope_kind::none;  // Llama 3 scaling on one length
        c.rope.scaling.original_max_position = 16;
        c.qk_norm = (S == 48 && d == 16);  // Qwen3's per-head q/k norm on one configuration
        c.overlap_comm = d == 16 && !c.chunked() && row_of(k.kind).chunks != sequence_chunking::required;
        const experiment_result r = run(c);
        ASSERT_TRUE(r.max_rel_error.has_value());
        for (const auto& [name, e] : r.rel_error)
          EXPECT_LT(e, 1e-5) << strategy_name(k.kind) << " U=" << c.head_chunk << " d=" << d << " S=" << S
                             << " tensor " << name;
        ++runs;
      }
  EXPECT_GT(runs, 0);
}

// Random document boundaries: every strategy keeps each token's attention inside its
// document and restarts RoPE with it, as the reference does. The boundaries fall anywhere:
// inside a rank's shard, on a shard's edge, a document of one token, and one longer than
// a shard; ring skips the blocks that share no document.
std::vector<std::int64_t> random_documents(std::int64_t S, std::uint64_t seed) {
  std::vector<std::int64_t> starts = {0};
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (std::int64_t g = 1; g < S; ++g) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    if (x % 5 == 0) starts.push_back(g);
  }
  if (starts.size() < 3) starts = {0, 1, S / 2};
  return starts;
}

TEST_P(strategy_sweep, packed_documents_match_reference) {
  const group_shape g = GetParam();
  int runs = 0;
  for (std::int64_t S : {24, 48})
    for (const sweep_case& k : table_cases(g)) {
      if (!fits(g, k, S)) continue;
      attention_config c = sweep_config(g, k.kind, k.head_chunk, 8, S);
      c.seq_chunks = k.seq_chunks;
      c.qk_norm = S == 48;
      experiment_options o;
      o.seed = 7000 + c.heads * 100 + c.kv_heads * 10 + c.cp;
      o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
      o.documents = random_documents(S, o.seed + static_cast<std::uint64_t>(S));
      const experiment_result r = run_attention_experiment(c, o);
      ASSERT_TRUE(r.max_rel_error.has_value());
      for (const auto& [name, e] : r.rel_error)
        EXPECT_LT(e, 1e-5) << strategy_name(k.kind) << " U=" << c.head_chunk << " S=" << S << " tensor " << name;
      ++runs;
    }
  EXPECT_GT(runs, 0);
}

// Sequence chunks: fpdt (Ulysses in N chunks) and upipe at every U with N in {1, 2, 3, 4},
// chunks that do not divide a rank's shard evenly (S = 36), Qwen3's qk-norm and packed
// documents on some: the earlier chunks' K/V pass through host memory and the parts merge
// by log-sum-exp, and the result is the reference's.
TEST_P(strategy_sweep, sequence_chunks_match_reference) {
  const group_shape g = GetParam();
  int runs = 0;
  for (std::int64_t S : {24, 36, 48})
    for (const sweep_case& k : table_cases(g, {2, 3, 4})) {
      if (!fits(g, k, S)) continue;
      attention_config c = sweep_config(g, k.kind, k.head_chunk, 8, S);
      c.seq_chunks = k.seq_chunks;
      c.qk_norm = S == 48;
      experiment_options o;
      o.seed = 11000 + c.heads * 100 + c.kv_heads * 10 + c.cp + k.seq_chunks;
      o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
      if (S != 36) o.documents = random_documents(S, o.seed + static_cast<std::uint64_t>(S));
      const experiment_result r = run_attention_experiment(c, o);
      ASSERT_TRUE(r.max_rel_error.has_value());
      for (const auto& [name, e] : r.rel_error)
        EXPECT_LT(e, 1e-5) << strategy_name(k.kind) << " U=" << c.head_chunk << " N=" << k.seq_chunks << " S=" << S
                           << " tensor " << name;
      ++runs;
    }
  EXPECT_GT(runs, 0);
}

// A sliding window under every strategy: W of one key (the token itself), W shorter than
// a rank's shard and a multiple of nothing, W longer than a shard, W = S and W > S (global
// attention), packed documents on one. Ring and hybrid skip the blocks wholly outside the
// window, the chunked strategies the parts; each equals the float64 reference.
TEST_P(strategy_sweep, sliding_window_matches_reference) {
  const group_shape g = GetParam();
  const std::int64_t S = 48;  // a multiple of 2C for every C of the sweep
  std::vector<sweep_case> cases = table_cases(g);
  for (const sweep_case& k : table_cases(g, {3}))
    if (k.head_chunk == 0 || k.head_chunk == g.cp) cases.push_back(k);  // chunked: the smallest U
  int runs = 0;
  for (const std::int64_t window : {1, 5, 13, 48, 100})
    for (const sweep_case& k : cases) {
      if (!fits(g, k, S)) continue;
      attention_config c = sweep_config(g, k.kind, k.head_chunk, 8, S);
      c.seq_chunks = k.seq_chunks;
      c.window = window;
      c.qk_norm = window == 13;
      experiment_options o;
      o.seed = 13000 + c.heads * 100 + c.kv_heads * 10 + c.cp + static_cast<unsigned long long>(window);
      o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
      if (window == 13) o.documents = random_documents(S, o.seed);
      const experiment_result r = run_attention_experiment(c, o);
      ASSERT_TRUE(r.max_rel_error.has_value());
      for (const auto& [name, e] : r.rel_error)
        EXPECT_LT(e, 1e-5) << strategy_name(k.kind) << " U=" << c.head_chunk << " N=" << c.seq_chunks
                           << " W=" << window << " tensor " << name;
      ++runs;
    }
  EXPECT_GT(runs, 0);
}

INSTANTIATE_TEST_SUITE_P(all_supported, strategy_sweep, ::testing::ValuesIn(supported_shapes()),
                         [](const auto& info) {
                           return "H" + std::to_string(info.param.heads) + "_K" + std::to_string(info.param.kv_heads) +
                                  "_C" + std::to_string(info.param.cp);
                         });

// Hybrid over every 2-D mesh of C <= 8 ranks (R rings of A = C / R), with Ulysses (U = H)
// and every valid UPipe U inside the groups: kv heads split and replicated over A, qk-norm
// and packed documents on some.
struct mesh_shape {
  int heads, kv_heads, cp, ring;
};

std::vector<mesh_shape> mesh_shapes() {
  std::vector<mesh_shape> out;
  for (int C : {2, 3, 4, 6, 8})
    for (int R = 1; R <= C; ++R) {
      if (C % R != 0) continue;
      const int A = C / R;
      for (auto [H, K] : std::vector<std::pair<int, int>>{{4, 2}, {8, 2}, {8, 8}, {12, 4}, {16, 4}})
        if (H % A == 0 && (K % A == 0 || A % K == 0)) out.push_back({H, K, C, R});
    }
  return out;
}

class hybrid_sweep : public ::testing::TestWithParam<mesh_shape> {};

// The table's mesh rows (hybrid).
std::vector<const strategy_row*> mesh_rows() {
  std::vector<const strategy_row*> rows;
  for (const strategy_row& row : strategy_rows())
    if (row.mesh) rows.push_back(&row);
  return rows;
}

TEST_P(hybrid_sweep, matches_reference) {
  const mesh_shape m = GetParam();
  const int A = m.cp / m.ring;
  int runs = 0;
  for (const strategy_row* row : mesh_rows())
    for (int u : head_chunk_choices(*row, m.heads, A))
      for (const bool documents : {false, true}) {
        const std::int64_t S = 48;  // a multiple of 2C for every C of the sweep
        attention_config c = sweep_config({m.heads, m.kv_heads, m.cp}, row->kind, u, 8, S);
        c.ring = m.ring;
        c.qk_norm = documents;
        experiment_options o;
        o.seed = 9000 + m.heads * 100 + m.kv_heads * 10 + m.cp + u;
        o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
        if (documents) o.documents = random_documents(S, o.seed);
        const experiment_result r = run_attention_experiment(c, o);
        ASSERT_TRUE(r.max_rel_error.has_value());
        for (const auto& [name, e] : r.rel_error)
          EXPECT_LT(e, 1e-5) << "U=" << u << (documents ? " documents" : "") << " tensor " << name;
        ++runs;
      }
  EXPECT_GT(runs, 0);
}

// Windows across the mesh: W shorter than a zigzag half and longer, with Ulysses and the
// smallest UPipe U inside the groups, packed documents on one.
TEST_P(hybrid_sweep, sliding_window_matches_reference) {
  const mesh_shape m = GetParam();
  int runs = 0;
  for (const strategy_row* row : mesh_rows()) {
    const std::vector<int> chunks = head_chunk_choices(*row, m.heads, m.cp / m.ring);
    for (const int u : {chunks.front(), chunks.back()})
      for (const std::int64_t window : {5, 11}) {
        const std::int64_t S = 48;
        attention_config c = sweep_config({m.heads, m.kv_heads, m.cp}, row->kind, u, 8, S);
        c.ring = m.ring;
        c.window = window;
        experiment_options o;
        o.seed = 15000 + m.heads * 100 + m.kv_heads * 10 + m.cp + u;
        o.limits = {std::size_t{64} << 20, std::size_t{1} << 20};
        if (window == 5) o.documents = random_documents(S, o.seed);
        const experiment_result r = run_attention_experiment(c, o);
        ASSERT_TRUE(r.max_rel_error.has_value());
        for (const auto& [name, e] : r.rel_error)
          EXPECT_LT(e, 1e-5) << "U=" << u << " W=" << window << " tensor " << name;
        ++runs;
      }
  }
  EXPECT_GT(runs, 0);
}

INSTANTIATE_TEST_SUITE_P(meshes, hybrid_sweep, ::testing::ValuesIn(mesh_shapes()), [](const auto& info) {
  const mesh_shape& m = info.param;
  return "H" + std::to_string(m.heads) + "_K" + std::to_string(m.kv_heads) + "_R" + std::to_string(m.ring) + "xA" +
         std::to_string(m.cp / m.ring);
});

TEST(hybrid_config, bad_meshes_are_refused_with_a_valid_alternative) {
  const auto refused = [](attention_config c, const std::string& says) {
    try {
      validate(c);
      ADD_FAILURE() << "accepted: " << says;
    } catch (const config_error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  attention_config c = sweep_config({8, 2, 4}, strategy_kind::hybrid, 0, 8, 48);
  c.ring = 3;
  refused(c, "--ring 3 must divide cp C = 4");
  c.ring = 2;
  c.head_chunk = 3;
  refused(c, "U must be a multiple of A and divide H; valid: 2, 4, 8");
  c.head_chunk = 0;
  c.seq_len = 44;
  refused(c, "must be divisible by 2C = 8");
  attention_config u = sweep_config({8, 2, 4}, strategy_kind::upipe, 0, 8, 48);
  u.ring = 2;
  refused(u, "--ring 2 applies to hybrid only");
  attention_config wide = sweep_config({6, 2, 8}, strategy_kind::hybrid, 0, 8, 48);
  wide.ring = 2;
  refused(wide, "the all-to-all group A = C / R = 4 must divide query heads H = 6");
  c.seq_len = 48;
  validate(c);
  EXPECT_EQ(c.head_chunk, 8);  // USP by default: Ulysses inside the groups
}

// Ring splits no heads, so it runs where C does not divide H or K (1024 GPUs of an 8B
// model): more ranks than heads, and a C that divides neither.
TEST(ring_groups, need_not_divide_the_heads) {
  for (auto [H, K, C] : {std::tuple{4, 2, 8}, {6, 3, 4}, {8, 8, 3}}) {
    attention_config c = sweep_config({H, K, C}, strategy_kind::ring, 0, 16, 2 * C * 4);
    const experiment_result r = run(c);
    ASSERT_TRUE(r.max_rel_error.has_value());
    EXPECT_LT(*r.max_rel_error, 1e-5) << "H" << H << " K" << K << " C" << C;
  }
}

// The sweep must cover the interesting regimes, or it proves little.
TEST(strategy_sweep_coverage, covers_split_and_replicated_kv) {
  bool split = false, replicated = false, odd_cp = false;
  for (const auto& g : supported_shapes()) {
    split |= g.kv_heads > g.cp && g.cp > 1;
    replicated |= g.kv_heads < g.cp;
    odd_cp |= g.cp == 3;
  }
  EXPECT_TRUE(split && replicated && odd_cp);
}

}  // namespace
}  // namespace upipe
