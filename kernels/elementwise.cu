#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>

#include "elementwise.cuh"
#include "moe/error.h"

namespace moe {
namespace {

template <typename In, typename Out>
__device__ Out convert_value(In value) {
  if constexpr (std::is_same_v<In, Out>) {
    return value;
  } else if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
    return __float2bfloat16_rn(value);
  } else {
    return __bfloat162float(value);
  }
}

template <typename In, typename Out>
__global__ void convert_kernel(const In* __restrict__ in, Out* __restrict__ out, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    out[i] = convert_value<In, Out>(in[i]);
  }
}

template <typename In, typename Out>
void launch(const Tensor& in, const Tensor& out, cudaStream_t stream) {
  const std::int64_t n = in.numel();
  constexpr int kThreads = 256;
  const auto blocks =
      static_cast<unsigned>(std::min<std::int64_t>((n + kThreads - 1) / kThreads, 65535));
  convert_kernel<In, Out><<<blocks, kThreads, 0, stream>>>(in.as<const In>(), out.as<Out>(), n);
  MOE_CHECK_LAUNCH();
}

// splitmix64: a counter-based hash, so element i's value needs no state.
__device__ __forceinline__ std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename Out>
__global__ void init_normal_kernel(Out* out, std::int64_t n, std::uint64_t seed,
                                   std::uint64_t first, float stddev) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const std::uint64_t bits = mix(seed ^ mix(first + static_cast<std::uint64_t>(i)));
    // Box-Muller on two 24-bit uniforms in (0, 1].
    const float u1 = (static_cast<float>(bits >> 40) + 1.0f) * (1.0f / 16777216.0f);
    const float u2 = static_cast<float>((bits >> 16) & 0xffffffu) * (1.0f / 16777216.0f);
    const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    out[i] = convert_value<float, Out>(stddev * z);
  }
}

template <typename In>
__global__ void count_nonfinite_kernel(const In* in, std::int64_t n, int* count) {
  int local = 0;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    local += !isfinite(convert_value<In, float>(in[i]));
  }
  if (local > 0) atomicAdd(count, local);
}

unsigned grid_for(std::int64_t n) {
  return static_cast<unsigned>(
      std::max<std::int64_t>(1, std::min<std::int64_t>((n + 255) / 256, 4096)));
}

struct SmallValues {
  std::int64_t values[8];
  int count;
};

__global__ void write_values_kernel(std::int64_t* device, const SmallValues values) {
  if (static_cast<int>(threadIdx.x) < values.count)
    device[threadIdx.x] = values.values[threadIdx.x];
}

}  // namespace

void init_normal(const Tensor& out, std::uint64_t seed, std::uint64_t first, float stddev,
                 cudaStream_t stream) {
  const std::int64_t n = out.numel();
  if (n == 0) return;
  if (out.dtype == DType::kBF16) {
    init_normal_kernel<<<grid_for(n), 256, 0, stream>>>(out.as<__nv_bfloat16>(), n, seed, first,
                                                        stddev);
  } else if (out.dtype == DType::kFP32) {
    init_normal_kernel<<<grid_for(n), 256, 0, stream>>>(out.as<float>(), n, seed, first, stddev);
  } else {
    fail("init_normal: " + out.describe() + " is not bf16 or fp32");
  }
  MOE_CHECK_LAUNCH();
}

void count_nonfinite(const Tensor& t, int* count, cudaStream_t stream) {
  MOE_CHECK_CUDA(cudaMemsetAsync(count, 0, sizeof(int), stream));
  const std::int64_t n = t.numel();
  if (n == 0) return;
  if (t.dtype == DType::kBF16) {
    count_nonfinite_kernel<<<grid_for(n), 256, 0, stream>>>(t.as<const __nv_bfloat16>(), n, count);
  } else if (t.dtype == DType::kFP32) {
    count_nonfinite_kernel<<<grid_for(n), 256, 0, stream>>>(t.as<const float>(), n, count);
  } else {
    fail("count_nonfinite: " + t.describe() + " is not bf16 or fp32");
  }
  MOE_CHECK_LAUNCH();
}

void convert(const Tensor& in, const Tensor& out, cudaStream_t stream) {
  if (in.numel() != out.numel()) {
    fail("convert: " + in.describe() + " into " + out.describe() + ": element counts differ");
  }
  if (in.numel() == 0) return;
  const bool in_bf16 = in.dtype == DType::kBF16;
  const bool out_bf16 = out.dtype == DType::kBF16;
  if ((!in_bf16 && in.dtype != DType::kFP32) || (!out_bf16 && out.dtype != DType::kFP32)) {
    fail("convert: " + in.describe() + " into " + out.describe() + ": only bf16 and fp32");
  }
  if (in_bf16 && out_bf16) return launch<__nv_bfloat16, __nv_bfloat16>(in, out, stream);
  if (in_bf16) return launch<__nv_bfloat16, float>(in, out, stream);
  if (out_bf16) return launch<float, __nv_bfloat16>(in, out, stream);
  launch<float, float>(in, out, stream);
}

void write_values(std::int64_t* device, std::span<const std::int64_t> values, cudaStream_t stream) {
  SmallValues small{};
  if (values.size() > std::size(small.values))
    fail("write_values: " + std::to_string(values.size()) + " values, at most 8");
  if (values.empty()) return;
  std::copy(values.begin(), values.end(), small.values);
  small.count = static_cast<int>(values.size());
  write_values_kernel<<<1, 32, 0, stream>>>(device, small);
  MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace moe
