// The NCCL exchange's pipeline (exchange_chunks): the local experts in chunks whose rows cross on
// the exchange's own stream while the experts run on the chunks already there; the copy exchange's
// too, dropless and in capacity mode. On every EP mesh
// shape, each chunk count (even and uneven chunks, more chunks than experts, the automatic one)
// runs a step over poisoned outputs (also with check mode on one rank only) and gives the very
// bits of the one-chunk step, which equals the fp64 mesh reference: dropless with a different T
// on every rank, capacity mode with its dropped rows kept on the sender, and fixed blocks
// (pad_to_capacity) with a shared expert; and FP8 experts, their rows sent in bf16 or as E4M3
// records (at a width of whole 128-value blocks, their codes sorted beside them for the experts),
// dropless and in fixed blocks (within FP8's error of the reference). The split-phase
// calls, with other work between them, give the same bits, and so do two blocks whose phases
// interleave over two micro-batches. (One block's steps in one chunk and in several run the same
// algorithms; the blocks here, fresh for each chunk count, take the heuristic's, as autotuning
// could time differently in each.)
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

struct Batches {
  std::vector<Matrix> xs, dys;
  std::vector<reference::LayerResult> want;
};

// Every rank draws every rank's batch, and the same reference; capacity mode's batches keep clear
// of the capacity boundary, where a last bit decides a drop.
Batches draw_batches(const MoEConfig& c, const reference::Params& params, bool same_tokens,
                     std::mt19937_64& rng) {
  const int world = test::world_size();
  Batches b{std::vector<Matrix>(world), std::vector<Matrix>(world), {}};
  for (int attempt = 0;; ++attempt) {
    REQUIRE(attempt < 50);
    for (int r = 0; r < world; ++r) {
      test::draw_separated(c, params, b.xs[r], same_tokens ? 37 : 21 + 9 * r, rng);
      b.dys[r] = test::round_to(test::random_matrix(b.xs[r].rows, c.hidden, rng), c.dtype);
    }
    // FP8 experts against the exact layer, within FP8's bound.
    MoEConfig exact = c;
    exact.fp8 = exact.fp8_dispatch = false;
    b.want = reference::run_mesh(exact, params, b.xs, b.dys);
    bool clear = true;
    for (int r = 0; r < world && c.capacity_factor > 0; ++r)
      clear = clear && test::capacity_boundary_clear(c, b.xs[r].rows, b.want[r]);
    if (clear) return b;
  }
}

// How run_step queues its second step: the whole calls, or the split-phase calls with other work
// queued between them.
enum class Calls { kWhole, kPhases };

// One step of a fresh block with `chunks`, its second, over poisoned outputs and gradients;
// check mode on this rank where asked.
test::Results run_step(MoEConfig c, int chunks, const Mesh& mesh, const reference::Params& params,
                       const Matrix& x, const Matrix& dy, bool check_mode = false,
                       Calls calls = Calls::kWhole) {
  c.exchange_chunks = chunks;
  Stream stream;
  MoEBlock block(c, mesh, stream.get());
  block.set_check_finite(check_mode);
  const int E_loc = c.num_experts / mesh.ep();
  // FP8: the first step runs on other weights, then the step's own are written over them in
  // place, so that the step compared quantizes the weights it is given, not the last step's copy.
  std::mt19937_64 other_rng(7);
  test::load_params(block,
                    c.fp8 ? test::round_params(test::random_params(c, other_rng), c.dtype) : params,
                    mesh.ep_index() * E_loc, E_loc);
  const std::int64_t T = x.rows;
  const auto x_dev = test::upload_as(x, c.dtype);
  const auto dy_dev = test::upload_as(dy, c.dtype);
  const Tensor x_view(x_dev.data(), c.dtype, {T, c.hidden});
  const Tensor dy_view(dy_dev.data(), c.dtype, {T, c.hidden});
  const ForwardOptions options = test::losses_on_device();
  MoEForward fwd = block.forward(x_view, options);
  Tensor dx = block.backward(dy_view);
  block.synchronize();
  if (c.fp8) test::load_params(block, params, mesh.ep_index() * E_loc, E_loc);
  test::poison_step(block, fwd, dx, stream.get());
  if (calls == Calls::kPhases) {
    const test::OtherWork other(stream.get());
    const test::PhasedStep step =
        test::run_phases(block, x_view, dy_view, options, [&] { other.queue(); });
    fwd = step.forward;
    dx = step.dx;
  } else {
    fwd = block.forward(x_view, options);
    dx = block.backward(dy_view);
  }
  block.synchronize();
  const test::Results results = test::read_step(block, c, fwd, dx, T);
  if (c.fp8 && calls == Calls::kWhole) {
    // The weights unchanged since: a step on the FP8 copy made for the last gives its bits.
    INFO("weights_unchanged");
    test::poison_step(block, fwd, dx, stream.get());
    ForwardOptions reuse = options;
    reuse.weights_unchanged = true;
    fwd = block.forward(x_view, reuse);
    dx = block.backward(dy_view);
    block.synchronize();
    test::check_identical(test::read_step(block, c, fwd, dx, T), results);
  }
  return results;
}

