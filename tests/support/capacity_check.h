// What the capacity-mode block tests share.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "moe/config.h"
#include "reference/reference.h"
#include "support/test_util.h"

namespace moe::test {

// The capacity-mode block tests' layer: the small shape, both losses, the given capacity.
inline MoEConfig capacity_config(DType dtype, double factor, DropPolicy policy, int align) {
  MoEConfig c = small_config(64, 48, 8, 2);
  c.dtype = dtype;
  c.gemm_autotune = run_size() != RunSize::kQuick;
  c.capacity_factor = factor;
  c.drop_policy = policy;
  c.align_size = align;
  c.aux_loss_coeff = 0.05;
  c.z_loss_coeff = 0.01;
  c.validate();
  return c;
}

// Whether, for each expert offered more than C slots, its C-th and (C+1)-th largest routed
// probabilities are at least 1e-6 apart: far more than the GPU's fp32 error on them (about 1e-8),
// so both keep the same slots. Ties elsewhere decide nothing.
inline bool capacity_boundary_clear(const MoEConfig& c, std::int64_t tokens,
                                    const reference::LayerResult& want) {
  if (c.drop_policy == DropPolicy::kPosition || tokens == 0) return true;
  const auto capacity = static_cast<std::size_t>(c.expert_capacity(tokens));
  std::vector<std::vector<double>> of_expert(static_cast<std::size_t>(c.num_experts));
  for (std::size_t i = 0; i < want.routing.expert.size(); ++i)
    of_expert[static_cast<std::size_t>(want.routing.expert[i])].push_back(want.routing.prob[i]);
  for (auto& probs : of_expert) {
    if (probs.size() <= capacity || capacity == 0) continue;
    std::sort(probs.rbegin(), probs.rend());
    if (probs[capacity - 1] - probs[capacity] < 1e-6) return false;
  }
  return true;
}

}  // namespace moe::test
