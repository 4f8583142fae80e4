#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "moe/error.h"
#include "router.cuh"
#include "vector_access.cuh"

namespace moe {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * kWarpSize;
constexpr int kMaxBlocksPerSm = 8;  // 64 warps: the most an SM holds
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kNormEpsilon = 1e-20f;
// The aux score sums cross blocks as 64-bit fixed point with 32 fraction bits: integer addition
// is associative, so the sum is the same whatever order the blocks finish in (deterministic
// without a second pass), and each s_aux ≤ 1 keeps 2^31 tokens within range.
constexpr double kSumScale = 4294967296.0;
// The last block reads up to this many z partials per thread in one batch (2048 blocks: 256 SMs
// at 8 blocks each); a loop takes any beyond.
constexpr int kZPartialsPerThread = 8;

// ---- Device helpers
// ------------------------------------------------------------------------------

// A float's bits turned into an unsigned integer with the same order, so that the warp's
// integer reductions (one redux.sync instruction instead of five shuffle rounds) order floats.
// -0 is folded into +0 first, as the float comparisons treat them as equal. A mask from the sign
// flips every bit of a negative value and only the sign bit of a positive one: a shift and one
// three-input logic operation (a select there compiled to four instructions an entry).
__device__ __forceinline__ unsigned order_key(float v) {
  const unsigned bits = __float_as_uint(v + 0.0f);
  return bits ^ (static_cast<unsigned>(static_cast<int>(bits) >> 31) | 0x80000000u);
}
__device__ __forceinline__ float from_order_key(unsigned key) {
  return __uint_as_float(key ^ (static_cast<unsigned>(static_cast<int>(~key) >> 31) | 0x80000000u));
}

// e^x as one ex2 with flush to zero: __expf also rescales results below 2^-126 into denormals,
// three more instructions per entry (the session-8 profile at E = 128), for values that vanish
// beside the row's largest term of 1 in every sum they enter.
__device__ __forceinline__ float fast_exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
  return y;
}

// 1/y as one rcp.approx for a y known to be a normal float. __fdividef tests its divisor for the
// range where it rescales (two predicated multiplications and a compare an entry in the shifted
// sigmoid: the session-19 profile of the E = 1024 forward); for a normal y its result is the same
// bits as x · reciprocal(y).
__device__ __forceinline__ float reciprocal(float y) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  return r;
}

// The order key of a score known to be +0 or above (an elementwise score without a bias): the
// sign bit set, the same key as order_key gives it, in one instruction instead of four (the bias
// addition, the fold of −0, the sign mask).
__device__ __forceinline__ unsigned nonnegative_order_key(float v) {
  return __float_as_uint(v) | 0x80000000u;
}

// Fast reciprocal division: the IEEE division's slow path for special operands cost a branch per
// entry (the session-7 profile); its 2 ulp are far inside the tolerances.
__device__ __forceinline__ float sigmoid(float x) {
  return __fdividef(1.0f, 1.0f + fast_exp(-x));
}
__device__ __forceinline__ float softplus(float x) {
  return fmaxf(x, 0.0f) + log1pf(fast_exp(-fabsf(x)));
}

// The elementwise score g(l) of sigmoid / sqrtsoftplus, and g'(l) given s = g(l).
__device__ __forceinline__ float elementwise_score(ScoreFunction f, float l) {
  return f == ScoreFunction::kSigmoid ? sigmoid(l) : sqrtf(softplus(l));
}
// The sigmoid's s·(1 − s) takes 1 − s as s·e^−l for l ≥ 0: where s nears 1 the subtraction
// cancels, and the 2 ulp of the fast division in s became ~10⁻⁵ of 1 − s at l ≈ 4 (the test
// grid's tolerance; seed 652691080432844090 at E = 256, K = 1, T = 1 failed by 4%).
// Both sides are formed and one selected: with the exponential under the condition the compiler
// kept a branch per entry (the inline ex2 is not speculated), and warps whose lanes held logits of
// both signs ran both paths (the session-16 profile of the E = 1024 backward: a third of its
// instructions in that loop). e^−l overflows only where l < 0, on the side not taken.
__device__ __forceinline__ float sigmoid_derivative(float l, float s) {
  const float e = fast_exp(-l);
  return l >= 0.0f ? s * s * e : s * (1.0f - s);
}
__device__ __forceinline__ float sqrtsoftplus_derivative(float l, float s) {
  return __fdividef(sigmoid(l), 2.0f * s);
}
__device__ __forceinline__ float elementwise_score_derivative(ScoreFunction f, float l, float s) {
  return f == ScoreFunction::kSigmoid ? sigmoid_derivative(l, s) : sqrtsoftplus_derivative(l, s);
}
// g over a lane's chunk, with the choice of function made once rather than per entry.
template <int V>
__device__ __forceinline__ void elementwise_scores(ScoreFunction f, const float (&l)[V],
                                                   float (&s)[V]) {
  if (f == ScoreFunction::kSigmoid) {
#pragma unroll
    for (int j = 0; j < V; ++j) s[j] = sigmoid(l[j]);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) s[j] = sqrtf(softplus(l[j]));
  }
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

// Σ of one value per thread over a block of kN threads: xor butterflies within each warp, then
// the warps' totals in warp order — the same additions in the same order on every run (bitwise
// deterministic; both lanes of a butterfly pair add the same two values, so every lane holds the
// same bits). Every thread gets the total. `tree` holds kN / 32 values; the leading barrier lets
// the caller reuse it for another sum right away. Two barriers, not one per level of a tree in
// shared memory (router step 34).
template <int kN, typename V>
__device__ V block_tree_sum(V value, V* tree) {
  static_assert(kN % kWarpSize == 0);
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
    value += __shfl_xor_sync(kFullMask, value, offset);
  __syncthreads();
  if (threadIdx.x % kWarpSize == 0) tree[threadIdx.x / kWarpSize] = value;
  __syncthreads();
  V total = tree[0];
#pragma unroll
  for (int w = 1; w < kN / kWarpSize; ++w) total += tree[w];
  return total;
}

// row[e] = value_of(e) for e < n, over the block. Each thread reads all of its values before it
// stores any, so that their global loads are in flight together: a loop of load-then-store
// waited one round trip per iteration before the block's first token (router step 34).
template <int kMax, typename ValueOf>
__device__ __forceinline__ void fill_shared_row(float* row, int n, ValueOf value_of) {
  constexpr int kPerThread = (kMax + kThreads - 1) / kThreads;
  constexpr int kBatch = kPerThread < 4 ? kPerThread : 4;  // loads in flight, bounded in registers
#pragma unroll
  for (int b = 0; b < kPerThread; b += kBatch) {
    float value[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int e = static_cast<int>(threadIdx.x) + (b + i) * kThreads;
      value[i] = e < n ? value_of(e) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int e = static_cast<int>(threadIdx.x) + (b + i) * kThreads;
      if (e < n) row[e] = value[i];
    }
  }
}

