#include "grouped_fp8_gemm.cuh"

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "core/driver_entry.h"
#include "moe/error.h"

// The tiles and their pipeline. A persistent block (one per SM) walks the tiles of C in steps of
// the grid. A group's rows are cut into tiles of 256 rows while more than 192 are left, then one
// of 128 and one of 64 as the rest needs: few rows of a tile go to waste however an expert's count
// falls, and the large tiles read fewer operand bytes a product (the products' feed from L2 bounds
// them). A 256- or 128-row tile spans 128 columns of C, a 64-row tile 256.
// The block's last warpgroup produces: one lane loads every tile's operands, 128 K-columns at a
// time (one scale block), through the tensor memory accelerator into a ring of stages, each stage's
// arrival counted on its "full" barrier. The first two warpgroups consume: each computes its half
// of the tile (its rows, or in a 64-row tile its 128 columns) in 64-row parts with m64n128k32
// warpgroup products on the stage, frees the stage on its "empty" barrier, and weighs each part's
// fp32 sums of the block by the block's two scales into the tile's accumulator (every block's sum
// is scaled once, in fp32). The loads of the next stages, and of the next tile while this one's
// results are stored, run beside the products; the two warpgroups drift apart, so one's products
// run while the other scales. Each warpgroup stores its results through shared memory, a 64-row
// part at a time, as whole rows: stored straight from the products' fragments, a warp's store
// touches 8 rows and fills half of each sector, and the stores held the products back.
// The tensor maps load rows past a group's end (the next group's, or zeros past the matrix) and
// columns past K as zeros: rows and columns past a tile's valid ones are never stored, and every
// row of C depends on its own row of A alone.

namespace moe {
namespace {

constexpr int kBlock = 128;    // K of a stage (one scale block), and N of a part's product
constexpr int kPartRows = 64;  // M of a warpgroup's product
constexpr int kStages = 4;
constexpr int kConsumerThreads = 256;
constexpr int kThreads = kConsumerThreads + 128;                        // + the producer warpgroup
[[maybe_unused]] constexpr int kConsumerWarps = kConsumerThreads / 32;  // the stub uses none
constexpr int kBoxBytes = kPartRows * kBlock;                           // one 64-row box of codes
// A stage holds a tile's A rows, then its B rows (columns of C): 256 + 128, 128 + 128 or 64 + 256.
constexpr int kStageBytes = 6 * kBoxBytes;
// Each consumer warpgroup's results leave through shared memory, a 64-row part of bf16 at a time.
constexpr int kStagingBytes = kPartRows * kBlock * 2;
// The stages, 1024-byte aligned for the 128-byte swizzle, then the barriers, then the two
// warpgroups' staging.
constexpr int kSharedBytes = 1024 + kStages * kStageBytes + 2 * kStages * 8 + 2 * kStagingBytes;
static_assert(kSharedBytes <= 227 * 1024, "an SM's shared memory holds the stages");

// How a group of `rows` rows is cut: `large` tiles of 256 rows, then `middle` (0 or 1) of 128 and
// `small` (0 or 1) of 64.
struct GroupCut {
  int large, middle, small;
};
__host__ __device__ constexpr GroupCut cut_rows(int rows) {
  const int rest = rows % 256;
  return {rows / 256 + (rest > 192 ? 1 : 0), rest > 64 && rest <= 192 ? 1 : 0,
          (rest > 0 && rest <= 64) || (rest > 128 && rest <= 192) ? 1 : 0};
}
// The group's tiles, given C's tiles of 128 and of 256 columns across N.
std::int64_t group_tiles(int rows, std::int64_t n_tiles128, std::int64_t n_tiles256) {
  const GroupCut cut = cut_rows(rows);
  return (cut.large + cut.middle) * n_tiles128 + cut.small * n_tiles256;
}

struct GroupedParams {
  CUtensorMap a_map;  // A as [Σ m_g, K] codes, 64 x 128 boxes, 128-byte swizzle
  CUtensorMap b_map;  // B as [groups · N, K] codes, the same boxes
  const float* a_scales;
  const float* b_scales;
  __nv_bfloat16* c;
  std::int64_t b_scale_stride;
  int n, groups, k_blocks, n_tiles128, n_tiles256, tile_scale_row, tiles;
  int first[kMaxGroupedGemmGroups];
  int rows[kMaxGroupedGemmGroups];
  int tile_start[kMaxGroupedGemmGroups + 1];
};
static_assert(sizeof(GroupedParams) <= 4096, "a launch's parameters hold at most 4 KiB");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOE_GROUPED_FP8_DEVICE 1
#endif

#ifdef MOE_GROUPED_FP8_DEVICE

__device__ __forceinline__ std::uint32_t shared_address(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void barrier_init(std::uint32_t barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(arrivals));
}

__device__ __forceinline__ void barrier_arrive(std::uint32_t barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}

// One arrival that also expects `bytes` from the tensor memory accelerator before the phase ends.
__device__ __forceinline__ void barrier_expect(std::uint32_t barrier, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes)
               : "memory");
}

