// Routings for the permute tests (test_permute.cpp, test_permute_dropped.cpp): each token's K
// distinct experts, and capacity mode's drops as the kernels see them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "reference/reference.h"

namespace moe::test {

// Each token's `topk` distinct experts, at probabilities in [0.05, 1); skewed: every token to
// experts 0..topk-1.
inline reference::Routing draw_routing(std::int64_t tokens, int experts, int topk, bool skewed,
                                       std::mt19937_64& rng) {
  reference::Routing routing;
  routing.tokens = tokens;
  routing.topk = topk;
  std::vector<int> all(experts);
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<double> prob(0.05, 1.0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    if (!skewed) std::shuffle(all.begin(), all.end(), rng);
    for (int k = 0; k < topk; ++k) {
      routing.expert.push_back(all[k]);
      routing.prob.push_back(prob(rng));
    }
  }
  return routing;
}

// A share of the slots dropped at random: `kept` [T·K] (1 kept, 0 dropped) for the reference's
// layout, and the kernels' kept routing, where a dropped slot names group `experts`. Share 0
// draws nothing, so a seed's other draws stay as they were.
struct DroppedSlots {
  std::vector<int> kept;
  std::vector<std::int32_t> topk_idx;
};
inline DroppedSlots drop_slots(const reference::Routing& routing, int experts, double share,
                               std::mt19937_64& rng) {
  DroppedSlots d{std::vector<int>(routing.expert.size(), 1),
                 std::vector<std::int32_t>(routing.expert.begin(), routing.expert.end())};
  if (share <= 0) return d;
  std::bernoulli_distribution drop(share);
  for (std::size_t i = 0; i < d.kept.size(); ++i) {
    if (drop(rng)) {
      d.kept[i] = 0;
      d.topk_idx[i] = experts;
    }
  }
  return d;
}

}  // namespace moe::test
