#include "core/digest.hpp"

#include <openssl/evp.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <memory>

#include "core/error.hpp"
#include "core/files.hpp"

namespace upipe {

std::string file_sha256(const std::string& path, const std::string& what) {
  // A regular file only (read_text_file refuses FIFOs and devices); tokenizer files are
  // tens of MiB at most.
  const std::string bytes = read_text_file(path, what, std::uint64_t{1} << 30);
  const std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int length = 0;
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1 ||
      EVP_DigestUpdate(ctx.get(), bytes.data(), bytes.size()) != 1 ||
      EVP_DigestFinal_ex(ctx.get(), digest.data(), &length) != 1)
    throw io_error("cannot hash " + path + " (" + what + "): OpenSSL's SHA-256 failed");
  std::string hex;
  char two[3];
  for (unsigned int i = 0; i < length; ++i) {
    std::snprintf(two, sizeof two, "%02x", digest[i]);
    hex += two;
  }
  return hex;
}

}  // namespace upipe
