// Safetensors files made by hand for the tests: any header, right or wrong, byte by byte.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "moe/error.h"
#include "moe/safetensors.h"
#include "support/test_util.h"

namespace moe::test {

// The 8-byte little-endian length prefix of the format.
inline std::string length_prefix(std::uint64_t length) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return out;
}

// A file assembled by hand, byte by byte, as the format specifies.
inline std::string hand_made(const std::string& header, const std::string& data) {
  return length_prefix(header.size()) + header + data;
}

// One header entry, written by hand so that any value (wrong ones included) can be given.
inline std::string entry(const std::string& name, const std::string& dtype,
                         const std::string& shape, const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":" + offsets + "}";
}

inline std::string error_of(const std::string& bytes) {
  try {
    TensorFile::parse(bytes, "f.safetensors");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

inline std::string read_error(const std::filesystem::path& path, std::uint64_t max_bytes) {
  try {
    TensorFile::read(path, max_bytes);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// The message of the moe::Error that `call` throws, or "(no error)".
template <typename Call>
std::string error_from(Call&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A file's bytes, as a string.
inline std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline std::filesystem::path temp_path(const std::string& stem) {
  return std::filesystem::temp_directory_path() /
         ("moe_test_" + stem + "_" + std::to_string(::getpid()) + "_" +
          std::to_string(fresh_seed()));
}

// F32 tensors of random sizes (zero-sized ones included) laid out in a random order, their JSON
// entries in another: the layout `begin`/`end` and the data the offsets describe.
struct Layout {
  std::vector<std::string> names;
  std::vector<std::int64_t> counts;  // elements
  std::vector<std::uint64_t> begin, end;
  std::string data;
};

inline Layout random_layout(std::mt19937_64& rng) {
  Layout l;
  const int n = std::uniform_int_distribution<int>(3, 6)(rng);
  for (int i = 0; i < n; ++i) {
    l.names.push_back(fmt::format("t{}", i));
    l.counts.push_back(std::uniform_int_distribution<std::int64_t>(0, 5)(rng));
  }
  l.counts[std::uniform_int_distribution<int>(0, n - 1)(rng)] = 0;  // one zero-size at least
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  l.begin.resize(n);
  l.end.resize(n);
  std::uint64_t offset = 0;
  for (const int i : order) {
    l.begin[i] = offset;
    offset += static_cast<std::uint64_t>(l.counts[i]) * 4;
    l.end[i] = offset;
  }
  for (std::uint64_t b = 0; b < offset; ++b)
    l.data.push_back(static_cast<char>(std::uniform_int_distribution<int>(0, 255)(rng)));
  return l;
}

inline std::string layout_header(const Layout& l, std::mt19937_64& rng) {
  std::vector<std::size_t> keys(l.names.size());
  std::iota(keys.begin(), keys.end(), 0);
  std::shuffle(keys.begin(), keys.end(), rng);
  std::string header = "{";
  for (const auto i : keys) {
    if (header.size() > 1) header += ",";
    header += entry(l.names[i], "F32", fmt::format("[{}]", l.counts[i]),
                    fmt::format("[{},{}]", l.begin[i], l.end[i]));
  }
  return header + "}";
}
}  // namespace moe::test
