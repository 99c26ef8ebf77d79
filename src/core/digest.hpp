// Content digests of files (OpenSSL's SHA-256): which tokenizer made a corpus.
#pragma once

#include <string>

namespace upipe {

// The SHA-256 of a regular file's bytes, as 64 lowercase hex digits. Throws io_error naming
// `what` and the path when it cannot be read.
std::string file_sha256(const std::string& path, const std::string& what);

}  // namespace upipe
