// The experts: each local expert's SwiGLU FFN over its rows, forward and backward (docs/design.md,
// "Experts" and "Experts backward"), on the rows the token exchange laid out.
#pragma once

#include <cuda_runtime_api.h>

#include <optional>

#include "kernels/experts.h"
#include "kernels/experts_fp8.h"
#include "moe/config.h"
#include "moe/device.h"
#include "moe/mesh.h"
#include "moe/tensor.h"
#include "src/token_exchange.h"

namespace moe {

class ExpertStage {
 public:
  ExpertStage(const MoEConfig& config, const Mesh& mesh, DeviceBuffer& activations);

  // Once a step, before the first forward: with fp8, quantizes the weights for the products,
  // unless weights_unchanged and the FP8 copy is of these very tensors; nothing without fp8.
  void prepare_forward(const Tensor& w13, const Tensor& w2, cudaStream_t stream,
                       bool weights_unchanged);
  // Y = (p ⊙ silu(X·w13_gateᵀ) ⊙ X·w13_upᵀ)·w2ᵀ per expert, p where rows.scale is given. Keeps h.
  // span: the experts of one chunk of a pipelined exchange (all where it does not pipeline).
  void forward(const ExpertRows& rows, const Tensor& w13, const Tensor& w2, cudaStream_t stream,
               ExpertSpan span = {});
  // dX and the weight gradients (overwritten) from dY, with the forward's h; the probabilities'
  // gradients into rows.scale where it is given. dX_queued, where given, is called once dX is
  // queued, ahead of the weight gradients' last products where the experts can order them so
  // (ExpertFFN::backward), at the end otherwise.
  void backward(const ExpertGradRows& rows, const Tensor& w13, const Tensor& w2,
                const Tensor& w13_grad, const Tensor& w2_grad, cudaStream_t stream,
                ExpertSpan span = {}, const ExpertFFN::DXQueued& dX_queued = {});
  // The weights were written (bound or initialized): the next forward quantizes them for the
  // FP8 products whatever ForwardOptions::weights_unchanged says.
  void weights_changed() { fp8_w13_ = fp8_w2_ = nullptr; }
  // Collective over the world, once: every rank adopts the union of the GEMM algorithms all ranks
  // timed so far (the lowest rank's where several timed one size class), and times none after,
  // so that every rank, DP replicas included, runs each product with the same algorithm. Nothing
  // without autotuning, on one rank, or once agreed. Waits for the stream (within the mesh's
  // timeout), once.
  void agree_gemm_algorithms(const Mesh& mesh, cudaStream_t stream);
  // Whether agree_gemm_algorithms has nothing left to do on this mesh (it would wait otherwise).
  bool gemm_algorithms_agreed(const Mesh& mesh) const {
    return !ffn_ || ffn_->tuning() == nullptr || ffn_->tuning()->frozen || mesh.world_size() == 1;
  }

 private:
  std::int64_t F_;
  DType dtype_;
  std::optional<ExpertFFN> ffn_;     // bf16 or fp32 products
  std::optional<Fp8ExpertFFN> fp8_;  // with config.fp8 (its products need no tuning)
  // The weights the FP8 copy was quantized from (a rebind or initialize changes them).
  const void* fp8_w13_ = nullptr;
  const void* fp8_w2_ = nullptr;
  // h [rows, 2F]: kept from forward to backward (a is recomputed from it), then dh in place.
  DeviceBuffer h_;
  // a [chunk rows, F], the scratch's: the SwiGLU output, then dA and a again in the backward;
  // one activation chunk of rows at a time (MoEConfig::activation_chunk_mib).
  DeviceBuffer& a_;
};

}  // namespace moe
