#include "train/mesh.hpp"

#include <optional>
#include <string>

#include "comm/launch.hpp"
#include "comm/nccl.hpp"
#include "core/error.hpp"
#include "model/model_step.hpp"

namespace upipe {

namespace {

constexpr int max_replicas = 1 << 16;

// Why a CP group of o.cp ranks cannot sit on nodes of o.gpus_per_node GPUs, or "" when it
// can: a group inside a node (C divides G) or over whole nodes (G divides C), and hybrid's
// all-to-all groups inside a node when its ring spans several.
std::string placement_problem(const train_options& o) {
  const int G = o.gpus_per_node, C = o.cp.cp;
  if (G <= 0) return "";
  if (C <= G && G % C != 0)
    return "a CP group of " + std::to_string(C) + " consecutive ranks would cross a node boundary of --gpus-per-node " +
           std::to_string(G) + " (C must divide " + std::to_string(G) + " or be a multiple of it)";
  if (C > G && C % G != 0)
    return "a CP group of " + std::to_string(C) + " ranks spans nodes of " + std::to_string(G) +
           " GPUs without spanning whole ones (C must be a multiple of " + std::to_string(G) + ")";
  if (o.cp.strategy == strategy_kind::hybrid && C > G && o.cp.ring >= 1 && C % o.cp.ring == 0) {
    const int A = C / o.cp.ring;
    if (G % A != 0)
      return "hybrid's ring of " + std::to_string(o.cp.ring) + " crosses nodes of " + std::to_string(G) +
             " GPUs, and its all-to-all groups of A = C / R = " + std::to_string(A) +
             " ranks must lie inside a node (A dividing " + std::to_string(G) + ", e.g. --ring " +
             std::to_string(C / G) + ")";
  }
  return "";
}

// The run as it would be on mesh m: the strategy's default U, hybrid's ring as given.
train_options on_mesh(const train_options& o, mesh_shape m) {
  train_options t = o;
  t.dp = m.dp;
  t.cp.cp = m.cp;
  t.cp.head_chunk = 0;
  return t;
}

bool usable(const train_options& t) {
  try {
    if (!placement_problem(t).empty()) return false;
    const std::int64_t unit = layout_unit(t.cp);
    attention_config_for(t.model, t.cp, unit * 1024);
    return true;
  } catch (const config_error&) {
    return false;
  }
}

[[noreturn]] void refuse(const train_options& o, const std::string& why) {
  const int ranks = o.dp * o.cp.cp;
  throw config_error("--dp " + std::to_string(o.dp) + " x --cp " + std::to_string(o.cp.cp) + ": " + why +
                     "; meshes of " + std::to_string(ranks) + " ranks that " + std::string(strategy_name(o.cp.strategy)) +
                     " runs: " + meshes_text(valid_meshes(o, ranks)));
}

}  // namespace

std::vector<mesh_shape> valid_meshes(const train_options& o, int ranks) {
  std::vector<mesh_shape> out;
  for (int d = 1; d <= ranks; ++d)
    if (ranks % d == 0 && usable(on_mesh(o, {d, ranks / d}))) out.push_back({d, ranks / d});
  return out;
}

std::string meshes_text(const std::vector<mesh_shape>& meshes) {
  std::string text;
  for (const mesh_shape& m : meshes)
    text += (text.empty() ? "" : ", ") + ("--dp " + std::to_string(m.dp) + " --cp " + std::to_string(m.cp));
  return text.empty() ? "none" : text;
}

std::vector<int> valid_expert_parallel(const train_options& o) {
  std::vector<int> out{1};
  const int ranks = o.dp * o.cp.cp, experts = o.model.sparse_layer_count() > 0 ? o.model.moe.experts : 1;
  for (int e = 2; e <= ranks; ++e)
    if (ranks % e == 0 && experts % e == 0) out.push_back(e);
  return out;
}

// --ep E: EP groups of E consecutive ranks of the mesh, each rank E-th of a sparse layer's
// experts (docs/design.md section 12).
void validate_expert_parallel(const train_options& o) {
  if (o.ep == 1) return;
  std::string valid;
  for (const int e : valid_expert_parallel(o)) valid += (valid.empty() ? "" : ", ") + std::to_string(e);
  const int ranks = o.dp * o.cp.cp;
  if (o.model.sparse_layer_count() == 0)
    throw config_error("--ep " + std::to_string(o.ep) + ": " + o.model.name + " has no sparse (mixture-of-experts) "
                       "layer, so there are no experts to split; use --ep 1");
  if (o.ep < 1 || ranks % o.ep != 0 || o.model.moe.experts % o.ep != 0)
    throw config_error("--ep " + std::to_string(o.ep) + " must divide the mesh's --dp " + std::to_string(o.dp) +
                       " x --cp " + std::to_string(o.cp.cp) + " = " + std::to_string(ranks) + " ranks and " +
                       o.model.name + "'s " + std::to_string(o.model.moe.experts) + " experts; valid: --ep " + valid);
  const std::int64_t block = std::int64_t{o.model.moe.experts / o.ep} * 3 * o.model.moe.expert_width * o.model.hidden_size;
  if (o.state_format.moments == moment_format::q8 && block % q8_block != 0)
    throw config_error("--optimizer-state 8bit with --ep " + std::to_string(o.ep) + ": a rank's " + std::to_string(block) +
                       " expert parameters of a layer are not whole blocks of " + std::to_string(q8_block) +
                       "; use --optimizer-state bf16, or --ep 1");
}

void validate_mesh(const train_options& o) {
  validate_expert_parallel(o);
  if (o.dp < 1 || o.dp > max_replicas)
    throw config_error("--dp " + std::to_string(o.dp) + " must lie between 1 and " + std::to_string(max_replicas) +
                       " (data-parallel replicas, each a CP group of --cp ranks; for example --dp 2)");
  if (o.gpus_per_node < 0)
    throw config_error("--gpus-per-node " + std::to_string(o.gpus_per_node) +
                       " must be 0 (every rank on one node) or the GPUs of a node (for example 8)");
  if (o.dp > 1 && o.batch >= 1 && o.batch <= max_batch && global_batch(o) > max_batch)
    throw config_error("--dp " + std::to_string(o.dp) + " x --batch " + std::to_string(o.batch) + " = " +
                       std::to_string(global_batch(o)) + " sequences per step is past the " +
                       std::to_string(max_batch) + " a step takes; lower --batch to at most " +
                       std::to_string(max_batch / o.dp));
  if (o.cp.cp < 1) return;  // the CP checks name it
  if (const std::string why = placement_problem(o); !why.empty()) refuse(o, why);
  if (o.dp > 1) {
    try {
      attention_config_for(o.model, o.cp, layout_unit(o.cp) * 1024);
    } catch (const config_error& e) {
      refuse(o, e.what());
    }
  }
  const std::optional<launch_env> env = launcher_environment();
  // NCCL threads in one process: a GPU per rank.
  if (!env && o.dp > 1 && o.backend == backend_kind::cuda && o.comm.kind == comm_kind::nccl &&
      visible_gpus() < o.dp * o.cp.cp)
    throw config_error("--comm nccl with --dp " + std::to_string(o.dp) + " x --cp " + std::to_string(o.cp.cp) +
                       " needs a GPU per rank but " + std::to_string(visible_gpus()) + " are visible; meshes of " +
                       std::to_string(visible_gpus()) + " ranks that " + std::string(strategy_name(o.cp.strategy)) +
                       " runs: " + meshes_text(valid_meshes(o, visible_gpus())) +
                       " (or --comm threads for virtual ranks on one GPU)");
  const bool launched = env && o.backend == backend_kind::cuda && o.comm.kind != comm_kind::threads;
  if (launched && env->size != o.dp * o.cp.cp) {
    throw config_error(env->launcher + " started " + std::to_string(env->size) + " processes but --dp " +
                       std::to_string(o.dp) + " x --cp " + std::to_string(o.cp.cp) + " is " +
                       std::to_string(o.dp * o.cp.cp) + " ranks; meshes of " + std::to_string(env->size) + " ranks that " +
                       std::string(strategy_name(o.cp.strategy)) + " runs: " +
                       meshes_text(valid_meshes(o, env->size)));
  }
}

std::string mesh_placement(const train_options& o) {
  const int D = o.dp, C = o.cp.cp, G = o.gpus_per_node;
  const auto node_of = [&](int rank) { return G > 0 ? rank / G : 0; };
  std::string text = "# mesh: --dp " + std::to_string(D) + " x --cp " + std::to_string(C) + " = " +
                     std::to_string(D * C) + " ranks (world rank = replica x " + std::to_string(C) +
                     " + CP rank); ZeRO shards over all " + std::to_string(D * C) + "\n#  ";
  for (int d = 0; d < D && d < 8; ++d) {
    const int first = d * C, last = first + C - 1;
    const int n0 = node_of(first), n1 = node_of(last);
    text += " replica " + std::to_string(d) + ": ranks " + std::to_string(first) + "-" + std::to_string(last) +
            (n0 == n1 ? " (node " + std::to_string(n0) + ")" : " (nodes " + std::to_string(n0) + "-" + std::to_string(n1) + ")") +
            (d + 1 < D && d + 1 < 8 ? ";" : "");
  }
  if (D > 8) text += " ... replica " + std::to_string(D - 1);
  if (o.ep > 1)
    text += "\n# experts: EP groups of " + std::to_string(o.ep) + " consecutive ranks (0-" + std::to_string(o.ep - 1) +
            (D * C > o.ep ? ", " + std::to_string(o.ep) + "-" + std::to_string(2 * o.ep - 1) + ", ..." : std::string()) +
            "), each rank " + std::to_string(o.model.moe.experts / o.ep) + " of a sparse layer's " +
            std::to_string(o.model.moe.experts) + " experts; ranks b, " + std::to_string(o.ep) + " + b, ... hold the same "
            "experts and reduce their gradients";
  text += "\n# global batch = dp " + std::to_string(D) + " x batch " + std::to_string(o.batch) + " = " +
          std::to_string(global_batch(o)) + " sequences of " + std::to_string(o.seq_len) +
          " tokens per step (each replica accumulates its " + std::to_string(o.batch) +
          " micro-batch(es) of one sequence)\n";
  return text;
}

}  // namespace upipe
