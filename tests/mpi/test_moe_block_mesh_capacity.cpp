// Capacity mode on EP × DP meshes against the fp64 mesh reference (reference::run_mesh), where
// each rank drops from its own tokens: every rank's output, dx, losses, kept mask and counts, the
// gate's gradient summed over the mesh and its local experts' gradients. The dropped slots stay on
// their sender over the NCCL exchange; with pad_to_capacity its blocks are fixed. The load
// statistics hold the mesh's routed and dropped slots.
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "support/block_results.h"
#include "support/block_util.h"
#include "support/capacity_check.h"
#include "support/catch.h"
#include "support/mesh_checks.h"
#include "support/test_main.h"

using namespace moe;
using reference::Matrix;

namespace {

// One step of every rank against the mesh reference; returns the slots dropped over the mesh.
// Every rank draws the same batches and computes the same reference, so every rank takes the
// same retries.
// A rank's tokens are drawn from [min_tokens, 40]; with same_tokens one T for every rank (what
// pad_to_capacity's fixed blocks need under EP).
int run_capacity_mesh_case(MoEConfig c, int ep, int dp, bool empty_rank, std::uint64_t seed,
                           int min_tokens = 1, bool same_tokens = false) {
  const int world = test::world_size();
  const int rank = test::world_rank();
  c.ep = ep;
  c.dp = dp;
  c.validate();
  INFO(c.describe() << " rank " << rank << (empty_rank ? ", last rank without tokens" : ""));
  std::mt19937_64 rng(seed);
  auto params = test::round_params(test::random_params(c, rng), c.dtype);
  std::vector<Matrix> xs(world), dys(world);
  std::vector<reference::LayerResult> want;
  for (int attempt = 0;; ++attempt) {
    REQUIRE(attempt < 50);
    const std::int64_t shared_tokens = std::uniform_int_distribution<int>(min_tokens, 40)(rng);
    for (int r = 0; r < world; ++r) {
      const std::int64_t tokens = empty_rank && r == world - 1 ? 0
                                  : same_tokens
                                      ? shared_tokens
                                      : std::uniform_int_distribution<int>(min_tokens, 40)(rng);
      test::draw_separated(c, params, xs[r], tokens, rng);
      dys[r] = test::round_to(test::random_matrix(tokens, c.hidden, rng), c.dtype);
    }
    want = reference::run_mesh(c, params, xs, dys);
    bool clear = true;
    for (int r = 0; r < world; ++r)
      clear = clear && test::capacity_boundary_clear(c, xs[r].rows, want[r]);
    if (clear) break;
  }
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, ep, dp, c.num_experts);
  Stream stream;
  MoEBlock block(c, mesh, stream.get());
  const int E_loc = c.num_experts / ep;
  test::load_params(block, params, mesh.ep_index() * E_loc, E_loc);
  const std::int64_t T = xs[rank].rows;
  const auto x = test::upload_as(xs[rank], c.dtype);
  const auto dy = test::upload_as(dys[rank], c.dtype);
  const auto fwd = block.forward(Tensor(x.data(), c.dtype, {T, c.hidden}));
  INFO("transport " << ep_transport_name(block.ep_transport()));
  // Fixed blocks over NCCL alone; otherwise NCCL where asked, auto's choice (peer memory where the
  // EP group has it) else.
  if (ep > 1 && (c.pad_to_capacity || c.ep_transport == EpTransport::kNccl))
    CHECK(block.ep_transport() == EpTransport::kNccl);
  if (ep > 1 && c.ep_transport == EpTransport::kCopy)
    CHECK(block.ep_transport() == EpTransport::kCopy);
  const Tensor dx = block.backward(Tensor(dy.data(), c.dtype, {T, c.hidden}));
  block.reduce_gradients();
  block.synchronize();

  const reference::LayerResult& mine = want[rank];
  const double tol = c.dtype == DType::kBF16 ? 2e-2 : 1e-5;
  if (T > 0) {
    CHECK(test::relative_error(test::read(fwd.out, T, c.hidden), mine.out) <= tol);
    CHECK(test::relative_error(test::read(dx, T, c.hidden), mine.dx) <= tol);
  }
  CHECK(fwd.aux_loss == Approx(mine.aux_loss).epsilon(1e-5).margin(1e-9));
  CHECK(fwd.z_loss == Approx(mine.z_loss).epsilon(1e-5).margin(1e-9));
  test::check_rank_gradients(c, block.gradients(), mine, 0, E_loc, tol);
  // This rank's own drops: the kept mask over its slots, and its kept and dropped counts.
  const MoERouting routing = block.routing();
  const auto slots = static_cast<std::size_t>(T * c.topk);
  const auto E = static_cast<std::size_t>(c.num_experts);
  std::vector<std::int32_t> kept(slots), counts(E), dropped(E);
  if (slots > 0) copy_to_host(kept.data(), routing.kept.data, slots * 4);
  copy_to_host(counts.data(), routing.tokens_per_expert.data, E * 4);
  copy_to_host(dropped.data(), routing.dropped_per_expert.data, E * 4);
  CHECK(std::vector<int>(kept.begin(), kept.end()) == mine.kept);
  for (std::size_t e = 0; e < E; ++e) {
    INFO("expert " << e);
    CHECK(counts[e] == mine.tokens_per_expert[e]);
    CHECK(dropped[e] == mine.dropped_per_expert[e]);
  }
  // The load statistics after this one step: every rank's slots routed to each expert (kept or
  // not) and dropped, summed over the whole mesh.
  const MoELoadStatistics load = block.load_statistics();
  CHECK(load.steps == 1);
  REQUIRE(load.dropped_per_expert.numel() == c.num_experts);
  std::vector<std::int64_t> routed_total(E), dropped_total(E);
  copy_to_host(routed_total.data(), load.tokens_per_expert.data, E * 8);
  copy_to_host(dropped_total.data(), load.dropped_per_expert.data, E * 8);
  for (std::size_t e = 0; e < E; ++e) {
    INFO("expert " << e);
    double routed = 0, dropped_mesh = 0;
    for (const auto& r : want) {
      routed += r.tokens_per_expert[e] + r.dropped_per_expert[e];
      dropped_mesh += r.dropped_per_expert[e];
    }
    CHECK(routed_total[e] == static_cast<std::int64_t>(routed));
    CHECK(dropped_total[e] == static_cast<std::int64_t>(dropped_mesh));
  }
  int dropped_slots = 0;
  for (const auto& r : want)
    dropped_slots += static_cast<int>(std::count(r.kept.begin(), r.kept.end(), 0));
  return dropped_slots;
}

}  // namespace

