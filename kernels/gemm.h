// Row-major matrix products on cuBLASLt, with the algorithm cached per shape and an owned
// workspace.
//
// C[M,N] = alpha · op(A) · op(B) + beta · C, all row-major: op(A) is [M,K] (A stored [M,K], or
// [K,M] when transposed), op(B) is [K,N]. Accumulation is fp32; fp32 inputs use true fp32 math
// (no TF32), so fp32 results match an fp64 reference to ~1e-6.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

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

class GemmRunner {
 public:
  explicit GemmRunner(std::size_t workspace_bytes = 32u << 20);

  // Launches on `stream`. Zero-sized products are no-ops, except that M·N > 0 with K = 0 writes
  // beta·C (so an expert with no rows gets a zero weight gradient when beta = 0).
  void run(const GemmShape& shape, const void* a, const void* b, void* c, cudaStream_t stream,
           float alpha = 1.0f, float beta = 0.0f);

 private:
  struct Plan;
  const Plan& plan(const GemmShape& shape);

  CublasLtHandle handle_;
  DeviceBuffer workspace_;
  std::map<GemmShape, std::shared_ptr<Plan>> plans_;
};

}  // namespace moe
