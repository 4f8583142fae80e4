#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "moe/error.h"
#include "train_kernels.cuh"

namespace moe::train {
namespace {

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

constexpr int kThreads = 256;

unsigned blocks_for(std::int64_t n) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, 4096));
}

template <typename T>
__global__ void add_kernel(const T* a, const T* b, T* out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    store(out, i, load(a, i) + load(b, i));
  }
}

template <typename T>
__global__ void squared_error_kernel(const T* __restrict__ pred, const T* __restrict__ target,
                                     float scale, T* __restrict__ grad, float* partial_sums,
                                     std::int64_t n) {
  __shared__ float sums[kThreads];
  float sum = 0.0f;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float diff = load(pred, i) - load(target, i);
    store(grad, i, 2.0f * scale * diff);
    sum += diff * diff;
  }
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {  // a fixed tree: the same sum every run
    if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial_sums[blockIdx.x] = sums[0];
}

template <typename G, typename P>
__global__ void adamw_kernel(AdamWHyper hyper, float correction1, float correction2,
                             const G* __restrict__ grad, float* __restrict__ master,
                             float* __restrict__ m, float* __restrict__ v, P* __restrict__ param,
                             std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float g = load(grad, i);
    const float m_i = hyper.beta1 * m[i] + (1.0f - hyper.beta1) * g;
    const float v_i = hyper.beta2 * v[i] + (1.0f - hyper.beta2) * g * g;
    m[i] = m_i;
    v[i] = v_i;
    const float update = (m_i / correction1) / (sqrtf(v_i / correction2) + hyper.eps);
    const float w = master[i] - hyper.lr * (update + hyper.weight_decay * master[i]);
    master[i] = w;
    store(param, i, w);
  }
}

template <typename Launch>
void by_dtype(DType dtype, const char* what, Launch&& launch) {
  if (dtype == DType::kBF16) return launch.template operator()<__nv_bfloat16>();
  if (dtype == DType::kFP32) return launch.template operator()<float>();
  fail(std::string(what) + ": dtype " + std::string(dtype_name(dtype)) + " must be bf16 or fp32");
}

void same_shape(const Tensor& a, const Tensor& b, const char* what) {
  if (a.dtype != b.dtype || a.numel() != b.numel())
    fail(std::string(what) + ": " + a.describe() + " and " + b.describe() + " differ");
}

}  // namespace

void add(const Tensor& a, const Tensor& b, const Tensor& out, cudaStream_t stream) {
  same_shape(a, b, "train::add");
  same_shape(a, out, "train::add");
  const std::int64_t n = a.numel();
  if (n == 0) return;
  by_dtype(a.dtype, "train::add", [&]<typename T>() {
    add_kernel<T>
        <<<blocks_for(n), kThreads, 0, stream>>>(a.as<const T>(), b.as<const T>(), out.as<T>(), n);
    MOE_CHECK_LAUNCH();
  });
}

int squared_error(const Tensor& pred, const Tensor& target, float scale, const Tensor& grad,
                  float* partial_sums, cudaStream_t stream) {
  same_shape(pred, target, "train::squared_error");
  same_shape(pred, grad, "train::squared_error");
  const std::int64_t n = pred.numel();
  const int blocks = static_cast<int>(std::min<std::int64_t>(blocks_for(n), kLossBlocks));
  by_dtype(pred.dtype, "train::squared_error", [&]<typename T>() {
    squared_error_kernel<T><<<blocks, kThreads, 0, stream>>>(
        pred.as<const T>(), target.as<const T>(), scale, grad.as<T>(), partial_sums, n);
    MOE_CHECK_LAUNCH();
  });
  return blocks;
}

void adamw_step(const AdamWHyper& hyper, const Tensor& grad, float* master, float* m, float* v,
                const Tensor& param, cudaStream_t stream) {
  if (grad.numel() != param.numel())
    fail("train::adamw_step: gradient " + grad.describe() + " for parameter " + param.describe());
  if (hyper.step < 1)
    fail("train::adamw_step: step = " + std::to_string(hyper.step) + " must be >= 1");
  const std::int64_t n = param.numel();
  if (n == 0) return;
  const float correction1 = 1.0f - std::pow(hyper.beta1, static_cast<float>(hyper.step));
  const float correction2 = 1.0f - std::pow(hyper.beta2, static_cast<float>(hyper.step));
  by_dtype(grad.dtype, "train::adamw_step gradient", [&]<typename G>() {
    by_dtype(param.dtype, "train::adamw_step parameter", [&]<typename P>() {
      adamw_kernel<G, P><<<blocks_for(n), kThreads, 0, stream>>>(
          hyper, correction1, correction2, grad.as<const G>(), master, m, v, param.as<P>(), n);
      MOE_CHECK_LAUNCH();
    });
  });
}

}  // namespace moe::train
