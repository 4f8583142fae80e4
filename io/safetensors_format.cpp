#include "io/safetensors_format.h"

#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "moe/error.h"

namespace moe::safetensors_format {
namespace {

using Json = nlohmann::json;

FileDType parse_file_dtype(const std::string& text, std::string_view source,
                           const std::string& name) {
  if (text == "BF16") return FileDType::kBF16;
  if (text == "F32") return FileDType::kF32;
  if (text == "I32") return FileDType::kI32;
  if (text == "I64") return FileDType::kI64;
  fail("{}: tensor '{}' has dtype '{}'; supported are BF16, F32, I32, I64", source, excerpt(name),
       excerpt(text));
}

std::uint64_t read_le64(const char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
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

// Finds repeated keys, which the format forbids but a JSON parser silently resolves by keeping
// one of them. A pass of its own over the parser's events, each key checked while its object is
// open: nlohmann's callback-filtered parse would do it in one pass, but it rescans the enclosing
// object at the end of every member object, quadratic in the tensors of a header (a 6 MB header
// of 80,000 tensors took minutes). The parser is iterative: deep nesting costs heap, not stack.
class RepeatedKeys : public nlohmann::json_sax<Json> {
 public:
  explicit RepeatedKeys(std::string_view source) : source_(source) {}

  bool start_object(std::size_t) override { return open(); }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(); }  // its set stays empty
  bool end_array() override { return close(); }
  bool key(string_t& key) override {
    if (open_.size() == 1) entry_ = key;
    if (!open_.back().insert(key).second) {
      if (open_.size() == 1 && key == "__metadata__")
        fail("{}: '__metadata__' appears twice in the header", source_);
      if (open_.size() == 1)
        fail("{}: tensor '{}' appears twice in the header", source_, excerpt(key));
      fail("{}: key '{}' appears twice in the header's entry '{}'", source_, excerpt(key),
           excerpt(entry_));
    }
    return true;
  }
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  // The parse that follows reports the error with its own words.
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  // A header nests three levels (the header, an entry, its shape); a few more are let through
  // for the parse below to name what is wrong, but not millions, which would cost a set and a
  // parsed array each before any check could refuse them.
  static constexpr std::size_t kMostLevels = 16;
  bool open() {
    if (open_.size() == kMostLevels)
      fail("{}: the header nests JSON more than {} levels deep (a safetensors header nests 3)",
           source_, kMostLevels);
    open_.emplace_back();
    return true;
  }
  bool close() {
    open_.pop_back();
    return true;
  }
  std::string_view source_;
  std::vector<std::set<std::string>> open_;  // each open container's keys, innermost last
  std::string entry_;  // the top-level key being read: names the tensor in messages
};

// The header's JSON, refused where it repeats a key.
Json parse_header_json(std::string_view text, std::string_view source) {
  if (text.empty() || text.front() != '{')
    fail("{}: the header must be a JSON object starting with '{{'", source);
  // JSON text holds no raw NUL (a string writes it \u0000), but the parser takes one as the end of
  // its input, which would let bytes after it (NUL padding instead of spaces) pass unread.
  if (const auto nul = text.find('\0'); nul != std::string_view::npos)
    fail("{}: the header holds a NUL byte at offset {}; JSON text has none", source, nul);
  RepeatedKeys repeated(source);
  (void)Json::sax_parse(text, &repeated);
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {
    fail("{}: the header is not valid JSON: {}", source, e.what());
  }
}

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
      fail("{}: tensor '{}' has dimension {} = {}, beyond int64", source, excerpt(name), index, *d);
    return static_cast<std::int64_t>(*d);
  }
  if (value.is_number_integer())
    fail("{}: tensor '{}' has a negative dimension {} = {}", source, excerpt(name), index,
         brief(value));
  fail("{}: tensor '{}' has dimension {} = {}, not an integer", source, excerpt(name), index,
       brief(value));
}

Entry parse_entry(const std::string& name, const Json& json, std::uint64_t data_bytes,
                  std::string_view source) {
  if (name.empty()) fail("{}: a tensor has an empty name", source);
  // A control character would cut or garble every message naming the tensor (a NUL ends the
  // C string a terminal is given): such a name is shown escaped, once, here.
  const auto control = std::find_if(name.begin(), name.end(), [](char c) {
    return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
  });
  if (control != name.end()) {
    fail("{}: tensor {} has a control character (U+{:04X}) in its name, at byte {}", source,
         brief(Json(name)), static_cast<unsigned char>(*control), control - name.begin());
  }
  if (!json.is_object())
    fail("{}: tensor '{}' has the entry {}; expected an object", source, excerpt(name),
         brief(json));
  for (const auto& [field, value] : json.items()) {
    if (field != "dtype" && field != "shape" && field != "data_offsets") {
      fail("{}: tensor '{}' has the unknown field '{}' (a tensor has dtype, shape, data_offsets)",
           source, excerpt(name), field);
    }
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!json.contains(field)) fail("{}: tensor '{}' has no '{}'", source, excerpt(name), field);
  }
  Entry e;
  e.name = name;
  const Json& dtype = json["dtype"];
  if (!dtype.is_string())
    fail("{}: tensor '{}' has dtype {}; expected a string", source, excerpt(name), brief(dtype));
  e.info.dtype = parse_file_dtype(dtype.get<std::string>(), source, excerpt(name));
  const Json& shape = json["shape"];
  if (!shape.is_array())
    fail("{}: tensor '{}' has shape {}; expected a list", source, excerpt(name), brief(shape));
  for (std::size_t i = 0; i < shape.size(); ++i)
    e.info.shape.push_back(dimension(shape[i], i, source, excerpt(name)));
  const auto expected = checked_bytes(e.info.shape, e.info.dtype);
  if (!expected) {
    fail("{}: tensor '{}' of shape [{}] has more elements or bytes than 64 bits count", source,
         excerpt(name), excerpt(fmt::format("{}", fmt::join(e.info.shape, ", "))));
  }
  e.info.numel = *checked_numel(e.info.shape);  // fits: the byte count did
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
    fail("{}: tensor '{}' has data_offsets [{}, {}]: begin after end", source, excerpt(name),
         e.begin, e.end);
  if (e.end > data_bytes) {
    fail("{}: tensor '{}' has data_offsets [{}, {}] outside the {} data bytes", source,
         excerpt(name), e.begin, e.end, data_bytes);
  }
  if (e.end - e.begin != *expected) {
    fail("{}: tensor '{}' holds {} bytes but {}[{}] needs {}", source, excerpt(name),
         e.end - e.begin, file_dtype_name(e.info.dtype), fmt::join(e.info.shape, ","), *expected);
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

}  // namespace

std::optional<std::int64_t> checked_numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (const auto d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

std::optional<std::uint64_t> checked_bytes(const std::vector<std::int64_t>& shape,
                                           FileDType dtype) {
  const auto n = checked_numel(shape);
  std::uint64_t bytes = 0;
  if (!n || __builtin_mul_overflow(static_cast<std::uint64_t>(*n), file_dtype_size(dtype), &bytes))
    return std::nullopt;
  return bytes;
}

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

std::string encode_header(const std::vector<TensorSpec>& tensors,
                          const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    const std::uint64_t bytes = *checked_bytes(t.shape, t.dtype);
    header[t.name] = {{"dtype", file_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<char>((static_cast<std::uint64_t>(text.size()) >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace moe::safetensors_format
