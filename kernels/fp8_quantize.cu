#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "fp8_device.cuh"
#include "fp8_quantize.cuh"
#include "moe/error.h"

namespace moe {
namespace {

// A block's 128 columns are read by 16 lanes of 8 columns (16 bytes of bf16) each, so a warp
// covers two row blocks, or two rows of a tile.
constexpr int kWarp = 32;
constexpr int kPerLane = fp8_device::kValuesPerLane;
constexpr int kLanesPerBlock = fp8_device::kLanesPerRowBlock;

using fp8_device::row_block_max;
using fp8_device::scale_exponent;
using fp8_device::SegmentedScales;
using fp8_device::to_e4m3;

// Whether whole 8-value accesses line up: 16-byte loads of bf16 need x 16-byte aligned, the
// stores what `store` says, and every row then starts aligned when its length is a multiple of 8.
template <typename Store>
__device__ __forceinline__ bool whole_lanes(const void* x, const Store& store,
                                            std::int64_t row_length) {
  return row_length % kPerLane == 0 && reinterpret_cast<std::uintptr_t>(x) % 16 == 0 &&
         store.aligned();
}

// A lane's 8 columns from `col` (fewer at a row's end: the rest read as 0). `vector`: cols is a
// multiple of 8, so every lane's columns are 16-byte aligned and whole.
__device__ __forceinline__ void load8(const __nv_bfloat16* row, std::int64_t col, std::int64_t cols,
                                      bool vector, float (&v)[kPerLane]) {
  if (vector && col < cols) {
    const uint4 raw = *reinterpret_cast<const uint4*>(row + col);
    const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
    for (int i = 0; i < kPerLane / 2; ++i) {
      const float2 pair = __bfloat1622float2(pairs[i]);
      v[2 * i] = pair.x;
      v[2 * i + 1] = pair.y;
    }
    return;
  }
  for (int i = 0; i < kPerLane; ++i) v[i] = col + i < cols ? __bfloat162float(row[col + i]) : 0.0f;
}

__device__ __forceinline__ void encode8(const float (&v)[kPerLane], float inverse_scale,
                                        std::uint8_t (&out)[kPerLane]) {
  for (int i = 0; i < kPerLane; ++i) out[i] = to_e4m3(v[i], inverse_scale);
}

// Stores 8 codes at row[col..col + 8), fewer at the row's end; whole 8 bytes when `vector`.
__device__ __forceinline__ void put8(std::uint8_t* row, std::int64_t col, std::int64_t cols,
                                     bool vector, const std::uint8_t (&out)[kPerLane]) {
  if (vector && col + kPerLane <= cols) {
    uint2 packed;
    packed.x = out[0] | (out[1] << 8) | (out[2] << 16) | (static_cast<std::uint32_t>(out[3]) << 24);
    packed.y = out[4] | (out[5] << 8) | (out[6] << 16) | (static_cast<std::uint32_t>(out[7]) << 24);
    *reinterpret_cast<uint2*>(row + col) = packed;
    return;
  }
  for (int i = 0; i < kPerLane; ++i)
    if (col + i < cols) row[col + i] = out[i];
}

// The same, the 8 codes little-endian in a uint2.
__device__ __forceinline__ void put8(std::uint8_t* row, std::int64_t col, std::int64_t cols,
                                     bool vector, uint2 packed) {
  if (vector && col + kPerLane <= cols) {
    *reinterpret_cast<uint2*>(row + col) = packed;
    return;
  }
  for (int i = 0; i < kPerLane; ++i) {
    if (col + i < cols)
      row[col + i] = static_cast<std::uint8_t>((i < 4 ? packed.x : packed.y) >> (8 * (i % 4)));
  }
}

// Where row r's column block c keeps its scale.
struct StridedScales {
  ScaleLayout layout;
  __device__ std::int64_t operator()(std::int64_t r, std::int64_t c, std::int64_t) const {
    return r * layout.stride_a + c * layout.stride_b;
  }
};

// Codes row-major [rows, cols] (8-byte stores), each block's scale where scale_index puts it.
template <typename ScaleIndex>
struct SeparateScales {
  std::uint8_t* q;
  float* scales;
  ScaleIndex scale_index;
  __device__ bool aligned() const { return reinterpret_cast<std::uintptr_t>(q) % 8 == 0; }
  __device__ void operator()(std::int64_t r, std::int64_t c, std::int64_t blocks_per_row,
                             std::int64_t col, std::int64_t cols, bool vector, int lane,
                             const float (&v)[kPerLane], int exponent) const {
    std::uint8_t codes[kPerLane];
    encode8(v, ldexpf(1.0f, -exponent), codes);
    put8(q + r * cols, col, cols, vector, codes);
    if (lane == 0) scales[scale_index(r, c, blocks_per_row)] = ldexpf(1.0f, exponent);
  }
};

// Records of fp8_row_bytes(cols) a row: its codes, its blocks' scales, zero bytes to the end.
struct Records {
  std::uint8_t* records;
  std::int64_t record_bytes;
  __device__ bool aligned() const { return reinterpret_cast<std::uintptr_t>(records) % 16 == 0; }
  __device__ void operator()(std::int64_t r, std::int64_t c, std::int64_t blocks_per_row,
                             std::int64_t col, std::int64_t cols, bool vector, int lane,
                             const float (&v)[kPerLane], int exponent) const {
    std::uint8_t* row = records + r * record_bytes;
    std::uint8_t codes[kPerLane];
    encode8(v, ldexpf(1.0f, -exponent), codes);
    put8(row, col, cols, vector, codes);
    if (lane != 0) return;
    auto* tail = reinterpret_cast<float*>(row + cols);  // cols is a multiple of 16
    tail[c] = ldexpf(1.0f, exponent);
    if (c + 1 == blocks_per_row) {
      for (std::int64_t i = blocks_per_row; i < (record_bytes - cols) / 4; ++i) tail[i] = 0.0f;
    }
  }
};

// Quantized and decoded again in registers, into bf16 [rows, cols].
struct RoundTrip {
  __nv_bfloat16* out;
  __device__ bool aligned() const { return reinterpret_cast<std::uintptr_t>(out) % 16 == 0; }
  __device__ void operator()(std::int64_t r, std::int64_t, std::int64_t, std::int64_t col,
                             std::int64_t cols, bool vector, int, const float (&v)[kPerLane],
                             int exponent) const {
    std::uint8_t codes[kPerLane];
    encode8(v, ldexpf(1.0f, -exponent), codes);
    const float scale = ldexpf(1.0f, exponent);
    __nv_bfloat16* row = out + r * cols;
    if (vector && col + kPerLane <= cols) {
      uint2 packed;
      packed.x = codes[0] | (codes[1] << 8) | (codes[2] << 16) |
                 (static_cast<std::uint32_t>(codes[3]) << 24);
      packed.y = codes[4] | (codes[5] << 8) | (codes[6] << 16) |
                 (static_cast<std::uint32_t>(codes[7]) << 24);
      *reinterpret_cast<uint4*>(row + col) = fp8_device::decode8(packed, scale);
      return;
    }
    for (int i = 0; i < kPerLane; ++i)
      if (col + i < cols) row[col + i] = fp8_device::decode(codes[i], scale);
  }
};

// Each group of 16 lanes quantizes one row block: its amax, then its values, which `store`
// writes.
template <typename Store>
__global__ void quantize_row_blocks_kernel(const __nv_bfloat16* __restrict__ x, std::int64_t rows,
                                           std::int64_t cols, Store store) {
  const std::int64_t blocks_per_row = (cols + kFP8Block - 1) / kFP8Block;
  const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // Whole warps leave together (blockDim is a multiple of 32); a warp whose second block lies
  // past the end keeps its lanes in the shuffles and stores nothing there.
  if (thread / kWarp * 2 >= rows * blocks_per_row) return;
  const std::int64_t block = thread / kLanesPerBlock;
  const bool valid = block < rows * blocks_per_row;
  const int lane = threadIdx.x % kLanesPerBlock;
  const std::int64_t r = valid ? block / blocks_per_row : 0, c = valid ? block % blocks_per_row : 0;
  const std::int64_t col = c * kFP8Block + lane * kPerLane;
  const bool vector = whole_lanes(x, store, cols);
  float v[kPerLane];
  load8(x + r * cols, col, cols, vector, v);
  float amax = 0.0f;
  for (float value : v) amax = fmaxf(amax, fabsf(value));
  const int exponent = scale_exponent(row_block_max(amax));
  if (!valid) return;
  store(r, c, blocks_per_row, col, cols, vector, lane, v, exponent);
}

// A lane's 8 columns from `col` as bf16 (fewer at a row's end: the rest read as 0), as load8.
__device__ __forceinline__ uint4 load8_bf16(const __nv_bfloat16* row, std::int64_t col,
                                            std::int64_t cols, bool vector) {
  if (vector && col < cols) return *reinterpret_cast<const uint4*>(row + col);
  uint4 raw;
  auto* values = reinterpret_cast<__nv_bfloat16*>(&raw);
  for (int i = 0; i < kPerLane; ++i)
    values[i] = col + i < cols ? row[col + i] : __float2bfloat16_rn(0.0f);
  return raw;
}

// The largest magnitude of 8 bf16 values (NaN ignored, as fmaxf does), as a float.
__device__ __forceinline__ float max_magnitude8(uint4 raw) {
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
  __nv_bfloat162 m = __habs2(pairs[0]);
  for (int i = 1; i < kPerLane / 2; ++i) m = __hmax2(m, __habs2(pairs[i]));
  return fmaxf(__bfloat162float(m.x), __bfloat162float(m.y));
}

// 8 bf16 values' codes, little-endian, given 2^-e: each value scaled exactly in fp32, then
// rounded once, as to_e4m3.
__device__ __forceinline__ uint2 encode8_bf16(uint4 raw, float inverse_scale) {
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
  std::uint32_t words[2];
  for (int w = 0; w < 2; ++w) {
    std::uint32_t word = 0;
    for (int i = 0; i < 2; ++i) {
      float2 pair = __bfloat1622float2(pairs[2 * w + i]);
      pair.x *= inverse_scale;
      pair.y *= inverse_scale;
      word |= static_cast<std::uint32_t>(__nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3))
              << (16 * i);
    }
    words[w] = word;
  }
  return {words[0], words[1]};
}

// One thread block a tile: 16 rows a pass, 8 passes, the values kept in registers (as bf16, so
// that four blocks fit an SM) between the amax and the stores, so the tile is read once. A
// transposed copy goes through shared memory, so that its stores too are whole rows.
constexpr int kTileThreads = 256;
constexpr int kTileRowsPerPass = kTileThreads / kLanesPerBlock;  // 16
constexpr int kTilePasses = kFP8Block / kTileRowsPerPass;        // 8
// The codes of a tile in shared memory for its transpose: 128 rows of 16 pairs of words, the
// pair p of row r kept at p ^ (r / 8), so that both the rows' stores (16 lanes a row) and the
// transposing reads (16 lanes down a column of 8 × 8 blocks) spread over every bank.
__device__ __forceinline__ int swizzled_pair(int row, int pair) {
  return pair ^ (row / 8 % 16);
}

// The transpose of a 4 × 4 block of bytes, a row a word.
__device__ __forceinline__ void transpose4x4(std::uint32_t (&w)[4]) {
  const std::uint32_t t0 = __byte_perm(w[0], w[1], 0x5140), t1 = __byte_perm(w[0], w[1], 0x7362);
  const std::uint32_t t2 = __byte_perm(w[2], w[3], 0x5140), t3 = __byte_perm(w[2], w[3], 0x7362);
  w[0] = __byte_perm(t0, t2, 0x5410);
  w[1] = __byte_perm(t0, t2, 0x7632);
  w[2] = __byte_perm(t1, t3, 0x5410);
  w[3] = __byte_perm(t1, t3, 0x7632);
}

__global__ void __launch_bounds__(kTileThreads, 4)
    quantize_tiles_kernel(const __nv_bfloat16* __restrict__ x, std::int64_t rows, std::int64_t cols,
                          TileOutput out, TileOutput transposed) {
  const std::int64_t tile_row = blockIdx.y, tile_col = blockIdx.x, matrix = blockIdx.z;
  x += matrix * rows * cols;
  const int lane = threadIdx.x % kLanesPerBlock, row_in_pass = threadIdx.x / kLanesPerBlock;
  const std::int64_t col = tile_col * kFP8Block + lane * kPerLane;
  const std::int64_t first_row = tile_row * kFP8Block;
  const bool vector = whole_lanes(x, SeparateScales<StridedScales>{out.codes, nullptr, {}}, cols);
  uint4 v[kTilePasses];
#pragma unroll
  for (int pass = 0; pass < kTilePasses; ++pass) {
    const std::int64_t r = first_row + pass * kTileRowsPerPass + row_in_pass;
    v[pass] = r < rows ? load8_bf16(x + r * cols, col, cols, vector) : uint4{0u, 0u, 0u, 0u};
  }
  float amax = 0.0f;
#pragma unroll
  for (int pass = 0; pass < kTilePasses; ++pass) amax = fmaxf(amax, max_magnitude8(v[pass]));
  __shared__ float warp_amax[kTileThreads / kWarp];
  __shared__ uint2 codes[kFP8Block][kFP8Block / kPerLane];
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (threadIdx.x % kWarp == 0) warp_amax[threadIdx.x / kWarp] = amax;
  __syncthreads();
  amax = 0.0f;
  for (float value : warp_amax) amax = fmaxf(amax, value);
  const int exponent = scale_exponent(amax);
  const float inverse_scale = ldexpf(1.0f, -exponent);
  const float scale = ldexpf(1.0f, exponent);
#pragma unroll
  for (int pass = 0; pass < kTilePasses; ++pass) {
    const int local_row = pass * kTileRowsPerPass + row_in_pass;
    const std::int64_t r = first_row + local_row;
    const uint2 packed = encode8_bf16(v[pass], inverse_scale);
    if (out.codes != nullptr && r < rows)
      put8(out.codes + (matrix * rows + r) * cols, col, cols, vector, packed);
    if (transposed.codes != nullptr) codes[local_row][swizzled_pair(local_row, lane)] = packed;
  }
  if (threadIdx.x == 0) {
    if (out.codes != nullptr) {
      const ScaleLayout& l = out.per_matrix.layout;
      out.scales[matrix * out.per_matrix.count + tile_row * l.stride_a + tile_col * l.stride_b] =
          scale;
    }
    if (transposed.codes != nullptr) {
      const ScaleLayout& l = transposed.per_matrix.layout;
      transposed.scales[matrix * transposed.per_matrix.count + tile_col * l.stride_a +
                        tile_row * l.stride_b] = scale;
    }
  }
  if (transposed.codes == nullptr) return;
  __syncthreads();
  // The transpose [cols, rows]: each thread turns one 8 × 8 block of the tile in registers, the
  // block's 8 rows from row 8 · block_row, its 8 columns from column 8 · block_col, which become
  // 8 bytes of 8 rows of the transpose; the 16 threads of a block column store 128 bytes a row.
  const int block_row = threadIdx.x % 16, block_col = threadIdx.x / 16;
  std::uint32_t low[2][4], high[2][4];  // [half of the block's rows][row]: columns 0-3 / 4-7
  for (int i = 0; i < kPerLane; ++i) {
    const int local_row = block_row * kPerLane + i;
    const uint2 pair = codes[local_row][swizzled_pair(local_row, block_col)];
    low[i / 4][i % 4] = pair.x;
    high[i / 4][i % 4] = pair.y;
  }
  for (int half = 0; half < 2; ++half) {
    transpose4x4(low[half]);
    transpose4x4(high[half]);
  }
  const bool transposed_vector =
      rows % kPerLane == 0 && reinterpret_cast<std::uintptr_t>(transposed.codes) % 8 == 0;
  std::uint8_t* matrix_t = transposed.codes + matrix * rows * cols;
  const std::int64_t at = first_row + block_row * kPerLane;
  for (int j = 0; j < kPerLane; ++j) {
    const std::int64_t c = tile_col * kFP8Block + block_col * kPerLane + j;
    if (c >= cols || at >= rows) continue;
    const std::uint32_t(&words)[2][4] = j < 4 ? low : high;
    const uint2 packed{words[0][j % 4], words[1][j % 4]};
    put8(matrix_t + c * rows, at, rows, transposed_vector, packed);
  }
}

std::string text(const void* pointer) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%p", pointer);
  return buffer;
}

