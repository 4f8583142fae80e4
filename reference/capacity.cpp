// Capacity mode in fp64 (docs/design.md, "Capacity mode"): which routed slots of one source rank
// keep their row when an expert is offered more than its capacity.
#include <algorithm>

#include "moe/error.h"
#include "reference/reference.h"

namespace moe::reference {

std::vector<int> keep_within_capacity(const MoEConfig& config, const Routing& routing) {
  const int E = config.num_experts;
  std::vector<int> kept(routing.expert.size(), 1);
  if (!config.capacity_mode()) return kept;
  const auto capacity = static_cast<std::size_t>(config.expert_capacity(routing.tokens));

  // Each expert's slots in (token, slot) order: the order position keeps, and the order of ties
  // under probs.
  std::vector<std::vector<std::size_t>> slots_of(static_cast<std::size_t>(E));
  for (std::size_t i = 0; i < routing.expert.size(); ++i) {
    const int e = routing.expert[i];
    if (e < 0 || e >= E) fail("keep_within_capacity: expert {} of {}", e, E);
    slots_of[static_cast<std::size_t>(e)].push_back(i);
  }
  for (auto& slots : slots_of) {
    if (slots.size() <= capacity) continue;
    if (config.drop_policy == DropPolicy::kProbs) {
      // Stable: equal probabilities keep (token, slot) order, so the lower token wins a tie.
      std::stable_sort(slots.begin(), slots.end(), [&](std::size_t a, std::size_t b) {
        return routing.prob[a] > routing.prob[b];
      });
    }
    for (std::size_t j = capacity; j < slots.size(); ++j) kept[slots[j]] = 0;
  }
  return kept;
}

std::vector<double> dropped_per_expert(const Routing& routing, std::span<const int> kept,
                                       int num_experts) {
  if (kept.size() != routing.expert.size())
    fail("dropped_per_expert: {} kept flags for {} slots", kept.size(), routing.expert.size());
  std::vector<double> dropped(static_cast<std::size_t>(num_experts), 0.0);
  for (std::size_t i = 0; i < kept.size(); ++i) {
    const int e = routing.expert[i];
    if (e < 0 || e >= num_experts) fail("dropped_per_expert: expert {} of {}", e, num_experts);
    if (kept[i] == 0) dropped[static_cast<std::size_t>(e)] += 1.0;
  }
  return dropped;
}

}  // namespace moe::reference
