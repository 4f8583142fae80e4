// MoEBlock with FP8 expert products on EP×DP meshes. Every rank runs the mesh block on its part of
// a global batch, and beside it a one-GPU FP8 block on the whole batch; then it checks its rows
// and its experts' gradients:
//
// - against the exact fp64 single run, within FP8's bound (0.1, as tests/gpu/test_moe_block_fp8.cpp
//   derives it);
// - against the one-GPU FP8 block, within bf16's rounding, wherever the experts weigh their rows by
//   the probabilities as the one-GPU block does (the peer exchange, and EP = 1). The FP8
//   quantization is per row (1 × 128 tiles of a row; 128 × 128 blocks of an expert's weights), an
//   expert's rows arrive in the concatenated batch's order and its products have the same shapes,
//   so the mesh forms the same E4M3 operands: what may differ is fp32 summation order (the gate's
//   gradient and the weight gradients summed over DP replicas) and, through the gate's logits, a
//   last bit of a probability, which can move a bf16 rounding of an output or of a row of dY
//   before it is quantized. Over the NCCL exchange the unpermute weighs the rows instead, so the
//   experts quantize dY unweighed: other E4M3 roundings of the same values, within FP8's bound
//   only.
//
// With fp8_dispatch the rows toward the experts cross as E4M3 records (over NCCL whatever the
// transport asked, auto included), and out, dx and the gate's gradient must equal the same mesh's
// without it bit for bit.
#include <mpi.h>

#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "support/block_results.h"
#include "support/block_util.h"
#include "support/catch.h"
#include "support/mesh_checks.h"
#include "support/test_main.h"

using namespace moe;
using reference::Matrix;
using test::relative_error;

namespace {

constexpr double kFp8Bound = 0.1;       // against the exact fp64 run
constexpr double kSameOperands = 5e-3;  // against the one-GPU FP8 block, the same E4M3 operands

// A rank's rows [first, first + T) of a whole-batch matrix.
Matrix rank_rows(const Matrix& m, std::int64_t first, std::int64_t T) {
  return reference::slice_rows(m, first, first + T);
}

void run_fp8_mesh_case(MoEConfig c, int ep, int dp, std::uint64_t seed) {
  const int world = test::world_size();
  const int rank = test::world_rank();
  c.ep = ep;
  c.dp = dp;
  c.validate();
  INFO(c.describe() << " rank " << rank << " seed " << seed);
  std::mt19937_64 rng(seed);
  const auto params = test::round_params(test::random_params(c, rng), c.dtype);
  std::vector<std::int64_t> tokens(world);
  for (auto& t : tokens) t = std::uniform_int_distribution<int>(20, 60)(rng);
  const std::int64_t total = std::accumulate(tokens.begin(), tokens.end(), std::int64_t{0});
  Matrix x;
  test::draw_separated(c, params, x, total, rng);
  const Matrix dy = test::round_to(test::random_matrix(total, c.hidden, rng), c.dtype);
  const std::int64_t first =
      std::accumulate(tokens.begin(), tokens.begin() + rank, std::int64_t{0});
  const std::int64_t T = tokens[rank];

  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, ep, dp, c.num_experts);
  const int E_loc = c.num_experts / ep;
  const int first_expert = mesh.ep_index() * E_loc;
  const auto dy_dev = test::upload_as(rank_rows(dy, first, T), c.dtype);
  Stream stream;
  // A mesh block of `config` on this rank's rows: its results, and whether its experts weigh
  // their rows.
  const auto run_mesh_block = [&](const MoEConfig& config, bool& experts_weigh_rows) {
    MoEBlock block(config, mesh, stream.get());
    test::load_params(block, params, first_expert, E_loc);
    test::Pending pending = test::start_block(block, config, rank_rows(x, first, T));
    const Tensor dx = block.backward(Tensor(dy_dev.data(), config.dtype, {T, config.hidden}));
    block.reduce_gradients();
    MOE_CHECK_CUDA(cudaDeviceSynchronize());
    test::Results results = pending.results;
    results.dx = test::read(dx, T, config.hidden);
    test::read_gradients(block, config, results);
    experts_weigh_rows = block.probabilities_in_experts();
    return results;
  };
  bool same_operands = false;
  const test::Results got = run_mesh_block(c, same_operands);
  if (c.fp8_dispatch) {
    // The FP8 products read the records' own codes, which the sort left beside the decoded rows
    // (H a multiple of 128, as both configs here), the values that the rows' own quantization
    // gives (tests/gpu/test_moe_block_fp8.cpp says why for rows quantized again), so out, dx and
    // the gate's gradient equal the mesh's without fp8_dispatch bit for bit: the records crossed
    // and were decoded in place.
    MoEConfig bf16_rows = c;
    bf16_rows.fp8_dispatch = false;
    if (ep > 1) bf16_rows.ep_transport = EpTransport::kNccl;  // the exchange fp8_dispatch took
    bool unused = false;
    const test::Results plain = run_mesh_block(bf16_rows, unused);
    CHECK(got.out.data == plain.out.data);
    CHECK(got.dx.data == plain.dx.data);
    CHECK(got.dgate.data == plain.dgate.data);
  }

