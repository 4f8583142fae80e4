// FP8 block quantization on the GPU (kernels/fp8_quantize.cuh) against the reference
// (reference::quantize_row_blocks / quantize_tiles): every code and every scale bit for bit, at
// shapes with partial blocks, with outliers, zero blocks and values in E4M3's subnormal range,
// the scales written through both strides, outputs poisoned before each launch; NaN, infinities
// and negative zeros as the reference takes them. The rows that travel, and the SwiGLU that
// quantizes its output, are tested in test_fp8_rows.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <sstream>
#include <utility>

#include "kernels/fp8_quantize.cuh"
#include "reference/reference.h"
#include "support/catch.h"
#include "support/fp8_values.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;

namespace {

using test::draw_fp8_values;
using Shape = test::MatrixShape;

void check(const reference::BlockQuantized& want, const std::vector<std::uint8_t>& codes,
           const std::vector<float>& scales, ScaleLayout layout) {
  std::int64_t wrong_codes = 0, first = -1;
  for (std::size_t i = 0; i < codes.size(); ++i) {
    if (codes[i] != want.codes[i]) {
      ++wrong_codes;
      if (first < 0) first = static_cast<std::int64_t>(i);
    }
  }
  INFO("first wrong code at element " << first);
  CHECK(wrong_codes == 0);
  const std::int64_t scale_rows = static_cast<std::int64_t>(want.scales.size()) / want.scale_cols;
  std::int64_t wrong_scales = 0;
  for (std::int64_t a = 0; a < scale_rows; ++a) {
    for (std::int64_t b = 0; b < want.scale_cols; ++b) {
      const float got = scales[static_cast<std::size_t>(a * layout.stride_a + b * layout.stride_b)];
      const float expected = want.scales[static_cast<std::size_t>(a * want.scale_cols + b)];
      if (std::memcmp(&got, &expected, sizeof(float)) != 0) ++wrong_scales;
    }
  }
  CHECK(wrong_scales == 0);
}

}  // namespace

TEST_CASE("fp8 quantize: row blocks and tiles equal the reference bit for bit",
          "[gpu][fp8][quantize]") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<Shape> shapes = {{1, 128}, {3, 200},   {130, 256}, {257, 1000}, {128, 16},
                                     {5, 7},   {300, 384}, {129, 136}, {64, 4100}};
  Stream stream;
  for (const Shape& s : shapes) {
    for (const bool tiles : {false, true}) {
      for (const bool outer_contiguous : {false, true}) {
        std::ostringstream what;
        what << s.rows << "x" << s.cols << (tiles ? " tiles" : " row blocks")
             << (outer_contiguous ? ", scales outer-contiguous" : ", scales row-major");
        INFO(what.str());
        const Matrix x = draw_fp8_values(s.rows, s.cols, rng);
        const reference::BlockQuantized want =
            tiles ? reference::quantize_tiles(x) : reference::quantize_row_blocks(x);
        const std::int64_t scale_rows =
            static_cast<std::int64_t>(want.scales.size()) / want.scale_cols;
        // Row-major scales [a][b], or the first index contiguous: [b][a] with a padded to 4.
        const std::int64_t padded = (scale_rows + 3) / 4 * 4;
        const ScaleLayout layout =
            outer_contiguous ? ScaleLayout{1, padded} : ScaleLayout{want.scale_cols, 1};
        const std::size_t scale_count = static_cast<std::size_t>(
            outer_contiguous ? padded * want.scale_cols : scale_rows * want.scale_cols);
        const DeviceBuffer x_dev = test::upload_as(x, DType::kBF16);
        DeviceBuffer q(static_cast<std::size_t>(s.rows * s.cols) + 16),
            scales(scale_count * 4 + 16);
        test::poison(q);
        test::poison(scales);
        if (tiles) {
          quantize_tiles(x_dev.data(), s.rows, s.cols, q.as<std::uint8_t>(), scales.as<float>(),
                         layout, stream.get());
        } else {
          quantize_row_blocks(x_dev.data(), s.rows, s.cols, q.as<std::uint8_t>(),
                              scales.as<float>(), layout, stream.get());
        }
        stream.synchronize();
        check(want, test::download<std::uint8_t>(q, static_cast<std::size_t>(s.rows * s.cols)),
              test::download<float>(scales, scale_count), layout);
      }
    }
  }
}