void check_arguments(const char* what, const void* x, std::int64_t rows, std::int64_t cols,
                     const void* q, const float* scales) {
  if (rows < 0 || cols < 0) {
    fail(std::string(what) + ": rows = " + std::to_string(rows) +
         " and cols = " + std::to_string(cols) + " must be >= 0");
  }
  if (rows > 0 && cols > 0 && (x == nullptr || q == nullptr || scales == nullptr)) {
    fail(std::string(what) + ": x, q and scales must be device pointers, got " + text(x) + ", " +
         text(q) + ", " + text(scales));
  }
}

[[noreturn]] void too_large(const char* what, std::int64_t rows, std::int64_t cols) {
  fail(std::string(what) + ": " + std::to_string(rows) + " rows of " + std::to_string(cols) +
       " columns are too many for one launch");
}

template <typename Store>
void launch_row_blocks(const char* what, const void* x, std::int64_t rows, std::int64_t cols,
                       const Store& store, cudaStream_t stream) {
  const std::int64_t row_blocks = rows * ((cols + kFP8Block - 1) / kFP8Block);
  constexpr int kThreads = 256;
  const std::int64_t threads = (row_blocks + 1) / 2 * kWarp;
  const std::int64_t blocks = (threads + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) too_large(what, rows, cols);
  quantize_row_blocks_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), rows, cols, store);
  MOE_CHECK_LAUNCH();
}