// Two blocks of one layer (a block and a scratch per micro-batch in flight), each micro-batch's
// split-phase calls between the other's, as a trainer overlapping them queues them, and a third
// block's whole step between their phases: each gives the bits of its own whole step.
void run_interleaved(const MoEConfig& c, const Mesh& mesh, const reference::Params& params,
                     const Matrix& x0, const Matrix& dy0, const Matrix& x1, const Matrix& dy1) {
  INFO("two blocks' split-phase calls interleaved");
  Stream stream;
  MoEBlock first(c, mesh, stream.get());
  MoEBlock second(c, mesh, stream.get());
  const int E_loc = c.num_experts / mesh.ep();
  test::load_params(first, params, mesh.ep_index() * E_loc, E_loc);
  test::load_params(second, params, mesh.ep_index() * E_loc, E_loc);
  const auto upload = [&](const Matrix& m, DeviceBuffer& buffer) {
    buffer = test::upload_as(m, c.dtype);
    return Tensor(buffer.data(), c.dtype, {m.rows, c.hidden});
  };
  DeviceBuffer buffers[4];
  const Tensor x0_view = upload(x0, buffers[0]), dy0_view = upload(dy0, buffers[1]);
  const Tensor x1_view = upload(x1, buffers[2]), dy1_view = upload(dy1, buffers[3]);
  const ForwardOptions options = test::losses_on_device();
  MoEForward f0 = first.forward(x0_view, options);
  Tensor dx0 = first.backward(dy0_view);
  MoEForward f1 = second.forward(x1_view, options);
  Tensor dx1 = second.backward(dy1_view);
  first.synchronize();
  const test::Results want0 = test::read_step(first, c, f0, dx0, x0.rows);
  const test::Results want1 = test::read_step(second, c, f1, dx1, x1.rows);
  test::poison_step(first, f0, dx0, stream.get());
  test::poison_step(second, f1, dx1, stream.get());

  first.forward_dispatch(x0_view, options);
  second.forward_dispatch(x1_view, options);
  {
    // A third block made, run and destroyed while both are mid-step: its buffers grow, and its
    // destruction frees them, each after waiting for the transfers in flight on the others'
    // exchange streams.
    MoEBlock passing(c, mesh, stream.get());
    test::load_params(passing, params, mesh.ep_index() * E_loc, E_loc);
    (void)passing.forward(x1_view, options);
    (void)passing.backward(dy1_view);
  }
  first.forward_experts();
  second.forward_experts();
  f0 = first.forward_combine();
  first.backward_combine(dy0_view);
  f1 = second.forward_combine();
  first.backward_experts();
  second.backward_combine(dy1_view);
  dx0 = first.backward_dispatch();
  second.backward_experts();
  dx1 = second.backward_dispatch();
  first.synchronize();
  test::check_identical(test::read_step(first, c, f0, dx0, x0.rows), want0);
  test::check_identical(test::read_step(second, c, f1, dx1, x1.rows), want1);
}