// Returns once the barrier's phase of parity `parity` has ended.
__device__ __forceinline__ void barrier_wait(std::uint32_t barrier, std::uint32_t parity) {
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(barrier), "r"(parity)
        : "memory");
  } while (done == 0);
}

// A 128 x 128 box of `map` at (column, row) into shared memory, counted on `barrier`.
__device__ __forceinline__ void load_box(std::uint32_t to, const CUtensorMap& map, int column,
                                         int row, std::uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(to),
      "l"(reinterpret_cast<std::uint64_t>(&map)), "r"(column), "r"(row), "r"(barrier)
      : "memory");
}

// A shared-memory matrix descriptor: K-major rows of 128 bytes under the 128-byte swizzle, groups
// of 8 rows 1024 bytes apart.
__device__ __forceinline__ std::uint64_t descriptor(std::uint32_t address) {
  std::uint64_t d = (address & 0x3FFFF) >> 4;  // start address
  d |= std::uint64_t{1} << 16;                 // leading byte offset (unused here), 16 bytes
  d |= std::uint64_t{1024 >> 4} << 32;         // stride byte offset: 8 rows of 128 bytes
  d |= std::uint64_t{1} << 62;                 // 128-byte swizzle
  return d;
}

// Keeps the compiler from moving register reads and writes across the warpgroup's asynchronous
// products, which write those registers behind its back.
__device__ __forceinline__ void fence_registers(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (64 x 128, fp32 in registers) = A (64 x 32, E4M3, shared) · B (128 x 32, E4M3, shared)ᵀ,
// plus D where `accumulate` is non-zero. Both operands K-major, as FP8 requires.
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], std::uint64_t a, std::uint64_t b,
                                                 int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate));
}

// Where tile `tile` lies: its group (the last one starting at or before it; a group without rows
// starts where the next begins), its first row and column within the group, and its rows.
struct TilePlace {
  int group, m0, n0, rows;
};
__device__ __forceinline__ TilePlace place(const GroupedParams& p, int tile) {
  int lo = 0, hi = p.groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.tile_start[mid] <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  // Down a column of tiles first: the blocks at work at once share its columns of B, read from
  // memory once, and the group's rows of A stay in L2 from one column to the next.
  int local = tile - p.tile_start[lo];
  const GroupCut cut = cut_rows(p.rows[lo]);
  const int tall = cut.large + cut.middle;  // the tiles of 256 and 128 rows down a column
  if (local < tall * p.n_tiles128) {
    const int m = local % tall, n0 = local / tall * kBlock;
    return m < cut.large ? TilePlace{lo, m * 256, n0, 256} : TilePlace{lo, m * 256, n0, 128};
  }
  local -= tall * p.n_tiles128;
  return {lo, cut.large * 256 + cut.middle * 128, local * 2 * kBlock, 64};
}