// ---- Teams: the lanes that share one token
//
// A token's E logits are spread over a team of S consecutive lanes (S a power of two); lane
// `rank` of the team holds experts [rank·V, rank·V + V) in registers, so a warp routes 32/S tokens
// at once. S and V are chosen from E (dispatch_layout): 8 lanes up to E = 64 and 16 at E = 128, so
// that many tokens are in flight, up to the whole warp for large E, so that registers stay
// bounded. Team sums are xor butterflies within the team: every lane of the team ends with the
// same value, and the order of additions is fixed (deterministic); maxima of half- and whole-warp
// teams are integer redux.sync reductions of order keys.

template <int S>
__device__ __forceinline__ float team_sum(float v) {
#pragma unroll
  for (int offset = S / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// The team's largest key: one redux.sync for a warp-wide team; for half-warp teams two, each
// over one half's keys with the other half's lanes giving 0 (below every float's key): 5
// instructions and two reductions' latency instead of four dependent shuffle steps, in the
// rounds that are the forward's critical path at E = 128 (the session-8 profile); xor
// butterflies within narrower teams.
template <int S>
__device__ __forceinline__ unsigned team_max_key(unsigned v) {
  if constexpr (S == kWarpSize) {
    return __reduce_max_sync(kFullMask, v);
  } else if constexpr (S == kWarpSize / 2) {
    const bool upper = (threadIdx.x & (kWarpSize / 2)) != 0;
    const unsigned lower_max = __reduce_max_sync(kFullMask, upper ? 0u : v);
    const unsigned upper_max = __reduce_max_sync(kFullMask, upper ? v : 0u);
    return upper ? upper_max : lower_max;
  } else {
#pragma unroll
    for (int offset = S / 2; offset > 0; offset >>= 1)
      v = max(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
  }
}

template <int S>
__device__ __forceinline__ float team_max(float v) {
  if constexpr (S >= kWarpSize / 2) {
    return from_order_key(team_max_key<S>(order_key(v)));
  } else {
#pragma unroll
    for (int offset = S / 2; offset > 0; offset >>= 1)
      v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
  }
}

// The best of the candidates of `lanes` consecutive lanes (a power of two ≤ S, aligned).
__device__ __forceinline__ Candidate lanes_best(Candidate c, int lanes) {
  for (int offset = lanes / 2; offset > 0; offset >>= 1) {
    const float v = __shfl_xor_sync(kFullMask, c.value, offset);
    const int i = __shfl_xor_sync(kFullMask, c.index, offset);
    if (ranks_before(v, i, c.value, c.index)) c = {v, i};
  }
  return c;
}

// The team's best candidate: the largest value, then among its holders the lowest index.
template <int S>
__device__ __forceinline__ Candidate team_best(Candidate c) {
  if constexpr (S == kWarpSize) {
    const unsigned key = order_key(c.value);
    const unsigned best_key = __reduce_max_sync(kFullMask, key);
    const int index = __reduce_min_sync(kFullMask, key == best_key ? c.index : INT_MAX);
    return {from_order_key(best_key), index};
  } else {
    return lanes_best(c, S);
  }
}

// From 32 entries per lane on (one team per warp, E > 512) a lane owns runs of kRun consecutive
// experts strided over the row — run r of lane `rank` is experts (r·S + rank)·kRun + [0, kRun) —
// instead of one contiguous chunk, and the per-expert rows that are the same for every token
// (biases, aux score sums, aux gradients) sit in shared memory instead of 2·V registers.
// Strided, a warp's access to its run r is one contiguous span of the row: chunks of 128 bytes
// made every 16-byte access touch 32 lines (session 14). The shared rows are in expert order, so
// that a warp's accesses to run r are free of bank conflicts. At E = 1024 the kernels held 255
// registers, 8 warps per SM, before the stride; now 128 and 16.
//
// The forward takes runs of one entry (kRun = 1: entry j is expert j·S + rank, a warp's access one
// 128-byte line); the backward runs of four, each moved as one 16-byte access to the logits, to
// dlogits and to its shared rows (a quarter of the instructions for those moves). Runs of four in
// the forward ran 5% slower read entry by entry, and 10% slower read as 16-byte runs, with which
// ptxas spilled 412 bytes at its 128 registers (session 16).
template <int V>
constexpr bool kStridedLanes = V >= 32;
constexpr int kBackwardRun = 4;

// Expert of the lane's entry j (kRun: the strided layout's run length, above).
template <int S, int V, int kRun = 1>
__device__ __forceinline__ int expert_of(int rank, int j) {
  if constexpr (kStridedLanes<V>) {
    return ((j / kRun) * S + rank) * kRun + j % kRun;
  } else {
    return rank * V + j;
  }
}

// kStridedLanes in the backward: the lane's V entries of a shared-memory row in expert order, as
// V / 4 runs of 16 bytes, read and written whole.
template <int S, int V>
__device__ __forceinline__ void read_runs(const float* row, int rank, float (&v)[V]) {
  constexpr int kRun = kBackwardRun;
  static_assert(kStridedLanes<V> && V % kRun == 0 && kRun == 4);
  const float4* runs = reinterpret_cast<const float4*>(row) + rank;
#pragma unroll
  for (int r = 0; r < V / kRun; ++r) {
    const float4 run = runs[r * S];
    v[r * kRun] = run.x;
    v[r * kRun + 1] = run.y;
    v[r * kRun + 2] = run.z;
    v[r * kRun + 3] = run.w;
  }
}
template <int S, int V>
__device__ __forceinline__ void write_runs(float* row, int rank, const float (&v)[V]) {
  constexpr int kRun = kBackwardRun;
  static_assert(kStridedLanes<V> && V % kRun == 0 && kRun == 4);
  float4* runs = reinterpret_cast<float4*>(row) + rank;
#pragma unroll
  for (int r = 0; r < V / kRun; ++r)
    runs[r * S] = make_float4(v[r * kRun], v[r * kRun + 1], v[r * kRun + 2], v[r * kRun + 3]);
}

// f(j) for each of the lane's entries inside the row: no test per entry when every lane's
// entries are (E = S·V, the common case of a power-of-two E).
template <int S, int V, int kRun = 1, typename F>
__device__ __forceinline__ void for_entries_inside(int rank, int experts, F&& f) {
  if (S * V <= experts) {
#pragma unroll
    for (int j = 0; j < V; ++j) f(j);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (expert_of<S, V, kRun>(rank, j) < experts) f(j);
    }
  }
}

// The lane's V logits of token t (−∞ past E or for a token past the end). Chunks move as 16-byte
// loads when the rows allow them and the chunk lies inside the row.
template <int V, typename In>
__device__ __forceinline__ void load_chunk(float (&l)[V], const In* __restrict__ logits,
                                           std::int64_t t, bool valid, int first, int experts,
                                           bool vector_rows) {
  constexpr int kPack = 16 / static_cast<int>(sizeof(In));
  const In* row = logits + t * experts + first;
  if constexpr (V % kPack == 0) {
    if (valid && vector_rows && first + V <= experts) {
      const auto* packs = reinterpret_cast<const device::Pack<In, kPack>*>(row);
#pragma unroll
      for (int i = 0; i < V / kPack; ++i) {
        const auto pack = packs[i];
#pragma unroll
        for (int q = 0; q < kPack; ++q) l[i * kPack + q] = device::to_float(pack.v[q]);
      }
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j)
    l[j] = (valid && first + j < experts) ? device::to_float(row[j]) : -INFINITY;
}

template <int S, int V, int kRun = 1, typename In>
__device__ __forceinline__ void load_entries(float (&l)[V], const In* __restrict__ logits,
                                             std::int64_t t, bool valid, int rank, int experts,
                                             bool vector_rows) {
  if constexpr (kStridedLanes<V>) {
    const In* row = logits + t * experts;
    if (valid && S * V <= experts) {  // every entry inside the row: no test per entry
      if constexpr (kRun > 1) {
        if (vector_rows) {  // whole runs
          const auto* runs = reinterpret_cast<const device::Pack<In, kRun>*>(row) + rank;
#pragma unroll
          for (int r = 0; r < V / kRun; ++r) {
            const auto run = runs[r * S];
#pragma unroll
            for (int q = 0; q < kRun; ++q) l[r * kRun + q] = device::to_float(run.v[q]);
          }
          return;
        }
      }
#pragma unroll
      for (int j = 0; j < V; ++j) l[j] = device::to_float(row[expert_of<S, V, kRun>(rank, j)]);
      return;
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int e = expert_of<S, V, kRun>(rank, j);
      l[j] = (valid && e < experts) ? device::to_float(row[e]) : -INFINITY;
    }
  } else {
    load_chunk(l, logits, t, valid, rank * V, experts, vector_rows);
  }
}

// Group-limited selection: keeps the top group_topk groups (a group scores the sum of its top
// K/GK entries) and sets the others' entries to −∞. `group_score` holds this team's G floats.
// Who scores a group depends on how groups fall on the lanes: when a group spans a power of two
// of whole lane chunks, those lanes score it together; when a chunk holds whole groups, its lane
// scores them alone; otherwise (group size and chunk size unrelated) the whole team walks every
// group, slower but general.
template <int S, int V>
__device__ __forceinline__ void mask_groups(float (&r)[V], const RouterParams& p, int rank,
                                            float* group_score) {
  const int E = p.num_experts;
  const int G = p.num_groups;
  const int per_group = E / G;
  const int per_group_k = p.topk / p.group_topk;
  const int first = rank * V;
  const int spanned = per_group / V;
  int lanes, group_begin, groups;
  if (kStridedLanes<V>) {  // a lane's entries lie in many groups
    lanes = S;
    group_begin = 0;
    groups = G;
  } else if (per_group % V == 0 && (spanned & (spanned - 1)) == 0 && spanned <= S) {
    lanes = spanned;
    group_begin = min(first / per_group, G - 1);
    groups = 1;
  } else if (V % per_group == 0) {
    lanes = 1;
    group_begin = first / per_group;
    groups = V / per_group;
  } else {
    lanes = S;
    group_begin = 0;
    groups = G;
  }
  for (int q = 0; q < groups; ++q) {
    const int g = group_begin + q;
    const int lo = g * per_group;
    const int hi = lo + per_group;
    Candidate previous = before_all();
    float sum = 0.0f;
    for (int m = 0; m < per_group_k; ++m) {
      Candidate best = no_candidate();
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int e = expert_of<S, V>(rank, j);
        const float v = r[j] + 0.0f;
        if (e >= lo && e < hi && ranks_before(previous.value, previous.index, v, e) &&
            ranks_before(v, e, best.value, best.index)) {
          best = {v, e};
        }
      }
      best = lanes_best(best, lanes);
      sum += best.value;
      previous = best;
    }
    if (g < G && lo < E && (rank % lanes) == 0 && (lanes == S ? rank == 0 : first < E))
      group_score[g] = sum;
  }
  __syncwarp();
  // The group_topk-th best group: every group ranking before it or equal to it is kept.
  Candidate previous = before_all();
  for (int m = 0; m < p.group_topk; ++m) {
    Candidate best = no_candidate();
    for (int g = rank; g < G; g += S) {
      const float v = group_score[g];
      if (ranks_before(previous.value, previous.index, v, g) &&
          ranks_before(v, g, best.value, best.index)) {
        best = {v, g};
      }
    }
    previous = team_best<S>(best);
  }
  if constexpr (kStridedLanes<V>) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int e = expert_of<S, V>(rank, j);
      const int g = e / per_group;
      if (e < E && ranks_before(previous.value, previous.index, group_score[g], g))
        r[j] = -INFINITY;
    }
  } else {
    int g = first / per_group;
    int offset = first - g * per_group;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (first + j < E && ranks_before(previous.value, previous.index, group_score[g], g))
        r[j] = -INFINITY;
      if (++offset == per_group) {
        offset = 0;
        ++g;
      }
    }
  }
  __syncwarp();  // the team's next token reuses group_score
}

