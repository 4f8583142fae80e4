// Element type conversion on the device: fp32 <-> bf16 (round to nearest even) and copies.
#pragma once

#include <cuda_runtime_api.h>

#include "moe/tensor.h"

namespace moe {

// out = in converted to out's dtype; both bf16 or fp32 with the same element count.
void convert(const Tensor& in, const Tensor& out, cudaStream_t stream);

}  // namespace moe
