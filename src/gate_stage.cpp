#include "src/gate_stage.h"

#include "kernels/elementwise.cuh"
#include "src/stage_support.h"

namespace moe {

GateStage::GateStage(const MoEConfig& config, DeviceBuffer& dlogits_low)
    : E_(config.num_experts),
      H_(config.hidden),
      dtype_(config.dtype),
      gemm_(static_cast<std::size_t>(config.gemm_workspace_mib) << 20),
      weight_gemm_(static_cast<std::size_t>(config.gemm_workspace_mib) << 20),
      dlogits_low_(dlogits_low) {}

Tensor GateStage::forward(const Tensor& x, const Tensor& gate_weight, cudaStream_t stream) {
  const std::int64_t T = x.dim(0);
  const Tensor logits = view(logits_, DType::kFP32, {T, E_});
  gemm_.run({T, E_, H_, false, true, dtype_, dtype_, DType::kFP32}, x.data, gate_weight.data,
            logits.data, stream);
  return logits;
}

void GateStage::backward(const Tensor& dlogits, const Tensor& x, const Tensor& gate_weight,
                         const Tensor& gate_weight_grad, const Tensor& dx, cudaStream_t stream) {
  const std::int64_t T = x.dim(0);
  Tensor dl = dlogits;
  if (dtype_ == DType::kBF16) {  // the GEMM takes both operands in one dtype
    dl = view(dlogits_low_, DType::kBF16, {T, E_});
    convert(dlogits, dl, stream);
  }
  const cudaStream_t side = side_.get();
  fork_.record(stream);
  MOE_CHECK_CUDA(cudaStreamWaitEvent(side, fork_.get(), 0));
  weight_gemm_.run({E_, H_, T, true, false, dtype_, dtype_, DType::kFP32}, dl.data, x.data,
                   gate_weight_grad.data, side);
  gemm_.run({T, H_, E_, false, false, dtype_, dtype_, dtype_}, dl.data, gate_weight.data, dx.data,
            stream, 1.0f, 1.0f);
  join_.record(side);
  MOE_CHECK_CUDA(cudaStreamWaitEvent(stream, join_.get(), 0));  // dl and dWg are done
}

}  // namespace moe
