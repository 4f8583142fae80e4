// Device code that the permute kernels share: one block's exclusive scan (the layout's offsets
// and the chunk table's), and the zeroing of an expert-major buffer's padding rows (and of their
// E4M3 codes, whose scales become 1).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fp8_quantize.cuh"
#include "permute_launch.h"
#include "vector_access.cuh"

namespace moe::permute_detail {

constexpr unsigned kFullMask = 0xffffffffu;

using device::from_float;
using device::Pack;
using device::to_float;

// Exclusive prefix sum of n values in shared memory by one block: each thread scans a segment,
// the segment totals are scanned Hillis-Steele style, then added back. Returns the total.
__device__ inline int block_exclusive_scan(int* values, int n, int* totals) {
  const int per_thread = (n + kScanThreads - 1) / kScanThreads;
  const int begin = min(n, static_cast<int>(threadIdx.x) * per_thread);
  const int end = min(n, begin + per_thread);
  int sum = 0;
  for (int i = begin; i < end; ++i) sum += values[i];
  totals[threadIdx.x] = sum;
  __syncthreads();
  for (int width = 1; width < kScanThreads; width *= 2) {
    const int add = threadIdx.x >= width ? totals[threadIdx.x - width] : 0;
    __syncthreads();
    totals[threadIdx.x] += add;
    __syncthreads();
  }
  int running = totals[threadIdx.x] - sum;  // exclusive prefix of this segment
  for (int i = begin; i < end; ++i) {
    const int v = values[i];
    values[i] = running;
    running += v;
  }
  const int total = totals[kScanThreads - 1];
  __syncthreads();
  return total;
}

// True in the grid's padding blocks, after zeroing this block's group.
template <typename T, int kElems>
__device__ __forceinline__ bool zero_padding_block(const Padding& pad, int hidden, T* out) {
  const int group = static_cast<int>(blockIdx.x) - static_cast<int>(gridDim.x - pad.groups);
  if (group < 0) return false;
  using P = Pack<T, kElems>;
  const int units = hidden / kElems;
  const std::int64_t begin = pad.offsets[group] + pad.counts[group];
  const std::int64_t total = (pad.offsets[group + 1] - begin) * units;
  P zero;
#pragma unroll
  for (int e = 0; e < kElems; ++e) zero.v[e] = from_float<T>(0.0f);
  P* rows = reinterpret_cast<P*>(out + begin * hidden);
  for (std::int64_t i = threadIdx.x; i < total; i += blockDim.x) rows[i] = zero;
  if (pad.scalars != nullptr) {
    for (std::int64_t r = begin + threadIdx.x; r < pad.offsets[group + 1]; r += blockDim.x)
      pad.scalars[r] = 0.0f;
  }
  return true;
}

// The padding blocks: each group's padding rows zero in bf16 (and their floats), their codes zero
// and their scales 1, as the quantizer leaves a block of zeros.
__device__ __forceinline__ bool zero_fp8_padding_block(const Padding& pad, int hidden,
                                                       __nv_bfloat16* out, std::uint8_t* codes,
                                                       float* scales) {
  if (!zero_padding_block<__nv_bfloat16, 8>(pad, hidden, out)) return false;
  const int group = static_cast<int>(blockIdx.x) - static_cast<int>(gridDim.x - pad.groups);
  const std::int64_t first = pad.offsets[group], end = pad.offsets[group + 1];
  const std::int64_t begin = first + pad.counts[group], rows = end - first;
  const int packs = hidden / 16;  // 16 codes a uint4
  const std::int64_t total = (end - begin) * packs;
  auto* code_packs = reinterpret_cast<uint4*>(codes + begin * hidden);
  for (std::int64_t i = threadIdx.x; i < total; i += blockDim.x) code_packs[i] = uint4{0, 0, 0, 0};
  const int blocks_per_row = hidden / kFP8Block;
  const std::int64_t padding = end - begin;
  for (std::int64_t i = threadIdx.x; i < padding * blocks_per_row; i += blockDim.x) {
    const std::int64_t r = begin + i % padding, c = i / padding;
    scales[first * blocks_per_row + c * rows + (r - first)] = 1.0f;
  }
  return true;
}

}  // namespace moe::permute_detail
