#include "src/copy_plan.h"

#include <cstdint>
#include <numeric>

#include "moe/error.h"

namespace moe {

CopyPlan plan_copies(std::span<const std::int32_t> all_counts, int ranks, int me, int local_experts,
                     std::span<const ExpertSpan> chunks, const MoEConfig& config) {
  const int E_loc = local_experts, E = ranks * local_experts;
  if (ranks < 1 || me < 0 || me >= ranks || E_loc < 1 ||
      std::ssize(all_counts) != std::int64_t{ranks} * E)
    fail("plan_copies: {} counts for {} ranks of {} experts each, rank {}", all_counts.size(),
         ranks, E_loc, me);
  const auto rows_of = [&](int source, int expert) -> std::int64_t {
    const std::int32_t rows = all_counts[static_cast<std::size_t>(source) * E + expert];
    if (rows < 0) fail("plan_copies: rank {} has {} rows for expert {}", source, rows, expert);
    return rows;
  };
  // Where each rank's rows of a group start in its sender's layout, and where each expert's group
  // starts in its rank's padded expert-major layout.
  std::vector<std::vector<std::int64_t>> slot_start(ranks), group_start(ranks);
  CopyPlan plan;
  for (int r = 0; r < ranks; ++r) {
    slot_start[r].assign(E + 1, 0);
    for (int g = 0; g < E; ++g) slot_start[r][g + 1] = slot_start[r][g] + rows_of(r, g);
    group_start[r].assign(E_loc + 1, 0);
    for (int e = 0; e < E_loc; ++e) {
      std::int64_t total = 0;
      for (int s = 0; s < ranks; ++s) total += rows_of(s, r * E_loc + e);
      group_start[r][e + 1] = group_start[r][e] + config.padded_rows(total);
    }
    plan.expert_rows.push_back(group_start[r][E_loc]);
    plan.slot_rows.push_back(slot_start[r][E]);
    // The kernels index rows by int32; every rank sees every rank's sums, so all refuse alike.
    if (plan.expert_rows.back() > INT32_MAX)
      fail("plan_copies: EP rank {} would receive {} rows, beyond the int32 row index", r,
           plan.expert_rows.back());
  }
  // Rows of expert g from the sources before `source`: where source's block starts in g's group.
  const auto before = [&](int source, int g) {
    std::int64_t rows = 0;
    for (int s = 0; s < source; ++s) rows += rows_of(s, g);
    return rows;
  };

  ExchangeCounts& c = plan.counts;
  c.sent.assign(E, 0);
  c.received.assign(E, 0);
  c.send_rows.assign(ranks, 0);
  c.recv_rows.assign(ranks, 0);
  for (int g = 0; g < E; ++g) {
    c.sent[g] = static_cast<std::int32_t>(rows_of(me, g));
    c.send_rows[g / E_loc] += c.sent[g];
  }
  for (int s = 0; s < ranks; ++s) {
    for (int e = 0; e < E_loc; ++e) {
      c.received[s * E_loc + e] = static_cast<std::int32_t>(rows_of(s, me * E_loc + e));
      c.recv_rows[s] += c.received[s * E_loc + e];
    }
  }

  for (const ExpertSpan& span : chunks) {
    const int first = std::max(span.first, 0), end = std::min(span.end, E_loc);
    std::vector<RowCopy>& out = plan.to_experts.emplace_back();
    std::vector<RowCopy>& back = plan.to_senders.emplace_back();
    for (int p = 0; p < ranks; ++p) {
      for (int e = first; e < end; ++e) {
        const int g = p * E_loc + e;
        if (const std::int64_t rows = rows_of(me, g); rows > 0)
          out.push_back({p, slot_start[me][g], group_start[p][e] + before(me, g), rows});
      }
    }
    for (int s = 0; s < ranks; ++s) {
      for (int e = first; e < end; ++e) {
        const int g = me * E_loc + e;
        if (const std::int64_t rows = rows_of(s, g); rows > 0)
          back.push_back({s, group_start[me][e] + before(s, g), slot_start[s][g], rows});
      }
    }
  }
  return plan;
}

}  // namespace moe
