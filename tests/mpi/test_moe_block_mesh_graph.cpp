// Static shapes on a mesh (capacity_factor with pad_to_capacity): forward + backward +
// reduce_gradients captured in a CUDA graph, on every mesh shape: DP (ep = 1, every rank all the
// experts) and under EP (fixed blocks in the NCCL exchange, every rank of an EP group the same T).
// On every rank the eager step waits on the host for nothing and equals the fp64 mesh reference,
// and the replay over poisoned outputs equals the eager step bitwise, the exchanges and the
// gradient all-reduce included; so does a graph of the split-phase calls with other work between.
// FP8 experts too, their rows as E4M3 records over the exchange in chunks (within FP8's error of
// the exact reference).
#include <mpi.h>

#include <cstdint>
#include <random>
#include <vector>

#include "moe/device.h"
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

void run_graph_case(MoEConfig c, int ep, std::uint64_t seed) {
  const int world = test::world_size();
  const int rank = test::world_rank();
  c.ep = ep;
  c.dp = world / ep;
  c.validate();
  INFO(c.describe() << " rank " << rank);
  std::mt19937_64 rng(seed);
  const auto params = test::round_params(test::random_params(c, rng), c.dtype);
  // Every rank draws every rank's batch (a different T each on a DP mesh; under EP the fixed blocks
  // need one T) and the same reference.
  std::vector<Matrix> xs(world), dys(world);
  std::vector<reference::LayerResult> want;
  for (int attempt = 0;; ++attempt) {
    REQUIRE(attempt < 50);
    for (int r = 0; r < world; ++r) {
      test::draw_separated(c, params, xs[r], ep == 1 ? 24 + 5 * r : 29, rng);
      dys[r] = test::round_to(test::random_matrix(xs[r].rows, c.hidden, rng), c.dtype);
    }
    MoEConfig exact = c;  // FP8 experts against the exact layer, within FP8's bound
    exact.fp8 = exact.fp8_dispatch = false;
    want = reference::run_mesh(exact, params, xs, dys);
    bool clear = true;
    for (int r = 0; r < world; ++r)
      clear = clear && test::capacity_boundary_clear(c, xs[r].rows, want[r]);
    if (clear) break;
  }
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, ep, world / ep, c.num_experts);
  Stream stream;
  MoEBlock block(c, mesh, stream.get());
  const int E_loc = c.num_experts / ep;
  test::load_params(block, params, mesh.ep_index() * E_loc, E_loc);
  const std::int64_t T = xs[rank].rows;
  const auto x = test::upload_as(xs[rank], c.dtype);
  const auto dy = test::upload_as(dys[rank], c.dtype);
  const Tensor x_view(x.data(), c.dtype, {T, c.hidden});
  const Tensor dy_view(dy.data(), c.dtype, {T, c.hidden});
  const ForwardOptions options = test::losses_on_device();

  // The first step grows the buffers, times the GEMMs and agrees on them over the mesh.
  (void)block.forward(x_view, options);
  (void)block.backward(dy_view);
  block.reduce_gradients();
  block.synchronize();
  // The second waits on the host for nothing until synchronize() and equals the reference.
  const std::int64_t waits = mesh.host_waits();
  const MoEForward eager_fwd = block.forward(x_view, options);
  const Tensor eager_dx = block.backward(dy_view);
  block.reduce_gradients();
  CHECK(mesh.host_waits() == waits);
  block.synchronize();
  const test::Results eager = test::read_step(block, c, eager_fwd, eager_dx, T);
  const reference::LayerResult& mine = want[rank];
  const double tol = c.fp8 ? 0.1 : c.dtype == DType::kBF16 ? 2e-2 : 1e-5;
  CHECK(test::relative_error(eager.out, mine.out) <= tol);
  CHECK(test::relative_error(eager.dx, mine.dx) <= tol);
  CHECK(eager.aux == Approx(mine.aux_loss).epsilon(1e-5).margin(1e-9));
  CHECK(eager.z == Approx(mine.z_loss).epsilon(1e-5).margin(1e-9));
  // Under FP8 the gate's gradient against the exact layer has no arithmetic bound: a few tokens
  // hold it, and a token's dlogit under softmax post, p₁p₂(dprob₁ − dprob₂), errs with |dprob|
  // rather than with the difference (tests/gpu/test_moe_block_fp8.cpp: up to 0.103 at T = 45
  // with inputs of one scale; 0.113 seen here at 24 tokens). A missing or wrong term costs about
  // 1, which 0.3 still fails; the replays below are held to the eager step's bits.
  const double gate_tol = c.fp8 ? 0.3 : tol;
  test::check_rank_gradients(c, block.gradients(), mine, 0, E_loc, tol, gate_tol);  // own experts

  MoEForward fwd;
  Tensor dx;
  const CudaGraph step(stream.get(), [&] {
    fwd = block.forward(x_view, options);
    dx = block.backward(dy_view);
    block.reduce_gradients();
  });
  for (int replay = 0; replay < 2; ++replay) {
    INFO("replay " << replay);
    test::poison_step(block, fwd, dx, stream.get());
    step.replay(stream.get());
    block.synchronize();
    test::check_identical(test::read_step(block, c, fwd, dx, T), eager);
  }

  // The split-phase calls captured, with other work between them (the exchange's stream forks
  // and joins inside the graph): the same bits.
  const test::OtherWork other(stream.get());
  test::PhasedStep phased;
  const CudaGraph phased_step(stream.get(), [&] {
    phased = test::run_phases(block, x_view, dy_view, options, [&] { other.queue(); });
    block.reduce_gradients();
  });
  test::poison_step(block, phased.forward, phased.dx, stream.get());
  phased_step.replay(stream.get());
  block.synchronize();
  test::check_identical(test::read_step(block, c, phased.forward, phased.dx, T), eager);
}

}  // namespace

TEST_CASE("a mesh step of static shapes in a CUDA graph replays the eager step bitwise",
          "[mpi][graph]") {
  const int world = test::world_size();
  const auto seed = test::shared_seed();
  INFO("seed " << seed);
  int index = 0;
  for (int ep = 1; ep <= world; ++ep) {  // every mesh shape: DP, EP × DP, EP
    if (world % ep != 0) continue;
    INFO("ep " << ep);
    MoEConfig c = test::small_config(64, 48, 8, 2);
    c.capacity_factor = 1.25;
    c.pad_to_capacity = true;
    c.align_size = 16;
    c.aux_loss_coeff = 0.05;
    c.z_loss_coeff = 0.01;
    c.dtype = DType::kFP32;
    run_graph_case(c, ep, seed + index++);
    // bf16, dropping by position, a gated shared expert beside the routed path.
    c.dtype = DType::kBF16;
    c.capacity_factor = 0.75;
    c.drop_policy = DropPolicy::kPosition;
    c.align_size = 0;
    c.shared_ffn_hidden = 40;
    c.shared_gate = true;
    run_graph_case(c, ep, seed + index++);
    // FP8 experts, their rows sent as E4M3 records, the exchange in chunks.
    MoEConfig f = test::small_config(64, 48, 8, 2);
    f.dtype = DType::kBF16;
    f.capacity_factor = 1.25;
    f.pad_to_capacity = true;
    f.align_size = 16;
    f.aux_loss_coeff = 0.05;
    f.fp8 = true;
    f.fp8_dispatch = true;
    f.exchange_chunks = 3;
    run_graph_case(f, ep, seed + index++);
  }
}
