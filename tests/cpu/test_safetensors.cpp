#include <cstring>
#include <filesystem>
#include <random>

#include "moe/error.h"
#include "moe/safetensors.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;

namespace {
// A file assembled by hand, byte by byte, as the format specifies.
std::string hand_made(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
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
