// The permute whose rows also leave as E4M3 codes with their 1 × 128 scales, for the FP8 experts'
// first product (and, in the backward on one rank, dY's): a token's row is quantized once and
// stored to each of its slots' rows, so the experts need no quantizing pass over T · K rows.
#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "fp8_device.cuh"
#include "fp8_quantize.cuh"
#include "moe/error.h"
#include "permute.cuh"
#include "permute_device.cuh"
#include "permute_launch.h"

namespace moe {

using namespace permute_detail;

namespace {

constexpr int kLanesPerBlock = fp8_device::kLanesPerRowBlock;  // 16 lanes of 8 values a block

// Where each of a token's slots keeps its row: the row, and its group's first row and row count
// (where the group's scales start and their stride), broadcast from lane k to every lane.
template <int kSlots>
struct SlotGroups {
  int row[kSlots];
  int first[kSlots];
  int rows[kSlots];
};

template <int kSlots>
__device__ __forceinline__ SlotGroups<kSlots> load_slot_groups(const std::int32_t* row_map,
                                                               const std::int32_t* topk_idx,
                                                               const std::int32_t* offsets,
                                                               std::int64_t t, int topk, int lane) {
  int row = -1, first = 0, rows = 0;
  if (lane < topk) {
    row = row_map[t * topk + lane];
    if (row >= 0) {  // a dropped slot names a group past the layout's: its offsets are not read
      const int group = topk_idx[t * topk + lane];
      first = offsets[group];
      rows = offsets[group + 1] - first;
    }
  }
  SlotGroups<kSlots> s;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    s.row[k] = __shfl_sync(kFullMask, row, k);
    s.first[k] = __shfl_sync(kFullMask, first, k);
    s.rows[k] = __shfl_sync(kFullMask, rows, k);
  }
  return s;
}

// One warp a token: lane L holds 8 values of each 256-value stretch of the row, the 16 lanes of a
// 128-value block share its largest magnitude, and the codes and scale follow as
// quantize_row_blocks_segmented computes them, bit for bit. The warp walks the row 32 lanes at a
// time together, so that every lane takes part in each block's shuffle.
template <int kSlots>
__global__ void __launch_bounds__(kRowWarps* kWarpSize)
    permute_fp8_kernel(const __nv_bfloat16* __restrict__ x,
                       const std::int32_t* __restrict__ row_map,
                       const std::int32_t* __restrict__ topk_idx, int topk, std::int64_t tokens,
                       int hidden, __nv_bfloat16* __restrict__ out,
                       std::uint8_t* __restrict__ codes, float* __restrict__ scales, Padding pad,
                       const float* __restrict__ prob) {
  if (zero_fp8_padding_block(pad, hidden, out, codes, scales)) return;
  using P = Pack<__nv_bfloat16, 8>;
  const int lane = threadIdx.x % kWarpSize;
  const std::int64_t t =
      static_cast<std::int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  const auto slots = load_slot_groups<kSlots>(row_map, topk_idx, pad.offsets, t, topk, lane);
  if (prob != nullptr && lane < topk) {
    const int row = row_map[t * topk + lane];
    if (row >= 0) pad.scalars[row] = prob[t * topk + lane];
  }
  const int units = hidden / 8, blocks_per_row = hidden / kFP8Block;
  const P* src = reinterpret_cast<const P*>(x + t * hidden);
  for (int base = 0; base < units; base += kWarpSize) {
    const int u = base + lane;
    const bool mine = u < units;  // hidden is a multiple of 128: whole 16-lane blocks either way
    P value{};
    if (mine) value = src[u];
    float v[8];
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      v[e] = mine ? to_float(value.v[e]) : 0.0f;
      amax = fmaxf(amax, fabsf(v[e]));
    }
    const int exponent = fp8_device::scale_exponent(fp8_device::row_block_max(amax));
    if (!mine) continue;
    const uint2 packed = fp8_device::encode8(v, ldexpf(1.0f, -exponent));
    const float scale = ldexpf(1.0f, exponent);
    const int c = u / kLanesPerBlock;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      if (k >= topk || slots.row[k] < 0) continue;
      const std::int64_t row = slots.row[k];
      reinterpret_cast<P*>(out + row * hidden)[u] = value;
      reinterpret_cast<uint2*>(codes + row * hidden)[u] = packed;
      if (lane % kLanesPerBlock == 0) {
        const std::int64_t first = slots.first[k];
        scales[first * blocks_per_row + std::int64_t{c} * slots.rows[k] + (row - first)] = scale;
      }
    }
  }
}

}  // namespace

bool permute_rows_fp8_applies(const Tensor& x, const Tensor& out) {
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  return x.dtype == DType::kBF16 && out.dtype == DType::kBF16 && x.rank() == 2 && x.dim(1) > 0 &&
         x.dim(1) % kFP8Block == 0 && aligned(x.data) && aligned(out.data);
}

void permute_rows_fp8(const Tensor& x, const std::int32_t* row_map, const std::int32_t* topk_idx,
                      int topk, const std::int32_t* offsets, const std::int32_t* counts,
                      int experts, const Tensor& out, const QuantizedRows& quantized,
                      cudaStream_t stream, const float* prob, float* row_prob) {
  const char* what = "permute_rows_fp8";
  check_activation(x, "permute_rows_fp8 x");
  check_activation(out, "permute_rows_fp8 out");
  check_same_width(x, out, what);
  check_topk(topk, what);
  check_scalar_pair(prob, row_prob, what, "prob", "row_prob");
  if (!permute_rows_fp8_applies(x, out)) {
    fail(std::string(what) + ": x " + x.describe() + " and out " + out.describe() +
         " must be bf16 rows of a multiple of 128 values, 16-byte aligned");
  }
  const std::int64_t tokens = x.dim(0);
  const int hidden = static_cast<int>(x.dim(1));
  const Padding pad{offsets, counts, experts, row_prob};
  const unsigned grid = row_grid(tokens, pad);
  // Wherever a block runs (the padding blocks run at T = 0 too: fixed groups keep their rows).
  const auto pointer = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  if (pointer(quantized.codes) % 16 != 0 || pointer(quantized.scales) % 4 != 0 ||
      (grid > 0 && (quantized.codes == nullptr || quantized.scales == nullptr)) ||
      (tokens > 0 && topk_idx == nullptr)) {
    fail(std::string(what) +
         ": codes and scales must be 16- and 4-byte aligned device pointers "
         "and topk_idx given");
  }
  if (grid == 0) return;
  dispatch_slots(topk, [&]<int kSlots>() {
    permute_fp8_kernel<kSlots><<<grid, kRowWarps * kWarpSize, 0, stream>>>(
        x.as<const __nv_bfloat16>(), row_map, topk_idx, topk, tokens, hidden,
        out.as<__nv_bfloat16>(), quantized.codes, quantized.scales, pad, prob);
    MOE_CHECK_LAUNCH();
  });
}

}  // namespace moe
