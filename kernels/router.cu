#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <string>

#include "moe/error.h"
#include "router.cuh"

namespace moe {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarpsPerBlock * kWarpSize;
constexpr int kMaxBlocksPerSm = 16;  // 64 warps: the most an SM holds
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kNormEpsilon = 1e-20f;

// ---- Device helpers
// ------------------------------------------------------------------------------

__device__ __forceinline__ float load_value(const float* p, std::int64_t i) {
  return p[i];
}
__device__ __forceinline__ float load_value(const __nv_bfloat16* p, std::int64_t i) {
  return __bfloat162float(p[i]);
}

// Butterfly reductions: every lane ends with the same value (fp addition is commutative).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}
// A float's bits turned into an unsigned integer with the same order, so that the warp's
// integer reductions (one redux.sync instruction instead of five shuffle rounds) order floats.
// -0 is folded into +0 first, as the float comparisons treat them as equal.
__device__ __forceinline__ unsigned order_key(float v) {
  const unsigned bits = __float_as_uint(v + 0.0f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
__device__ __forceinline__ float from_order_key(unsigned key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ float warp_max(float v) {
  return from_order_key(__reduce_max_sync(kFullMask, order_key(v)));
}

__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + __expf(-x));
}
__device__ __forceinline__ float softplus(float x) {
  return fmaxf(x, 0.0f) + log1pf(__expf(-fabsf(x)));
}

// The elementwise score g(l) of sigmoid / sqrtsoftplus, and g'(l) given s = g(l).
__device__ __forceinline__ float elementwise_score(ScoreFunction f, float l) {
  return f == ScoreFunction::kSigmoid ? sigmoid(l) : sqrtf(softplus(l));
}
__device__ __forceinline__ float elementwise_score_derivative(ScoreFunction f, float l, float s) {
  return f == ScoreFunction::kSigmoid ? s * (1.0f - s) : sigmoid(l) / (2.0f * s);
}

// SPEC.md's order: higher value first, ties to the lower index.
__device__ __forceinline__ bool ranks_before(float av, int ai, float bv, int bi) {
  return av > bv || (av == bv && ai < bi);
}

struct Candidate {
  float value;
  int index;
};
__device__ __forceinline__ Candidate no_candidate() {
  return {-INFINITY, INT_MAX};
}
__device__ __forceinline__ Candidate before_all() {
  return {INFINITY, -1};
}

// The warp's best candidate: the largest value, then among its holders the lowest index.
__device__ __forceinline__ Candidate warp_best(Candidate c) {
  const unsigned key = order_key(c.value);
  const unsigned best_key = __reduce_max_sync(kFullMask, key);
  const int index = __reduce_min_sync(kFullMask, key == best_key ? c.index : INT_MAX);
  return {from_order_key(best_key), index};
}

// The best entry of the row (lane-strided registers) that ranks after `previous`. Taking the next
// in order, rather than masking the winner, never picks an entry twice, even among equal values.
template <int N>
__device__ __forceinline__ Candidate next_best(const float (&row)[N], int lane,
                                               Candidate previous) {
  Candidate best = no_candidate();
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int e = lane + kWarpSize * j;
    const float v = row[j] + 0.0f;  // -0 as +0, as in order_key
    if (ranks_before(previous.value, previous.index, v, e) &&
        ranks_before(v, e, best.value, best.index)) {
      best = {v, e};
    }
  }
  return warp_best(best);
}

// row[expert] of the lane that holds it, broadcast to every lane.
template <int N>
__device__ __forceinline__ float broadcast_entry(const float (&row)[N], int expert) {
  float mine = 0.0f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if (j == (expert >> 5)) mine = row[j];
  }
  return __shfl_sync(kFullMask, mine, expert & 31);
}

// Adds each active slot's value (lane k holds slot k's expert and value) into the row.
template <int N>
__device__ __forceinline__ void scatter_add(float (&row)[N], int lane, int topk, int slot_expert,
                                            float slot_value) {
  for (int k = 0; k < topk; ++k) {
    const int e = __shfl_sync(kFullMask, slot_expert, k);
    const float v = __shfl_sync(kFullMask, slot_value, k);
    if ((e & 31) == lane) {
#pragma unroll
      for (int j = 0; j < N; ++j) {
        if (j == (e >> 5)) row[j] += v;
      }
    }
  }
}