TEST_CASE("capacity mode on every mesh shape equals the mesh reference", "[mpi][block][capacity]") {
  const int world = test::world_size();
  const auto seed = test::shared_seed();
  INFO("seed " << seed);
  int index = 0;
  // Over the run, not per case (a rank may be left without tokens). At factor 0.5 a rank of
  // T >= 8 tokens offers E·C = 8·⌈T/8⌉ < 2T = T·K rows for its slots: it must drop.
  int dropped_at_half = 0;
  for (int ep = 1; ep <= world; ++ep) {
    if (world % ep != 0) continue;
    // Under EP over every exchange: NCCL and the copy exchange, where the dropped slots are never
    // sent, and auto (the peer exchange where the EP group has peer access), where they keep rows
    // on their sender.
    const std::vector<EpTransport> transports =
        ep == 1 ? std::vector{EpTransport::kAuto} : test::ep_transports();
    for (const DropPolicy policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
      for (const double factor : {0.5, 1.25}) {
        MoEConfig c = test::small_config(64, 48, 8, 2);
        c.dtype = DType::kFP32;
        c.gemm_autotune = false;
        c.capacity_factor = factor;
        c.drop_policy = policy;
        c.ep_transport = transports[index % transports.size()];
        c.aux_loss_coeff = 0.05;
        c.z_loss_coeff = 0.01;
        // Unaligned where the factor is meant to drop (align 16 gives C = 16, above most loads).
        c.align_size = factor == 0.5 ? 0 : 16;
        ++index;
        const int dropped = run_capacity_mesh_case(c, ep, world / ep, index % 3 == 0, seed + index,
                                                   factor == 0.5 ? 8 : 1);
        if (factor == 0.5) dropped_at_half += dropped;
      }
    }
    // deepseek's router and a shared expert beside the drops, in bf16.
    MoEConfig ds = test::deepseek_like(test::small_config(64, 48, 8, 2));
    ds.capacity_factor = 0.75;
    ds.shared_ffn_hidden = 40;
    ds.gemm_autotune = false;
    for (const EpTransport transport : transports) {
      ds.ep_transport = transport;
      ds.keep_expert_input = transport != EpTransport::kAuto;  // else X stored again backward
      ++index;
      run_capacity_mesh_case(ds, ep, world / ep, false, seed + index);
    }
    // pad_to_capacity: fixed blocks in the exchange under EP (every rank the same T), each expert
    // a fixed group on one EP rank.
    for (const double factor : {0.5, 1.25}) {
      MoEConfig c = test::small_config(64, 48, 8, 2);
      c.dtype = factor == 0.5 ? DType::kFP32 : DType::kBF16;
      c.gemm_autotune = false;
      c.capacity_factor = factor;
      c.pad_to_capacity = true;
      c.aux_loss_coeff = 0.05;
      c.align_size = factor == 0.5 ? 0 : 16;
      ++index;
      const int dropped = run_capacity_mesh_case(c, ep, world / ep, false, seed + index, 8,
                                                 /*same_tokens=*/true);
      if (factor == 0.5) dropped_at_half += dropped;
    }
  }
  CHECK(dropped_at_half > 0);
}

TEST_CASE("pad_to_capacity under EP with another T on one rank fails every rank by name",
          "[mpi][block][capacity]") {
  const int world = test::world_size();
  if (world < 2) return;  // one rank: no EP group
  MoEConfig c = test::small_config(64, 48, 8, 2);
  c.dtype = DType::kFP32;
  c.capacity_factor = 1.0;
  c.pad_to_capacity = true;
  c.ep = world;
  c.dp = 1;
  c.validate();
  // Rank 1 holds one token more, or none (C = 0): its blocks would differ from the others'.
  for (const std::int64_t other : {17, 0}) {
    INFO("rank 1 holds " << other << " tokens");
    const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, c.num_experts);
    Stream stream;
    MoEBlock block(c, mesh, stream.get());
    block.initialize(5);
    const std::int64_t T = test::world_rank() == 1 ? other : 16;
    std::mt19937_64 rng(7);
    const auto x =
        test::upload_as(test::random_matrix(std::max<std::int64_t>(T, 1), c.hidden, rng), c.dtype);
    std::string message;
    try {
      (void)block.forward(Tensor(x.data(), c.dtype, {T, c.hidden}), test::losses_on_device());
    } catch (const Error& e) {
      message = e.what();
    }
    CHECK_THAT(message, test::contains_text("pad_to_capacity under EP needs the same T on every "
                                            "rank of an EP group") &&
                            test::contains_text("16, " + std::to_string(other)));
  }
}
