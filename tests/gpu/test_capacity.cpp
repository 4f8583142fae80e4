// Capacity mode's drops on the GPU against the fp64 reference (reference::keep_within_capacity):
// both policies, probabilities with ties, every token to the same experts, a capacity of zero and
// one so large that nothing drops; outputs poisoned before each launch, every slot checked.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <string>

#include "kernels/capacity.cuh"
#include "kernels/permute.cuh"
#include "reference/reference.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

using namespace moe;

namespace {

struct Case {
  std::int64_t tokens;
  int experts, topk;
  bool skewed;         // every token to experts 0 .. K-1
  int distinct_probs;  // 0: drawn freely; n: one of n values, so that many slots tie
  std::int64_t capacity;
  DropPolicy policy;
  std::string describe() const {
    std::ostringstream s;
    s << "T=" << tokens << " E=" << experts << " K=" << topk << (skewed ? " skewed" : "")
      << " distinct_probs=" << distinct_probs << " C=" << capacity
      << (policy == DropPolicy::kProbs ? " probs" : " position");
    return s.str();
  }
};

// Probabilities as fp32 holds them, so that the reference and the kernel see the same ties.
reference::Routing draw_routing(const Case& c, std::mt19937_64& rng) {
  reference::Routing routing;
  routing.tokens = c.tokens;
  routing.topk = c.topk;
  std::vector<int> all(c.experts);
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<double> free_prob(0.01, 1.0);
  std::uniform_int_distribution<int> level(1, std::max(c.distinct_probs, 1));
  for (std::int64_t t = 0; t < c.tokens; ++t) {
    if (!c.skewed) std::shuffle(all.begin(), all.end(), rng);
    for (int k = 0; k < c.topk; ++k) {
      routing.expert.push_back(all[k]);
      const double p = c.distinct_probs > 0 ? level(rng) / 8.0 : free_prob(rng);
      routing.prob.push_back(static_cast<float>(p));
    }
  }
  return routing;
}

void check_case(const Case& c, std::mt19937_64& rng) {
  INFO(c.describe());
  const reference::Routing routing = draw_routing(c, rng);
  const std::int64_t T = c.tokens, slots = T * c.topk;
  const int E = c.experts, K = c.topk;

  // The reference at the same capacity: a config whose expert_capacity(T) is exactly c.capacity
  // is not always at hand, so the reference's rule is applied with the capacity given.
  std::vector<int> want_kept(static_cast<std::size_t>(slots), 1);
  {
    std::vector<std::vector<std::size_t>> slots_of(static_cast<std::size_t>(E));
    for (std::size_t i = 0; i < routing.expert.size(); ++i)
      slots_of[static_cast<std::size_t>(routing.expert[i])].push_back(i);
    for (auto& group : slots_of) {
      if (c.policy == DropPolicy::kProbs) {
        std::stable_sort(group.begin(), group.end(), [&](std::size_t a, std::size_t b) {
          return routing.prob[a] > routing.prob[b];
        });
      }
      for (std::size_t j = static_cast<std::size_t>(c.capacity); j < group.size(); ++j)
        want_kept[group[j]] = 0;
    }
  }
  // Where a config gives this capacity, the reference library's own function agrees.
  MoEConfig config = test::small_config(8, 8, E, K);
  config.capacity_factor = 1.0;
  config.drop_policy = c.policy;
  if (config.expert_capacity(T) == c.capacity)
    CHECK(reference::keep_within_capacity(config, routing) == want_kept);
  const std::vector<double> want_dropped = reference::dropped_per_expert(routing, want_kept, E);

  std::vector<std::int32_t> idx(routing.expert.begin(), routing.expert.end());
  std::vector<float> prob(routing.prob.begin(), routing.prob.end());
  const DeviceBuffer idx_dev = test::upload(idx), prob_dev = test::upload(prob);
  Stream stream;
  const auto slot_bytes = static_cast<std::size_t>(slots) * 4 + 16;
  DeviceBuffer counts(static_cast<std::size_t>(E) * 4),
      offsets(static_cast<std::size_t>(E + 1) * 4), row_map(slot_bytes),
      layout_ws(layout_workspace_bytes(T, K, E));
  build_layout({idx_dev.as<std::int32_t>(), T, K, E, 1, counts.as<std::int32_t>(),
                offsets.as<std::int32_t>(), row_map.as<std::int32_t>(), layout_ws.data()},
               stream.get());
  stream.synchronize();

  DeviceBuffer kept(slot_bytes), kept_idx(slot_bytes), kept_p(slot_bytes),
      dropped(static_cast<std::size_t>(E) * 4), kept_counts(static_cast<std::size_t>(E) * 4),
      workspace(capacity_workspace_bytes(T, K, E) + 16);
  for (const auto* b : {&kept, &kept_idx, &kept_p, &dropped, &kept_counts, &workspace})
    test::poison(*b);
  CapacityArgs args;
  args.topk_idx = idx_dev.as<std::int32_t>();
  args.topk_p = prob_dev.as<float>();
  args.offsets = offsets.as<std::int32_t>();
  args.row_map = row_map.as<std::int32_t>();
  args.tokens = T;
  args.topk = K;
  args.experts = E;
  args.capacity = c.capacity;
  args.by_probability = c.policy == DropPolicy::kProbs;
  args.kept = kept.as<std::int32_t>();
  args.kept_idx = kept_idx.as<std::int32_t>();
  args.kept_p = kept_p.as<float>();
  args.dropped = dropped.as<std::int32_t>();
  args.routed_counts = counts.as<std::int32_t>();
  args.kept_counts = kept_counts.as<std::int32_t>();
  args.workspace = workspace.data();
  keep_within_capacity(args, stream.get());
  stream.synchronize();

  const auto got_kept = test::download<std::int32_t>(kept, static_cast<std::size_t>(slots));
  const auto got_idx = test::download<std::int32_t>(kept_idx, static_cast<std::size_t>(slots));
  const auto got_p = test::download<float>(kept_p, static_cast<std::size_t>(slots));
  const auto got_dropped = test::download<std::int32_t>(dropped, static_cast<std::size_t>(E));
  const auto got_kept_counts =
      test::download<std::int32_t>(kept_counts, static_cast<std::size_t>(E));
  std::vector<double> routed(static_cast<std::size_t>(E), 0.0);
  for (const int e : routing.expert) routed[static_cast<std::size_t>(e)] += 1.0;
  std::int64_t wrong = 0, first_wrong = -1;
  for (std::int64_t s = 0; s < slots; ++s) {
    const auto i = static_cast<std::size_t>(s);
    const bool keep = want_kept[i] != 0;
    const bool ok = got_kept[i] == (keep ? 1 : 0) && got_idx[i] == (keep ? idx[i] : E) &&
                    got_p[i] == (keep ? prob[i] : 0.0f);
    if (!ok && wrong++ == 0) first_wrong = s;
  }
  INFO("first wrong slot " << first_wrong << " of " << wrong);
  CHECK(wrong == 0);
  for (int e = 0; e < E; ++e) {
    INFO("expert " << e);
    const auto i = static_cast<std::size_t>(e);
    CHECK(got_dropped[i] == want_dropped[i]);
    CHECK(got_kept_counts[i] == routed[i] - want_dropped[i]);
  }

  // pad_to_capacity's layout of the kept routing, over the E expert groups as every exchange
  // builds it: expert e's group is exactly rows [e·C, (e + 1)·C), its kept slots first, each on a
  // row of its own; a dropped slot names group E, past them, and has no row (-1, over a row map
  // that held other values); the layout ends at E·C.
  if (c.capacity == 0) return;
  DeviceBuffer fixed_counts(static_cast<std::size_t>(E) * 4),
      fixed_offsets(static_cast<std::size_t>(E + 1) * 4), fixed_rows(slot_bytes),
      fixed_ws(layout_workspace_bytes(T, K, E));
  for (const auto* b : {&fixed_counts, &fixed_offsets}) test::poison(*b);
  MOE_CHECK_CUDA(cudaMemset(fixed_rows.data(), 0x7F, fixed_rows.bytes()));  // not -1
  MOE_CHECK_CUDA(cudaDeviceSynchronize());
  LayoutArgs fixed{kept_idx.as<std::int32_t>(),
                   T,
                   K,
                   E,
                   1,
                   fixed_counts.as<std::int32_t>(),
                   fixed_offsets.as<std::int32_t>(),
                   fixed_rows.as<std::int32_t>(),
                   fixed_ws.data()};
  fixed.fixed_rows = static_cast<int>(c.capacity);
  fixed.fixed_groups = E;
  build_layout(fixed, stream.get());
  stream.synchronize();
  const auto got_offsets =
      test::download<std::int32_t>(fixed_offsets, static_cast<std::size_t>(E + 1));
  const auto got_counts = test::download<std::int32_t>(fixed_counts, static_cast<std::size_t>(E));
  const auto got_rows = test::download<std::int32_t>(fixed_rows, static_cast<std::size_t>(slots));
  for (int e = 0; e <= E; ++e) CHECK(got_offsets[e] == e * c.capacity);
  CHECK(got_counts == got_kept_counts);
  std::vector<int> used(static_cast<std::size_t>(E * c.capacity), 0);
  std::int64_t misplaced = 0;
  for (std::int64_t s = 0; s < slots; ++s) {
    const auto i = static_cast<std::size_t>(s);
    const std::int64_t row = got_rows[i];
    if (want_kept[i] == 0) {
      misplaced += row != -1;
      continue;
    }
    const std::int64_t begin = idx[i] * c.capacity;
    const std::int64_t end = begin + got_kept_counts[static_cast<std::size_t>(idx[i])];
    if (row < begin || row >= end || used[static_cast<std::size_t>(row)]++ > 0) ++misplaced;
  }
  CHECK(misplaced == 0);
}

}  // namespace

