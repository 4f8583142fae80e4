// Where the copy exchange's rows go (docs/design.md, "Transports"). From every EP rank's rows per
// expert, all-gathered, each rank knows every rank's layouts: its rows for expert g are one
// block of its sender's layout (by expert, unpadded), and on g's rank one block of the padded
// expert-major layout (each expert's group holds the sources' blocks in source order). So each
// (rank, expert) block is one copy, both ways, with no staging and no chunk sort.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "comm/exchange.h"
#include "comm/peer_copy.h"
#include "kernels/experts.h"
#include "moe/config.h"

namespace moe {

struct CopyPlan {
  ExchangeCounts counts;                  // this rank's, as the NCCL counts exchange gives them
  std::vector<std::int64_t> expert_rows;  // [EP] each rank's padded expert-major rows
  std::vector<std::int64_t> slot_rows;    // [EP] each rank's slots' rows, every group's
  // Per chunk of local experts: this rank's blocks to the experts' ranks (from its sender's
  // layout into theirs), and back to the senders (from its expert-major layout into theirs).
  std::vector<std::vector<RowCopy>> to_experts, to_senders;
};

// all_counts [ranks · E]: rank s's rows for global expert g at [s · E + g], where EP rank r holds
// experts [r · E_loc, (r + 1) · E_loc) and E = ranks · E_loc. Each chunk's copies move its local
// experts [first, end), on every rank. Throws on a negative count, and where a rank would receive
// more rows than an int32 row index reaches.
CopyPlan plan_copies(std::span<const std::int32_t> all_counts, int ranks, int me, int local_experts,
                     std::span<const ExpertSpan> chunks, const MoEConfig& config);

}  // namespace moe
