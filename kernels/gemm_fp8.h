// Block-scaled FP8 matrix products on cuBLASLt (Hopper): E4M3 operands quantized in blocks
// (kernels/fp8_quantize.cuh), fp32 accumulation, each block's partial sums multiplied by its two
// scales.
//
// C[M,N] = A[M,K] · B[N,K]ᵀ, row-major, K the inner dimension of both operands (the only FP8
// layout Hopper's tensor cores take): A in row blocks (1 × 128, activations), B in tiles
// (128 × 128, weights). cuBLASLt reads the scales in layouts of its own, which
// row_block_scales / tile_scales give for the quantizers.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "fp8_quantize.cuh"
#include "gemm.h"
#include "moe/device.h"
#include "moe/tensor.h"

namespace moe {

// The scales of A [rows, cols] in row blocks, as cuBLASLt reads them: block c of row r at
// c · rows + r (each column block's scales contiguous over the rows).
ScaleBuffer row_block_scales(std::int64_t rows, std::int64_t cols);
// The scales of B [rows, cols] in tiles: tile (i, j) at i · L4 + j, with L4 the column tiles
// rounded up to a multiple of 4.
ScaleBuffer tile_scales(std::int64_t rows, std::int64_t cols);

class BlockScaledGemm {
 public:
  explicit BlockScaledGemm(std::size_t workspace_bytes = kDefaultGemmWorkspaceBytes);
  ~BlockScaledGemm();
  BlockScaledGemm(const BlockScaledGemm&) = delete;
  BlockScaledGemm& operator=(const BlockScaledGemm&) = delete;

  // Whether cuBLASLt offers this product here; if not, `why` says what it answered.
  bool available(std::int64_t m, std::int64_t n, std::int64_t k, DType c_type,
                 std::string* why = nullptr);

  // C = A · Bᵀ (+ C with accumulate), C bf16 or fp32; a_scales and b_scales as row_block_scales
  // and tile_scales lay them out. Throws moe::Error where cuBLASLt has no algorithm.
  void run(std::int64_t m, std::int64_t n, std::int64_t k, const std::uint8_t* a,
           const float* a_scales, const std::uint8_t* b, const float* b_scales, void* c,
           DType c_type, cudaStream_t stream, bool accumulate = false);

  // `batch` products of one shape in one call, each operand's matrices back to back (A [batch,
  // M, K], B [batch, N, K], C [batch, M, N]) and so their scales (batch × row_block_scales(M, K)
  // and batch × tile_scales(N, K)): experts padded to one row count.
  bool batched_available(std::int64_t m, std::int64_t n, std::int64_t k, int batch, DType c_type,
                         std::string* why = nullptr);
  void run_batched(std::int64_t m, std::int64_t n, std::int64_t k, int batch, const std::uint8_t* a,
                   const float* a_scales, const std::uint8_t* b, const float* b_scales, void* c,
                   DType c_type, cudaStream_t stream);

 private:
  struct Plan;
  Plan* plan(std::int64_t m, std::int64_t n, std::int64_t k, DType c_type, int batch = 1);
  void launch(Plan* p, const std::uint8_t* a, const float* a_scales, const std::uint8_t* b,
              const float* b_scales, void* c, cudaStream_t stream, bool accumulate);

  CublasLtHandle handle_;
  DeviceBuffer workspace_;
  std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t, DType, int>, std::unique_ptr<Plan>>
      plans_;
};

}  // namespace moe
