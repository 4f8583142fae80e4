// The copy exchange's plan (src/copy_plan.h), simulated on the host over every rank of an EP
// group: each rank's copies, applied to labelled rows, must build every expert's padded group
// exactly as the NCCL exchange's chunk sort does (the sources' blocks in source order, each in its
// sender's order, padding untouched), bring every row back to the very place it left, never write
// the same row twice.
#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "src/chunk_plan.h"
#include "src/copy_plan.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;

namespace {

// A row's label: who sent it, for which group, and its index among that sender's rows of it.
struct Label {
  int source = -1, group = -1, index = -1;
  bool operator==(const Label&) const = default;
};

void check_plan(int ranks, int local_experts, int align, int chunks, std::mt19937_64& rng) {
  const int E = ranks * local_experts;
  MoEConfig config = test::small_config(8, 8, E, 1);
  config.align_size = align;
  INFO("ranks " << ranks << ", " << local_experts << " experts a rank, align " << align << ", "
                << chunks << " chunks");
  std::uniform_int_distribution<int> count(0, 7);
  std::vector<std::int32_t> all(static_cast<std::size_t>(ranks) * E);
  for (auto& c : all) c = count(rng) < 2 ? 0 : count(rng);  // empty blocks too
  const auto rows_of = [&](int s, int g) { return all[static_cast<std::size_t>(s) * E + g]; };
  const std::vector<ExpertSpan> spans = near_equal_spans(local_experts, chunks);

  // Every rank's sender's layout, labelled; the expert-major layouts and the returned rows empty.
  std::vector<std::vector<Label>> slots(ranks), experts(ranks), returned(ranks);
  std::vector<CopyPlan> plans;
  for (int r = 0; r < ranks; ++r) {
    for (int g = 0; g < E; ++g)
      for (int i = 0; i < rows_of(r, g); ++i) slots[r].push_back({r, g, i});
    plans.push_back(plan_copies(all, ranks, r, local_experts, spans, config));
  }
  for (int r = 0; r < ranks; ++r) {
    REQUIRE(std::ssize(plans[r].expert_rows) == ranks);
    REQUIRE(std::ssize(plans[r].to_experts) == chunks);
    REQUIRE(std::ssize(plans[r].to_senders) == chunks);
    experts[r].assign(plans[0].expert_rows[r], Label{});
    returned[r].assign(plans[0].slot_rows[r], Label{});
    CHECK(plans[0].slot_rows[r] == std::ssize(slots[r]));
  }
  // Applies rank `me`'s copies from `from` into the ranks' `to`, each row written once.
  const auto apply = [](const std::vector<RowCopy>& copies, const std::vector<Label>& from,
                        std::vector<std::vector<Label>>& to) {
    for (const RowCopy& c : copies) {
      REQUIRE(c.rows > 0);
      REQUIRE(c.from >= 0);
      REQUIRE(c.from + c.rows <= std::ssize(from));
      REQUIRE(c.to >= 0);
      REQUIRE(c.to + c.rows <= std::ssize(to[c.peer]));
      for (std::int64_t i = 0; i < c.rows; ++i) {
        CHECK(to[c.peer][c.to + i] == Label{});  // not written before
        to[c.peer][c.to + i] = from[c.from + i];
      }
    }
  };
  for (int chunk = 0; chunk < chunks; ++chunk)
    for (int r = 0; r < ranks; ++r) apply(plans[r].to_experts[chunk], slots[r], experts);

  // Each rank's expert-major layout: expert e's group padded to align, the sources in order.
  for (int r = 0; r < ranks; ++r) {
    std::vector<Label> want;
    for (int e = 0; e < local_experts; ++e) {
      const int g = r * local_experts + e;
      std::int64_t total = 0;
      for (int s = 0; s < ranks; ++s) {
        for (int i = 0; i < rows_of(s, g); ++i) want.push_back({s, g, i});
        total += rows_of(s, g);
      }
      want.resize(want.size() + (config.padded_rows(total) - total), Label{});  // padding
    }
    CHECK(experts[r] == want);
    // This rank's counts, as the NCCL counts exchange gives them.
    const ExchangeCounts& c = plans[r].counts;
    for (int g = 0; g < E; ++g) CHECK(c.sent[g] == rows_of(r, g));
    for (int s = 0; s < ranks; ++s) {
      std::int64_t from_s = 0, to_s = 0;
      for (int e = 0; e < local_experts; ++e) {
        CHECK(c.received[s * local_experts + e] == rows_of(s, r * local_experts + e));
        from_s += rows_of(s, r * local_experts + e);
        to_s += rows_of(r, s * local_experts + e);
      }
      CHECK(c.recv_rows[s] == from_s);
      CHECK(c.send_rows[s] == to_s);
    }
  }

  // Back: every expert's row to the place it left.
  for (int chunk = 0; chunk < chunks; ++chunk)
    for (int r = 0; r < ranks; ++r) apply(plans[r].to_senders[chunk], experts[r], returned);
  for (int r = 0; r < ranks; ++r) CHECK(returned[r] == slots[r]);
}

}  // namespace

TEST_CASE("the copy exchange's plan builds the padded layouts and brings every row back",
          "[cpu][exchange]") {
  std::mt19937_64 rng(test::fresh_seed());
  for (const int ranks : {1, 2, 3, 4, 8})
    for (const int local_experts : {1, 3, 5})
      for (const int align : {0, 4, 16})
        for (const int chunks : {1, 2, local_experts})
          if (chunks <= local_experts) check_plan(ranks, local_experts, align, chunks, rng);
}

TEST_CASE("the copy exchange's plan refuses counts that do not fit its group", "[cpu][exchange]") {
  const MoEConfig config = test::small_config(8, 8, 4, 1);
  const std::vector<ExpertSpan> one{{0, 2}};
  std::vector<std::int32_t> all(8, 1);
  CHECK_THROWS_WITH(plan_copies(std::span(all).first(7), 2, 0, 2, one, config),
                    test::contains_text("plan_copies: 7 counts for 2 ranks of 2 experts each"));
  CHECK_THROWS_WITH(plan_copies(all, 2, 2, 2, one, config), test::contains_text("rank 2"));
  all[5] = -3;
  CHECK_THROWS_WITH(plan_copies(all, 2, 0, 2, one, config),
                    test::contains_text("plan_copies: rank 1 has -3 rows for expert 1"));
  // Both ranks send INT32_MAX rows to expert 2 (on EP rank 1): 2^32 − 2 rows there.
  all = {0, 0, INT32_MAX, 0, 0, 0, INT32_MAX, 0};
  CHECK_THROWS_WITH(plan_copies(all, 2, 0, 2, one, config),
                    test::contains_text("EP rank 1 would receive 4294967294 rows, beyond the "
                                        "int32 row index"));
}
