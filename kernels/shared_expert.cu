#include "shared_expert.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "moe/error.h"

namespace moe {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
// Tokens per slice of the gate weight's gradient: enough slices to fill the GPU at the layer's
// shapes (H / 256 column blocks times the slices), few enough partials to sum again.
constexpr std::int64_t kTokensPerSlice = 128;
constexpr std::int64_t kMaxSlices = 64;

__device__ __forceinline__ float load(const float* p, std::int64_t i) {
  return p[i];
}
__device__ __forceinline__ float load(const __nv_bfloat16* p, std::int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, std::int64_t i, float v) {
  p[i] = v;
}
__device__ __forceinline__ void store(__nv_bfloat16* p, std::int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

__device__ __forceinline__ float sigmoid(float v) {
  return 1.0f / (1.0f + expf(-v));
}

// One warp per token: lanes stride over H, then a butterfly; the same order on every run.
template <typename T>
__global__ void gate_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                    std::int64_t tokens, std::int64_t hidden,
                                    float* __restrict__ logit, float* __restrict__ gate) {
  const int lane = threadIdx.x % kWarp;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kThreads / kWarp);
  for (std::int64_t t = blockIdx.x * (kThreads / kWarp) + threadIdx.x / kWarp; t < tokens;
       t += warps) {
    float sum = 0.0f;
    for (std::int64_t h = lane; h < hidden; h += kWarp)
      sum += load(x, t * hidden + h) * load(weight, h);
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset >>= 1)
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) {
      logit[t] = sum;
      gate[t] = sigmoid(sum);
    }
  }
}

__global__ void gate_logit_grad_kernel(const float* __restrict__ logit, float* __restrict__ dgate,
                                       std::int64_t tokens) {
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       t < tokens; t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float g = sigmoid(logit[t]);
    dgate[t] *= g * (1.0f - g);
  }
}

// partial[s][h] = Σ over the tokens of slice s of dlogit[t]·x[t, h]: threads of a block take
// consecutive columns, so each token's row is read in whole cache lines.
template <typename T>
__global__ void gate_weight_partials_kernel(const T* __restrict__ x,
                                            const float* __restrict__ dlogit, std::int64_t tokens,
                                            std::int64_t hidden, std::int64_t per_slice,
                                            float* __restrict__ partial) {
  const std::int64_t h = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x;
  if (h >= hidden) return;
  const std::int64_t first = blockIdx.y * per_slice;
  const std::int64_t last = first + per_slice < tokens ? first + per_slice : tokens;
  float sum = 0.0f;
  for (std::int64_t t = first; t < last; ++t) sum += dlogit[t] * load(x, t * hidden + h);
  partial[blockIdx.y * hidden + h] = sum;
}

__global__ void sum_partials_kernel(const float* __restrict__ partial, int slices,
                                    std::int64_t hidden, float* __restrict__ out) {
  const std::int64_t h = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x;
  if (h >= hidden) return;
  float sum = 0.0f;
  for (int s = 0; s < slices; ++s) sum += partial[s * hidden + h];
  out[h] = sum;
}

template <typename T>
__global__ void add_input_grad_kernel(T* __restrict__ dx, const T* __restrict__ dx_shared,
                                      const float* __restrict__ dlogit,
                                      const T* __restrict__ weight, std::int64_t tokens,
                                      std::int64_t hidden) {
  const std::int64_t n = tokens * hidden;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float v = load(dx, i) + load(dx_shared, i);
    if (dlogit != nullptr) v += dlogit[i / hidden] * load(weight, i % hidden);
    store(dx, i, v);
  }
}

template <typename T>
__global__ void add_into_kernel(T* __restrict__ target, const T* __restrict__ addend,
                                std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    store(target, i, load(target, i) + load(addend, i));
  }
}

int grid_for(std::int64_t items, std::int64_t per_block) {
  return static_cast<int>(std::clamp<std::int64_t>((items + per_block - 1) / per_block, 1, 65535));
}

std::int64_t slices_for(std::int64_t tokens) {
  return std::clamp<std::int64_t>((tokens + kTokensPerSlice - 1) / kTokensPerSlice, 1, kMaxSlices);
}

void require_float_dtype(const Tensor& t, const char* what) {
  if (t.dtype != DType::kBF16 && t.dtype != DType::kFP32)
    fail(std::string("shared expert: ") + what + " must be bf16 or fp32, got " + t.describe());
}

