#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "moe/error.h"
#include "swiglu.cuh"
#include "vector_access.cuh"

namespace moe {
namespace {

using device::from_float;
using device::Pack;
using device::to_float;

__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + __expf(-x));
}

// Grid-stride over (row, column pack) of the [rows, F] output.
template <typename T, int kElems>
__global__ void swiglu_forward_kernel(const T* __restrict__ h, T* __restrict__ a, std::int64_t rows,
                                      int ffn, const float* __restrict__ scale) {
  using P = Pack<T, kElems>;
  const int packs = ffn / kElems;
  const std::int64_t total = rows * packs;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / packs;
    const int c = static_cast<int>(i % packs) * kElems;
    const P gate = *reinterpret_cast<const P*>(h + r * 2 * ffn + c);
    const P up = *reinterpret_cast<const P*>(h + r * 2 * ffn + ffn + c);
    const float weight = scale != nullptr ? scale[r] : 1.0f;
    P out;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      const float g = to_float(gate.v[e]);
      out.v[e] = from_float<T>(weight * (g * sigmoid(g) * to_float(up.v[e])));
    }
    *reinterpret_cast<P*>(a + r * ffn + c) = out;
  }
}

// One pack of the SwiGLU backward at row r, columns [c, c + kElems), with the row's weight w (1
// unweighed): dh from w·dA, a = w·silu(gate)·up for dw2, and the pack's share of Σ dA·silu·up, the
// weight's gradient. Reads every element before it writes dh and a, so they may be h and dA.
template <typename T, int kElems>
__device__ __forceinline__ float swiglu_backward_pack(const T* h, const T* dA, T* dh, T* a,
                                                      std::int64_t r, int ffn, int c, float w) {
  using P = Pack<T, kElems>;
  const P gate = *reinterpret_cast<const P*>(h + r * 2 * ffn + c);
  const P up = *reinterpret_cast<const P*>(h + r * 2 * ffn + ffn + c);
  const P grad = *reinterpret_cast<const P*>(dA + r * ffn + c);
  P dgate, dup, act;
  float dot = 0.0f;
#pragma unroll
  for (int e = 0; e < kElems; ++e) {
    const float g = to_float(gate.v[e]);
    const float u = to_float(up.v[e]);
    const float s = sigmoid(g);
    const float silu = g * s;
    const float unweighed = silu * u;
    dot += to_float(grad.v[e]) * unweighed;
    const float d = w * to_float(grad.v[e]);
    dgate.v[e] = from_float<T>(d * u * s * (1.0f + g * (1.0f - s)));  // silu'(g) = σ(1 + g(1 − σ))
    dup.v[e] = from_float<T>(d * silu);
    act.v[e] = from_float<T>(w * unweighed);
  }
  *reinterpret_cast<P*>(dh + r * 2 * ffn + c) = dgate;
  *reinterpret_cast<P*>(dh + r * 2 * ffn + ffn + c) = dup;
  *reinterpret_cast<P*>(a + r * ffn + c) = act;
  return dot;
}

// In place allowed: dh may be h and a may be dA; no other thread touches a thread's elements.
template <typename T, int kElems>
__global__ void swiglu_backward_kernel(const T* h, const T* dA, T* dh, T* a, std::int64_t rows,
                                       int ffn) {
  const int packs = ffn / kElems;
  const std::int64_t total = rows * packs;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    (void)swiglu_backward_pack<T, kElems>(h, dA, dh, a, i / packs, ffn,
                                          static_cast<int>(i % packs) * kElems, 1.0f);
  }
}

constexpr int kWarpSize = 32;
constexpr int kRowWarps = 8;  // warps per block of the weighed backward: one row each

// The backward of the weighed SwiGLU, a warp per row: the row's weight w is read once, and its
// gradient Σ_f dA·act needs the whole row, summed across the warp in a fixed order (bitwise the
// same on every run). In place allowed as in swiglu_backward_kernel; dscale may be scale: every
// lane reads w before the warp's sum, after which lane 0 writes the gradient.
template <typename T, int kElems>
__global__ void __launch_bounds__(kRowWarps* kWarpSize)
    swiglu_weighed_backward_kernel(const T* h, const T* dA, T* dh, T* a, std::int64_t rows, int ffn,
                                   const float* scale, float* dscale) {
  const int packs = ffn / kElems;
  const int lane = threadIdx.x % kWarpSize;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpSize;
       r < rows; r += static_cast<std::int64_t>(gridDim.x) * kRowWarps) {
    const float w = scale[r];
    float dot = 0.0f;
    for (int i = lane; i < packs; i += kWarpSize)
      dot += swiglu_backward_pack<T, kElems>(h, dA, dh, a, r, ffn, i * kElems, w);
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) dscale[r] = dot;
  }
}

