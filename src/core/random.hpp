// Counter-based random numbers for large host arrays: element i of a stream is a pure
// function of (seed, stream, i), so all cores can fill one array and the values do not
// depend on how many there are.
#pragma once

#include <cstdint>
#include <span>

namespace upipe {

// splitmix64's finalizer: a bijection of 64-bit words that mixes every bit.
constexpr std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// out[i] = scale * z, z standard normal (Box-Muller on two hashed words).
void fill_normal(std::span<float> out, std::uint64_t seed, std::uint64_t stream, float scale);

// out[i] uniform in [-bound, bound).
void fill_uniform(std::span<float> out, std::uint64_t seed, std::uint64_t stream, float bound);

}  // namespace upipe
