#include "gemm.h"

#include <bit>
#include <memory>

#include "moe/error.h"

namespace moe {
namespace {

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kFP32:
      return CUDA_R_32F;
    case DType::kInt32:
      break;
  }
  fail("GemmRunner: dtype {} is not a matrix type", dtype_name(dtype));
}

struct LayoutOwner {
  cublasLtMatrixLayout_t layout = nullptr;
  LayoutOwner(cudaDataType_t type, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
    MOE_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&layout, type, static_cast<std::uint64_t>(rows),
                                                static_cast<std::uint64_t>(cols), ld));
  }
  ~LayoutOwner() { (void)cublasLtMatrixLayoutDestroy(layout); }
  void use_pointer_array() {
    const auto mode = static_cast<std::uint32_t>(CUBLASLT_BATCH_MODE_POINTER_ARRAY);
    MOE_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE,
                                                      &mode, sizeof(mode)));
  }
  void set_batch(int count) {
    const std::int32_t value = count;
    MOE_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                      &value, sizeof(value)));
  }
  LayoutOwner(const LayoutOwner&) = delete;
  LayoutOwner& operator=(const LayoutOwner&) = delete;
};

struct DescOwner {
  cublasLtMatmulDesc_t desc = nullptr;
  DescOwner(cublasComputeType_t compute, cudaDataType_t scale) {
    MOE_CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc, compute, scale));
  }
  ~DescOwner() { (void)cublasLtMatmulDescDestroy(desc); }
  DescOwner(const DescOwner&) = delete;
  DescOwner& operator=(const DescOwner&) = delete;
};

}  // namespace

// cuBLASLt is column-major. A row-major [r, c] matrix is a column-major [c, r] one, so the
// row-major C = op(A)·op(B) is computed as the column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: B goes first.
struct GemmRunner::Plan {
  DescOwner desc{CUBLAS_COMPUTE_32F, CUDA_R_32F};
  LayoutOwner first;   // B as column-major
  LayoutOwner second;  // A as column-major
  LayoutOwner out;     // C as column-major [N, M]
  cublasLtMatmulAlgo_t algo{};

  Plan(const GemmShape& s, int batch_class, std::uint32_t alignment, cublasLtHandle_t handle,
       std::size_t workspace_bytes)
      : first(cuda_type(s.b_type), s.trans_b ? s.k : s.n, s.trans_b ? s.n : s.k,
              s.trans_b ? s.k : s.n),
        second(cuda_type(s.a_type), s.trans_a ? s.m : s.k, s.trans_a ? s.k : s.m,
               s.trans_a ? s.m : s.k),
        out(cuda_type(s.c_type), s.n, s.m, s.n) {
    const cublasOperation_t op_first = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_second = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    MOE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc.desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                    &op_first, sizeof(op_first)));
    MOE_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc.desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                    &op_second, sizeof(op_second)));
    if (batch_class > 0) {
      for (LayoutOwner* layout : {&first, &second, &out}) {
        layout->use_pointer_array();
        layout->set_batch(batch_class);
      }
    }

    cublasLtMatmulPreference_t preference = nullptr;
    MOE_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
    std::unique_ptr<void, void (*)(void*)> preference_owner(preference, [](void* p) {
      (void)cublasLtMatmulPreferenceDestroy(static_cast<cublasLtMatmulPreference_t>(p));
    });
    const std::uint64_t bytes = workspace_bytes;
    MOE_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof(bytes)));
    if (alignment > 0) {
      for (const auto attribute :
           {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
        MOE_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &alignment,
                                                              sizeof(alignment)));
      }
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    MOE_CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle, desc.desc, first.layout, second.layout,
                                                    out.layout, out.layout, preference, 1, &result,
                                                    &found));
    if (found == 0) {
      fail(
          "cuBLASLt has no algorithm for C[{},{}] = op(A)[{},{}] · op(B)[{},{}] ({} x {} -> {}, "
          "batch of {}, operands aligned to {} bytes)",
          s.m, s.n, s.m, s.k, s.k, s.n, dtype_name(s.a_type), dtype_name(s.b_type),
          dtype_name(s.c_type), batch_class, alignment);
    }
    algo = result.algo;
  }
};

GemmRunner::GemmRunner(std::size_t workspace_bytes) : workspace_(workspace_bytes) {}

GemmRunner::Plan& GemmRunner::plan(const PlanKey& key) {
  auto found = plans_.find(key);
  if (found == plans_.end()) {
    found = plans_
                .emplace(key, std::make_shared<Plan>(key.shape, key.batch_class, key.alignment,
                                                     handle_.get(), workspace_.bytes()))
                .first;
  }
  return *found->second;
}

void GemmRunner::run(const GemmShape& shape, const void* a, const void* b, void* c,
                     cudaStream_t stream, float alpha, float beta) {
  if (shape.m < 0 || shape.n < 0 || shape.k < 0) {
    fail("GemmRunner: negative extent M={} N={} K={}", shape.m, shape.n, shape.k);
  }
  if (shape.m == 0 || shape.n == 0) return;
  if (shape.k == 0) {
    // cuBLASLt rejects K = 0; the product is empty, so C = beta·C. Only beta = 0 is needed here.
    if (beta != 0.0f) fail("GemmRunner: K = 0 with beta = {} is not supported", beta);
    MOE_CHECK_CUDA(cudaMemsetAsync(
        c, 0, static_cast<std::size_t>(shape.m * shape.n) * dtype_size(shape.c_type), stream));
    return;
  }
  const Plan& p = plan({shape});
  MOE_CHECK_CUBLAS(cublasLtMatmul(handle_.get(), p.desc.desc, &alpha, b, p.first.layout, a,
                                  p.second.layout, &beta, c, p.out.layout, c, p.out.layout, &p.algo,
                                  workspace_.data(), workspace_.bytes(), stream));
}

void GemmRunner::run_batched(const GemmShape& shape, int batch, const void* const* a,
                             const void* const* b, void* const* c, std::uint32_t alignment,
                             cudaStream_t stream) {
  if (shape.m <= 0 || shape.n <= 0 || shape.k <= 0 || batch < 1) {
    fail("GemmRunner: a batched product needs M, N, K, batch > 0 (got M={} N={} K={} batch={})",
         shape.m, shape.n, shape.k, batch);
  }
  if (!std::has_single_bit(alignment)) {
    fail("GemmRunner: alignment = {} must be a power of two", alignment);
  }
  Plan& p = plan({shape, static_cast<int>(std::bit_ceil(static_cast<unsigned>(batch))), alignment});
  for (LayoutOwner* layout : {&p.first, &p.second, &p.out}) layout->set_batch(batch);
  const float alpha = 1.0f, beta = 0.0f;
  // With pointer-array batching, C and D are the address arrays themselves.
  void* const out_addresses = const_cast<void**>(c);
  MOE_CHECK_CUBLAS(cublasLtMatmul(handle_.get(), p.desc.desc, &alpha, b, p.first.layout, a,
                                  p.second.layout, &beta, out_addresses, p.out.layout,
                                  out_addresses, p.out.layout, &p.algo, workspace_.data(),
                                  workspace_.bytes(), stream));
}

}  // namespace moe
