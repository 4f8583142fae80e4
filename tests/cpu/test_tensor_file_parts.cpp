// Safetensors in parts: a header read alone, then ranges and rows of one tensor; the writer that
// puts the header first and appends each tensor's bytes in pieces.
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
  // The bytes go to a file beside the target until finish() renames it onto the target: a target
  // that exists keeps its contents through a writer that fails.
  const std::string before = "what the target held";
  std::ofstream(path, std::ios::binary) << before;
  {
    TensorFileWriter writer(path, specs);
    CHECK(file_bytes(path) == before);
    writer.append("b", values.data(), 16);
    CHECK_THAT(error_from([&] { writer.append("b", values.data(), 12); }),
               test::contains_text("tensor 'b' has 24 bytes; 12 more after the 16 written pass "
                                   "its end"));
    CHECK_THAT(error_from([&] { writer.append("c", values.data(), 4); }),
               test::contains_text("no tensor named 'c' was declared"));
    writer.append("b", values.data(), 8);
    CHECK_THAT(error_from([&] { writer.finish(); }),
               test::contains_text("out.safetensors': tensor 'a' got 0 of its 8 bytes"));
    CHECK(file_bytes(path) == before);  // an incomplete file is removed at once, the target kept
    CHECK_THAT(error_from([&] { writer.append("a", values.data(), 4); }),
               test::contains_text("appending to tensor 'a' after the writer failed"));
  }
  std::filesystem::remove(path);
  {
    TensorFileWriter abandoned(path, specs);
    abandoned.append("a", values.data(), 8);
  }
  CHECK_FALSE(std::filesystem::exists(path));  // destroyed before finish(): no file
  CHECK(std::filesystem::is_empty(dir));       // and nothing beside it
  {
    TensorFileWriter writer(path, specs);
    writer.append("a", values.data(), 8);
    writer.append("b", values.data(), 24);
    // Every byte is there but the length prefix: a process killed now leaves no readable file,
    // and nothing at the target.
    CHECK_FALSE(std::filesystem::exists(path));
    for (const auto& written : std::filesystem::directory_iterator(dir)) {
      CHECK_THAT(error_from([&] { TensorFileReader reader(written.path()); }),
                 test::contains_text("the header must be a JSON object"));
    }
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
  CHECK_THAT(
      error_from([&] { TensorFileWriter w(dir / "absent" / "x.safetensors", specs); }),
      test::contains_text("the directory '" + (dir / "absent").string() + "' does not exist"));
  CHECK_THAT(error_from([&] { TensorFileWriter w(dir, specs); }),
             test::contains_text("is a directory; name a file"));
  {  // A parent that is a regular file is named as such, not as missing.
    std::ofstream(dir / "plain") << "x";
    CHECK_THAT(error_from([&] { TensorFileWriter w(dir / "plain" / "x.safetensors", specs); }),
               test::contains_text("'" + (dir / "plain").string() + "' is not a directory"));
  }
  CHECK_THAT(error_from([&] { TensorFileWriter w(dir / std::string(256, 'n'), specs); }),
             test::contains_text("has 256 bytes; file systems take at most 255"));
  // An empty path, a link that leads nowhere and a loop of links are refused; nothing is made.
  CHECK_THAT(error_from([&] { TensorFileWriter w("", specs); }),
             test::contains_text("the path of the tensor file to write is empty"));
  const auto dangling = dir / "dangling";
  std::filesystem::create_symlink(dir / "missing.safetensors", dangling);
  CHECK_THAT(error_from([&] { TensorFileWriter w(dangling, specs); }),
             test::contains_text("is a symbolic link that leads nowhere"));
  std::filesystem::create_symlink(dir / "loop_b", dir / "loop_a");
  std::filesystem::create_symlink(dir / "loop_a", dir / "loop_b");
  CHECK_THAT(error_from([&] { TensorFileWriter w(dir / "loop_a", specs); }),
             test::contains_text("is a symbolic link that leads nowhere"));
  CHECK(std::filesystem::is_symlink(std::filesystem::symlink_status(dangling)));
  CHECK_FALSE(std::filesystem::exists(dir / "missing.safetensors"));
  // A name as long as the file system allows (255 bytes) is written, through a shorter
  // temporary name.
  const auto longest = dir / std::string(255, 'n');
  {
    TensorFileWriter writer(longest, specs);
    writer.append("a", values.data(), 8);
    writer.append("b", values.data(), 24);
    writer.finish();
  }
  CHECK(TensorFile::read(longest).get("b").shape == std::vector<std::int64_t>{2, 3});
  // A FIFO is refused without blocking, and left where it was.
  const auto fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THAT(error_from([&] { TensorFileWriter w(fifo, specs); }),
             test::contains_text("is not a regular file"));
  CHECK(std::filesystem::exists(fifo));
  std::filesystem::remove_all(dir);
}

