// Rows to and from the padded expert-major layout: the permute (dispatch), the weighted combine
// and its backward, over this rank's rows or, through the peer exchange, the EP group's.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "fp8_device.cuh"
#include "fp8_quantize.cuh"
#include "moe/error.h"
#include "moe/types.h"
#include "permute.cuh"
#include "permute_device.cuh"
#include "permute_launch.h"
#include "vector_access.cuh"

namespace moe {

using namespace permute_detail;  // the code that the permute_*.cu files share

namespace {

// A token's K slots, broadcast from lane k to every lane. kSlots (2, 4, 8 or 16, at least K)
// sizes the register arrays: a top-2 layer must not pay a top-16 layer's registers, which would
// halve the warps an SM holds.
template <int kSlots>
struct Probs {
  float p[kSlots];
};
template <int kSlots>
__device__ __forceinline__ Probs<kSlots> load_probs(const float* prob, std::int64_t t, int topk,
                                                    int lane) {
  const float mine = (lane < topk && prob != nullptr) ? prob[t * topk + lane] : 1.0f;
  Probs<kSlots> probs;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) probs.p[k] = __shfl_sync(kFullMask, mine, k);
  return probs;
}

// Where the row kernels find each slot's row; `load` gives a token's K positions, `at` a slot's
// row from its position and the kernel's buffer argument. kRemote: rows may be in other GPUs'
// memory, so each thread's stores there are fenced at system scope before it exits (the
// transfer's completion is then an ordinary collective on the stream behind the kernel).
//
// LocalRows: rows of the kernel's buffer by row_map; a slot whose row is -1 (dropped) has none.
struct LocalRows {
  static constexpr bool kRemote = false;
  const std::int32_t* row_map;  // [T, K]
  float* scalars = nullptr;     // [rows]: a float beside each row (the slot's probability)

  template <int kSlots>
  struct Slots {
    int row[kSlots];
    template <typename T>
    __device__ __forceinline__ T* at(T* base, int k, int hidden) const {
      return base + static_cast<std::int64_t>(row[k]) * hidden;
    }
    // Uniform over the warp: every lane holds every slot's row.
    __device__ __forceinline__ bool has(int k) const { return row[k] >= 0; }
  };
  template <int kSlots>
  __device__ __forceinline__ Slots<kSlots> load(std::int64_t t, int topk, int lane) const {
    const int mine = lane < topk ? row_map[t * topk + lane] : 0;
    Slots<kSlots> slots;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) slots.row[k] = __shfl_sync(kFullMask, mine, k);
    return slots;
  }
  // The float beside slot (t, lane)'s row (lane < topk); null for a slot without a row.
  __device__ __forceinline__ float* scalar_at(std::int64_t t, int topk, int lane) const {
    const int row = row_map[t * topk + lane];
    return row >= 0 ? scalars + row : nullptr;
  }
};

// PeerRows: each slot's row in the buffer of its expert's EP rank (a pointer per slot; the
// kernel's buffer argument is unused); a slot whose row is -1 (dropped) has none.
struct PeerRowsOnDevice {
  static constexpr bool kRemote = true;
  char* base[kMaxPeerRanks];
  int experts_per_rank;
  const std::int32_t* topk_idx;  // [T, K]
  const std::int32_t* rows;      // [T, K]
  std::int64_t row_bytes;
  float* scalars[kMaxPeerRanks];  // each rank's float per row, or null

  template <int kSlots>
  struct Slots {
    char* ptr[kSlots];
    template <typename T>
    __device__ __forceinline__ T* at(T*, int k, int) const {
      return reinterpret_cast<T*>(ptr[k]);
    }
    // Uniform over the warp: every lane holds every slot's pointer.
    __device__ __forceinline__ bool has(int k) const { return ptr[k] != nullptr; }
  };
  template <int kSlots>
  __device__ __forceinline__ Slots<kSlots> load(std::int64_t t, int topk, int lane) const {
    unsigned long long mine = 0;  // null: no row (a dropped slot, whose group names no rank)
    if (lane < topk) {
      const std::int64_t i = t * topk + lane;
      const std::int32_t row = rows[i];
      if (row >= 0)
        mine = reinterpret_cast<unsigned long long>(base[topk_idx[i] / experts_per_rank] +
                                                    static_cast<std::int64_t>(row) * row_bytes);
    }
    Slots<kSlots> slots;
#pragma unroll
    for (int k = 0; k < kSlots; ++k)
      slots.ptr[k] = reinterpret_cast<char*>(__shfl_sync(kFullMask, mine, k));
    return slots;
  }
  __device__ __forceinline__ float* scalar_at(std::int64_t t, int topk, int lane) const {
    const std::int64_t i = t * topk + lane;
    const std::int32_t row = rows[i];
    return row >= 0 ? scalars[topk_idx[i] / experts_per_rank] + row : nullptr;
  }
};

