#include "grouped_fp8_gemm.cuh"

#include <cuda_bf16.h>

#include <atomic>
#include <string>

#include "moe/error.h"

// The tile and its pipeline. A block of 256 threads (two warpgroups) computes a 128 x 128 tile of
// one group's C: warpgroup w its rows [64w, 64w + 64), with m64n128k32 warpgroup products on
// operands in shared memory. The K dimension goes in 128-column blocks, the scales' blocks:
// each block's four products accumulate into a fresh fp32 partial sum, which the block's two
// scales then weigh into the tile's accumulator (so every block's sum is scaled once, in fp32).
// Operand tiles stream in through cp.async in a three-stage ring, each row of 128 codes stored
// with the 128-byte swizzle that the products' shared-memory descriptors name.

namespace moe {
namespace {

constexpr int kTileRows = 128;  // M and N of a tile
constexpr int kBlock = 128;     // K of a stage: one scale block
constexpr int kStages = 3;
constexpr int kThreads = 256;
constexpr int kOperandBytes = kTileRows * kBlock;                 // one operand's tile in one stage
constexpr int kSharedBytes = kStages * 2 * kOperandBytes + 1024;  // + alignment to 1024

struct GroupedParams {
  const std::uint8_t* a;
  const float* a_scales;
  const std::uint8_t* b;
  const float* b_scales;
  __nv_bfloat16* c;
  std::int64_t b_scale_stride;
  int n, k, groups, k_blocks, n_tiles, tile_scale_row;
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

// 16 bytes from global to shared memory, or 16 zero bytes where `valid` is false.
__device__ __forceinline__ void copy16(std::uint32_t to, const void* from, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from),
               "r"(valid ? 16 : 0));
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

// Row `row` of a tile (128 codes from column `column` of a row-major [*, k] matrix) into a stage,
// chunk by 16-byte chunk, chunk c at (c ^ (row mod 8)) · 16 of the row's 128 bytes.
__device__ __forceinline__ void load_tile(std::uint32_t stage, const std::uint8_t* matrix,
                                          int valid_rows, int k, int column) {
#pragma unroll
  for (int i = 0; i < kOperandBytes / 16 / kThreads; ++i) {
    const int chunk = threadIdx.x + i * kThreads;
    const int row = chunk / 8, c = chunk % 8;
    const int col = column + c * 16;
    const bool valid = row < valid_rows && col < k;
    const std::uint8_t* from = valid ? matrix + static_cast<std::int64_t>(row) * k + col : matrix;
    copy16(stage + row * 128 + ((c ^ (row & 7)) << 4), from, valid);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    grouped_fp8_gemm_kernel(const __grid_constant__ GroupedParams p) {
  extern __shared__ std::uint8_t shared_raw[];
  const std::uint32_t base = (shared_address(shared_raw) + 1023) & ~1023u;
  const auto stage_a = [&](int s) { return base + s * 2 * kOperandBytes; };
  const auto stage_b = [&](int s) { return base + s * 2 * kOperandBytes + kOperandBytes; };

  // The group whose tiles hold this block's: the last one starting at or before it (a group
  // without rows starts where the next begins).
  const int tile = blockIdx.x;
  int lo = 0, hi = p.groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.tile_start[mid] <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int g = lo, local = tile - p.tile_start[g];
  const int m0 = local / p.n_tiles * kTileRows, n0 = local % p.n_tiles * kTileRows;
  const int rows = p.rows[g];
  const int valid_m = min(kTileRows, rows - m0), valid_n = min(kTileRows, p.n - n0);
  const std::uint8_t* a = p.a + static_cast<std::int64_t>(p.first[g] + m0) * p.k;
  const std::uint8_t* b = p.b + (static_cast<std::int64_t>(g) * p.n + n0) * p.k;
  const float* a_scales = p.a_scales + static_cast<std::int64_t>(p.first[g]) * p.k_blocks;
  const float* b_scales = p.b_scales + g * p.b_scale_stride +
                          static_cast<std::int64_t>(n0 / kTileRows) * p.tile_scale_row;

  const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  // This thread's two rows of the tile, and its columns 8j + 2(lane mod 4) + {0, 1}.
  const int row0 = warpgroup * 64 + warp * 16 + lane / 4, row1 = row0 + 8;

  float acc[64], part[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < p.k_blocks) {
      load_tile(stage_a(s), a, valid_m, p.k, s * kBlock);
      load_tile(stage_b(s), b, valid_n, p.k, s * kBlock);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  }
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
    // The copies are the generic proxy's writes, the products read through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    // The stage the previous block's products read, done with (they were waited for).
    const int next = kb + kStages - 1;
    if (next < p.k_blocks) {
      load_tile(stage_a(next % kStages), a, valid_m, p.k, next * kBlock);
      load_tile(stage_b(next % kStages), b, valid_n, p.k, next * kBlock);
    }
    asm volatile("cp.async.commit_group;\n" ::);

    // The block's scales, loaded while the products run.
    const float b_scale = b_scales[kb];
    const std::int64_t scale_row = static_cast<std::int64_t>(kb) * rows + m0;
    const float scale0 = m0 + row0 < rows ? a_scales[scale_row + row0] * b_scale : 0.0f;
    const float scale1 = m0 + row1 < rows ? a_scales[scale_row + row1] * b_scale : 0.0f;
    const int s = kb % kStages;
    const std::uint32_t a_rows = stage_a(s) + warpgroup * 64 * 128;
    fence_registers(part);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int step = 0; step < kBlock / 32; ++step)
      wgmma_m64n128k32(part, descriptor(a_rows + step * 32), descriptor(stage_b(s) + step * 32),
                       step);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    fence_registers(part);

#pragma unroll
    for (int j = 0; j < 16; ++j) {
      acc[4 * j + 0] += part[4 * j + 0] * scale0;
      acc[4 * j + 1] += part[4 * j + 1] * scale0;
      acc[4 * j + 2] += part[4 * j + 2] * scale1;
      acc[4 * j + 3] += part[4 * j + 3] * scale1;
    }
  }

  __nv_bfloat16* c = p.c + static_cast<std::int64_t>(p.first[g] + m0) * p.n + n0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int col = 8 * j + 2 * (lane % 4);
    if (col >= valid_n) continue;
    if (row0 < valid_m)
      *reinterpret_cast<__nv_bfloat162*>(c + static_cast<std::int64_t>(row0) * p.n + col) =
          __floats2bfloat162_rn(acc[4 * j + 0], acc[4 * j + 1]);
    if (row1 < valid_m)
      *reinterpret_cast<__nv_bfloat162*>(c + static_cast<std::int64_t>(row1) * p.n + col) =
          __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
  }
}

#else  // built without sm_90a's warpgroup instructions: a launch traps rather than write nothing

__global__ void grouped_fp8_gemm_kernel(const __grid_constant__ GroupedParams) {
  __trap();
}

#endif

}  // namespace