template <int N, typename In>
__device__ __forceinline__ void load_row(float (&row)[N], const In* logits, std::int64_t t,
                                         std::int64_t tokens, int experts, int lane) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int e = lane + kWarpSize * j;
    row[j] = (t < tokens && e < experts) ? load_value(logits, t * experts + e) : -INFINITY;
  }
}

// Max and Σ exp(l − max) of a row; padding lanes hold −∞ and add nothing.
template <int N>
__device__ __forceinline__ void row_softmax_stats(const float (&l)[N], float& row_max,
                                                  float& row_sum) {
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < N; ++j) m = fmaxf(m, l[j]);
  row_max = warp_max(m);
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < N; ++j) s += __expf(l[j] - row_max);
  row_sum = warp_sum(s);
}

// Group-limited selection: keeps the top group_topk groups (a group scores the sum of its top
// K/GK entries) and sets the others' entries to −∞. `scratch` holds E + 2G floats for this warp.
template <int N>
__device__ __forceinline__ void mask_groups(float (&r)[N], const RouterParams& p, int lane,
                                            float* scratch) {
  const int E = p.num_experts;
  const int G = p.num_groups;
  const int per_group = E / G;
  const int per_group_k = p.topk / p.group_topk;
  float* group_score = scratch + E;
  float* group_kept = scratch + E + G;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int e = lane + kWarpSize * j;
    if (e < E) scratch[e] = r[j];
  }
  __syncwarp();
  for (int g = lane; g < G; g += kWarpSize) {
    Candidate previous = before_all();
    float sum = 0.0f;
    for (int m = 0; m < per_group_k; ++m) {
      Candidate best = no_candidate();
      for (int i = 0; i < per_group; ++i) {
        const int e = g * per_group + i;
        const float v = scratch[e];
        if (ranks_before(previous.value, previous.index, v, e) &&
            ranks_before(v, e, best.value, best.index)) {
          best = {v, e};
        }
      }
      sum += best.value;
      previous = best;
    }
    group_score[g] = sum;
    group_kept[g] = 0.0f;
  }
  __syncwarp();
  Candidate previous = before_all();
  for (int m = 0; m < p.group_topk; ++m) {
    Candidate best = no_candidate();
    for (int g = lane; g < G; g += kWarpSize) {
      const float v = group_score[g];
      if (ranks_before(previous.value, previous.index, v, g) &&
          ranks_before(v, g, best.value, best.index)) {
        best = {v, g};
      }
    }
    best = warp_best(best);
    if (lane == 0) group_kept[best.index] = 1.0f;
    previous = best;
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int e = lane + kWarpSize * j;
    if (e < E && group_kept[e / per_group] == 0.0f) r[j] = -INFINITY;
  }
  __syncwarp();  // the next token reuses the scratch
}

// ---- Forward
// -------------------------------------------------------------------------------------

template <typename In>
struct ForwardKernelArgs {
  RouterParams p;
  const In* logits;
  std::int64_t tokens;
  const float* expert_bias;
  std::int32_t* topk_idx;
  float* topk_p;
  std::int32_t* tokens_per_expert;
  std::int32_t* aux_tokens_per_expert;
  float* score_sum_partials;  // [gridDim.x, E]
  float* z_partials;          // [gridDim.x]
};

__host__ __device__ inline int scratch_floats_per_warp(const RouterParams& p) {
  return (p.num_groups > 0 || p.aux_loss) ? p.num_experts + 2 * p.num_groups : 0;
}