// Runs `launch` with the element type of `dtype` (bf16 or fp32).
template <typename Launch>
void with_element_type(DType dtype, Launch&& launch) {
  if (dtype == DType::kBF16) {
    launch(static_cast<__nv_bfloat16*>(nullptr));
  } else {
    launch(static_cast<float*>(nullptr));
  }
}

}  // namespace

void shared_gate_forward(const Tensor& x, const Tensor& weight, float* logit, float* gate,
                         cudaStream_t stream) {
  require_float_dtype(x, "x");
  const std::int64_t T = x.dim(0), H = x.dim(1);
  expect_tensor(weight, "shared_gate_weight", x.dtype, {1, H});
  if (T == 0) return;
  with_element_type(x.dtype, [&](auto* type) {
    using E = std::remove_pointer_t<decltype(type)>;
    gate_forward_kernel<E><<<grid_for(T, kThreads / kWarp), kThreads, 0, stream>>>(
        x.as<E>(), weight.as<E>(), T, H, logit, gate);
  });
  MOE_CHECK_CUDA(cudaGetLastError());
}

std::size_t shared_gate_workspace_bytes(std::int64_t tokens, std::int64_t hidden) {
  return static_cast<std::size_t>(slices_for(tokens) * hidden) * sizeof(float);
}

void shared_gate_backward(const Tensor& x, const float* logit, float* dgate, float* weight_grad,
                          void* workspace, cudaStream_t stream) {
  require_float_dtype(x, "x");
  const std::int64_t T = x.dim(0), H = x.dim(1);
  if (T == 0) {
    MOE_CHECK_CUDA(cudaMemsetAsync(weight_grad, 0, static_cast<std::size_t>(H) * 4, stream));
    return;
  }
  gate_logit_grad_kernel<<<grid_for(T, kThreads), kThreads, 0, stream>>>(logit, dgate, T);
  MOE_CHECK_CUDA(cudaGetLastError());
  const std::int64_t slices = slices_for(T);
  const std::int64_t per_slice = (T + slices - 1) / slices;
  auto* partial = static_cast<float*>(workspace);
  const dim3 grid(static_cast<unsigned>((H + kThreads - 1) / kThreads),
                  static_cast<unsigned>(slices));
  with_element_type(x.dtype, [&](auto* type) {
    using E = std::remove_pointer_t<decltype(type)>;
    gate_weight_partials_kernel<E>
        <<<grid, kThreads, 0, stream>>>(x.as<E>(), dgate, T, H, per_slice, partial);
  });
  MOE_CHECK_CUDA(cudaGetLastError());
  sum_partials_kernel<<<grid.x, kThreads, 0, stream>>>(partial, static_cast<int>(slices), H,
                                                       weight_grad);
  MOE_CHECK_CUDA(cudaGetLastError());
}

void add_shared_input_grad(const Tensor& dx, const Tensor& dx_shared, const float* dlogit,
                           const Tensor& weight, cudaStream_t stream) {
  require_float_dtype(dx, "dx");
  const std::int64_t T = dx.dim(0), H = dx.dim(1);
  expect_tensor(dx_shared, "shared expert dx", dx.dtype, {T, H});
  if (dlogit != nullptr) expect_tensor(weight, "shared_gate_weight", dx.dtype, {1, H});
  if (T == 0) return;
  with_element_type(dx.dtype, [&](auto* type) {
    using E = std::remove_pointer_t<decltype(type)>;
    add_input_grad_kernel<E><<<grid_for(T * H, 4 * kThreads), kThreads, 0, stream>>>(
        dx.as<E>(), dx_shared.as<E>(), dlogit, dlogit != nullptr ? weight.as<E>() : nullptr, T, H);
  });
  MOE_CHECK_CUDA(cudaGetLastError());
}

void add_into(const Tensor& target, const Tensor& addend, cudaStream_t stream) {
  require_float_dtype(target, "target");
  if (addend.dtype != target.dtype || addend.numel() != target.numel())
    fail("add_into: " + addend.describe() + " cannot be added to " + target.describe());
  const std::int64_t n = target.numel();
  if (n == 0) return;
  with_element_type(target.dtype, [&](auto* type) {
    using E = std::remove_pointer_t<decltype(type)>;
    add_into_kernel<E>
        <<<grid_for(n, 4 * kThreads), kThreads, 0, stream>>>(target.as<E>(), addend.as<E>(), n);
  });
  MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace moe
