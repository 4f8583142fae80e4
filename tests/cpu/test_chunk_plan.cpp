// The pipeline's chunks (src/chunk_plan.h): the spans tile the local experts in near-equal runs,
// and each chunk's ranges, taken in chunk order, tile every peer's rows of the exchange in one
// piece, in both layouts, so that every row lands where the exchange in one piece puts it.
#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "src/chunk_plan.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;

namespace {

// Rows [offset, offset + rows) of each chunk, in chunk order, must tile [begin, end).
void check_tiling(const std::vector<std::int64_t>& offsets, const std::vector<std::int64_t>& rows,
                  std::int64_t begin, std::int64_t end) {
  std::int64_t at = begin;
  for (std::size_t c = 0; c < offsets.size(); ++c) {
    CHECK(offsets[c] == at);
    CHECK(rows[c] >= 0);
    at += rows[c];
  }
  CHECK(at == end);
}

}  // namespace

TEST_CASE("chunk spans tile the local experts in runs at most one apart", "[cpu][chunks]") {
  for (int experts : {1, 2, 3, 7, 8, 32, 64}) {
    for (int chunks = 1; chunks <= std::min(experts, 9); ++chunks) {
      INFO(experts << " experts, " << chunks << " chunks");
      const auto spans = near_equal_spans(experts, chunks);
      REQUIRE(std::ssize(spans) == chunks);
      int at = 0, smallest = experts, largest = 0;
      for (const ExpertSpan& s : spans) {
        CHECK(s.first == at);
        CHECK(s.end > s.first);
        smallest = std::min(smallest, s.end - s.first);
        largest = std::max(largest, s.end - s.first);
        at = s.end;
      }
      CHECK(at == experts);
      CHECK(largest - smallest <= 1);
    }
  }
  CHECK_THROWS_WITH(near_equal_spans(4, 0), test::contains_text("0 chunks of 4"));
  CHECK_THROWS_WITH(near_equal_spans(4, 5), test::contains_text("5 chunks of 4"));
}

TEST_CASE("chunk ranges tile each peer's rows of the exchange in one piece", "[cpu][chunks]") {
  std::mt19937_64 rng(test::fresh_seed());
  for (int ranks : {1, 2, 4, 8}) {
    for (int local_experts : {1, 3, 8}) {
      for (int chunks = 1; chunks <= local_experts; ++chunks) {
        INFO(ranks << " ranks, " << local_experts << " experts a rank, " << chunks << " chunks");
        const int groups = ranks * local_experts;
        std::uniform_int_distribution<int> count(0, 9);
        std::vector<std::int32_t> sent(groups), received(groups);
        for (auto& c : sent) c = count(rng);
        for (auto& c : received) c = count(rng);
        if (groups > 1) sent[1] = received[groups - 1] = 0;  // empty groups among the others
        const auto spans = near_equal_spans(local_experts, chunks);
        const auto ranges = plan_chunk_ranges(sent, received, ranks, local_experts, spans);
        REQUIRE(std::ssize(ranges) == chunks);
        // Where each peer's groups start and end in either layout, in one piece.
        std::vector<std::int64_t> sent_start(groups + 1, 0), received_start(groups + 1, 0);
        std::partial_sum(sent.begin(), sent.end(), sent_start.begin() + 1);
        std::partial_sum(received.begin(), received.end(), received_start.begin() + 1);
        for (int peer = 0; peer < ranks; ++peer) {
          std::vector<std::int64_t> send_offsets, send_rows, recv_offsets, recv_rows;
          for (const ChunkRanges& r : ranges) {
            REQUIRE(std::ssize(r.send_offsets) == ranks);
            send_offsets.push_back(r.send_offsets[peer]);
            send_rows.push_back(r.send_rows[peer]);
            recv_offsets.push_back(r.recv_offsets[peer]);
            recv_rows.push_back(r.recv_rows[peer]);
          }
          const int first = peer * local_experts, end = first + local_experts;
          check_tiling(send_offsets, send_rows, sent_start[first], sent_start[end]);
          check_tiling(recv_offsets, recv_rows, received_start[first], received_start[end]);
        }
        for (std::size_t c = 0; c < ranges.size(); ++c) {
          const ExpertSpan s = spans[c];
          std::int64_t widest = 0;
          for (int peer = 0; peer < ranks; ++peer) {
            const int first = peer * local_experts;
            const auto rows_of = [&](const std::vector<std::int32_t>& counts) {
              return std::accumulate(counts.begin() + first + s.first,
                                     counts.begin() + first + s.end, std::int64_t{0});
            };
            CHECK(ranges[c].send_rows[peer] == rows_of(sent));  // the span's experts on the peer
            CHECK(ranges[c].recv_rows[peer] == rows_of(received));
            widest = std::max(widest, rows_of(received));
          }
          CHECK(ranges[c].widest_source == widest);
        }
      }
    }
  }
}

TEST_CASE("chunk ranges refuse counts and spans that do not fit", "[cpu][chunks]") {
  const std::vector<std::int32_t> four{1, 2, 3, 4}, three{1, 2, 3}, negative{1, -2, 3, 4};
  const auto spans = near_equal_spans(2, 2);
  CHECK_THROWS_WITH(plan_chunk_ranges(three, four, 2, 2, spans),
                    test::contains_text("3 sent and 4 received counts for 2 ranks of 2 experts"));
  CHECK_THROWS_WITH(plan_chunk_ranges(four, negative, 2, 2, spans),
                    test::contains_text("received count 1 is -2"));
  const std::vector<ExpertSpan> outside{{0, 3}};
  CHECK_THROWS_WITH(plan_chunk_ranges(four, four, 2, 2, outside),
                    test::contains_text("span [0, 3) of 2 local experts"));
}