// ---- Selection
//
// Each lane keeps its entries' order keys (a float's order as an unsigned integer; 0 marks an
// entry out of the race) and its best three entries in SPEC.md's order. A round of top-K takes
// the team's largest lane-best key by one team reduction; lanes hold consecutive experts, so the
// lowest lane of the ballot of its holders holds the lowest expert index with that key (the tie
// rule) without a second reduction (strided lanes, kStridedLanes, take the lowest expert among
// the holders by a second one). Only the winning lane moves on to its next best, and only a
// lane that wins more than three times rescans its entries. A round thus costs a few dozen
// instructions per team instead of passes over every entry (the session-7 profile: the forward
// at E = 256 ran 2,300 instructions per token, most of them in those passes and in the
// pre-filter that had replaced them).

// The lanes of the caller's team as a warp mask.
template <int S>
__device__ __forceinline__ unsigned team_lanes(int team_base) {
  return (kFullMask >> (kWarpSize - S)) << team_base;
}

// The lowest lane of the team whose `key` equals the team's largest.
template <int S>
__device__ __forceinline__ int team_argmax_lane(unsigned key, int team_base, unsigned& top) {
  top = team_max_key<S>(key);
  return __ffs(__ballot_sync(kFullMask, key == top) & team_lanes<S>(team_base)) - 1;
}

