#include "core/files.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>

#include "core/error.hpp"

namespace upipe {

namespace fs = std::filesystem;

namespace {

std::string node_name(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a file";
}

}  // namespace

std::string describe_path(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0) return node_name(info.st_mode);
  if (errno == ELOOP) return "a symbolic link loop";
  struct stat link {};
  if (::lstat(path.c_str(), &link) == 0 && S_ISLNK(link.st_mode)) return "a symbolic link to a missing path";
  return "missing";
}

input_file::input_file(const std::string& path, const std::string& what) : path_(path), what_(what) {
  if (path.empty()) fail("an empty path names no file");
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) {
    const int err = errno;
    fail(err == ENOENT   ? std::string("no such file")
         : err == ELOOP  ? std::string("it is a symbolic link loop, not a regular file")
         : err == EISDIR ? std::string("it is a directory, not a regular file")
                         : std::string(std::strerror(err)));
  }
  struct stat info {};
  if (::fstat(fd_, &info) != 0) fail(std::string("cannot stat it: ") + std::strerror(errno));
  if (!S_ISREG(info.st_mode)) fail("it is " + node_name(info.st_mode) + ", not a regular file");
  size_ = static_cast<std::uint64_t>(info.st_size);
}

input_file::~input_file() {
  if (fd_ >= 0) ::close(fd_);
}

void input_file::fail(const std::string& problem) const {
  throw io_error("cannot read " + what_ + " '" + path_ + "': " + problem);
}

mapped_file::mapped_file(const std::string& path, const std::string& what, access pattern) : path_(path) {
  const input_file file(path, what);
  size_ = file.size();
  if (size_ == 0) return;
  void* map = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, file.fd(), 0);  // keeps the file open
  if (map == MAP_FAILED) file.fail(std::string("cannot map it into memory: ") + std::strerror(errno));
  if (pattern == access::sequential) ::madvise(map, size_, MADV_SEQUENTIAL);
  data_ = map;
}

mapped_file::~mapped_file() {
  if (data_ && ::munmap(const_cast<void*>(data_), size_) != 0)
    std::fprintf(stderr, "upipe: cannot unmap %s: %s\n", path_.c_str(), std::strerror(errno));
}

std::string read_text_file(const std::string& path, const std::string& what, std::uint64_t max_bytes) {
  const input_file file(path, what);
  if (file.size() > max_bytes)
    file.fail("it holds " + std::to_string(file.size()) + " bytes, more than the " + std::to_string(max_bytes >> 20) +
              " MiB such a file ever needs (is it the right file?)");
  std::string text(static_cast<std::size_t>(file.size()), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(file.fd(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // shorter than its size said: a file truncated meanwhile
    done += static_cast<std::size_t>(n);
  }
  text.resize(done);
  return text;
}

bool is_character_device(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISCHR(info.st_mode);
}

std::string checked_output_file(const std::string& given, const std::string& what, missing_parents parents) {
  const auto refuse = [&](const std::string& problem) -> void {
    throw io_error("cannot write " + what + " '" + given + "': " + problem);
  };
  if (given.empty()) refuse("an empty path names no file");
  if (given.back() == '/') refuse("the path ends in '/', a directory; name a file");
  std::error_code ec;
  fs::path path(given);
  // Follows links to what they name (as the kernel does, at most 40), so that the file
  // behind them is written and the links stay; a dangling link's target is created.
  for (int hops = 0; fs::is_symlink(path, ec); ++hops) {
    const fs::path target = fs::read_symlink(path, ec);
    if (ec || hops == 40) refuse(hops == 40 ? "it is a symbolic link loop; name another file"
                                            : "its symbolic link cannot be read (" + ec.message() + ")");
    path = target.is_absolute() ? target : path.parent_path() / target;
  }
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0) {
    if (S_ISREG(info.st_mode) || S_ISCHR(info.st_mode)) return path.string();
    refuse("it is " + node_name(info.st_mode) + "; name a regular file (it is never replaced)");
  }
  if (errno == ELOOP) refuse("it is a symbolic link loop; name another file");
  fs::path parent = path.has_parent_path() ? path.parent_path() : fs::path(".");
  if (parents == missing_parents::made)  // the nearest ancestor that exists (".", for a relative "runs/m.jsonl")
    while (!fs::exists(parent, ec) && parent != parent.parent_path())
      parent = parent.has_parent_path() ? parent.parent_path() : fs::path(".");
  if (!fs::is_directory(parent, ec))
    refuse(fs::exists(parent, ec) ? parent.string() + " is not a directory; name a file in a directory"
                                  : "its directory " + parent.string() + " does not exist; create it first (mkdir -p " +
                                        parent.string() + ")");
  return path.string();
}

void make_parent_directories(const std::string& path, const std::string& what) {
  const fs::path parent = fs::path(path).parent_path();
  std::error_code ec;
  if (parent.empty() || fs::is_directory(parent, ec)) return;
  fs::create_directories(parent, ec);
  if (ec) throw io_error("cannot make the directory " + parent.string() + " for " + what + ": " + ec.message());
}

namespace {

void write_all(int fd, const std::string& text, const std::function<void(int)>& fail) {
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(n < 0 ? errno : ENOSPC);
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace

void write_file_atomically(const std::string& given, const std::string& text, const std::string& what) {
  const std::string path = checked_output_file(given, what);
  const auto fail = [&](int err) {
    throw io_error("cannot write " + what + " '" + given + "': " + std::strerror(err) + " (a full disk?)");
  };
  if (is_character_device(path)) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) fail(errno);
    try {
      write_all(fd, text, fail);
    } catch (...) {
      ::close(fd);
      throw;
    }
    if (::close(fd) != 0) fail(errno);
    return;
  }
  remove_stale_temporaries(path);
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(errno);
  try {
    write_all(fd, text, fail);
    if (::fsync(fd) != 0) fail(errno);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  const int closed = ::close(fd);
  if (closed != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(err);
  }
}

void remove_stale_temporaries(const std::string& path) {
  const fs::path target(path);
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string prefix = target.filename().string() + ".tmp-";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(parent, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string pid = name.substr(prefix.size());
    if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) continue;
    if (::kill(static_cast<pid_t>(std::stol(pid)), 0) != 0 && errno == ESRCH) fs::remove_all(entry.path(), ec);
  }
}

}  // namespace upipe