TEST_CASE("safetensors: a writer refusing non-finite values names the first, index by index",
          "[cpu][safetensors]") {
  const auto seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const auto dir = temp_path("finite");
  std::filesystem::create_directories(dir);
  const auto path = dir / "out.safetensors";
  const std::vector<std::int64_t> shape = {3, 5, 7};
  const std::int64_t n = 3 * 5 * 7;
  for (const FileDType dtype : {FileDType::kF32, FileDType::kBF16}) {
    const std::size_t element = file_dtype_size(dtype);
    const float bad[3] = {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()};
    const int which = std::uniform_int_distribution<int>(0, 2)(rng);
    const auto at = std::uniform_int_distribution<std::int64_t>(0, n - 1)(rng);
    INFO(file_dtype_name(dtype) << " element " << at);
    std::vector<std::byte> bytes(static_cast<std::size_t>(n) * element);
    for (std::int64_t i = 0; i < n; ++i) {
      const float value = i == at ? bad[which] : 1e30f;  // large, but finite in either dtype
      if (dtype == FileDType::kBF16) {
        const BF16 raw = to_bf16(value);
        std::memcpy(bytes.data() + i * 2, &raw, 2);
      } else {
        std::memcpy(bytes.data() + i * 4, &value, 4);
      }
    }
    const std::vector<TensorSpec> specs = {{"t", dtype, shape}, {"i", FileDType::kI32, {2}}};
    {
      // Integer tensors are never checked; the float one fails in the piece holding the value,
      // whichever piece that is.
      TensorFileWriter writer(path, specs);
      writer.refuse_non_finite();
      const std::int32_t ints[2] = {-1, 0x7f800000};  // an int that reads as Inf as a float
      writer.append("i", ints, sizeof(ints));
      const std::size_t piece = 7 * element;
      std::string error = "(no error)";
      for (std::size_t first = 0; first < bytes.size() && error == "(no error)"; first += piece)
        error = error_from([&] { writer.append("t", bytes.data() + first, piece); });
      const std::string value = which == 0 ? "nan" : which == 1 ? "inf" : "-inf";
      const std::string index = std::to_string(at / 35) + ", " + std::to_string(at / 7 % 5) + ", " +
                                std::to_string(at % 7);
      CHECK_THAT(error, test::contains_text("tensor 't' would hold " + value + " at [" + index +
                                            "]; results that are not finite are refused"));
    }
    CHECK_FALSE(std::filesystem::exists(path));
    CHECK(std::filesystem::is_empty(dir));
    {
      // Pieces must hold whole elements.
      TensorFileWriter writer(path, specs);
      writer.refuse_non_finite();
      CHECK_THAT(error_from([&] { writer.append("t", bytes.data(), element + 1); }),
                 test::contains_text("pieces must hold whole"));
    }
    {
      // Not asked to refuse, the writer writes what it is given.
      TensorFileWriter writer(path, specs);
      writer.append("t", bytes);
      writer.append("i", bytes.data(), 8);
      writer.finish();
    }
    CHECK(TensorFile::read(path).get("t").data == bytes);
    std::filesystem::remove(path);
  }
  std::filesystem::remove_all(dir);
}
