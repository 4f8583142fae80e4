#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "fp8_device.cuh"
#include "fp8_quantize.cuh"
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

// a = w · silu(gate) · up for one pack, rounded to T: the one expression of the forward, whether
// or not its output is quantized after.
template <typename T, int kElems>
__device__ __forceinline__ Pack<T, kElems> swiglu_values(const Pack<T, kElems>& gate,
                                                         const Pack<T, kElems>& up, float w) {
  Pack<T, kElems> out;
#pragma unroll
  for (int e = 0; e < kElems; ++e) {
    const float g = to_float(gate.v[e]);
    out.v[e] = from_float<T>(w * (g * sigmoid(g) * to_float(up.v[e])));
  }
  return out;
}

// The backward of one pack, with the row's weight w (1 unweighed): dh's two halves from w·dA,
// a = w·silu(gate)·up again for dw2, and the pack's share of Σ dA·silu·up, the weight's gradient.
template <typename T, int kElems>
struct BackwardPack {
  Pack<T, kElems> dgate, dup, act;
  float dot = 0.0f;
};

template <typename T, int kElems>
__device__ __forceinline__ BackwardPack<T, kElems> swiglu_backward_values(
    const Pack<T, kElems>& gate, const Pack<T, kElems>& up, const Pack<T, kElems>& grad, float w) {
  BackwardPack<T, kElems> out;
#pragma unroll
  for (int e = 0; e < kElems; ++e) {
    const float g = to_float(gate.v[e]);
    const float u = to_float(up.v[e]);
    const float s = sigmoid(g);
    const float silu = g * s;
    const float unweighed = silu * u;
    out.dot += to_float(grad.v[e]) * unweighed;
    const float d = w * to_float(grad.v[e]);
    out.dgate.v[e] = from_float<T>(d * u * s * (1.0f + g * (1.0f - s)));  // silu' = σ(1 + g(1 − σ))
    out.dup.v[e] = from_float<T>(d * silu);
    out.act.v[e] = from_float<T>(w * unweighed);
  }
  return out;
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
    *reinterpret_cast<P*>(a + r * ffn + c) = swiglu_values(gate, up, weight);
  }
}

// A pack's elements from p and back: one access where kVector (p aligned to the pack), else one
// element at a time. The pack, not the access, sets the order of a row's sums.
template <bool kVector, typename T, int kElems>
__device__ __forceinline__ Pack<T, kElems> load_pack(const T* p) {
  if constexpr (kVector) {
    return *reinterpret_cast<const Pack<T, kElems>*>(p);
  } else {
    Pack<T, kElems> out;
#pragma unroll
    for (int e = 0; e < kElems; ++e) out.v[e] = p[e];
    return out;
  }
}
template <bool kVector, typename T, int kElems>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, kElems>& values) {
  if constexpr (kVector) {
    *reinterpret_cast<Pack<T, kElems>*>(p) = values;
  } else {
#pragma unroll
    for (int e = 0; e < kElems; ++e) p[e] = values.v[e];
  }
}

// One pack of the SwiGLU backward at row r, columns [c, c + kElems), with the row's weight w;
// returns the pack's share of the weight's gradient. Reads every element before it writes dh and
// a, so they may be h and dA.
template <typename T, int kElems, bool kVector = true>
__device__ __forceinline__ float swiglu_backward_pack(const T* h, const T* dA, T* dh, T* a,
                                                      std::int64_t r, int ffn, int c, float w) {
  const auto out =
      swiglu_backward_values<T, kElems>(load_pack<kVector, T, kElems>(h + r * 2 * ffn + c),
                                        load_pack<kVector, T, kElems>(h + r * 2 * ffn + ffn + c),
                                        load_pack<kVector, T, kElems>(dA + r * ffn + c), w);
  store_pack<kVector>(dh + r * 2 * ffn + c, out.dgate);
  store_pack<kVector>(dh + r * 2 * ffn + ffn + c, out.dup);
  store_pack<kVector>(a + r * ffn + c, out.act);
  return out.dot;
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
template <typename T, int kElems, bool kVector>
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
      dot += swiglu_backward_pack<T, kElems, kVector>(h, dA, dh, a, r, ffn, i * kElems, w);
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) dscale[r] = dot;
  }
}

