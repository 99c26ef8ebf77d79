// Data parallelism beside context parallelism on the cpu backend (docs/design.md section
// 11): D = 2 replicas of C = 2 ranks train exactly what one rank trains with the replicas'
// sequences as one batch (--batch 2), under every strategy, ZeRO-2 and 3, on packed
// documents and a token stream, with the optimizer (and the weights) in host memory, and
// with LoRA: the losses and every saved master weight within 1e-6. A run saved on one mesh
// resumes on another and continues the same steps. Bad meshes are refused naming the
// meshes that would run.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "model/lora.hpp"
#include "model/parameter_store.hpp"
#include "train/mesh.hpp"
#include "train/train_checkpoint.hpp"
#include "train/run_directory.hpp"
#include "train/trainer.hpp"
#include "train_support.hpp"

namespace upipe {
namespace {

namespace fs = std::filesystem;

constexpr double exact = 1e-6;

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("upipe_dp_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

// A corpus of documents of varied lengths (5 to 83 tokens) over pseudo-random ids, so that
// a window holds several documents and no two windows are alike.
std::string write_corpus(const fs::path& dir) {
  fs::create_directories(dir);
  const std::string prefix = (dir / "corpus").string();
  std::ofstream tokens(prefix + ".tokens", std::ios::binary), index(prefix + ".index", std::ios::binary);
  std::uint64_t offset = 0, x = 12345;
  index.write(reinterpret_cast<const char*>(&offset), 8);
  for (int d = 0; d < 40; ++d) {
    const int length = 5 + (d * 37) % 79;
    for (int i = 0; i < length; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const auto id = static_cast<std::uint32_t>((x >> 33) % 250);
      tokens.write(reinterpret_cast<const char*>(&id), 4);
    }
    offset += static_cast<std::uint64_t>(length);
    index.write(reinterpret_cast<const char*>(&offset), 8);
  }
  const nlohmann::json m = {{"format", "upipe-tokens"}, {"version", 1}, {"dtype", "uint32"}, {"vocab_size", 256},
                            {"documents", 40}, {"tokens", offset}};
  std::ofstream(prefix + ".json") << m.dump();
  return prefix;
}

// Four steps of tiny-llama at 64 tokens on D x C ranks, `batch` sequences per replica.
train_options run_on(int dp, const cp_settings& cp, std::int64_t batch, zero_stage zero) {
  train_options o = four_tiny_steps(cp, zero, batch);
  o.dp = dp;
  return o;
}

// The reference: one rank, the two replicas' sequences as one batch.
train_options one_rank(const train_options& o) {
  train_options one = o;
  one.dp = 1;
  one.cp = {strategy_kind::ulysses, 1, 0};
  one.batch = global_batch(o);
  one.offload_optimizer = one.offload_params = false;
  return one;
}

std::string name_of(const train_options& o) {
  return std::string(strategy_name(o.cp.strategy)) + " D=" + std::to_string(o.dp) + " C=" +
         std::to_string(o.cp.cp) + " U=" + std::to_string(o.cp.head_chunk) + " R=" + std::to_string(o.cp.ring) +
         " N=" + std::to_string(o.cp.seq_chunks) + " zero=" + (o.zero == zero_stage::three ? "3" : "2") +
         (o.offload_params ? " offload optimizer,params" : o.offload_optimizer ? " offload optimizer" : "") +
         (o.data_path.empty() ? " passkey" : " " + std::string(o.packing == packing_mode::stream ? "stream" : "documents")) +
         (o.step.lora.enabled() ? " lora" : "");
}

// Runs `o`, saving at its end; its last checkpoint becomes `dir`. Returns its losses.
std::vector<double> train_and_save(train_options o, const fs::path& dir) {
  const fs::path run = dir.string() + ".run";
  o.save_dir = run.string();
  std::vector<double> out;
  for (const step_record& r : train(o, nullptr).steps) out.push_back(r.loss);
  fs::rename(resolve_checkpoint(run.string()), dir);
  fs::remove_all(run);
  return out;
}

// The trained store's parameters by unit: the model's, or under LoRA each layer's adapters
// as one.
std::vector<std::vector<unit_parameter>> trained_units(const train_options& o) {
  if (!o.step.lora.enabled()) return parameter_units(o.model);
  std::vector<std::vector<unit_parameter>> units(static_cast<std::size_t>(o.model.num_layers) + 2);
  for (int l = 0; l < o.model.num_layers; ++l)
    units[1 + static_cast<std::size_t>(l)] = {
        {"layer " + std::to_string(l) + " adapters", 0, lora_parameter_count(o.model, o.step.lora) / o.model.num_layers}};
  return units;
}

// Every parameter's saved fp32 master in `got` against `want`, max |a - b| / max |b|.
void expect_same_weights(const fs::path& got, const fs::path& want, const train_options& o) {
  const saved_state a(got.string()), b(want.string());
  const auto units = trained_units(o);
  for (std::size_t u = 0; u < units.size(); ++u)
    for (const unit_parameter& p : units[u]) {
      std::vector<float> x(static_cast<std::size_t>(p.numel)), y(x.size());
      a.read(static_cast<int>(u), shard_state::master, p.offset, p.numel, x.data());
      b.read(static_cast<int>(u), shard_state::master, p.offset, p.numel, y.data());
      double diff = 0, scale = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        diff = std::max(diff, std::abs(static_cast<double>(x[i]) - y[i]));
        scale = std::max(scale, std::abs(static_cast<double>(y[i])));
      }
      EXPECT_LE(diff, exact * scale) << name_of(o) << ": " << p.name << " differs by " << diff << " of " << scale;
    }
}

void expect_same_losses(const std::vector<double>& got, const std::vector<double>& want, const train_options& o) {
  ASSERT_EQ(got.size(), want.size()) << name_of(o);
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_LT(std::abs(got[i] - want[i]) / want[i], exact) << name_of(o) << " step " << i + 1;
}

// The same run on one replica of its CP group with the global batch accumulated.
train_options one_replica(const train_options& o) {
  train_options one = o;
  one.dp = 1;
  one.batch = global_batch(o);
  return one;
}

// Runs `o` once per distinct configuration (by name_of), saving into dir; the losses and
// where they were saved.
struct reference_runs {
  fs::path dir;
  std::map<std::string, std::pair<fs::path, std::vector<double>>> done;

