// The EP receiver's chunk sort: rows ordered by (source rank, local expert), unpadded, moved to or
// from the padded expert-major layout.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fp8_device.cuh"
#include "fp8_quantize.cuh"
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

// The source-major row of this warp (`row`, in the grid's span) and its expert-major place; false
// where the warp has no row.
__device__ __forceinline__ bool locate_row(const RowSpan& span, int chunks,
                                           const std::int32_t* __restrict__ source_start,
                                           const std::int32_t* __restrict__ expert_start,
                                           std::int64_t& row, std::int64_t& expert_row,
                                           int* chunk = nullptr) {
  row = static_cast<std::int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpSize;
  std::int64_t end = span.rows;
  if (gridDim.y > 1 || span.end > 0) {  // source blockIdx.y's rows of the span's experts
    const int first_chunk = static_cast<int>(blockIdx.y) * span.local_experts;
    row += source_start[first_chunk + span.first];
    end = source_start[first_chunk + span.end];
  }
  if (row >= end) return false;
  int lo = 0, hi = chunks;  // last chunk with source_start <= row (empty chunks share starts)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (source_start[mid] <= row)
      lo = mid;
    else
      hi = mid;
  }
  expert_row = expert_start[lo] + (row - source_start[lo]);
  if (chunk != nullptr) *chunk = lo;
  return true;
}

// The padding blocks (after the rows' blocks) zero it once, in the grid's first row; true in
// them.
template <typename T, int kElems>
__device__ __forceinline__ bool padding_done(const Padding& pad, int hidden, T* to) {
  const bool padding_block =
      static_cast<int>(blockIdx.x) >= static_cast<int>(gridDim.x) - pad.groups;
  if (padding_block && blockIdx.y > 0) return true;
  return zero_padding_block<T, kElems>(pad, hidden, to);
}

// One warp per source-major row: finds its chunk by binary search and copies the row to or from
// its expert-major place.
template <typename T, int kElems, bool kToExpertMajor>
__global__ void __launch_bounds__(kRowWarps* kWarpSize)
    chunk_copy_kernel(const T* __restrict__ from, T* __restrict__ to, RowSpan span, int hidden,
                      int chunks, const std::int32_t* __restrict__ source_start,
                      const std::int32_t* __restrict__ expert_start, Padding pad) {
  if (kToExpertMajor && padding_done<T, kElems>(pad, hidden, to)) return;
  using P = Pack<T, kElems>;
  const int lane = threadIdx.x % kWarpSize;
  std::int64_t row = 0, expert_row = 0;
  if (!locate_row(span, chunks, source_start, expert_start, row, expert_row)) return;
  const std::int64_t src_row = kToExpertMajor ? row : expert_row;
  const std::int64_t dst_row = kToExpertMajor ? expert_row : row;
  const P* src = reinterpret_cast<const P*>(from + src_row * hidden);
  P* dst = reinterpret_cast<P*>(to + dst_row * hidden);
  for (int u = lane; u < hidden / kElems; u += kWarpSize) dst[u] = src[u];
}

// Where the sort of records also leaves the rows' codes and scales for the FP8 experts: the codes
// [rows, hidden], and each local expert's scales where a product over its rows reads them
// (kernels/fp8_quantize.cuh, segments); group_offsets [E_loc + 1] are the chunk table's.
struct CodesOut {
  std::uint8_t* codes = nullptr;
  float* scales = nullptr;
  const std::int32_t* group_offsets = nullptr;
};