// A lane's best entries, best first: three, so that a rescan is needed only when one lane holds
// more than three of a token's K (at E = 128 over 16 lanes, 0.12 rescans per token against 1.28
// with two kept).
constexpr int kLaneKept = 3;

struct LaneBest {
  unsigned key[kLaneKept] = {};  // 0 = none
  int j[kLaneKept] = {};         // places in the lane's chunk
  int known = kLaneKept;         // entries of key[] that are the lane's next best
};

// The lane's best kLaneKept entries; with kAfter only those ranked after (after_key, after_j),
// the entry the lane gave up last. Ascending j with strict comparisons: equal keys rank by index.
template <bool kAfter, int V>
__device__ __forceinline__ LaneBest lane_best(const unsigned (&keys)[V], unsigned after_key = 0,
                                              int after_j = 0) {
  LaneBest b;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    unsigned key = keys[j];
    if constexpr (kAfter) {
      if (key > after_key || (key == after_key && j <= after_j)) key = 0;
    }
    // Branch-free: the nested ifs compiled to divergent branches, ~20 instructions an entry
    // and 30% of the forward's at E = 1024 (session 14's profile); selects and integer
    // min/max take 13. Strict comparisons: an equal key does not displace an earlier entry.
    const bool above0 = key > b.key[0], above1 = key > b.key[1], above2 = key > b.key[2];
    b.j[2] = above1 ? b.j[1] : above2 ? j : b.j[2];
    b.key[2] = max(b.key[2], min(b.key[1], key));
    b.j[1] = above0 ? b.j[0] : above1 ? j : b.j[1];
    b.key[1] = max(b.key[1], min(b.key[0], key));
    b.j[0] = above0 ? j : b.j[0];
    b.key[0] = max(b.key[0], key);
  }
  return b;
}

// The team's K best entries: slot k (its expert and key) is kept by team lane k % S. `best` is
// the lane's lane_best, cleared for a lane that is out of the race.
template <int S, int V, int kSlots>
__device__ __forceinline__ void team_top_k(const unsigned (&keys)[V], LaneBest best, int K,
                                           int rank, int team_base, int (&slot_expert)[kSlots],
                                           unsigned (&slot_key)[kSlots]) {
#pragma unroll 1
  for (int k = 0; k < K; ++k) {
    unsigned top;
    int winner, expert;
    if constexpr (kStridedLanes<V>) {
      // Equal keys on several lanes: the lowest expert is the lowest j, then the lowest lane.
      static_assert(S == kWarpSize);
      top = __reduce_max_sync(kFullMask, best.key[0]);
      expert = static_cast<int>(__reduce_min_sync(
          kFullMask, best.key[0] == top ? static_cast<unsigned>(best.j[0] * S + rank) : ~0u));
      winner = expert % S;
    } else {
      winner = team_argmax_lane<S>(best.key[0], team_base, top);
      expert = (winner - team_base) * V + __shfl_sync(kFullMask, best.j[0], winner);
    }
    if constexpr (kSlots == 1) {
      if (rank == k) {
        slot_expert[0] = expert;
        slot_key[0] = top;
      }
    } else if (rank == k % S) {
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        if (i == k / S) {
          slot_expert[i] = expert;
          slot_key[i] = top;
        }
      }
    }
    if (team_base + rank == winner) {
      if (--best.known == 0) {
        best = lane_best<true>(keys, best.key[0], best.j[0]);
      } else {
#pragma unroll
        for (int i = 0; i + 1 < kLaneKept; ++i) {
          best.key[i] = best.key[i + 1];
          best.j[i] = best.j[i + 1];
        }
        best.key[kLaneKept - 1] = 0;
      }
    }
  }
}

// The K best of a warp-wide strided row (kStridedLanes, S = 32: entry j of lane `rank` is expert
// j·32 + rank) by a threshold instead of K rounds. τ, the K-th largest of the lanes' largest keys,
// is at most the row's K-th largest key (K lanes hold an entry ≥ τ), so the row's K best are
// among its entries ≥ τ — typically a few more than K. Each lane marks its entries ≥ τ in a bit
// mask, writes them to `gathered` (the warp's [32] in shared memory) at its place among the
// lanes, with each key formed again by `key_of(j)` from the row (in L1) — a register array cannot
// be indexed by a varying j — and every gathered entry is ranked by counting those before it.
// Per entry that is a max, a compare and an or, against the 11 instructions of the best-three
// insert; and K − 1 short rounds over the lane maxima instead of K rounds of ~30 instructions
// (the session-19 profile of the E = 1024 forward: insert and rounds were 39% of its
// instructions). key_of must give the bits of keys[j]. Returns false, having chosen nothing,
// where more than 32 entries reach τ (many ties, or many of the best entries on one lane); the
// caller takes the rounds then. Slot k goes to lane k.
template <int V, typename KeyOf>
__device__ __forceinline__ bool strided_top_k(const unsigned (&keys)[V], int K, int rank,
                                              uint2* gathered, KeyOf&& key_of, int& slot_expert,
                                              unsigned& slot_key) {
  static_assert(kStridedLanes<V> && V <= 64);
  using Mask = std::conditional_t<(V > 32), unsigned long long, unsigned>;
  unsigned lane_max = 0;
#pragma unroll
  for (int j = 0; j < V; ++j) lane_max = max(lane_max, keys[j]);
  // τ: each of K − 1 rounds takes one holder of the largest lane maximum out (ties count once
  // each).
  for (int k = 1; k < K; ++k) {
    const unsigned top = __reduce_max_sync(kFullMask, lane_max);
    if (rank == __ffs(__ballot_sync(kFullMask, lane_max == top)) - 1) lane_max = 0;
  }
  const unsigned threshold = __reduce_max_sync(kFullMask, lane_max);

  Mask reaching = 0;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (keys[j] >= threshold) reaching |= Mask{1} << j;
  }
  const int count = V > 32 ? __popcll(reaching) : __popc(static_cast<unsigned>(reaching));
  int end = count;  // Σ of the counts of the lanes up to this one
#pragma unroll
  for (int d = 1; d < kWarpSize; d <<= 1) {
    const int below = __shfl_up_sync(kFullMask, end, d);
    if (rank >= d) end += below;
  }
  const int gathered_count = __shfl_sync(kFullMask, end, kWarpSize - 1);
  if (gathered_count > kWarpSize) return false;
  for (int at = end - count; reaching != 0; ++at) {
    const int j = (V > 32 ? __ffsll(reaching) : __ffs(static_cast<unsigned>(reaching))) - 1;
    reaching &= reaching - 1;
    gathered[at] = make_uint2(key_of(j), static_cast<unsigned>(j * kWarpSize + rank));
  }
  __syncwarp();

  // Rank: the gathered entries ranked before this lane's — a larger key, or an equal one of a
  // lower expert.
  const uint2 mine = rank < gathered_count ? gathered[rank] : make_uint2(0u, ~0u);
  int before = 0;
  for (int m = 0; m < gathered_count; ++m) {
    const unsigned key = __shfl_sync(kFullMask, mine.x, m);
    const unsigned expert = __shfl_sync(kFullMask, mine.y, m);
    before += key > mine.x || (key == mine.x && expert < mine.y);
  }
  __syncwarp();
  if (rank < gathered_count && before < K) gathered[before] = mine;
  __syncwarp();
  if (rank < K) {
    slot_key = gathered[rank].x;
    slot_expert = static_cast<int>(gathered[rank].y);
  }
  __syncwarp();  // the next token's writes after these reads
  return true;
}

