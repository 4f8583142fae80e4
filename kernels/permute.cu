#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <string>

#include "moe/config.h"
#include "moe/error.h"
#include "permute.cuh"
#include "vector_access.cuh"

namespace moe {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kLayoutTokens = 128;  // tokens per block when building the layout
constexpr int kRowWarps = 4;        // warps per block of the row kernels: one token (or row) each
constexpr int kScanThreads = 1024;

// ---- Layout
// --------------------------------------------------------------------------------------

// Per-block histograms of the experts chosen by each block's tokens.
__global__ void __launch_bounds__(kLayoutTokens)
    layout_histogram_kernel(const std::int32_t* __restrict__ topk_idx, std::int64_t tokens,
                            int topk, int experts, std::int32_t* __restrict__ histogram) {
  extern __shared__ int counts[];
  for (int e = threadIdx.x; e < experts; e += kLayoutTokens) counts[e] = 0;
  __syncthreads();
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kLayoutTokens + threadIdx.x;
  // Lanes that chose the same expert add once, through their lowest lane: with few experts a
  // warp's 32 adds to one counter would otherwise be serialised.
  const unsigned valid = __ballot_sync(kFullMask, t < tokens);
  if (t < tokens) {
    for (int k = 0; k < topk; ++k) {
      const int e = topk_idx[t * topk + k];
      const unsigned same = __match_any_sync(valid, e);
      if (static_cast<int>(threadIdx.x % kWarpSize) == __ffs(same) - 1)
        atomicAdd(&counts[e], __popc(same));
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += kLayoutTokens) {
    histogram[static_cast<std::int64_t>(blockIdx.x) * experts + e] = counts[e];
  }
}

// Exclusive prefix sum of n values in shared memory by one block: each thread scans a segment,
// the segment totals are scanned Hillis-Steele style, then added back. Returns the total.
__device__ int block_exclusive_scan(int* values, int n, int* totals) {
  const int per_thread = (n + kScanThreads - 1) / kScanThreads;
  const int begin = min(n, static_cast<int>(threadIdx.x) * per_thread);
  const int end = min(n, begin + per_thread);
  int sum = 0;
  for (int i = begin; i < end; ++i) sum += values[i];
  totals[threadIdx.x] = sum;
  __syncthreads();
  for (int width = 1; width < kScanThreads; width *= 2) {
    const int add = threadIdx.x >= width ? totals[threadIdx.x - width] : 0;
    __syncthreads();
    totals[threadIdx.x] += add;
    __syncthreads();
  }
  int running = totals[threadIdx.x] - sum;  // exclusive prefix of this segment
  for (int i = begin; i < end; ++i) {
    const int v = values[i];
    values[i] = running;
    running += v;
  }
  const int total = totals[kScanThreads - 1];
  __syncthreads();
  return total;
}

// Lanes that share one expert's column of the histogram in the scan: a power of two from 1 (E ≥
// 1024) to a warp (E ≤ 32), so that the block's 1024 threads cover the columns at once.
__host__ __device__ constexpr int scan_column_lanes(int experts) {
  int lanes = kWarpSize;
  while (lanes > 1 && lanes * experts > kScanThreads) lanes /= 2;
  return lanes;
}

// Expert counts, padded group offsets, and each layout block's base row per expert (in place of
// its histogram): base[b][e] = offsets[e] + Σ_{b' < b} histogram[b'][e].
// Each column is split into segments over `lanes` lanes of one warp: the segments' loads are
// independent and issue together, their sums are scanned with shuffles, and every entry is read
// and written once more. (One thread walking a whole column, a dependent load per layout block,
// took 38 µs at E = 8, T = 8192: the session-9 stage timing.)
__global__ void __launch_bounds__(kScanThreads)
    layout_scan_kernel(std::int32_t* histogram, int blocks, int experts, int align,
                       std::int32_t* counts, std::int32_t* offsets) {
  constexpr int kChunk = 8;  // entries a lane loads before it writes them back
  __shared__ int padded[kMaxExperts];
  __shared__ int segment_base[kMaxExperts > kScanThreads ? kMaxExperts : kScanThreads];
  __shared__ int totals[kScanThreads];
  const int lanes = scan_column_lanes(experts);
  const int columns_per_pass = kScanThreads / lanes;
  const int part = static_cast<int>(threadIdx.x) % lanes;
  const int span = (blocks + lanes - 1) / lanes;
  const int first_block = min(blocks, part * span);
  const int end_block = min(blocks, first_block + span);

  // Pass 1: segment sums, scanned within each column; column totals give counts and padding.
  for (int first = 0; first < experts; first += columns_per_pass) {
    const int e = first + static_cast<int>(threadIdx.x) / lanes;
    int sum = 0;
    if (e < experts) {
#pragma unroll kChunk
      for (int b = first_block; b < end_block; ++b)
        sum += histogram[static_cast<std::int64_t>(b) * experts + e];
    }
    int inclusive = sum;
    for (int d = 1; d < lanes; d *= 2) {
      const int before = __shfl_up_sync(kFullMask, inclusive, d, lanes);
      if (part >= d) inclusive += before;
    }
    const int column_total = __shfl_sync(kFullMask, inclusive, lanes - 1, lanes);
    if (e < experts) {
      segment_base[first / columns_per_pass * kScanThreads + threadIdx.x] = inclusive - sum;
      if (part == 0) {
        counts[e] = column_total;
        padded[e] = align > 1 ? (column_total + align - 1) / align * align : column_total;
      }
    }
  }
  __syncthreads();
  const int total = block_exclusive_scan(padded, experts, totals);
  for (int e = threadIdx.x; e < experts; e += kScanThreads) offsets[e] = padded[e];
  if (threadIdx.x == 0) offsets[experts] = total;

  // Pass 2: each entry becomes its block's base row for the expert.
  for (int first = 0; first < experts; first += columns_per_pass) {
    const int e = first + static_cast<int>(threadIdx.x) / lanes;
    if (e >= experts) continue;
    int running = padded[e] + segment_base[first / columns_per_pass * kScanThreads + threadIdx.x];
    for (int b0 = first_block; b0 < end_block; b0 += kChunk) {
      int value[kChunk];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        value[i] =
            b0 + i < end_block ? histogram[static_cast<std::int64_t>(b0 + i) * experts + e] : 0;
      }
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        if (b0 + i < end_block)
          histogram[static_cast<std::int64_t>(b0 + i) * experts + e] = running;
        running += value[i];
      }
    }
  }
}

