// The router's forward: one kernel that scores, selects and weighs each token's experts and
// gathers the loss statistics; the last of its blocks to finish turns the blocks' totals into
// the counts and sums (and, for a whole batch on one GPU, the losses).
#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "moe/error.h"
#include "router.cuh"
#include "router_device.cuh"
#include "router_launch.h"
#include "router_select.cuh"
#include "vector_access.cuh"

namespace moe {

using namespace router_detail;  // the code that the router_*.cu files share

namespace {

// The aux score sums cross blocks as 64-bit fixed point with 32 fraction bits: integer addition
// is associative, so the sum is the same whatever order the blocks finish in (deterministic
// without a second pass), and each s_aux ≤ 1 keeps 2^31 tokens within range.
constexpr double kSumScale = 4294967296.0;
// The last block reads up to this many z partials per thread in one batch (2048 blocks: 256 SMs
// at 8 blocks each); a loop takes any beyond.
constexpr int kZPartialsPerThread = 8;

template <typename In>
struct ForwardKernelArgs {
  RouterParams p;
  const In* logits;
  std::int64_t tokens;
  bool vector_rows;  // 16-byte row loads allowed
  const float* expert_bias;
  std::int32_t* topk_idx;
  float* topk_p;
  std::int32_t* tokens_per_expert;
  std::int32_t* aux_tokens_per_expert;
  float* aux_score_sum;
  float* z_sum;
  float* losses;      // null unless the losses are computed here (RouterForwardArgs::losses)
  double aux_factor;  // α·E/(K·T²)
  double z_factor;    // β/T
  ForwardState state;
};

// Shared memory of the forward: the biases (kStridedLanes), per-block totals, then each team's
// group scores (the general group-limited path).
template <int S, int V>
std::size_t forward_shared_bytes(const RouterParams& p) {
  constexpr int kTeams = kWarpSize / S;
  const std::size_t sums_stride = kStridedLanes<V> ? S * V : p.num_experts;
  return (kStridedLanes<V> ? S * V * 4 + kThreads * 8 : 0) + kWarpsPerBlock * sums_stride * 4 +
         static_cast<std::size_t>(p.num_experts) * (4 + 4) + kWarpsPerBlock * 4 +
         static_cast<std::size_t>(kTeams) * kWarpsPerBlock * p.num_groups * 4;
}

// Blocks per SM the forward is compiled for: the backward's (backward_blocks_per_sm), but 24 warps
// for teams narrower than a warp at up to 8 entries per lane, and more for the lean forward.
// The lean forward (kLean, strided layouts only) leaves out the softmax and the aux routing's own
// top-K: it serves elementwise scores (sigmoid, sqrtsoftplus) without groups whose aux routing,
// if any, is the main one (no bias then; takes_lean_forward). Its largest live state is then one
// array of the row, scores in place of logits, and at E = 1024 it fits 64 registers without spills:
// 32 warps per SM instead of 16. At T = 16384 the E = 1024 forward takes 54.3–54.8 µs so, against
// 60.6–62.0 at 16 warps and 55.3–56.1 at 24; at 8 warps (16 halved, by shared memory) it takes
// 85 µs against 62: the strided forward is bound by the latency of each token's chain, and more
// tokens in flight hide it.
template <int S, int V, bool kLean>
constexpr int forward_blocks_per_sm() {
  if constexpr (kLean) {
    static_assert(kStridedLanes<V>);
    return V <= 32 ? 4 : 2;
  }
  return V <= 8 && S < kWarpSize ? 3 : backward_blocks_per_sm<V>();
}

template <int S, int V, typename In, bool kLean>
__global__ void __launch_bounds__(kThreads, forward_blocks_per_sm<S, V, kLean>())
    router_forward_kernel(ForwardKernelArgs<In> a) {
  constexpr int kTeams = kWarpSize / S;
  constexpr int kSlots = (kMaxTopK + S - 1) / S;  // slot k lives on team lane k % S
  extern __shared__ __align__(16) unsigned char shared[];
  __shared__ int is_last_block;
  __shared__ float z_tree[kThreads / kWarpSize];
  const RouterParams& p = a.p;
  const int E = p.num_experts;
  const int K = p.topk;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int rank = lane % S;
  const int team = lane / S;
  const int team_base = team * S;
  const int first = rank * V;

  // Per-block totals: counts by shared-memory atomics (integer, so order-free), score sums per
  // warp then over the warps in order; then one global atomic per expert and block.
  constexpr bool kStrided = kStridedLanes<V>;
  const int sums_stride = kStrided ? S * V : E;
  float* bias_row = reinterpret_cast<float*>(shared);  // [S·V] when kStrided
  // [warps][32] when kStrided: strided_top_k's gathered entries
  auto* gathered = reinterpret_cast<uint2*>(bias_row + (kStrided ? S * V : 0));
  uint2* warp_gathered = gathered + warp * kWarpSize;
  float* warp_sums =
      reinterpret_cast<float*>(gathered + (kStrided ? kThreads : 0));  // [warps][sums_stride]
  auto* block_counts = reinterpret_cast<int*>(warp_sums + kWarpsPerBlock * sums_stride);
  int* block_aux_counts = block_counts + E;
  float* warp_z = reinterpret_cast<float*>(block_aux_counts + E);
  float* group_score = warp_z + kWarpsPerBlock + (warp * kTeams + team) * p.num_groups;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    block_counts[e] = 0;
    block_aux_counts[e] = 0;
  }
  if constexpr (kStrided) {
    // −∞ past E, as the registers' biases below.
    fill_shared_row<S * V>(bias_row, S * V, [&](int e) {
      return e >= E ? -INFINITY : p.expert_bias ? a.expert_bias[e] : 0.0f;
    });
    for (int i = threadIdx.x; i < kWarpsPerBlock * sums_stride; i += kThreads) warp_sums[i] = 0.0f;
  }
  __syncthreads();

