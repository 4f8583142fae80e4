// The host side that the router's kernels share: their block geometry, the checks of RouterParams,
// the team layout (S, V) chosen from E, grid sizing (one persistent wave from a cached occupancy),
// and the forward's cross-block state inside the caller's workspace.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "moe/error.h"
#include "moe/tensor.h"
#include "moe/types.h"
#include "router.cuh"

namespace moe::router_detail {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * kWarpSize;
constexpr int kMaxBlocksPerSm = 8;  // 64 warps: the most an SM holds

// The forward's cross-block state, in the caller's workspace. Zero before the first call; the
// last block of every call reads the totals out and leaves it zero again.
struct ForwardState {
  unsigned* finished_blocks;          // [1]
  unsigned* tokens_per_expert;        // [E]
  unsigned* aux_tokens_per_expert;    // [E]
  unsigned long long* aux_score_sum;  // [E], fixed point (router_forward.cu's kSumScale)
  float* z_partials;                  // [max blocks]
};

// The ForwardState inside a workspace of router_workspace_bytes().
ForwardState forward_state(void* workspace, int experts);

// Both host queries below cost microseconds, more than the kernels they size at small E: asked
// once per device (SM count) and per kernel and shared-memory size (occupancy), then remembered.
int sm_count();
int blocks_per_sm(const void* kernel, std::size_t shared_bytes);

// One persistent wave (as many blocks as fit on the SMs, no more than the tokens need): the
// forward's per-block totals then stay few, and both kernels stride over the tokens.
int grid_size(const void* kernel, std::size_t shared_bytes, std::int64_t tokens,
              int tokens_per_block);

// Lanes per token S and logits per lane V from E. At most 8 entries per lane up to E = 256, so
// that the rows, scores and keys of a token stay in registers at a high occupancy (16 per lane
// take 128 registers and spill); 8 lanes at least, as every token is a chain of dependent team
// steps and the GPU needs many tokens in flight; the whole warp from E = 256 on, where its
// reductions are single redux.sync instructions.
template <typename Launch>
void dispatch_layout(int experts, Launch&& launch) {
  if (experts <= 8) return launch.template operator()<8, 1>();
  if (experts <= 16) return launch.template operator()<8, 2>();
  if (experts <= 32) return launch.template operator()<8, 4>();
  if (experts <= 64) return launch.template operator()<8, 8>();
  if (experts <= 128) return launch.template operator()<16, 8>();
  if (experts <= 256) return launch.template operator()<32, 8>();
  if (experts <= 512) return launch.template operator()<32, 16>();
  if (experts <= 1024) return launch.template operator()<32, 32>();
  if (experts <= 2048) return launch.template operator()<32, 64>();
  fail("router: num_experts = " + std::to_string(experts) + " exceeds " +
       std::to_string(kMaxExperts));
}

void check_params(const RouterParams& p);
void check_logits_dtype(DType dtype);

template <typename Kernel>
void allow_shared_memory(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024) {  // rare (E ≥ 2048 or many groups): not worth remembering
    MOE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  }
}

// Rows can move as 16-byte packs when every row starts on a 16-byte boundary.
bool aligned_rows(const void* p, int experts, std::size_t element_bytes);

}  // namespace moe::router_detail
