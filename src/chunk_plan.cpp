#include "src/chunk_plan.h"

#include <algorithm>

#include "moe/error.h"

namespace moe {
namespace {

// Where each group of `counts` starts, with the total last.
std::vector<std::int64_t> starts(std::span<const std::int32_t> counts, const char* name) {
  std::vector<std::int64_t> start(counts.size() + 1, 0);
  for (std::size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0) fail("plan_chunk_ranges: {} count {} is {}", name, i, counts[i]);
    start[i + 1] = start[i] + counts[i];
  }
  return start;
}

}  // namespace

std::vector<ExpertSpan> near_equal_spans(int local_experts, int chunks) {
  if (chunks < 1 || chunks > local_experts)
    fail("near_equal_spans: {} chunks of {} local experts (need 1 to the experts)", chunks,
         local_experts);
  std::vector<ExpertSpan> spans;
  for (int chunk = 0; chunk < chunks; ++chunk)
    spans.push_back({chunk * local_experts / chunks, (chunk + 1) * local_experts / chunks});
  return spans;
}

std::vector<ChunkRanges> plan_chunk_ranges(std::span<const std::int32_t> sent,
                                           std::span<const std::int32_t> received, int ranks,
                                           int local_experts, std::span<const ExpertSpan> spans) {
  const std::int64_t groups = std::int64_t{ranks} * local_experts;
  if (ranks < 1 || local_experts < 1 || std::ssize(sent) != groups ||
      std::ssize(received) != groups)
    fail("plan_chunk_ranges: {} sent and {} received counts for {} ranks of {} experts",
         sent.size(), received.size(), ranks, local_experts);
  const std::vector<std::int64_t> sent_start = starts(sent, "sent"),
                                  received_start = starts(received, "received");
  std::vector<ChunkRanges> ranges;
  for (const ExpertSpan& span : spans) {
    if (span.first < 0 || span.first > span.end || span.end > local_experts)
      fail("plan_chunk_ranges: span [{}, {}) of {} local experts", span.first, span.end,
           local_experts);
    ChunkRanges r;
    for (int peer = 0; peer < ranks; ++peer) {
      const int first = peer * local_experts + span.first, end = peer * local_experts + span.end;
      r.send_offsets.push_back(sent_start[first]);
      r.send_rows.push_back(sent_start[end] - sent_start[first]);
      r.recv_offsets.push_back(received_start[first]);
      r.recv_rows.push_back(received_start[end] - received_start[first]);
      r.widest_source = std::max(r.widest_source, r.recv_rows.back());
    }
    ranges.push_back(std::move(r));
  }
  return ranges;
}

}  // namespace moe
