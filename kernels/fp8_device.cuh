// Device code that the FP8 kernels share: a block's scale, E4M3 codes and their values back in
// bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

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

}  // namespace moe::fp8_device
