// Model weights on the host under Hugging Face names: read from and written to
// safetensors (checked against the configuration), or drawn at random.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "model/config.hpp"

namespace upipe {

using host_weights = std::map<std::string, std::vector<float>>;

// Reads every weight of `config` in full from a model directory (one model.safetensors or
// shards with their index), an index file or a .safetensors file (model/hf_model.hpp),
// checking every parameter is there with its shape; a tied model needs no lm_head.weight.
// Throws io_error naming the tensor, the shape found and the one expected.
host_weights read_weights(const model_config& config, const std::string& path);

// Writes the parameters of `config` as a safetensors file (atomically), in `type`.
void write_weights(const model_config& config, const host_weights& weights, const std::string& path, dtype type);

// Random initialization by the parameters' kinds: matrices and embeddings N(0, 0.02); norm
// weights scaling by 1 + N(0, 0.1) (a Gemma norm's stored weight is that minus its offset
// 1, a gated norm's that itself) and biases N(0, 0.1), so that a test cannot pass with a
// norm or a bias ignored or misplaced; a depthwise convolution N(0, 1 / Kc); A_log
// log 0.1 + N(0, 0.25), so that a Gated DeltaNet state carries over tens of tokens. Counter-based draws on all
// cores (core/random.hpp), so models of billions of parameters start in seconds.
host_weights random_weights(const model_config& config, unsigned long long seed);

// `count` token ids uniform in [0, vocab), from `seed` (std::mt19937_64).
std::vector<std::int32_t> random_tokens(std::int64_t count, std::int64_t vocab, unsigned long long seed);

}  // namespace upipe
