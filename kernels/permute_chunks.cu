// The EP receiver's chunk sort: rows ordered by (source rank, local expert), unpadded, moved to or
// from the padded expert-major layout.
#include <cstddef>
#include <cstdint>
#include <string>

#include "moe/error.h"
#include "permute.cuh"
#include "permute_device.cuh"
#include "permute_launch.h"
#include "vector_access.cuh"

namespace moe {

using namespace permute_detail;  // the code that the permute_*.cu files share

namespace {

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
    chunk_table_kernel(const std::int32_t* __restrict__ counts, int uniform_count, int sources,
                       int local_experts, int align, ChunkTable table) {
  extern __shared__ int scan[];  // [chunks] then [local_experts]
  __shared__ int totals[kScanThreads];
  const int chunks = sources * local_experts;
  int* padded = scan + chunks;
  auto count = [&](int c) { return counts != nullptr ? counts[c] : uniform_count; };
  for (int c = threadIdx.x; c < chunks; c += kScanThreads) scan[c] = count(c);
  for (int e = threadIdx.x; e < local_experts; e += kScanThreads) {
    int rows = 0;
    for (int s = 0; s < sources; ++s) rows += count(s * local_experts + e);
    table.group_counts[e] = rows;
    // Rounded up in 64 bits: rows near the int32 limit plus align - 1 would wrap; the host has
    // checked that the padded rows fit.
    padded[e] = align > 1
                    ? static_cast<int>((static_cast<long long>(rows) + align - 1) / align * align)
                    : rows;
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
      start += count(s * local_experts + e);
    }
  }
  if (threadIdx.x == 0) {
    table.source_start[chunks] = source_rows;
    table.group_offsets[local_experts] = expert_rows;
  }
}

// The source-major rows a copy moves: every row, or (several grid rows) those of local experts
// [first, end) from source blockIdx.y.
struct RowSpan {
  std::int64_t rows = 0;
  int local_experts = 0, first = 0, end = 0;
};

// One warp per source-major row: finds its chunk by binary search and copies the row to or from
// its expert-major place.
template <typename T, int kElems, bool kToExpertMajor>
__global__ void __launch_bounds__(kRowWarps* kWarpSize)
    chunk_copy_kernel(const T* __restrict__ from, T* __restrict__ to, RowSpan span, int hidden,
                      int chunks, const std::int32_t* __restrict__ source_start,
                      const std::int32_t* __restrict__ expert_start, Padding pad) {
  // The padding blocks (after the rows' blocks) zero it once, in the grid's first row.
  const bool padding_block =
      static_cast<int>(blockIdx.x) >= static_cast<int>(gridDim.x) - pad.groups;
  if (kToExpertMajor && padding_block && blockIdx.y > 0) return;
  if (kToExpertMajor && zero_padding_block<T, kElems>(pad, hidden, to)) return;
  using P = Pack<T, kElems>;
  const int lane = threadIdx.x % kWarpSize;
  std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpSize;
  std::int64_t end = span.rows;
  if (gridDim.y > 1 || span.end > 0) {  // source blockIdx.y's rows of the span's experts
    const int first_chunk = static_cast<int>(blockIdx.y) * span.local_experts;
    row += source_start[first_chunk + span.first];
    end = source_start[first_chunk + span.end];
  }
  if (row >= end) return;
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

template <bool kToExpertMajor>
void copy_chunks(const ChunkArgs& c, const Tensor& from, const Tensor& to,
                 const Tensor& source_major, const Tensor& expert_major, cudaStream_t stream) {
  if (c.sources < 1 || c.local_experts < 1 || c.uniform_count < 0 || c.workspace == nullptr) {
    fail("chunk sort: sources = " + std::to_string(c.sources) +
         ", local_experts = " + std::to_string(c.local_experts) +
         ", uniform_count = " + std::to_string(c.uniform_count) + "; a workspace is required");
  }
  check_activation(source_major, "chunk sort source-major rows");
  check_activation(expert_major, "chunk sort expert-major rows");
  if (c.counts == nullptr && c.uniform_count == 0 && source_major.dim(0) > 0)
    fail("chunk sort: no counts and uniform_count 0, but " + std::to_string(source_major.dim(0)) +
         " source-major rows");
  check_same_width(source_major, expert_major, "chunk sort");
  const int chunks = c.sources * c.local_experts;
  const ChunkTable table = chunk_table(c.workspace, c.sources, c.local_experts);
  const std::size_t shared = (static_cast<std::size_t>(chunks) + c.local_experts) * sizeof(int);
  if (shared > 48 * 1024)
    fail("chunk sort: " + std::to_string(chunks) +
         " chunks exceed the table kernel's shared memory");
  const bool part = c.end_expert > 0;
  if (part && (c.first_expert < 0 || c.first_expert >= c.end_expert ||
               c.end_expert > c.local_experts || c.widest_source < 0)) {
    fail("chunk sort: experts [" + std::to_string(c.first_expert) + ", " +
         std::to_string(c.end_expert) + ") of " + std::to_string(c.local_experts) +
         ", widest source " + std::to_string(c.widest_source));
  }
  chunk_table_kernel<<<1, kScanThreads, shared, stream>>>(c.counts, c.uniform_count, c.sources,
                                                          c.local_experts, c.align, table);
  MOE_CHECK_LAUNCH();
  const RowSpan span{source_major.dim(0), c.local_experts, part ? c.first_expert : 0,
                     part ? c.end_expert : 0};
  const int hidden = static_cast<int>(source_major.dim(1));
  // Sorting into the expert-major layout also zeroes its padding (of the span's experts); the
  // way back has none to write.
  const int first = span.first, experts = part ? c.end_expert - c.first_expert : c.local_experts;
  const Padding pad =
      kToExpertMajor ? Padding{table.group_offsets + first, table.group_counts + first, experts}
                     : Padding{};
  const unsigned grid = row_grid(part ? c.widest_source : span.rows, pad);
  if (grid == 0) return;
  const dim3 blocks(grid, part ? static_cast<unsigned>(c.sources) : 1u);
  dispatch_rows(source_major, {from.data, to.data}, [&]<typename T, int kElems>() {
    chunk_copy_kernel<T, kElems, kToExpertMajor><<<blocks, kRowWarps * kWarpSize, 0, stream>>>(
        from.as<const T>(), to.as<T>(), span, hidden, chunks, table.source_start,
        table.expert_start, pad);
    MOE_CHECK_LAUNCH();
  });
}

}  // namespace

std::size_t chunk_workspace_bytes(int sources, int local_experts) {
  const auto chunks = static_cast<std::size_t>(sources) * local_experts;
  return (2 * chunks + 2 * static_cast<std::size_t>(local_experts) + 2) * sizeof(std::int32_t);
}

void sort_chunks(const ChunkArgs& chunks, const Tensor& source_major, const Tensor& expert_major,
                 cudaStream_t stream) {
  copy_chunks<true>(chunks, source_major, expert_major, source_major, expert_major, stream);
}

void unsort_chunks(const ChunkArgs& chunks, const Tensor& expert_major, const Tensor& source_major,
                   cudaStream_t stream) {
  copy_chunks<false>(chunks, expert_major, source_major, source_major, expert_major, stream);
}

void zero_chunk_padding(const ChunkArgs& chunks, const Tensor& expert_major, cudaStream_t stream) {
  // A sort of no rows: the grid holds the padding blocks alone.
  ChunkArgs padding_only = chunks;
  if (padding_only.end_expert == 0) {
    padding_only.first_expert = 0;
    padding_only.end_expert = chunks.local_experts;
  }
  padding_only.widest_source = 0;
  const Tensor no_rows(expert_major.data, expert_major.dtype, {0, expert_major.dim(1)});
  copy_chunks<true>(padding_only, no_rows, expert_major, no_rows, expert_major, stream);
}

}  // namespace moe