// Row of every (t, k): its block's base for the expert plus the number of earlier tokens of the
// block that chose the same expert, read off a per-block bitmap [expert][token].
__global__ void __launch_bounds__(kLayoutTokens)
    layout_rank_kernel(const std::int32_t* __restrict__ topk_idx, std::int64_t tokens, int topk,
                       int experts, const std::int32_t* __restrict__ base,
                       std::int32_t* __restrict__ row_map) {
  constexpr int kWords = kLayoutTokens / 32;
  extern __shared__ unsigned bitmap[];  // [experts][kWords]
  for (int i = threadIdx.x; i < experts * kWords; i += kLayoutTokens) bitmap[i] = 0;
  __syncthreads();
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kLayoutTokens + threadIdx.x;
  const int word = threadIdx.x / 32;
  const unsigned bit = 1u << (threadIdx.x % 32);
  // A word of the bitmap is one warp's lanes, so the lanes that chose the same expert are that
  // word's bits: their lowest lane sets them all at once.
  const unsigned valid = __ballot_sync(kFullMask, t < tokens);
  if (t < tokens) {
    for (int k = 0; k < topk; ++k) {
      const int e = topk_idx[t * topk + k];
      const unsigned same = __match_any_sync(valid, e);
      if ((same & (bit - 1)) == 0) atomicOr(&bitmap[e * kWords + word], same);
    }
  }
  __syncthreads();
  if (t >= tokens) return;
  for (int k = 0; k < topk; ++k) {
    const int e = topk_idx[t * topk + k];
    const unsigned* bits = bitmap + e * kWords;
    int rank = __popc(bits[word] & (bit - 1));
    for (int w = 0; w < word; ++w) rank += __popc(bits[w]);
    row_map[t * topk + k] = base[static_cast<std::int64_t>(blockIdx.x) * experts + e] + rank;
  }
}

// ---- Row movement ----------------------------------------------------------------------------

