// Safetensors files read and written whole: hand-made files parse to their values, round trips
// are exact, and every malformed file is refused with an error naming the problem.
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
#include "support/tensor_files.h"
#include "support/test_util.h"

using namespace moe;

using namespace moe::test;

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
             test::contains_text("'__metadata__' appears twice in the header"));
  CHECK_THAT(error_of(hand_made(R"({"__metadata__":{},"__metadata__":{}})", "")),
             !test::contains_text("entry"));
  CHECK_THAT(error_of(hand_made(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4],)"
                                R"("offset":0}})",
                                "abcd")),
             test::contains_text("tensor 'x' has the unknown field 'offset'"));
  CHECK_THAT(error_of(hand_made(R"({"x":{"dtype":"F32","shape":[1]}})", "")),
             test::contains_text("tensor 'x' has no 'data_offsets'"));
  // A name or dtype from the file is quoted by its first 64 bytes, then counted.
  const std::string long_name(10000, 'a'), long_dtype(10000, 'Q');
  for (const std::string& header : {"{" + entry(long_name, "Q4", "[1]", "[0,4]") + "}",
                                    "{" + entry("x", long_dtype, "[1]", "[0,4]") + "}",
                                    "{" + x + "," + entry(long_name, "F32", "[1]", "[0,4]") + "," +
                                        entry(long_name, "F32", "[1]", "[0,4]") + "}"}) {
    const std::string error = error_of(hand_made(header, "abcd"));
    CHECK((error.size() < 300 && error.find("more bytes)") != std::string::npos));
  }
  // A control character in a name would cut every message naming it; it is shown escaped.
  CHECK_THAT(error_of(hand_made(R"({"a\u0000b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                "abcd")),
             test::contains_text(
                 R"(tensor "a\u0000b" has a control character (U+0000) in its name, at byte 1)"));
  CHECK_THAT(
      error_of(hand_made(R"({"x\ty":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "abcd")),
      test::contains_text(R"(tensor "x\ty" has a control character (U+0009))"));
  CHECK_THAT(error_of(hand_made(R"({"x":[1,2]})", "")),
             test::contains_text("tensor 'x' has the entry a list of 2 items; expected an object"));
  CHECK_THAT(error_of(hand_made(R"({"x":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", "abcd")),
             test::contains_text("tensor 'x' has dtype 7; expected a string"));
  CHECK_THAT(error_of(hand_made(std::string("{}\0\0", 4), "")),
             test::contains_text("the header holds a NUL byte at offset 2"));
  CHECK_THAT(error_of(hand_made(" {}", "")), test::contains_text("must be a JSON object"));
  CHECK_THAT(error_of(hand_made("", "")), test::contains_text("must be a JSON object"));
  CHECK_THAT(error_of(hand_made(R"({"__metadata__":{"a":1}})", "")),
             test::contains_text("metadata 'a' is 1, not a string"));
  // Nesting deep enough to exhaust a recursive parser's stack, or its memory, is refused by
  // its depth before anything is parsed; a few levels past a header's three are the parse's to
  // name.
  CHECK_THAT(error_of(hand_made("{\"x\":" + std::string(1 << 20, '['), "")),
             test::contains_text("nests JSON more than 16 levels deep"));
  CHECK_THAT(error_of(hand_made("{\"x\":" + std::string(8, '[') + std::string(8, ']') + "}", "")),
             test::contains_text("tensor 'x' has the entry a list of 1 items"));
}

// Repeats are caught in a pass over the parser's events; a callback-filtered parse rescanned the
// header's object at the end of each entry, and 80,000 tensors took minutes (ctest's time-out
// would end this case).
TEST_CASE("safetensors: a header of 100000 tensors is read in one pass, repeats still caught",
          "[cpu][safetensors]") {
  constexpr int kTensors = 100000;
  std::string header = "{";
  std::string data;
  for (int i = 0; i < kTensors; ++i) {
    if (i > 0) header += ",";
    header += entry(fmt::format("t{}", i), "F32", "[1]", fmt::format("[{},{}]", 4 * i, 4 * i + 4));
    const float value = static_cast<float>(i);
    data.append(reinterpret_cast<const char*>(&value), 4);
  }
  const auto file = TensorFile::parse(hand_made(header + "}", data));
  CHECK(file.tensors().size() == static_cast<std::size_t>(kTensors));
  float last = 0.0f;
  std::memcpy(&last, file.get(fmt::format("t{}", kTensors - 1)).data.data(), 4);
  CHECK(last == static_cast<float>(kTensors - 1));
  const std::string repeat = "," + entry("t0", "F32", "[1]", "[0,4]");
  CHECK_THAT(error_of(hand_made(header + repeat + "}", data)),
             test::contains_text("tensor 't0' appears twice in the header"));
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
