#include "src/expert_stage.h"

#include "src/stage_support.h"

namespace moe {

ExpertStage::ExpertStage(const MoEConfig& config, const Mesh& mesh, DeviceBuffer& activations)
    : F_(config.ffn_hidden),
      dtype_(config.dtype),
      ffn_(config.hidden, config.ffn_hidden, config.num_experts / mesh.ep(), config.dtype,
           ExpertSchedule::kBatched, 4,
           static_cast<std::size_t>(config.activation_chunk_mib * (1 << 20)),
           static_cast<std::size_t>(config.gemm_workspace_mib) << 20, config.gemm_autotune),
      a_(activations) {
  ffn_.set_host_wait([&mesh](cudaEvent_t event) {
    mesh.wait(event, "the work queued before the expert GEMMs' algorithm timing");
  });
}

void ExpertStage::forward(const ExpertRows& rows, const Tensor& w13, const Tensor& w2,
                          cudaStream_t stream) {
  const std::int64_t n = rows.offsets.back();
  ExpertActivations act{.h = view(h_, dtype_, {n, 2 * F_}),
                        .a = view(a_, dtype_, {ffn_.activation_rows(rows.offsets), F_})};
  act.scale = rows.scale;
  ffn_.forward(rows.input, rows.offsets, w13, w2, act, rows.output, stream);
}

void ExpertStage::backward(const ExpertGradRows& rows, const Tensor& w13, const Tensor& w2,
                           const Tensor& w13_grad, const Tensor& w2_grad, cudaStream_t stream) {
  const std::int64_t n = rows.offsets.back();
  // In place: dh over h, dA over a (the SwiGLU backward reads each element before writing its
  // gradient, and writes a there again for dw2).
  const Tensor h(h_.data(), dtype_, {n, 2 * F_});
  const Tensor a(a_.data(), dtype_, {ffn_.activation_rows(rows.offsets), F_});
  ExpertActivations act{.h = h, .a = a, .dA = a, .dh = h};
  act.scale = act.dscale = rows.scale;
  ffn_.backward(rows.dY, rows.input, rows.offsets, w13, w2, act, false, rows.dX, w13_grad, w2_grad,
                stream, rows.refill);
}

}  // namespace moe