using device::from_float;
using device::Pack;
using device::to_float;

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
// LocalRows: rows of the kernel's buffer by row_map.
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
  };
  template <int kSlots>
  __device__ __forceinline__ Slots<kSlots> load(std::int64_t t, int topk, int lane) const {
    const int mine = lane < topk ? row_map[t * topk + lane] : 0;
    Slots<kSlots> slots;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) slots.row[k] = __shfl_sync(kFullMask, mine, k);
    return slots;
  }
  // The float beside slot (t, lane)'s row (lane < topk).
  __device__ __forceinline__ float* scalar_at(std::int64_t t, int topk, int lane) const {
    return scalars + row_map[t * topk + lane];
  }
};

// PeerRows: each slot's row in the buffer of its expert's EP rank (a pointer per slot; the
// kernel's buffer argument is unused).
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
  };
  template <int kSlots>
  __device__ __forceinline__ Slots<kSlots> load(std::int64_t t, int topk, int lane) const {
    unsigned long long mine = 0;
    if (lane < topk) {
      const std::int64_t i = t * topk + lane;
      mine = reinterpret_cast<unsigned long long>(base[topk_idx[i] / experts_per_rank] +
                                                  static_cast<std::int64_t>(rows[i]) * row_bytes);
    }
    Slots<kSlots> slots;
#pragma unroll
    for (int k = 0; k < kSlots; ++k)
      slots.ptr[k] = reinterpret_cast<char*>(__shfl_sync(kFullMask, mine, k));
    return slots;
  }
  __device__ __forceinline__ float* scalar_at(std::int64_t t, int topk, int lane) const {
    const std::int64_t i = t * topk + lane;
    return scalars[topk_idx[i] / experts_per_rank] + rows[i];
  }
};

template <typename Rows>
__device__ __forceinline__ void fence_remote_stores() {
  if constexpr (Rows::kRemote) __threadfence_system();
}

// Columns of a row each lane handles per step: with few slots, several columns' loads are issued
// before the first use so that enough bytes are in flight.
template <int kSlots>
constexpr int column_unroll() {
  return kSlots <= 2 ? 4 : (kSlots <= 4 ? 2 : 1);
}

// The alignment padding of an expert-major buffer: rows [offsets[g] + counts[g], offsets[g + 1])
// of every group g, zeroed by `groups` extra blocks at the end of a row kernel's grid (a separate
// launch cost more than the zeroing: 5-7 µs per stage at T = 8192, H = 2048).
struct Padding {
  const std::int32_t* offsets = nullptr;
  const std::int32_t* counts = nullptr;
  int groups = 0;
  float* scalars = nullptr;  // the floats beside the rows, zeroed with them (may be null)
};

