// Device code that the FP8 kernels share: E4M3 codes turned back into bf16 values.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace moe::fp8_device {

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