// strided_top_k's fallback, the rounds of team_top_k, out of line: the keys cross the call in
// memory, so that the threshold path, taken by almost every token, needs no registers for them
// after its gather (inlined, this path made ptxas spill 192 bytes at 64 registers).
template <int V>
struct StridedKeys {
  unsigned key[V];
};
struct Slot {
  int expert;
  unsigned key;
};
template <int V>
__device__ __noinline__ Slot strided_top_k_by_rounds(StridedKeys<V> keys, int K, int rank) {
  int slot_expert[1] = {0};
  unsigned slot_key[1] = {0};
  team_top_k<kWarpSize, V>(keys.key, lane_best<false>(keys.key), K, rank, 0, slot_expert, slot_key);
  return {slot_expert[0], slot_key[0]};
}

// Group-limited selection when each group is a power of two of whole lane chunks (E/G a multiple
// of V) and at most two entries score a group: a group's score, the sum of its top K/GK, comes
// from its lanes' best two, and the top group_topk groups are taken by rounds like the experts.
// Returns whether this lane's group is kept. `group` is the lane's group (G for lanes past E).
template <int S>
__device__ __forceinline__ bool team_keeps_group(const LaneBest& best, int group, int groups,
                                                 int spanned, int per_group_k, int group_topk,
                                                 int team_base) {
  unsigned g1 = best.key[0], g2 = best.key[1];
  for (int offset = 1; offset < spanned; offset <<= 1) {
    const unsigned o1 = __shfl_xor_sync(kFullMask, g1, offset);
    const unsigned o2 = __shfl_xor_sync(kFullMask, g2, offset);
    g2 = max(min(g1, o1), max(g2, o2));
    g1 = max(g1, o1);
  }
  const float score = from_order_key(g1) + (per_group_k == 2 ? from_order_key(g2) : 0.0f);
  unsigned key = group < groups ? order_key(score) : 0u;
  bool kept = false;
  for (int m = 0; m < group_topk; ++m) {
    unsigned top;
    const int winner = team_argmax_lane<S>(key, team_base, top);
    if (__shfl_sync(kFullMask, group, winner) == group) {
      kept = true;
      key = 0;
    }
  }
  return kept;
}

// The row's max (a team reduction of the lanes' maxima).
template <int S, int V>
__device__ __forceinline__ float row_max_of(const float (&l)[V]) {
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < V; ++j) m = fmaxf(m, l[j]);
  return team_max<S>(m);
}

// exp(l − max) of each entry, the row's max and Σ exp(l − max); entries past E hold −∞ and add
// nothing. Callers that need only the max and the sum pass an array they never read: its
// registers are dropped.
template <int S, int V>
__device__ __forceinline__ void row_softmax(const float (&l)[V], float (&ex)[V], float& row_max,
                                            float& row_sum) {
  row_max = row_max_of<S>(l);
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    ex[j] = fast_exp(l[j] - row_max);
    s += ex[j];
  }
  row_sum = team_sum<S>(s);
}

// The sigmoid with the row's max m at hand (the z-loss gradient needs it): one exponential per
// entry, x = e^(l − m), serves both the row's softmax and the sigmoid, since σ(l) = x / (x + c)
// with c = e^−m, and r = 1 / (x + c) also gives 1 − σ(l) = c·r, without the cancellation of
// 1 − σ where σ nears 1. In the backward that is two MUFU operations an entry instead of five
// (the sigmoid's exponential and division, its derivative's e^−l, the softmax's e^(l − m) and the
// z term's, formed again). x flushes to 0 below l = m − 87, where σ(l) < σ(m − 87): valid while
// m ≤ 16 (σ < 10^−30 there, as the plain form flushes below l = −88); c stays a normal float for
// m ≥ −80. Rows with m outside take the plain forms.
//
// Taken from 32 entries per lane on, where the backward is bound by those operations (E = 1024:
// 48.6 → 44.1 µs, session 17); at 8 per lane it measured 0.5 µs slower (the max, a team
// reduction, now comes before the first exponential). The forward, which needs only three of
// them, was no faster for it at E = 1024 (and 1 µs slower at E = 256); it takes it there to form
// the scores in place of the logits, which lets its lean kernel fit 64 registers.
template <int V>
constexpr bool kShiftedSigmoid = kStridedLanes<V>;
constexpr float kShiftedSigmoidMaxRowMax = 16.0f;
constexpr float kShiftedSigmoidMinRowMax = -80.0f;

// σ(l) from x = e^(l − m) and c = e^−m. x + c ≥ e^−16 is a normal float, so one rcp.approx does.
__device__ __forceinline__ float shifted_sigmoid(float x, float exp_neg_max) {
  return x * reciprocal(x + exp_neg_max);
}

// Whether every team of the warp may take the shifted sigmoid (lanes past the tokens' end do not
// count: their results are never used).
__device__ __forceinline__ bool warp_takes_shifted_sigmoid(float row_max, bool valid) {
  return __all_sync(kFullMask, !valid || (row_max >= kShiftedSigmoidMinRowMax &&
                                          row_max <= kShiftedSigmoidMaxRowMax));
}

// ---- Forward
// -------------------------------------------------------------------------------------

// The forward's cross-block state, in the caller's workspace. Zero before the first call; the
// last block of every call reads the totals out and leaves it zero again.
struct ForwardState {
  unsigned* finished_blocks;          // [1]
  unsigned* tokens_per_expert;        // [E]
  unsigned* aux_tokens_per_expert;    // [E]
  unsigned long long* aux_score_sum;  // [E], fixed point (kSumScale)
  float* z_partials;                  // [max blocks]
};

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