// The rows that travel take whole 16-byte records and whole 8-value lanes.
// `out` (named out_name) must be 16-byte aligned where `aligned` says so (records, whose scales
// are stored as floats after the codes).
void check_travelling_rows(const char* what, const void* x, std::int64_t rows, std::int64_t cols,
                           const void* out, const char* out_name, bool aligned) {
  if (rows < 0 || cols < 0 || cols % 16 != 0) {
    fail(std::string(what) + ": rows = " + std::to_string(rows) +
         " and cols = " + std::to_string(cols) + " must be >= 0, cols a multiple of 16");
  }
  if (rows > 0 && cols > 0 && (x == nullptr || out == nullptr)) {
    fail(std::string(what) + ": x and " + out_name + " must be device pointers, got " + text(x) +
         ", " + text(out));
  }
  if (aligned && reinterpret_cast<std::uintptr_t>(out) % 16 != 0) {
    fail(std::string(what) + ": " + out_name + " = " + text(out) + " must be 16-byte aligned");
  }
}

}  // namespace

void quantize_row_blocks(const void* x, std::int64_t rows, std::int64_t cols, std::uint8_t* q,
                         float* scales, ScaleLayout layout, cudaStream_t stream) {
  check_arguments("quantize_row_blocks", x, rows, cols, q, scales);
  if (rows == 0 || cols == 0) return;
  launch_row_blocks("quantize_row_blocks", x, rows, cols,
                    SeparateScales<StridedScales>{q, scales, StridedScales{layout}}, stream);
}

