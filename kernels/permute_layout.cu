// The padded expert-major layout from topk_idx: per-block histograms of the experts chosen, one
// block's scan of them into the counts, the group offsets and each layout block's base rows, then
// the row of every (t, k).
#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>

#include "moe/error.h"
#include "moe/types.h"
#include "permute.cuh"
#include "permute_device.cuh"
#include "permute_launch.h"

namespace moe {

using namespace permute_detail;  // the code that the permute_*.cu files share

namespace {

constexpr int kLayoutTokens = 128;  // tokens per block when building the layout

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
      if (e < experts && static_cast<int>(threadIdx.x % kWarpSize) == __ffs(same) - 1)
        atomicAdd(&counts[e], __popc(same));
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += kLayoutTokens) {
    histogram[static_cast<std::int64_t>(blockIdx.x) * experts + e] = counts[e];
  }
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
// independent and in flight together, their sums are scanned with shuffles, and every entry is
// read and written once more. (One thread walking a whole column, a dependent load per layout
// block, takes 38 µs at E = 8, T = 8192.)
__global__ void __launch_bounds__(kScanThreads)
    layout_scan_kernel(std::int32_t* histogram, int blocks, int experts, int align, int fixed_rows,
                       int fixed_groups, std::int32_t* counts, std::int32_t* offsets) {
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
        padded[e] = e < fixed_groups ? fixed_rows
                    : align > 1      ? (column_total + align - 1) / align * align
                                     : column_total;
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
// block that chose the same expert, read off a per-block bitmap [expert][token]; -1 for a slot
// that names group `experts` (a dropped slot, which has no row).
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
      if (e < experts && (same & (bit - 1)) == 0) atomicOr(&bitmap[e * kWords + word], same);
    }
  }
  __syncthreads();
  if (t >= tokens) return;
  for (int k = 0; k < topk; ++k) {
    const int e = topk_idx[t * topk + k];
    if (e >= experts) {  // a dropped slot: no row
      row_map[t * topk + k] = -1;
      continue;
    }
    const unsigned* bits = bitmap + e * kWords;
    int rank = __popc(bits[word] & (bit - 1));
    for (int w = 0; w < word; ++w) rank += __popc(bits[w]);
    row_map[t * topk + k] = base[static_cast<std::int64_t>(blockIdx.x) * experts + e] + rank;
  }
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
  // The scan sums the padded rows in int32: the slots plus the most padding any routing can
  // add (align - 1 rows per expert) must fit, not the slots alone.
  if (a.fixed_rows < 0 || a.fixed_groups < 0 || a.fixed_groups > a.experts ||
      (a.fixed_groups > 0 && a.fixed_rows == 0)) {
    fail("build_layout: fixed_rows = " + std::to_string(a.fixed_rows) + " over fixed_groups = " +
         std::to_string(a.fixed_groups) + " of " + std::to_string(a.experts) + " groups");
  }
  const std::int64_t padding = std::int64_t{a.experts} * std::max(a.align - 1, 0) +
                               std::int64_t{a.fixed_groups} * a.fixed_rows;
  if (a.tokens < 0 || a.tokens * a.topk + padding > INT_MAX) {
    fail("build_layout: tokens = " + std::to_string(a.tokens) +
         " with topk = " + std::to_string(a.topk) + " and up to " + std::to_string(padding) +
         " rows of padding exceed the int32 row index");
  }
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
  layout_scan_kernel<<<1, kScanThreads, 0, stream>>>(
      histogram, blocks, a.experts, a.align, a.fixed_rows, a.fixed_groups, a.counts, a.offsets);
  MOE_CHECK_LAUNCH();
  if (a.tokens > 0) {
    const std::size_t bitmap =
        static_cast<std::size_t>(a.experts) * (kLayoutTokens / 32) * sizeof(unsigned);
    layout_rank_kernel<<<blocks, kLayoutTokens, bitmap, stream>>>(a.topk_idx, a.tokens, a.topk,
                                                                  a.experts, histogram, a.row_map);
    MOE_CHECK_LAUNCH();
  }
}

}  // namespace moe
