// Routing replay: the router's forward has run; each token's slots now take the given experts,
// their probabilities recomputed from the logits by the score function's rule (docs/design.md,
// "Routing replay"), and the counts are those of the given routing.
#include <cmath>
#include <cstdint>
#include <string>

#include "moe/error.h"
#include "router.cuh"
#include "router_device.cuh"

namespace moe {

using namespace router_detail;

namespace {

constexpr int kReplayWarps = 8;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// One warp per token; lane k < K holds slot k.
__global__ void __launch_bounds__(kReplayWarps* kWarpSize)
    router_replay_kernel(RouterParams p, const float* __restrict__ logits,
                         const std::int32_t* __restrict__ given, std::int64_t tokens,
                         std::int32_t* __restrict__ topk_idx, float* __restrict__ topk_p,
                         std::int32_t* __restrict__ tokens_per_expert,
                         unsigned long long* __restrict__ first_invalid) {
  const int lane = threadIdx.x % kWarpSize;
  const int E = p.num_experts, K = p.topk;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kReplayWarps;
  for (std::int64_t t = blockIdx.x * kReplayWarps + threadIdx.x / kWarpSize; t < tokens;
       t += warps) {
    const float* row = logits + t * E;
    const bool slot = lane < K;
    const std::int64_t at = t * K + lane;
    const int expert = slot ? given[at] : 0;
    const int selected = slot ? topk_idx[at] : 0;
    // Valid: inside [0, E) and distinct from every earlier slot of the token.
    bool valid = !slot || (expert >= 0 && expert < E);
    for (int j = 0; j < K; ++j) {
      const int other = __shfl_sync(kFullMask, expert, j);
      if (slot && j < lane && other == expert) valid = false;
    }
    if (!valid) {
      // The lowest slot with its value: the host reports it after the dispatch's sync.
      atomicMin(first_invalid,
                (static_cast<unsigned long long>(at) << 32) | static_cast<unsigned>(expert));
    }
    const bool token_valid = __all_sync(kFullMask, valid);
    const bool same = __all_sync(kFullMask, !slot || expert == selected);
    if (token_valid && !same) {
      // Recompute p for the given experts. Full-precision exponentials: these are not the
      // forward kernel's bits, which a replay of the same selection keeps untouched.
      const float l = slot ? row[expert] : -INFINITY;
      float value = 0.0f;
      if (p.score_function == ScoreFunction::kSoftmax && !p.pre_softmax) {
        const float peak = warp_max(l);
        const float e = slot ? expf(l - peak) : 0.0f;
        value = e / warp_sum(e);
      } else if (p.score_function == ScoreFunction::kSoftmax) {
        float peak = -INFINITY;
        for (int i = lane; i < E; i += kWarpSize) peak = fmaxf(peak, row[i]);
        peak = warp_max(peak);
        float sum = 0.0f;
        for (int i = lane; i < E; i += kWarpSize) sum += expf(row[i] - peak);
        sum = warp_sum(sum);
        value = slot ? expf(l - peak) / sum : 0.0f;
      } else {
        float s = 0.0f;
        if (slot) {
          s = p.score_function == ScoreFunction::kSigmoid
                  ? 1.0f / (1.0f + expf(-l))
                  : sqrtf(fmaxf(l, 0.0f) + log1pf(expf(-fabsf(l))));
        }
        const float total = warp_sum(s);
        value = K > 1 ? s / (total + kNormEpsilon) : s;
      }
      if (slot) {
        topk_idx[at] = expert;
        topk_p[at] = value * p.scaling_factor;
      }
    }
    // A token with an invalid slot keeps the router's own selection, so that the layout that
    // follows reads only valid experts before the host raises the error.
    const int final_expert = token_valid ? expert : selected;
    if (slot) atomicAdd(tokens_per_expert + final_expert, 1);
  }
}

}  // namespace

void router_replay(const RouterParams& params, const RouterReplayArgs& args, cudaStream_t stream) {
  check_params(params);
  if (args.tokens < 0) fail("router_replay: tokens = " + std::to_string(args.tokens));
  if (args.tokens == 0) return;
  if (args.logits == nullptr || args.given == nullptr || args.topk_idx == nullptr ||
      args.topk_p == nullptr || args.tokens_per_expert == nullptr ||
      args.first_invalid == nullptr) {
    fail("router_replay: a buffer is null");
  }
  MOE_CHECK_CUDA(
      cudaMemsetAsync(args.tokens_per_expert, 0,
                      sizeof(std::int32_t) * static_cast<std::size_t>(params.num_experts), stream));
  const std::int64_t blocks = (args.tokens + kReplayWarps - 1) / kReplayWarps;
  const int grid = static_cast<int>(blocks < 65535 ? blocks : 65535);
  router_replay_kernel<<<grid, kReplayWarps * kWarpSize, 0, stream>>>(
      params, args.logits, args.given, args.tokens, args.topk_idx, args.topk_p,
      args.tokens_per_expert, args.first_invalid);
  MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace moe