template <int N, typename In>
__global__ void __launch_bounds__(kThreads) router_forward_kernel(ForwardKernelArgs<In> a) {
  extern __shared__ float shared[];
  const RouterParams& p = a.p;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int E = p.num_experts;
  const int K = p.topk;
  const int region = scratch_floats_per_warp(p);
  float* scratch = shared + warp * region;
  float* z_shared = shared + kWarpsPerBlock * region;
  // Per-block expert counts: shared-memory atomics, then one global atomic per expert and block
  // (thousands of tokens hitting a few counters would serialise in L2).
  auto* block_counts = reinterpret_cast<int*>(z_shared + kWarpsPerBlock);
  int* block_aux_counts = block_counts + E;
  for (int e = threadIdx.x; e < 2 * E; e += kThreads) block_counts[e] = 0;
  __syncthreads();
  const bool softmax = p.score_function == ScoreFunction::kSoftmax;
  const bool need_row_softmax = (softmax && (p.pre_softmax || p.aux_loss)) || p.z_loss;
  const bool active = lane < K;

  float score_sum[N];
#pragma unroll
  for (int j = 0; j < N; ++j) score_sum[j] = 0.0f;
  float z_acc = 0.0f;

  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  float next[N];
  load_row(next, a.logits, t, a.tokens, E, lane);
  for (; t < a.tokens; t += stride) {
    float l[N];
#pragma unroll
    for (int j = 0; j < N; ++j) l[j] = next[j];
    load_row(next, a.logits, t + stride, a.tokens, E, lane);  // in flight while this row is routed

    float row_max = 0.0f, row_sum = 1.0f;
    if (need_row_softmax) row_softmax_stats(l, row_max, row_sum);

    // Selection scores: logits (softmax post), softmax (pre), g(l) + bias (sigmoid, sqrtsoftplus).
    float r[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int e = lane + kWarpSize * j;
      if (e >= E) {
        r[j] = -INFINITY;
      } else if (softmax) {
        r[j] = p.pre_softmax ? __expf(l[j] - row_max) / row_sum : l[j];
      } else {
        r[j] =
            elementwise_score(p.score_function, l[j]) + (p.expert_bias ? a.expert_bias[e] : 0.0f);
      }
    }
    if (p.num_groups > 0) mask_groups(r, p, lane, scratch);

    // Top-K: lane k ends with slot k's expert and logit.
    int slot_expert = 0;
    float slot_logit = 0.0f;
    Candidate previous = before_all();
    for (int k = 0; k < K; ++k) {
      const Candidate best = next_best(r, lane, previous);
      const float logit = broadcast_entry(l, best.index);
      if (lane == k) {
        slot_expert = best.index;
        slot_logit = logit;
      }
      previous = best;
    }

    float prob;
    if (softmax && !p.pre_softmax) {
      const float m = warp_max(active ? slot_logit : -INFINITY);
      const float ex = active ? __expf(slot_logit - m) : 0.0f;
      prob = ex / warp_sum(ex);
    } else if (softmax) {
      prob = __expf(slot_logit - row_max) / row_sum;
    } else {
      const float s = elementwise_score(p.score_function, slot_logit);
      prob = K > 1 ? s / (warp_sum(active ? s : 0.0f) + kNormEpsilon) : s;
    }
    if (active) {
      a.topk_idx[t * K + lane] = slot_expert;
      a.topk_p[t * K + lane] = prob * p.scaling_factor;
      atomicAdd(&block_counts[slot_expert], 1);
    }

    if (p.aux_loss) {
      // Aux scores: softmax, or g(l) normalised over the row; their sums P and their own top-K.
      float s_aux[N];
      float norm = row_sum;
      if (!softmax) {
        float u_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const int e = lane + kWarpSize * j;
          s_aux[j] = e < E ? elementwise_score(p.score_function, l[j]) : 0.0f;
          u_sum += s_aux[j];
        }
        norm = warp_sum(u_sum) + kNormEpsilon;
      }
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const int e = lane + kWarpSize * j;
        const float numerator = softmax ? __expf(l[j] - row_max) : s_aux[j];
        s_aux[j] = e < E ? numerator / norm : -INFINITY;
        if (e < E) score_sum[j] += s_aux[j];
      }
      if (p.aux_routing_is_main()) {
        if (active) atomicAdd(&block_aux_counts[slot_expert], 1);
      } else {
        Candidate previous_aux = before_all();
        for (int k = 0; k < K; ++k) {
          const Candidate best = next_best(s_aux, lane, previous_aux);
          if (lane == 0) atomicAdd(&block_aux_counts[best.index], 1);
          previous_aux = best;
        }
      }
    }
    if (p.z_loss && lane == 0) {
      const float lse = row_max + logf(row_sum);
      z_acc += lse * lse;
    }
  }

  // This block's partial sums, reduced over its warps in a fixed order (deterministic).
  if (p.aux_loss) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int e = lane + kWarpSize * j;
      if (e < E) scratch[e] = score_sum[j];
    }
  }
  if (lane == 0) z_shared[warp] = z_acc;
  __syncthreads();
  if (p.aux_loss) {
    for (int e = threadIdx.x; e < E; e += kThreads) {
      float sum = 0.0f;
      for (int w = 0; w < kWarpsPerBlock; ++w) sum += shared[w * region + e];
      a.score_sum_partials[static_cast<std::int64_t>(blockIdx.x) * E + e] = sum;
    }
  }
  if (p.z_loss && threadIdx.x == 0) {
    float sum = 0.0f;
    for (int w = 0; w < kWarpsPerBlock; ++w) sum += z_shared[w];
    a.z_partials[blockIdx.x] = sum;
  }
  for (int e = threadIdx.x; e < E; e += kThreads) {
    if (block_counts[e] != 0) atomicAdd(&a.tokens_per_expert[e], block_counts[e]);
    if (p.aux_loss && block_aux_counts[e] != 0)
      atomicAdd(&a.aux_tokens_per_expert[e], block_aux_counts[e]);
  }
}

