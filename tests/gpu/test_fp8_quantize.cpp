// FP8 block quantization on the GPU (kernels/fp8_quantize.cuh) against the reference
// (reference::quantize_row_blocks / quantize_tiles): every code and every scale bit for bit, at
// shapes with partial blocks, with outliers, zero blocks and values in E4M3's subnormal range,
// the scales written through both strides, outputs poisoned before each launch.
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "kernels/fp8_quantize.cuh"
#include "reference/reference.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;

namespace {

// bf16 values of mixed magnitudes: most N(0, 1), some blocks scaled by 1e3 or 1e-6 (subnormal
// codes), one zero block, and single outliers.
Matrix draw(std::int64_t rows, std::int64_t cols, std::mt19937_64& rng) {
  Matrix x(rows, cols);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> kind(0, 9);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c0 = 0; c0 < cols; c0 += 128) {
      const int k = kind(rng);
      const double factor = k == 0 ? 1e3 : k == 1 ? 1e-6 : k == 2 ? 0.0 : 1.0;
      for (std::int64_t c = c0; c < std::min(c0 + 128, cols); ++c) x(r, c) = factor * normal(rng);
    }
  }
  std::uniform_int_distribution<std::int64_t> any(0, rows * cols - 1);
  for (int i = 0; i < 3; ++i) x.data[static_cast<std::size_t>(any(rng))] = 3e4 * normal(rng);
  return round_to(x, DType::kBF16);
}

struct Shape {
  std::int64_t rows, cols;
};

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
  const std::vector<Shape> shapes = {{1, 128}, {3, 200}, {130, 256}, {257, 1000},
                                     {128, 16}, {5, 7},  {300, 384}};
  Stream stream;
  for (const Shape& s : shapes) {
    for (const bool tiles : {false, true}) {
      for (const bool outer_contiguous : {false, true}) {
        std::ostringstream what;
        what << s.rows << "x" << s.cols << (tiles ? " tiles" : " row blocks")
             << (outer_contiguous ? ", scales outer-contiguous" : ", scales row-major");
        INFO(what.str());
        const Matrix x = draw(s.rows, s.cols, rng);
        const reference::BlockQuantized want =
            tiles ? reference::quantize_tiles(x) : reference::quantize_row_blocks(x);
        const std::int64_t scale_rows = static_cast<std::int64_t>(want.scales.size()) / want.scale_cols;
        // Row-major scales [a][b], or the first index contiguous: [b][a] with a padded to 4.
        const std::int64_t padded = (scale_rows + 3) / 4 * 4;
        const ScaleLayout layout = outer_contiguous ? ScaleLayout{1, padded}
                                                    : ScaleLayout{want.scale_cols, 1};
        const std::size_t scale_count =
            static_cast<std::size_t>(outer_contiguous ? padded * want.scale_cols : scale_rows * want.scale_cols);
        const DeviceBuffer x_dev = test::upload_as(x, DType::kBF16);
        DeviceBuffer q(static_cast<std::size_t>(s.rows * s.cols) + 16), scales(scale_count * 4 + 16);
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

TEST_CASE("fp8 quantize: bad arguments are named", "[gpu][fp8][quantize]") {
  Stream stream;
  DeviceBuffer buffer(1024);
  CHECK_THROWS_WITH(quantize_row_blocks(buffer.data(), -1, 128, buffer.as<std::uint8_t>(),
                                        buffer.as<float>(), {1, 1}, stream.get()),
                    test::contains_text("rows = -1"));
  CHECK_THROWS_WITH(quantize_tiles(nullptr, 4, 128, buffer.as<std::uint8_t>(), buffer.as<float>(),
                                   {1, 1}, stream.get()),
                    test::contains_text("must be device pointers"));
  // Nothing to do is no error.
  quantize_tiles(nullptr, 0, 128, nullptr, nullptr, {1, 1}, stream.get());
}
