// Safetensors files: the tensor-file format of moe_run and of checkpoints.
//
// Layout: an 8-byte little-endian header size N, N bytes of JSON
//   {"name": {"dtype": "BF16" | "F32" | "I32" | "I64", "shape": [...], "data_offsets": [begin,
//   end]},
//    ..., "__metadata__": {"key": "value", ...}}
// then the tensors' bytes, offsets relative to the end of the header. Data are held on the host.
//
// A file is accepted only as the format specifies it: the header a JSON object without repeated
// keys, each tensor's byte count equal to dtype × shape, and the tensors' byte ranges covering the
// data section exactly (contiguous, no overlap, no gap, no trailing bytes). Every size read from
// a file is checked for overflow before it is used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "moe/tensor.h"

namespace moe {

enum class FileDType { kBF16, kF32, kI32, kI64 };

struct FileTensor {
  FileDType dtype = FileDType::kF32;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;

  // Throws moe::Error when a dimension is negative or the product overflows int64.
  std::int64_t numel() const;
  // The view as a moe::Tensor over the host bytes (I64 has no moe::DType: an error).
  Tensor view();
};

std::size_t file_dtype_size(FileDType dtype);
std::string_view file_dtype_name(FileDType dtype);  // "BF16", "F32", "I32", "I64"

// The header's bound, the one the format's reference implementation enforces. A header lists
// tensors, not their data (a million tensors' entries fit in well under 100 MB); without a bound
// a corrupt length field would make the reader allocate and scan up to the whole file as JSON.
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
// The default bound on a whole file read from disk: 64 GiB holds one layer of the largest shape
// in configs/ in F32 (deepseek-v3: w13 and w2 together 45 GB, its results file the same), and
// stops a corrupt or hostile size from exhausting memory. TensorFile::read takes another bound.
inline constexpr std::uint64_t kMaxTensorFileBytes = std::uint64_t{64} << 30;

class TensorFile {
 public:
  // Throws moe::Error naming the file, the tensor or key, and the offending value: short file,
  // header length beyond the file or kMaxHeaderBytes, bad JSON, a repeated key, unknown dtype or
  // entry field, offsets outside the data, not matching dtype × shape, overlapping, leaving gaps
  // or not covering the data section; for read(), also a path that is not a regular file or a
  // file larger than max_bytes. Tensors are read from the file straight into their buffers.
  static TensorFile read(const std::filesystem::path& path,
                         std::uint64_t max_bytes = kMaxTensorFileBytes);
  static TensorFile parse(std::string_view bytes, std::string_view source = "<memory>");
  void write(const std::filesystem::path& path) const;
  std::string serialize() const;

  void add(const std::string& name, FileDType dtype, std::vector<std::int64_t> shape,
           const void* data);
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws moe::Error naming the tensor (and the file it came from) when absent.
  const FileTensor& get(const std::string& name) const;
  FileTensor& get(const std::string& name);
  const std::map<std::string, FileTensor>& tensors() const { return tensors_; }
  // Where the tensors came from: the path given to read(), the source given to parse(), or
  // "<memory>" for a file built with add().
  const std::string& source() const { return source_; }
  std::map<std::string, std::string> metadata;

 private:
  std::string source_ = "<memory>";
  std::map<std::string, FileTensor> tensors_;
};

}  // namespace moe