TEST_CASE("capacity drops equal the reference: both policies, ties, skew, every capacity",
          "[gpu][capacity]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const DropPolicy policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
    // A capacity below the mean load, at it, far above it (nothing drops) and zero (all drop).
    const std::vector<Case> cases = {
        {37, 8, 2, false, 0, 5, policy},
        {37, 8, 2, false, 3, 5, policy},
        {64, 8, 2, true, 0, 7, policy},
        {64, 8, 2, true, 2, 7, policy},
        {513, 64, 6, false, 4, 41, policy},
        {513, 64, 6, false, 0, 48, policy},
        {1000, 16, 4, false, 0, 1000, policy},
        {100, 16, 4, false, 2, 0, policy},
        {4096, 256, 8, false, 8, 160, policy},
        {3001, 7, 3, true, 0, 999, policy},
        // The most experts: a dropped slot names group 2048, past every expert's.
        {300, kMaxExperts, 4, false, 0, 1, policy},
        {5000, kMaxExperts, 8, false, 3, 4, policy},
        {test::by_run_size(2048, 16384, 65536), 128, 8, false, 5, 100, policy}};
    for (const Case& c : cases) check_case(c, rng);
  }
}

TEST_CASE("capacity drops: no tokens, and bad arguments named", "[gpu][capacity]") {
  Stream stream;
  DeviceBuffer dropped(8 * 4);
  test::poison(dropped);
  CapacityArgs args;
  args.tokens = 0;
  args.topk = 2;
  args.experts = 8;
  args.capacity = 4;
  args.dropped = dropped.as<std::int32_t>();
  keep_within_capacity(args, stream.get());
  stream.synchronize();
  CHECK(test::download<std::int32_t>(dropped, 8) == std::vector<std::int32_t>(8, 0));
  args.capacity = -1;
  CHECK_THROWS_WITH(keep_within_capacity(args, stream.get()), test::contains_text("capacity = -1"));
  CHECK_THROWS_WITH(capacity_workspace_bytes(std::int64_t{1} << 30, 8, 256),
                    test::contains_text("beyond the sort's int32 count"));
}
