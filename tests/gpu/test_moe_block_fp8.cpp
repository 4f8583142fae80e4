// MoEBlock with FP8 expert products (config fp8) against the exact fp64 reference of the layer,
// within FP8's bound, and the reuse of the weights' FP8 copy across micro-batches (the configs
// refused are tests/cpu/test_config.cpp's).
//
// The bound, from E4M3's 3 mantissa bits: a quantized operand's values err by at most 2^-4 of
// themselves, about 0.026 in root mean square over a block's spread of magnitudes (more for the
// values far below their block's largest, which fall among the subnormals). Errors of different
// operands are independent, so they add in squares: the output passes four quantized operands
// (X, w13; a, w2), dx eight (its own dY, w2ᵀ, dh, w13ᵀ and the forward's four, through dh), the
// weight gradients the forward's four and dY's or dh's: about √8 · 0.026 ≈ 0.074 in relative
// Frobenius norm at the most (measured 0.06-0.08 on H200). The tests allow 0.1 with inputs of one
// scale, and 0.15 with outliers (tokens 8 times larger or smaller, single values 30 times their
// row's), whose blocks push their other values toward the subnormals. The exact kernels behind it
// are checked to the last bit of their arithmetic in test_experts_fp8 and test_fp8_quantize.
#include <cmath>
#include <cstdio>
#include <random>

#include "moe/device.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "support/block_results.h"
#include "support/block_util.h"
#include "support/catch.h"

using namespace moe;
using reference::Matrix;
using test::relative_error;
using test::Results;

namespace {

// Tokens 8 times larger or smaller, and single values 30 times their row's, where the routing
// stays clear of ties.
void add_outliers(const MoEConfig& c, const reference::Params& params, Matrix& x,
                  std::mt19937_64& rng) {
  std::uniform_int_distribution<int> pick(0, 9);
  std::uniform_int_distribution<std::int64_t> column(0, c.hidden - 1);
  for (std::int64_t t = 0; t < x.rows; ++t) {
    Matrix row = reference::slice_rows(x, t, t + 1);
    const int kind = pick(rng);
    if (kind == 0) {
      for (double& v : row.data) v *= 8.0;
    } else if (kind == 1) {
      for (double& v : row.data) v /= 8.0;
    } else if (kind <= 3) {
      row(0, column(rng)) *= 30.0;
    }
    row = reference::round_to(row, c.dtype);
    if (test::well_separated(c, reference::matmul_nt(row, params.gate_weight), params.expert_bias,
                             1e-4)) {
      std::copy(row.data.begin(), row.data.end(), x.row(t).begin());
    }
  }
}

void run_case(const MoEConfig& c, std::int64_t tokens, bool outliers, std::mt19937_64& rng) {
  c.validate();
  INFO(c.describe() << " T=" << tokens << (outliers ? " with outliers" : ""));
  Stream stream;
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, stream.get());
  const auto params = test::round_params(test::random_params(c, rng), c.dtype);
  Matrix x;
  test::draw_separated(c, params, x, tokens, rng);
  if (outliers) add_outliers(c, params, x, rng);
  const Matrix dy = test::round_to(test::random_matrix(tokens, c.hidden, rng), c.dtype);
  test::load_params(block, params, 0, c.num_experts);
  const Results got = test::run_block(block, c, x, dy);
  MoEConfig exact = c;
  exact.fp8 = false;
  const auto want = reference::run_layer(exact, params, x, dy);
  const double bound = outliers ? 0.15 : 0.1;
  double worst_dw13 = 0, worst_dw2 = 0;
  for (std::size_t e = 0; e < got.dw13.size(); ++e) {
    worst_dw13 =
        std::max(worst_dw13, relative_error(got.dw13[e], transpose(want.expert_grads.dw13[e])));
    worst_dw2 =
        std::max(worst_dw2, relative_error(got.dw2[e], transpose(want.expert_grads.dw2[e])));
  }
  const double out = relative_error(got.out, want.out), dx = relative_error(got.dx, want.dx),
               dgate = relative_error(got.dgate, want.d_gate_weight);
  // The measured errors, for docs/performance.md's accuracy table.
  std::printf("fp8 layer error: %s T=%lld%s: out %.4f dx %.4f dgate %.4f dw13 %.4f dw2 %.4f\n",
              c.describe().c_str(), static_cast<long long>(tokens), outliers ? " outliers" : "",
              out, dx, dgate, worst_dw13, worst_dw2);
  CHECK(out <= bound);
  CHECK(dx <= bound);
  CHECK(dgate <= bound);
  CHECK(worst_dw13 <= bound);
  CHECK(worst_dw2 <= bound);
  // The router runs in bf16 as without fp8: the losses are the exact ones within bf16.
  CHECK(got.aux == Approx(want.aux_loss).epsilon(1e-2).margin(1e-6));
}

}  // namespace

TEST_CASE("MoEBlock with fp8 stays within FP8's bound of the exact fp64 reference",
          "[gpu][block][fp8]") {
  std::mt19937_64 rng(test::fresh_seed());
  for (const bool outliers : {false, true}) {
    run_case(test::fp8_config(128, 128, 8, 2), 45, outliers, rng);
    run_case(test::deepseek_like(test::fp8_config(256, 144, 8, 2)), 200, outliers, rng);
    MoEConfig shared = test::fp8_config(128, 256, 8, 2);
    shared.shared_ffn_hidden = 64;
    shared.keep_expert_input = true;
    run_case(shared, 100, outliers, rng);
  }
}

TEST_CASE("MoEBlock with fp8 reuses the weights' FP8 copy only while they are unchanged",
          "[gpu][block][fp8]") {
  std::mt19937_64 rng(test::fresh_seed());
  const MoEConfig c = test::fp8_config(128, 128, 8, 2);
  Stream stream;
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, stream.get());
  block.initialize(11);
  const Matrix x = test::round_to(test::random_matrix(40, c.hidden, rng), c.dtype);
  ForwardOptions reuse;
  reuse.weights_unchanged = true;
  const Matrix first = test::start_block(block, c, x).results.out;
  // A later micro-batch of the same step: the copy is reused, and the output is the same.
  CHECK(test::start_block(block, c, x, reuse).results.out.data == first.data);
  // Expert weights written in place (an optimizer step) and reuse asked for anyway: the stale copy
  // runs, as documented; without reuse the new weights are quantized.
  const auto& view = block.parameters();
  test::copy_into(
      view.w13, test::round_to(test::random_matrix(view.w13.numel() / c.hidden, c.hidden, rng, 0.1),
                               c.dtype));
  test::copy_into(view.w2, test::round_to(test::random_matrix(view.w2.numel() / c.ffn_hidden,
                                                              c.ffn_hidden, rng, 0.1),
                                          c.dtype));
  CHECK(test::start_block(block, c, x, reuse).results.out.data == first.data);
  CHECK(test::start_block(block, c, x).results.out.data != first.data);
  // New weights at the same addresses: initialize forgets the copy even when told to reuse it.
  block.initialize(12);
  const Matrix second = test::start_block(block, c, x, reuse).results.out;
  CHECK(second.data != first.data);
  Stream other_stream;
  MoEBlock fresh(c, mesh, other_stream.get());
  fresh.initialize(12);
  CHECK(test::start_block(fresh, c, x).results.out.data == second.data);
}