  // The one-GPU FP8 block on the whole batch, on this rank's GPU.
  MoEConfig one = c.for_one_rank();
  const Mesh single = Mesh::single();
  Stream single_stream;
  MoEBlock whole(one, single, single_stream.get());
  test::load_params(whole, params, 0, c.num_experts);
  const test::Results want_fp8 = test::run_block(whole, one, x, dy);
  MoEConfig exact = one;
  exact.fp8 = exact.fp8_dispatch = false;  // the exact layer (under fp8 the reference is FP8's)
  const auto want = reference::run_layer(exact, params, x, dy, test::kAsStored,
                                         same_operands ? reference::ProbabilityGradient::kExperts
                                                       : reference::ProbabilityGradient::kCombine);

  auto check = [&](const char* name, const Matrix& value, const Matrix& fp8_run,
                   const Matrix& exact) {
    INFO(name);
    CHECK(relative_error(value, exact) <= kFp8Bound);
    if (same_operands) CHECK(relative_error(value, fp8_run) <= kSameOperands);
  };
  check("out", got.out, rank_rows(want_fp8.out, first, T), rank_rows(want.out, first, T));
  check("dx", got.dx, rank_rows(want_fp8.dx, first, T), rank_rows(want.dx, first, T));
  check("gate gradient", got.dgate, want_fp8.dgate, want.d_gate_weight);
  for (int le = 0; le < E_loc; ++le) {
    const int e = first_expert + le;
    INFO("expert " << e);
    check("dw13", got.dw13[le], want_fp8.dw13[e], transpose(want.expert_grads.dw13[e]));
    check("dw2", got.dw2[le], want_fp8.dw2[e], transpose(want.expert_grads.dw2[e]));
  }
  // The router runs as without fp8: the losses are the mesh-wide ones.
  CHECK(got.aux == Approx(want_fp8.aux).epsilon(1e-4).margin(1e-7));
  CHECK(got.z == Approx(want_fp8.z).epsilon(1e-4).margin(1e-7));
}

}  // namespace

TEST_CASE("MoEBlock with fp8 on every mesh shape equals the one-GPU FP8 run on the whole batch",
          "[mpi][block][fp8]") {
  const int world = test::world_size();
  const auto seed = test::shared_seed();
  int index = 0;
  for (int ep = 1; ep <= world; ++ep) {
    if (world % ep != 0) continue;
    const std::vector<EpTransport> transports =
        ep == 1 ? std::vector{EpTransport::kAuto}
                : std::vector{EpTransport::kNccl, EpTransport::kAuto};
    for (const EpTransport transport : transports) {
      // fp8_dispatch: E4M3 records toward the experts (over NCCL; auto takes it).
      for (const bool fp8_dispatch : {false, true}) {
        MoEConfig plain = test::fp8_config(128, 128, 8, 2);
        MoEConfig deepseek = test::deepseek_like(test::fp8_config(256, 144, 8, 2));
        for (MoEConfig* c : {&plain, &deepseek}) {
          c->ep_transport = transport;
          c->fp8_dispatch = fp8_dispatch;
          c->z_loss_coeff = 0.001;
          c->keep_expert_input = index % 2 == 1;  // else X is stored again in the backward
          run_fp8_mesh_case(*c, ep, world / ep, seed + static_cast<std::uint64_t>(index++));
        }
      }
    }
  }
}
