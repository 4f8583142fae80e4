#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "moe/device.h"
#include "moe/error.h"
#include "moe/tensor.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;

TEST_CASE("bf16 conversion rounds to nearest even and keeps specials", "[cpu][tensor]") {
  CHECK(from_bf16(to_bf16(1.0f)) == 1.0f);
  CHECK(from_bf16(to_bf16(-2.5f)) == -2.5f);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  CHECK(from_bf16(to_bf16(1.0f + std::ldexp(1.0f, -8))) == 1.0f);
  // 1 + 3·2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: ties go to 1 + 2^-6 (even).
  CHECK(from_bf16(to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))) == 1.0f + std::ldexp(1.0f, -6));
  CHECK(std::isnan(from_bf16(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(from_bf16(to_bf16(std::numeric_limits<float>::infinity()))));
  CHECK(std::signbit(from_bf16(to_bf16(-0.0f))));

  std::mt19937_64 rng(test::fresh_seed());
  std::normal_distribution<float> normal(0.0f, 100.0f);
  for (int i = 0; i < 10000; ++i) {
    const float v = normal(rng);
    const float r = from_bf16(to_bf16(v));
    REQUIRE(std::abs(r - v) <= std::abs(v) * std::ldexp(1.0f, -8));  // half an ulp of 8 bits
  }
}

TEST_CASE("Tensor views describe themselves and shape checks name the tensor", "[cpu][tensor]") {
  float storage[6] = {};
  const Tensor t(storage, DType::kFP32, {2, 3});
  CHECK(t.numel() == 6);
  CHECK(t.bytes() == 24);
  CHECK(t.describe() == "fp32[2, 3]");
  CHECK_NOTHROW(expect_tensor(t, "x", DType::kFP32, {2, 3}));
  try {
    expect_tensor(t, "x", DType::kBF16, {2, 4});
    FAIL("expected moe::Error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) == "x: expected bf16[2, 4], got fp32[2, 3]");
  }
  CHECK(parse_dtype("bf16") == DType::kBF16);
  CHECK_THROWS_AS(parse_dtype("fp16"), Error);
}

TEST_CASE("check macros name the call, the file and the line", "[cpu][error]") {
  try {
    MOE_CHECK_CUDA(cudaErrorInvalidValue);
    FAIL("expected moe::Error");
  } catch (const Error& e) {
    const std::string message = e.what();
    CHECK(message.find("cudaErrorInvalidValue") != std::string::npos);
    CHECK(message.find("test_core.cpp") != std::string::npos);
  }
  CHECK_THROWS_AS(MOE_CHECK_CUBLAS(CUBLAS_STATUS_INVALID_VALUE), Error);
  CHECK_THROWS_AS(MOE_CHECK_NCCL(ncclInvalidArgument), Error);
  CHECK_NOTHROW(MOE_CHECK_NCCL(ncclSuccess));
}

TEST_CASE("error messages show control characters escaped and stop at a bound", "[cpu][error]") {
  const auto message_of = [](const std::string& text) {
    try {
      fail(text);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  // A NUL would end what() early, an escape sequence drive the terminal; newlines and tabs stay.
  CHECK(message_of(std::string("sig\0moid", 8)) == "sig\\x00moid");
  CHECK(message_of("a\x1b[2Jb\x7f") == "a\\x1b[2Jb\\x7f");
  CHECK(message_of("line one\n\tline two") == "line one\n\tline two");
  // A message quoting a file's text stops at kMaxErrorBytes, the rest counted, never inside a
  // UTF-8 sequence.
  const std::string long_text = "x" + std::string(3 * kMaxErrorBytes, 'y');
  const std::string shown = message_of(long_text);
  CHECK(shown.size() < kMaxErrorBytes + 40);
  CHECK_THAT(shown, test::contains_text("... (" + std::to_string(2 * kMaxErrorBytes + 1) +
                                        " more bytes)"));
  std::string accented;
  while (accented.size() < 2 * kMaxErrorBytes) accented += "\xc3\xa9";  // é, two bytes
  const std::string cut = message_of(accented);
  const std::size_t kept = cut.find(" ... (");
  REQUIRE(kept != std::string::npos);
  CHECK(kept % 2 == 0);
}

TEST_CASE("device count is zero, not an exception, without a GPU", "[cpu][device]") {
  CHECK(cuda_device_count() >= 0);
}

TEST_CASE("a buffer growth's drain is the innermost guard's, on this thread only",
          "[cpu][device]") {
  std::vector<int> drained;
  BufferGrowthDrain::before_free();  // no guard: nothing to run
  {
    const BufferGrowthDrain outer([&] { drained.push_back(1); });
    BufferGrowthDrain::before_free();
    {
      const BufferGrowthDrain inner([&] { drained.push_back(2); });
      BufferGrowthDrain::before_free();
      std::thread([] { BufferGrowthDrain::before_free(); }).join();  // another thread: none
    }
    BufferGrowthDrain::before_free();
    // A drain that throws (a mesh's timeout) reaches the growth's caller.
    const BufferGrowthDrain failing([] { moe::fail("the stream did not drain"); });
    CHECK_THROWS_WITH(BufferGrowthDrain::before_free(), "the stream did not drain");
  }
  BufferGrowthDrain::before_free();
  CHECK(drained == std::vector<int>{1, 2, 1});
}