template <typename Rows>
__device__ __forceinline__ void fence_remote_stores() {
  if constexpr (Rows::kRemote) __threadfence_system();
}

// Columns of a row each lane handles per pass: with few slots, the loads of several columns go out
// before the first is used, to keep enough bytes in flight.
template <int kSlots>
constexpr int column_unroll() {
  return kSlots <= 2 ? 4 : (kSlots <= 4 ? 2 : 1);
}

template <typename T, int kElems, int kSlots, typename Rows>
__global__ void __launch_bounds__(kRowWarps* kWarpSize)
    permute_kernel(const T* __restrict__ x, Rows rows, int topk, std::int64_t tokens, int hidden,
                   T* __restrict__ out, Padding pad, const float* __restrict__ prob) {
  if (zero_padding_block<T, kElems>(pad, hidden, out)) return;
  using P = Pack<T, kElems>;
  constexpr int kUnroll = column_unroll<kSlots>();
  const int lane = threadIdx.x % kWarpSize;
  const std::int64_t t =
      static_cast<std::int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  const auto slots = rows.template load<kSlots>(t, topk, lane);
  if (prob != nullptr && lane < topk) {
    if (float* beside = rows.scalar_at(t, topk, lane)) *beside = prob[t * topk + lane];
  }
  const int units = hidden / kElems;
  const P* src = reinterpret_cast<const P*>(x + t * hidden);
  for (int base = lane; base < units; base += kWarpSize * kUnroll) {
    P value[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      if (base + i * kWarpSize < units) value[i] = src[base + i * kWarpSize];
    }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int u = base + i * kWarpSize;
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        if (k < topk && slots.has(k) && u < units)
          reinterpret_cast<P*>(slots.at(out, k, hidden))[u] = value[i];
      }
    }
  }
  fence_remote_stores<Rows>();
}

// dprob (may be null): dprob[t, k] = the float beside slot (t, k)'s row (the gradient of its
// probability, left there by experts that weighed their rows).
template <typename T, int kElems, int kSlots, typename Rows>
__global__ void __launch_bounds__(kRowWarps* kWarpSize)
    unpermute_combine_kernel(const T* __restrict__ y, Rows source, const float* __restrict__ prob,
                             int topk, std::int64_t tokens, int hidden, T* __restrict__ out,
                             float* __restrict__ dprob) {
  using P = Pack<T, kElems>;
  constexpr int kUnroll = column_unroll<kSlots>();
  const int lane = threadIdx.x % kWarpSize;
  const std::int64_t t =
      static_cast<std::int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  const auto slots = source.template load<kSlots>(t, topk, lane);
  const auto probs = load_probs<kSlots>(prob, t, topk, lane);
  if (dprob != nullptr && lane < topk) {
    const float* beside = source.scalar_at(t, topk, lane);
    dprob[t * topk + lane] = beside != nullptr ? *beside : 0.0f;
  }
  const int units = hidden / kElems;
  for (int base = lane; base < units; base += kWarpSize * kUnroll) {
    P rows[kUnroll][kSlots];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const int u = base + i * kWarpSize;
        if (k < topk && slots.has(k) && u < units)
          rows[i][k] = reinterpret_cast<const P*>(slots.at(y, k, hidden))[u];
      }
    }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int u = base + i * kWarpSize;
      if (u >= units) continue;
      float acc[kElems] = {};
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        if (k < topk && slots.has(k)) {
#pragma unroll
          for (int e = 0; e < kElems; ++e) acc[e] += probs.p[k] * to_float(rows[i][k].v[e]);
        }
      }
      P result;
