// SwiGLU between the expert GEMMs: a = silu(h_gate) ⊙ h_up over all experts' rows at once, and
// its backward. fp32 math whatever the storage dtype.
#pragma once

#include <cuda_runtime_api.h>

#include "moe/tensor.h"

namespace moe {

// h [rows, 2F] (columns [0, F) gate, [F, 2F) up) -> a [rows, F].
void swiglu_forward(const Tensor& h, const Tensor& a, cudaStream_t stream);

// From h and dA [rows, F]: dh [rows, 2F] (dgate = dA·up·silu'(gate), dup = dA·silu(gate)) and
// a = silu(gate)·up again (the down GEMM's weight gradient needs it), in one pass. In place
// allowed: dh may be h and a may be dA.
void swiglu_backward(const Tensor& h, const Tensor& dA, const Tensor& dh, const Tensor& a,
                     cudaStream_t stream);

}  // namespace moe
