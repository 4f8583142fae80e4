// SwiGLU between the expert GEMMs: a = silu(h_gate) ⊙ h_up over all experts' rows at once, and
// its backward. fp32 math whatever the storage dtype.
#pragma once

#include <cuda_runtime_api.h>

#include "moe/tensor.h"

namespace moe {

// h [rows, 2F] (columns [0, F) gate, [F, 2F) up) -> a [rows, F]. With scale (fp32 [rows], or an
// empty tensor for none): a = scale ⊙ silu(h_gate) ⊙ h_up, each row weighed before rounding —
// the routing probabilities applied inside the experts, so that y = a·w2ᵀ is already weighed.
void swiglu_forward(const Tensor& h, const Tensor& a, cudaStream_t stream,
                    const Tensor& scale = {});

// From h and dA [rows, F]: dh [rows, 2F] (dgate = dA·up·silu'(gate), dup = dA·silu(gate)) and
// a = silu(gate)·up again (the down GEMM's weight gradient needs it), in one pass. In place
// allowed: dh may be h and a may be dA.
// With scale (as in the forward; dA is then the gradient of the weighed a): a is written weighed,
// dh takes scale·dA, and dscale [rows] = Σ_f dA·silu(gate)·up, the row's fp32 dot, its weight's
// gradient; dscale may be scale itself (each row's weight is read before its gradient is written).
void swiglu_backward(const Tensor& h, const Tensor& dA, const Tensor& dh, const Tensor& a,
                     cudaStream_t stream, const Tensor& scale = {}, const Tensor& dscale = {});

}  // namespace moe