// Sums the per-block partials in a fixed order: block x of the grid takes experts
// [32x, 32x + 32); its warps stride over the partial rows, then warp 0 adds the warps' sums.
constexpr int kFinalizeWarps = 8;
__global__ void __launch_bounds__(kFinalizeWarps* kWarpSize)
    router_finalize_kernel(int experts, int blocks, const float* score_sum_partials,
                           const float* z_partials, float* score_sum, float* z_sum) {
  __shared__ float warp_sums[kFinalizeWarps][kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int e = blockIdx.x * kWarpSize + lane;
  float sum = 0.0f;
  for (int b = warp; b < blocks; b += kFinalizeWarps) {
    if (score_sum != nullptr && e < experts)
      sum += score_sum_partials[static_cast<std::int64_t>(b) * experts + e];
  }
  warp_sums[warp][lane] = sum;
  float z = 0.0f;
  if (z_sum != nullptr && blockIdx.x == 0) {
    for (int b = threadIdx.x; b < blocks; b += kFinalizeWarps * kWarpSize) z += z_partials[b];
  }
  __syncthreads();
  if (warp == 0 && score_sum != nullptr && e < experts) {
    float total = 0.0f;
    for (int w = 0; w < kFinalizeWarps; ++w) total += warp_sums[w][lane];
    score_sum[e] = total;
  }
  if (z_sum != nullptr && blockIdx.x == 0) {
    __syncthreads();
    warp_sums[warp][lane] = z;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.0f;
      for (int w = 0; w < kFinalizeWarps; ++w) {
        for (int l = 0; l < kWarpSize; ++l) total += warp_sums[w][l];
      }
      *z_sum = total;
    }
  }
}

// ---- Backward
// ------------------------------------------------------------------------------------

template <typename In>
struct BackwardKernelArgs {
  RouterParams p;
  const In* logits;
  std::int64_t tokens;
  const std::int32_t* topk_idx;
  const float* topk_p;
  const float* dprob;
  const std::int32_t* aux_tokens_per_expert;
  float aux_factor;
  float z_factor;
  float* dlogits;
};

