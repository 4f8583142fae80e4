#include "src/gradient_reduction.h"

#include <algorithm>
#include <cstdint>

#include "kernels/elementwise.cuh"

namespace moe {

void reduce_gradients(const MoEGradients& grads, const Mesh& mesh, DeviceBuffer& staging,
                      cudaStream_t stream) {
  const DType grad_dtype = grads.w13.dtype;
  if (grad_dtype == DType::kBF16 && mesh.dp() > 1) {
    // NCCL would round every hop's partial sum to bf16: widen a chunk at a time to fp32, sum,
    // narrow back, through one bounded staging buffer.
    constexpr std::int64_t kStageElements = std::int64_t{16} << 20;  // 64 MiB of fp32
    for (const Tensor* grad : {&grads.w13, &grads.w2}) {
      const std::int64_t total = grad->numel();
      staging.reserve(static_cast<std::size_t>(std::min(total, kStageElements)) * 4);
      for (std::int64_t first = 0; first < total; first += kStageElements) {
        const std::int64_t n = std::min(kStageElements, total - first);
        const Tensor part(static_cast<std::uint16_t*>(grad->data) + first, DType::kBF16, {n});
        const Tensor wide(staging.data(), DType::kFP32, {n});
        convert(part, wide, stream);
        mesh.all_reduce_sum(wide.data, static_cast<std::size_t>(n), ncclFloat32,
                            MeshGroup::kDataParallel, stream);
        convert(wide, part, stream);
      }
    }
  } else {
    const ncclDataType_t type = grad_dtype == DType::kBF16 ? ncclBfloat16 : ncclFloat32;
    mesh.group_start();
    mesh.all_reduce_sum(grads.w13.data, grads.w13.numel(), type, MeshGroup::kDataParallel, stream);
    mesh.all_reduce_sum(grads.w2.data, grads.w2.numel(), type, MeshGroup::kDataParallel, stream);
    mesh.group_end("the expert gradient reduction");
  }
  mesh.all_reduce_sum(grads.gate_weight.data, grads.gate_weight.numel(), ncclFloat32,
                      MeshGroup::kWorld, stream);
}

}  // namespace moe