// ---- The FP8 variants: a warp a row, each half-warp a 128-column block of F at a time, so that
// lane L takes F's packs L, L + 32, ..., as the weighed backward above does (its row sums come out
// the same, bit for bit), and each of the output's row blocks lies in one half-warp's registers.
using Bf16Pack = Pack<__nv_bfloat16, fp8_device::kValuesPerLane>;

struct Fp8Output {
  std::uint8_t* codes;
  float* scales;
  fp8_device::SegmentedScales index;
};

// One lane's 8 values of a row block into codes (8 bytes at `codes`), the 16 lanes of the block
// together; the block's first lane stores its scale. Every lane of the warp calls it, `valid` or
// not (the block's largest value is found across lanes).
__device__ __forceinline__ void quantize_lane(const Bf16Pack& values, bool valid,
                                              std::uint8_t* codes, float* scale, bool first_lane) {
  float v[fp8_device::kValuesPerLane];
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < fp8_device::kValuesPerLane; ++e) {
    v[e] = valid ? to_float(values.v[e]) : 0.0f;
    amax = fmaxf(amax, fabsf(v[e]));
  }
  const int exponent = fp8_device::scale_exponent(fp8_device::row_block_max(amax));
  if (!valid) return;
  *reinterpret_cast<uint2*>(codes) = fp8_device::encode8(v, ldexpf(1.0f, -exponent));
  if (first_lane) *scale = ldexpf(1.0f, exponent);
}

struct RowLanes {
  int half;    // which of the warp's two blocks
  int column;  // the lane's first column within its block
  __device__ RowLanes()
      : half(static_cast<int>(threadIdx.x % kWarpSize) / fp8_device::kLanesPerRowBlock),
        column(static_cast<int>(threadIdx.x % fp8_device::kLanesPerRowBlock) *
               fp8_device::kValuesPerLane) {}
};

__global__ void __launch_bounds__(kRowWarps* kWarpSize)
    swiglu_forward_fp8_kernel(const __nv_bfloat16* __restrict__ h, __nv_bfloat16* __restrict__ a,
                              std::int64_t rows, int ffn, const float* __restrict__ scale,
                              Fp8Output out) {
  const RowLanes lanes;
  const int blocks = ffn / kFP8Block;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpSize;
       r < rows; r += static_cast<std::int64_t>(gridDim.x) * kRowWarps) {
    const float w = scale != nullptr ? scale[r] : 1.0f;
    const auto segment = out.index.locate(r);
    for (int pair = 0; pair < blocks; pair += 2) {
      const int b = pair + lanes.half;
      const bool valid = b < blocks;
      const std::int64_t c = static_cast<std::int64_t>(b) * kFP8Block + lanes.column;
      Bf16Pack values;
      float* block_scale = nullptr;
      if (valid) {
        values = swiglu_values(*reinterpret_cast<const Bf16Pack*>(h + r * 2 * ffn + c),
                               *reinterpret_cast<const Bf16Pack*>(h + r * 2 * ffn + ffn + c), w);
        *reinterpret_cast<Bf16Pack*>(a + r * ffn + c) = values;
        block_scale = out.scales + fp8_device::SegmentedScales::at(segment, r, b, blocks);
      }
      quantize_lane(values, valid, out.codes + r * ffn + c, block_scale, lanes.column == 0);
    }
  }
}