  const bool softmax = !kLean && p.score_function == ScoreFunction::kSoftmax;
  const bool need_row_softmax = (softmax && (p.pre_softmax || p.aux_loss)) || p.z_loss;
  // Groups of whole lane chunks (a power of two of them) scored by at most two entries take the
  // fast path of team_keeps_group; any other grouping masks the scores in mask_groups.
  const int per_group = p.num_groups > 0 ? E / p.num_groups : E;
  const int spanned = per_group / V;
  const bool lane_groups = !kStrided && p.num_groups > 0 && per_group % V == 0 && spanned <= S &&
                           (spanned & (spanned - 1)) == 0 && p.topk / p.group_topk <= 2;
  const int group = first < E ? first / per_group : p.num_groups;

  // The lane's expert biases, the same for every token; −∞ past E, so that every score there is
  // −∞ without a test per entry: such entries, ranked last and after every real one on ties
  // (higher index), are never selected.
  float bias[V];
  float score_sum[V];
  if constexpr (!kStrided) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      bias[j] = first + j >= E ? -INFINITY : p.expert_bias ? a.expert_bias[first + j] : 0.0f;
      score_sum[j] = 0.0f;
    }
  }
  float* lane_sums = warp_sums + warp * sums_stride + rank;  // kStrided: entry j at j·S
  float z_acc = 0.0f;

  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock * kTeams;
  const std::int64_t start =
      (static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + warp) * kTeams;
  // The loop bound is the warp's, not the team's: every lane joins every shuffle. The row is
  // loaded when its token starts: loading the next token's row during this one's (up to 16
  // entries per lane) is 2–6% slower in a loop this short, and holds 2–13 more registers at
  // every V ≤ 16 (docs/performance.md).
  for (std::int64_t base = start; base < a.tokens; base += step) {
    const std::int64_t t = base + team;
    const bool valid = t < a.tokens;
    float l[V];
    load_entries<S, V>(l, a.logits, t, valid, rank, E, a.vector_rows);

    // u: what the aux scores normalise — exp(l − max) (softmax, when the row's softmax is
    // needed) or g(l) (sigmoid, sqrtsoftplus; 0 past E). The row's max and Σ exp(l − max) for
    // the z-loss and the softmax.
    float u[V];
    float row_max = 0.0f, row_sum = 1.0f, exp_neg_max = 0.0f;
    bool shifted = false;  // the scores are the shifted sigmoid's
    if (softmax) {
      if (need_row_softmax) row_softmax<S>(l, u, row_max, row_sum);
    } else {
      // Scores in place of the logits (l dies as u is formed), so that only one array of the row
      // is live: the z terms first, then g(l); or, from 32 entries per lane, both from one
      // exponential where the sigmoid may be shifted (the same sums, to the bit, as row_softmax
      // forms them).
      if (kShiftedSigmoid<V> && p.z_loss && p.score_function == ScoreFunction::kSigmoid) {
        row_max = row_max_of<S>(l);
        shifted = warp_takes_shifted_sigmoid(row_max, valid);
      }
      if (shifted) {
        exp_neg_max = fast_exp(-row_max);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float x = fast_exp(l[j] - row_max);
          sum += x;
          u[j] = shifted_sigmoid(x, exp_neg_max);
        }
        row_sum = team_sum<S>(sum);
      }
      if (!shifted) {
        if (p.z_loss) {
          float unused[V];
          row_softmax<S>(l, unused, row_max, row_sum);
        }
        elementwise_scores(p.score_function, l, u);
      }
    }
    const float inv_row_sum = 1.0f / row_sum;

    // The aux scores first, so that their inputs are dead before the selection's keys live: their
    // sums P, and their own top-K unless the main routing is theirs.
    unsigned keys[V];
    if (p.aux_loss) {
      float inv_norm = inv_row_sum;
      if (!softmax) {
        float u_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < V; ++j) u_sum += u[j];  // g(−∞) = 0 past E
        inv_norm = 1.0f / (team_sum<S>(u_sum) + kNormEpsilon);
      }
      if constexpr (kStrided) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if (valid) lane_sums[j * S] += u[j] * inv_norm;  // 0 past E
        }
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if (valid) score_sum[j] += u[j] * inv_norm;  // 0 past E
        }
      }
      // The aux routing's counts: the main counts when it is the main routing (the last block
      // copies them), else its own top-K of the aux scores.
      if (!kLean && !p.aux_routing_is_main()) {
#pragma unroll
        for (int j = 0; j < V; ++j) keys[j] = order_key(u[j] * inv_norm);  // 0 past E: ranked last
        int aux_expert[kSlots];
        unsigned aux_key[kSlots];
        team_top_k<S, V>(keys, lane_best<false>(keys), K, rank, team_base, aux_expert, aux_key);
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          if (i * S >= K) break;
          if (valid && i * S + rank < K) atomicAdd(&block_aux_counts[aux_expert[i]], 1);
        }
      }
    }
    if (p.z_loss && valid && rank == 0) {
      const float lse = row_max + logf(row_sum);
      z_acc += lse * lse;
    }

    // Selection keys from the scores: logits (softmax post), softmax (pre), g(l) + bias
    // (sigmoid, sqrtsoftplus).
    // g(l) ≥ +0 without a bias, and 0 past E (ranked after every real entry on ties, by index).
    // Not compiled into the strided kernel that is not lean: it never takes the case (the lean
    // one does), and with it ptxas spilled 564 bytes there.
    if ((kLean || !kStrided) && !softmax && !p.expert_bias && p.num_groups == 0) {
#pragma unroll
      for (int j = 0; j < V; ++j) keys[j] = nonnegative_order_key(u[j]);
    } else {
      // One loop per case: a select per entry made the compiler keep a predicate per entry.
      float r[V];
      if (!softmax) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if constexpr (kStrided) {
            r[j] = u[j] + bias_row[j * S + rank];
          } else {
            r[j] = u[j] + bias[j];
          }
        }
      } else if (p.pre_softmax) {
#pragma unroll
        for (int j = 0; j < V; ++j) r[j] = u[j] * inv_row_sum;
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) r[j] = l[j];
      }
      if (!kLean && p.num_groups > 0 && !lane_groups) mask_groups<S>(r, p, rank, group_score);