TEST_CASE(
    "fp8 quantize: row blocks in segments put each segment's scales where its product reads them",
    "[gpu][fp8][quantize]") {
  std::mt19937_64 rng(test::fresh_seed());
  Stream stream;
  for (const std::int64_t cols : {std::int64_t{128}, std::int64_t{200}, std::int64_t{640}}) {
    for (const int segments : {1, 5, 40}) {
      // Segment sizes 0 to 48 rows, some empty, as experts' row groups come.
      std::uniform_int_distribution<int> size(0, 3);
      std::vector<std::int64_t> offsets{0};
      for (int s = 0; s < segments; ++s) offsets.push_back(offsets.back() + 16 * size(rng));
      if (offsets.back() == 0) offsets.back() = 16;
      const std::int64_t rows = offsets.back();
      INFO(rows << "x" << cols << " in " << segments << " segments");
      const Matrix x = draw_fp8_values(rows, cols, rng);
      const reference::BlockQuantized want = reference::quantize_row_blocks(x);
      const std::int64_t blocks = want.scale_cols;
      const DeviceBuffer x_dev = test::upload_as(x, DType::kBF16);
      DeviceBuffer q(static_cast<std::size_t>(rows * cols) + 16),
          scales(static_cast<std::size_t>(rows * blocks) * 4 + 16);
      test::poison(q);
      test::poison(scales);
      quantize_row_blocks_segmented(x_dev.data(), offsets, cols, q.as<std::uint8_t>(),
                                    scales.as<float>(), stream.get());
      stream.synchronize();
      const auto codes = test::download<std::uint8_t>(q, static_cast<std::size_t>(rows * cols));
      CHECK(codes == want.codes);
      const auto got = test::download<float>(scales, static_cast<std::size_t>(rows * blocks));
      std::int64_t wrong = 0;
      for (int s = 0; s < segments; ++s) {
        const std::int64_t first = offsets[s], n = offsets[s + 1] - first;
        for (std::int64_t i = 0; i < n; ++i) {
          for (std::int64_t c = 0; c < blocks; ++c) {
            const float expected = want.scales[static_cast<std::size_t>((first + i) * blocks + c)];
            const float value = got[static_cast<std::size_t>(first * blocks + c * n + i)];
            if (std::memcmp(&value, &expected, sizeof(float)) != 0) ++wrong;
          }
        }
      }
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("fp8 quantize: stacked matrices and their transposes in tiles equal the reference",
          "[gpu][fp8][quantize]") {
  std::mt19937_64 rng(test::fresh_seed());
  Stream stream;
  const std::vector<Shape> shapes = {{256, 128}, {520, 384}, {96, 200},
                                     {300, 264}, {16, 16},   {130, 7}};
  for (const Shape& s : shapes) {
    for (const std::int64_t matrices : {std::int64_t{1}, std::int64_t{3}}) {
      INFO(matrices << " matrices of " << s.rows << "x" << s.cols);
      std::vector<Matrix> parts;
      for (std::int64_t m = 0; m < matrices; ++m)
        parts.push_back(draw_fp8_values(s.rows, s.cols, rng));
      // Scales of each matrix row-major with padded rows, and of each transpose the other way
      // round, so that both strides are exercised.
      const std::int64_t tr = (s.rows + 127) / 128, tc = (s.cols + 127) / 128;
      const ScaleBuffer direct{{tc + 1, 1}, tr * (tc + 1)}, flipped{{1, tc + 2}, tr * (tc + 2)};
      const DeviceBuffer x_dev = test::upload_as(reference::concat_rows(parts), DType::kBF16);
      const auto elements = static_cast<std::size_t>(matrices * s.rows * s.cols);
      DeviceBuffer q(elements + 16), qt(elements + 16),
          scales(static_cast<std::size_t>(matrices * direct.count) * 4 + 16),
          scales_t(static_cast<std::size_t>(matrices * flipped.count) * 4 + 16);
      for (const auto* b : {&q, &qt, &scales, &scales_t}) test::poison(*b);
      quantize_tiles(x_dev.data(), matrices, s.rows, s.cols,
                     TileOutput{q.as<std::uint8_t>(), scales.as<float>(), direct},
                     TileOutput{qt.as<std::uint8_t>(), scales_t.as<float>(), flipped},
                     stream.get());
      stream.synchronize();
      const auto codes = test::download<std::uint8_t>(q, elements);
      const auto codes_t = test::download<std::uint8_t>(qt, elements);
      const auto got =
          test::download<float>(scales, static_cast<std::size_t>(matrices * direct.count));
      const auto got_t =
          test::download<float>(scales_t, static_cast<std::size_t>(matrices * flipped.count));
      const auto per_matrix = static_cast<std::size_t>(s.rows * s.cols);
      for (std::int64_t m = 0; m < matrices; ++m) {
        const auto want = reference::quantize_tiles(parts[static_cast<std::size_t>(m)]);
        const auto want_t =
            reference::quantize_tiles(reference::transpose(parts[static_cast<std::size_t>(m)]));
        const auto at = static_cast<std::size_t>(m) * per_matrix;
        CHECK(std::equal(want.codes.begin(), want.codes.end(), codes.begin() + at));
        CHECK(std::equal(want_t.codes.begin(), want_t.codes.end(), codes_t.begin() + at));
        std::int64_t wrong = 0;
        for (std::int64_t i = 0; i < tr; ++i) {
          for (std::int64_t j = 0; j < tc; ++j) {
            const float expected = want.scales[static_cast<std::size_t>(i * tc + j)];
            const float a = got[static_cast<std::size_t>(m * direct.count + i * (tc + 1) + j)];
            const float b = got_t[static_cast<std::size_t>(m * flipped.count + j + i * (tc + 2))];
            // The transpose's tile (j, i) is this tile: its reference says the same.
            const float expected_t = want_t.scales[static_cast<std::size_t>(j * tr + i)];
            if (std::memcmp(&a, &expected, 4) != 0 || std::memcmp(&b, &expected, 4) != 0 ||
                std::memcmp(&expected_t, &expected, 4) != 0)
              ++wrong;
          }
        }
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("fp8 quantize: tiles from unaligned x into unaligned codes, and the transpose alone",
          "[gpu][fp8][quantize]") {
  std::mt19937_64 rng(test::fresh_seed());
  Stream stream;
  for (const Shape& s : std::vector<Shape>{{136, 256}, {256, 136}, {96, 200}}) {
    INFO(s.rows << "x" << s.cols << ", x 2 bytes and the codes 1 byte past alignment");
    const Matrix x = draw_fp8_values(s.rows, s.cols, rng);
    const auto want = reference::quantize_tiles(x);
    const auto want_t = reference::quantize_tiles(reference::transpose(x));
    const auto elements = static_cast<std::size_t>(s.rows * s.cols);
    const DeviceBuffer x_aligned = test::upload_as(x, DType::kBF16);
    DeviceBuffer x_dev(elements * 2 + 16), q(elements + 16), qt(elements + 16),
        scales(want.scales.size() * 4 + 16), scales_t(want.scales.size() * 4 + 16);
    MOE_CHECK_CUDA(
        cudaMemcpy(x_dev.as<char>() + 2, x_aligned.data(), elements * 2, cudaMemcpyDeviceToDevice));
    const std::int64_t tr = (s.rows + 127) / 128, tc = (s.cols + 127) / 128;
    const TileOutput transposed{
        qt.as<std::uint8_t>() + 1, scales_t.as<float>(), {{tr, 1}, tr * tc}};
    for (const bool both : {true, false}) {
      INFO((both ? "codes and transpose" : "the transpose alone"));
      for (const auto* b : {&q, &qt, &scales, &scales_t}) test::poison(*b);
      const TileOutput direct =
          both ? TileOutput{q.as<std::uint8_t>() + 1, scales.as<float>(), {{tc, 1}, tr * tc}}
               : TileOutput{};
      quantize_tiles(x_dev.as<char>() + 2, 1, s.rows, s.cols, direct, transposed, stream.get());
      stream.synchronize();
      const auto codes = test::download<std::uint8_t>(q, elements + 16);
      const auto codes_t = test::download<std::uint8_t>(qt, elements + 16);
      CHECK(std::equal(want_t.codes.begin(), want_t.codes.end(), codes_t.begin() + 1));
      CHECK(codes_t[0] == 0xFF);
      CHECK(codes_t[elements + 1] == 0xFF);  // nothing past the end
      check(want_t, std::vector<std::uint8_t>(codes_t.begin() + 1, codes_t.begin() + 1 + elements),
            test::download<float>(scales_t, want_t.scales.size()), {tr, 1});
      if (both) {
        CHECK(std::equal(want.codes.begin(), want.codes.end(), codes.begin() + 1));
        CHECK(codes[elements + 1] == 0xFF);
        check(want, std::vector<std::uint8_t>(codes.begin() + 1, codes.begin() + 1 + elements),
              test::download<float>(scales, want.scales.size()), {tc, 1});
      } else {
        CHECK(std::count(codes.begin(), codes.end(), 0xFF) == std::ssize(codes));
      }
    }
  }
}

namespace {

// x with non-finite values and negative zeros placed in its 128 × 128 tiles (row-major tile
// index): one NaN; one +Inf; a -Inf and a NaN; all NaN; all -0; -0 among normal values; a
// negative NaN.
Matrix with_specials(Matrix x, std::mt19937_64& rng) {
  const double nan = std::nan(""), inf = std::numeric_limits<double>::infinity();
  const std::int64_t tile_cols = (x.cols + 127) / 128;
  auto tile = [&](std::int64_t index) {
    const std::int64_t r0 = index / tile_cols * 128, c0 = index % tile_cols * 128;
    return std::pair{r0, c0};
  };
  auto anywhere = [&](std::int64_t index) -> double& {
    const auto [r0, c0] = tile(index);
    std::uniform_int_distribution<std::int64_t> r(r0, std::min(r0 + 128, x.rows) - 1),
        c(c0, std::min(c0 + 128, x.cols) - 1);
    return x(r(rng), c(rng));
  };
  auto fill = [&](std::int64_t index, double value) {
    const auto [r0, c0] = tile(index);
    for (std::int64_t r = r0; r < std::min(r0 + 128, x.rows); ++r)
      for (std::int64_t c = c0; c < std::min(c0 + 128, x.cols); ++c) x(r, c) = value;
  };
  anywhere(0) = nan;
  anywhere(1) = inf;
  double& minus_inf = anywhere(2);
  minus_inf = -inf;
  for (double* other = &anywhere(2);; other = &anywhere(2)) {  // beside it, not over it
    if (other == &minus_inf) continue;
    *other = nan;
    break;
  }
  fill(3, nan);
  fill(4, -0.0);
  for (int i = 0; i < 10; ++i) anywhere(5) = -0.0;
  anywhere(6) = -nan;  // a negative NaN: its code may keep the sign
  return x;
}

// Codes equal, a NaN's code being either of E4M3's NaNs (its sign is not kept).
std::int64_t wrong_codes(std::span<const std::uint8_t> want, std::span<const std::uint8_t> got) {
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const bool both_nan = (want[i] & 0x7F) == 0x7F && (got[i] & 0x7F) == 0x7F;
    wrong += want[i] != got[i] && !both_nan;
  }
  return wrong;
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

// NaN does not count toward a block's largest magnitude and stays NaN; an infinity takes the
// largest scale, so that it saturates to ±448 and its block's finite values round to ±0; -0 keeps
// its sign. Row blocks, their segmented form, and tiles with their transposes.
TEST_CASE("fp8 quantize: NaN, infinities and negative zeros as the reference quantizes them",
          "[gpu][fp8][quantize]") {
  std::mt19937_64 rng(test::fresh_seed());
  Stream stream;
  for (const Shape& s : std::vector<Shape>{{300, 384}, {256, 800}}) {
    INFO(s.rows << "x" << s.cols);
    const Matrix x = with_specials(draw_fp8_values(s.rows, s.cols, rng), rng);
    const auto elements = static_cast<std::size_t>(s.rows * s.cols);
    const std::int64_t tr = (s.rows + 127) / 128, tc = (s.cols + 127) / 128;
    const DeviceBuffer x_dev = test::upload_as(x, DType::kBF16);
    DeviceBuffer q(elements), qt(elements), scales(static_cast<std::size_t>(s.rows * tc) * 4),
        scales_t(static_cast<std::size_t>(tr * tc) * 4);
    const auto poison = [&] {
      for (const auto* b : {&q, &qt, &scales, &scales_t}) test::poison(*b);
    };
    {
      INFO("row blocks");
      const auto want = reference::quantize_row_blocks(x);
      poison();
      quantize_row_blocks(x_dev.data(), s.rows, s.cols, q.as<std::uint8_t>(), scales.as<float>(),
                          {tc, 1}, stream.get());
      stream.synchronize();
      CHECK(wrong_codes(want.codes, test::download<std::uint8_t>(q, elements)) == 0);
      CHECK(same_bits(want.scales, test::download<float>(scales, want.scales.size())));
    }
    {
      INFO("row blocks in two segments");
      const std::vector<std::int64_t> offsets{0, 128, s.rows};
      poison();
      quantize_row_blocks_segmented(x_dev.data(), offsets, s.cols, q.as<std::uint8_t>(),
                                    scales.as<float>(), stream.get());
      stream.synchronize();
      CHECK(wrong_codes(reference::quantize_row_blocks(x).codes,
                        test::download<std::uint8_t>(q, elements)) == 0);
    }
    {
      INFO("tiles and their transposes");
      const auto want = reference::quantize_tiles(x);
      const auto want_t = reference::quantize_tiles(reference::transpose(x));
      poison();
      quantize_tiles(x_dev.data(), 1, s.rows, s.cols,
                     TileOutput{q.as<std::uint8_t>(), scales.as<float>(), {{tc, 1}, tr * tc}},
                     TileOutput{qt.as<std::uint8_t>(), scales_t.as<float>(), {{tr, 1}, tr * tc}},
                     stream.get());
      stream.synchronize();
      CHECK(wrong_codes(want.codes, test::download<std::uint8_t>(q, elements)) == 0);
      CHECK(wrong_codes(want_t.codes, test::download<std::uint8_t>(qt, elements)) == 0);
      CHECK(same_bits(want.scales, test::download<float>(scales, want.scales.size())));
      CHECK(same_bits(want_t.scales, test::download<float>(scales_t, want_t.scales.size())));
      // The reference itself: NaN stays NaN, +Inf is 448 at the largest scale, -0 keeps its sign.
      CHECK(want.scales[1] == std::ldexp(1.0f, 127));
      CHECK(std::count(want.codes.begin(), want.codes.end(), 0x7E) >= 1);
      CHECK(std::count(want.codes.begin(), want.codes.end(), 0xFE) >= 1);
      const auto first_code = [&](std::int64_t tile) {
        return want.codes[static_cast<std::size_t>(tile / tc * 128 * s.cols + tile % tc * 128)];
      };
      CHECK((first_code(3) & 0x7F) == 0x7F);  // all NaN: scale 1, NaN codes
      CHECK(want.scales[3] == 1.0f);
      CHECK(first_code(4) == 0x80);  // all -0
      CHECK(want.scales[2] == std::ldexp(1.0f, 127));
    }
  }
}

TEST_CASE("fp8 quantize: bad arguments are named", "[gpu][fp8][quantize]") {
  Stream stream;
  DeviceBuffer buffer(1024);
  CHECK_THROWS_WITH(quantize_row_blocks(buffer.data(), -1, 128, buffer.as<std::uint8_t>(),
                                        buffer.as<float>(), {1, 1}, stream.get()),
                    test::contains_text("rows = -1"));
  CHECK_THROWS_WITH(quantize_tiles(nullptr, 4, 128, buffer.as<std::uint8_t>(), buffer.as<float>(),
                                   {1, 1}, stream.get()),
                    test::contains_text("must be device pointers"));
  const std::vector<std::int64_t> decreasing{0, 32, 16};
  CHECK_THROWS_WITH(
      quantize_row_blocks_segmented(buffer.data(), decreasing, 128, buffer.as<std::uint8_t>(),
                                    buffer.as<float>(), stream.get()),
      test::contains_text("offsets[2] = 16"));
  const std::vector<std::int64_t> too_many(kMaxQuantizeSegments + 2, 0);
  CHECK_THROWS_WITH(
      quantize_row_blocks_segmented(buffer.data(), too_many, 128, buffer.as<std::uint8_t>(),
                                    buffer.as<float>(), stream.get()),
      test::contains_text("514 offsets"));
  // Nothing to do is no error.
  quantize_tiles(nullptr, 0, 128, nullptr, nullptr, {1, 1}, stream.get());
}
