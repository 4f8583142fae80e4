// FP8 (E4M3) block quantization for block-scaled matrix products on Hopper.
//
// A block of values shares one fp32 scale s = amax / 448 (448 is E4M3's largest finite value; a
// block of zeros takes s = 1), and each value x is stored as E4M3(x / s), rounded to nearest even
// and saturated to ±448. A product then multiplies each block's partial sums by its scales, in
// fp32. Two block shapes, as DeepSeek-V3 trained with:
//   rows: 1 × 128 (a row's 128 consecutive columns; the last block of a row may be shorter), for
//         activations, whose outliers are per token;
//   tiles: 128 × 128, for weights; a tile's scale serves the transposed matrix unchanged, so the
//          backward's products need no second set of scales.
// Matrices are row-major [rows, cols], the columns being the product's inner dimension. Where a
// block's scale goes is the caller's: scale[a · stride_a + b · stride_b], with a, b given below,
// so the scales can be written in whatever layout the matrix library reads.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moe {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr int kFP8Block = 128;

struct ScaleLayout {
  std::int64_t stride_a = 0;
  std::int64_t stride_b = 0;
};

// Row blocks: the scale of row r's column block c (columns [128c, 128c + 128)) goes to
// scales[r · stride_a + c · stride_b]. x bf16 [rows, cols]; q E4M3 [rows, cols] (one byte each).
void quantize_row_blocks(const void* x, std::int64_t rows, std::int64_t cols, std::uint8_t* q,
                         float* scales, ScaleLayout layout, cudaStream_t stream);

// Tiles: the scale of tile (i, j) (rows [128i, 128i + 128), columns [128j, 128j + 128); edge tiles
// may be smaller) goes to scales[i · stride_a + j · stride_b].
void quantize_tiles(const void* x, std::int64_t rows, std::int64_t cols, std::uint8_t* q,
                    float* scales, ScaleLayout layout, cudaStream_t stream);

}  // namespace moe