void quantize_row_blocks_segmented(const void* x, std::span<const std::int64_t> offsets,
                                   std::int64_t cols, std::uint8_t* q, float* scales,
                                   cudaStream_t stream) {
  const char* what = "quantize_row_blocks_segmented";
  const SegmentedScales index = fp8_device::segmented_scales(offsets, what);
  const std::int64_t rows = offsets.back();
  check_arguments(what, x, rows, cols, q, scales);
  if (rows == 0 || cols == 0) return;
  launch_row_blocks(what, x, rows, cols, SeparateScales<SegmentedScales>{q, scales, index}, stream);
}

void quantize_tiles(const void* x, std::int64_t matrices, std::int64_t rows, std::int64_t cols,
                    const TileOutput& out, const TileOutput& transposed, cudaStream_t stream) {
  const char* what = "quantize_tiles";
  if (matrices < 0 || matrices > 65535) {
    fail(std::string(what) + ": matrices = " + std::to_string(matrices) + " must be in [0, 65535]");
  }
  check_arguments(what, x, rows, cols, out.codes != nullptr ? out.codes : transposed.codes,
                  out.codes != nullptr ? out.scales : transposed.scales);
  if ((out.codes != nullptr && out.scales == nullptr) ||
      (transposed.codes != nullptr && transposed.scales == nullptr)) {
    fail(std::string(what) + ": out.codes = " + text(out.codes) + " with out.scales = " +
         text(out.scales) + ", transposed.codes = " + text(transposed.codes) +
         " with transposed.scales = " + text(transposed.scales) + ": codes need scales");
  }
  if (rows == 0 || cols == 0 || matrices == 0) return;
  const std::int64_t tile_rows = (rows + kFP8Block - 1) / kFP8Block;
  const std::int64_t tile_cols = (cols + kFP8Block - 1) / kFP8Block;
  if (tile_rows > 65535 || tile_cols > 0x7fffffff) too_large(what, rows, cols);
  const dim3 grid(static_cast<unsigned>(tile_cols), static_cast<unsigned>(tile_rows),
                  static_cast<unsigned>(matrices));
  quantize_tiles_kernel<<<grid, kTileThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x),
                                                           rows, cols, out, transposed);
  MOE_CHECK_LAUNCH();
}