#pragma unroll
      for (int e = 0; e < kElems; ++e) result.v[e] = from_float<T>(acc[e]);
      reinterpret_cast<P*>(out + t * hidden)[u] = result;
    }
  }
}

template <typename T, int kElems, int kSlots>
__global__ void __launch_bounds__(kRowWarps* kWarpSize)
    combine_backward_kernel(const T* __restrict__ dy, const T* y, LocalRows rows,
                            const float* __restrict__ prob, int topk, std::int64_t tokens,
                            int hidden, T* dY, float* __restrict__ dprob, Padding pad) {
  // y and dY may be one buffer: each lane writes a row's units only after it has read them, and
  // no other lane touches them (a row belongs to one (t, k); padding rows are never read).
  if (zero_padding_block<T, kElems>(pad, hidden, dY)) return;
  using P = Pack<T, kElems>;
  constexpr int kUnroll = column_unroll<kSlots>();
  const int lane = threadIdx.x % kWarpSize;
  const std::int64_t t =
      static_cast<std::int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  const auto slots = rows.template load<kSlots>(t, topk, lane);
  const auto probs = load_probs<kSlots>(prob, t, topk, lane);
  const int units = hidden / kElems;
  float dot[kSlots] = {};
  for (int base = lane; base < units; base += kWarpSize * kUnroll) {
    P g[kUnroll];
    P rows_in[kUnroll][kSlots];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int u = base + i * kWarpSize;
      if (u < units) g[i] = reinterpret_cast<const P*>(dy + t * hidden)[u];
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        if (k < topk && slots.has(k) && u < units)
          rows_in[i][k] = reinterpret_cast<const P*>(slots.at(y, k, hidden))[u];
      }
    }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int u = base + i * kWarpSize;
      if (u >= units) continue;
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        if (k < topk && slots.has(k)) {  // a dropped slot: no row, dprob 0
          P scaled;
#pragma unroll
          for (int e = 0; e < kElems; ++e) {
            const float ge = to_float(g[i].v[e]);
            dot[k] += ge * to_float(rows_in[i][k].v[e]);
            scaled.v[e] = from_float<T>(probs.p[k] * ge);
          }
          reinterpret_cast<P*>(slots.at(dY, k, hidden))[u] = scaled;
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    if (k < topk) {
      float v = dot[k];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
      if (lane == 0) dprob[t * topk + k] = v;
    }
  }
}

// The combine backward whose rows leave as fp8_dispatch's records: each lane holds 8 values of a
// slot's row, bf16(p · dy) as combine_backward stores them, and the 16 lanes of a 128-value block
// share its largest magnitude; codes and scale go into the slot's record. The warp walks the row
// in steps of 32 lanes together, so that every lane takes part in each block's shuffle.
template <int kSlots>
__global__ void __launch_bounds__(kRowWarps* kWarpSize)
    combine_backward_records_kernel(const __nv_bfloat16* __restrict__ dy,
                                    const __nv_bfloat16* __restrict__ y, LocalRows rows,
                                    const float* __restrict__ prob, int topk, std::int64_t tokens,
                                    int hidden, std::int64_t record_bytes,
                                    std::uint8_t* __restrict__ records, float* __restrict__ dprob,
                                    Padding pad) {
  if (zero_padding_block<float, 4>(pad, static_cast<int>(record_bytes / 4),
                                   reinterpret_cast<float*>(records)))
    return;
  using P = Pack<__nv_bfloat16, 8>;
  const int lane = threadIdx.x % kWarpSize;
  const std::int64_t t =
      static_cast<std::int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpSize;
  if (t >= tokens) return;
  const auto slots = rows.template load<kSlots>(t, topk, lane);
  const auto probs = load_probs<kSlots>(prob, t, topk, lane);
  const int units = hidden / 8;
  float dot[kSlots] = {};
  for (int base = 0; base < units; base += kWarpSize) {
    const int u = base + lane;
    const bool mine = u < units;
    P g{};
    if (mine) g = reinterpret_cast<const P*>(dy + t * hidden)[u];
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      if (k >= topk || !slots.has(k)) continue;  // uniform over the warp; no row: dprob 0
      float scaled[8];
      float amax = 0.0f;
      P row_in{};
      if (mine) row_in = reinterpret_cast<const P*>(slots.at(y, k, hidden))[u];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float ge = mine ? to_float(g.v[e]) : 0.0f;
        dot[k] += ge * (mine ? to_float(row_in.v[e]) : 0.0f);
        scaled[e] = __bfloat162float(__float2bfloat16_rn(probs.p[k] * ge));
        amax = fmaxf(amax, fabsf(scaled[e]));
      }
      for (int offset = 8; offset > 0; offset /= 2)  // the 16 lanes of one block
        amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
      if (!mine) continue;
      const int exponent = fp8_device::scale_exponent(amax);
      std::uint8_t* record = slots.at(records, k, static_cast<int>(record_bytes));
      reinterpret_cast<uint2*>(record)[u] = fp8_device::encode8(scaled, ldexpf(1.0f, -exponent));
      auto* tail = reinterpret_cast<float*>(record + hidden);
      if (lane % 16 == 0) tail[u / 16] = ldexpf(1.0f, exponent);
      if (u == 0) {  // the zero bytes after the scales
        const int blocks = (hidden + kFP8Block - 1) / kFP8Block;
        for (std::int64_t i = blocks; i < (record_bytes - hidden) / 4; ++i) tail[i] = 0.0f;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    if (k < topk) {
      float v = dot[k];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
      if (lane == 0) dprob[t * topk + k] = v;
    }
  }
}