// A tile's rows of A in a stage, then its rows of B: 64-row boxes, 1024-byte aligned.
__device__ __forceinline__ int a_boxes(int tile_rows) {
  return tile_rows / kPartRows;
}
__device__ __forceinline__ int b_boxes(int tile_rows) {
  return tile_rows == 64 ? 4 : 2;
}

__device__ void produce(const GroupedParams& p, std::uint32_t stages, std::uint32_t full,
                        std::uint32_t empty) {
  std::uint32_t step = 0;  // stages filled so far, over every tile
  for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    const TilePlace at = place(p, tile);
    const int a_row = p.first[at.group] + at.m0, b_row = at.group * p.n + at.n0;
    const int na = a_boxes(at.rows), nb = b_boxes(at.rows);
    for (int kb = 0; kb < p.k_blocks; ++kb, ++step) {
      const std::uint32_t s = step % kStages;
      // The consumers' last reading of this stage is over: its previous filling's phase.
      if (step >= kStages) barrier_wait(empty + 8 * s, (step / kStages - 1) & 1);
      barrier_expect(full + 8 * s, (na + nb) * kBoxBytes);
      const std::uint32_t stage = stages + s * kStageBytes;
      for (int i = 0; i < na; ++i)
        load_box(stage + i * kBoxBytes, p.a_map, kb * kBlock, a_row + i * kPartRows, full + 8 * s);
      for (int i = 0; i < nb; ++i)
        load_box(stage + (na + i) * kBoxBytes, p.b_map, kb * kBlock, b_row + i * kPartRows,
                 full + 8 * s);
    }
  }
}

// The consumer warpgroup's 128 threads meet (named barriers 1 and 2; 0 is __syncthreads').
__device__ __forceinline__ void warpgroup_sync(int warpgroup) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + warpgroup) : "memory");
}

