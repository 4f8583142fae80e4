// Device code that the router's kernels share: fast math for the score functions and their
// derivatives, block and team reductions, the layout of a token's experts over its team's lanes
// and the loads of its logits, and the row's softmax and shifted sigmoid.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "moe/types.h"
#include "router.cuh"
#include "router_launch.h"
#include "vector_access.cuh"

namespace moe::router_detail {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kNormEpsilon = 1e-20f;

// ---- Arithmetic ---------------------------------------------------------------------------------

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
// three more instructions per entry, for values that vanish beside the row's largest term of 1
// in every sum they enter.
__device__ __forceinline__ float fast_exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
  return y;
}

// 1/y as one rcp.approx for a y known to be a normal float. __fdividef tests its divisor for the
// range where it rescales (two predicated multiplications and a compare an entry in the shifted
// sigmoid, which the E = 1024 forward runs on every entry); for a normal y its result is the same
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

// Fast reciprocal division: the IEEE division's slow path for operands outside its fast range
// costs a branch per entry; the fast one's 2 ulp are far inside the tolerances.
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
// cancels, and the 2 ulp of the fast division in s become ~10⁻⁵ of 1 − s at l ≈ 4 (the test
// grid's tolerance; seed 652691080432844090 at E = 256, K = 1, T = 1 misses it by 4%).
// Both sides are formed and one selected: with the exponential under the condition the compiler
// keeps a branch per entry (it does not hoist the inline ex2 above the test), and warps whose
// lanes hold logits of both signs run both paths (in the E = 1024 backward that put a third of
// the instructions in that loop). e^−l overflows only where l < 0, on the side not taken.
__device__ __forceinline__ float sigmoid_derivative(float l, float s) {
  const float e = fast_exp(-l);
  return l >= 0.0f ? s * s * e : s * (1.0f - s);
}
// g' = σ(l) / (2·√softplus(l)). Far below zero σ(l) and softplus(l) agree to fp32 precision
// (their ratio is 1 − e^l/2 + …), so g' = s/2 there; the quotient itself would be 0/0 = NaN once
// e^l underflows (l < −87), and the limit, 0, is what s/2 gives.
__device__ __forceinline__ float sqrtsoftplus_derivative(float l, float s) {
  return l < -20.0f ? 0.5f * s : __fdividef(sigmoid(l), 2.0f * s);
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

// Σ of one value per thread over a block of kN threads: xor butterflies within each warp, then
// the warps' totals in warp order — the same additions in the same order on every run (bitwise
// deterministic; both lanes of a butterfly pair add the same two values, so every lane holds the
// same bits). Every thread gets the total. `tree` holds kN / 32 values; the leading barrier lets
// the caller reuse it for another sum right away. Two barriers, where a tree in shared memory
// takes one per level.
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
// waits one memory round trip per iteration, all before the block's first token.
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
// rounds that are the forward's critical path at E = 128; xor butterflies within narrower
// teams.
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

// From 32 entries per lane on (one team per warp, E > 512) a lane owns runs of kRun consecutive
// experts strided over the row — run r of lane `rank` is experts (r·S + rank)·kRun + [0, kRun) —
// instead of one contiguous chunk, and the per-expert rows that are the same for every token
// (biases, aux score sums, aux gradients) sit in shared memory instead of 2·V registers.
// Strided, a warp's access to its run r is one contiguous span of the row, where contiguous
// chunks of 128 bytes a lane make every 16-byte access touch 32 lines. The shared rows are in
// expert order, so that a warp's accesses to run r are free of bank conflicts. At E = 1024 this
// takes the kernels from 255 registers (8 warps per SM) to 128 (16 warps).
//
// The forward takes runs of one entry (kRun = 1: entry j is expert j·S + rank, a warp's access one
// 128-byte line); the backward runs of four, each moved as one 16-byte access to the logits, to
// dlogits and to its shared rows (a quarter of the instructions for those moves). Runs of four in
// the forward run 5% slower read entry by entry, and 10% slower read as 16-byte runs, with which
// ptxas spills 412 bytes at its 128 registers.
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

// ---- The row's softmax --------------------------------------------------------------------------

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
// 44.1 µs against 48.6 with the plain forms); at 8 per lane it is 0.5 µs slower (the max, a team
// reduction, must then come before the first exponential). The forward, which needs only three
// of them, is no faster for it at E = 1024 (and 1 µs slower at E = 256); it takes it there to
// form the scores in place of the logits, which lets its lean kernel fit 64 registers.
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

// ---- Occupancy ----------------------------------------------------------------------------------

// Blocks per SM the kernels are compiled for. Up to 8 entries per lane, whose chains of team
// steps need many tokens in flight: 32 warps per SM (64 registers) for the backward and for the
// forward of whole-warp teams (E = 129 to 256), 24 (80 registers) for the forward of narrower
// teams, which spill 112 bytes at 64 (E = 128: 3–5% slower). 32 warps also make the rounds of
// tokens per warp fewer: at T = 8192 and E = 256, 2 instead of 3 at 24 warps (the forward
// 27.7 µs against 29.4, the backward 13.6 against 15.1). 16 warps up to 32 entries
// (kStridedLanes); 8 at 64 per lane (E > 1024). The forward's own choice, forward_blocks_per_sm
// in router_forward.cu, starts from this one.
template <int V>
constexpr int backward_blocks_per_sm() {
  return V <= 8 ? 4 : V <= 32 ? 2 : 1;
}

}  // namespace moe::router_detail