// Blocks per SM the kernels are compiled for. Up to 8 entries per lane, whose chains of team
// steps need many tokens in flight: 32 warps per SM (64 registers) for the backward and for the
// forward of whole-warp teams (E = 129 to 256), 24 (80 registers) for the forward of narrower
// teams, which spilled 112 bytes at 64 (E = 128: 3–5% slower). 32 warps also make the rounds of
// tokens per warp fewer: at T = 8192 and E = 256, 2 instead of 3 (session 17: the forward 29.4
// → 27.7 µs, the backward 15.1 → 13.6). 16 warps up to 32 entries (kStridedLanes); 8 at 64 per
// lane (E > 1024).
template <int V>
constexpr int backward_blocks_per_sm() {
  return V <= 8 ? 4 : V <= 32 ? 2 : 1;
}
//
// The lean forward (kLean, strided layouts only) leaves out the softmax and the aux routing's own
// top-K: it serves elementwise scores (sigmoid, sqrtsoftplus) without groups whose aux routing,
// if any, is the main one (no bias then; takes_lean_forward). Its largest live state is then one
// array of the row, scores in place of logits, and at E = 1024 it fits 64 registers without spills:
// 32 warps per SM instead of 16. Measured at T = 16384 (session 18): the E = 1024 forward 60.6–62.0
// → 54.3–54.8 µs; 55.3–56.1 at 24 warps. Halving the warps instead (16 → 8, by shared memory) made
// it 62 → 85 µs: the strided forward is bound by the latency of each token's chain, and more tokens
// in flight hide it.
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
  // loaded when its token starts: loading the next token's row during this one's (sessions 7–14,
  // up to 16 entries per lane) measured 2–6% slower once the rest of the loop had shrunk
  // (docs/performance.md, router step 14).
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
  // over the block's writes ordered before it by the barrier, and a fence in every thread cost
  // each warp a wait of microseconds (the session-7 profile at E = 8).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    is_last_block = atomicAdd(s.finished_blocks, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last_block) return;
  __threadfence();
  // Every other block has finished, so the totals and the blocks' z partials are read with plain
  // L2 loads, all of a thread's issued before the first is used: atomic exchanges in a loop
  // waited one round trip per expert (1–2 µs of the forward at E = 1024, router step 34), and a
  // loop over the partials one per partial (step 39).
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

// ---- Backward
// ------------------------------------------------------------------------------------

template <typename In>
struct BackwardKernelArgs {
  RouterParams p;
  const In* logits;
  std::int64_t tokens;
  bool vector_rows;
  const std::int32_t* topk_idx;
  const float* topk_p;
  const float* dprob;
  const std::int32_t* aux_tokens_per_expert;
  float aux_factor;
  float z_factor;
  float* dlogits;
};

// The backward's shared memory: the aux gradients (kStridedLanes), then, with dprob, one row of
// E floats per team, where the selected entries' terms are added to the row's dense terms (aux,
// z) before the row is stored.
template <int S, int V>
std::size_t backward_shared_bytes(int experts, bool dprob) {
  constexpr int kTeams = kWarpSize / S;
  const std::size_t row = kStridedLanes<V> ? S * V : experts;
  return (kStridedLanes<V> ? S * V * 4 : 0) +
         (dprob ? static_cast<std::size_t>(kTeams) * kWarpsPerBlock * row * 4 : 0);
}

