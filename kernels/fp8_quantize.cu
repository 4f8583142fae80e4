#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdio>
#include <string>

#include "fp8_quantize.cuh"
#include "moe/error.h"

namespace moe {
namespace {

constexpr int kWarp = 32;
constexpr int kPerLane = kFP8Block / kWarp;  // 4 columns a lane in a 128-column block

__device__ __forceinline__ float warp_max(float value) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

__device__ __forceinline__ float block_scale(float amax) { return amax > 0.0f ? amax / kE4M3Max : 1.0f; }

__device__ __forceinline__ std::uint8_t to_e4m3(float value, float scale) {
  // Division rounded to nearest, as the reference does it: x · (1/s) would round twice.
  return __nv_cvt_float_to_fp8(__fdiv_rn(value, scale), __NV_SATFINITE, __NV_E4M3);
}

// Loads a lane's 4 columns starting at `col` (fewer at a row's end; the rest read as 0).
__device__ __forceinline__ void load4(const __nv_bfloat16* row, std::int64_t col, std::int64_t cols,
                                      bool vector, float (&v)[kPerLane]) {
  if (vector && col + kPerLane <= cols) {
    const uint2 raw = *reinterpret_cast<const uint2*>(row + col);
    const auto* pair = reinterpret_cast<const __nv_bfloat162*>(&raw);
    const float2 lo = __bfloat1622float2(pair[0]), hi = __bfloat1622float2(pair[1]);
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
    return;
  }
  for (int i = 0; i < kPerLane; ++i) v[i] = col + i < cols ? __bfloat162float(row[col + i]) : 0.0f;
}

__device__ __forceinline__ void store4(std::uint8_t* row, std::int64_t col, std::int64_t cols,
                                       bool vector, const float (&v)[kPerLane], float scale) {
  std::uint8_t out[kPerLane];
  for (int i = 0; i < kPerLane; ++i) out[i] = to_e4m3(v[i], scale);
  if (vector && col + kPerLane <= cols) {
    *reinterpret_cast<std::uint32_t*>(row + col) =
        out[0] | (out[1] << 8) | (out[2] << 16) | (static_cast<std::uint32_t>(out[3]) << 24);
    return;
  }
  for (int i = 0; i < kPerLane; ++i)
    if (col + i < cols) row[col + i] = out[i];
}

// One warp a row block: the warp's amax, then its values.
__global__ void quantize_row_blocks_kernel(const __nv_bfloat16* __restrict__ x, std::int64_t rows,
                                           std::int64_t cols, std::uint8_t* __restrict__ q,
                                           float* __restrict__ scales, ScaleLayout layout) {
  const std::int64_t blocks_per_row = (cols + kFP8Block - 1) / kFP8Block;
  const std::int64_t warp =
      (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  if (warp >= rows * blocks_per_row) return;  // whole warps leave together
  const int lane = threadIdx.x % kWarp;
  const std::int64_t r = warp / blocks_per_row, c = warp % blocks_per_row;
  const std::int64_t col = c * kFP8Block + lane * kPerLane;
  const bool vector = cols % kPerLane == 0;  // then every lane's 4 columns are 8-byte aligned
  float v[kPerLane];
  load4(x + r * cols, col, cols, vector, v);
  float amax = 0.0f;
  for (float value : v) amax = fmaxf(amax, fabsf(value));
  const float scale = block_scale(warp_max(amax));
  store4(q + r * cols, col, cols, vector, v, scale);
  if (lane == 0) scales[r * layout.stride_a + c * layout.stride_b] = scale;
}

// One thread block a tile: 8 warps, each lane 4 columns of every 8th row of the tile.
constexpr int kTileThreads = 256;
constexpr int kTileRowsPerPass = kTileThreads / kWarp;

__global__ void quantize_tiles_kernel(const __nv_bfloat16* __restrict__ x, std::int64_t rows,
                                      std::int64_t cols, std::uint8_t* __restrict__ q,
                                      float* __restrict__ scales, ScaleLayout layout) {
  const std::int64_t tile_row = blockIdx.y, tile_col = blockIdx.x;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const std::int64_t col = tile_col * kFP8Block + lane * kPerLane;
  const std::int64_t first_row = tile_row * kFP8Block;
  const std::int64_t end_row = min(first_row + kFP8Block, rows);
  const bool vector = cols % kPerLane == 0;
  float amax = 0.0f;
  for (std::int64_t r = first_row + warp; r < end_row; r += kTileRowsPerPass) {
    float v[kPerLane];
    load4(x + r * cols, col, cols, vector, v);
    for (float value : v) amax = fmaxf(amax, fabsf(value));
  }
  __shared__ float warp_amax[kTileRowsPerPass];
  amax = warp_max(amax);
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads();
  amax = 0.0f;
  for (float value : warp_amax) amax = fmaxf(amax, value);
  const float scale = block_scale(amax);
  // The second pass reads the tile again: it is 32 KiB, and reads that recent come from L2.
  for (std::int64_t r = first_row + warp; r < end_row; r += kTileRowsPerPass) {
    float v[kPerLane];
    load4(x + r * cols, col, cols, vector, v);
    store4(q + r * cols, col, cols, vector, v, scale);
  }
  if (threadIdx.x == 0) scales[tile_row * layout.stride_a + tile_col * layout.stride_b] = scale;
}

std::string text(const void* pointer) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%p", pointer);
  return buffer;
}

void check_arguments(const char* what, const void* x, std::int64_t rows, std::int64_t cols,
                     const void* q, const float* scales) {
  if (rows < 0 || cols < 0) {
    fail(std::string(what) + ": rows = " + std::to_string(rows) + " and cols = " +
         std::to_string(cols) + " must be >= 0");
  }
  if (rows > 0 && cols > 0 && (x == nullptr || q == nullptr || scales == nullptr)) {
    fail(std::string(what) + ": x, q and scales must be device pointers, got " + text(x) + ", " +
         text(q) + ", " + text(scales));
  }
}

void too_large(const char* what, std::int64_t rows, std::int64_t cols) {
  fail(std::string(what) + ": " + std::to_string(rows) + " rows of " + std::to_string(cols) +
       " columns are too many for one launch");
}

}  // namespace

void quantize_row_blocks(const void* x, std::int64_t rows, std::int64_t cols, std::uint8_t* q,
                         float* scales, ScaleLayout layout, cudaStream_t stream) {
  check_arguments("quantize_row_blocks", x, rows, cols, q, scales);
  if (rows == 0 || cols == 0) return;
  const std::int64_t warps = rows * ((cols + kFP8Block - 1) / kFP8Block);
  constexpr int kThreads = 256;
  const std::int64_t blocks = (warps * kWarp + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) too_large("quantize_row_blocks", rows, cols);
  quantize_row_blocks_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), rows, cols, q, scales, layout);
  MOE_CHECK_LAUNCH();
}

void quantize_tiles(const void* x, std::int64_t rows, std::int64_t cols, std::uint8_t* q,
                    float* scales, ScaleLayout layout, cudaStream_t stream) {
  check_arguments("quantize_tiles", x, rows, cols, q, scales);
  if (rows == 0 || cols == 0) return;
  const std::int64_t tile_rows = (rows + kFP8Block - 1) / kFP8Block;
  const std::int64_t tile_cols = (cols + kFP8Block - 1) / kFP8Block;
  if (tile_rows > 65535 || tile_cols > 0x7fffffff)
    too_large("quantize_tiles", rows, cols);
  const dim3 grid(static_cast<unsigned>(tile_cols), static_cast<unsigned>(tile_rows));
  quantize_tiles_kernel<<<grid, kTileThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x),
                                                           rows, cols, q, scales, layout);
  MOE_CHECK_LAUNCH();
}

}  // namespace moe
