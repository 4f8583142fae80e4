#include "gemm.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <vector>

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
    case DType::kInt64:
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
  LayoutOwner first;                             // B as column-major
  LayoutOwner second;                            // A as column-major
  LayoutOwner out;                               // C as column-major [N, M]
  cublasLtMatmulAlgo_t algo{};                   // what runs: the heuristic's first, or tuned
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's proposals, best guess first
  bool tuned = false;
  std::uint64_t generation = 0;  // of the GemmTuning whose winner `algo` is

  Plan(const GemmShape& s, int batch_class, std::uint32_t alignment, int proposals,
       cublasLtHandle_t handle, std::size_t workspace_bytes)
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
    std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<std::size_t>(proposals));
    int found = 0;
    MOE_CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle, desc.desc, first.layout, second.layout,
                                                    out.layout, out.layout, preference, proposals,
                                                    results.data(), &found));
    if (found == 0) {
      fail(
          "cuBLASLt has no algorithm for C[{},{}] = op(A)[{},{}] · op(B)[{},{}] ({} x {} -> {}, "
          "batch of {}, operands aligned to {} bytes)",
          s.m, s.n, s.m, s.k, s.k, s.n, dtype_name(s.a_type), dtype_name(s.b_type),
          dtype_name(s.c_type), batch_class, alignment);
    }
    for (int i = 0; i < found; ++i) candidates.push_back(results[static_cast<std::size_t>(i)].algo);
    algo = candidates.front();
  }

  bool supports(cublasLtHandle_t handle, const cublasLtMatmulAlgo_t& candidate,
                std::size_t workspace_bytes) const {
    cublasLtMatmulHeuristicResult_t check{};
    return cublasLtMatmulAlgoCheck(handle, desc.desc, first.layout, second.layout, out.layout,
                                   out.layout, &candidate, &check) == CUBLAS_STATUS_SUCCESS &&
           check.workspaceSize <= workspace_bytes;
  }
};

namespace {

// Sizes 1025..2048 share a class: tuning results carry over between row counts of one class.
int size_class(std::int64_t extent) {
  return static_cast<int>(
      std::bit_width(static_cast<std::uint64_t>(std::max<std::int64_t>(extent, 1) - 1)));
}

constexpr int kTuneProposals = 8;

}  // namespace

namespace {

// One winner as bytes: the size class's key, field by field in fixed widths, and the algorithm
// (an opaque struct of integers that cuBLASLt defines alike on every rank of one build).
struct WinnerRecord {
  std::int64_t m, n, k;
  std::int32_t trans_a, trans_b, a_type, b_type, c_type, batch_class;
  std::uint32_t alignment;
  std::uint32_t padding = 0;
  cublasLtMatmulAlgo_t algo;
};

}  // namespace

std::vector<std::byte> GemmTuning::serialize() const {
  std::vector<std::byte> bytes(winners.size() * sizeof(WinnerRecord));
  std::size_t at = 0;
  for (const auto& [key, algo] : winners) {
    const GemmShape& shape = key.shape;
    const WinnerRecord record{shape.m,
                              shape.n,
                              shape.k,
                              shape.trans_a,
                              shape.trans_b,
                              static_cast<std::int32_t>(shape.a_type),
                              static_cast<std::int32_t>(shape.b_type),
                              static_cast<std::int32_t>(shape.c_type),
                              key.batch_class,
                              key.alignment,
                              0,
                              algo};
    std::memcpy(bytes.data() + at, &record, sizeof(record));
    at += sizeof(record);
  }
  return bytes;
}

void GemmTuning::adopt_agreed(std::span<const std::vector<std::byte>> ranks) {
  std::map<GemmPlanKey, cublasLtMatmulAlgo_t> agreed;
  for (std::size_t rank = 0; rank < ranks.size(); ++rank) {
    const auto& bytes = ranks[rank];
    if (bytes.size() % sizeof(WinnerRecord) != 0) {
      fail("GemmTuning::adopt_agreed: rank {} sent {} bytes, not a whole number of {}-byte records",
           rank, bytes.size(), sizeof(WinnerRecord));
    }
    for (std::size_t at = 0; at < bytes.size(); at += sizeof(WinnerRecord)) {
      WinnerRecord record;
      std::memcpy(&record, bytes.data() + at, sizeof(record));
      GemmPlanKey key;
      key.shape = {record.m,
                   record.n,
                   record.k,
                   record.trans_a != 0,
                   record.trans_b != 0,
                   static_cast<DType>(record.a_type),
                   static_cast<DType>(record.b_type),
                   static_cast<DType>(record.c_type)};
      key.batch_class = record.batch_class;
      key.alignment = record.alignment;
      agreed.emplace(key, record.algo);  // keeps the lowest rank's
    }
  }
  winners = std::move(agreed);
  frozen = true;
  ++generation;
}

GemmRunner::GemmRunner(std::size_t workspace_bytes, std::shared_ptr<GemmTuning> tuning)
    : workspace_(workspace_bytes), tuning_(std::move(tuning)), tune_start_(true), tune_stop_(true) {
  // Zeroed once: compute-sanitizer's initcheck saw cuBLASLt's split-K reduction read workspace
  // words that no tracked store had written, 1.7 million reads over the experts suite. Written
  // once here, and waited for, since the products run on other streams than this memset.
  if (workspace_.bytes() > 0) {
    MOE_CHECK_CUDA(cudaMemset(workspace_.data(), 0, workspace_.bytes()));
    MOE_CHECK_CUDA(cudaStreamSynchronize(cudaStreamLegacy));
  }
}

