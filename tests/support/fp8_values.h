// What the FP8 tests quantize: bf16 values of mixed magnitudes, so that a block's scale takes
// many exponents, E4M3's subnormal codes occur, and some blocks are zero.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>

#include "moe/tensor.h"
#include "reference/reference.h"

namespace moe::test {

// Most N(0, 1), some 128-column blocks scaled by 1e3 or 1e-6 (subnormal codes), some zero, and
// three single outliers; rounded to bf16.
inline reference::Matrix draw_fp8_values(std::int64_t rows, std::int64_t cols,
                                         std::mt19937_64& rng) {
  reference::Matrix x(rows, cols);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> kind(0, 9);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c0 = 0; c0 < cols; c0 += 128) {
      const int k = kind(rng);
      const double factor = k == 0 ? 1e3 : k == 1 ? 1e-6 : k == 2 ? 0.0 : 1.0;
      for (std::int64_t c = c0; c < std::min(c0 + 128, cols); ++c) x(r, c) = factor * normal(rng);
    }
  }
  if (rows * cols > 0) {
    std::uniform_int_distribution<std::int64_t> any(0, rows * cols - 1);
    for (int i = 0; i < 3; ++i) x.data[static_cast<std::size_t>(any(rng))] = 3e4 * normal(rng);
  }
  return reference::round_to(x, DType::kBF16);
}

struct MatrixShape {
  std::int64_t rows, cols;
};

}  // namespace moe::test
