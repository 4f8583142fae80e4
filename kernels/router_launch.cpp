#include "router_launch.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>

namespace moe::router_detail {
namespace {

// The byte offsets of ForwardState's arrays in the workspace, each on a 256-byte boundary; the z
// partials are sized for the largest grid, one wave of kMaxBlocksPerSm blocks on every SM.
struct WorkspaceLayout {
  std::size_t counts, aux_counts, score_sum, z_partials, bytes;
  static WorkspaceLayout of(int experts, int max_blocks) {
    auto round_up = [](std::size_t n) { return (n + 255) / 256 * 256; };
    WorkspaceLayout w{};
    w.counts = 256;
    w.aux_counts = w.counts + round_up(static_cast<std::size_t>(experts) * 4);
    w.score_sum = w.aux_counts + round_up(static_cast<std::size_t>(experts) * 4);
    w.z_partials = w.score_sum + round_up(static_cast<std::size_t>(experts) * 8);
    w.bytes = w.z_partials + round_up(static_cast<std::size_t>(max_blocks) * 4);
    return w;
  }
};

int max_forward_blocks() {
  return sm_count() * kMaxBlocksPerSm;
}

}  // namespace

int sm_count() {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int>, kMaxDevices> counts{};
  int device = 0;
  MOE_CHECK_CUDA(cudaGetDevice(&device));
  if (device < kMaxDevices && counts[device].load(std::memory_order_relaxed) > 0)
    return counts[device].load(std::memory_order_relaxed);
  int count = 0;
  MOE_CHECK_CUDA(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (device < kMaxDevices) counts[device].store(count, std::memory_order_relaxed);
  return count;
}

int blocks_per_sm(const void* kernel, std::size_t shared_bytes) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, std::size_t>, int> known;
  const std::lock_guard lock(mutex);
  const auto key = std::make_pair(kernel, shared_bytes);
  if (const auto it = known.find(key); it != known.end()) return it->second;
  int per_sm = 0;
  MOE_CHECK_CUDA(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared_bytes));
  per_sm = std::clamp(per_sm, 1, kMaxBlocksPerSm);
  known.emplace(key, per_sm);
  return per_sm;
}

int grid_size(const void* kernel, std::size_t shared_bytes, std::int64_t tokens,
              int tokens_per_block) {
  const std::int64_t needed = (tokens + tokens_per_block - 1) / tokens_per_block;
  return static_cast<int>(std::max<std::int64_t>(
      1, std::min<std::int64_t>(needed, sm_count() * blocks_per_sm(kernel, shared_bytes))));
}

void check_params(const RouterParams& p) {
  if (p.num_experts < 1 || p.num_experts > kMaxExperts) {
    fail("router: num_experts = " + std::to_string(p.num_experts) + " must be in [1, " +
         std::to_string(kMaxExperts) + "]");
  }
  if (p.topk < 1 || p.topk > std::min(p.num_experts, kMaxTopK)) {
    fail("router: topk = " + std::to_string(p.topk) + " must be in [1, min(num_experts, " +
         std::to_string(kMaxTopK) + ")]");
  }
  if (p.num_groups > 0 &&
      (p.group_topk < 1 || p.group_topk > p.num_groups || p.num_experts % p.num_groups != 0 ||
       p.topk % p.group_topk != 0 || p.topk / p.group_topk > p.num_experts / p.num_groups)) {
    fail("router: invalid grouping num_groups = " + std::to_string(p.num_groups) +
         ", group_topk = " + std::to_string(p.group_topk));
  }
}

void check_logits_dtype(DType dtype) {
  if (dtype != DType::kFP32 && dtype != DType::kBF16) {
    fail("router: logits dtype = " + std::string(dtype_name(dtype)) + " must be fp32 or bf16");
  }
}

bool aligned_rows(const void* p, int experts, std::size_t element_bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0 && (experts * element_bytes) % 16 == 0;
}

ForwardState forward_state(void* workspace, int experts) {
  const auto w = WorkspaceLayout::of(experts, max_forward_blocks());
  auto* base = static_cast<unsigned char*>(workspace);
  return {reinterpret_cast<unsigned*>(base), reinterpret_cast<unsigned*>(base + w.counts),
          reinterpret_cast<unsigned*>(base + w.aux_counts),
          reinterpret_cast<unsigned long long*>(base + w.score_sum),
          reinterpret_cast<float*>(base + w.z_partials)};
}

}  // namespace moe::router_detail

namespace moe {

std::size_t router_workspace_bytes(const RouterParams& params, std::int64_t tokens) {
  (void)tokens;  // one wave at most, whatever the token count
  return router_detail::WorkspaceLayout::of(params.num_experts, router_detail::max_forward_blocks())
      .bytes;
}

void router_workspace_clear(const RouterParams& params, void* workspace, cudaStream_t stream) {
  if (workspace == nullptr) fail("router_workspace_clear: workspace is null");
  MOE_CHECK_CUDA(cudaMemsetAsync(workspace, 0, router_workspace_bytes(params, 0), stream));
}

}  // namespace moe