// In place as swiglu_weighed_backward_kernel: each lane reads its columns of h and dA before it
// writes them, and dscale may be scale.
template <bool kWeighed>
__global__ void __launch_bounds__(kRowWarps* kWarpSize)
    swiglu_backward_fp8_kernel(const __nv_bfloat16* h, const __nv_bfloat16* dA, __nv_bfloat16* dh,
                               __nv_bfloat16* a, std::int64_t rows, int ffn, const float* scale,
                               float* dscale, Fp8Output out) {
  const RowLanes lanes;
  const int blocks = ffn / kFP8Block;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpSize;
       r < rows; r += static_cast<std::int64_t>(gridDim.x) * kRowWarps) {
    const float w = kWeighed ? scale[r] : 1.0f;
    const auto segment = out.index.locate(r);
    float dot = 0.0f;
    for (int pair = 0; pair < blocks; pair += 2) {
      const int b = pair + lanes.half;
      const bool valid = b < blocks;
      const std::int64_t c = static_cast<std::int64_t>(b) * kFP8Block + lanes.column;
      BackwardPack<__nv_bfloat16, fp8_device::kValuesPerLane> values;
      float *gate_scale = nullptr, *up_scale = nullptr;
      if (valid) {
        values =
            swiglu_backward_values(*reinterpret_cast<const Bf16Pack*>(h + r * 2 * ffn + c),
                                   *reinterpret_cast<const Bf16Pack*>(h + r * 2 * ffn + ffn + c),
                                   *reinterpret_cast<const Bf16Pack*>(dA + r * ffn + c), w);
        *reinterpret_cast<Bf16Pack*>(dh + r * 2 * ffn + c) = values.dgate;
        *reinterpret_cast<Bf16Pack*>(dh + r * 2 * ffn + ffn + c) = values.dup;
        *reinterpret_cast<Bf16Pack*>(a + r * ffn + c) = values.act;
        dot += values.dot;
        gate_scale = out.scales + fp8_device::SegmentedScales::at(segment, r, b, 2 * blocks);
        up_scale = out.scales + fp8_device::SegmentedScales::at(segment, r, blocks + b, 2 * blocks);
      }
      std::uint8_t* codes = out.codes + r * 2 * ffn + c;
      quantize_lane(values.dgate, valid, codes, gate_scale, lanes.column == 0);
      quantize_lane(values.dup, valid, codes + ffn, up_scale, lanes.column == 0);
    }
    if constexpr (kWeighed) {
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
        dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      if (threadIdx.x % kWarpSize == 0) dscale[r] = dot;
    }
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

bool aligned16(std::initializer_list<const Tensor*> tensors) {
  return std::all_of(tensors.begin(), tensors.end(), [](const Tensor* t) {
    return reinterpret_cast<std::uintptr_t>(t->data) % 16 == 0;
  });
}

// 16-byte packs of kElems values where F allows them. launch<T, kElems, kVector>: kVector says
// whether a pack moves as one 16-byte access, which needs every tensor 16-byte aligned (every row
// then starts aligned too). Unaligned tensors move one element at a time: as packs moved element
// by element where kFixedPacks (the row sums, so that a row sums in the same order wherever its
// tensors lie), else as packs of one.
template <bool kFixedPacks, typename Launch>
void dispatch(DType dtype, int ffn, std::initializer_list<const Tensor*> tensors, Launch&& launch) {
  const bool aligned = aligned16(tensors);
  auto packs = [&]<typename T, int kPack>() {
    if (ffn % kPack != 0) return launch.template operator()<T, 1, true>();
    if (aligned) return launch.template operator()<T, kPack, true>();
    if constexpr (kFixedPacks) return launch.template operator()<T, kPack, false>();
    return launch.template operator()<T, 1, true>();
  };
  if (dtype == DType::kBF16) return packs.template operator()<__nv_bfloat16, 8>();
  if (dtype != DType::kFP32)
    fail("swiglu: dtype " + std::string(dtype_name(dtype)) + " must be bf16 or fp32");
  packs.template operator()<float, 4>();
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
  dispatch<false>(a.dtype, ffn, {&h, &a}, [&]<typename T, int kElems, bool>() {
    swiglu_forward_kernel<T, kElems><<<blocks_for(rows * ffn / kElems), 256, 0, stream>>>(
        h.as<const T>(), a.as<T>(), rows, ffn, weights);
    MOE_CHECK_LAUNCH();
  });
}

namespace {

// The backward's arguments, checked: its rows and F, and the row weights and their gradients
// (null without).
struct BackwardArgs {
  std::int64_t rows;
  int ffn;
  const float* weights;
  float* weight_grads;
};
BackwardArgs check_backward(const char* what, const Tensor& h, const Tensor& dA, const Tensor& dh,
                            const Tensor& a, const Tensor& scale, const Tensor& dscale) {
  const std::int64_t rows = h.dim(0);
  const int ffn = static_cast<int>(h.dim(1) / 2);
  check(h, rows, 2 * static_cast<std::int64_t>(ffn), a.dtype, "h");
  check(dA, rows, ffn, a.dtype, "dA");
  check(dh, rows, 2 * static_cast<std::int64_t>(ffn), a.dtype, "dh");
  check(a, rows, ffn, a.dtype, "a");
  const float* weights = optional_rows(scale, rows, "scale");
  const float* weight_grads = optional_rows(dscale, rows, "dscale");
  if (scale.shape.empty() != dscale.shape.empty())
    fail(std::string(what) + ": scale is " + scale.describe() + " and dscale " + dscale.describe() +
         "; give both or neither");
  return {rows, ffn, weights, const_cast<float*>(weight_grads)};
}

}  // namespace

void swiglu_backward(const Tensor& h, const Tensor& dA, const Tensor& dh, const Tensor& a,
                     cudaStream_t stream, const Tensor& scale, const Tensor& dscale) {
  const auto [rows, ffn, weights, weight_grads] =
      check_backward("swiglu_backward", h, dA, dh, a, scale, dscale);
  if (rows == 0) return;
  if (!scale.shape.empty()) {
    dispatch<true>(a.dtype, ffn, {&h, &dA, &dh, &a}, [&]<typename T, int kElems, bool kVector>() {
      const auto blocks = static_cast<unsigned>(
          std::min<std::int64_t>((rows + kRowWarps - 1) / kRowWarps, 132 * 16));
      swiglu_weighed_backward_kernel<T, kElems, kVector>
          <<<blocks, kRowWarps * kWarpSize, 0, stream>>>(h.as<const T>(), dA.as<const T>(),
                                                         dh.as<T>(), a.as<T>(), rows, ffn, weights,
                                                         weight_grads);
      MOE_CHECK_LAUNCH();
    });
    return;
  }
  dispatch<false>(a.dtype, ffn, {&h, &dA, &dh, &a}, [&]<typename T, int kElems, bool>() {
    swiglu_backward_kernel<T, kElems><<<blocks_for(rows * ffn / kElems), 256, 0, stream>>>(
        h.as<const T>(), dA.as<const T>(), dh.as<T>(), a.as<T>(), rows, ffn);
    MOE_CHECK_LAUNCH();
  });
}

namespace {

// What the FP8 variants check beside the SwiGLU's own arguments: the codes and scales, and offsets
// that cover the rows. Returns where the scales go.
fp8_device::SegmentedScales check_fp8_output(const char* what, const Fp8RowBlocks& out,
                                             std::int64_t rows, DType dtype) {
  const auto index = fp8_device::segmented_scales(out.offsets, what);
  if (out.offsets.back() != rows) {
    fail(std::string(what) + ": offsets end at " + std::to_string(out.offsets.back()) + ", h has " +
         std::to_string(rows) + " rows");
  }
  if (rows > 0 && (out.codes == nullptr || out.scales == nullptr))
    fail(std::string(what) + ": out.codes and out.scales must be device pointers");
  if (dtype != DType::kBF16) {
    fail(std::string(what) + ": a is " + std::string(dtype_name(dtype)) +
         "; FP8 quantizes bf16 rows");
  }
  return index;
}

// Whether one pass does it: each of F's 128-column blocks whole in a half-warp, every access of
// 16 bytes (8 for the codes) aligned.
bool one_pass(const Fp8RowBlocks& out, int ffn, std::initializer_list<const Tensor*> tensors) {
  return ffn % kFP8Block == 0 && reinterpret_cast<std::uintptr_t>(out.codes) % 8 == 0 &&
         aligned16(tensors);
}

unsigned row_warp_blocks(std::int64_t rows) {
  return static_cast<unsigned>(
      std::min<std::int64_t>((rows + kRowWarps - 1) / kRowWarps, 132 * 16));
}

}  // namespace

void swiglu_forward_fp8(const Tensor& h, const Tensor& a, const Fp8RowBlocks& out,
                        cudaStream_t stream, const Tensor& scale) {
  const char* what = "swiglu_forward_fp8";
  const std::int64_t rows = h.dim(0);
  const int ffn = static_cast<int>(h.dim(1) / 2);
  check(h, rows, 2 * static_cast<std::int64_t>(ffn), a.dtype, "h");
  check(a, rows, ffn, a.dtype, "a");
  const float* weights = optional_rows(scale, rows, "scale");
  const auto index = check_fp8_output(what, out, rows, a.dtype);
  if (!one_pass(out, ffn, {&h, &a})) {
    swiglu_forward(h, a, stream, scale);
    quantize_row_blocks_segmented(a.data, out.offsets, ffn, out.codes, out.scales, stream);
    return;
  }
  if (rows == 0) return;
  swiglu_forward_fp8_kernel<<<row_warp_blocks(rows), kRowWarps * kWarpSize, 0, stream>>>(
      h.as<const __nv_bfloat16>(), a.as<__nv_bfloat16>(), rows, ffn, weights,
      Fp8Output{out.codes, out.scales, index});
  MOE_CHECK_LAUNCH();
}

void swiglu_backward_fp8(const Tensor& h, const Tensor& dA, const Tensor& dh, const Tensor& a,
                         const Fp8RowBlocks& out, cudaStream_t stream, const Tensor& scale,
                         const Tensor& dscale) {
  const char* what = "swiglu_backward_fp8";
  const auto [rows, ffn, weights, weight_grads] = check_backward(what, h, dA, dh, a, scale, dscale);
  const auto index = check_fp8_output(what, out, rows, a.dtype);
  if (!one_pass(out, ffn, {&h, &dA, &dh, &a})) {
    swiglu_backward(h, dA, dh, a, stream, scale, dscale);
    quantize_row_blocks_segmented(dh.data, out.offsets, 2 * static_cast<std::int64_t>(ffn),
                                  out.codes, out.scales, stream);
    return;
  }
  if (rows == 0) return;
  const Fp8Output output{out.codes, out.scales, index};
  const unsigned blocks = row_warp_blocks(rows);
  if (weights != nullptr) {
    swiglu_backward_fp8_kernel<true><<<blocks, kRowWarps * kWarpSize, 0, stream>>>(
        h.as<const __nv_bfloat16>(), dA.as<const __nv_bfloat16>(), dh.as<__nv_bfloat16>(),
        a.as<__nv_bfloat16>(), rows, ffn, weights, weight_grads, output);
  } else {
    swiglu_backward_fp8_kernel<false><<<blocks, kRowWarps * kWarpSize, 0, stream>>>(
        h.as<const __nv_bfloat16>(), dA.as<const __nv_bfloat16>(), dh.as<__nv_bfloat16>(),
        a.as<__nv_bfloat16>(), rows, ffn, nullptr, nullptr, output);
  }
  MOE_CHECK_LAUNCH();
}

}  // namespace moe
