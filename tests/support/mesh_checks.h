// What the mesh block tests share: one seed for every rank, and the check of a rank's gradients
// against a reference run.
#pragma once

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cstdint>
#include <vector>

#include "moe/moe_block.h"
#include "reference/reference.h"
#include "support/block_util.h"
#include "support/catch.h"
#include "support/test_main.h"

namespace moe::test {

// Rank 0's fresh seed, on every rank: they draw the same global batch and weights.
inline std::uint64_t shared_seed() {
  std::uint64_t seed = world_rank() == 0 ? fresh_seed() : 0;
  MOE_CHECK_MPI(MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD));
  return seed;
}

// Whether every pair of this host's GPUs has peer access, which the peer and copy exchanges need
// (the mesh tests run every rank on one host).
inline bool host_gpus_have_peer_access() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) return false;
  for (int a = 0; a < devices; ++a) {
    for (int b = 0; b < devices; ++b) {
      int can = 0;
      if (a != b && (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess || can == 0)) return false;
    }
  }
  return true;
}

// The exchanges a test runs under EP: NCCL, auto (the peer exchange where the EP group has peer
// access) and, with peer access, the copy exchange.
inline std::vector<EpTransport> ep_transports() {
  if (host_gpus_have_peer_access())
    return {EpTransport::kNccl, EpTransport::kAuto, EpTransport::kCopy};
  return {EpTransport::kNccl, EpTransport::kAuto};
}

// The gate's gradient, this rank's experts' and the shared expert's, against `want` within
// `tolerance` (the gate's within gate_tolerance where one is given). The rank's local expert le
// is want's expert first_expert + le (its global index against a single run, first_expert 0
// against a mesh reference's own rank).
inline void check_rank_gradients(const MoEConfig& c, const MoEGradients& g,
                                 const reference::LayerResult& want, int first_expert,
                                 int local_experts, double tolerance, double gate_tolerance = 0) {
  CHECK(relative_error(read(g.gate_weight, c.num_experts, c.hidden), want.d_gate_weight) <=
        (gate_tolerance > 0 ? gate_tolerance : tolerance));
  const std::int64_t F = c.ffn_hidden, H = c.hidden;
  const reference::Matrix dw13 = read(g.w13, local_experts * 2 * F, H);
  const reference::Matrix dw2 = read(g.w2, local_experts * H, F);
  for (int le = 0; le < local_experts; ++le) {
    const int e = first_expert + le;
    INFO("expert " << e << " of the reference");
    CHECK(relative_error(reference::slice_rows(dw13, le * 2 * F, (le + 1) * 2 * F),
                         transpose(want.expert_grads.dw13[e])) <= tolerance);
    CHECK(relative_error(reference::slice_rows(dw2, le * H, (le + 1) * H),
                         transpose(want.expert_grads.dw2[e])) <= tolerance);
  }
  if (c.shared_experts()) {  // summed over the world
    const std::int64_t Fs = c.shared_ffn_hidden;
    CHECK(relative_error(read(g.shared_w13, 2 * Fs, H), transpose(want.shared_grads.dw13)) <=
          tolerance);
    CHECK(relative_error(read(g.shared_w2, H, Fs), transpose(want.shared_grads.dw2)) <= tolerance);
  }
}

}  // namespace moe::test