__device__ void consume(const GroupedParams& p, std::uint32_t stages, std::uint32_t full,
                        std::uint32_t empty, std::uint8_t* staging) {
  const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  // This thread's two rows of a part, and its columns 8j + 2(lane mod 4) + {0, 1}.
  const int row0 = warp * 16 + lane / 4, row1 = row0 + 8;
  float acc[2][64], part[64];
  std::uint32_t step = 0;  // stages consumed so far, over every tile
  for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    const TilePlace at = place(p, tile);
    const int group_rows = p.rows[at.group];
    // This warpgroup's parts: two of 64 rows in a 256-row tile, else one; in a 64-row tile it
    // takes 128 columns, elsewhere its rows.
    const int parts = at.rows == 256 ? 2 : 1;
    const int m0 = at.m0 + (at.rows == 64 ? 0 : warpgroup * parts * kPartRows);
    const int n0 = at.n0 + (at.rows == 64 ? warpgroup * kBlock : 0);
    const int a_offset = (at.rows == 64 ? 0 : warpgroup * parts) * kBoxBytes;
    const int b_offset = (a_boxes(at.rows) + (at.rows == 64 ? 2 * warpgroup : 0)) * kBoxBytes;
    const int valid_n = min(kBlock, p.n - n0);
    const float* a_scales =
        p.a_scales + static_cast<std::int64_t>(p.first[at.group]) * p.k_blocks + m0;
    const float* b_scales = p.b_scales + at.group * p.b_scale_stride +
                            static_cast<std::int64_t>(n0 / kBlock) * p.tile_scale_row;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
    for (int kb = 0; kb < p.k_blocks; ++kb, ++step) {
      // The block's scales, loaded while the stage arrives; none past N or the group's rows.
      const float b_scale = valid_n > 0 ? b_scales[kb] : 0.0f;
      const std::int64_t scale_row = static_cast<std::int64_t>(kb) * group_rows;
      float scale[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r0 = m0 + h * kPartRows + row0, r1 = r0 + 8;
        scale[h][0] = h < parts && r0 < group_rows ? a_scales[scale_row + r0 - m0] * b_scale : 0.0f;
        scale[h][1] = h < parts && r1 < group_rows ? a_scales[scale_row + r1 - m0] * b_scale : 0.0f;
      }
      const std::uint32_t s = step % kStages;
      barrier_wait(full + 8 * s, (step / kStages) & 1);
      const std::uint32_t b_rows = stages + s * kStageBytes + b_offset;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (h >= parts) break;
        const std::uint32_t a_rows = stages + s * kStageBytes + a_offset + h * kBoxBytes;
        fence_registers(part);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int k = 0; k < kBlock / 32; ++k)
          wgmma_m64n128k32(part, descriptor(a_rows + k * 32), descriptor(b_rows + k * 32), k);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_registers(part);
        // This warp is done reading the stage once its last part's products are.
        if (h + 1 == parts) {
          __syncwarp();
          if (lane == 0) barrier_arrive(empty + 8 * s);
        }
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          acc[h][4 * j + 0] += part[4 * j + 0] * scale[h][0];
          acc[h][4 * j + 1] += part[4 * j + 1] * scale[h][0];
          acc[h][4 * j + 2] += part[4 * j + 2] * scale[h][1];
          acc[h][4 * j + 3] += part[4 * j + 3] * scale[h][1];
        }
      }
    }
    __nv_bfloat16* c = p.c + static_cast<std::int64_t>(p.first[at.group] + m0) * p.n + n0;
    // Through shared memory: the part's fragments into its 64 rows of 256 bytes, each row's
    // 16-byte chunks XOR-swizzled by the row (the fragments' writes, 8 rows of a warp, and the
    // rows' reads, 8 chunks of a row, each meet 32 distinct banks), then whole rows out, 16
    // bytes a lane, so that every store fills its sectors.
    const int t = threadIdx.x % 128;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h >= parts) break;
      const int valid_m = min(kPartRows, group_rows - m0 - h * kPartRows);
      __nv_bfloat16* rows = c + static_cast<std::int64_t>(h * kPartRows) * p.n;
      warpgroup_sync(warpgroup);  // the last part's rows have left
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int byte = ((j ^ (row0 % 8)) * 16) + 4 * (lane % 4);
        *reinterpret_cast<__nv_bfloat162*>(staging + row0 * 256 + byte) =
            __floats2bfloat162_rn(acc[h][4 * j + 0], acc[h][4 * j + 1]);
        *reinterpret_cast<__nv_bfloat162*>(staging + row1 * 256 + byte) =
            __floats2bfloat162_rn(acc[h][4 * j + 2], acc[h][4 * j + 3]);
      }
      warpgroup_sync(warpgroup);
#pragma unroll
      for (int i = 0; i < kPartRows * 16 / 128; ++i) {
        const int row = i * 8 + t / 16, chunk = t % 16;
        if (row >= valid_m || chunk * 8 >= valid_n) continue;
        const uint4 v =
            *reinterpret_cast<const uint4*>(staging + row * 256 + ((chunk ^ (row % 8)) * 16));
        *reinterpret_cast<uint4*>(rows + static_cast<std::int64_t>(row) * p.n + chunk * 8) = v;
      }
    }
  }
}

// A consumer holds two parts' accumulators and a part's sums (192 registers): the producer
// warpgroup gives up registers for the consumers to take, three warps of each quarter of the SM
// sharing its 16384 (40 + 2 · 232, times 32 lanes).
__global__ void __launch_bounds__(kThreads, 1)
    grouped_fp8_gemm_kernel(const __grid_constant__ GroupedParams p) {
  extern __shared__ std::uint8_t shared_raw[];
  const std::uint32_t stages = (shared_address(shared_raw) + 1023) & ~1023u;
  const std::uint32_t full = stages + kStages * kStageBytes, empty = full + 8 * kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(full + 8 * s, 1);
      barrier_init(empty + 8 * s, kConsumerWarps);
    }
    // The barriers' initialization, seen by the tensor memory accelerator's arrivals.
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= kConsumerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x == kConsumerThreads) produce(p, stages, full, empty);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const std::uint32_t staging = empty + 8 * kStages + (threadIdx.x / 128) * kStagingBytes;
    consume(p, stages, full, empty, shared_raw + (staging - shared_address(shared_raw)));
  }
}

