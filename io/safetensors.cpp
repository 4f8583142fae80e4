#include "moe/safetensors.h"

#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <system_error>

#include "core/input_file.h"
#include "moe/error.h"

namespace moe {
namespace {

using Json = nlohmann::json;

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

// The element count of a shape, or nothing when a dimension is negative or the product overflows
// int64 (a shape read from a file can claim anything).
std::optional<std::int64_t> checked_numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (const auto d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

// The byte count of dtype × shape, or nothing when it does not fit in size_t.
std::optional<std::size_t> checked_bytes(const std::vector<std::int64_t>& shape, FileDType dtype) {
  const auto n = checked_numel(shape);
  std::size_t bytes = 0;
  if (!n || __builtin_mul_overflow(static_cast<std::uint64_t>(*n), file_dtype_size(dtype), &bytes))
    return std::nullopt;
  return bytes;
}

// A JSON value in a message: scalars as written (long strings cut), containers by kind only, so
// a message never recurses into (or grows with) whatever nesting a corrupt header holds.
std::string brief(const Json& value) {
  if (value.is_array()) return fmt::format("a list of {} items", value.size());
  if (value.is_object()) return fmt::format("an object of {} keys", value.size());
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > 64) text = text.substr(0, 60) + "...";
  return text;
}

// The 8-byte length prefix of a file of `file_bytes` bytes, checked against the file and the
// header bound.
std::uint64_t header_length(const char* prefix, std::uint64_t file_bytes, std::string_view source) {
  const std::uint64_t length = read_le64(prefix);
  if (length > file_bytes - 8) {
    fail("{}: header of {} bytes runs past the end of the file ({} bytes)", source, length,
         file_bytes);
  }
  if (length > kMaxHeaderBytes) {
    fail("{}: header of {} bytes exceeds the format's limit of {} bytes", source, length,
         kMaxHeaderBytes);
  }
  return length;
}

// The header's JSON. The format forbids repeated keys, but a JSON parser silently keeps one of
// them; its callback sees each key while the object it belongs to is still open, so repeats are
// caught there (the parser itself is iterative: deep nesting costs heap, not stack).
Json parse_header_json(std::string_view text, std::string_view source) {
  if (text.empty() || text.front() != '{')
    fail("{}: the header must be a JSON object starting with '{{'", source);
  std::vector<std::set<std::string>> open_objects;  // keys seen so far, innermost object last
  std::string entry;  // the top-level key being read: names the tensor in messages
  const Json::parser_callback_t callback = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == Json::parse_event_t::object_end) {
      open_objects.pop_back();
    } else if (event == Json::parse_event_t::key) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (depth == 1) entry = key;
      if (!open_objects.back().insert(key).second) {
        if (depth == 1 && key != "__metadata__")
          fail("{}: tensor '{}' appears twice in the header", source, key);
        fail("{}: key '{}' appears twice in the header's entry '{}'", source, key, entry);
      }
    }
    return true;
  };
  try {
    return Json::parse(text, callback);
  } catch (const Json::exception& e) {
    fail("{}: the header is not valid JSON: {}", source, e.what());
  }
}