template <int N, typename In>
__global__ void __launch_bounds__(kThreads) router_backward_kernel(BackwardKernelArgs<In> a) {
  const RouterParams& p = a.p;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int E = p.num_experts;
  const int K = p.topk;
  const float c = p.scaling_factor;
  const bool softmax = p.score_function == ScoreFunction::kSoftmax;
  const bool aux = a.aux_factor != 0.0f;
  const bool z = a.z_factor != 0.0f;
  const bool need_row = (softmax && p.pre_softmax) || aux || z;
  const bool need_row_softmax = (softmax && (p.pre_softmax || aux)) || z;
  const bool active = lane < K;

  // ∂L_aux/∂s_aux[t, e] = factor · f_e is the same for every token: held in registers.
  float aux_grad[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int e = lane + kWarpSize * j;
    aux_grad[j] =
        (aux && e < E) ? a.aux_factor * static_cast<float>(a.aux_tokens_per_expert[e]) : 0.0f;
  }

  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + warp; t < a.tokens;
       t += stride) {
    const int slot_expert = active ? a.topk_idx[t * K + lane] : 0;
    const float slot_p = active ? a.topk_p[t * K + lane] : 0.0f;
    const float slot_dp = (active && a.dprob != nullptr) ? a.dprob[t * K + lane] : 0.0f;

    float l[N];
    if (need_row) {
      load_row(l, a.logits, t, a.tokens, E, lane);
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) l[j] = -INFINITY;
    }
    float row_max = 0.0f, row_sum = 1.0f;
    if (need_row_softmax) row_softmax_stats(l, row_max, row_sum);

    float g[N];
#pragma unroll
    for (int j = 0; j < N; ++j) g[j] = 0.0f;

    if (a.dprob != nullptr) {
      if (softmax && !p.pre_softmax) {
        // dl_m = c·q_m·(dp_m − Σ_j q_j dp_j) with q = p / c.
        const float q = slot_p / c;
        const float q_dot_dp = warp_sum(active ? q * slot_dp : 0.0f);
        scatter_add(g, lane, K, slot_expert, c * q * (slot_dp - q_dot_dp));
      } else if (softmax) {
        // ds = c·dp at the selected; dl = s ⊙ (ds − Σ s·ds), with s_m = p_m / c at the selected.
        const float ds = c * slot_dp;
        const float s_dot_ds = warp_sum(active ? (slot_p / c) * ds : 0.0f);
        scatter_add(g, lane, K, slot_expert, ds);
#pragma unroll
        for (int j = 0; j < N; ++j) g[j] = __expf(l[j] - row_max) / row_sum * (g[j] - s_dot_ds);
      } else {
        const float slot_logit = active ? load_value(a.logits, t * E + slot_expert) : 0.0f;
        const float s = elementwise_score(p.score_function, slot_logit);
        const float ds_dl = elementwise_score_derivative(p.score_function, slot_logit, s);
        float dl;
        if (K == 1) {
          dl = c * slot_dp * ds_dl;
        } else {
          const float norm = warp_sum(active ? s : 0.0f) + kNormEpsilon;
          const float dp_dot_p = warp_sum(active ? slot_dp * slot_p : 0.0f);
          dl = (c * slot_dp - dp_dot_p) / norm * ds_dl;
        }
        scatter_add(g, lane, K, slot_expert, dl);
      }
    }

    if (aux) {
      if (softmax) {
        float s[N];
        float s_dot_g = 0.0f;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          s[j] = __expf(l[j] - row_max) / row_sum;
          s_dot_g += s[j] * aux_grad[j];
        }
        s_dot_g = warp_sum(s_dot_g);
#pragma unroll
        for (int j = 0; j < N; ++j) g[j] += s[j] * (aux_grad[j] - s_dot_g);
      } else {
        // s_aux = u / S, u = g(l), S = Σu + ε:  du_m = g_m / S − Σ_i g_i u_i / S².
        float u[N];
        float u_sum = 0.0f, g_dot_u = 0.0f;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const int e = lane + kWarpSize * j;
          u[j] = e < E ? elementwise_score(p.score_function, l[j]) : 0.0f;
          u_sum += u[j];
          g_dot_u += aux_grad[j] * u[j];
        }
        const float norm = warp_sum(u_sum) + kNormEpsilon;
        g_dot_u = warp_sum(g_dot_u);
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const int e = lane + kWarpSize * j;
          if (e < E) {
            const float du = aux_grad[j] / norm - g_dot_u / (norm * norm);
            g[j] += du * elementwise_score_derivative(p.score_function, l[j], u[j]);
          }
        }
      }
    }
    if (z) {
      const float scale = a.z_factor * 2.0f * (row_max + logf(row_sum));
#pragma unroll
      for (int j = 0; j < N; ++j) g[j] += scale * __expf(l[j] - row_max) / row_sum;
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int e = lane + kWarpSize * j;
      if (e < E) a.dlogits[t * E + e] = g[j];
    }
  }
}