bool grouped_fp8_gemm_supported(int device) {
  int major = 0, minor = 0;
  MOE_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOE_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
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
  const std::int64_t k_blocks = (k + kBlock - 1) / kBlock;
  const std::int64_t tile_scale_row = (k_blocks + 3) / 4 * 4;
  if (operands.b_scale_stride < (n + kTileRows - 1) / kTileRows * tile_scale_row)
    fail(what + ": b_scale_stride = " + std::to_string(operands.b_scale_stride) +
         " is less than one group's tile scales, " +
         std::to_string((n + kTileRows - 1) / kTileRows * tile_scale_row));
  GroupedParams p{};
  p.a = operands.a;
  p.a_scales = operands.a_scales;
  p.b = operands.b;
  p.b_scales = operands.b_scales;
  p.c = static_cast<__nv_bfloat16*>(operands.c);
  p.b_scale_stride = operands.b_scale_stride;
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.groups = static_cast<int>(offsets.size()) - 1;
  p.k_blocks = static_cast<int>(k_blocks);
  p.n_tiles = static_cast<int>((n + kTileRows - 1) / kTileRows);
  p.tile_scale_row = static_cast<int>(tile_scale_row);
  std::int64_t tiles = 0;
  for (int g = 0; g <= p.groups; ++g) {
    const bool ordered = g == 0 ? offsets[g] == 0 : offsets[g] >= offsets[g - 1];
    if (!ordered || offsets[g] > 0x7fffffff)
      fail(what + ": offsets[" + std::to_string(g) + "] = " + std::to_string(offsets[g]) +
           " must start at 0, never decrease and stay below 2^31");
    p.tile_start[g] = static_cast<int>(tiles);
    if (g == p.groups) break;
    p.first[g] = static_cast<int>(offsets[g]);
    p.rows[g] = static_cast<int>(offsets[g + 1] - offsets[g]);
    tiles += (static_cast<std::int64_t>(p.rows[g]) + kTileRows - 1) / kTileRows * p.n_tiles;
  }
  if (tiles > 0x7fffffff) fail(what + ": " + std::to_string(tiles) + " tiles exceed one grid");
  if (tiles == 0) return;
  // Checked once there is work: without rows a caller may have no buffers yet.
  if (operands.a == nullptr || operands.a_scales == nullptr || operands.b == nullptr ||
      operands.b_scales == nullptr || operands.c == nullptr)
    fail(what + ": a null operand (a, a_scales, b, b_scales and c are all needed)");
  // cp.async moves 16 bytes at a time, and the output is stored two bf16 at a time.
  const auto misaligned = [](const void* pointer, std::uintptr_t bytes) {
    return reinterpret_cast<std::uintptr_t>(pointer) % bytes != 0;
  };
  if (misaligned(operands.a, 16) || misaligned(operands.b, 16) || misaligned(operands.c, 4) ||
      misaligned(operands.a_scales, 4) || misaligned(operands.b_scales, 4))
    fail(what + ": a and b must be 16-byte aligned, c and the scales 4-byte aligned");
  // The shared memory beyond the default 48 KiB is asked for once on each device.
  static std::atomic<bool> sized[64];
  int device = 0;
  MOE_CHECK_CUDA(cudaGetDevice(&device));
  if (device >= 64 || !sized[device].load(std::memory_order_acquire)) {
    MOE_CHECK_CUDA(cudaFuncSetAttribute(grouped_fp8_gemm_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes));
    if (device < 64) sized[device].store(true, std::memory_order_release);
  }
  grouped_fp8_gemm_kernel<<<static_cast<unsigned>(tiles), kThreads, kSharedBytes, stream>>>(p);
  MOE_CHECK_LAUNCH();
}

}  // namespace moe
