// Paths as a user means them. Inputs are opened as regular files only (a FIFO would wait
// for a writer forever, a directory or a device is not a file of ours), and outputs are
// written so that nothing already there is lost: through a symbolic link to its target
// (the link stays), into a character device as it is (/dev/null), never over a FIFO, a
// directory or a device node; a regular file is replaced atomically from a temporary
// PATH.tmp-<pid>, and temporaries that a killed writer left are removed by the next write.
#pragma once

#include <cstdint>
#include <string>

namespace upipe {

// "a directory", "a FIFO", "a character device", "a socket", "a symbolic link loop",
// "missing" or "a regular file": what is at `path` (links followed), for messages.
std::string describe_path(const std::string& path);

// The whole of a small text file (a config.json, an index, a manifest): a regular file of
// at most `max_bytes`, opened without waiting (O_NONBLOCK). Throws io_error naming `what`,
// the path and what is wrong with it.
std::string read_text_file(const std::string& path, const std::string& what,
                           std::uint64_t max_bytes = std::uint64_t{64} << 20);

// Where an output named `path` is written: the target of a symbolic link (resolved, so the
// link itself is never replaced), `path` otherwise. Throws io_error, before any work, when
// the path cannot take a file: a directory, a FIFO, a socket or a block device, a
// symbolic link loop, a missing parent directory, or an empty name. Character devices
// (/dev/null, /dev/stdout) are allowed: they are written in place.
std::string checked_output_file(const std::string& path, const std::string& what);

// Is `path` a character device (written in place, not through a temporary)?
bool is_character_device(const std::string& path);

// Writes `text` to an output checked by checked_output_file: a regular file atomically
// (PATH.tmp-<pid>, fsync, rename; stale temporaries removed first), a character device in
// place. Throws io_error naming `what` and the path (a full disk, /dev/full).
void write_file_atomically(const std::string& path, const std::string& text, const std::string& what);

// Removes PATH.tmp-<pid> files whose process is gone (a write killed before its rename).
void remove_stale_temporaries(const std::string& path);

}  // namespace upipe