// ---- Losses and bias update ------------------------------------------------------------------

constexpr int kReduceThreads = 256;

__global__ void router_losses_kernel(int experts, int topk, const std::int32_t* f,
                                     const float* score_sum, const float* z_sum,
                                     const std::int64_t* global_tokens, double aux_coeff,
                                     double z_coeff, float* losses) {
  __shared__ float partial[kReduceThreads];
  float sum = 0.0f;
  if (f != nullptr) {
    for (int e = threadIdx.x; e < experts; e += kReduceThreads)
      sum += score_sum[e] * static_cast<float>(f[e]);
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int width = kReduceThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double T = static_cast<double>(*global_tokens);
    const double aux_factor = T > 0 ? aux_coeff * experts / (topk * T * T) : 0.0;  // α·E/(K·T²)
    const double z_factor = T > 0 ? z_coeff / T : 0.0;                             // β/T
    losses[0] = f != nullptr ? static_cast<float>(aux_factor * partial[0]) : 0.0f;
    losses[1] = z_sum != nullptr ? static_cast<float>(z_factor * *z_sum) : 0.0f;
  }
}

__global__ void update_expert_bias_kernel(float* bias, const std::int32_t* load, int experts,
                                          float rate) {
  __shared__ long long partial[kReduceThreads];
  long long sum = 0;
  for (int e = threadIdx.x; e < experts; e += kReduceThreads) sum += load[e];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int width = kReduceThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  // Compare load_i · E with the total rather than with a rounded mean: the sign is exact.
  const long long total = partial[0];
  for (int e = threadIdx.x; e < experts; e += kReduceThreads) {
    const long long gap = total - static_cast<long long>(load[e]) * experts;
    bias[e] += rate * static_cast<float>((gap > 0) - (gap < 0));
  }
}

// ---- Host side -------------------------------------------------------------------------------

int sm_count() {
  int device = 0;
  int count = 0;
  MOE_CHECK_CUDA(cudaGetDevice(&device));
  MOE_CHECK_CUDA(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// The forward runs one persistent wave (as many blocks as fit on the SMs): its per-block partial
// sums then stay small. The backward has no partials and gives every token its own warp.
template <typename Kernel>
int forward_blocks(Kernel kernel, std::size_t shared_bytes, std::int64_t tokens) {
  int per_sm = 0;
  MOE_CHECK_CUDA(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared_bytes));
  per_sm = std::clamp(per_sm, 1, kMaxBlocksPerSm);
  const std::int64_t needed = (tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<int>(
      std::max<std::int64_t>(1, std::min<std::int64_t>(needed, sm_count() * per_sm)));
}
int max_forward_blocks() {
  return sm_count() * kMaxBlocksPerSm;
}
int backward_blocks(std::int64_t tokens) {
  return static_cast<int>(
      std::clamp<std::int64_t>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock, 1, INT_MAX));
}

// Registers per lane: the smallest power of two with 32·N ≥ E.
template <typename Launch>
void dispatch_width(int experts, Launch&& launch) {
  if (experts <= 32) return launch.template operator()<1>();
  if (experts <= 64) return launch.template operator()<2>();
  if (experts <= 128) return launch.template operator()<4>();
  if (experts <= 256) return launch.template operator()<8>();
  if (experts <= 512) return launch.template operator()<16>();
  if (experts <= 1024) return launch.template operator()<32>();
  if (experts <= 2048) return launch.template operator()<64>();
  fail("router: num_experts = " + std::to_string(experts) + " exceeds " +
       std::to_string(kMaxExperts));
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
      (p.group_topk < 1 || p.num_experts % p.num_groups != 0 || p.topk % p.group_topk != 0)) {
    fail("router: invalid grouping num_groups = " + std::to_string(p.num_groups) +
         ", group_topk = " + std::to_string(p.group_topk));
  }
}

