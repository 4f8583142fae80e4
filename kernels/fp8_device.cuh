// Device code that the FP8 kernels share: a block's scale, E4M3 codes and their values back in
// bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <span>
#include <string>

#include "fp8_quantize.cuh"
#include "moe/error.h"

namespace moe::fp8_device {

// The block's scale 2^e, e the least with amax <= 448 · 2^e (so the block's largest value maps
// into (224, 448]), in [-126, 127]: a power of two, so that x / 2^e is exact and costs one
// multiplication. 448 = 0.875 · 2^9.
__device__ __forceinline__ int scale_exponent(float amax) {
  if (amax == 0.0f) return 0;
  if (!(amax < INFINITY)) return 127;
  int exponent = 0;
  const float mantissa = frexpf(amax, &exponent);  // amax = mantissa · 2^exponent, [0.5, 1)
  return min(max(mantissa <= 0.875f ? exponent - 9 : exponent - 8, -126), 127);
}

// E4M3 of value / 2^e, given 2^-e: exact scaling, then one rounding, to nearest even.
__device__ __forceinline__ std::uint8_t to_e4m3(float value, float inverse_scale) {
  return __nv_cvt_float_to_fp8(value * inverse_scale, __NV_SATFINITE, __NV_E4M3);
}

// Eight values' codes, little-endian in a uint2, given 2^-e.
__device__ __forceinline__ uint2 encode8(const float (&values)[8], float inverse_scale) {
  uint2 codes{0u, 0u};
  for (int i = 0; i < 4; ++i) {
    codes.x |= static_cast<std::uint32_t>(to_e4m3(values[i], inverse_scale)) << (8 * i);
    codes.y |= static_cast<std::uint32_t>(to_e4m3(values[4 + i], inverse_scale)) << (8 * i);
  }
  return codes;
}

// A code's value times its block's scale, rounded to bf16 to nearest even. The product is exact
// in fp32: E4M3 keeps 4 significant bits and the scale is a power of two whose products stay
// within fp32's range (a block's scale is chosen from its bf16 values).
__device__ __forceinline__ __nv_bfloat16 decode(std::uint8_t code, float scale) {
  const __half value(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3));
  return __float2bfloat16_rn(__half2float(value) * scale);
}

// Eight codes (little-endian in a uint2) into eight bf16 values (a uint4).
__device__ __forceinline__ uint4 decode8(uint2 codes, float scale) {
  uint4 out;
  auto* values = reinterpret_cast<__nv_bfloat16*>(&out);
  for (int i = 0; i < 4; ++i) {
    values[i] = decode(static_cast<std::uint8_t>(codes.x >> (8 * i)), scale);
    values[4 + i] = decode(static_cast<std::uint8_t>(codes.y >> (8 * i)), scale);
  }
  return out;
}

// ---- Row blocks (1 × 128) as the row kernels read them: 16 lanes a block, 8 values (16 bytes of
// bf16) a lane, so that a warp covers two blocks.
inline constexpr int kValuesPerLane = 8;
inline constexpr int kLanesPerRowBlock = kFP8Block / kValuesPerLane;  // 16

// The largest of `value` over the 16 lanes of a row block. Every lane of the warp takes part.
__device__ __forceinline__ float row_block_max(float value) {
  for (int offset = kLanesPerRowBlock / 2; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// The experts' row groups, carried in a launch's parameters: segment s owns rows
// [first[s], first[s + 1]).
struct Segments {
  int count = 0;
  std::int32_t first[kMaxQuantizeSegments + 1];
};

// Where a product over one segment alone reads its row blocks' scales: block c of the segment's
// row i at first · blocks_per_row + c · rows + i (quantize_row_blocks_segmented).
struct SegmentedScales {
  Segments segments;

  struct Segment {
    std::int64_t first, rows;
  };
  // The last segment whose first row is <= r.
  __device__ Segment locate(std::int64_t r) const {
    int lo = 0, hi = segments.count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (segments.first[mid] <= r) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return {segments.first[lo], segments.first[lo + 1] - segments.first[lo]};
  }
  __device__ static std::int64_t at(Segment s, std::int64_t r, std::int64_t c,
                                    std::int64_t blocks_per_row) {
    return s.first * blocks_per_row + c * s.rows + (r - s.first);
  }
  __device__ std::int64_t operator()(std::int64_t r, std::int64_t c,
                                     std::int64_t blocks_per_row) const {
    return at(locate(r), r, c, blocks_per_row);
  }
};

// Host: the segments of `offsets` ([segments + 1], starting at 0, never decreasing, below 2^31,
// 1 to kMaxQuantizeSegments segments), or moe::Error naming `what` and the offending value.
inline SegmentedScales segmented_scales(std::span<const std::int64_t> offsets, const char* what) {
  if (offsets.size() < 2 || offsets.size() > kMaxQuantizeSegments + 1) {
    fail(std::string(what) + ": " + std::to_string(offsets.size()) + " offsets; it takes 1 to " +
         std::to_string(kMaxQuantizeSegments) + " segments, one offset more");
  }
  SegmentedScales index;
  index.segments.count = static_cast<int>(offsets.size()) - 1;
  for (std::size_t s = 0; s < offsets.size(); ++s) {
    const bool ordered = s == 0 ? offsets[s] == 0 : offsets[s] >= offsets[s - 1];
    if (!ordered || offsets[s] > 0x7fffffff) {
      fail(std::string(what) + ": offsets[" + std::to_string(s) + "] = " +
           std::to_string(offsets[s]) + " must start at 0, never decrease and stay below 2^31");
    }
    index.segments.first[s] = static_cast<std::int32_t>(offsets[s]);
  }
  return index;
}

}  // namespace moe::fp8_device
