#include "src/shared_expert_stage.h"

#include "kernels/shared_expert.cuh"
#include "src/stage_support.h"

namespace moe {
namespace {

// The routed experts' stage run as one local expert of width Fs: the same FFN, chunking,
// schedules and GEMM tuning. Its products stay in the layer's dtype under fp8: its one row group
// is every token, which FP8's multiples of 16 rows would need padded.
MoEConfig one_expert_config(const MoEConfig& config, const Mesh& mesh) {
  MoEConfig shared = config;
  shared.ffn_hidden = config.shared_ffn_hidden;
  shared.num_experts = mesh.ep();  // one per EP rank: E_loc = 1
  shared.fp8 = false;
  return shared;
}

// A replicated [rows, cols] weight seen as the stack of one expert, [1, rows, cols].
Tensor as_one_expert(const Tensor& t) {
  return Tensor(t.data, t.dtype, {1, t.dim(0), t.dim(1)});
}

}  // namespace

SharedExpertStage::SharedExpertStage(const MoEConfig& config, const Mesh& mesh)
    : gated_(config.shared_gate),
      overlap_(config.shared_expert_overlap),
      H_(config.hidden),
      Fs_(config.shared_ffn_hidden),
      dtype_(config.dtype),
      ffn_(one_expert_config(config, mesh), mesh, activations_) {}

void SharedExpertStage::start_forward(const Tensor& x, const MoEParameters& params,
                                      cudaStream_t stream) {
  const std::int64_t T = x.dim(0);
  x_ = x;
  offsets_ = {0, T};
  forked_.record(stream);
  const cudaStream_t work = overlap_ ? side_.get() : stream;
  MOE_CHECK_CUDA(cudaStreamWaitEvent(work, forked_.get()));
  Tensor scale;
  if (gated_) {
    scale = view(gate_, DType::kFP32, {T});
    shared_gate_forward(x, params.shared_gate_weight, typed<float>(logit_, T), scale.as<float>(),
                        work);
  }
  const ExpertRows rows{
      .input = x, .output = view(y_, dtype_, {T, H_}), .scale = scale, .offsets = offsets_};
  ffn_.forward(rows, as_one_expert(params.shared_w13), as_one_expert(params.shared_w2), work);
  joined_.record(work);
}

void SharedExpertStage::add_output(const Tensor& out, cudaStream_t stream) {
  MOE_CHECK_CUDA(cudaStreamWaitEvent(stream, joined_.get()));
  add_into(out, Tensor(y_.data(), dtype_, {out.dim(0), H_}), stream);
}

void SharedExpertStage::start_backward(const Tensor& dy, const MoEParameters& params,
                                       const MoEGradients& grads, cudaStream_t stream) {
  const std::int64_t T = x_.dim(0);
  forked_.record(stream);
  const cudaStream_t work = overlap_ ? side_.get() : stream;
  MOE_CHECK_CUDA(cudaStreamWaitEvent(work, forked_.get()));
  // The gate's values become their gradients in place (the experts' backward writes each row
  // weight's gradient where the weight was); the logits keep what σ' needs.
  const Tensor scale = gated_ ? Tensor(gate_.data(), DType::kFP32, {T}) : Tensor{};
  const ExpertGradRows rows{.dY = dy,
                            .input = x_,
                            .dX = view(dx_, dtype_, {T, H_}),
                            .scale = scale,
                            .offsets = offsets_,
                            .refill = {}};
  ffn_.backward(rows, as_one_expert(params.shared_w13), as_one_expert(params.shared_w2),
                as_one_expert(grads.shared_w13), as_one_expert(grads.shared_w2), work);
  if (gated_) {
    workspace_.reserve(std::max<std::size_t>(shared_gate_workspace_bytes(T, H_), 16));
    shared_gate_backward(x_, logit_.as<float>(), gate_.as<float>(),
                         grads.shared_gate_weight.as<float>(), workspace_.data(), work);
  }
  joined_.record(work);
}

void SharedExpertStage::add_input_grad(const Tensor& dx, const MoEParameters& params,
                                       cudaStream_t stream) {
  MOE_CHECK_CUDA(cudaStreamWaitEvent(stream, joined_.get()));
  add_shared_input_grad(dx, Tensor(dx_.data(), dtype_, {dx.dim(0), H_}),
                        gated_ ? gate_.as<float>() : nullptr, params.shared_gate_weight, stream);
}

}  // namespace moe
