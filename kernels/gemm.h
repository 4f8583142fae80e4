// Row-major matrix products on cuBLASLt, with the algorithm cached per shape and an owned
// workspace.
//
// C[M,N] = alpha · op(A) · op(B) + beta · C, all row-major: op(A) is [M,K] (A stored [M,K], or
// [K,M] when transposed), op(B) is [K,N]. Accumulation is fp32; fp32 inputs use true fp32 math
// (no TF32), so fp32 results match an fp64 reference to ~1e-6.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <tuple>
#include <vector>

#include "moe/device.h"
#include "moe/tensor.h"

namespace moe {

struct GemmShape {
  std::int64_t m = 0;
  std::int64_t n = 0;
  std::int64_t k = 0;
  bool trans_a = false;
  bool trans_b = false;
  DType a_type = DType::kBF16;
  DType b_type = DType::kBF16;
  DType c_type = DType::kFP32;

  auto key() const { return std::tie(m, n, k, trans_a, trans_b, a_type, b_type, c_type); }
  bool operator<(const GemmShape& other) const { return key() < other.key(); }
};

// A plan's identity. batch_class 0: a plain product; otherwise pointer-array batching, the
// algorithm chosen for batch_class products and reused for any count up to it (counts vary from
// step to step). alignment 0: cuBLASLt checks the addresses itself.
struct GemmPlanKey {
  GemmShape shape;
  int batch_class = 0;
  std::uint32_t alignment = 0;
  auto key() const { return std::tuple_cat(shape.key(), std::tie(batch_class, alignment)); }
  bool operator<(const GemmPlanKey& other) const { return key() < other.key(); }
};

// The algorithms autotuning chose, by size class (GemmPlanKey with extents replaced by their
// power-of-two class). Runners that run the same products on several streams share one, so that
// each class is timed once.
struct GemmTuning {
  // Also tune plain (unbatched) products. ExpertFFN does not: at mixtral-8x7b its per-expert
  // products gained nothing in isolation and the layer measured 2-4% slower with the
  // isolation-timed winners running four to a GPU (docs/performance.md).
  bool plain_products = true;
  std::map<GemmPlanKey, cublasLtMatmulAlgo_t> winners;
  // Timing picks differently on different GPUs, so ranks that tuned alone may run one product
  // with different algorithms, and DP replicas would not be bitwise equal. A mesh agrees: every
  // rank adopts the union of all ranks' winners (adopt_agreed), and from then on, frozen, a size
  // class nobody timed runs the heuristic's first proposal untimed, which is the same everywhere.
  bool frozen = false;
  // Whether a product with rows has asked for its algorithm (timed or not): a mesh that ran
  // products but timed none (every one plain, say) agrees on that and freezes all the same.
  bool ran_products = false;
  // Bumped when adopt_agreed replaces winners: plans re-read their algorithm.
  std::uint64_t generation = 0;

  // The winners as bytes (fixed-size records), for the agreement's exchange.
  std::vector<std::byte> serialize() const;
  // `ranks`: every rank's serialize(), in rank order. Each size class takes the winner of the
  // lowest rank that timed it; then frozen. Throws moe::Error on bytes that are not records.
  void adopt_agreed(std::span<const std::vector<std::byte>> ranks);
};

// cuBLASLt's workspace per runner (per stream that runs products concurrently).
inline constexpr std::size_t kDefaultGemmWorkspaceBytes = std::size_t{4} << 20;

class GemmRunner {
 public:
  // With `tuning`, the first product of each size class (extents rounded up to powers of two)
  // times cuBLASLt's first 8 proposals on its own operands, alone on the device, and the class
  // keeps the fastest: the heuristic's first guess is up to 20% slower on some expert products
  // (docs/performance.md). Only products with beta = 0 are tuned (a trial overwrites C), and none
  // under stream capture. Without it, the heuristic's first proposal runs.
  explicit GemmRunner(std::size_t workspace_bytes = kDefaultGemmWorkspaceBytes,
                      std::shared_ptr<GemmTuning> tuning = nullptr);

  // Launches on `stream`. Zero-sized products are no-ops, except that M·N > 0 with K = 0 writes
  // beta·C (so an expert with no rows gets a zero weight gradient when beta = 0).
  void run(const GemmShape& shape, const void* a, const void* b, void* c, cudaStream_t stream,
           float alpha = 1.0f, float beta = 0.0f);

  // `batch` products of one shape (M, N, K > 0) in one call, C = op(A)·op(B) each: cuBLASLt reads
  // the operands' addresses from the device arrays a[batch], b[batch] and c[batch].
  // `alignment` (a power of two) divides every one of those addresses: cuBLASLt cannot see them
  // when it picks the algorithm, so it is told.
  // class_count: the count whose size class picks the algorithm (0: batch itself), so that part
  // of a batch runs as the whole batch would.
  void run_batched(const GemmShape& shape, int batch, const void* const* a, const void* const* b,
                   void* const* c, std::uint32_t alignment, cudaStream_t stream,
                   int class_count = 0);

  // Whether the product (batch 0: a plain run; else run_batched with that count and alignment)
  // would launch without timing proposals first: no tuning, or its size class is tuned already.
  bool tuned(const GemmShape& shape, int batch = 0, std::uint32_t alignment = 0,
             int class_count = 0);

 private:
  struct Plan;
  using PlanKey = GemmPlanKey;
  Plan& plan(const PlanKey& key);
  static PlanKey tune_class(const PlanKey& key);
  bool adopt_known_winner(Plan& p, const PlanKey& key);
  void tune(Plan& p, const PlanKey& key, const void* a, const void* b, void* c,
            cudaStream_t stream);
  cublasStatus_t launch(const Plan& p, const cublasLtMatmulAlgo_t& algo, const void* a,
                        const void* b, void* c, float alpha, float beta, cudaStream_t stream);

  CublasLtHandle handle_;
  DeviceBuffer workspace_;
  std::shared_ptr<GemmTuning> tuning_;
  Event tune_start_, tune_stop_;
  std::map<PlanKey, std::shared_ptr<Plan>> plans_;
};

}  // namespace moe
