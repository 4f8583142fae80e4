// The router's losses from the mesh-wide statistics, the factors its backward takes, and the
// aux-loss-free update of the expert biases.
#include <cstdint>
#include <string>

#include "moe/error.h"
#include "router.cuh"
#include "router_device.cuh"

namespace moe {

using namespace router_detail;  // the code that the router_*.cu files share

namespace {

constexpr int kReduceThreads = 256;

__global__ void router_losses_kernel(int experts, int topk, const std::int32_t* f,
                                     const float* score_sum, const float* z_sum,
                                     const std::int64_t* global_tokens, double aux_coeff,
                                     double z_coeff, float* losses, float* factors) {
  __shared__ float partial[kReduceThreads / kWarpSize];
  float sum = 0.0f;
  if (f != nullptr) {
    for (int e = threadIdx.x; e < experts; e += kReduceThreads)
      sum += score_sum[e] * static_cast<float>(f[e]);
  }
  const float aux_total = block_tree_sum<kReduceThreads>(sum, partial);
  if (threadIdx.x == 0) {
    const double T = static_cast<double>(*global_tokens);
    const double aux_factor = T > 0 ? aux_coeff * experts / (topk * T * T) : 0.0;  // α·E/(K·T²)
    const double z_factor = T > 0 ? z_coeff / T : 0.0;                             // β/T
    losses[0] = f != nullptr ? static_cast<float>(aux_factor * aux_total) : 0.0f;
    losses[1] = z_sum != nullptr ? static_cast<float>(z_factor * *z_sum) : 0.0f;
    // The same values aux_loss_factor and z_loss_factor give on the host.
    factors[0] = f != nullptr ? static_cast<float>(aux_factor) : 0.0f;
    factors[1] = z_sum != nullptr ? static_cast<float>(z_factor) : 0.0f;
  }
}

__global__ void update_expert_bias_kernel(float* bias, const std::int32_t* load, int experts,
                                          float rate) {
  __shared__ long long partial[kReduceThreads / kWarpSize];
  long long sum = 0;
  for (int e = threadIdx.x; e < experts; e += kReduceThreads) sum += load[e];
  // Compare load_i · E with the total rather than with a rounded mean: the sign is exact.
  const long long total = block_tree_sum<kReduceThreads>(sum, partial);
  for (int e = threadIdx.x; e < experts; e += kReduceThreads) {
    const long long gap = total - static_cast<long long>(load[e]) * experts;
    bias[e] += rate * static_cast<float>((gap > 0) - (gap < 0));
  }
}

__global__ void accumulate_load_kernel(std::int64_t* total, const std::int32_t* load, int experts) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < experts; e += gridDim.x * blockDim.x)
    total[e] += load[e];
}

}  // namespace

float aux_loss_factor(const RouterParams& params, double aux_loss_coeff,
                      std::int64_t global_tokens) {
  if (global_tokens == 0) return 0.0f;
  const double T = static_cast<double>(global_tokens);
  return static_cast<float>(aux_loss_coeff * params.num_experts / (params.topk * T * T));
}

float z_loss_factor(double z_loss_coeff, std::int64_t global_tokens) {
  if (global_tokens == 0) return 0.0f;
  return static_cast<float>(z_loss_coeff / static_cast<double>(global_tokens));
}

void router_losses(const RouterParams& params, double aux_loss_coeff, double z_loss_coeff,
                   const std::int32_t* aux_tokens_per_expert, const float* aux_score_sum,
                   const float* z_sum, const std::int64_t* global_tokens, float* losses,
                   float* factors, cudaStream_t stream) {
  if (losses == nullptr || factors == nullptr || global_tokens == nullptr)
    fail("router_losses: global_tokens, losses and factors are required");
  router_losses_kernel<<<1, kReduceThreads, 0, stream>>>(
      params.num_experts, params.topk, params.aux_loss ? aux_tokens_per_expert : nullptr,
      aux_score_sum, params.z_loss ? z_sum : nullptr, global_tokens, aux_loss_coeff, z_loss_coeff,
      losses, factors);
  MOE_CHECK_LAUNCH();
}

void update_expert_bias(float* expert_bias, const std::int32_t* load, int num_experts, float rate,
                        cudaStream_t stream) {
  if (num_experts < 1) fail("update_expert_bias: num_experts = " + std::to_string(num_experts));
  update_expert_bias_kernel<<<1, kReduceThreads, 0, stream>>>(expert_bias, load, num_experts, rate);
  MOE_CHECK_LAUNCH();
}

void accumulate_load(std::int64_t* total, const std::int32_t* load, int num_experts,
                     cudaStream_t stream) {
  if (num_experts <= 0) return;
  accumulate_load_kernel<<<(num_experts + kReduceThreads - 1) / kReduceThreads, kReduceThreads, 0,
                           stream>>>(total, load, num_experts);
  MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace moe