// rows[i] = row_map[i] + shift[topk_idx[i]]: a slot's row on its expert's rank; -1 where the
// slot has no row (row_map -1: a dropped slot, whose group has no shift).
__global__ void peer_row_map_kernel(const std::int32_t* __restrict__ row_map,
                                    const std::int32_t* __restrict__ topk_idx,
                                    const std::int32_t* __restrict__ shift, std::int64_t slots,
                                    std::int32_t* __restrict__ rows) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < slots;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t row = row_map[i];
    rows[i] = row >= 0 ? row + shift[topk_idx[i]] : -1;
  }
}

// ---- Launch -------------------------------------------------------------------------------------

// The permute over local rows (LocalRows) or rows on the EP group's ranks (PeerRowsOnDevice):
// x's rows to their slots' places, `padded` taking the padding rows (and the local ones).
template <typename Rows>
void launch_permute(const Tensor& x, const Rows& rows, int topk, const Padding& pad,
                    const Tensor& padded, const float* prob, cudaStream_t stream) {
  const std::int64_t tokens = x.dim(0);
  const int hidden = static_cast<int>(x.dim(1));
  const unsigned grid = row_grid(tokens, pad);
  if (grid == 0) return;
  dispatch_rows(x, {x.data, padded.data}, [&]<typename T, int kElems>() {
    dispatch_slots(topk, [&]<int kSlots>() {
      permute_kernel<T, kElems, kSlots><<<grid, kRowWarps * kWarpSize, 0, stream>>>(
          x.as<const T>(), rows, topk, tokens, hidden, padded.as<T>(), pad, prob);
      MOE_CHECK_LAUNCH();
    });
  });
}

// The combine over local rows of y, or (y null) rows on the EP group's ranks.
template <typename Rows>
void launch_unpermute_combine(const Tensor* y, const Rows& rows, const float* prob, int topk,
                              const Tensor& out, float* dprob, cudaStream_t stream) {
  const std::int64_t tokens = out.dim(0);
  if (tokens == 0) return;
  const int hidden = static_cast<int>(out.dim(1));
  dispatch_rows(out, {y ? y->data : nullptr, out.data}, [&]<typename T, int kElems>() {
    dispatch_slots(topk, [&]<int kSlots>() {
      unpermute_combine_kernel<T, kElems, kSlots>
          <<<row_grid(tokens, Padding{}), kRowWarps * kWarpSize, 0, stream>>>(
              y ? y->as<const T>() : nullptr, rows, prob, topk, tokens, hidden, out.as<T>(), dprob);
      MOE_CHECK_LAUNCH();
    });
  });
}

}  // namespace