// True in the grid's padding blocks, after zeroing this block's group.
template <typename T, int kElems>
__device__ __forceinline__ bool zero_padding_block(const Padding& pad, int hidden, T* out) {
  const int group = static_cast<int>(blockIdx.x) - static_cast<int>(gridDim.x - pad.groups);
  if (group < 0) return false;
  using P = Pack<T, kElems>;
  const int units = hidden / kElems;
  const std::int64_t begin = pad.offsets[group] + pad.counts[group];
  const std::int64_t total = (pad.offsets[group + 1] - begin) * units;
  P zero;
#pragma unroll
  for (int e = 0; e < kElems; ++e) zero.v[e] = from_float<T>(0.0f);
  P* rows = reinterpret_cast<P*>(out + begin * hidden);
  for (std::int64_t i = threadIdx.x; i < total; i += blockDim.x) rows[i] = zero;
  if (pad.scalars != nullptr) {
    for (std::int64_t r = begin + threadIdx.x; r < pad.offsets[group + 1]; r += blockDim.x)
      pad.scalars[r] = 0.0f;
  }
  return true;
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
  if (prob != nullptr && lane < topk) *rows.scalar_at(t, topk, lane) = prob[t * topk + lane];
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
        if (k < topk && u < units) reinterpret_cast<P*>(slots.at(out, k, hidden))[u] = value[i];
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
  if (dprob != nullptr && lane < topk) dprob[t * topk + lane] = *source.scalar_at(t, topk, lane);
  const int units = hidden / kElems;
  for (int base = lane; base < units; base += kWarpSize * kUnroll) {
    P rows[kUnroll][kSlots];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const int u = base + i * kWarpSize;
        if (k < topk && u < units)
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
        if (k < topk) {
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
        if (k < topk && u < units)
          rows_in[i][k] = reinterpret_cast<const P*>(slots.at(y, k, hidden))[u];
      }
    }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int u = base + i * kWarpSize;
      if (u >= units) continue;
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        if (k < topk) {
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

// rows[i] = row_map[i] + shift[topk_idx[i]]: a slot's row on its expert's rank.
__global__ void peer_row_map_kernel(const std::int32_t* __restrict__ row_map,
                                    const std::int32_t* __restrict__ topk_idx,
                                    const std::int32_t* __restrict__ shift, std::int64_t slots,
                                    std::int32_t* __restrict__ rows) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < slots;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    rows[i] = row_map[i] + shift[topk_idx[i]];
}

// ---- Chunk sort
// ----------------------------------------------------------------------------------

// Chunk table of the EP receiver: chunk c = s·E_loc + e starts at source_start[c] in the
// source-major rows and at expert_start[c] in the padded expert-major rows; group offsets and
// counts per expert.
struct ChunkTable {
  std::int32_t* source_start;   // [C + 1]
  std::int32_t* expert_start;   // [C]
  std::int32_t* group_offsets;  // [E_loc + 1]
  std::int32_t* group_counts;   // [E_loc]
};

ChunkTable chunk_table(void* workspace, int sources, int local_experts) {
  auto* base = static_cast<std::int32_t*>(workspace);
  const int chunks = sources * local_experts;
  return {base, base + chunks + 1, base + 2 * chunks + 1, base + 2 * chunks + local_experts + 2};
}

__global__ void __launch_bounds__(kScanThreads)
    chunk_table_kernel(const std::int32_t* __restrict__ counts, int sources, int local_experts,
                       int align, ChunkTable table) {
  extern __shared__ int scan[];  // [chunks] then [local_experts]
  __shared__ int totals[kScanThreads];
  const int chunks = sources * local_experts;
  int* padded = scan + chunks;
  for (int c = threadIdx.x; c < chunks; c += kScanThreads) scan[c] = counts[c];
  for (int e = threadIdx.x; e < local_experts; e += kScanThreads) {
    int rows = 0;
    for (int s = 0; s < sources; ++s) rows += counts[s * local_experts + e];
    table.group_counts[e] = rows;
    padded[e] = align > 1 ? (rows + align - 1) / align * align : rows;
  }
  __syncthreads();
  const int source_rows = block_exclusive_scan(scan, chunks, totals);
  const int expert_rows = block_exclusive_scan(padded, local_experts, totals);
  for (int c = threadIdx.x; c < chunks; c += kScanThreads) table.source_start[c] = scan[c];
  for (int e = threadIdx.x; e < local_experts; e += kScanThreads) {
    table.group_offsets[e] = padded[e];
    int start = padded[e];
    for (int s = 0; s < sources; ++s) {
      table.expert_start[s * local_experts + e] = start;
      start += counts[s * local_experts + e];
    }
  }
  if (threadIdx.x == 0) {
    table.source_start[chunks] = source_rows;
    table.group_offsets[local_experts] = expert_rows;
  }
}

// One warp per source-major row: finds its chunk by binary search and copies the row to or from
// its expert-major place.
template <typename T, int kElems, bool kToExpertMajor>
__global__ void __launch_bounds__(kRowWarps* kWarpSize)
    chunk_copy_kernel(const T* __restrict__ from, T* __restrict__ to, std::int64_t rows, int hidden,
                      int chunks, const std::int32_t* __restrict__ source_start,
                      const std::int32_t* __restrict__ expert_start, Padding pad) {
  if (kToExpertMajor && zero_padding_block<T, kElems>(pad, hidden, to)) return;
  using P = Pack<T, kElems>;
  const int lane = threadIdx.x % kWarpSize;
  const std::int64_t row =
      static_cast<std::int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  int lo = 0, hi = chunks;  // last chunk with source_start <= row (empty chunks share starts)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (source_start[mid] <= row)
      lo = mid;
    else
      hi = mid;
  }
  const std::int64_t expert_row = expert_start[lo] + (row - source_start[lo]);
  const std::int64_t src_row = kToExpertMajor ? row : expert_row;
  const std::int64_t dst_row = kToExpertMajor ? expert_row : row;
  const P* src = reinterpret_cast<const P*>(from + src_row * hidden);
  P* dst = reinterpret_cast<P*>(to + dst_row * hidden);
  for (int u = lane; u < hidden / kElems; u += kWarpSize) dst[u] = src[u];
}

