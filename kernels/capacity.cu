// Capacity mode's drops. By position, a slot's rank among its expert's slots is its row in the
// unpadded layout minus its group's start. By probability, each group's probabilities are sorted
// descending with a stable segmented radix sort (equal probabilities keep (token, slot) order, so
// the earlier slot wins a tie); a slot's rank is its place in the sorted group.
#include <cub/device/device_segmented_radix_sort.cuh>

#include <algorithm>
#include <climits>
#include <string>

#include "capacity.cuh"
#include "moe/error.h"

namespace moe {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kAlign = 256;

int blocks_for(std::int64_t n) {
  return static_cast<int>(std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, 4096));
}

std::size_t aligned(std::size_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

// The sort's inputs and outputs and CUB's own storage, carved from one workspace.
struct SortSpace {
  float* keys_in = nullptr;
  float* keys_out = nullptr;
  std::int32_t* slots_in = nullptr;
  std::int32_t* slots_out = nullptr;
  void* temp = nullptr;
  std::size_t temp_bytes = 0;
};

std::size_t sort_temp_bytes(std::int64_t slots, int experts) {
  std::size_t bytes = 0;
  MOE_CHECK_CUDA(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, bytes, static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
      static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr),
      static_cast<int>(slots), experts, static_cast<const std::int32_t*>(nullptr),
      static_cast<const std::int32_t*>(nullptr)));
  return bytes;
}

SortSpace carve(void* workspace, std::int64_t slots, int experts) {
  const std::size_t array = aligned(static_cast<std::size_t>(slots) * 4);
  auto* base = static_cast<char*>(workspace);
  SortSpace s;
  s.keys_in = reinterpret_cast<float*>(base);
  s.keys_out = reinterpret_cast<float*>(base + array);
  s.slots_in = reinterpret_cast<std::int32_t*>(base + 2 * array);
  s.slots_out = reinterpret_cast<std::int32_t*>(base + 3 * array);
  s.temp = base + 4 * array;
  s.temp_bytes = sort_temp_bytes(slots, experts);
  return s;
}

// Each slot's probability and index at its row of the unpadded layout: the groups to sort.
__global__ void gather_by_row_kernel(const std::int32_t* __restrict__ row_map,
                                     const float* __restrict__ topk_p, std::int64_t slots,
                                     float* __restrict__ keys, std::int32_t* __restrict__ slot_of) {
  for (std::int64_t s = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; s < slots;
       s += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t row = row_map[s];
    keys[row] = topk_p[s];
    slot_of[row] = static_cast<std::int32_t>(s);
  }
}

// By probability: the slot at sorted place j of its group keeps its row if j is within capacity.
__global__ void keep_sorted_kernel(const std::int32_t* __restrict__ slot_of_sorted,
                                   const std::int32_t* __restrict__ topk_idx,
                                   const std::int32_t* __restrict__ offsets, std::int64_t slots,
                                   std::int64_t capacity, std::int32_t* __restrict__ kept) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < slots;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t s = slot_of_sorted[j];
    kept[s] = j - offsets[topk_idx[s]] < capacity ? 1 : 0;
  }
}

// By position: a slot's row in its group is its rank.
__global__ void keep_by_position_kernel(const std::int32_t* __restrict__ row_map,
                                        const std::int32_t* __restrict__ topk_idx,
                                        const std::int32_t* __restrict__ offsets,
                                        std::int64_t slots, std::int64_t capacity,
                                        std::int32_t* __restrict__ kept) {
  for (std::int64_t s = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; s < slots;
       s += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    kept[s] = row_map[s] - offsets[topk_idx[s]] < capacity ? 1 : 0;
  }
}

