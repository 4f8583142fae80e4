// The gate: logits = x · Wgᵀ forward; dx += dlogits · Wg and dWg = dlogitsᵀ · x backward
// (docs/design.md, "Gate" and "Gate backward").
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/gemm.h"
#include "moe/config.h"
#include "moe/device.h"
#include "moe/tensor.h"

namespace moe {

class GateStage {
 public:
  GateStage(const MoEConfig& config, DeviceBuffer& dlogits_low);

  // logits [T, E] fp32, in the stage's own buffer: the router reads them in the forward and again
  // in its backward, so they live until the next forward.
  Tensor forward(const Tensor& x, const Tensor& gate_weight, cudaStream_t stream);

  // dx += dlogits · Wg on `stream`, dWg = dlogitsᵀ · x beside it on the side stream; returns once
  // `stream` waits for both.
  void backward(const Tensor& dlogits, const Tensor& x, const Tensor& gate_weight,
                const Tensor& gate_weight_grad, const Tensor& dx, cudaStream_t stream);

 private:
  int E_;
  std::int64_t H_;
  DType dtype_;
  GemmRunner gemm_;  // the forward product and dx
  // The weight gradient beside the input gradient: neither product fills the GPU, the first with
  // E·H / tile ≈ 60–120 tiles over a long T.
  GemmRunner weight_gemm_;
  Stream side_;
  Event fork_, join_;
  DeviceBuffer logits_;
  DeviceBuffer& dlogits_low_;  // the scratch's: dlogits in bf16
};

}  // namespace moe