void quantize_tiles(const void* x, std::int64_t rows, std::int64_t cols, std::uint8_t* q,
                    float* scales, ScaleLayout layout, cudaStream_t stream) {
  check_arguments("quantize_tiles", x, rows, cols, q, scales);
  quantize_tiles(x, 1, rows, cols, TileOutput{q, scales, {layout, 0}}, TileOutput{}, stream);
}

void quantize_row_records(const void* x, std::int64_t rows, std::int64_t cols, void* records,
                          cudaStream_t stream) {
  check_travelling_rows("quantize_row_records", x, rows, cols, records, "records", true);
  if (rows == 0 || cols == 0) return;
  launch_row_blocks("quantize_row_records", x, rows, cols,
                    Records{static_cast<std::uint8_t*>(records), fp8_row_bytes(cols)}, stream);
}

void round_rows_through_fp8(const void* x, std::int64_t rows, std::int64_t cols, void* out,
                            cudaStream_t stream) {
  check_travelling_rows("round_rows_through_fp8", x, rows, cols, out, "out", false);
  if (rows == 0 || cols == 0) return;
  launch_row_blocks("round_rows_through_fp8", x, rows, cols,
                    RoundTrip{static_cast<__nv_bfloat16*>(out)}, stream);
}

}  // namespace moe
