#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "moe/error.h"
#include "moe/safetensors.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;

namespace {
// The 8-byte little-endian length prefix of the format.
std::string length_prefix(std::uint64_t length) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return out;
}

// A file assembled by hand, byte by byte, as the format specifies.
std::string hand_made(const std::string& header, const std::string& data) {
  return length_prefix(header.size()) + header + data;
}

// One header entry, written by hand so that any value (wrong ones included) can be given.
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":" + offsets + "}";
}

std::string error_of(const std::string& bytes) {
  try {
    TensorFile::parse(bytes, "f.safetensors");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string read_error(const std::filesystem::path& path, std::uint64_t max_bytes) {
  try {
    TensorFile::read(path, max_bytes);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::filesystem::path temp_path(const std::string& stem) {
  return std::filesystem::temp_directory_path() /
         ("moe_test_" + stem + "_" + std::to_string(::getpid()) + "_" +
          std::to_string(test::fresh_seed()));
}

// F32 tensors of random sizes (zero-sized ones included) laid out in a random order, their JSON
// entries in another: the layout `begin`/`end` and the data the offsets describe.
struct Layout {
  std::vector<std::string> names;
  std::vector<std::int64_t> counts;  // elements
  std::vector<std::uint64_t> begin, end;
  std::string data;
};

Layout random_layout(std::mt19937_64& rng) {
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

std::string layout_header(const Layout& l, std::mt19937_64& rng) {
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
}  // namespace

TEST_CASE("safetensors: a hand-made file parses to its values", "[cpu][safetensors]") {
  const float values[3] = {1.5f, -2.0f, 0.25f};
  const std::int32_t ids[2] = {7, -3};
  std::string data(reinterpret_cast<const char*>(ids), 8);
  data.append(reinterpret_cast<const char*>(values), 12);
  const auto file = TensorFile::parse(hand_made(
      R"({"ids":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},)"
      R"("x":{"dtype":"F32","shape":[1,3],"data_offsets":[8,20]},"__metadata__":{"format":"pt"}})",
      data));
  const auto& x = file.get("x");
  CHECK(x.dtype == FileDType::kF32);
  CHECK(x.shape == std::vector<std::int64_t>{1, 3});
  CHECK(std::memcmp(x.data.data(), values, 12) == 0);
  CHECK(std::memcmp(file.get("ids").data.data(), ids, 8) == 0);
  CHECK(file.metadata.at("format") == "pt");
}

TEST_CASE("safetensors: write then read gives back every tensor bit for bit",
          "[cpu][safetensors]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  TensorFile file;
  std::vector<BF16> bf16(6 * 5);
  for (auto& v : bf16) v = to_bf16(std::normal_distribution<float>(0, 1)(rng));
  std::vector<float> f32(7);
  for (auto& v : f32) v = std::normal_distribution<float>(0, 1)(rng);
  std::vector<std::int64_t> i64 = {1, -2, 1LL << 40};
  file.add("layer.w13", FileDType::kBF16, {6, 5}, bf16.data());
  file.add("layer.bias", FileDType::kF32, {7}, f32.data());
  file.add("step", FileDType::kI64, {3}, i64.data());
  file.add("empty", FileDType::kI32, {0, 4}, nullptr);
  file.metadata["config"] = "small";
  const auto path = std::filesystem::temp_directory_path() /
                    ("moe_test_" + std::to_string(seed) + ".safetensors");
  file.write(path);
  const auto back = TensorFile::read(path);
  std::filesystem::remove(path);
  CHECK(back.tensors().size() == 4);
  CHECK(std::memcmp(back.get("layer.w13").data.data(), bf16.data(), bf16.size() * 2) == 0);
  CHECK(std::memcmp(back.get("layer.bias").data.data(), f32.data(), f32.size() * 4) == 0);
  CHECK(std::memcmp(back.get("step").data.data(), i64.data(), 24) == 0);
  CHECK(back.get("empty").shape == std::vector<std::int64_t>{0, 4});
  CHECK(back.metadata.at("config") == "small");
  CHECK(back.serialize() == file.serialize());
}

TEST_CASE("safetensors: malformed files get errors naming the problem", "[cpu][safetensors]") {
  CHECK_THROWS_WITH(TensorFile::parse("abc", "f"), test::contains_text("too short"));
  CHECK_THROWS_WITH(TensorFile::parse(hand_made("{not json", ""), "f"),
                    test::contains_text("not valid JSON"));
  CHECK_THROWS_WITH(
      TensorFile::parse(
          hand_made(R"({"x":{"dtype":"F16","shape":[1],"data_offsets":[0,2]}})", "ab"), "f"),
      test::contains_text("dtype 'F16'"));
  CHECK_THROWS_WITH(
      TensorFile::parse(
          hand_made(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcd"), "f"),
      test::contains_text("holds 4 bytes but F32[2] needs 8"));
  CHECK_THROWS_WITH(
      TensorFile::parse(
          hand_made(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})", "abcd"), "f"),
      test::contains_text("outside the 4 data bytes"));
  std::string short_header = hand_made("{}", "");
  short_header[0] = 100;
  CHECK_THROWS_WITH(TensorFile::parse(short_header, "f"), test::contains_text("runs past the end"));
  CHECK_THROWS_WITH(TensorFile::parse(hand_made("{}", ""), "f.safetensors").get("w"),
                    test::contains_text("f.safetensors: no tensor named 'w'"));
  CHECK_THROWS_AS(TensorFile::read("/nonexistent/x.safetensors"), Error);
}

TEST_CASE("safetensors: sizes from the header are checked for overflow, naming the tensor",
          "[cpu][safetensors]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  // Element counts beyond int64, and byte counts beyond 64 bits from a fitting element count.
  const auto big = [&] {
    return std::uniform_int_distribution<std::uint64_t>(1ULL << 32, 1ULL << 40)(rng);
  };
  const auto d0 = std::to_string(big()), d1 = std::to_string(big());
  CHECK_THAT(
      error_of(hand_made("{" + entry("huge", "F32", "[" + d0 + "," + d1 + "]", "[0,0]") + "}", "")),
      test::contains_text("tensor 'huge' of shape [" + d0 + ", " + d1 +
                          "] has more elements or bytes than 64 bits count"));
  CHECK_THAT(
      error_of(hand_made("{" + entry("wide", "I64", "[2305843009213693952,2]", "[0,0]") + "}", "")),
      test::contains_text("tensor 'wide' of shape [2305843009213693952, 2] has more"));
  CHECK_THAT(
      error_of(hand_made("{" + entry("d", "F32", "[18446744073709551615]", "[0,0]") + "}", "")),
      test::contains_text("tensor 'd' has dimension 0 = 18446744073709551615, beyond int64"));
  CHECK_THAT(error_of(hand_made("{" + entry("n", "F32", "[2,-1]", "[0,0]") + "}", "")),
             test::contains_text("tensor 'n' has a negative dimension 1 = -1"));
  CHECK(TensorFile::parse(hand_made("{" + entry("z", "F32", "[-0]", "[-0,0]") + "}", ""), "f")
            .get("z")
            .shape == std::vector<std::int64_t>{0});
  CHECK_THAT(error_of(hand_made("{" + entry("f", "F32", "[1.5]", "[0,0]") + "}", "")),
             test::contains_text("tensor 'f' has dimension 0 = 1.5, not an integer"));
  const std::uint64_t far = big();
  CHECK_THAT(error_of(hand_made(
                 "{" +
                     entry("o", "F32", "[1]",
                           "[" + std::to_string(far) + "," + std::to_string(far + 4) + "]") +
                     "}",
                 "abcd")),
             test::contains_text("tensor 'o' has data_offsets [" + std::to_string(far) + ", " +
                                 std::to_string(far + 4) + "] outside the 4 data bytes"));
  CHECK_THAT(error_of(hand_made("{" + entry("o", "F32", "[1]", "[-4,0]") + "}", "abcd")),
             test::contains_text("tensor 'o' has data_offsets [-4, 0]; expected [begin, end]"));
  CHECK_THAT(error_of(hand_made("{" + entry("o", "F32", "[1]", "[0.0,4]") + "}", "abcd")),
             test::contains_text("tensor 'o' has data_offsets [0.0, 4]"));
  CHECK_THAT(error_of(hand_made("{" + entry("o", "F32", "[1]", "[0,4,8]") + "}", "abcd")),
             test::contains_text("tensor 'o' has data_offsets a list of 3 items"));
  // A length prefix of any 64-bit value: never read past the end, never allocated.
  const std::uint64_t length = std::uniform_int_distribution<std::uint64_t>(1ULL << 33)(rng);
  CHECK_THAT(error_of(length_prefix(length) + "{}"),
             test::contains_text("header of " + std::to_string(length) + " bytes runs past"));
  CHECK_THAT(error_of(length_prefix(~0ULL) + "{}"), test::contains_text("runs past the end"));
}

TEST_CASE("safetensors: the header length is bounded at 100 MB before anything is read",
          "[cpu][safetensors]") {
  // A sparse file: its size passes, its header length does not, and no byte of it is read.
  const auto path = temp_path("long_header");
  {
    std::ofstream out(path, std::ios::binary);
    out << length_prefix(kMaxHeaderBytes + 1) << "{";
  }
  std::filesystem::resize_file(path, kMaxHeaderBytes + 64);
  CHECK_THAT(read_error(path, kMaxTensorFileBytes),
             test::contains_text("header of 100000001 bytes exceeds the format's limit of "
                                 "100000000 bytes"));
  std::filesystem::remove(path);
}

TEST_CASE("safetensors: data_offsets must tile the data section exactly", "[cpu][safetensors]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 20; ++round) {
    const Layout l = random_layout(rng);
    const std::string header = layout_header(l, rng);
    INFO(header);
    // Valid whatever the order of the entries or of the tensors in the data.
    const auto file = TensorFile::parse(hand_made(header, l.data), "f");
    for (std::size_t i = 0; i < l.names.size(); ++i) {
      const auto& t = file.get(l.names[i]);
      REQUIRE(t.data.size() == l.end[i] - l.begin[i]);
      CHECK(std::equal(t.data.begin(), t.data.end(),
                       reinterpret_cast<const std::byte*>(l.data.data() + l.begin[i])));
    }
    // Trailing bytes no tensor covers.
    CHECK_THAT(error_of(hand_made(header, l.data + "tail")),
               test::contains_text("the data section has " + std::to_string(l.data.size() + 4) +
                                   " bytes but the tensors cover only the first " +
                                   std::to_string(l.data.size())));
    // A tensor with data, moved: 4 bytes later (a gap) or 4 bytes earlier (an overlap), or its
    // offsets swapped.
    std::vector<std::size_t> filled;
    for (std::size_t i = 0; i < l.names.size(); ++i) {
      if (l.counts[i] > 0) filled.push_back(i);
    }
    if (filled.empty()) continue;
    const auto pick = filled[std::uniform_int_distribution<std::size_t>(0, filled.size() - 1)(rng)];
    Layout later = l;
    for (std::size_t i = 0; i < l.names.size(); ++i) {
      if (l.begin[i] >= l.begin[pick] && l.counts[i] > 0) later.begin[i] += 4, later.end[i] += 4;
      if (l.begin[i] > l.begin[pick] && l.counts[i] == 0) later.begin[i] += 4, later.end[i] += 4;
    }
    later.data.insert(l.begin[pick], "gap!");
    CHECK_THAT(error_of(hand_made(layout_header(later, rng), later.data)),
               test::contains_text("bytes [" + std::to_string(l.begin[pick]) + ", " +
                                   std::to_string(l.begin[pick] + 4) +
                                   ") of the data section "
                                   "belong to no tensor"));
    if (l.begin[pick] > 0) {
      Layout earlier = l;
      earlier.begin[pick] -= 4;
      earlier.end[pick] -= 4;
      CHECK_THAT(error_of(hand_made(layout_header(earlier, rng), l.data)),
                 test::contains_text("overlaps tensor"));
    }
    Layout reversed = l;
    std::swap(reversed.begin[pick], reversed.end[pick]);
    CHECK_THAT(error_of(hand_made(layout_header(reversed, rng), l.data)),
               test::contains_text("tensor '" + l.names[pick] + "' has data_offsets [" +
                                   std::to_string(l.end[pick]) + ", " +
                                   std::to_string(l.begin[pick]) + "]: begin after end"));
  }
}

TEST_CASE("safetensors: repeated keys and unknown fields are rejected", "[cpu][safetensors]") {
  const std::string x = entry("x", "F32", "[1]", "[0,4]");
  CHECK_THAT(error_of(hand_made("{" + x + "," + x + "}", "abcd")),
             test::contains_text("f.safetensors: tensor 'x' appears twice in the header"));
  CHECK_THAT(error_of(hand_made(R"({"x":{"dtype":"F32","shape":[1],"dtype":"I32",)"
                                R"("data_offsets":[0,4]}})",
                                "abcd")),
             test::contains_text("key 'dtype' appears twice in the header's entry 'x'"));
  CHECK_THAT(error_of(hand_made("{" + x + R"(,"__metadata__":{"a":"1","a":"2"}})", "abcd")),
             test::contains_text("key 'a' appears twice in the header's entry '__metadata__'"));
  CHECK_THAT(error_of(hand_made(R"({"__metadata__":{},"__metadata__":{}})", "")),
             test::contains_text("key '__metadata__' appears twice"));
  CHECK_THAT(error_of(hand_made(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4],)"
                                R"("offset":0}})",
                                "abcd")),
             test::contains_text("tensor 'x' has the unknown field 'offset'"));
  CHECK_THAT(error_of(hand_made(R"({"x":{"dtype":"F32","shape":[1]}})", "")),
             test::contains_text("tensor 'x' has no 'data_offsets'"));
  CHECK_THAT(error_of(hand_made(R"({"x":[1,2]})", "")),
             test::contains_text("tensor 'x' has the entry a list of 2 items; expected an object"));
  CHECK_THAT(error_of(hand_made(R"({"x":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", "abcd")),
             test::contains_text("tensor 'x' has dtype 7; expected a string"));
  CHECK_THAT(error_of(hand_made(" {}", "")), test::contains_text("must be a JSON object"));
  CHECK_THAT(error_of(hand_made("", "")), test::contains_text("must be a JSON object"));
  CHECK_THAT(error_of(hand_made(R"({"__metadata__":{"a":1}})", "")),
             test::contains_text("metadata 'a' is 1, not a string"));
  // Nesting deep enough to exhaust a recursive parser's stack is an error like any other.
  CHECK_THAT(error_of(hand_made("{\"x\":" + std::string(1 << 20, '['), "")),
             test::contains_text("not valid JSON"));
}

TEST_CASE("safetensors: zero-size tensors round-trip without touching a null pointer",
          "[cpu][safetensors]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  TensorFile file;
  const int n = std::uniform_int_distribution<int>(1, 4)(rng);
  for (int i = 0; i < n; ++i) {
    std::vector<std::int64_t> shape = {std::uniform_int_distribution<std::int64_t>(1, 9)(rng), 0};
    std::shuffle(shape.begin(), shape.end(), rng);
    file.add("empty" + std::to_string(i), FileDType::kBF16, shape, nullptr);
  }
  const auto back = TensorFile::parse(file.serialize(), "f");
  CHECK(back.tensors().size() == static_cast<std::size_t>(n));
  for (const auto& [name, t] : back.tensors()) CHECK(t.data.empty());
  CHECK(TensorFile::parse(hand_made("{}", ""), "f").tensors().empty());
  CHECK_THROWS_WITH(file.add("x", FileDType::kF32, {2}, nullptr),
                    test::contains_text("tensor 'x' has 8 bytes but no data"));
  CHECK_THROWS_WITH(file.add("y", FileDType::kF32, {-1}, nullptr),
                    test::contains_text("tensor 'y' of shape [-1] has a negative dimension"));
}

TEST_CASE("safetensors: only regular files of bounded size are read", "[cpu][safetensors]") {
  const auto dir = temp_path("dir");
  std::filesystem::create_directories(dir);
  CHECK_THAT(read_error(dir, kMaxTensorFileBytes), test::contains_text("is a directory"));
  const auto fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // Opened without blocking and refused: a FIFO without a writer would otherwise hang here.
  CHECK_THAT(read_error(fifo, kMaxTensorFileBytes), test::contains_text("is a FIFO"));
  CHECK_THAT(read_error("/dev/zero", kMaxTensorFileBytes),
             test::contains_text("'/dev/zero' is a character device; only regular files"));
  CHECK_THAT(read_error(dir / "absent", kMaxTensorFileBytes),
             test::contains_text("No such file or directory"));
  TensorFile file;
  const float one = 1.0f;
  file.add("x", FileDType::kF32, {1}, &one);
  file.write(dir / "x.safetensors");
  const auto size = std::filesystem::file_size(dir / "x.safetensors");
  CHECK(TensorFile::read(dir / "x.safetensors", size).get("x").data.size() == 4);
  CHECK_THAT(read_error(dir / "x.safetensors", size - 1),
             test::contains_text("has " + std::to_string(size) + " bytes, more than the limit of " +
                                 std::to_string(size - 1)));
  // A file cut short: the header promises data the file does not have.
  std::filesystem::resize_file(dir / "x.safetensors", size - 2);
  CHECK_THAT(read_error(dir / "x.safetensors", size),
             test::contains_text("tensor 'x' has data_offsets [0, 4] outside the 2 data bytes"));
  CHECK_THAT(read_error(dir / "x.safetensors", size), test::contains_text("x.safetensors"));
  std::filesystem::remove_all(dir);
}

namespace {

// `count` random bytes: the tensors' values, whatever their dtype.
std::vector<std::byte> random_bytes(std::size_t count, std::mt19937_64& rng) {
  std::vector<std::byte> bytes(count);
  for (auto& b : bytes) b = static_cast<std::byte>(std::uniform_int_distribution<int>(0, 255)(rng));
  return bytes;
}

// Tensors of every dtype, some of odd shapes, some of zero size, one of no dimensions.
TensorFile random_tensors(std::mt19937_64& rng) {
  const std::vector<std::vector<std::int64_t>> shapes = {
      {7}, {3, 5}, {2, 3, 5}, {1, 1}, {13, 1, 3}, {4, 0}, {0}, {}, {5, 7, 2}, {1, 11}};
  const FileDType dtypes[] = {FileDType::kBF16, FileDType::kF32, FileDType::kI32, FileDType::kI64};
  TensorFile file;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const FileDType dtype = dtypes[std::uniform_int_distribution<int>(0, 3)(rng)];
    std::int64_t n = 1;
    for (const auto d : shapes[i]) n *= d;
    const auto data = random_bytes(static_cast<std::size_t>(n) * file_dtype_size(dtype), rng);
    file.add(fmt::format("t{}", i), dtype, shapes[i], data.data());
  }
  file.metadata["format"] = "pt";
  return file;
}

std::vector<std::byte> slice(const FileTensor& t, std::int64_t first, std::int64_t count) {
  const auto element = static_cast<std::int64_t>(file_dtype_size(t.dtype));
  return {t.data.begin() + first * element, t.data.begin() + (first + count) * element};
}

template <typename Call>
std::string error_from(Call&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("safetensors: ranges and rows read from the header alone equal the whole file's",
          "[cpu][safetensors]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const TensorFile written = random_tensors(rng);
  const auto path = temp_path("ranges");
  written.write(path);
  const TensorFile whole = TensorFile::read(path);
  const TensorFileReader reader(path);
  CHECK(reader.names() == whole.names());
  CHECK(reader.metadata() == whole.metadata);
  CHECK(reader.source() == path.string());
  for (const auto& name : whole.names()) {
    INFO("tensor " << name);
    const FileTensor& t = whole.get(name);
    const TensorInfo info = reader.info(name);
    CHECK(info.dtype == t.dtype);
    CHECK(info.shape == t.shape);
    CHECK(info.numel == t.numel());
    const auto [begin, end] = reader.data_offsets(name);
    CHECK(end - begin == t.data.size());
    CHECK(reader.read_tensor(name).data == t.data);
    CHECK(reader.read_tensor(name).shape == t.shape);
    // The same ranges from the file on disk and from the file in memory.
    for (int round = 0; round < 20; ++round) {
      const std::int64_t n = t.numel();
      const auto first = std::uniform_int_distribution<std::int64_t>(0, n)(rng);
      const auto count = std::uniform_int_distribution<std::int64_t>(0, n - first)(rng);
      INFO("elements [" << first << ", " << first + count << ")");
      const FileTensor part = reader.read_range(name, first, count);
      CHECK(part.dtype == t.dtype);
      CHECK(part.shape == std::vector<std::int64_t>{count});
      CHECK(part.data == slice(t, first, count));
      CHECK(whole.read_range(name, first, count).data == part.data);
      std::vector<std::byte> into(part.data.size());
      reader.read_into(name, first, count, into);
      CHECK(into == part.data);
      if (t.shape.empty()) continue;
      const std::int64_t rows = t.shape[0];
      const auto first_row = std::uniform_int_distribution<std::int64_t>(0, rows)(rng);
      const auto row_count = std::uniform_int_distribution<std::int64_t>(0, rows - first_row)(rng);
      const std::int64_t row = rows == 0 ? 0 : n / rows;
      const FileTensor block = reader.read_rows(name, first_row, row_count);
      std::vector<std::int64_t> shape = t.shape;
      shape[0] = row_count;
      CHECK(block.shape == shape);
      CHECK(block.data == slice(t, first_row * row, row_count * row));
      CHECK(whole.read_rows(name, first_row, row_count).data == block.data);
    }
  }
  std::filesystem::remove(path);
}

TEST_CASE("safetensors: a range outside its tensor is an error naming tensor, range and size",
          "[cpu][safetensors]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const auto path = temp_path("outside");
  TensorFile file;
  const std::vector<float> values(60, 1.0f);
  file.add("w13", FileDType::kF32, {4, 3, 5}, values.data());
  file.add("scalar", FileDType::kF32, {}, values.data());
  file.write(path);
  const TensorFileReader reader(path);
  const std::string where = path.string() + ": ";
  for (const TensorSource* source :
       {static_cast<const TensorSource*>(&reader), static_cast<const TensorSource*>(&file)}) {
    const std::string prefix = source == &reader ? where : "<memory>: ";
    const auto past = std::uniform_int_distribution<std::int64_t>(1, 60)(rng);
    CHECK_THAT(error_from([&] { source->read_range("w13", 60 - past + 1, past); }),
               test::contains_text(prefix + "elements [" + std::to_string(61 - past) +
                                   ", 61) of "
                                   "tensor 'w13' lie outside its 60 elements"));
    CHECK_THAT(error_from([&] { source->read_range("w13", -1, 2); }),
               test::contains_text("elements [-1, 1) of tensor 'w13' lie outside its 60"));
    CHECK_THAT(error_from([&] { source->read_range("w13", 3, -1); }),
               test::contains_text("elements [3, 2) of tensor 'w13' lie outside its 60"));
    const std::int64_t max = std::numeric_limits<std::int64_t>::max();
    CHECK_THAT(error_from([&] { source->read_range("w13", max, 2); }),
               test::contains_text("elements [" + std::to_string(max) + ", " + std::to_string(max) +
                                   " + 2) of tensor 'w13' lie outside"));
    CHECK_THAT(error_from([&] { source->read_rows("w13", 3, 2); }),
               test::contains_text(prefix + "rows [3, 5) of tensor 'w13' lie outside its 4 rows"));
    CHECK_THAT(error_from([&] { source->read_rows("w13", max, max); }),
               test::contains_text("rows [" + std::to_string(max) + ", " + std::to_string(max) +
                                   " + " + std::to_string(max) + ") of tensor 'w13'"));
    CHECK_THAT(error_from([&] { source->read_rows("scalar", 0, 1); }),
               test::contains_text("tensor 'scalar' has no dimensions, so no rows to read"));
    CHECK_THAT(error_from([&] { source->read_range("w4", 0, 1); }),
               test::contains_text(prefix + "no tensor named 'w4'"));
    std::vector<std::byte> small(7);
    CHECK_THAT(error_from([&] { source->read_into("w13", 0, 2, small); }),
               test::contains_text("elements [0, 2) of tensor 'w13' are 8 bytes of F32, but the "
                                   "buffer holds 7"));
    CHECK(source->read_range("w13", 60, 0).data.empty());  // an empty range at the end is inside
  }
  // A tensor whose bytes were changed by hand no longer matches its shape: refused, not read.
  TensorFile edited = file;
  edited.get("w13").data.resize(12);
  CHECK_THAT(error_from([&] { edited.read_range("w13", 0, 1); }),
             test::contains_text("tensor 'w13' holds 12 bytes but F32[4,3,5] needs 240"));
  std::filesystem::remove(path);
}

TEST_CASE("safetensors: opening the header alone fails exactly as read() on every bad file",
          "[cpu][safetensors]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const std::string x = entry("x", "F32", "[1]", "[0,4]");
  std::vector<std::string> files = {
      "abc",
      hand_made("{not json", ""),
      hand_made(R"({"x":{"dtype":"F16","shape":[1],"data_offsets":[0,2]}})", "ab"),
      hand_made(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcd"),
      hand_made(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})", "abcd"),
      hand_made("{" + entry("huge", "F32", "[4294967296,4294967296]", "[0,0]") + "}", ""),
      hand_made("{" + entry("n", "F32", "[2,-1]", "[0,0]") + "}", ""),
      hand_made("{" + entry("o", "F32", "[1]", "[-4,0]") + "}", "abcd"),
      hand_made("{" + x + "," + x + "}", "abcd"),
      hand_made("{" + x + R"(,"__metadata__":{"a":"1","a":"2"}})", "abcd"),
      hand_made(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"offset":0}})", "abcd"),
      hand_made(R"({"__metadata__":{"a":1}})", ""),
      hand_made(" {}", ""),
      hand_made("{" + x + "}", "abcdtail"),
      length_prefix(~0ULL) + "{}",
      hand_made("{\"x\":" + std::string(1 << 12, '['), ""),
  };
  std::string past_end = hand_made("{}", "");
  past_end[0] = 100;
  files.push_back(past_end);
  // Gaps, overlaps and reversed offsets of a random layout.
  for (int round = 0; round < 5; ++round) {
    Layout l = random_layout(rng);
    const auto pick = std::uniform_int_distribution<std::size_t>(0, l.names.size() - 1)(rng);
    std::swap(l.begin[pick], l.end[pick]);
    files.push_back(hand_made(layout_header(l, rng), l.data));
    l = random_layout(rng);
    files.push_back(hand_made(layout_header(l, rng), l.data + "gap!"));
  }
  // And the fuzz corpus, good files and bad.
  for (const auto& seed_file : std::filesystem::directory_iterator(
           std::filesystem::path(MOE_SOURCE_DIR) / "fuzz" / "corpus" / "safetensors")) {
    files.push_back(file_bytes(seed_file.path()));
  }
  const auto path = temp_path("bad");
  int refused = 0;
  for (const auto& bytes : files) {
    {
      std::ofstream out(path, std::ios::binary);
      out << bytes;
    }
    const std::string by_read = read_error(path, kMaxTensorFileBytes);
    const std::string by_open = error_from([&] { TensorFileReader reader(path); });
    INFO("file of " << bytes.size() << " bytes: " << by_read);
    CHECK(by_open == by_read);
    // The message is parse()'s, naming the path instead of parse()'s source.
    std::string by_parse = error_of(bytes);
    if (by_parse != "(no error)") by_parse.replace(0, by_parse.find(':'), path.string());
    CHECK(by_read == by_parse);
    refused += by_read != "(no error)";
  }
  CHECK(refused >= 25);
  // Size bounds and file kinds are InputFile's, the same for both.
  TensorFile one;
  const float value = 1.0f;
  one.add("x", FileDType::kF32, {1}, &value);
  one.write(path);
  const auto size = std::filesystem::file_size(path);
  CHECK(error_from([&] { TensorFileReader reader(path, size - 1); }) == read_error(path, size - 1));
  CHECK_THAT(error_from([&] { TensorFileReader reader("/dev/zero"); }),
             test::contains_text("'/dev/zero' is a character device; only regular files"));
  std::filesystem::resize_file(path, size - 2);
  CHECK(error_from([&] { TensorFileReader reader(path); }) == read_error(path, size));
  std::filesystem::remove(path);
}

TEST_CASE("safetensors: the streaming writer writes TensorFile::write's file byte for byte",
          "[cpu][safetensors]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 5; ++round) {
    const TensorFile file = random_tensors(rng);
    const auto whole_path = temp_path("whole"), streamed_path = temp_path("streamed");
    file.write(whole_path);
    std::vector<TensorSpec> specs;
    for (const auto& [name, t] : file.tensors()) specs.push_back({name, t.dtype, t.shape});
    std::shuffle(specs.begin(), specs.end(), rng);  // declared in any order
    {
      TensorFileWriter writer(streamed_path, specs, file.metadata);
      // Pieces of random sizes, the tensors interleaved at random.
      std::map<std::string, std::size_t> done;
      std::vector<std::string> open = file.names();
      while (!open.empty()) {
        const auto i = std::uniform_int_distribution<std::size_t>(0, open.size() - 1)(rng);
        const auto& data = file.get(open[i]).data;
        const std::size_t left = data.size() - done[open[i]];
        const auto piece = std::uniform_int_distribution<std::size_t>(0, left)(rng);
        writer.append(open[i], data.data() + done[open[i]], piece);
        done[open[i]] += piece;
        CHECK(writer.remaining(open[i]) == left - piece);
        if (piece == left) open.erase(open.begin() + static_cast<std::ptrdiff_t>(i));
      }
      writer.finish();
    }
    CHECK(file_bytes(streamed_path) == file_bytes(whole_path));
    CHECK(file_bytes(streamed_path) == file.serialize());
    const TensorFile back = TensorFile::read(streamed_path);
    CHECK(back.serialize() == file.serialize());
    std::filesystem::remove(whole_path);
    std::filesystem::remove(streamed_path);
  }
}

TEST_CASE("safetensors: the writer refuses what would make a wrong file and leaves none behind",
          "[cpu][safetensors]") {
  const auto dir = temp_path("writer");
  std::filesystem::create_directories(dir);
  const auto path = dir / "out.safetensors";
  const std::vector<TensorSpec> specs = {{"b", FileDType::kF32, {2, 3}},
                                         {"a", FileDType::kI32, {2}}};
  const std::vector<float> values(6, 0.5f);
  {
    TensorFileWriter writer(path, specs);
    CHECK(std::filesystem::exists(path));
    writer.append("b", values.data(), 16);
    CHECK_THAT(error_from([&] { writer.append("b", values.data(), 12); }),
               test::contains_text("tensor 'b' has 24 bytes; 12 more after the 16 written pass "
                                   "its end"));
    CHECK_THAT(error_from([&] { writer.append("c", values.data(), 4); }),
               test::contains_text("no tensor named 'c' was declared"));
    writer.append("b", values.data(), 8);
    CHECK_THAT(error_from([&] { writer.finish(); }),
               test::contains_text("out.safetensors': tensor 'a' got 0 of its 8 bytes"));
    CHECK_FALSE(std::filesystem::exists(path));  // an incomplete file is removed at once
    CHECK_THAT(error_from([&] { writer.append("a", values.data(), 4); }),
               test::contains_text("appending to tensor 'a' after the writer failed"));
  }
  {
    TensorFileWriter abandoned(path, specs);
    abandoned.append("a", values.data(), 8);
  }
  CHECK_FALSE(std::filesystem::exists(path));  // destroyed before finish(): no file
  {
    TensorFileWriter writer(path, specs);
    writer.append("a", values.data(), 8);
    writer.append("b", values.data(), 24);
    // Every byte is there but the length prefix: a process killed now leaves no readable file.
    CHECK_THAT(error_from([&] { TensorFileReader reader(path); }),
               test::contains_text("the header must be a JSON object"));
    writer.finish();
    CHECK_THAT(error_from([&] { writer.append("a", values.data(), 0); }),
               test::contains_text("after the writer finished"));
  }
  CHECK(TensorFile::read(path).get("b").shape == std::vector<std::int64_t>{2, 3});
  CHECK_THAT(error_from([&] {
               TensorFileWriter w(path, {specs[0], specs[0]});
             }),
             test::contains_text("tensor 'b' is declared twice"));
  CHECK_THAT(error_from([&] {
               TensorFileWriter w(path, {{"", FileDType::kF32, {1}}});
             }),
             test::contains_text("'' is not a valid tensor name"));
  CHECK_THAT(error_from([&] {
               TensorFileWriter w(path, {{"n", FileDType::kF32, {-2}}});
             }),
             test::contains_text("tensor 'n' of shape [-2] has a negative dimension"));
  CHECK_THAT(error_from([&] { TensorFileWriter w(dir / "absent" / "x.safetensors", specs); }),
             test::contains_text("cannot create tensor file"));
  // A FIFO is refused without blocking, and left where it was.
  const auto fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THAT(error_from([&] { TensorFileWriter w(fifo, specs); }),
             test::contains_text("cannot create tensor file"));
  CHECK(std::filesystem::exists(fifo));
  std::filesystem::remove_all(dir);
}