#pragma unroll
      for (int j = 0; j < V; ++j) keys[j] = order_key(r[j]);
    }
    int slot_expert[kSlots];
    unsigned slot_key[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      slot_expert[i] = 0;
      slot_key[i] = 0;
    }
    bool selected = false;
    if constexpr (kLean) {
      // The key of entry j as formed above, from its logit read again.
      auto key_of = [&](int j) {
        const int expert = j * S + rank;
        const float logit = expert < E ? device::to_float(a.logits[t * E + expert]) : -INFINITY;
        const float score = shifted ? shifted_sigmoid(fast_exp(logit - row_max), exp_neg_max)
                                    : elementwise_score(p.score_function, logit);
        return p.expert_bias ? order_key(score + bias_row[expert]) : nonnegative_order_key(score);
      };
      selected =
          strided_top_k<V>(keys, K, rank, warp_gathered, key_of, slot_expert[0], slot_key[0]);
      if (!selected) {
        StridedKeys<V> copy;
#pragma unroll
        for (int j = 0; j < V; ++j) copy.key[j] = keys[j];
        const Slot slot = strided_top_k_by_rounds<V>(copy, K, rank);
        slot_expert[0] = slot.expert;
        slot_key[0] = slot.key;
        selected = true;
      }
    }
    if (!selected) {
      LaneBest best = lane_best<false>(keys);
      if (lane_groups && !team_keeps_group<S>(best, group, p.num_groups, spanned,
                                              p.topk / p.group_topk, p.group_topk, team_base)) {
        best = LaneBest{};
      }
      team_top_k<S, V>(keys, best, K, rank, team_base, slot_expert, slot_key);
    }
    float slot_score[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      slot_score[i] = i * S + rank < K ? from_order_key(slot_key[i]) : 0.0f;

    // Probabilities. The selection score is the logit (softmax post) or the probability itself
    // (softmax pre); g(l) is recomputed from the logit, read again (from cache), as the score
    // there carries the bias.
    float prob[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) prob[i] = 0.0f;
    if (softmax && !p.pre_softmax) {
      // The first slot holds the largest selected logit, on team lane 0.
      const float m = S == 1 ? slot_score[0] : __shfl_sync(kFullMask, slot_score[0], team_base);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        if (i * S >= K) break;
        prob[i] = i * S + rank < K ? fast_exp(slot_score[i] - m) : 0.0f;
        sum += prob[i];
      }
      const float inv_sum = 1.0f / team_sum<S>(sum);
#pragma unroll
      for (int i = 0; i < kSlots; ++i) prob[i] *= inv_sum;
    } else if (softmax) {
#pragma unroll
      for (int i = 0; i < kSlots; ++i) prob[i] = slot_score[i];
    } else {
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        if (i * S >= K) break;
        if (valid && i * S + rank < K) {
          const float logit = device::to_float(a.logits[t * E + slot_expert[i]]);
          prob[i] = elementwise_score(p.score_function, logit);
        }
        sum += prob[i];
      }
      if (K > 1) {
        const float inv_sum = 1.0f / (team_sum<S>(sum) + kNormEpsilon);
#pragma unroll
        for (int i = 0; i < kSlots; ++i) prob[i] *= inv_sum;
      }
    }
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      if (i * S >= K) break;
      const int k = i * S + rank;
      if (valid && k < K) {
        a.topk_idx[t * K + k] = slot_expert[i];
        a.topk_p[t * K + k] = prob[i] * p.scaling_factor;
        atomicAdd(&block_counts[slot_expert[i]], 1);
      }
    }
  }

  // This block's totals. Score sums over the warp's teams (lanes of equal rank hold the same
  // experts; shared-memory 64-bit atomics would be compare-and-swap loops under contention).
  if constexpr (!kStrided) {  // else they are there already
    if (p.aux_loss) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float v = score_sum[j];
#pragma unroll
        for (int offset = S; offset < kWarpSize; offset <<= 1)
          v += __shfl_xor_sync(kFullMask, v, offset);
        if (team == 0 && first + j < E) warp_sums[warp * E + first + j] = v;
      }
    }
  }
  z_acc = team_sum<kWarpSize>(z_acc);
  if (lane == 0) warp_z[warp] = z_acc;
  __syncthreads();
  const ForwardState& s = a.state;
  if (p.z_loss && threadIdx.x == 0) {
    float sum = 0.0f;
    for (int w = 0; w < kWarpsPerBlock; ++w) sum += warp_z[w];
    s.z_partials[blockIdx.x] = sum;
  }
  for (int e = threadIdx.x; e < E; e += kThreads) {
    if (block_counts[e] != 0) atomicAdd(&s.tokens_per_expert[e], block_counts[e]);
    if (p.aux_loss && !p.aux_routing_is_main() && block_aux_counts[e] != 0)
      atomicAdd(&s.aux_tokens_per_expert[e], block_aux_counts[e]);
    if (p.aux_loss) {
      float sum = 0.0f;
      for (int w = 0; w < kWarpsPerBlock; ++w) sum += warp_sums[w * sums_stride + e];
      if (sum != 0.0f)
        atomicAdd(&s.aux_score_sum[e], __double2ull_rn(static_cast<double>(sum) * kSumScale));
    }
  }

  // The last block to finish reads the totals out, zeroing them for the next call. One fence per
  // block, after the barrier (the pattern of a cooperative grid sync): the fence is cumulative
  // over the block's writes ordered before it by the barrier, and a fence in every thread costs
  // each warp a wait of microseconds (at E = 8, 19% of the forward's stall samples).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    is_last_block = atomicAdd(s.finished_blocks, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last_block) return;
  __threadfence();
  // Every other block has finished, so the totals and the blocks' z partials are read with plain
  // L2 loads, all of a thread's in flight before the first is used: atomic exchanges in a loop
  // wait one L2 round trip per expert (1–2 µs of the forward at E = 1024), and a loop over the
  // partials one per partial.
  constexpr int kPerThread = (S * V + kThreads - 1) / kThreads;  // S·V ≥ E
  const bool aux_counts_own = p.aux_loss && !p.aux_routing_is_main();
  const int blocks = static_cast<int>(gridDim.x);
  unsigned count[kPerThread], aux_count[kPerThread];
  unsigned long long fixed_sum[kPerThread];
  float z_partial[kZPartialsPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = threadIdx.x + i * kThreads;
    if (e < E) {
      count[i] = __ldcg(&s.tokens_per_expert[e]);
      if (aux_counts_own) aux_count[i] = __ldcg(&s.aux_tokens_per_expert[e]);
      if (p.aux_loss) fixed_sum[i] = __ldcg(&s.aux_score_sum[e]);
    }
  }
  if (p.z_loss) {
#pragma unroll
    for (int i = 0; i < kZPartialsPerThread; ++i) {
      const int b = threadIdx.x + i * kThreads;
      z_partial[i] = b < blocks ? __ldcg(&s.z_partials[b]) : 0.0f;
    }
  }
  float z_block_sum = 0.0f;
  if (p.z_loss) {
    // Σ of the blocks' partials in a fixed order: a strided pass, then a tree (below).
#pragma unroll
    for (int i = 0; i < kZPartialsPerThread; ++i) {
      if (threadIdx.x + i * kThreads < blocks) z_block_sum += z_partial[i];
    }
    for (int b = threadIdx.x + kZPartialsPerThread * kThreads; b < blocks; b += kThreads)
      z_block_sum += __ldcg(&s.z_partials[b]);
  }
  float aux_partial = 0.0f;  // Σ_e f_e·P_e over this thread's experts, for the fused losses
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = threadIdx.x + i * kThreads;
    if (e >= E) break;
    s.tokens_per_expert[e] = 0u;  // zero for the next call
    a.tokens_per_expert[e] = static_cast<std::int32_t>(count[i]);
    if (p.aux_loss) {
      const auto f = static_cast<std::int32_t>(aux_counts_own ? aux_count[i] : count[i]);
      if (aux_counts_own) s.aux_tokens_per_expert[e] = 0u;
      s.aux_score_sum[e] = 0ull;
      const auto score_sum = static_cast<float>(static_cast<double>(fixed_sum[i]) / kSumScale);
      a.aux_tokens_per_expert[e] = f;
      a.aux_score_sum[e] = score_sum;
      aux_partial += score_sum * static_cast<float>(f);
    }
  }
  float z_total = 0.0f;
  if (p.z_loss) {
    z_total = block_tree_sum<kThreads>(z_block_sum, z_tree);
    if (threadIdx.x == 0) *a.z_sum = z_total;
  }
  if (a.losses != nullptr) {  // the same sums, in the same order, as router_losses_kernel
    const float aux_total = block_tree_sum<kThreads>(aux_partial, z_tree);
    if (threadIdx.x == 0) {
      a.losses[0] = p.aux_loss ? static_cast<float>(a.aux_factor * aux_total) : 0.0f;
      a.losses[1] = p.z_loss ? static_cast<float>(a.z_factor * z_total) : 0.0f;
    }
  }
  if (threadIdx.x == 0) atomicExch(s.finished_blocks, 0u);
}

