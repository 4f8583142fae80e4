#include "gemm_fp8.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "moe/error.h"

namespace moe {
namespace {

std::int64_t blocks(std::int64_t extent) {
  return (extent + kFP8Block - 1) / kFP8Block;
}

cudaDataType_t output_type(DType c_type) {
  if (c_type == DType::kBF16) return CUDA_R_16BF;
  if (c_type == DType::kFP32) return CUDA_R_32F;
  fail("BlockScaledGemm: C must be bf16 or fp32, got {}", dtype_name(c_type));
}

}  // namespace

ScaleBuffer row_block_scales(std::int64_t rows, std::int64_t cols) {
  return {{1, rows}, rows * blocks(cols)};
}

ScaleBuffer tile_scales(std::int64_t rows, std::int64_t cols) {
  const std::int64_t padded = (blocks(cols) + 3) / 4 * 4;
  return {{padded, 1}, blocks(rows) * padded};
}

// cuBLASLt is column-major: the row-major C[M,N] = A·Bᵀ is its Cᵀ[N,M] = B·Aᵀ, with B (stored
// [N,K] row-major, a column-major [K,N]) transposed as its first operand and A (a column-major
// [K,M]) as its second. So cuBLASLt's first operand carries the tile scales.
struct BlockScaledGemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
  std::string why;

  // `placeholder`: any device address; cuBLASLt proposes block-scaled algorithms only once the
  // scale pointers are set, and each run sets the real ones.
  Plan(cublasLtHandle_t handle, std::int64_t m, std::int64_t n, std::int64_t k, DType c_type,
       int batch, std::size_t workspace_bytes, const void* placeholder) {
    MOE_CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
    MOE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                                    sizeof(transpose)));
    MOE_CHECK_CUBLAS(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)));
    const cublasLtMatmulMatrixScale_t tiles = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const cublasLtMatmulMatrixScale_t rows = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    MOE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &tiles,
                                                    sizeof(tiles)));
    MOE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &rows,
                                                    sizeof(rows)));
    for (const auto pointer :
         {CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER}) {
      MOE_CHECK_CUBLAS(
          cublasLtMatmulDescSetAttribute(desc, pointer, &placeholder, sizeof(placeholder)));
    }
    const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
    MOE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&first, CUDA_R_8F_E4M3, u(k), u(n), k));
    MOE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&second, CUDA_R_8F_E4M3, u(k), u(m), k));
    MOE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&out, output_type(c_type), u(n), u(m), n));
    if (batch > 1) {
      const std::int32_t count = batch;
      for (const auto& [layout, stride] :
           {std::pair{first, n * k}, std::pair{second, m * k}, std::pair{out, m * n}}) {
        MOE_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(
            layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
        MOE_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(
            layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
      }
    }

    cublasLtMatmulPreference_t preference = nullptr;
    MOE_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
    const std::uint64_t bytes = workspace_bytes;
    const cublasStatus_t set = cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof(bytes));
    cublasLtMatmulHeuristicResult_t result{};
    int count = 0;
    const cublasStatus_t asked =
        set != CUBLAS_STATUS_SUCCESS
            ? set
            : cublasLtMatmulAlgoGetHeuristic(handle, desc, first, second, out, out, preference, 1,
                                             &result, &count);
    (void)cublasLtMatmulPreferenceDestroy(preference);
    found = asked == CUBLAS_STATUS_SUCCESS && count > 0;
    if (found) {
      algo = result.algo;
    } else {
      why = fmt::format(
          "cuBLASLt {} for E4M3 [{},{}] · [{},{}]ᵀ -> {} with 1x128 and 128x128 scales{}",
          asked == CUBLAS_STATUS_SUCCESS
              ? std::string("proposed no algorithm")
              : fmt::format("answered status {}", static_cast<int>(asked)),
          m, k, n, k, dtype_name(c_type),
          batch > 1 ? fmt::format(", a strided batch of {}", batch) : std::string());
    }
  }
  ~Plan() {
    (void)cublasLtMatrixLayoutDestroy(out);
    (void)cublasLtMatrixLayoutDestroy(second);
    (void)cublasLtMatrixLayoutDestroy(first);
    (void)cublasLtMatmulDescDestroy(desc);
  }
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
};

BlockScaledGemm::BlockScaledGemm(std::size_t workspace_bytes)
    : workspace_(std::max<std::size_t>(workspace_bytes, 256)) {}
BlockScaledGemm::~BlockScaledGemm() = default;

BlockScaledGemm::Plan* BlockScaledGemm::plan(std::int64_t m, std::int64_t n, std::int64_t k,
                                             DType c_type, int batch) {
  if (m <= 0 || n <= 0 || k <= 0 || batch <= 0)
    fail("BlockScaledGemm: M = {}, N = {}, K = {} and batch = {} must be > 0", m, n, k, batch);
  // FP8 operands: cuBLASLt takes extents in multiples of 16 along K and rows of 16-byte alignment.
  if (k % 16 != 0) fail("BlockScaledGemm: K = {} must be a multiple of 16", k);
  auto& slot = plans_[{m, n, k, c_type, batch}];
  if (!slot) {
    slot = std::make_unique<Plan>(handle_.get(), m, n, k, c_type, batch, workspace_.bytes(),
                                  workspace_.data());
  }
  return slot.get();
}

bool BlockScaledGemm::available(std::int64_t m, std::int64_t n, std::int64_t k, DType c_type,
                                std::string* why) {
  return batched_available(m, n, k, 1, c_type, why);
}

bool BlockScaledGemm::batched_available(std::int64_t m, std::int64_t n, std::int64_t k, int batch,
                                        DType c_type, std::string* why) {
  const Plan* p = plan(m, n, k, c_type, batch);
  if (why != nullptr) *why = p->why;
  return p->found;
}

void BlockScaledGemm::launch(Plan* p, const std::uint8_t* a, const float* a_scales,
                             const std::uint8_t* b, const float* b_scales, void* c,
                             cudaStream_t stream, bool accumulate) {
  if (!p->found) fail("BlockScaledGemm: {}", p->why);
  MOE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                  &b_scales, sizeof(b_scales)));
  MOE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                  &a_scales, sizeof(a_scales)));
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  MOE_CHECK_CUBLAS(cublasLtMatmul(handle_.get(), p->desc, &alpha, b, p->first, a, p->second, &beta,
                                  c, p->out, c, p->out, &p->algo, workspace_.data(),
                                  workspace_.bytes(), stream));
}

void BlockScaledGemm::run(std::int64_t m, std::int64_t n, std::int64_t k, const std::uint8_t* a,
                          const float* a_scales, const std::uint8_t* b, const float* b_scales,
                          void* c, DType c_type, cudaStream_t stream, bool accumulate) {
  launch(plan(m, n, k, c_type), a, a_scales, b, b_scales, c, stream, accumulate);
}

void BlockScaledGemm::run_batched(std::int64_t m, std::int64_t n, std::int64_t k, int batch,
                                  const std::uint8_t* a, const float* a_scales,
                                  const std::uint8_t* b, const float* b_scales, void* c,
                                  DType c_type, cudaStream_t stream) {
  launch(plan(m, n, k, c_type, batch), a, a_scales, b, b_scales, c, stream, false);
}

}  // namespace moe