// The sort of rows that travelled as records: each lane decodes 8 codes of a row with their
// block's scale into 8 bf16 values of its expert-major place; with `out.codes`, it also stores the
// codes there unchanged, and the first lane of each 128-value block the block's scale (then
// hidden is a multiple of 128, and the padding rows' codes are zero and their scales 1).
__global__ void __launch_bounds__(kRowWarps* kWarpSize)
    chunk_decode_kernel(const std::uint8_t* __restrict__ records, __nv_bfloat16* __restrict__ to,
                        RowSpan span, int hidden, std::int64_t record_bytes, int chunks,
                        const std::int32_t* __restrict__ source_start,
                        const std::int32_t* __restrict__ expert_start, Padding pad, CodesOut out) {
  const bool padding_block =
      static_cast<int>(blockIdx.x) >= static_cast<int>(gridDim.x) - pad.groups;
  if (padding_block) {
    if (blockIdx.y == 0) {
      if (out.codes != nullptr)
        zero_fp8_padding_block(pad, hidden, to, out.codes, out.scales);
      else
        zero_padding_block<__nv_bfloat16, 8>(pad, hidden, to);
    }
    return;
  }
  const int lane = threadIdx.x % kWarpSize;
  std::int64_t row = 0, expert_row = 0;
  int chunk = 0;
  if (!locate_row(span, chunks, source_start, expert_start, row, expert_row, &chunk)) return;
  const std::uint8_t* record = records + row * record_bytes;
  const auto* scales = reinterpret_cast<const float*>(record + hidden);
  auto* dst = reinterpret_cast<uint4*>(to + expert_row * hidden);
  std::int64_t first = 0, group_rows = 0;
  if (out.codes != nullptr) {
    const int expert = chunk % span.local_experts;
    first = out.group_offsets[expert];
    group_rows = out.group_offsets[expert + 1] - first;
  }
  const int blocks_per_row = hidden / kFP8Block;
  for (int u = lane; u < hidden / 8; u += kWarpSize) {
    const uint2 codes = reinterpret_cast<const uint2*>(record)[u];
    const float scale = scales[u * 8 / kFP8Block];
    dst[u] = fp8_device::decode8(codes, scale);
    if (out.codes == nullptr) continue;
    reinterpret_cast<uint2*>(out.codes + expert_row * hidden)[u] = codes;
    if (u * 8 % kFP8Block == 0) {
      const std::int64_t block = u * 8 / kFP8Block;
      out.scales[first * blocks_per_row + block * group_rows + (expert_row - first)] = scale;
    }
  }
}

// With `records`, the source-major rows are fp8_dispatch's records, source_major only their shape
// (bf16 [rows, hidden]), decoded into expert_major.
template <bool kToExpertMajor>
void copy_chunks(const ChunkArgs& c, const Tensor& from, const Tensor& to,
                 const Tensor& source_major, const Tensor& expert_major, cudaStream_t stream,
                 const void* records = nullptr, const QuantizedRows& codes = {}) {
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
  if (records != nullptr) {
    const bool whole = hidden % 16 == 0 && expert_major.dtype == DType::kBF16 &&
                       reinterpret_cast<std::uintptr_t>(records) % 16 == 0 &&
                       reinterpret_cast<std::uintptr_t>(expert_major.data) % 16 == 0;
    if (!kToExpertMajor || !whole)
      fail(
          "chunk sort of records: bf16 rows of a multiple of 16 values, 16-byte aligned, into the "
          "expert-major layout; got " +
          expert_major.describe());
    const auto pointer = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
    if (codes.given() && (hidden % kFP8Block != 0 || pointer(codes.codes) % 16 != 0 ||
                          codes.scales == nullptr || pointer(codes.scales) % 4 != 0)) {
      fail("chunk sort of records into codes: rows of a multiple of " + std::to_string(kFP8Block) +
           " values (got " + std::to_string(hidden) +
           "), codes and scales 16- and 4-byte aligned device pointers");
    }
    const CodesOut out{codes.codes, codes.scales, table.group_offsets};
    chunk_decode_kernel<<<blocks, kRowWarps * kWarpSize, 0, stream>>>(
        static_cast<const std::uint8_t*>(records), expert_major.as<__nv_bfloat16>(), span, hidden,
        fp8_row_bytes(hidden), chunks, table.source_start, table.expert_start, pad, out);
    MOE_CHECK_LAUNCH();
    return;
  }
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

void sort_chunk_records(const ChunkArgs& chunks, const void* records, std::int64_t rows,
                        const Tensor& expert_major, cudaStream_t stream,
                        const QuantizedRows& codes) {
  const std::int64_t hidden = expert_major.rank() == 2 ? expert_major.dim(1) : 0;
  if (rows < 0 || hidden % 16 != 0 || expert_major.dtype != DType::kBF16)
    fail("chunk sort of records: rows = " + std::to_string(rows) +
         " must be >= 0, into bf16 rows "
         "of a multiple of 16 values; got " +
         expert_major.describe());
  if ((records == nullptr && rows > 0) || reinterpret_cast<std::uintptr_t>(records) % 16 != 0)
    fail("chunk sort of records: records = " +
         std::to_string(reinterpret_cast<std::uintptr_t>(records)) + " for " +
         std::to_string(rows) + " rows must be a 16-byte aligned device pointer");
  const Tensor shape(nullptr, DType::kBF16, {rows, expert_major.dim(1)});
  copy_chunks<true>(chunks, shape, expert_major, shape, expert_major, stream, records, codes);
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
