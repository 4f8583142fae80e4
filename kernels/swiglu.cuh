// SwiGLU between the expert GEMMs: a = silu(h_gate) ⊙ h_up over all experts' rows at once, and
// its backward. fp32 math whatever the storage dtype.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

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

// ---- With the output quantized for the FP8 experts' next product (docs/design.md, "FP8"): E4M3
// codes [rows, cols] and the 1 × 128 row blocks' scales where quantize_row_blocks_segmented puts
// them, segment s (an expert) owning rows [offsets[s], offsets[s + 1]) (host, [segments + 1]).
struct Fp8RowBlocks {
  std::uint8_t* codes = nullptr;
  float* scales = nullptr;
  std::span<const std::int64_t> offsets;
};

// swiglu_forward, and a (bf16) quantized as quantize_row_blocks_segmented(a, offsets, F) would,
// bit for bit. One pass where F is a multiple of 128 and the rows are 16-byte aligned (each of a's
// blocks then comes from one warp's registers), otherwise the two calls.
void swiglu_forward_fp8(const Tensor& h, const Tensor& a, const Fp8RowBlocks& out,
                        cudaStream_t stream, const Tensor& scale = {});

// swiglu_backward, and dh [rows, 2F] (bf16) quantized as quantize_row_blocks_segmented(dh,
// offsets, 2F) would, bit for bit, under the same conditions for one pass. In place as
// swiglu_backward allows.
void swiglu_backward_fp8(const Tensor& h, const Tensor& dA, const Tensor& dh, const Tensor& a,
                         const Fp8RowBlocks& out, cudaStream_t stream, const Tensor& scale = {},
                         const Tensor& dscale = {});

}  // namespace moe
