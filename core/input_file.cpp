#include "core/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

#include "moe/error.h"

namespace moe {
namespace {

std::string describe_errno(int error) {
  return std::error_code(error, std::generic_category()).message();
}

std::string_view file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

InputFile::InputFile(const std::filesystem::path& path, std::uint64_t max_bytes,
                     std::string_view what)
    : path_(path.string()), what_(what) {
  // O_NONBLOCK: opening a FIFO that has no writer would otherwise block before it is refused.
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd_ < 0) fail("cannot open {} '{}': {}", what_, path_, describe_errno(errno));
  try {
    struct stat status {};
    if (::fstat(fd_, &status) != 0)
      fail("cannot stat {} '{}': {}", what_, path_, describe_errno(errno));
    if (!S_ISREG(status.st_mode)) {
      fail("{} '{}' is {}; only regular files are read", what_, path_, file_kind(status.st_mode));
    }
    size_ = static_cast<std::uint64_t>(status.st_size);
    if (size_ > max_bytes) {
      fail("{} '{}' has {} bytes, more than the limit of {} bytes", what_, path_, size_, max_bytes);
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InputFile::read_at(std::uint64_t offset, void* out, std::size_t bytes) const {
  auto* dst = static_cast<char*>(out);
  while (bytes > 0) {
    // One call reads at most 1 GiB: Linux caps a single read near 2 GiB anyway.
    const std::size_t chunk = std::min<std::size_t>(bytes, std::size_t{1} << 30);
    const ssize_t got = ::pread(fd_, dst, chunk, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail("reading {} '{}' failed: {}", what_, path_, describe_errno(errno));
    if (got == 0) {
      fail("{} '{}' ended at byte {} of the {} its size gave (was it truncated while read?)", what_,
           path_, offset, size_);
    }
    dst += got;
    offset += static_cast<std::uint64_t>(got);
    bytes -= static_cast<std::size_t>(got);
  }
}

std::string InputFile::read_all() const {
  std::string text(static_cast<std::size_t>(size_), '\0');
  read_at(0, text.data(), text.size());
  return text;
}

}  // namespace moe
