// The shared expert's own kernels (its FFN runs on ExpertFFN as one expert over every token): the
// optional sigmoid gate, forward and backward, and the sums that add its output to the layer's
// output and its input gradient to dx. Every sum runs in a fixed order: bitwise deterministic.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "moe/tensor.h"

namespace moe {

// logit[t] = x[t] · weight (fp32 accumulation), gate[t] = σ(logit[t]). x [T, H] and weight [1, H]
// of one dtype (bf16 or fp32); logit and gate fp32 [T].
void shared_gate_forward(const Tensor& x, const Tensor& weight, float* logit, float* gate,
                         cudaStream_t stream);

// Workspace of shared_gate_backward: partial column sums over slices of the tokens.
std::size_t shared_gate_workspace_bytes(std::int64_t tokens, std::int64_t hidden);

// From dgate[t] = ∂L/∂gate[t]: dgate becomes dlogit[t] = dgate[t]·σ'(logit[t]) in place, and
// weight_grad [H] (fp32, overwritten) = Σ_t dlogit[t]·x[t].
void shared_gate_backward(const Tensor& x, const float* logit, float* dgate, float* weight_grad,
                          void* workspace, cudaStream_t stream);

// dx += dx_shared, plus dlogit[t]·weight with the gate (dlogit null: none). dx, dx_shared [T, H]
// and weight [1, H] of one dtype; the sum in fp32, rounded once.
void add_shared_input_grad(const Tensor& dx, const Tensor& dx_shared, const float* dlogit,
                           const Tensor& weight, cudaStream_t stream);

// target += addend, both of one dtype and element count; the sum in fp32, rounded once.
void add_into(const Tensor& target, const Tensor& addend, cudaStream_t stream);

}  // namespace moe