// An fp32 [rows] weight vector, or a tensor without shape (Tensor{}) for none.
const float* optional_rows(const Tensor& t, std::int64_t rows, const char* what) {
  if (t.shape.empty()) return nullptr;
  if (t.dtype != DType::kFP32 || t.rank() != 1 || t.dim(0) != rows ||
      (t.data == nullptr && rows > 0)) {
    fail(std::string("swiglu: ") + what + " is " + t.describe() + ", expected " +
         Tensor(nullptr, DType::kFP32, {rows}).describe());
  }
  return t.as<const float>();
}

void check(const Tensor& t, std::int64_t rows, std::int64_t cols, DType dtype, const char* what) {
  if (t.dtype != dtype || t.rank() != 2 || t.dim(0) != rows || t.dim(1) != cols) {
    fail(std::string("swiglu: ") + what + " is " + t.describe() + ", expected " +
         Tensor(nullptr, dtype, {rows, cols}).describe());
  }
}

// 16-byte packs when F allows them (every row then starts 16-byte aligned too).
template <typename Launch>
void dispatch(DType dtype, int ffn, Launch&& launch) {
  if (dtype == DType::kBF16) {
    if (ffn % 8 == 0) return launch.template operator()<__nv_bfloat16, 8>();
    return launch.template operator()<__nv_bfloat16, 1>();
  }
  if (dtype != DType::kFP32)
    fail("swiglu: dtype " + std::string(dtype_name(dtype)) + " must be bf16 or fp32");
  if (ffn % 4 == 0) return launch.template operator()<float, 4>();
  launch.template operator()<float, 1>();
}

unsigned blocks_for(std::int64_t work) {
  return static_cast<unsigned>(std::min<std::int64_t>((work + 255) / 256, 132 * 16));
}

}  // namespace

void swiglu_forward(const Tensor& h, const Tensor& a, cudaStream_t stream, const Tensor& scale) {
  const std::int64_t rows = h.dim(0);
  const int ffn = static_cast<int>(h.dim(1) / 2);
  check(h, rows, 2 * static_cast<std::int64_t>(ffn), a.dtype, "h");
  check(a, rows, ffn, a.dtype, "a");
  const float* weights = optional_rows(scale, rows, "scale");
  if (rows == 0) return;
  dispatch(a.dtype, ffn, [&]<typename T, int kElems>() {
    swiglu_forward_kernel<T, kElems><<<blocks_for(rows * ffn / kElems), 256, 0, stream>>>(
        h.as<const T>(), a.as<T>(), rows, ffn, weights);
    MOE_CHECK_LAUNCH();
  });
}

void swiglu_backward(const Tensor& h, const Tensor& dA, const Tensor& dh, const Tensor& a,
                     cudaStream_t stream, const Tensor& scale, const Tensor& dscale) {
  const std::int64_t rows = h.dim(0);
  const int ffn = static_cast<int>(h.dim(1) / 2);
  check(h, rows, 2 * static_cast<std::int64_t>(ffn), a.dtype, "h");
  check(dA, rows, ffn, a.dtype, "dA");
  check(dh, rows, 2 * static_cast<std::int64_t>(ffn), a.dtype, "dh");
  check(a, rows, ffn, a.dtype, "a");
  const float* weights = optional_rows(scale, rows, "scale");
  const float* weight_grads = optional_rows(dscale, rows, "dscale");
  if (scale.shape.empty() != dscale.shape.empty())
    fail("swiglu_backward: scale is " + scale.describe() + " and dscale " + dscale.describe() +
         "; give both or neither");
  if (rows == 0) return;
  if (!scale.shape.empty()) {
    dispatch(a.dtype, ffn, [&]<typename T, int kElems>() {
      const auto blocks = static_cast<unsigned>(
          std::min<std::int64_t>((rows + kRowWarps - 1) / kRowWarps, 132 * 16));
      swiglu_weighed_backward_kernel<T, kElems><<<blocks, kRowWarps * kWarpSize, 0, stream>>>(
          h.as<const T>(), dA.as<const T>(), dh.as<T>(), a.as<T>(), rows, ffn, weights,
          const_cast<float*>(weight_grads));
      MOE_CHECK_LAUNCH();
    });
    return;
  }
  dispatch(a.dtype, ffn, [&]<typename T, int kElems>() {
    swiglu_backward_kernel<T, kElems><<<blocks_for(rows * ffn / kElems), 256, 0, stream>>>(
        h.as<const T>(), dA.as<const T>(), dh.as<T>(), a.as<T>(), rows, ffn);
    MOE_CHECK_LAUNCH();
  });
}

}  // namespace moe