  const std::pair<fs::path, std::vector<double>>& of(const train_options& o) {
    const std::string key = name_of(o) + " batch " + std::to_string(o.batch) + " lr " + std::to_string(o.optim.lr);
    auto it = done.find(key);
    if (it != done.end()) return it->second;
    const fs::path saved = dir / ("reference" + std::to_string(done.size()));
    return done[key] = {saved, train_and_save(o, saved)};
  }
};

// Each run on its mesh: its losses those of one rank with its global batch, and its losses
// and every saved weight those of one replica of its CP group accumulating the global
// batch (the replicas' gradients are summed as that replica adds its micro-batches). The
// weights are not held to the one rank's: a CP group's reduce-scatter adds other partial
// sums than one rank's GEMM does, and AdamW's first steps magnify that rounding wherever a
// gradient element nearly cancels (1e-8 of eps); that is the CP group's, not the mesh's,
// and the D x 1 runs, which have no CP group, match one rank's weights too.
void expect_runs_equal_one_rank(const std::vector<train_options>& runs, const std::string& tag) {
  reference_runs references{scratch(tag), {}};
  fs::create_directories(references.dir);
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const train_options& o = runs[i];
    const auto& one = references.of(one_rank(o));
    if (o.data_path.empty()) EXPECT_LT(one.second.back(), one.second.front()) << name_of(o) << ": one rank learns";
    const auto& replica = references.of(one_replica(o));
    const fs::path saved = references.dir / ("run" + std::to_string(i));
    const std::vector<double> got = train_and_save(o, saved);
    expect_same_losses(got, one.second, o);
    expect_same_losses(got, replica.second, o);
    expect_same_weights(saved, replica.first, o);
    fs::remove_all(saved);
  }
  fs::remove_all(references.dir);
}

// The five strategies on C = 2: upipe at U = 2, fpdt over two sequence chunks, hybrid as a
// ring of two groups of one.
std::vector<cp_settings> every_strategy() {
  return {{strategy_kind::ulysses, 2, 0}, {strategy_kind::upipe, 2, 2}, {strategy_kind::ring, 2, 0},
          {strategy_kind::fpdt, 2, 0, 1, 2}, {strategy_kind::hybrid, 2, 0, 2}};
}

TEST(dp, two_replicas_of_two_ranks_equal_one_rank_with_the_batch_under_every_strategy_and_zero_stage) {
  std::vector<train_options> runs;
  for (zero_stage z : {zero_stage::two, zero_stage::three}) {
    for (const cp_settings& cp : every_strategy()) runs.push_back(run_on(2, cp, 1, z));
    runs.push_back(run_on(2, {strategy_kind::ulysses, 1, 0}, 1, z));  // no CP group: one rank's weights too
  }
  expect_runs_equal_one_rank(runs, "strategies");
}

TEST(dp, each_replica_reads_its_own_documents_and_stream_windows) {
  const fs::path data = scratch("corpus");
  const std::string corpus = write_corpus(data);
  std::vector<train_options> runs;
  for (const cp_settings& cp : every_strategy()) {
    train_options o = run_on(2, cp, 1, cp.strategy == strategy_kind::ring ? zero_stage::three : zero_stage::two);
    o.data_path = corpus;
    runs.push_back(o);
  }
  train_options stream = run_on(2, {strategy_kind::upipe, 2, 2}, 1, zero_stage::three);
  stream.data_path = corpus;
  stream.packing = packing_mode::stream;
  runs.push_back(stream);
  expect_runs_equal_one_rank(runs, "documents");
  // Two sequences a replica: the data as one rank with four reads it. The weights go
  // unchecked here: the replicas' sums (a + b) + (c + d) are another association than one
  // replica's ((a + b) + c) + d, which AdamW magnifies as above.
  stream.batch = 2;
  const std::vector<double> two_each = train_and_save(stream, data / "two_each");
  expect_same_losses(two_each, train_and_save(one_rank(stream), data / "four_on_one"), stream);
  fs::remove_all(data);
}

TEST(dp, the_offloaded_optimizer_and_lora_train_on_the_mesh) {
  const fs::path data = scratch("offload_corpus");
  const std::string corpus = write_corpus(data);
  std::vector<train_options> runs;
  for (zero_stage z : {zero_stage::two, zero_stage::three}) {
    train_options o = run_on(2, {strategy_kind::upipe, 2, 2}, 1, z);
    o.offload_optimizer = true;
    runs.push_back(o);
    o.offload_params = true;
    o.cp = {strategy_kind::ring, 2, 0};
    runs.push_back(o);
  }
  train_options documents = run_on(2, {strategy_kind::hybrid, 2, 0, 2}, 1, zero_stage::three);
  documents.data_path = corpus;
  documents.offload_optimizer = true;
  runs.push_back(documents);
  train_options lora = run_on(2, {strategy_kind::ulysses, 2, 0}, 1, zero_stage::three);
  lora.step.lora = parse_lora("r=4,alpha=8", lora.model);
  lora.optim.lr = 1e-2;
  runs.push_back(lora);
  lora.offload_optimizer = true;
  lora.cp = {strategy_kind::fpdt, 2, 0, 1, 2};
  runs.push_back(lora);
  expect_runs_equal_one_rank(runs, "offload");
  fs::remove_all(data);
}

TEST(dp, a_run_saved_on_one_mesh_resumes_on_another) {
  // Saved at step 2 of D = 2 x C = 2, resumed on D = 1 x C = 4 (--batch 2) and on D = 2 x
  // C = 1: the same global batch, so the steps go on as the uninterrupted run's, the state
  // resharded from 4 ranks' shards onto the new mesh's.
  const fs::path dir = scratch("resume");
  const train_options whole = run_on(2, {strategy_kind::upipe, 2, 2}, 1, zero_stage::three);
  std::vector<double> uninterrupted;
  for (const step_record& r : train(whole, nullptr).steps) uninterrupted.push_back(r.loss);
  train_options first = whole;
  first.stop_after = 2;
  train_and_save(first, dir);
  EXPECT_TRUE(fs::exists(dir / "trainer" / "rank-00003-of-00004.safetensors"));
  for (const auto& [dp, cp, batch, zero] :
       {std::tuple{1, cp_settings{strategy_kind::ring, 4, 0}, 2, zero_stage::two},
        std::tuple{2, cp_settings{strategy_kind::ulysses, 1, 0}, 1, zero_stage::three}}) {
    train_options next = run_on(dp, cp, batch, zero);
    next.resume_dir = dir.string();
    std::vector<double> resumed;
    for (const step_record& r : train(next, nullptr).steps) resumed.push_back(r.loss);
    ASSERT_EQ(resumed.size(), 2u);
    for (std::size_t i = 0; i < 2; ++i)
      EXPECT_LT(std::abs(resumed[i] - uninterrupted[2 + i]) / uninterrupted[2 + i], exact)
          << name_of(next) << " step " << 3 + i;
  }
  fs::remove_all(dir);
}

// A config_error from `o`'s validation, its message (fails the test when none is thrown).
std::string refusal(const train_options& o) {
  try {
    validate(o);
  } catch (const config_error& e) {
    return e.what();
  }
  ADD_FAILURE() << name_of(o) << " was not refused";
  return "";
}

TEST(dp, bad_meshes_are_refused_naming_the_meshes_that_run) {
  train_options o = run_on(0, {strategy_kind::upipe, 2, 0}, 1, zero_stage::two);
  EXPECT_NE(refusal(o).find("--dp 0 must lie between 1 and 65536"), std::string::npos) << refusal(o);
  // tiny-llama's 4 heads do not split over 3 ranks: of 6 ranks, C = 1 and 2 do.
  o = run_on(2, {strategy_kind::upipe, 3, 0}, 1, zero_stage::two);
  EXPECT_NE(refusal(o).find("meshes of 6 ranks that upipe runs: --dp 3 --cp 2, --dp 6 --cp 1"), std::string::npos)
      << refusal(o);
  // Ring splits no heads: any C runs (on a length of its layout's unit, 2C).
  o.cp.strategy = strategy_kind::ring;
  o.seq_len = 96;
  EXPECT_NO_THROW(validate(o));
  // A CP group of 2 on nodes of 3 GPUs straddles a node boundary.
  o = run_on(3, {strategy_kind::ulysses, 2, 0}, 1, zero_stage::two);
  o.gpus_per_node = 3;
  EXPECT_NE(refusal(o).find("would cross a node boundary of --gpus-per-node 3"), std::string::npos) << refusal(o);
  EXPECT_NE(refusal(o).find("--dp 6 --cp 1"), std::string::npos) << refusal(o);
  // Hybrid's ring over nodes of 2 with all-to-all groups of 4: not a multiple of the node.
  o = run_on(2, {strategy_kind::hybrid, 4, 0, 1}, 1, zero_stage::two);
  o.gpus_per_node = 2;
  EXPECT_NE(refusal(o).find("must lie inside a node (A dividing 2, e.g. --ring 2)"), std::string::npos) << refusal(o);
  o.cp.ring = 2;
  EXPECT_NO_THROW(validate(o));
  // The global batch is bounded as a step's batch is.
  o = run_on(4, {strategy_kind::ulysses, 1, 0}, max_batch / 2, zero_stage::two);
  EXPECT_NE(refusal(o).find("lower --batch to at most 16384"), std::string::npos) << refusal(o);
  // Under a launcher the job must be D x C processes.
  o = run_on(2, {strategy_kind::upipe, 2, 0}, 1, zero_stage::two);
  o.backend = backend_kind::cuda;
  ::setenv("OMPI_COMM_WORLD_RANK", "0", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "8", 1);
  const std::string launched = refusal(o);
  ::unsetenv("OMPI_COMM_WORLD_RANK");
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  EXPECT_NE(launched.find("started 8 processes but --dp 2 x --cp 2 is 4 ranks; meshes of 8 ranks that upipe runs: "
                          "--dp 2 --cp 4, --dp 4 --cp 2, --dp 8 --cp 1"),
            std::string::npos)
      << launched;
}

TEST(dp, the_placement_names_each_replica_its_ranks_and_nodes) {
  train_options o = run_on(4, {strategy_kind::upipe, 4, 0}, 2, zero_stage::three);
  o.gpus_per_node = 8;
  const std::string text = mesh_placement(o);
  EXPECT_NE(text.find("--dp 4 x --cp 4 = 16 ranks"), std::string::npos) << text;
  EXPECT_NE(text.find("replica 1: ranks 4-7 (node 0); replica 2: ranks 8-11 (node 1)"), std::string::npos) << text;
  EXPECT_NE(text.find("global batch = dp 4 x batch 2 = 8 sequences"), std::string::npos) << text;
}

}  // namespace
}  // namespace upipe