#else  // built without sm_90a's warpgroup instructions: a launch traps rather than write nothing

__global__ void grouped_fp8_gemm_kernel(const __grid_constant__ GroupedParams) {
  __trap();
}

#endif

// The driver's tensor-map encoder (core/driver_entry.h), or null where the driver lacks it.
using EncodeTiled = CUresult(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                             const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                             const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                             CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled* encode_tiled() {
  static EncodeTiled* const call = [] {
    EncodeTiled* found = nullptr;
    return find_driver_call("cuTensorMapEncodeTiled", found) ? found : nullptr;
  }();
  return call;
}

// A row-major [rows, k] matrix of codes, loaded in 64 x 128 boxes under the 128-byte swizzle
// that the products' descriptors name; outside the matrix a box holds zeros.
CUtensorMap box_map(const std::uint8_t* matrix, std::int64_t rows, std::int64_t k,
                    const char* operand) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k)};
  const cuuint32_t box[2] = {kBlock, kPartRows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult status = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<std::uint8_t*>(matrix), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS)
    fail(std::string("grouped_fp8_gemm: cuTensorMapEncodeTiled failed (") +
         std::to_string(static_cast<int>(status)) + ") for " + operand + " as [" +
         std::to_string(rows) + ", " + std::to_string(k) + "] codes");
  return map;
}

}  // namespace

bool grouped_fp8_gemm_supported(int device) {
  int major = 0, minor = 0;
  MOE_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOE_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
#ifdef MOE_GROUPED_FP8_BUILT
  return major == 9 && minor == 0 && encode_tiled() != nullptr;
#else
  return false;  // built without sm_90a: the kernel is a stub that traps
#endif
}

