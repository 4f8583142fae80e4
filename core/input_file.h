// A regular file opened for reading, its size known and bounded before any byte is read: what
// every reader of a path given by a user (configs, tensor files) opens. The checks run on the open
// descriptor (fstat), so the file cannot be swapped between check and read, and a FIFO, a
// directory or a device such as /dev/zero is refused with a message instead of hanging or being
// read forever.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace moe {

class InputFile {
 public:
  // `what` names the file in messages ("config file", "tensor file").
  InputFile(const std::filesystem::path& path, std::uint64_t max_bytes, std::string_view what);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  std::uint64_t size() const { return size_; }
  // Exactly `bytes` bytes at `offset`; a file that ends early (shrunk while read) is an error.
  void read_at(std::uint64_t offset, void* out, std::size_t bytes) const;
  // The whole file.
  std::string read_all() const;

 private:
  int fd_ = -1;
  std::string path_;
  std::string what_;
  std::uint64_t size_ = 0;
};

}  // namespace moe
