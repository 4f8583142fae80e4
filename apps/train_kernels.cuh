// The device work of moe_train's model around the layers: residual sums, the regression loss and
// AdamW with fp32 master weights. A trainer's own code, not part of the library.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moe/tensor.h"

namespace moe::train {

// out = a + b elementwise (bf16 or fp32, all three the same dtype; out may be a or b).
void add(const Tensor& a, const Tensor& b, const Tensor& out, cudaStream_t stream);

// grad = scale · 2 · (pred − target); partial_sums[blocks] (fp32, device) get Σ (pred − target)²
// per block, in a fixed order. Returns the number of partial sums written (≤ kLossBlocks).
inline constexpr int kLossBlocks = 256;
int squared_error(const Tensor& pred, const Tensor& target, float scale, const Tensor& grad,
                  float* partial_sums, cudaStream_t stream);

// One AdamW step on n elements (decoupled weight decay, bias-corrected moments):
//   m = β1·m + (1 − β1)·g;  v = β2·v + (1 − β2)·g²
//   master −= lr · (m / (1 − β1^t) / (sqrt(v / (1 − β2^t)) + ε) + wd · master)
// then param = master in param's dtype. grad bf16 or fp32; master, m, v fp32.
struct AdamWHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  int step = 1;  // t, from 1
};
void adamw_step(const AdamWHyper& hyper, const Tensor& grad, float* master, float* m, float* v,
                const Tensor& param, cudaStream_t stream);

}  // namespace moe::train