void permute_rows(const Tensor& x, const std::int32_t* row_map, int topk,
                  const std::int32_t* offsets, const std::int32_t* counts, int experts,
                  const Tensor& out, cudaStream_t stream, const float* prob, float* row_prob) {
  check_activation(x, "permute_rows x");
  check_activation(out, "permute_rows out");
  check_same_width(x, out, "permute_rows");
  check_topk(topk, "permute_rows");
  check_scalar_pair(prob, row_prob, "permute_rows", "prob", "row_prob");
  launch_permute(x, LocalRows{row_map, row_prob}, topk, Padding{offsets, counts, experts, row_prob},
                 out, prob, stream);
}

void unpermute_combine(const Tensor& y, const std::int32_t* row_map, const float* prob, int topk,
                       const Tensor& out, cudaStream_t stream, const float* row_grad,
                       float* dprob) {
  check_activation(y, "unpermute_combine y");
  check_activation(out, "unpermute_combine out");
  check_same_width(y, out, "unpermute_combine");
  check_topk(topk, "unpermute_combine");
  check_scalar_pair(row_grad, dprob, "unpermute_combine", "row_grad", "dprob");
  launch_unpermute_combine(&y, LocalRows{row_map, const_cast<float*>(row_grad)}, prob, topk, out,
                           dprob, stream);
}

void combine_backward(const Tensor& dy, const Tensor& y, const std::int32_t* row_map,
                      const float* prob, int topk, const std::int32_t* offsets,
                      const std::int32_t* counts, int experts, const Tensor& dY, float* dprob,
                      cudaStream_t stream) {
  check_activation(dy, "combine_backward dy");
  check_activation(y, "combine_backward y");
  check_activation(dY, "combine_backward dY");
  check_same_width(dy, y, "combine_backward");
  check_same_width(dy, dY, "combine_backward");
  check_topk(topk, "combine_backward");
  if (prob == nullptr || dprob == nullptr) fail("combine_backward: prob and dprob are required");
  const std::int64_t tokens = dy.dim(0);
  const int hidden = static_cast<int>(dy.dim(1));
  const Padding pad{offsets, counts, experts};
  const unsigned grid = row_grid(tokens, pad);
  if (grid == 0) return;
  dispatch_rows(dy, {dy.data, y.data, dY.data}, [&]<typename T, int kElems>() {
    dispatch_slots(topk, [&]<int kSlots>() {
      combine_backward_kernel<T, kElems, kSlots><<<grid, kRowWarps * kWarpSize, 0, stream>>>(
          dy.as<const T>(), y.as<const T>(), LocalRows{row_map}, prob, topk, tokens, hidden,
          dY.as<T>(), dprob, pad);
      MOE_CHECK_LAUNCH();
    });
  });
}

void combine_backward_records(const Tensor& dy, const Tensor& y, const std::int32_t* row_map,
                              const float* prob, int topk, const std::int32_t* offsets,
                              const std::int32_t* counts, int experts, void* records, float* dprob,
                              cudaStream_t stream) {
  check_activation(dy, "combine_backward_records dy");
  check_activation(y, "combine_backward_records y");
  check_same_width(dy, y, "combine_backward_records");
  check_topk(topk, "combine_backward_records");
  if (prob == nullptr || dprob == nullptr)
    fail("combine_backward_records: prob and dprob are required");
  const std::int64_t tokens = dy.dim(0);
  const int hidden = static_cast<int>(dy.dim(1));
  if (dy.dtype != DType::kBF16 || hidden % 16 != 0)
    fail("combine_backward_records: dy " + dy.describe() +
         " must be bf16 rows of a multiple of 16 values");
  for (const auto& [name, pointer] :
       {std::pair<const char*, const void*>{"dy", dy.data}, {"y", y.data}, {"records", records}}) {
    if (reinterpret_cast<std::uintptr_t>(pointer) % 16 != 0 || (pointer == nullptr && tokens > 0))
      fail(std::string("combine_backward_records: ") + name + " = " +
           std::to_string(reinterpret_cast<std::uintptr_t>(pointer)) +
           " must be a 16-byte aligned device pointer");
  }
  const Padding pad{offsets, counts, experts};
  const unsigned grid = row_grid(tokens, pad);
  if (grid == 0) return;
  dispatch_slots(topk, [&]<int kSlots>() {
    combine_backward_records_kernel<kSlots><<<grid, kRowWarps * kWarpSize, 0, stream>>>(
        dy.as<const __nv_bfloat16>(), y.as<const __nv_bfloat16>(), LocalRows{row_map}, prob, topk,
        tokens, hidden, fp8_row_bytes(hidden), static_cast<std::uint8_t*>(records), dprob, pad);
    MOE_CHECK_LAUNCH();
  });
}