// ---- Launch -------------------------------------------------------------------------------------

// Whether the forward may take its lean kernel (kLean): an elementwise score, no groups, and an
// aux routing that is the main one whenever the aux loss is on.
bool takes_lean_forward(const RouterParams& p) {
  return p.score_function != ScoreFunction::kSoftmax && p.num_groups == 0 &&
         !(p.aux_loss && !p.aux_routing_is_main());
}

template <typename In>
void launch_forward(const RouterParams& p, const RouterForwardArgs& args, cudaStream_t stream) {
  // The factors as router_losses_kernel forms them, to the same rounding.
  const auto T = static_cast<double>(args.tokens);
  const double aux_factor =
      args.tokens > 0 ? args.aux_loss_coeff * p.num_experts / (p.topk * T * T) : 0.0;
  const double z_factor = args.tokens > 0 ? args.z_loss_coeff / T : 0.0;
  ForwardKernelArgs<In> k{p,
                          static_cast<const In*>(args.logits),
                          args.tokens,
                          aligned_rows(args.logits, p.num_experts, sizeof(In)),
                          args.expert_bias,
                          args.topk_idx,
                          args.topk_p,
                          args.tokens_per_expert,
                          args.aux_tokens_per_expert,
                          args.aux_score_sum,
                          args.z_sum,
                          args.losses,
                          aux_factor,
                          z_factor,
                          forward_state(args.workspace, p.num_experts)};
  dispatch_layout(p.num_experts, [&]<int S, int V>() {
    constexpr int kTeams = kWarpSize / S;
    const std::size_t shared = forward_shared_bytes<S, V>(p);
    auto run = [&](auto kernel) {
      allow_shared_memory(kernel, shared);
      const int blocks = grid_size(reinterpret_cast<const void*>(kernel), shared, args.tokens,
                                   kWarpsPerBlock * kTeams);
      kernel<<<blocks, kThreads, shared, stream>>>(k);
      MOE_CHECK_LAUNCH();
    };
    if constexpr (kStridedLanes<V>) {
      if (takes_lean_forward(p)) return run(router_forward_kernel<S, V, In, true>);
    }
    run(router_forward_kernel<S, V, In, false>);
  });
}

}  // namespace

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
  if (args.workspace == nullptr) fail("router_forward: workspace is required");
  if (args.losses != nullptr && !(args.aux_loss_coeff >= 0.0 && args.z_loss_coeff >= 0.0)) {
    fail("router_forward: loss coefficients must be >= 0, got aux_loss_coeff = " +
         std::to_string(args.aux_loss_coeff) +
         ", z_loss_coeff = " + std::to_string(args.z_loss_coeff));
  }
  if (args.logits_dtype == DType::kBF16) {
    launch_forward<__nv_bfloat16>(p, args, stream);
  } else {
    launch_forward<float>(p, args, stream);
  }
}

}  // namespace moe
