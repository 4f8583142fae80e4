#include "src/capacity_stage.h"

#include "kernels/capacity.cuh"
#include "src/stage_support.h"

namespace moe {

CapacityStage::CapacityStage(const MoEConfig& config, DeviceBuffer& layout_workspace)
    : config_(config), layout_(layout_workspace) {}

void CapacityStage::forward(const std::int32_t* topk_idx, const float* topk_p,
                            const std::int32_t* routed_counts, std::int64_t tokens,
                            cudaStream_t stream) {
  const int E = config_.num_experts, K = config_.topk;
  const auto slots = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(K);
  layout_.build(topk_idx, tokens, K, E, /*align=*/1, stream);
  CapacityArgs a;
  a.topk_idx = topk_idx;
  a.topk_p = topk_p;
  a.offsets = layout_.offsets();
  a.row_map = layout_.row_map();
  a.tokens = tokens;
  a.topk = K;
  a.experts = E;
  a.capacity = config_.expert_capacity(tokens);
  a.by_probability = config_.drop_policy == DropPolicy::kProbs;
  a.kept = typed<std::int32_t>(kept_, slots);
  a.kept_idx = typed<std::int32_t>(kept_idx_, slots);
  a.kept_p = typed<float>(kept_p_, slots);
  a.dropped = typed<std::int32_t>(dropped_, static_cast<std::size_t>(E));
  a.routed_counts = routed_counts;
  a.kept_counts = typed<std::int32_t>(kept_counts_, static_cast<std::size_t>(E));
  workspace_.reserve(capacity_workspace_bytes(tokens, K, E));
  a.workspace = workspace_.data();
  keep_within_capacity(a, stream);
}

}  // namespace moe
