// Capacity mode's drops in the block (docs/design.md, "Capacity mode"): after the router, each
// expert keeps at most C of this rank's slots; the kept routing sends the others to an extra group
// at probability 0, which the exchange lays out past every expert and never sends (under EP), or
// gives no rows (on one GPU).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moe/config.h"
#include "moe/device.h"
#include "src/exchange_impl.h"

namespace moe {

class CapacityStage {
 public:
  CapacityStage(const MoEConfig& config, DeviceBuffer& layout_workspace);

  // The drops of this rank's T tokens, from the router's topk_idx, topk_p [T, K] and its counts
  // [E] (routed, before the drops). The results live until the next forward.
  void forward(const std::int32_t* topk_idx, const float* topk_p, const std::int32_t* routed_counts,
               std::int64_t tokens, cudaStream_t stream);

  const std::int32_t* kept_idx() const { return kept_idx_.as<std::int32_t>(); }        // [T, K]
  const float* kept_p() const { return kept_p_.as<float>(); }                          // [T, K]
  const std::int32_t* kept() const { return kept_.as<std::int32_t>(); }                // [T, K]
  const std::int32_t* dropped() const { return dropped_.as<std::int32_t>(); }          // [E]
  const std::int32_t* kept_counts() const { return kept_counts_.as<std::int32_t>(); }  // [E]

 private:
  MoEConfig config_;
  SlotLayout layout_;  // the routed slots' unpadded layout, each expert's in (token, slot) order
  DeviceBuffer kept_, kept_idx_, kept_p_, dropped_, kept_counts_, workspace_;
};

}  // namespace moe