void check_logits_dtype(DType dtype) {
  if (dtype != DType::kFP32 && dtype != DType::kBF16) {
    fail("router: logits dtype = " + std::string(dtype_name(dtype)) + " must be fp32 or bf16");
  }
}

template <typename Kernel>
void allow_shared_memory(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024) {
    MOE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  }
}

// Launches the forward kernel; returns its grid size (the number of partial rows written).
template <typename In>
int launch_forward(const RouterParams& p, const RouterForwardArgs& args, float* partials,
                   float* z_partials, cudaStream_t stream) {
  ForwardKernelArgs<In> k{p,
                          static_cast<const In*>(args.logits),
                          args.tokens,
                          args.expert_bias,
                          args.topk_idx,
                          args.topk_p,
                          args.tokens_per_expert,
                          args.aux_tokens_per_expert,
                          partials,
                          z_partials};
  const std::size_t shared =
      (static_cast<std::size_t>(scratch_floats_per_warp(p)) + 1) * kWarpsPerBlock * sizeof(float) +
      2 * static_cast<std::size_t>(p.num_experts) * sizeof(int);
  int blocks = 0;
  dispatch_width(p.num_experts, [&]<int N>() {
    allow_shared_memory(router_forward_kernel<N, In>, shared);
    blocks = forward_blocks(router_forward_kernel<N, In>, shared, args.tokens);
    router_forward_kernel<N, In><<<blocks, kThreads, shared, stream>>>(k);
    MOE_CHECK_LAUNCH();
  });
  return blocks;
}

template <typename In>
void launch_backward(const RouterParams& p, const RouterBackwardArgs& args, cudaStream_t stream) {
  BackwardKernelArgs<In> k{p,
                           static_cast<const In*>(args.logits),
                           args.tokens,
                           args.topk_idx,
                           args.topk_p,
                           args.dprob,
                           args.aux_tokens_per_expert,
                           args.aux_factor,
                           args.z_factor,
                           args.dlogits};
  const int blocks = backward_blocks(args.tokens);
  dispatch_width(p.num_experts, [&]<int N>() {
    router_backward_kernel<N, In><<<blocks, kThreads, 0, stream>>>(k);
    MOE_CHECK_LAUNCH();
  });
}

}  // namespace

RouterParams RouterParams::from(const MoEConfig& config) {
  RouterParams p;
  p.num_experts = config.num_experts;
  p.topk = config.topk;
  p.score_function = config.score_function;
  p.pre_softmax = config.pre_softmax;
  p.num_groups = config.num_groups;
  p.group_topk = config.group_topk;
  p.scaling_factor = static_cast<float>(config.scaling_factor);
  p.expert_bias = config.expert_bias;
  p.aux_loss = config.aux_loss_coeff > 0;
  p.z_loss = config.z_loss_coeff > 0;
  return p;
}

std::size_t router_workspace_bytes(const RouterParams& params, std::int64_t tokens) {
  (void)tokens;  // one wave at most, whatever the token count
  return static_cast<std::size_t>(max_forward_blocks()) *
         (static_cast<std::size_t>(params.num_experts) + 1) * sizeof(float);
}

