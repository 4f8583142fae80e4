// Safetensors files: the tensor-file format of moe_run and of checkpoints.
//
// Layout: an 8-byte little-endian header size N, N bytes of JSON
//   {"name": {"dtype": "BF16" | "F32" | "I32" | "I64", "shape": [...], "data_offsets": [begin,
//   end]},
//    ..., "__metadata__": {"key": "value", ...}}
// then the tensors' bytes, offsets relative to the end of the header. Data are held on the host.
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

  std::int64_t numel() const;
  // The view as a moe::Tensor over the host bytes (I64 has no moe::DType: an error).
  Tensor view();
};

std::size_t file_dtype_size(FileDType dtype);
std::string_view file_dtype_name(FileDType dtype);  // "BF16", "F32", "I32", "I64"

class TensorFile {
 public:
  // Throws moe::Error naming the file and the problem: short file, bad JSON, unknown dtype,
  // offsets outside the data or not matching dtype × shape.
  static TensorFile read(const std::filesystem::path& path);
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
  std::map<std::string, std::string> metadata;

 private:
  std::string source_ = "<memory>";
  std::map<std::string, FileTensor> tensors_;
};

}  // namespace moe
