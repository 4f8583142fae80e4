// FP8 (E4M3) block quantization for block-scaled matrix products on Hopper.
//
// A block of values shares one fp32 scale s = 2^e, e the least integer with amax <= 448 · 2^e
// (448 is E4M3's largest finite value; e is kept in [-126, 127], and a block of zeros takes
// s = 1), and each value x is stored as E4M3(x / s), rounded to nearest even and saturated to
// ±448. A power of two makes x / s exact, so the only rounding is E4M3's own: the block's
// largest value lands in (224, 448], and E4M3 keeps the same relative precision at any magnitude
// above its subnormals, so this costs nothing against amax / 448 but the top half-octave of range.
// A product then multiplies each block's partial sums by its scales, in fp32. Two block shapes, as
// DeepSeek-V3 trained with:
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
#include <span>

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

// Row blocks of rows in segments (the experts' row groups): segment s owns rows
// [offsets[s], offsets[s + 1]) and its scales lie where a product over that segment alone reads
// them, at offsets[s] · ceil(cols / 128): block c of the segment's row i at c · n_s + i, n_s its
// rows. offsets: host, [segments + 1], at most kMaxQuantizeSegments segments, carried in the
// launch's parameters (no copy, so a CUDA graph captures them).
inline constexpr int kMaxQuantizeSegments = 512;
void quantize_row_blocks_segmented(const void* x, std::span<const std::int64_t> offsets,
                                   std::int64_t cols, std::uint8_t* q, float* scales,
                                   cudaStream_t stream);

// Rows already quantized as quantize_row_blocks_segmented leaves them: codes [rows, cols] and
// each segment's scales where a product over it reads them. The permute writes X's and dY's so on
// one rank (permute_rows_fp8, kernels/permute.cuh), as does the EP receiver's sort of
// fp8_dispatch's records (sort_chunk_records), and the FP8 experts then read them instead of
// quantizing the rows in a pass of their own.
struct QuantizedRows {
  std::uint8_t* codes = nullptr;
  float* scales = nullptr;
  bool given() const { return codes != nullptr; }
};

// ---- Rows that travel (fp8_dispatch): a record a row, its E4M3 codes then its row blocks' fp32
// scales, zero bytes to a multiple of 16, so that an exchange moves each row as one piece of
// about half the bytes of bf16 (docs/design.md, "FP8 dispatch").
inline constexpr std::int64_t fp8_row_bytes(std::int64_t cols) {
  return (cols + 4 * ((cols + kFP8Block - 1) / kFP8Block) + 15) / 16 * 16;
}
// x bf16 [rows, cols] (cols a multiple of 16) into records [rows, fp8_row_bytes(cols)], 16-byte
// aligned.
void quantize_row_records(const void* x, std::int64_t rows, std::int64_t cols, void* records,
                          cudaStream_t stream);
// What the records of x give back once decoded (each code times its scale, rounded to bf16), in
// one pass: out bf16 [rows, cols], which must not overlap x.
void round_rows_through_fp8(const void* x, std::int64_t rows, std::int64_t cols, void* out,
                            cudaStream_t stream);

// Tiles: the scale of tile (i, j) (rows [128i, 128i + 128), columns [128j, 128j + 128); edge tiles
// may be smaller) goes to scales[i · stride_a + j · stride_b].
void quantize_tiles(const void* x, std::int64_t rows, std::int64_t cols, std::uint8_t* q,
                    float* scales, ScaleLayout layout, cudaStream_t stream);

// One matrix's scales: where tile (i, j) goes, and the floats the layout spans.
struct ScaleBuffer {
  ScaleLayout layout;
  std::int64_t count = 0;
};

struct TileOutput {
  std::uint8_t* codes = nullptr;  // null: not written
  float* scales = nullptr;
  ScaleBuffer per_matrix;
};

// Tiles of `matrices` matrices [rows, cols] stacked in x (an expert's weights each): matrix m's
// codes at out.codes + m · rows · cols, its scales at out.scales + m · out.per_matrix.count.
// With transposed.codes, each matrix's transpose [cols, rows] too, in the same tiles (one read of
// x serves both): tile (i, j) becomes tile (j, i) with the same scale, at transposed.scales +
// m · transposed.per_matrix.count + j · stride_a + i · stride_b. The backward's products read the
// weights transposed, and FP8 products take the inner dimension contiguous only.
void quantize_tiles(const void* x, std::int64_t matrices, std::int64_t rows, std::int64_t cols,
                    const TileOutput& out, const TileOutput& transposed, cudaStream_t stream);

}  // namespace moe
