// Grouped block-scaled FP8 products on Hopper in one launch: every expert's product at once, its
// tiles spread over the GPU's SMs, where cuBLASLt's block-scaled products run one expert a call
// (docs/design.md, "FP8"; slow at a few hundred rows an expert).
//
// For each group g (an expert) with rows [offsets[g], offsets[g + 1]):
//   C_g[m_g, N] = A_g[m_g, K] · B_g[N, K]ᵀ, bf16 out, fp32 accumulation,
// A in 1 × 128 row blocks and B in 128 × 128 tiles (kernels/fp8_quantize.cuh), each 128-column
// block's partial sums multiplied by its two scales in fp32: the arithmetic of cuBLASLt's
// block-scaled products, in the scale layouts the layer already writes for them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

namespace moe {

inline constexpr int kMaxGroupedGemmGroups = 256;

struct GroupedFp8Operands {
  // E4M3 [Σ m_g, K], group g's rows from offsets[g].
  const std::uint8_t* a = nullptr;
  // Row-block scales, segmented as quantize_row_blocks_segmented writes them: group g's at
  // offsets[g] · ⌈K / 128⌉, block c of its row i at c · m_g + i.
  const float* a_scales = nullptr;
  // E4M3 [groups, N, K].
  const std::uint8_t* b = nullptr;
  // Tile scales, b_scale_stride floats a group: tile (i, j) at i · L + j, L = ⌈K / 128⌉ rounded up
  // to a multiple of 4 (tile_scales(N, K)).
  const float* b_scales = nullptr;
  std::int64_t b_scale_stride = 0;
  // bf16 [Σ m_g, N].
  void* c = nullptr;
};

// Whether `device` runs the grouped products: compute capability 9.0, this library built for
// sm_90a (the kernel's warpgroup instructions; CMAKE_CUDA_ARCHITECTURES holds 90a), and a driver
// with tensor maps.
bool grouped_fp8_gemm_supported(int device);

// offsets: host, [groups + 1], 1 to kMaxGroupedGemmGroups groups, starting at 0, never
// decreasing, at most 2^31 - 257 (carried in the launch's parameters, so a CUDA graph captures
// them). N and K positive multiples of 16, groups · N at most 2^31 - 257; a, b and c 16-byte
// aligned, the scales 4-byte aligned. Throws moe::Error naming what is wrong, a device that cannot
// run it included.
void grouped_fp8_gemm(std::span<const std::int64_t> offsets, std::int64_t n, std::int64_t k,
                      const GroupedFp8Operands& operands, cudaStream_t stream);

}  // namespace moe