// ---- Rows on the EP group's ranks (peer exchange) -----------------------------------------------

namespace {
// with_scalars: the kernel moves the floats beside the rows too, so every rank's must be mapped.
PeerRowsOnDevice on_device(const PeerRows& rows, std::int64_t row_bytes, bool with_scalars,
                           const char* what) {
  if (rows.ranks < 1 || rows.ranks > kMaxPeerRanks || rows.experts_per_rank < 1 ||
      rows.topk_idx == nullptr || rows.rows == nullptr) {
    fail(std::string(what) + ": ranks = " + std::to_string(rows.ranks) + " (1 to " +
         std::to_string(kMaxPeerRanks) + "), experts_per_rank = " +
         std::to_string(rows.experts_per_rank) + "; topk_idx and rows are required");
  }
  PeerRowsOnDevice d{};
  for (int r = 0; r < rows.ranks; ++r) {
    if (rows.base[r] == nullptr)
      fail(std::string(what) + ": rank " + std::to_string(r) + "'s buffer is null");
    d.base[r] = static_cast<char*>(rows.base[r]);
    if (with_scalars && rows.scalars[r] == nullptr)
      fail(std::string(what) + ": rank " + std::to_string(r) +
           "'s floats beside the rows are null");
    d.scalars[r] = static_cast<float*>(rows.scalars[r]);
  }
  d.experts_per_rank = rows.experts_per_rank;
  d.topk_idx = rows.topk_idx;
  d.rows = rows.rows;
  d.row_bytes = row_bytes;
  return d;
}
}  // namespace

void peer_row_map(const std::int32_t* row_map, const std::int32_t* topk_idx,
                  const std::int32_t* shift, std::int64_t slots, std::int32_t* rows,
                  cudaStream_t stream) {
  if (slots <= 0) return;
  const int threads = 256;
  const auto blocks =
      static_cast<unsigned>(std::min<std::int64_t>((slots + threads - 1) / threads, 4096));
  peer_row_map_kernel<<<blocks, threads, 0, stream>>>(row_map, topk_idx, shift, slots, rows);
  MOE_CHECK_LAUNCH();
}

void peer_permute(const Tensor& x, const PeerRows& out, int topk, const std::int32_t* own_offsets,
                  const std::int32_t* own_counts, int own_experts, const Tensor& own,
                  cudaStream_t stream, const float* prob, float* own_prob) {
  check_activation(x, "peer_permute x");
  check_activation(own, "peer_permute own rows");
  check_same_width(x, own, "peer_permute");
  check_topk(topk, "peer_permute");
  check_scalar_pair(prob, own_prob, "peer_permute", "prob", "own_prob");
  const PeerRowsOnDevice rows =
      on_device(out, x.dim(1) * static_cast<std::int64_t>(dtype_size(x.dtype)), prob != nullptr,
                "peer_permute");
  launch_permute(x, rows, topk, Padding{own_offsets, own_counts, own_experts, own_prob}, own, prob,
                 stream);
}

void peer_unpermute_combine(const PeerRows& y, const float* prob, int topk, const Tensor& out,
                            cudaStream_t stream, float* dprob) {
  check_activation(out, "peer_unpermute_combine out");
  check_topk(topk, "peer_unpermute_combine");
  if (out.dim(0) == 0) return;
  const PeerRowsOnDevice rows =
      on_device(y, out.dim(1) * static_cast<std::int64_t>(dtype_size(out.dtype)), dprob != nullptr,
                "peer_unpermute_combine");
  launch_unpermute_combine(nullptr, rows, prob, topk, out, dprob, stream);
}

}  // namespace moe
