// Shared experts in the fp64 reference (docs/design.md, "Shared experts"): the forward against a
// direct transcription, the backward against finite differences, with and without the gate, and
// the simulated mesh against the single run on the concatenated batch.
#include <cmath>
#include <random>

#include "reference/reference.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;
using namespace moe::reference;

namespace {

MoEConfig shared_config(bool gated) {
  MoEConfig config = test::small_config(6, 4, 4, 2);
  config.shared_ffn_hidden = 3;
  config.shared_gate = gated;
  config.validate();
  return config;
}

}  // namespace

TEST_CASE("shared experts add (σ(x·g) ·) SwiGLU(x) to every token", "[cpu][reference][shared]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const bool gated : {false, true}) {
    INFO((gated ? "gated" : "ungated"));
    const MoEConfig config = shared_config(gated);
    const Params params = test::random_params(config, rng);
    const Matrix x = test::random_matrix(5, 6, rng), dy = test::random_matrix(5, 6, rng);
    MoEConfig routed_only = config;
    routed_only.shared_ffn_hidden = 0;
    routed_only.shared_gate = false;
    const LayerResult with = run_layer(config, params, x, dy);
    const LayerResult without = run_layer(routed_only, params, x, dy);
    CHECK(with.routing.expert == without.routing.expert);
    const Matrix& w13 = params.shared.w13;  // [H, 2Fs]
    const Matrix& w2 = params.shared.w2;    // [Fs, H]
    for (std::int64_t t = 0; t < 5; ++t) {
      INFO("token " << t);
      double gate = 1.0;
      if (gated) {
        double logit = 0.0;
        for (int i = 0; i < 6; ++i) logit += x(t, i) * params.shared.gate_weight(0, i);
        gate = 1.0 / (1.0 + std::exp(-logit));
      }
      std::vector<double> a(3);
      for (int j = 0; j < 3; ++j) {
        double g = 0.0, u = 0.0;
        for (int i = 0; i < 6; ++i) {
          g += x(t, i) * w13(i, j);
          u += x(t, i) * w13(i, 3 + j);
        }
        a[j] = silu(g) * u;
      }
      for (int i = 0; i < 6; ++i) {
        double y = 0.0;
        for (int j = 0; j < 3; ++j) y += a[j] * w2(j, i);
        CHECK(with.out(t, i) == Approx(without.out(t, i) + gate * y).epsilon(1e-12).margin(1e-12));
      }
    }
    CHECK(with.shared_grads.dgate_weight.data.empty() == !gated);
  }
}

TEST_CASE("shared experts: layer backward equals finite differences", "[cpu][reference][shared]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const bool gated : {false, true}) {
    for (const auto score : {ScoreFunction::kSoftmax, ScoreFunction::kSigmoid}) {
      INFO((gated ? "gated, " : "ungated, ") << score_function_name(score));
      MoEConfig config = shared_config(gated);
      config.score_function = score;
      config.aux_loss_coeff = 0.2;
      config.z_loss_coeff = 0.05;
      config.align_size = 4;
      Params params;
      Matrix x;
      do {
        params = test::random_params(config, rng);
        x = test::random_matrix(5, config.hidden, rng);
      } while (!test::well_separated(config, matmul_nt(x, params.gate_weight), params.expert_bias,
                                     1e-3));
      const Matrix dy = test::random_matrix(5, config.hidden, rng);
      const LayerResult result = run_layer(config, params, x, dy);
      auto objective = [&] { return layer_objective(config, params, x, dy); };
      constexpr double kTolerance = 1e-6;
      CHECK(test::relative_error(result.dx.data, test::finite_differences(x.data, objective)) <=
            kTolerance);
      CHECK(test::relative_error(result.d_gate_weight.data,
                                 test::finite_differences(params.gate_weight.data, objective)) <=
            kTolerance);
      CHECK(test::relative_error(result.shared_grads.dw13.data,
                                 test::finite_differences(params.shared.w13.data, objective)) <=
            kTolerance);
      CHECK(test::relative_error(result.shared_grads.dw2.data,
                                 test::finite_differences(params.shared.w2.data, objective)) <=
            kTolerance);
      if (gated) {
        CHECK(test::relative_error(result.shared_grads.dgate_weight.data,
                                   test::finite_differences(params.shared.gate_weight.data,
                                                            objective)) <= kTolerance);
      }
      for (int e = 0; e < config.num_experts; ++e) {
        INFO("expert " << e);
        CHECK(test::relative_error(
                  result.expert_grads.dw13[e].data,
                  test::finite_differences(params.experts.w13[e].data, objective)) <= kTolerance);
      }
    }
  }
}

TEST_CASE("shared experts on a mesh equal the single run on the concatenated batch",
          "[cpu][reference][shared][mesh]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> tokens(1, 7);
  for (const auto& [ep, dp] : {std::pair{2, 2}, std::pair{4, 1}, std::pair{1, 2}}) {
    for (const bool gated : {false, true}) {
      INFO("EP " << ep << " DP " << dp << (gated ? ", gated" : ""));
      MoEConfig single = shared_config(gated);
      single.num_experts = 8;
      single.aux_loss_coeff = 0.1;
      single.z_loss_coeff = 0.01;
      single.align_size = 4;
      single.validate();
      const Params params = test::random_params(single, rng);
      MoEConfig config = single;
      config.ep = ep;
      config.dp = dp;
      config.validate();
      std::vector<Matrix> xs, dys;
      for (int r = 0; r < ep * dp; ++r) {
        const int t = r == 1 ? 0 : tokens(rng);  // rank 1 holds no tokens
        xs.push_back(test::random_matrix(t, 6, rng));
        dys.push_back(test::random_matrix(t, 6, rng));
      }
      const LayerResult want = run_layer(single, params, concat_rows(xs), concat_rows(dys));
      const auto ranks = run_mesh(config, params, xs, dys);
      constexpr double kTolerance = 1e-11;  // fp64; only the order of the sums differs
      std::int64_t first = 0;
      for (int r = 0; r < ep * dp; ++r) {
        INFO("rank " << r);
        const std::int64_t last = first + xs[r].rows;
        CHECK(test::relative_error(ranks[r].out, slice_rows(want.out, first, last)) <= kTolerance);
        CHECK(test::relative_error(ranks[r].dx, slice_rows(want.dx, first, last)) <= kTolerance);
        CHECK(ranks[r].aux_loss == Approx(want.aux_loss).epsilon(1e-12));
        CHECK(test::relative_error(ranks[r].d_gate_weight, want.d_gate_weight) <= kTolerance);
        CHECK(test::relative_error(ranks[r].shared_grads.dw13, want.shared_grads.dw13) <=
              kTolerance);
        CHECK(test::relative_error(ranks[r].shared_grads.dw2, want.shared_grads.dw2) <= kTolerance);
        if (gated) {
          CHECK(test::relative_error(ranks[r].shared_grads.dgate_weight,
                                     want.shared_grads.dgate_weight) <= kTolerance);
        }
        first = last;
      }
    }
  }
}
