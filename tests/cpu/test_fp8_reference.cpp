// The fp64 reference's E4M3 rounding and block quantization (docs/design.md, "FP8"): every code
// decodes and encodes back to itself, values between two codes round to the nearer (ties to the
// even code), magnitudes past 448 saturate, block scales are the powers of two that bring each
// block's largest value into (224, 448], and a block's values come back within half a code step.
#include <array>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "reference/reference.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;
using namespace moe::reference;

TEST_CASE("fp8 reference: every E4M3 code encodes back to itself", "[cpu][reference][fp8]") {
  for (int code = 0; code < 256; ++code) {
    INFO("code " << code);
    const double value = from_e4m3(static_cast<std::uint8_t>(code));
    if ((code & 0x7F) == 0x7F) {
      CHECK(std::isnan(value));
      continue;
    }
    CHECK(to_e4m3(static_cast<float>(value)) == code);
  }
  CHECK(from_e4m3(0x7E) == 448.0);
  CHECK(from_e4m3(0x01) == std::ldexp(1.0, -9));  // the smallest subnormal
  CHECK(from_e4m3(0x08) == std::ldexp(1.0, -6));  // the smallest normal
}

TEST_CASE("fp8 reference: rounding to nearest, ties to even, saturation", "[cpu][reference][fp8]") {
  // Between 1 (0x38) and 1.125 (0x39): the midpoint goes to the even code, 1.
  CHECK(to_e4m3(1.0625f) == 0x38);
  CHECK(to_e4m3(1.0626f) == 0x39);
  // Between 1.125 (0x39) and 1.25 (0x3A): the midpoint goes to 1.25.
  CHECK(to_e4m3(1.1875f) == 0x3A);
  // Subnormals: half the smallest rounds to zero (even), a little more to the smallest.
  CHECK(to_e4m3(std::ldexp(1.0f, -10)) == 0x00);
  CHECK(to_e4m3(std::ldexp(1.1f, -10)) == 0x01);
  CHECK(to_e4m3(-std::ldexp(1.0f, -9)) == 0x81);
  // Past the largest finite value: ±448, however large.
  CHECK(to_e4m3(449.0f) == 0x7E);
  CHECK(to_e4m3(1e30f) == 0x7E);
  CHECK(to_e4m3(-INFINITY) == 0xFE);
  CHECK(to_e4m3(NAN) == 0x7F);
  // Every value within half a step of its code: spacing 2^(e-3) at exponent e.
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<double> log_magnitude(-12.0, 8.7);
  for (int i = 0; i < 10000; ++i) {
    const auto value = static_cast<float>(std::exp2(log_magnitude(rng)));
    const double back = from_e4m3(to_e4m3(value));
    const double spacing =
        std::ldexp(1.0, std::max(std::ilogb(static_cast<double>(value)), -6) - 3);
    INFO("value " << value << " came back as " << back);
    CHECK(std::fabs(back - std::min<double>(value, 448.0)) <= 0.5 * spacing);
  }
}

TEST_CASE("fp8 reference: block scales and values", "[cpu][reference][fp8]") {
  Matrix x(130, 200);
  std::mt19937_64 rng(test::fresh_seed());
  std::normal_distribution<double> normal(0.0, 1.0);
  for (double& v : x.data) v = normal(rng);
  x = round_to(x, DType::kBF16);
  for (std::int64_t c = 128; c < 200; ++c) x(5, c) = 0.0;  // a row block of zeros: scale 1
  x(7, 3) = 1000.0;                                        // an outlier owns its block's scale

  const BlockQuantized rows = quantize_row_blocks(x);
  REQUIRE(rows.scales.size() == 130 * 2);
  CHECK(rows.scales[5 * 2 + 1] == 1.0f);
  // 1000 <= 448 · 2^2 = 1792 but not <= 448 · 2: the scale is 4, and 1000 / 4 = 250 is stored
  // as 256 (E4M3 spaces values 32 apart between 256 and 448, 16 between 128 and 256).
  CHECK(rows.scales[7 * 2 + 0] == 4.0f);
  CHECK(rows.codes[7 * 200 + 3] == to_e4m3(256.0f));
  CHECK(rows.value(7, 3) == 1024.0);
  const BlockQuantized tiles = quantize_tiles(x);
  REQUIRE(tiles.scales.size() == 2 * 2);
  CHECK(tiles.scales[0] == 4.0f);
  // Scales are powers of two that put each block's largest value in (224, 448].
  for (const BlockQuantized* q : {&rows, &tiles}) {
    for (const float scale : q->scales) {
      int exponent = 0;
      CHECK(std::frexp(scale, &exponent) == 0.5f);
    }
  }
  // Each value within half a code step of the block's scale, relative to its magnitude: E4M3
  // keeps 3 mantissa bits, so at most 2^-4 of the value above the subnormal range.
  for (const BlockQuantized* q : {&rows, &tiles}) {
    for (std::int64_t r = 0; r < x.rows; ++r) {
      for (std::int64_t c = 0; c < x.cols; ++c) {
        const double scale = q->scales[static_cast<std::size_t>((r / q->block_rows) * 2 + c / 128)];
        const double bound = std::max(std::fabs(x(r, c)) / 16.0, scale * std::ldexp(1.0, -10));
        if (std::fabs(q->value(r, c) - x(r, c)) > bound) FAIL("(" << r << ", " << c << ")");
      }
    }
  }
}

