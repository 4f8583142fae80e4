// Capacity mode's drops on one rank's routing (docs/design.md, "Capacity mode"): each expert keeps
// at most `capacity` of the slots routed to it, the first in (token, slot) order (drop by
// position) or those of the highest probability, ties to the earlier slot (drop by probability).
//
// The kept routing is the routing with each dropped slot sent to the extra group `experts` at
// probability 0: a layout built over the experts' groups, as every exchange builds it, gives them
// no rows (build_layout), so nothing is stored, sent or computed for them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe {

struct CapacityArgs {
  const std::int32_t* topk_idx = nullptr;  // [T, K]
  const float* topk_p = nullptr;           // [T, K]
  // The unpadded layout of topk_idx over `experts` groups (build_layout with align 1): each
  // group's rows in (token, slot) order.
  const std::int32_t* offsets = nullptr;  // [E + 1]
  const std::int32_t* row_map = nullptr;  // [T, K]
  std::int64_t tokens = 0;
  int topk = 0;
  int experts = 0;
  std::int64_t capacity = 0;  // slots each expert keeps at most
  bool by_probability = true;
  std::int32_t* kept = nullptr;      // [T, K] out: 1 where the slot keeps its row, else 0
  std::int32_t* kept_idx = nullptr;  // [T, K] out: topk_idx, or `experts` where dropped
  float* kept_p = nullptr;           // [T, K] out: topk_p, or 0 where dropped
  std::int32_t* dropped = nullptr;   // [E] out: dropped slots per expert
  // Optional, both or neither: the routed slots per expert [E] in, the kept ones [E] out.
  const std::int32_t* routed_counts = nullptr;
  std::int32_t* kept_counts = nullptr;
  void* workspace = nullptr;  // capacity_workspace_bytes()
};

std::size_t capacity_workspace_bytes(std::int64_t tokens, int topk, int experts);
void keep_within_capacity(const CapacityArgs& args, cudaStream_t stream);

}  // namespace moe