void grouped_fp8_gemm(std::span<const std::int64_t> offsets, std::int64_t n, std::int64_t k,
                      const GroupedFp8Operands& operands, cudaStream_t stream) {
  const std::string what = "grouped_fp8_gemm";
  if (offsets.size() < 2 || offsets.size() > kMaxGroupedGemmGroups + 1)
    fail(what + ": " + std::to_string(offsets.size()) + " offsets; it takes 1 to " +
         std::to_string(kMaxGroupedGemmGroups) + " groups, one offset more");
  if (n <= 0 || n % 16 != 0 || n > 0x7fffffff || k <= 0 || k % 16 != 0 || k > 0x7fffffff)
    fail(what + ": n = " + std::to_string(n) + " and k = " + std::to_string(k) +
         " must be positive multiples of 16 below 2^31");
  // The loads' row coordinates are 32-bit and reach up to 256 rows past a tile's first.
  constexpr std::int64_t kRowLimit = 0x7fffffff - 256;
  const auto groups = static_cast<std::int64_t>(offsets.size()) - 1;
  if (groups * n > kRowLimit)
    fail(what + ": " + std::to_string(groups) + " groups of n = " + std::to_string(n) +
         " rows of b exceed 2^31 - 257");
  const std::int64_t k_blocks = (k + kBlock - 1) / kBlock;
  const std::int64_t tile_scale_row = (k_blocks + 3) / 4 * 4;
  const std::int64_t n_tiles128 = (n + kBlock - 1) / kBlock;
  if (operands.b_scale_stride < n_tiles128 * tile_scale_row)
    fail(what + ": b_scale_stride = " + std::to_string(operands.b_scale_stride) +
         " is less than one group's tile scales, " + std::to_string(n_tiles128 * tile_scale_row));
  GroupedParams p{};
  p.a_scales = operands.a_scales;
  p.b_scales = operands.b_scales;
  p.c = static_cast<__nv_bfloat16*>(operands.c);
  p.b_scale_stride = operands.b_scale_stride;
  p.n = static_cast<int>(n);
  p.groups = static_cast<int>(groups);
  p.k_blocks = static_cast<int>(k_blocks);
  p.n_tiles128 = static_cast<int>(n_tiles128);
  p.n_tiles256 = static_cast<int>((n + 2 * kBlock - 1) / (2 * kBlock));
  p.tile_scale_row = static_cast<int>(tile_scale_row);
  std::int64_t tiles = 0;
  for (int g = 0; g <= p.groups; ++g) {
    const bool ordered = g == 0 ? offsets[g] == 0 : offsets[g] >= offsets[g - 1];
    if (!ordered || offsets[g] > kRowLimit)
      fail(what + ": offsets[" + std::to_string(g) + "] = " + std::to_string(offsets[g]) +
           " must start at 0, never decrease and stay below 2^31 - 256");
    p.tile_start[g] = static_cast<int>(tiles);
    if (g == p.groups) break;
    p.first[g] = static_cast<int>(offsets[g]);
    p.rows[g] = static_cast<int>(offsets[g + 1] - offsets[g]);
    tiles += group_tiles(p.rows[g], p.n_tiles128, p.n_tiles256);
  }
  // The blocks step through the tiles by the grid, in 32-bit counts.
  if (tiles > 0x7fffffff - 65536)
    fail(what + ": " + std::to_string(tiles) + " tiles exceed 2^31 - 65537");
  if (tiles == 0) return;
  // Checked once there is work: without rows a caller may have no buffers yet.
  if (operands.a == nullptr || operands.a_scales == nullptr || operands.b == nullptr ||
      operands.b_scales == nullptr || operands.c == nullptr)
    fail(what + ": a null operand (a, a_scales, b, b_scales and c are all needed)");
  // The tensor maps take 16-byte aligned matrices, and the output is stored two bf16 at a time.
  const auto misaligned = [](const void* pointer, std::uintptr_t bytes) {
    return reinterpret_cast<std::uintptr_t>(pointer) % bytes != 0;
  };
  if (misaligned(operands.a, 16) || misaligned(operands.b, 16) || misaligned(operands.c, 16) ||
      misaligned(operands.a_scales, 4) || misaligned(operands.b_scales, 4))
    fail(what + ": a, b and c must be 16-byte aligned, the scales 4-byte aligned");
  int device = 0;
  MOE_CHECK_CUDA(cudaGetDevice(&device));
  if (!grouped_fp8_gemm_supported(device))
    fail(what + ": device " + std::to_string(device) +
         " cannot run it (grouped_fp8_gemm_supported: compute capability 9.0, a build for sm_90a "
         "and the driver's tensor maps)");
  p.a_map = box_map(operands.a, offsets.back(), k, "a");
  p.b_map = box_map(operands.b, static_cast<std::int64_t>(p.groups) * n, k, "b");
  p.tiles = static_cast<int>(tiles);
  // The shared memory beyond the default 48 KiB is asked for once on each device.
  static std::atomic<bool> sized[64];
  if (device >= 64 || !sized[device].load(std::memory_order_acquire)) {
    MOE_CHECK_CUDA(cudaFuncSetAttribute(grouped_fp8_gemm_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes));
    if (device < 64) sized[device].store(true, std::memory_order_release);
  }
  // One persistent block an SM, or one a tile where there are fewer.
  int sms = 0;
  MOE_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>(tiles, sms));
  grouped_fp8_gemm_kernel<<<blocks, kThreads, kSharedBytes, stream>>>(p);
  MOE_CHECK_LAUNCH();
}

}  // namespace moe
