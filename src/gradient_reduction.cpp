#include "src/gradient_reduction.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "kernels/elementwise.cuh"

namespace moe {
namespace {

constexpr std::int64_t kStageElements = std::int64_t{16} << 20;  // 64 MiB of fp32

// NCCL would round every hop's partial sum of bf16 values to bf16: a bf16 gradient is widened a
// chunk at a time to fp32, summed, and narrowed back, through one bounded staging buffer (sized
// by reduce_gradients before the first collective: growing it later would free memory, which
// waits for the device, behind collectives that might never complete).
void sum_bf16_in_fp32(const Tensor& grad, MeshGroup group, const Mesh& mesh, DeviceBuffer& staging,
                      cudaStream_t stream) {
  const std::int64_t total = grad.numel();
  for (std::int64_t first = 0; first < total; first += kStageElements) {
    const std::int64_t n = std::min(kStageElements, total - first);
    const Tensor part(static_cast<std::uint16_t*>(grad.data) + first, DType::kBF16, {n});
    const Tensor wide(staging.data(), DType::kFP32, {n});
    convert(part, wide, stream);
    mesh.all_reduce_sum(wide.data, static_cast<std::size_t>(n), ncclFloat32, group, stream);
    convert(wide, part, stream);
  }
}

// Sums gradients of one dtype over `group`: fp32 in one NCCL group, bf16 widened.
void sum_gradients(std::initializer_list<const Tensor*> grads, MeshGroup group, const Mesh& mesh,
                   DeviceBuffer& staging, cudaStream_t stream, const char* what) {
  if (mesh.group_size(group) == 1) return;
  if (grads.size() > 0 && (*grads.begin())->dtype == DType::kBF16) {
    for (const Tensor* grad : grads) sum_bf16_in_fp32(*grad, group, mesh, staging, stream);
    return;
  }
  mesh.group_start();
  for (const Tensor* grad : grads)
    mesh.all_reduce_sum(grad->data, static_cast<std::size_t>(grad->numel()), ncclFloat32, group,
                        stream);
  mesh.group_end(what);
}

}  // namespace

void reduce_gradients(const MoEConfig& config, const MoEGradients& grads, const Mesh& mesh,
                      DeviceBuffer& staging, cudaStream_t stream) {
  std::int64_t widest = 4;
  for (const Tensor* grad : {&grads.w13, &grads.w2, &grads.shared_w13, &grads.shared_w2}) {
    if (grad->dtype == DType::kBF16)
      widest = std::max(widest, std::min(grad->numel(), kStageElements));
  }
  staging.reserve(static_cast<std::size_t>(widest) * 4);
  sum_gradients({&grads.w13, &grads.w2}, MeshGroup::kDataParallel, mesh, staging, stream,
                "the expert gradient reduction");
  // The gate and the shared expert are replicated on every rank: summed over the world.
  mesh.all_reduce_sum(grads.gate_weight.data, grads.gate_weight.numel(), ncclFloat32,
                      MeshGroup::kWorld, stream);
  if (config.shared_experts()) {
    sum_gradients({&grads.shared_w13, &grads.shared_w2}, MeshGroup::kWorld, mesh, staging, stream,
                  "the shared expert's gradient reduction");
  }
  if (config.shared_gate) {
    mesh.all_reduce_sum(grads.shared_gate_weight.data, grads.shared_gate_weight.numel(),
                        ncclFloat32, MeshGroup::kWorld, stream);
  }
}

}  // namespace moe
