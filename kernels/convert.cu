#include <cuda_bf16.h>

#include "convert.cuh"
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
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    out[i] = convert_value<In, Out>(in[i]);
  }
}

template <typename In, typename Out>
void launch(const Tensor& in, const Tensor& out, cudaStream_t stream) {
  const std::int64_t n = in.numel();
  constexpr int kThreads = 256;
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((n + kThreads - 1) / kThreads, 65535));
  convert_kernel<In, Out><<<blocks, kThreads, 0, stream>>>(in.as<const In>(), out.as<Out>(), n);
  MOE_CHECK_LAUNCH();
}

}  // namespace

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

}  // namespace moe