// The kept routing (dropped slots to group `experts` at probability 0) and the drops per expert.
__global__ void kept_routing_kernel(const std::int32_t* __restrict__ kept,
                                    const std::int32_t* __restrict__ topk_idx,
                                    const float* __restrict__ topk_p, std::int64_t slots,
                                    int experts, std::int32_t* __restrict__ kept_idx,
                                    float* __restrict__ kept_p,
                                    std::int32_t* __restrict__ dropped) {
  for (std::int64_t s = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; s < slots;
       s += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t e = topk_idx[s];
    if (kept[s] != 0) {
      kept_idx[s] = e;
      kept_p[s] = topk_p[s];
    } else {
      kept_idx[s] = experts;
      kept_p[s] = 0.0f;
      atomicAdd(dropped + e, 1);
    }
  }
}

__global__ void kept_counts_kernel(const std::int32_t* __restrict__ routed,
                                   const std::int32_t* __restrict__ dropped, int experts,
                                   std::int32_t* __restrict__ kept) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < experts; e += gridDim.x * blockDim.x)
    kept[e] = routed[e] - dropped[e];
}

void mark_kept(const CapacityArgs& a, std::int64_t slots, cudaStream_t stream) {
  const int blocks = blocks_for(slots);
  if (a.by_probability) {
    const SortSpace s = carve(a.workspace, slots, a.experts);
    gather_by_row_kernel<<<blocks, kThreads, 0, stream>>>(a.row_map, a.topk_p, slots, s.keys_in,
                                                          s.slots_in);
    MOE_CHECK_LAUNCH();
    std::size_t temp_bytes = s.temp_bytes;
    MOE_CHECK_CUDA(cub::DeviceSegmentedRadixSort::SortPairsDescending(
        s.temp, temp_bytes, s.keys_in, s.keys_out, s.slots_in, s.slots_out, static_cast<int>(slots),
        a.experts, a.offsets, a.offsets + 1, 0, static_cast<int>(sizeof(float) * 8), stream));
    keep_sorted_kernel<<<blocks, kThreads, 0, stream>>>(s.slots_out, a.topk_idx, a.offsets, slots,
                                                        a.capacity, a.kept);
    MOE_CHECK_LAUNCH();
  } else {
    keep_by_position_kernel<<<blocks, kThreads, 0, stream>>>(a.row_map, a.topk_idx, a.offsets,
                                                             slots, a.capacity, a.kept);
    MOE_CHECK_LAUNCH();
  }
  kept_routing_kernel<<<blocks, kThreads, 0, stream>>>(a.kept, a.topk_idx, a.topk_p, slots,
                                                       a.experts, a.kept_idx, a.kept_p, a.dropped);
  MOE_CHECK_LAUNCH();
}

}  // namespace

std::size_t capacity_workspace_bytes(std::int64_t tokens, int topk, int experts) {
  const std::int64_t slots = tokens * topk;
  if (slots > INT_MAX)
    fail("capacity mode: " + std::to_string(tokens) + " tokens x top-" + std::to_string(topk) +
         " = " + std::to_string(slots) + " slots, beyond the sort's int32 count");
  return 4 * aligned(static_cast<std::size_t>(slots) * 4) + sort_temp_bytes(slots, experts);
}

void keep_within_capacity(const CapacityArgs& a, cudaStream_t stream) {
  if (a.tokens < 0 || a.topk < 1 || a.experts < 1 || a.capacity < 0)
    fail("keep_within_capacity: tokens = " + std::to_string(a.tokens) +
         ", topk = " + std::to_string(a.topk) + ", experts = " + std::to_string(a.experts) +
         ", capacity = " + std::to_string(a.capacity));
  const std::int64_t slots = a.tokens * a.topk;
  if ((a.routed_counts == nullptr) != (a.kept_counts == nullptr))
    fail("keep_within_capacity: routed_counts and kept_counts go together");
  MOE_CHECK_CUDA(cudaMemsetAsync(a.dropped, 0, static_cast<std::size_t>(a.experts) * 4, stream));
  if (slots > 0) mark_kept(a, slots, stream);
  if (a.kept_counts != nullptr) {
    kept_counts_kernel<<<blocks_for(a.experts), kThreads, 0, stream>>>(a.routed_counts, a.dropped,
                                                                       a.experts, a.kept_counts);
    MOE_CHECK_LAUNCH();
  }
}

}  // namespace moe
