// The safetensors header, read and written: the one place that knows its JSON, shared by
// TensorFile, TensorFileReader and TensorFileWriter (private to io/).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moe/safetensors.h"

namespace moe::safetensors_format {

// The element count of a shape, or nothing when a dimension is negative or the product overflows
// int64 (a shape read from a file can claim anything).
std::optional<std::int64_t> checked_numel(const std::vector<std::int64_t>& shape);
// The byte count of dtype × shape, or nothing when it does not fit in 64 bits.
std::optional<std::uint64_t> checked_bytes(const std::vector<std::int64_t>& shape, FileDType dtype);

// The 8-byte length prefix of a file of `file_bytes` (>= 8) bytes, checked against the file and
// the header bound.
std::uint64_t header_length(const char* prefix, std::uint64_t file_bytes, std::string_view source);

// One tensor as the header describes it; its bytes are [begin, end) of the data section.
struct Entry {
  std::string name;
  TensorInfo info;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

struct Header {
  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
};

// The header's JSON text, checked entry by entry and for exact coverage of a data section of
// `data_bytes` bytes; errors name `source`.
Header parse_header(std::string_view text, std::uint64_t data_bytes, std::string_view source);

// The length prefix and JSON (padded to keep the data 8-byte aligned) of a file holding these
// tensors, their data laid out in the order given: callers give name order, the order of the
// JSON's keys. Every spec's shape must already be checked.
std::string encode_header(const std::vector<TensorSpec>& tensors,
                          const std::map<std::string, std::string>& metadata);

}  // namespace moe::safetensors_format