void run_pipeline_case(MoEConfig c, int ep, std::uint64_t seed,
                       EpTransport transport = EpTransport::kNccl) {
  const int world = test::world_size();
  const int rank = test::world_rank();
  c.ep = ep;
  c.dp = world / ep;
  c.ep_transport = transport;
  // Each block would time its own GEMM algorithms, and timing may pick differently from block to
  // block: the heuristic's first choice is the same everywhere.
  c.gemm_autotune = false;
  c.validate();
  INFO(c.describe() << " rank " << rank << " seed " << seed);
  if (transport == EpTransport::kCopy && !test::host_gpus_have_peer_access()) return;
  std::mt19937_64 rng(seed);
  const auto params = test::round_params(test::random_params(c, rng), c.dtype);
  const Batches b = draw_batches(c, params, c.pad_to_capacity, rng);
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, ep, world / ep, c.num_experts);
  const int E_loc = c.num_experts / ep;

  const test::Results plain = run_step(c, 1, mesh, params, b.xs[rank], b.dys[rank]);
  const reference::LayerResult& mine = b.want[rank];
  // FP8 experts: within FP8's error of the exact layer (docs/design.md, "FP8").
  const double tol = c.fp8 ? 0.1 : c.dtype == DType::kBF16 ? 2e-2 : 1e-5;
  CHECK(test::relative_error(plain.out, mine.out) <= tol);
  CHECK(test::relative_error(plain.dx, mine.dx) <= tol);
  if (transport == EpTransport::kCopy) {  // the same rows in the same places: NCCL's very bits
    INFO("against the NCCL exchange");
    MoEConfig over_nccl = c;
    over_nccl.ep_transport = EpTransport::kNccl;
    test::check_identical(run_step(over_nccl, 1, mesh, params, b.xs[rank], b.dys[rank]), plain);
  }
  for (const int chunks : {2, 3, E_loc + 1, 0}) {
    INFO("exchange_chunks " << chunks);
    test::check_identical(run_step(c, chunks, mesh, params, b.xs[rank], b.dys[rank]), plain);
  }
  // Check mode on the first rank alone (a local debugging aid): the ranks still queue the same
  // exchanges, and its reads wait for every chunk.
  INFO("check mode on rank 0");
  test::check_identical(run_step(c, 0, mesh, params, b.xs[rank], b.dys[rank], rank == 0), plain);
  // The split-phase calls, with other work queued between them, in one chunk and in the automatic
  // four.
  for (const int chunks : {1, 0}) {
    INFO("split-phase calls, exchange_chunks " << chunks);
    test::check_identical(
        run_step(c, chunks, mesh, params, b.xs[rank], b.dys[rank], false, Calls::kPhases), plain);
  }
  const int next = (rank + 1) % test::world_size();
  run_interleaved(c, mesh, params, b.xs[rank], b.dys[rank], b.xs[next], b.dys[next]);
}

}  // namespace

TEST_CASE("the pipelined NCCL exchange gives the one-chunk step's bits on every EP mesh",
          "[mpi][block][pipeline]") {
  const int world = test::world_size();
  const auto seed = test::shared_seed();
  int index = 0;
  for (int ep = 2; ep <= world; ++ep) {  // EP and EP × DP
    if (world % ep != 0) continue;
    INFO("ep " << ep);
    // Dropless, bf16, 6 or 3 experts a rank at EP 2 or 4.
    MoEConfig c = test::small_config(64, 48, 12, 3);
    c.dtype = DType::kBF16;
    c.aux_loss_coeff = 0.05;
    run_pipeline_case(c, ep, seed + index++);
    // The same over the copy engines.
    run_pipeline_case(c, ep, seed + index++, EpTransport::kCopy);
    // Capacity mode, dropping by probability: the dropped rows stay on the sender.
    c.capacity_factor = 0.75;
    run_pipeline_case(c, ep, seed + index++);
    run_pipeline_case(c, ep, seed + index++, EpTransport::kCopy);
    // Fixed blocks, fp32, by position, with a gated shared expert beside the routed path.
    c.dtype = DType::kFP32;
    c.capacity_factor = 1.25;
    c.pad_to_capacity = true;
    c.drop_policy = DropPolicy::kPosition;
    c.align_size = 16;
    c.shared_ffn_hidden = 40;
    c.shared_gate = true;
    run_pipeline_case(c, ep, seed + index++);
    // FP8 experts, the rows toward them in bf16 over both exchanges, then as E4M3 records.
    MoEConfig f = test::small_config(64, 48, 12, 3);
    f.dtype = DType::kBF16;
    f.aux_loss_coeff = 0.05;
    f.fp8 = true;
    f.align_size = 16;
    run_pipeline_case(f, ep, seed + index++);
    run_pipeline_case(f, ep, seed + index++, EpTransport::kCopy);
    f.fp8_dispatch = true;
    run_pipeline_case(f, ep, seed + index++);
    // Rows of one 128-value block, whose codes and scales each chunk's sort also leaves for its
    // experts' products, which then quantize nothing of X or dY (rows of several blocks, in the
    // automatic chunks, are test_moe_block_mesh_fp8's H = 256; the scales' layout over several
    // blocks and experts is test_gpu_fp8_rows's).
    MoEConfig wide = f;
    wide.hidden = 128;
    run_pipeline_case(wide, ep, seed + index++);
    // FP8 experts in fixed blocks (pad_to_capacity), dropping by probability.
    for (MoEConfig* fixed : {&f, &wide}) {
      fixed->capacity_factor = 1.25;
      fixed->pad_to_capacity = true;
      run_pipeline_case(*fixed, ep, seed + index++);
    }
  }
}
