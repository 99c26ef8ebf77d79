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

// An input file open for reading: a regular file only, opened without waiting
// (O_NONBLOCK), so that a FIFO, a directory, a device or a symbolic link loop is refused by
// name and never waited on. Every reader of a user's file opens it through this. Throws
// io_error "cannot read WHAT 'PATH': it is a FIFO, not a regular file" and the like.
class input_file {
 public:
  input_file(const std::string& path, const std::string& what);
  ~input_file();
  input_file(const input_file&) = delete;
  input_file& operator=(const input_file&) = delete;
  int fd() const { return fd_; }
  std::uint64_t size() const { return size_; }
  // Throws the io_error of this file: "cannot read WHAT 'PATH': PROBLEM".
  [[noreturn]] void fail(const std::string& problem) const;

 private:
  std::string path_, what_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

// A whole input file mapped read-only (an input_file, so a regular file only); empty files
// map to no bytes.
class mapped_file {
 public:
  // How the bytes will be read: `sequential` tells the kernel to read ahead.
  enum class access { random, sequential };
  mapped_file(const std::string& path, const std::string& what, access pattern = access::random);
  ~mapped_file();
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;
  const void* data() const { return data_; }
  const std::uint8_t* bytes() const { return static_cast<const std::uint8_t*>(data_); }
  std::uint64_t size() const { return size_; }

 private:
  std::string path_;
  const void* data_ = nullptr;
  std::uint64_t size_ = 0;
};

// "a directory", "a FIFO", "a character device", "a socket", "a symbolic link loop",
// "missing" or "a regular file": what is at `path` (links followed), for messages.
std::string describe_path(const std::string& path);

// The whole of a small text file (a config.json, an index, a manifest): an input_file of
// at most `max_bytes`. Throws io_error naming `what`, the path and what is wrong with it.
std::string read_text_file(const std::string& path, const std::string& what,
                           std::uint64_t max_bytes = std::uint64_t{64} << 20);

// Where an output named `path` is written: the target of a symbolic link (resolved, so the
// link itself is never replaced), `path` otherwise. Throws io_error, before any work, when
// the path cannot take a file: a directory, a FIFO, a socket or a block device, a
// symbolic link loop, a missing parent directory (unless `parents` is made: then the
// nearest existing ancestor must be a directory, and make_parent_directories makes the
// rest), or an empty name. Character devices (/dev/null, /dev/stdout) are allowed: they are
// written in place.
enum class missing_parents : std::uint8_t { refused, made };
std::string checked_output_file(const std::string& path, const std::string& what,
                                missing_parents parents = missing_parents::refused);

// Makes the missing parent directories of an output file (mkdir -p); io_error naming `what`
// and the directory when one cannot be made.
void make_parent_directories(const std::string& path, const std::string& what);

// Is `path` a character device (written in place, not through a temporary)?
bool is_character_device(const std::string& path);

// Writes `text` to an output checked by checked_output_file: a regular file atomically
// (PATH.tmp-<pid>, fsync, rename; stale temporaries removed first), a character device in
// place. Throws io_error naming `what` and the path (a full disk, /dev/full).
void write_file_atomically(const std::string& path, const std::string& text, const std::string& what);

// Removes PATH.tmp-<pid> files whose process is gone (a write killed before its rename).
void remove_stale_temporaries(const std::string& path);

}  // namespace upipe