// One tensor as the header describes it; its bytes are [begin, end) of the data section.
struct Entry {
  std::string name;
  FileTensor tensor;  // dtype and shape; the caller fills the data
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

struct Header {
  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
};

// A JSON integer >= 0 (the parser keeps "-0" as a signed zero), or nothing.
std::optional<std::uint64_t> non_negative(const Json& value) {
  if (value.is_number_unsigned()) return value.get<std::uint64_t>();
  if (value.is_number_integer() && value.get<std::int64_t>() == 0) return 0;
  return std::nullopt;
}

std::int64_t dimension(const Json& value, std::size_t index, std::string_view source,
                       const std::string& name) {
  if (const auto d = non_negative(value)) {
    if (*d > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail("{}: tensor '{}' has dimension {} = {}, beyond int64", source, name, index, *d);
    return static_cast<std::int64_t>(*d);
  }
  if (value.is_number_integer())
    fail("{}: tensor '{}' has a negative dimension {} = {}", source, name, index, brief(value));
  fail("{}: tensor '{}' has dimension {} = {}, not an integer", source, name, index, brief(value));
}

Entry parse_entry(const std::string& name, const Json& json, std::uint64_t data_bytes,
                  std::string_view source) {
  if (name.empty()) fail("{}: a tensor has an empty name", source);
  if (!json.is_object())
    fail("{}: tensor '{}' has the entry {}; expected an object", source, name, brief(json));
  for (const auto& [field, value] : json.items()) {
    if (field != "dtype" && field != "shape" && field != "data_offsets") {
      fail("{}: tensor '{}' has the unknown field '{}' (a tensor has dtype, shape, data_offsets)",
           source, name, field);
    }
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!json.contains(field)) fail("{}: tensor '{}' has no '{}'", source, name, field);
  }
  Entry e;
  e.name = name;
  const Json& dtype = json["dtype"];
  if (!dtype.is_string())
    fail("{}: tensor '{}' has dtype {}; expected a string", source, name, brief(dtype));
  e.tensor.dtype = parse_file_dtype(dtype.get<std::string>(), source, name);
  const Json& shape = json["shape"];
  if (!shape.is_array())
    fail("{}: tensor '{}' has shape {}; expected a list", source, name, brief(shape));
  for (std::size_t i = 0; i < shape.size(); ++i)
    e.tensor.shape.push_back(dimension(shape[i], i, source, name));
  const auto expected = checked_bytes(e.tensor.shape, e.tensor.dtype);
  if (!expected) {
    fail("{}: tensor '{}' of shape [{}] has more elements or bytes than 64 bits count", source,
         name, fmt::join(e.tensor.shape, ", "));
  }
  const Json& offsets = json["data_offsets"];
  const bool pair = offsets.is_array() && offsets.size() == 2;
  const auto begin = pair ? non_negative(offsets[0]) : std::nullopt;
  const auto end = pair ? non_negative(offsets[1]) : std::nullopt;
  if (!begin || !end) {
    fail("{}: tensor '{}' has data_offsets {}; expected [begin, end], two integers >= 0", source,
         name,
         pair ? fmt::format("[{}, {}]", brief(offsets[0]), brief(offsets[1])) : brief(offsets));
  }
  e.begin = *begin;
  e.end = *end;
  if (e.begin > e.end)
    fail("{}: tensor '{}' has data_offsets [{}, {}]: begin after end", source, name, e.begin,
         e.end);
  if (e.end > data_bytes) {
    fail("{}: tensor '{}' has data_offsets [{}, {}] outside the {} data bytes", source, name,
         e.begin, e.end, data_bytes);
  }
  if (e.end - e.begin != *expected) {
    fail("{}: tensor '{}' holds {} bytes but {}[{}] needs {}", source, name, e.end - e.begin,
         file_dtype_name(e.tensor.dtype), fmt::join(e.tensor.shape, ","), *expected);
  }
  return e;
}

// The format requires the tensors' byte ranges to tile the data section: sorted by offset, each
// starts where the one before ends, the first at 0 and the last at the section's end. (A zero-byte
// tensor occupies no bytes and fits anywhere between others.)
void check_coverage(std::vector<const Entry*> entries, std::uint64_t data_bytes,
                    std::string_view source) {
  std::sort(entries.begin(), entries.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry* e : entries) {
    if (e->begin < covered) {
      fail("{}: tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (bytes [{}, {}))", source,
           e->name, e->begin, e->end, previous->name, previous->begin, previous->end);
    }
    if (e->begin > covered) {
      fail("{}: bytes [{}, {}) of the data section belong to no tensor (a gap before tensor '{}')",
           source, covered, e->begin, e->name);
    }
    covered = e->end;
    if (e->end > e->begin) previous = e;
  }
  if (covered != data_bytes) {
    fail("{}: the data section has {} bytes but the tensors cover only the first {}", source,
         data_bytes, covered);
  }
}

Header parse_header(std::string_view text, std::uint64_t data_bytes, std::string_view source) {
  const Json json = parse_header_json(text, source);
  if (!json.is_object()) fail("{}: the header is not a JSON object", source);
  Header header;
  for (const auto& [name, entry] : json.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail("{}: __metadata__ is {}, not an object", source, brief(entry));
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string())
          fail("{}: metadata '{}' is {}, not a string", source, key, brief(value));
        header.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    header.entries.push_back(parse_entry(name, entry, data_bytes, source));
  }
  std::vector<const Entry*> order;
  for (const auto& e : header.entries) order.push_back(&e);
  check_coverage(std::move(order), data_bytes, source);
  return header;
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
  const auto n = checked_numel(shape);
  if (!n) fail("a tensor of shape [{}] has a negative or too large size", fmt::join(shape, ", "));
  return *n;
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
  const std::uint64_t length = header_length(bytes.data(), bytes.size(), source);
  const std::string_view data = bytes.substr(8 + length);
  Header header = parse_header(bytes.substr(8, length), data.size(), source);
  TensorFile file;
  file.source_ = std::string(source);
  file.metadata = std::move(header.metadata);
  for (auto& e : header.entries) {
    e.tensor.data.resize(e.end - e.begin);
    // A zero-byte tensor's buffer may be null, which memcpy must never see.
    if (!e.tensor.data.empty())
      std::memcpy(e.tensor.data.data(), data.data() + e.begin, e.tensor.data.size());
    file.tensors_.emplace(std::move(e.name), std::move(e.tensor));
  }
  return file;
}

TensorFile TensorFile::read(const std::filesystem::path& path, std::uint64_t max_bytes) {
  const std::string source = path.string();
  const InputFile in(path, max_bytes, "tensor file");
  if (in.size() < 8) fail("{}: {} bytes is too short for a safetensors file", source, in.size());
  char prefix[8];
  in.read_at(0, prefix, 8);
  const std::uint64_t length = header_length(prefix, in.size(), source);
  std::string text(static_cast<std::size_t>(length), '\0');
  in.read_at(8, text.data(), text.size());
  const std::uint64_t data_start = 8 + length;
  Header header = parse_header(text, in.size() - data_start, source);
  // Each tensor read straight into its buffer: the file is never held twice in memory. The
  // buffers add up to the data section, which the size limit bounds.
  TensorFile file;
  file.source_ = source;
  file.metadata = std::move(header.metadata);
  for (auto& e : header.entries) {
    e.tensor.data.resize(e.end - e.begin);
    if (!e.tensor.data.empty())
      in.read_at(data_start + e.begin, e.tensor.data.data(), e.tensor.data.size());
    file.tensors_.emplace(std::move(e.name), std::move(e.tensor));
  }
  return file;
}

std::string TensorFile::serialize() const {
  Json header = Json::object();
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
  const auto bytes = checked_bytes(shape, dtype);
  if (!bytes) {
    fail("TensorFile::add: tensor '{}' of shape [{}] has a negative dimension or too many bytes",
         name, fmt::join(shape, ", "));
  }
  if (*bytes > 0 && data == nullptr)
    fail("TensorFile::add: tensor '{}' has {} bytes but no data", name, *bytes);
  FileTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(*bytes);
  if (*bytes > 0) std::memcpy(t.data.data(), data, *bytes);
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