void router_forward(const RouterParams& p, const RouterForwardArgs& args, cudaStream_t stream) {
  check_params(p);
  check_logits_dtype(args.logits_dtype);
  if (args.tokens < 0)
    fail("router_forward: tokens = " + std::to_string(args.tokens) + " must be >= 0");
  if (args.tokens > 0 &&
      (args.logits == nullptr || args.topk_idx == nullptr || args.topk_p == nullptr)) {
    fail("router_forward: logits, topk_idx and topk_p are required");
  }
  if (args.tokens_per_expert == nullptr) fail("router_forward: tokens_per_expert is required");
  if (p.expert_bias && args.expert_bias == nullptr)
    fail("router_forward: expert_bias is on but no bias was given");
  if (p.aux_loss && (args.aux_tokens_per_expert == nullptr || args.aux_score_sum == nullptr)) {
    fail("router_forward: aux_loss needs aux_tokens_per_expert and aux_score_sum");
  }
  if (p.z_loss && args.z_sum == nullptr) fail("router_forward: z_loss needs z_sum");
  if ((p.aux_loss || p.z_loss) && args.workspace == nullptr)
    fail("router_forward: workspace is required");

  const std::size_t count_bytes = static_cast<std::size_t>(p.num_experts) * sizeof(std::int32_t);
  MOE_CHECK_CUDA(cudaMemsetAsync(args.tokens_per_expert, 0, count_bytes, stream));
  if (p.aux_loss)
    MOE_CHECK_CUDA(cudaMemsetAsync(args.aux_tokens_per_expert, 0, count_bytes, stream));
  auto* partials = static_cast<float*>(args.workspace);
  float* z_partials =
      partials == nullptr
          ? nullptr
          : partials + static_cast<std::size_t>(max_forward_blocks()) * p.num_experts;
  int blocks = 1;
  if (args.tokens > 0) {
    blocks = args.logits_dtype == DType::kBF16
                 ? launch_forward<__nv_bfloat16>(p, args, partials, z_partials, stream)
                 : launch_forward<float>(p, args, partials, z_partials, stream);
  } else if (partials != nullptr) {
    MOE_CHECK_CUDA(cudaMemsetAsync(partials, 0, router_workspace_bytes(p, 0), stream));
  }
  if (p.aux_loss || p.z_loss) {
    router_finalize_kernel<<<(p.num_experts + kWarpSize - 1) / kWarpSize,
                             kFinalizeWarps * kWarpSize, 0, stream>>>(
        p.num_experts, blocks, partials, z_partials, p.aux_loss ? args.aux_score_sum : nullptr,
        p.z_loss ? args.z_sum : nullptr);
    MOE_CHECK_LAUNCH();
  }
}

float aux_loss_factor(const MoEConfig& config, std::int64_t global_tokens) {
  if (global_tokens == 0) return 0.0f;
  const double T = static_cast<double>(global_tokens);
  return static_cast<float>(config.aux_loss_coeff * config.num_experts / (config.topk * T * T));
}

float z_loss_factor(const MoEConfig& config, std::int64_t global_tokens) {
  if (global_tokens == 0) return 0.0f;
  return static_cast<float>(config.z_loss_coeff / static_cast<double>(global_tokens));
}

void router_losses(const RouterParams& params, const MoEConfig& config,
                   const std::int32_t* aux_tokens_per_expert, const float* aux_score_sum,
                   const float* z_sum, const std::int64_t* global_tokens, float* losses,
                   cudaStream_t stream) {
  router_losses_kernel<<<1, kReduceThreads, 0, stream>>>(
      params.num_experts, params.topk, params.aux_loss ? aux_tokens_per_expert : nullptr,
      aux_score_sum, params.z_loss ? z_sum : nullptr, global_tokens, config.aux_loss_coeff,
      config.z_loss_coeff, losses);
  MOE_CHECK_LAUNCH();
}

void router_backward(const RouterParams& p, const RouterBackwardArgs& args, cudaStream_t stream) {
  check_params(p);
  check_logits_dtype(args.logits_dtype);
  if (args.tokens < 0)
    fail("router_backward: tokens = " + std::to_string(args.tokens) + " must be >= 0");
  if (args.tokens == 0) return;
  if (args.logits == nullptr || args.topk_idx == nullptr || args.topk_p == nullptr ||
      args.dlogits == nullptr) {
    fail("router_backward: logits, topk_idx, topk_p and dlogits are required");
  }
  if (args.aux_factor != 0.0f && args.aux_tokens_per_expert == nullptr) {
    fail("router_backward: aux_factor is set but aux_tokens_per_expert is null");
  }
  if (args.logits_dtype == DType::kBF16) {
    launch_backward<__nv_bfloat16>(p, args, stream);
  } else {
    launch_backward<float>(p, args, stream);
  }
}

void update_expert_bias(float* expert_bias, const std::int32_t* load, int num_experts, float rate,
                        cudaStream_t stream) {
  if (num_experts < 1) fail("update_expert_bias: num_experts = " + std::to_string(num_experts));
  update_expert_bias_kernel<<<1, kReduceThreads, 0, stream>>>(expert_bias, load, num_experts, rate);
  MOE_CHECK_LAUNCH();
}

}  // namespace moe
