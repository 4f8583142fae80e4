#include <algorithm>
#include <numeric>
#include <random>
#include <set>
#include <tuple>

#include "reference/reference.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;
using namespace moe::reference;

namespace {

Routing make_routing(std::int64_t tokens, int topk, std::vector<int> experts) {
  Routing routing;
  routing.tokens = tokens;
  routing.topk = topk;
  routing.expert = std::move(experts);
  routing.prob.resize(routing.expert.size());
  for (std::size_t i = 0; i < routing.prob.size(); ++i)
    routing.prob[i] = 0.5 + 0.1 * static_cast<double>(i);
  return routing;
}

// Random routing: K distinct experts per token; `skew` sends every token to experts 0..K-1.
Routing random_routing(std::int64_t tokens, int experts, int topk, bool skew,
                       std::mt19937_64& rng) {
  std::vector<int> chosen;
  std::vector<int> all(experts);
  std::iota(all.begin(), all.end(), 0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    if (!skew) std::shuffle(all.begin(), all.end(), rng);
    chosen.insert(chosen.end(), all.begin(), all.begin() + topk);
  }
  return make_routing(tokens, topk, chosen);
}

}  // namespace

TEST_CASE("layout of a hand-worked routing", "[cpu][layout]") {
  // Token 0 -> experts (0, 2), token 1 -> (2, 0), token 2 -> (1, 2).
  const Routing routing = make_routing(3, 2, {0, 2, 2, 0, 1, 2});
  const Layout padded = make_layout(routing, 3, 4);
  CHECK(padded.counts == std::vector<std::int64_t>{2, 1, 3});
  CHECK(padded.offsets == std::vector<std::int64_t>{0, 4, 8, 12});
  // Expert 0 holds tokens 0, 1 at rows 0, 1; expert 1 token 2 at row 4; expert 2 tokens 0, 1, 2.
  CHECK(padded.row == std::vector<std::int64_t>{0, 8, 9, 1, 4, 10});

  const Layout unpadded = make_layout(routing, 3, 0);
  CHECK(unpadded.offsets == std::vector<std::int64_t>{0, 2, 3, 6});
  CHECK(unpadded.row == std::vector<std::int64_t>{0, 3, 4, 1, 2, 5});
  CHECK(make_layout(routing, 3, 1).offsets == unpadded.offsets);

  Matrix x(3, 2);
  for (std::int64_t t = 0; t < 3; ++t) {
    x(t, 0) = static_cast<double>(t + 1);
    x(t, 1) = -static_cast<double>(t + 1);
  }
  const Matrix X = permute(x, padded, routing);
  REQUIRE(X.rows == 12);
  const std::vector<double> first_column = {1, 2, 0, 0, 3, 0, 0, 0, 1, 2, 3, 0};
  for (std::int64_t r = 0; r < 12; ++r) {
    CHECK(X(r, 0) == first_column[r]);
    CHECK(X(r, 1) == -first_column[r]);
  }
  // Combine: out[t] = Σ_k p[t,k]·Y[row(t,k)]; with Y = X each token gets back (Σ_k p) · x[t].
  const Matrix out = unpermute_combine(X, padded, routing);
  for (std::int64_t t = 0; t < 3; ++t) {
    const double p_sum = routing.prob_of(t, 0) + routing.prob_of(t, 1);
    CHECK(out(t, 0) == Approx(p_sum * x(t, 0)));
  }
  // Permute backward sums a token's K rows.
  const Matrix dx = permute_backward(X, padded, routing);
  for (std::int64_t t = 0; t < 3; ++t) CHECK(dx(t, 0) == 2 * x(t, 0));
}

