// The forward's top-K selection: the routing order, group-limited selection, and the team's
// K best entries, by rounds over the lanes' best entries or, for strided rows, by a threshold.
#pragma once

#include <climits>
#include <type_traits>

#include "router.cuh"
#include "router_device.cuh"

namespace moe::router_detail {

// The routing order (the CPU reference's): higher value first, ties to the lower index.
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
// entry out of the race) and its best three entries in the routing order. A round of top-K takes
// the team's largest lane-best key by one team reduction; lanes hold consecutive experts, so the
// lowest lane of the ballot of its holders holds the lowest expert index with that key (the tie
// rule) without a second reduction (strided lanes, kStridedLanes, take the lowest expert among
// the holders by a second one). Only the winning lane moves on to its next best, and only a
// lane that wins more than three times rescans its entries. A round thus costs a few dozen
// instructions per team, where passes over every entry (or a pre-filter ahead of them) cost the
// forward at E = 256 some 2,300 instructions per token.

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
    // Branch-free: nested ifs compile to divergent branches, ~20 instructions an entry and 30%
    // of the forward's at E = 1024; selects and integer min/max take 13. Strict comparisons: an
    // equal key does not displace an earlier entry.
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
// (in the E = 1024 forward the insert and the rounds are 39% of the instructions). key_of must
// give the bits of keys[j]. Returns false, having chosen nothing, where more than 32 entries
// reach τ (many ties, or many of the best entries on one lane); the caller takes the rounds
// then. Slot k goes to lane k.
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

}  // namespace moe::router_detail
