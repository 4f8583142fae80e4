// load_imbalance: the largest load over the mean, per expert and per EP rank.
#include <cstdint>
#include <vector>

#include "moe/moe_block.h"
#include "support/catch.h"

using namespace moe;

TEST_CASE("load imbalance per expert and per EP rank", "[cpu][load]") {
  // 8 experts, 4 EP ranks of 2 experts: loads 10, 30 | 20, 20 | 0, 40 | 20, 20 (total 160).
  const std::vector<std::int64_t> loads = {10, 30, 20, 20, 0, 40, 20, 20};
  const LoadImbalance by_four = load_imbalance(loads, 4);
  CHECK(by_four.expert == Approx(40.0 / 20.0));   // mean 20
  CHECK(by_four.ep_rank == Approx(40.0 / 40.0));  // every rank holds 40
  const LoadImbalance by_two = load_imbalance(loads, 2);
  CHECK(by_two.ep_rank == Approx(80.0 / 80.0));
  const LoadImbalance one_rank = load_imbalance(loads, 1);
  CHECK(one_rank.ep_rank == 1.0);
  CHECK(one_rank.expert == Approx(2.0));
  // Every token on one expert of eight: 8×; on one of two ranks: 2×.
  const std::vector<std::int64_t> hot = {0, 0, 0, 0, 0, 0, 0, 96};
  CHECK(load_imbalance(hot, 2).expert == Approx(8.0));
  CHECK(load_imbalance(hot, 2).ep_rank == Approx(2.0));
  // No tokens: even by convention.
  const std::vector<std::int64_t> none(8, 0);
  CHECK(load_imbalance(none, 4).expert == 1.0);
  CHECK(load_imbalance(none, 4).ep_rank == 1.0);
}

TEST_CASE("load imbalance rejects a mesh that does not divide the experts, and negative loads",
          "[cpu][load]") {
  const std::vector<std::int64_t> loads = {1, 2, 3};
  CHECK_THROWS_WITH(load_imbalance(loads, 2),
                    test::contains_text("ep = 2 must be >= 1 and divide"));
  CHECK_THROWS_WITH(load_imbalance(loads, 0), test::contains_text("ep = 0"));
  const std::vector<std::int64_t> negative = {4, -1};
  CHECK_THROWS_WITH(load_imbalance(negative, 1),
                    test::contains_text("expert 1 has a negative load -1"));
}