TEST_CASE("random layouts: aligned groups, token order inside groups, zero padding",
          "[cpu][layout]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const int align : {0, 1, 8, 16, 32, 64, 128}) {
    for (const bool skew : {false, true}) {
      for (const auto& [tokens, experts, topk] :
           {std::tuple{0, 4, 1}, std::tuple{1, 8, 2}, std::tuple{37, 8, 2}, std::tuple{50, 16, 8},
            std::tuple{20, 4, 4}}) {
        INFO("align " << align << " skew " << skew << " T " << tokens << " E " << experts << " K "
                      << topk);
        const Routing routing = random_routing(tokens, experts, topk, skew, rng);
        const Layout layout = make_layout(routing, experts, align);
        std::set<std::int64_t> used;
        for (int e = 0; e < experts; ++e) {
          const auto begin = layout.offsets[e];
          const auto size = layout.offsets[e + 1] - begin;
          if (align > 1) CHECK(begin % align == 0);
          CHECK(size ==
                (align > 1 ? (layout.counts[e] + align - 1) / align * align : layout.counts[e]));
        }
        const Matrix x = test::random_matrix(tokens, 3, rng);
        const Matrix X = permute(x, layout, routing);
        std::vector<std::int64_t> last_token(experts, -1);
        for (std::int64_t t = 0; t < tokens; ++t) {
          for (int k = 0; k < topk; ++k) {
            const auto row = layout.row_of(t, k, topk);
            const int e = routing.expert_of(t, k);
            REQUIRE(row >= layout.offsets[e]);
            REQUIRE(row < layout.offsets[e] + layout.counts[e]);
            REQUIRE(t > last_token[e]);  // (token, slot) ascending inside the group
            last_token[e] = t;
            REQUIRE(used.insert(row).second);
            REQUIRE(X(row, 0) == x(t, 0));
          }
        }
        for (std::int64_t row = 0; row < layout.rows(); ++row) {
          if (used.count(row) == 0) {
            REQUIRE(X(row, 0) == 0.0);
            REQUIRE(X(row, 2) == 0.0);
          }
        }
      }
    }
  }
}

TEST_CASE("chunk sort: (source, local expert) rows to padded expert-major and back",
          "[cpu][layout]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> count(0, 5);
  for (const int align : {0, 8}) {
    ChunkLayout chunks{3, 4, {}};
    for (int i = 0; i < 12; ++i) chunks.counts.push_back(i % 5 == 0 ? 0 : count(rng));
    std::int64_t rows = 0;
    for (const auto c : chunks.counts) rows += c;
    Matrix source_major(rows, 2);
    for (std::int64_t r = 0; r < rows; ++r) source_major(r, 0) = static_cast<double>(r + 1);

    const Matrix expert_major = sort_chunks(source_major, chunks, align);
    const auto offsets = padded_offsets(chunks.rows_per_expert(), align);
    REQUIRE(expert_major.rows == offsets.back());
    // Expert e's group holds source 0's chunk, then source 1's, ..., then zero padding.
    std::int64_t source_row = 0;
    std::vector<std::int64_t> cursor(offsets.begin(), offsets.end() - 1);
    std::vector<std::vector<double>> expected(4);
    for (int s = 0; s < 3; ++s) {
      for (int e = 0; e < 4; ++e) {
        for (std::int64_t i = 0; i < chunks.count(s, e); ++i) {
          CHECK(expert_major(cursor[e]++, 0) == source_major(source_row++, 0));
        }
      }
    }
    for (int e = 0; e < 4; ++e) {
      for (auto r = cursor[e]; r < offsets[e + 1]; ++r) CHECK(expert_major(r, 0) == 0.0);
    }
    const Matrix back = unsort_chunks(expert_major, chunks, align);
    CHECK(back.data == source_major.data);
  }
}

TEST_CASE("expert loads and the aux-loss-free bias update", "[cpu][router]") {
  const Routing routing = make_routing(4, 2, {0, 1, 1, 2, 1, 3, 2, 3});
  const auto load = tokens_per_expert(routing, 4);
  CHECK(load == std::vector<double>{1, 3, 2, 2});
  std::vector<double> bias = {0.0, 0.0, 0.5, -0.5};
  update_expert_bias(bias, load, 0.01);  // mean 2: under-loaded up, over-loaded down, equal kept
  CHECK(bias == std::vector<double>{0.01, -0.01, 0.5, -0.5});
}