template <int S, int V, typename In>
__global__ void __launch_bounds__(kThreads, backward_blocks_per_sm<V>())
    router_backward_kernel(BackwardKernelArgs<In> a) {
  constexpr int kTeams = kWarpSize / S;
  constexpr int kSlots = (kMaxTopK + S - 1) / S;
  extern __shared__ __align__(16) unsigned char shared[];
  const RouterParams& p = a.p;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int rank = lane % S;
  const int team = lane / S;
  const int first = rank * V;
  const int E = p.num_experts;
  const int K = p.topk;
  const float c = p.scaling_factor;
  const float inv_c = 1.0f / c;
  const bool softmax = p.score_function == ScoreFunction::kSoftmax;
  const bool aux = a.aux_factor != 0.0f;
  const bool z = a.z_factor != 0.0f;
  const bool need_row = (softmax && p.pre_softmax) || aux || z;
  const bool need_row_softmax = (softmax && (p.pre_softmax || aux)) || z;
  constexpr bool kStrided = kStridedLanes<V>;
  float* aux_grad_row = reinterpret_cast<float*>(shared);  // [S·V] when kStrided
  float* row =
      aux_grad_row + (kStrided ? S * V : 0) + (warp * kTeams + team) * (kStrided ? S * V : E);
  // 16-byte row moves when the lane's chunk starts on a 16-byte boundary and lies in the row.
  const bool vector_chunk = V % 4 == 0 && E % 4 == 0 && first + V <= E;

  // ∂L_aux/∂s_aux[t, e] = factor · f_e is the same for every token: held in registers, or in
  // shared memory from 32 entries per lane on (kStridedLanes).
  auto aux_grad_of = [&](int e) {
    return (aux && e < E) ? a.aux_factor * static_cast<float>(a.aux_tokens_per_expert[e]) : 0.0f;
  };
  float aux_grad[V];
  if constexpr (kStrided) {
    fill_shared_row<S * V>(aux_grad_row, S * V, aux_grad_of);
    __syncthreads();
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) aux_grad[j] = aux_grad_of(first + j);
  }
  auto lane_aux_grad = [&](int j) {
    if constexpr (kStrided) {
      // One 16-byte read per run serves its four entries (the loops are unrolled).
      const float4 run =
          reinterpret_cast<const float4*>(aux_grad_row)[(j / kBackwardRun) * S + rank];
      const int q = j % kBackwardRun;
      return q == 0 ? run.x : q == 1 ? run.y : q == 2 ? run.z : run.w;
    } else {
      return aux_grad[j];
    }
  };

  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock * kTeams;
  const std::int64_t start =
      (static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + warp) * kTeams;
  for (std::int64_t base = start; base < a.tokens; base += step) {
    const std::int64_t t = base + team;
    const bool valid = t < a.tokens;
    // The token's slots (slot k on team lane k % S) and its row.
    int slot_expert[kSlots];
    float slot_p[kSlots], slot_dp[kSlots], l[V];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      const int k = i * S + rank;
      const bool active = valid && k < K && i * S < K;
      slot_expert[i] = active ? a.topk_idx[t * K + k] : 0;
      slot_p[i] = active ? a.topk_p[t * K + k] : 0.0f;
      slot_dp[i] = (active && a.dprob != nullptr) ? a.dprob[t * K + k] : 0.0f;
    }
    if (need_row) {
      load_entries<S, V, kBackwardRun>(l, a.logits, t, valid, rank, E, a.vector_rows);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) l[j] = -INFINITY;
    }

    // The selected entries' terms, slot_d, added through shared memory below; dense_dot, the
    // pre-softmax's Σ s·ds that every entry's term carries.
    float slot_d[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) slot_d[i] = 0.0f;
    float dense_dot = 0.0f;

    if (a.dprob != nullptr) {
      if (softmax && !p.pre_softmax) {
        // dl_m = c·q_m·(dp_m − Σ_j q_j dp_j) with q = p / c.
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < kSlots; ++i) dot += (slot_p[i] * inv_c) * slot_dp[i];
        dot = team_sum<S>(dot);
#pragma unroll
        for (int i = 0; i < kSlots; ++i) slot_d[i] = slot_p[i] * (slot_dp[i] - dot);
      } else if (softmax) {
        // ds = c·dp at the selected; dl = s ⊙ (ds − Σ s·ds), with s_m = p_m / c at the selected:
        // −s·Σ s·ds everywhere, and s_m·ds_m = p_m·dp_m at the selected.
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          dense_dot += (slot_p[i] * inv_c) * (c * slot_dp[i]);
          slot_d[i] = slot_p[i] * slot_dp[i];
        }
        dense_dot = team_sum<S>(dense_dot);
      } else {
        float s[kSlots], ds_dl[kSlots];
        float s_sum = 0.0f, dp_dot_p = 0.0f;
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          s[i] = 0.0f;
          ds_dl[i] = 0.0f;
          if (i * S < K && valid && i * S + rank < K) {
            const float slot_logit = device::to_float(a.logits[t * E + slot_expert[i]]);
            s[i] = elementwise_score(p.score_function, slot_logit);
            ds_dl[i] = elementwise_score_derivative(p.score_function, slot_logit, s[i]);
          }
          s_sum += s[i];
          dp_dot_p += slot_dp[i] * slot_p[i];
        }
        if (K == 1) {
#pragma unroll
          for (int i = 0; i < kSlots; ++i) slot_d[i] = c * slot_dp[i] * ds_dl[i];
        } else {
          const float inv_norm = 1.0f / (team_sum<S>(s_sum) + kNormEpsilon);
          dp_dot_p = team_sum<S>(dp_dot_p);
#pragma unroll
          for (int i = 0; i < kSlots; ++i)
            slot_d[i] = (c * slot_dp[i] - dp_dot_p) * inv_norm * ds_dl[i];
        }
      }
    }

    // The dense terms of every entry (pre-softmax, aux, z), formed in one pass over the row: w
    // holds softmax(l) (softmax) or g(l) (elementwise, with the aux loss), and nothing else of
    // the row stays live beside it.
    float w[V];
    float row_max = 0.0f, row_sum = 1.0f, exp_neg_max = 0.0f;
    bool shifted = false;
    if (softmax) {
      if (need_row_softmax) {
        row_softmax<S>(l, w, row_max, row_sum);
        const float inv_row_sum = 1.0f / row_sum;
#pragma unroll
        for (int j = 0; j < V; ++j) w[j] *= inv_row_sum;
      }
    } else {
      // The shifted sigmoid when the row allows it: l then holds x = e^(l − m) (as row_softmax
      // forms it, so the z terms are the same to the bit) and w holds r = 1 / (x + e^−m), from
      // which σ = x·r and σ' = σ·(1 − σ) = x·r·e^−m·r.
      if (kShiftedSigmoid<V> && (aux || z) && p.score_function == ScoreFunction::kSigmoid) {
        row_max = row_max_of<S>(l);
        shifted = warp_takes_shifted_sigmoid(row_max, valid);
      }
      if (shifted) {
        exp_neg_max = fast_exp(-row_max);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          l[j] = fast_exp(l[j] - row_max);
          sum += l[j];
          w[j] = reciprocal(l[j] + exp_neg_max);  // ≥ e^−16: a normal float
        }
        if (z) row_sum = team_sum<S>(sum);
      } else {
        if (z) {
          float unused[V];
          row_softmax<S>(l, unused, row_max, row_sum);
        }
        if (aux) elementwise_scores(p.score_function, l, w);
      }
    }
    const float z_scale = z ? a.z_factor * 2.0f * (row_max + logf(row_sum)) : 0.0f;
    float g[V];
    if (softmax) {
      // Every dense term is softmax(l) times one coefficient of the token (plus f_e's factor):
      // −Σ s·ds (pre-softmax), −Σ s·∂L_aux/∂s (aux), 2β/T·lse (z).
      float coef = z_scale - dense_dot;
      if (aux) {
        float s_dot_g = 0.0f;
#pragma unroll
        for (int j = 0; j < V; ++j) s_dot_g += w[j] * lane_aux_grad(j);
        coef -= team_sum<S>(s_dot_g);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) g[j] = need_row_softmax ? w[j] * (coef + lane_aux_grad(j)) : 0.0f;
    } else {
      // s_aux = u / S, u = g(l), S = Σu + ε:  du_m = g_m / S − Σ_i g_i u_i / S².
      float inv_norm = 0.0f, shift = 0.0f;
      // u = g(l): w (plain), x·r (shifted). One loop per score function and per term: choices
      // made per entry compiled to a test and a branch per entry.
      auto shifted_u = [&](int j) { return l[j] * w[j]; };
      if (aux) {
        float u_sum = 0.0f, g_dot_u = 0.0f;
        auto add_sums = [&](auto u_of) {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float u = u_of(j);
            u_sum += u;  // g(−∞) = 0 past E
            g_dot_u += lane_aux_grad(j) * u;
          }
        };
        if (shifted) {
          add_sums(shifted_u);
        } else {
          add_sums([&](int j) { return w[j]; });
        }
        inv_norm = 1.0f / (team_sum<S>(u_sum) + kNormEpsilon);
        shift = team_sum<S>(g_dot_u) * inv_norm * inv_norm;
      }
