// The router on the GPU: the fused routing (score function, grouped top-K, expert bias,
// probabilities, scaling), the statistics of the aux and z losses, their values, the backward into
// dlogits, and the aux-loss-free expert-bias update.
//
// A team of lanes handles one token (8 lanes for E ≤ 64, 16 for E ≤ 128, the whole warp above;
// each lane a contiguous chunk of experts, or every 32nd expert above E = 512), its E logits held
// in registers, so E up to 2048 and K up to 16 need no shared-memory rows of logits (the backward
// stages one row per team to add the selected entries' terms; above 512 experts the biases, score
// sums and aux gradients, the same for every token, sit in shared memory to free registers). The
// forward is one kernel: the last of its blocks to finish turns the per-block totals into the
// counts and sums (no memsets, no second launch). Everything is deterministic: counts and the
// aux score sums cross blocks as integers (sums in 64-bit fixed point), z in a fixed order.
//
// The implementation: router_forward.cu, router_backward.cu and router_losses.cu, with the device
// code they share in router_device.cuh, the forward's selection in router_select.cuh, and the host
// side of their launches in router_launch.h / router_launch.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "moe/tensor.h"
#include "moe/types.h"

namespace moe {

struct RouterParams {
  int num_experts = 0;
  int topk = 0;
  ScoreFunction score_function = ScoreFunction::kSoftmax;
  bool pre_softmax = false;
  int num_groups = 0;  // 0 = plain top-K
  int group_topk = 0;
  float scaling_factor = 1.0f;
  bool expert_bias = false;
  bool aux_loss = false;  // compute the aux-loss statistics
  bool z_loss = false;    // compute Σ logsumexp²

  // The aux routing (plain top-K of the aux scores) equals the main routing when there are no
  // groups and no bias: then its counts are the main counts and its top-K is not run twice.
  constexpr bool aux_routing_is_main() const { return num_groups == 0 && !expert_bias; }
};

struct RouterForwardArgs {
  const void* logits = nullptr;  // [T, E], fp32 or bf16
  DType logits_dtype = DType::kFP32;
  std::int64_t tokens = 0;
  const float* expert_bias = nullptr;  // [E] when params.expert_bias

  std::int32_t* topk_idx = nullptr;           // [T, K] out
  float* topk_p = nullptr;                    // [T, K] out
  std::int32_t* tokens_per_expert = nullptr;  // [E] out: main routing counts
  // With params.aux_loss: f [E] (aux routing counts) and P [E] (Σ_t aux scores).
  std::int32_t* aux_tokens_per_expert = nullptr;
  float* aux_score_sum = nullptr;
  float* z_sum = nullptr;     // [1] out with params.z_loss: Σ_t logsumexp(logits[t])²
  void* workspace = nullptr;  // router_workspace_bytes(), zeroed once by router_workspace_clear

  // When these tokens are the whole batch (one GPU, nothing to sum over a mesh): with `losses`
  // set, the forward also writes losses[0] = L_aux and losses[1] = L_z, as router_losses would
  // with T_glob = tokens, from the last block, saving router_losses' launch (3–4 µs).
  float* losses = nullptr;  // [2] out
  double aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;
};

// Workspace of router_forward for `tokens` tokens on the current device. It carries the
// forward's cross-block totals: zero it once with router_workspace_clear after allocating it;
// every router_forward leaves it zero again. One workspace serves one stream at a time.
std::size_t router_workspace_bytes(const RouterParams& params, std::int64_t tokens);
void router_workspace_clear(const RouterParams& params, void* workspace, cudaStream_t stream);

void router_forward(const RouterParams& params, const RouterForwardArgs& args, cudaStream_t stream);

// Routing replay, after router_forward on the same logits: each token's slots take the given
// experts (in the given order), with probabilities recomputed by the score function's rule and
// scaled; a token whose given experts are what the forward selected keeps the forward's
// probabilities bit for bit, so replaying a recorded step reproduces it. tokens_per_expert is
// counted again for the given routing. A token with an expert outside [0, E) or one repeated keeps
// the forward's selection, and *first_invalid (set to all ones by the caller) receives
// min((t·K + k) << 32 | expert) over its bad slots: the caller raises the error once it reads it.
// The loss statistics stay those of the forward.
struct RouterReplayArgs {
  const float* logits = nullptr;        // [T, E] fp32, as the forward read them
  const std::int32_t* given = nullptr;  // [T, K]
  std::int64_t tokens = 0;
  std::int32_t* topk_idx = nullptr;             // [T, K] in: the forward's; out: the given
  float* topk_p = nullptr;                      // [T, K] in: the forward's; out: the given's
  std::int32_t* tokens_per_expert = nullptr;    // [E] out
  unsigned long long* first_invalid = nullptr;  // [1] in/out
};
void router_replay(const RouterParams& params, const RouterReplayArgs& args, cudaStream_t stream);

// The loss values from the statistics summed over the mesh: losses[0] = L_aux, losses[1] = L_z.
// Counts f and sums P are those of the whole mesh; *global_tokens (device) is T_glob, read on the
// device, so that neither the values nor the backward need the host. factors (device fp32 [2])
// receives what the backward takes, α·E/(K·T_glob²) and β/T_glob (0 for a loss that is off).
void router_losses(const RouterParams& params, double aux_loss_coeff, double z_loss_coeff,
                   const std::int32_t* aux_tokens_per_expert, const float* aux_score_sum,
                   const float* z_sum, const std::int64_t* global_tokens, float* losses,
                   float* factors, cudaStream_t stream);

struct RouterBackwardArgs {
  const void* logits = nullptr;  // [T, E] as in forward
  DType logits_dtype = DType::kFP32;
  std::int64_t tokens = 0;
  const std::int32_t* topk_idx = nullptr;  // [T, K] from forward: K distinct experts a row
  const float* topk_p = nullptr;           // [T, K] from forward
  const float* dprob = nullptr;            // [T, K] ∂L/∂topk_p; null = none
  // Aux-loss gradient: the mesh-wide f [E], and α·E/(K·T_glob²); null / 0 = none.
  const std::int32_t* aux_tokens_per_expert = nullptr;
  float aux_factor = 0.0f;
  float z_factor = 0.0f;  // β / T_glob; 0 = none
  // Or both factors on the device, fp32 {aux, z} as router_losses writes them (T_glob then never
  // reaches the host); when set, aux_factor and z_factor are not read.
  const float* loss_factors = nullptr;
  float* dlogits = nullptr;  // [T, E] out, fp32, every element written
};

void router_backward(const RouterParams& params, const RouterBackwardArgs& args,
                     cudaStream_t stream);

// α·E/(K·T²) and β/T: the factors the backward takes (0 when T = 0).
float aux_loss_factor(const RouterParams& params, double aux_loss_coeff,
                      std::int64_t global_tokens);
float z_loss_factor(double z_loss_coeff, std::int64_t global_tokens);

// Load statistics: total[i] += load[i] for the E experts (int64 totals of int32 step counts).
void accumulate_load(std::int64_t* total, const std::int32_t* load, int num_experts,
                     cudaStream_t stream);

// Aux-loss-free balancing: bias[i] += rate · sign(mean_j load_j − load_i), load = mesh-wide counts.
void update_expert_bias(float* expert_bias, const std::int32_t* load, int num_experts, float rate,
                        cudaStream_t stream);

}  // namespace moe