namespace {

// Relative Frobenius error of the FP8 expert's results against the exact expert's.
struct Fp8Errors {
  double y, dX, dw13, dw2;
};

Fp8Errors fp8_expert_errors(std::int64_t H, std::int64_t F, std::int64_t T, bool outliers,
                            std::mt19937_64& rng) {
  Matrix X = test::random_matrix(T, H, rng);
  if (outliers) {  // tokens 8 times larger or smaller, single values 30 times their row's
    std::uniform_int_distribution<int> pick(0, 9);
    std::uniform_int_distribution<std::int64_t> column(0, H - 1);
    for (std::int64_t t = 0; t < T; ++t) {
      const int kind = pick(rng);
      for (double& v : X.row(t)) v *= kind == 0 ? 8.0 : kind == 1 ? 0.125 : 1.0;
      if (kind == 2 || kind == 3) X(t, column(rng)) *= 30.0;
    }
  }
  X = round_to(X, DType::kBF16);
  ExpertWeights weights;
  weights.w13.push_back(
      round_to(test::random_matrix(H, 2 * F, rng, 1.0 / std::sqrt(H)), DType::kBF16));
  weights.w2.push_back(round_to(test::random_matrix(F, H, rng, 1.0 / std::sqrt(F)), DType::kBF16));
  const Matrix dy = round_to(test::random_matrix(T, H, rng), DType::kBF16);
  const std::array<std::int64_t, 2> offsets{0, T};
  const ExpertActivations exact = experts_forward(X, offsets, weights);
  const ExpertGrads grads = experts_backward(X, exact, dy, offsets, weights);
  const Fp8ExpertStep fp8 = fp8_expert_step(X, weights.w13[0], weights.w2[0], dy);
  return {test::relative_error(fp8.y, exact.y), test::relative_error(fp8.dX, grads.dX),
          test::relative_error(fp8.dw13, grads.dw13[0]),
          test::relative_error(fp8.dw2, grads.dw2[0])};
}

}  // namespace

// What FP8 costs at the model shapes (docs/design.md, "FP8", Accuracy): one expert's step with
// the GPU's quantization (bit-exact to these quantizers) against the exact step, at the model's H
// and F. mixtral-8x7b's expert (F = 14336) takes gigabytes in fp64 and runs with MOE_TEST_LONG=1.
TEST_CASE("fp8 reference: one expert's step at the model shapes stays within FP8's bound",
          "[cpu][reference][fp8]") {
  std::mt19937_64 rng(test::fresh_seed());
  struct Shape {
    const char* name;
    std::int64_t H, F;
  };
  std::vector<Shape> shapes = {{"qwen3-30b-a3b", 2048, 768}, {"deepseek-v3", 7168, 2048}};
  if (test::long_run()) shapes.push_back({"mixtral-8x7b", 4096, 14336});
  const std::int64_t T = test::by_run_size(4, 16, 64);
  for (const Shape& s : shapes) {
    for (const bool outliers : {false, true}) {
      const Fp8Errors e = fp8_expert_errors(s.H, s.F, T, outliers, rng);
      std::printf("fp8 expert error: %s T=%lld%s: y %.4f dX %.4f dw13 %.4f dw2 %.4f\n", s.name,
                  static_cast<long long>(T), outliers ? " outliers" : "", e.y, e.dX, e.dw13, e.dw2);
      INFO(s.name << (outliers ? " with outliers" : ""));
      const double bound = outliers ? 0.15 : 0.1;
      CHECK(e.y <= bound);
      CHECK(e.dX <= bound);
      CHECK(e.dw13 <= bound);
      CHECK(e.dw2 <= bound);
    }
  }
}
