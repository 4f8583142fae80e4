#include "moe/safetensors.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <sstream>

#include "moe/error.h"

namespace moe {
namespace {

FileDType parse_file_dtype(const std::string& text, std::string_view source,
                           const std::string& name) {
  if (text == "BF16") return FileDType::kBF16;
  if (text == "F32") return FileDType::kF32;
  if (text == "I32") return FileDType::kI32;
  if (text == "I64") return FileDType::kI64;
  fail("{}: tensor '{}' has dtype '{}'; supported are BF16, F32, I32, I64", source, name, text);
}

std::uint64_t read_le64(const char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

}  // namespace

std::size_t file_dtype_size(FileDType dtype) {
  switch (dtype) {
    case FileDType::kBF16:
      return 2;
    case FileDType::kF32:
    case FileDType::kI32:
      return 4;
    case FileDType::kI64:
      return 8;
  }
  return 0;
}

std::string_view file_dtype_name(FileDType dtype) {
  switch (dtype) {
    case FileDType::kBF16:
      return "BF16";
    case FileDType::kF32:
      return "F32";
    case FileDType::kI32:
      return "I32";
    case FileDType::kI64:
      return "I64";
  }
  return "?";
}

std::int64_t FileTensor::numel() const {
  std::int64_t n = 1;
  for (const auto d : shape) n *= d;
  return n;
}

Tensor FileTensor::view() {
  DType dtype_view = DType::kFP32;
  switch (dtype) {
    case FileDType::kBF16:
      dtype_view = DType::kBF16;
      break;
    case FileDType::kF32:
      dtype_view = DType::kFP32;
      break;
    case FileDType::kI32:
      dtype_view = DType::kInt32;
      break;
    case FileDType::kI64:
      fail("FileTensor::view: I64 tensors have no moe::DType");
  }
  return Tensor(data.data(), dtype_view, shape);
}

TensorFile TensorFile::parse(std::string_view bytes, std::string_view source) {
  if (bytes.size() < 8)
    fail("{}: {} bytes is too short for a safetensors file", source, bytes.size());
  const std::uint64_t header_size = read_le64(bytes.data());
  if (header_size > bytes.size() - 8) {
    fail("{}: header of {} bytes runs past the end of the file ({} bytes)", source, header_size,
         bytes.size());
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.substr(8, header_size));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: the header is not valid JSON: {}", source, e.what());
  }
  if (!header.is_object()) fail("{}: the header is not a JSON object", source);
  const std::string_view data = bytes.substr(8 + header_size);

  TensorFile file;
  file.source_ = std::string(source);
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail("{}: __metadata__ is not an object", source);
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) fail("{}: metadata '{}' is not a string", source, key);
        file.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    try {
      FileTensor t;
      t.dtype = parse_file_dtype(entry.at("dtype").get<std::string>(), source, name);
      t.shape = entry.at("shape").get<std::vector<std::int64_t>>();
      for (const auto d : t.shape) {
        if (d < 0) fail("{}: tensor '{}' has a negative dimension", source, name);
      }
      const auto offsets = entry.at("data_offsets").get<std::vector<std::uint64_t>>();
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data.size()) {
        fail("{}: tensor '{}' has data_offsets outside the {} data bytes", source, name,
             data.size());
      }
      const auto expected = static_cast<std::uint64_t>(t.numel()) * file_dtype_size(t.dtype);
      if (offsets[1] - offsets[0] != expected) {
        fail("{}: tensor '{}' holds {} bytes but {}{} needs {}", source, name,
             offsets[1] - offsets[0], file_dtype_name(t.dtype), nlohmann::json(t.shape).dump(),
             expected);
      }
      t.data.resize(expected);
      std::memcpy(t.data.data(), data.data() + offsets[0], expected);
      file.tensors_.emplace(name, std::move(t));
    } catch (const nlohmann::json::exception& e) {
      fail("{}: tensor '{}' has a malformed entry: {}", source, name, e.what());
    }
  }
  return file;
}

TensorFile TensorFile::read(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open tensor file '{}'", path.string());
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return parse(bytes.str(), path.string());
}

std::string TensorFile::serialize() const {
  nlohmann::json header = nlohmann::json::object();
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors_) {  // std::map: name order, reproducible files
    header[name] = {{"dtype", file_dtype_name(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<char>((static_cast<std::uint64_t>(text.size()) >> (8 * i)) & 0xff);
  out += text;
  for (const auto& [name, t] : tensors_)
    out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size());
  return out;
}

void TensorFile::write(const std::filesystem::path& path) const {
  std::ofstream out(path, std::ios::binary);
  if (!out) fail("cannot create tensor file '{}'", path.string());
  const std::string bytes = serialize();
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) fail("writing tensor file '{}' failed", path.string());
}

void TensorFile::add(const std::string& name, FileDType dtype, std::vector<std::int64_t> shape,
                     const void* data) {
  if (name.empty() || name == "__metadata__")
    fail("TensorFile::add: '{}' is not a valid tensor name", name);
  FileTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  for (const auto d : t.shape) {
    if (d < 0) fail("TensorFile::add: tensor '{}' has a negative dimension", name);
  }
  t.data.resize(static_cast<std::size_t>(t.numel()) * file_dtype_size(dtype));
  if (!t.data.empty()) std::memcpy(t.data.data(), data, t.data.size());
  tensors_[name] = std::move(t);
}

const FileTensor& TensorFile::get(const std::string& name) const {
  const auto found = tensors_.find(name);
  if (found == tensors_.end()) fail("{}: no tensor named '{}'", source_, name);
  return found->second;
}

FileTensor& TensorFile::get(const std::string& name) {
  return const_cast<FileTensor&>(static_cast<const TensorFile&>(*this).get(name));
}

}  // namespace moe
