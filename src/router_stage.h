// The router: top-K routing, probabilities and expert counts from the logits; the loss statistics
// summed over the mesh and the loss values; the backward into dlogits (docs/design.md, "Router",
// "Losses" and "Router backward").
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/router.cuh"
#include "moe/config.h"
#include "moe/device.h"
#include "moe/mesh.h"
#include "moe/tensor.h"

namespace moe {

// What the host learns from the router, with the dispatch's row counts: the forward's one host
// synchronisation carries these bytes from the device too (the layout of `scalars`).
struct RouterTotals {
  static constexpr std::uint64_t kAllGivenValid = ~std::uint64_t{0};

  std::int64_t global_tokens = 0;  // T_glob
  float losses[2] = {};            // L_aux, L_z
  // Routing replay: this rank's first invalid given slot, (t·K + k) << 32 | expert, or
  // kAllGivenValid; and the smallest of every rank's, so that all ranks fail in the same forward.
  std::uint64_t first_invalid_given = kAllGivenValid;
  std::uint64_t mesh_first_invalid_given = kAllGivenValid;
  // This rank's count of forwards as {count, -count}, reduced by max over the world: each reads
  // back as this rank's own unless a rank is at another forward. A rank whose peers gave up on it
  // and aborted can see its collectives complete over what they last left behind; this tells it.
  std::int64_t forward_agreement[2] = {};
};
static_assert(sizeof(RouterTotals) == 48);

// The router kernels' parameters for a layer's config: the kernels take plain values, never the
// config itself.
RouterParams router_params(const MoEConfig& config);

class RouterStage {
 public:
  RouterStage(const MoEConfig& config, const Mesh& mesh, DeviceBuffer& workspace);

  // Router forward on logits [T, E] (kept for the backward): topk_idx, topk_p, this rank's counts
  // and the loss statistics; on one rank, whose tokens are the whole batch, the loss values too.
  // `given` (device int32 [T, K], or null): routing replay, the slots take these experts.
  void forward(const Tensor& logits, const Tensor& expert_bias, const std::int32_t* given,
               cudaStream_t stream);
  // The statistics, the loads and the token count summed over the world (one NCCL group), then
  // the loss values from them (on a mesh), ready on the device before the dispatch copies them.
  // In capacity mode `dropped` [E] is this rank's dropped slots per expert, summed over the world
  // in the same group and added to the drop totals; null when dropless.
  void reduce_losses(const std::int32_t* dropped, cudaStream_t stream);
  // Checks what the host learnt in the forward's wait (a forward that does not wait for the host
  // need not call it; the backward's loss factors never come from it). Throws
  // moe::Error naming the token, slot and expert when this rank's replayed routing held an
  // invalid one, and on the other ranks of the mesh an error saying that a peer's did.
  void set_totals(const RouterTotals& totals);

  // ∂L/∂logits [T, E] fp32 from dprob [T, K] (∂L/∂topk_p) and the loss gradients.
  void backward(const float* dprob, const Tensor& dlogits, cudaStream_t stream);

  // [T, K] each slot's global expert, descending score order; [T, K] its scaled probability.
  std::int32_t* topk_idx() const { return topk_idx_.as<std::int32_t>(); }
  float* topk_p() const { return topk_p_.as<float>(); }
  // [E] this rank's tokens per expert; the mesh's (null before the first forward).
  std::int32_t* tokens_per_expert() const { return counts_.as<std::int32_t>(); }
  const std::int32_t* global_load() const { return global_load_.as<std::int32_t>(); }
  // [E] int64: the mesh-wide loads summed over the forwards since construction or the last reset
  // (null before the first forward), and how many forwards that is.
  const std::int64_t* load_total() const { return load_total_.as<std::int64_t>(); }
  // Capacity mode: [E] int64, the mesh-wide dropped slots over the same forwards (null when
  // dropless or before the first forward).
  const std::int64_t* drop_total() const { return drop_total_.as<std::int64_t>(); }
  std::int64_t load_steps() const { return load_steps_; }
  void reset_load_total(cudaStream_t stream);
  // RouterTotals on the device, complete once reduce_losses' work has run.
  const void* device_totals() const { return scalars_.data(); }
  // Its loss values, fp32 {L_aux, L_z}.
  float* device_losses() const { return scalars_.as<RouterTotals>()->losses; }

 private:
  MoEConfig config_;
  const Mesh& mesh_;
  RouterParams params_;
  DeviceBuffer& workspace_;  // the scratch's

  DeviceBuffer topk_idx_, topk_p_, counts_, aux_counts_, score_sum_, z_sum_, global_load_, scalars_;
  DeviceBuffer load_total_, global_dropped_, drop_total_;
  // On a mesh: the backward's loss factors {α·E/(K·T_glob²), β/T_glob}, from router_losses.
  DeviceBuffer loss_factors_;
  std::int64_t load_steps_ = 0;
  std::int64_t forwards_ = 0;  // every forward's, never reset: the mesh's agreement on the step

  // What the forward keeps for the backward, beside topk_idx, topk_p and the mesh-wide aux counts.
  struct Saved {
    Tensor logits;
    std::int64_t global_tokens = 0;  // on one rank (T); a mesh's stays on the device
  } saved_;
};

}  // namespace moe
