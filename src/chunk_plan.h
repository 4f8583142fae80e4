// The pipeline's chunks (docs/design.md, "Pipelined exchange"): near-equal spans of consecutive
// local experts, and each EP peer's rows of a span in both of the exchange's layouts, at the very
// offsets of the exchange in one piece, so that every row lands where one piece puts it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/experts.h"

namespace moe {

// `chunks` spans of consecutive experts out of `local_experts`, their sizes at most one apart.
// Throws unless 1 ≤ chunks ≤ local_experts.
std::vector<ExpertSpan> near_equal_spans(int local_experts, int chunks);

// A chunk: each EP peer's rows of its experts, as offsets and counts in rows.
struct ChunkRanges {
  std::vector<std::int64_t> send_offsets, send_rows, recv_offsets, recv_rows;  // [EP]
  std::int64_t widest_source = 0;  // the most rows of the chunk from one source
};

// Each span's ranges in the sender's layout (`sent`: this rank's rows by global expert, peer p
// holding experts [p · E_loc, (p + 1) · E_loc)) and in the source-major layout (`received`: the
// rows that arrive, by source then local expert). Throws unless both hold ranks · local_experts
// counts, none negative, and every span lies within the local experts.
std::vector<ChunkRanges> plan_chunk_ranges(std::span<const std::int32_t> sent,
                                           std::span<const std::int32_t> received, int ranks,
                                           int local_experts, std::span<const ExpertSpan> spans);

}  // namespace moe