#pragma unroll
      for (int j = 0; j < V; ++j) g[j] = 0.0f;
      if (aux) {
        auto add_aux_terms = [&](auto derivative) {
          for_entries_inside<S, V, kBackwardRun>(rank, E, [&](int j) {
            g[j] = (lane_aux_grad(j) * inv_norm - shift) * derivative(j);
          });
        };
        if (shifted) {
          add_aux_terms([&](int j) { return shifted_u(j) * (exp_neg_max * w[j]); });
        } else if (p.score_function == ScoreFunction::kSigmoid) {
          add_aux_terms([&](int j) { return sigmoid_derivative(l[j], w[j]); });
        } else {
          add_aux_terms([&](int j) { return sqrtsoftplus_derivative(l[j], w[j]); });
        }
      }
      if (z) {
        const float z_coef = z_scale / row_sum;
        if (shifted) {
#pragma unroll
          for (int j = 0; j < V; ++j) g[j] += z_coef * l[j];
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) g[j] += z_coef * fast_exp(l[j] - row_max);
        }
      }
    }

    // The row through shared memory: the dense terms in, each selected entry's term added by
    // its slot's lane (the K experts of a token differ), the row out to dlogits. A lane's chunk
    // goes in and out as whole 16-byte packs where it can, or entry by entry (kStridedLanes).
    if (a.dprob != nullptr) {
      if constexpr (kStrided) {
        write_runs<S>(row, rank, g);
      } else if (vector_chunk) {
#pragma unroll
        for (int i = 0; i < V / 4; ++i)
          reinterpret_cast<float4*>(row + first)[i] =
              make_float4(g[4 * i], g[4 * i + 1], g[4 * i + 2], g[4 * i + 3]);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if (first + j < E) row[first + j] = g[j];
        }
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        // A token's K experts differ (the forward's top-K), so no two lanes add into one entry;
        // tokens past the end (all slots 0) add nothing.
        if (valid && i * S < K && i * S + rank < K) row[slot_expert[i]] += slot_d[i];
      }
      __syncwarp();
      if constexpr (kStrided) {
        read_runs<S>(row, rank, g);
      } else if (vector_chunk) {
#pragma unroll
        for (int i = 0; i < V / 4; ++i) {
          const float4 v = reinterpret_cast<const float4*>(row + first)[i];
          g[4 * i] = v.x;
          g[4 * i + 1] = v.y;
          g[4 * i + 2] = v.z;
          g[4 * i + 3] = v.w;
        }
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if (first + j < E) g[j] = row[first + j];
        }
      }
      __syncwarp();  // the team's next token rewrites the row
    }
    if (valid) {
      if constexpr (kStrided) {
        float* out = a.dlogits + t * E;
        if (a.vector_rows && S * V <= E) {
          write_runs<S>(out, rank, g);
        } else {
          for_entries_inside<S, V, kBackwardRun>(
              rank, E, [&](int j) { out[expert_of<S, V, kBackwardRun>(rank, j)] = g[j]; });
        }
      } else {
        float* out = a.dlogits + t * E + first;
        if (vector_chunk && a.vector_rows) {
#pragma unroll
          for (int i = 0; i < V / 4; ++i)
            reinterpret_cast<float4*>(out)[i] =
                make_float4(g[4 * i], g[4 * i + 1], g[4 * i + 2], g[4 * i + 3]);
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            if (first + j < E) out[j] = g[j];
          }
        }
      }
    }
  }
}

// ---- Losses and bias update ------------------------------------------------------------------

constexpr int kReduceThreads = 256;

__global__ void router_losses_kernel(int experts, int topk, const std::int32_t* f,
                                     const float* score_sum, const float* z_sum,
                                     const std::int64_t* global_tokens, double aux_coeff,
                                     double z_coeff, float* losses) {
  __shared__ float partial[kReduceThreads / kWarpSize];
  float sum = 0.0f;
  if (f != nullptr) {
    for (int e = threadIdx.x; e < experts; e += kReduceThreads)
      sum += score_sum[e] * static_cast<float>(f[e]);
  }
  const float aux_total = block_tree_sum<kReduceThreads>(sum, partial);
  if (threadIdx.x == 0) {
    const double T = static_cast<double>(*global_tokens);
    const double aux_factor = T > 0 ? aux_coeff * experts / (topk * T * T) : 0.0;  // α·E/(K·T²)
    const double z_factor = T > 0 ? z_coeff / T : 0.0;                             // β/T
    losses[0] = f != nullptr ? static_cast<float>(aux_factor * aux_total) : 0.0f;
    losses[1] = z_sum != nullptr ? static_cast<float>(z_factor * *z_sum) : 0.0f;
  }
}

__global__ void update_expert_bias_kernel(float* bias, const std::int32_t* load, int experts,
                                          float rate) {
  __shared__ long long partial[kReduceThreads / kWarpSize];
  long long sum = 0;
  for (int e = threadIdx.x; e < experts; e += kReduceThreads) sum += load[e];
  // Compare load_i · E with the total rather than with a rounded mean: the sign is exact.
  const long long total = block_tree_sum<kReduceThreads>(sum, partial);
  for (int e = threadIdx.x; e < experts; e += kReduceThreads) {
    const long long gap = total - static_cast<long long>(load[e]) * experts;
    bias[e] += rate * static_cast<float>((gap > 0) - (gap < 0));
  }
}

// ---- Host side -------------------------------------------------------------------------------

// Both host queries below cost microseconds, more than the kernels they size at small E: asked
// once per device (SM count) and per kernel and shared-memory size (occupancy), then remembered.
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

int max_forward_blocks() {
  return sm_count() * kMaxBlocksPerSm;
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

// One persistent wave (as many blocks as fit on the SMs, no more than the tokens need): the
// forward's per-block totals then stay few, and both kernels stride over the tokens.
int grid_size(const void* kernel, std::size_t shared_bytes, std::int64_t tokens,
              int tokens_per_block) {
  const std::int64_t needed = (tokens + tokens_per_block - 1) / tokens_per_block;
  return static_cast<int>(std::max<std::int64_t>(
      1, std::min<std::int64_t>(needed, sm_count() * blocks_per_sm(kernel, shared_bytes))));
}

// Lanes per token S and logits per lane V from E. At most 8 entries per lane up to E = 256, so
// that the rows, scores and keys of a token stay in registers at a high occupancy (the session-7
// profile: 16 per lane took 128 registers and spilled); 8 lanes at least, as every token is a
// chain of dependent team steps and the GPU needs many tokens in flight; the whole warp from
// E = 256 on, where its reductions are single redux.sync instructions.
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

template <typename Kernel>
void allow_shared_memory(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024) {  // rare (E ≥ 2048 or many groups): not worth remembering
    MOE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  }
}

// Rows can move as 16-byte packs when every row starts on a 16-byte boundary.
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

template <typename In>
void launch_backward(const RouterParams& p, const RouterBackwardArgs& args, cudaStream_t stream) {
  BackwardKernelArgs<In> k{p,
                           static_cast<const In*>(args.logits),
                           args.tokens,
                           aligned_rows(args.logits, p.num_experts, sizeof(In)) &&
                               aligned_rows(args.dlogits, p.num_experts, sizeof(float)),
                           args.topk_idx,
                           args.topk_p,
                           args.dprob,
                           args.aux_tokens_per_expert,
                           args.aux_factor,
                           args.z_factor,
                           args.dlogits};
  dispatch_layout(p.num_experts, [&]<int S, int V>() {
    constexpr int kTeams = kWarpSize / S;
    auto kernel = router_backward_kernel<S, V, In>;
    const std::size_t shared = backward_shared_bytes<S, V>(p.num_experts, args.dprob != nullptr);
    allow_shared_memory(kernel, shared);
    const int blocks = grid_size(reinterpret_cast<const void*>(kernel), shared, args.tokens,
                                 kWarpsPerBlock * kTeams);
    kernel<<<blocks, kThreads, shared, stream>>>(k);
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
  return WorkspaceLayout::of(params.num_experts, max_forward_blocks()).bytes;
}

void router_workspace_clear(const RouterParams& params, void* workspace, cudaStream_t stream) {
  if (workspace == nullptr) fail("router_workspace_clear: workspace is null");
  MOE_CHECK_CUDA(cudaMemsetAsync(workspace, 0, router_workspace_bytes(params, 0), stream));
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