// ---- Host side -------------------------------------------------------------------------------

void check_activation(const Tensor& t, const char* what) {
  if (t.dtype != DType::kBF16 && t.dtype != DType::kFP32) {
    fail(std::string(what) + ": dtype " + std::string(dtype_name(t.dtype)) +
         " must be bf16 or fp32");
  }
  if (t.rank() != 2) fail(std::string(what) + ": expected a [rows, H] matrix, got " + t.describe());
}

void check_same_width(const Tensor& a, const Tensor& b, const char* what) {
  if (a.dtype != b.dtype || a.dim(1) != b.dim(1)) {
    fail(std::string(what) + ": " + a.describe() + " and " + b.describe() +
         " differ in dtype or H");
  }
}

void check_topk(int topk, const char* what) {
  if (topk < 1 || topk > kMaxTopK) {
    fail(std::string(what) + ": topk = " + std::to_string(topk) + " must be in [1, " +
         std::to_string(kMaxTopK) + "]");
  }
}

// The floats that travel beside the rows come in pairs: a source and a destination, or neither.
void check_scalar_pair(const void* from, const void* to, const char* what, const char* from_name,
                       const char* to_name) {
  if ((from == nullptr) != (to == nullptr)) {
    fail(std::string(what) + ": " + from_name + " and " + to_name +
         " must be given together (got " + (from ? "" : "no ") + from_name + ", " +
         (to ? "" : "no ") + to_name + ")");
  }
}

// Calls launch.operator()<T, kElems>() with 16-byte packs when every row allows them.
template <typename Launch>
void dispatch_rows(const Tensor& reference, std::initializer_list<const void*> pointers,
                   Launch&& launch) {
  const auto hidden = reference.dim(1);
  const bool bf16 = reference.dtype == DType::kBF16;
  const std::size_t row_bytes = static_cast<std::size_t>(hidden) * dtype_size(reference.dtype);
  bool vector = row_bytes % 16 == 0;
  for (const void* p : pointers) vector = vector && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
  if (bf16) {
    if (vector) return launch.template operator()<__nv_bfloat16, 8>();
    return launch.template operator()<__nv_bfloat16, 1>();
  }
  if (vector) return launch.template operator()<float, 4>();
  launch.template operator()<float, 1>();
}

// Calls launch.operator()<kSlots>() with the smallest slot bucket that holds topk.
template <typename Launch>
void dispatch_slots(int topk, Launch&& launch) {
  if (topk <= 2) return launch.template operator()<2>();
  if (topk <= 4) return launch.template operator()<4>();
  if (topk <= 8) return launch.template operator()<8>();
  launch.template operator()<16>();
}

// Blocks of a row kernel over `rows` rows (one warp each) followed by the padding blocks.
unsigned row_grid(std::int64_t rows, const Padding& pad) {
  return static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps + pad.groups);
}

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

int layout_blocks(std::int64_t tokens) {
  return static_cast<int>(std::max<std::int64_t>(1, (tokens + kLayoutTokens - 1) / kLayoutTokens));
}

}  // namespace

std::size_t layout_workspace_bytes(std::int64_t tokens, int topk, int experts) {
  (void)topk;
  return static_cast<std::size_t>(layout_blocks(tokens)) * experts * sizeof(std::int32_t);
}

