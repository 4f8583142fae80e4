// MoEBlock::reduce_gradients: the expert gradients summed over the DP group, the gate's and the
// shared expert's over the world (docs/design.md, "Gradient reduction"). Sums, never averages:
// the trainer scales. bf16 gradients are summed in fp32.
#pragma once

#include <cuda_runtime_api.h>

#include "moe/device.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"

namespace moe {

// staging: the scratch's, for the fp32 sum of bf16 gradients. The config says which gradients
// exist (never the pointers: bound tensors a config does not use must not be reduced on some
// ranks only).
void reduce_gradients(const MoEConfig& config, const MoEGradients& grads, const Mesh& mesh,
                      DeviceBuffer& staging, cudaStream_t stream);

}  // namespace moe