GemmRunner::PlanKey GemmRunner::tune_class(const PlanKey& key) {
  PlanKey c = key;
  c.shape.m = size_class(key.shape.m);
  c.shape.n = size_class(key.shape.n);
  c.shape.k = size_class(key.shape.k);
  return c;
}

cublasStatus_t GemmRunner::launch(const Plan& p, const cublasLtMatmulAlgo_t& algo, const void* a,
                                  const void* b, void* c, float alpha, float beta,
                                  cudaStream_t stream) {
  return cublasLtMatmul(handle_.get(), p.desc.desc, &alpha, b, p.first.layout, a, p.second.layout,
                        &beta, c, p.out.layout, c, p.out.layout, &algo, workspace_.data(),
                        workspace_.bytes(), stream);
}

bool GemmRunner::adopt_known_winner(Plan& p, const PlanKey& key) {
  if (p.tuned && p.generation == tuning_->generation) return true;
  const auto known = tuning_->winners.find(tune_class(key));
  if (known == tuning_->winners.end()) {
    if (!tuning_->frozen) return false;
    p.algo = p.candidates.front();  // agreed: nobody timed this class, so the heuristic's first
  } else {
    // Another shape of this size class was timed: its winner, where it applies to this shape.
    p.algo = p.supports(handle_.get(), known->second, workspace_.bytes()) ? known->second
                                                                          : p.candidates.front();
  }
  p.tuned = true;
  p.generation = tuning_->generation;
  return true;
}

void GemmRunner::tune(Plan& p, const PlanKey& key, const void* a, const void* b, void* c,
                      cudaStream_t stream) {
  if (adopt_known_winner(p, key)) return;
  p.tuned = true;
  p.generation = tuning_->generation;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOE_CHECK_CUDA(cudaStreamIsCapturing(stream, &capture));
  if (p.candidates.size() > 1 && capture == cudaStreamCaptureStatusNone) {
    // Time each proposal on this call's own operands (C is written over, as the call itself
    // will): once to warm up, then three runs between events; a proposal cuBLASLt refuses at
    // launch is skipped. The host waits here once per size class, never again. The timings are
    // fair only with nothing else running: callers that spread products over streams tune
    // before they fan out (ExpertFFN).
    float best_ms = 0;
    for (const auto& candidate : p.candidates) {
      if (launch(p, candidate, a, b, c, 1.0f, 0.0f, stream) != CUBLAS_STATUS_SUCCESS) continue;
      tune_start_.record(stream);
      for (int run = 0; run < 3; ++run)
        MOE_CHECK_CUBLAS(launch(p, candidate, a, b, c, 1.0f, 0.0f, stream));
      tune_stop_.record(stream);
      MOE_CHECK_CUDA(cudaEventSynchronize(tune_stop_.get()));
      const float ms = tune_stop_.elapsed_ms_since(tune_start_);
      if (best_ms == 0 || ms < best_ms) {
        best_ms = ms;
        p.algo = candidate;
      }
    }
  }
  tuning_->winners.emplace(tune_class(key), p.algo);
}

bool GemmRunner::tuned(const GemmShape& shape, int batch, std::uint32_t alignment,
                       int class_count) {
  if (class_count > 0) batch = std::max(batch, class_count);
  if (!tuning_ || shape.m <= 0 || shape.n <= 0 || shape.k <= 0) return true;
  tuning_->ran_products = true;
  if (batch == 0 && !tuning_->plain_products) return true;
  const PlanKey key =
      batch > 0
          ? PlanKey{shape, static_cast<int>(std::bit_ceil(static_cast<unsigned>(batch))), alignment}
          : PlanKey{shape};
  return adopt_known_winner(plan(key), key);
}

GemmRunner::Plan& GemmRunner::plan(const PlanKey& key) {
  auto found = plans_.find(key);
  if (found == plans_.end()) {
    found = plans_
                .emplace(key, std::make_shared<Plan>(
                                  key.shape, key.batch_class, key.alignment,
                                  tuning_ && (key.batch_class > 0 || tuning_->plain_products)
                                      ? kTuneProposals
                                      : 1,
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
  const PlanKey key{shape};
  Plan& p = plan(key);
  if (tuning_ && tuning_->plain_products && beta == 0.0f) tune(p, key, a, b, c, stream);
  MOE_CHECK_CUBLAS(launch(p, p.algo, a, b, c, alpha, beta, stream));
}

void GemmRunner::run_batched(const GemmShape& shape, int batch, const void* const* a,
                             const void* const* b, void* const* c, std::uint32_t alignment,
                             cudaStream_t stream, int class_count) {
  if (shape.m <= 0 || shape.n <= 0 || shape.k <= 0 || batch < 1) {
    fail("GemmRunner: a batched product needs M, N, K, batch > 0 (got M={} N={} K={} batch={})",
         shape.m, shape.n, shape.k, batch);
  }
  if (!std::has_single_bit(alignment)) {
    fail("GemmRunner: alignment = {} must be a power of two", alignment);
  }
  if (class_count < 0 || (class_count > 0 && class_count < batch))
    fail("GemmRunner: a batch of {} takes the size class of {}", batch, class_count);
  const int class_of = class_count > 0 ? class_count : batch;
  const PlanKey key{shape, static_cast<int>(std::bit_ceil(static_cast<unsigned>(class_of))),
                    alignment};
  Plan& p = plan(key);
  for (LayoutOwner* layout : {&p.first, &p.second, &p.out}) layout->set_batch(batch);
  // With pointer-array batching, C and D are the address arrays themselves.
  void* const out_addresses = const_cast<void**>(c);
  if (tuning_) tune(p, key, a, b, out_addresses, stream);
  MOE_CHECK_CUBLAS(launch(p, p.algo, a, b, out_addresses, 1.0f, 0.0f, stream));
}

}  // namespace moe