void build_layout(const LayoutArgs& a, cudaStream_t stream) {
  if (a.experts < 1 || a.experts > kMaxExperts) {
    fail("build_layout: experts = " + std::to_string(a.experts) + " must be in [1, " +
         std::to_string(kMaxExperts) + "]");
  }
  check_topk(a.topk, "build_layout");
  if (a.align < 0) fail("build_layout: align = " + std::to_string(a.align) + " must be >= 0");
  if (a.tokens < 0 || a.tokens * a.topk > INT_MAX)
    fail("build_layout: tokens = " + std::to_string(a.tokens) + " out of range");
  if (a.counts == nullptr || a.offsets == nullptr || a.workspace == nullptr ||
      (a.tokens > 0 && (a.topk_idx == nullptr || a.row_map == nullptr))) {
    fail("build_layout: topk_idx, counts, offsets, row_map and workspace are required");
  }
  const int blocks = layout_blocks(a.tokens);
  auto* histogram = static_cast<std::int32_t*>(a.workspace);
  if (a.tokens == 0)
    MOE_CHECK_CUDA(
        cudaMemsetAsync(histogram, 0, layout_workspace_bytes(0, a.topk, a.experts), stream));
  if (a.tokens > 0) {
    layout_histogram_kernel<<<blocks, kLayoutTokens, a.experts * sizeof(int), stream>>>(
        a.topk_idx, a.tokens, a.topk, a.experts, histogram);
    MOE_CHECK_LAUNCH();
  }
  layout_scan_kernel<<<1, kScanThreads, 0, stream>>>(histogram, blocks, a.experts, a.align,
                                                     a.counts, a.offsets);
  MOE_CHECK_LAUNCH();
  if (a.tokens > 0) {
    const std::size_t bitmap =
        static_cast<std::size_t>(a.experts) * (kLayoutTokens / 32) * sizeof(unsigned);
    layout_rank_kernel<<<blocks, kLayoutTokens, bitmap, stream>>>(a.topk_idx, a.tokens, a.topk,
                                                                  a.experts, histogram, a.row_map);
    MOE_CHECK_LAUNCH();
  }
}

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

std::size_t chunk_workspace_bytes(int sources, int local_experts) {
  const auto chunks = static_cast<std::size_t>(sources) * local_experts;
  return (2 * chunks + 2 * static_cast<std::size_t>(local_experts) + 2) * sizeof(std::int32_t);
}

namespace {
template <bool kToExpertMajor>
void copy_chunks(const ChunkArgs& c, const Tensor& from, const Tensor& to,
                 const Tensor& source_major, const Tensor& expert_major, cudaStream_t stream) {
  if (c.sources < 1 || c.local_experts < 1 || c.counts == nullptr || c.workspace == nullptr) {
    fail("chunk sort: sources = " + std::to_string(c.sources) + ", local_experts = " +
         std::to_string(c.local_experts) + "; counts and workspace are required");
  }
  check_activation(source_major, "chunk sort source-major rows");
  check_activation(expert_major, "chunk sort expert-major rows");
  check_same_width(source_major, expert_major, "chunk sort");
  const int chunks = c.sources * c.local_experts;
  const ChunkTable table = chunk_table(c.workspace, c.sources, c.local_experts);
  const std::size_t shared = (static_cast<std::size_t>(chunks) + c.local_experts) * sizeof(int);
  if (shared > 48 * 1024)
    fail("chunk sort: " + std::to_string(chunks) +
         " chunks exceed the table kernel's shared memory");
  chunk_table_kernel<<<1, kScanThreads, shared, stream>>>(c.counts, c.sources, c.local_experts,
                                                          c.align, table);
  MOE_CHECK_LAUNCH();
  const std::int64_t rows = source_major.dim(0);
  const int hidden = static_cast<int>(source_major.dim(1));
  // Sorting into the expert-major layout also zeroes its padding; the way back has none to write.
  const Padding pad = kToExpertMajor
                          ? Padding{table.group_offsets, table.group_counts, c.local_experts}
                          : Padding{};
  const unsigned grid = row_grid(rows, pad);
  if (grid == 0) return;
  dispatch_rows(source_major, {from.data, to.data}, [&]<typename T, int kElems>() {
    chunk_copy_kernel<T, kElems, kToExpertMajor><<<grid, kRowWarps * kWarpSize, 0, stream>>>(
        from.as<const T>(), to.as<T>(), rows, hidden, chunks, table.source_start,
        table.expert_start, pad);
    MOE_CHECK_LAUNCH();
  });
}
}  // namespace

void sort_chunks(const ChunkArgs& chunks, const Tensor& source_major, const Tensor& expert_major,
                 cudaStream_t stream) {
  copy_chunks<true>(chunks, source_major, expert_major, source_major, expert_major, stream);
}

void unsort_chunks(const ChunkArgs& chunks, const Tensor& expert_major, const Tensor& source_major,
                   cudaStream_t stream) {
  copy_chunks<false>(chunks, expert_major, source_major, source_major, expert_major, stream);
}

// ---- Rows on the EP group's ranks (peer exchange)
// -------------------------------------------------------

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
