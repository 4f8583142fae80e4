// The simulated EP×DP mesh against one run on the concatenated batch: every rank must hold the
// single run's values for its tokens, the same losses, and the reduced gradients.
#include <random>

#include "reference/reference.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;
using namespace moe::reference;

namespace {

constexpr double kTolerance = 1e-11;  // fp64, only the summation order differs

void check_mesh_equals_single(const MoEConfig& config, const Params& params,
                              const std::vector<Matrix>& x, const std::vector<Matrix>& dy) {
  MoEConfig single_config = config;
  single_config.ep = 1;
  single_config.dp = 1;
  const LayerResult single = run_layer(single_config, params, concat_rows(x), concat_rows(dy));
  const auto ranks = run_mesh(config, params, x, dy);
  REQUIRE(ranks.size() == x.size());

  const int E_loc = config.local_experts();
  std::int64_t first_token = 0;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    INFO("rank " << r << " of EP " << config.ep << " x DP " << config.dp << ", " << x[r].rows
                 << " tokens");
    const auto& got = ranks[r];
    const auto last_token = first_token + x[r].rows;
    CHECK(test::relative_error(got.out, slice_rows(single.out, first_token, last_token)) <=
          kTolerance);
    CHECK(test::relative_error(got.dx, slice_rows(single.dx, first_token, last_token)) <=
          kTolerance);
    CHECK(got.aux_loss == Approx(single.aux_loss).epsilon(1e-12));
    CHECK(got.z_loss == Approx(single.z_loss).epsilon(1e-12));
    CHECK(test::relative_error(got.d_gate_weight, single.d_gate_weight) <= kTolerance);
    const int ep_index = static_cast<int>(r) % config.ep;
    REQUIRE(std::ssize(got.expert_grads.dw13) == E_loc);
    for (int le = 0; le < E_loc; ++le) {
      INFO("local expert " << le);
      const int e = ep_index * E_loc + le;
      CHECK(test::relative_error(got.expert_grads.dw13[le], single.expert_grads.dw13[e]) <=
            kTolerance);
      CHECK(test::relative_error(got.expert_grads.dw2[le], single.expert_grads.dw2[e]) <=
            kTolerance);
    }
    first_token = last_token;
  }
}

}  // namespace

TEST_CASE("mesh reference equals the single run on the concatenated batch",
          "[cpu][reference][mesh]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> tokens(1, 7);
  for (const auto& [ep, dp] :
       {std::pair{2, 2}, std::pair{4, 1}, std::pair{1, 2}, std::pair{2, 1}, std::pair{1, 1}}) {
    for (const bool sigmoid_grouped : {false, true}) {
      MoEConfig config = test::small_config(6, 4, 8, 2);
      config.ep = ep;
      config.dp = dp;
      config.align_size = 4;
      config.aux_loss_coeff = 0.1;
      config.z_loss_coeff = 0.01;
      if (sigmoid_grouped) {
        config.score_function = ScoreFunction::kSigmoid;
        config.expert_bias = true;
        config.num_groups = 4;
        config.group_topk = 2;
        config.scaling_factor = 2.5;
      }
      config.validate();
      const Params params = test::random_params(config, rng);
      std::vector<Matrix> x, dy;
      for (int r = 0; r < ep * dp; ++r) {
        const int t = (r == 1) ? 0 : tokens(rng);  // rank 1, where there is one, has no tokens
        x.push_back(test::random_matrix(t, config.hidden, rng));
        dy.push_back(test::random_matrix(t, config.hidden, rng));
      }
      check_mesh_equals_single(config, params, x, dy);
    }
  }
}

// FP8 experts on the mesh, with the NCCL exchange's roles (the combine weighs the rows): each
// expert's rows are quantized row by row and its weights tile by tile wherever they run, so every
// rank holds the one FP8 run's values, with and without the rows crossing as E4M3 records. Widths
// of one 128-value block and of a block and a short one.
TEST_CASE("mesh reference with FP8 experts equals the single FP8 run on the concatenated batch",
          "[cpu][reference][mesh][fp8]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> tokens(1, 9);
  for (const auto& [ep, dp] :
       {std::pair{2, 2}, std::pair{4, 1}, std::pair{1, 2}, std::pair{2, 1}}) {
    for (const std::int64_t hidden : {128, 144}) {
      for (const bool dispatch : {false, true}) {
        MoEConfig config = test::small_config(hidden, 48, 8, 2);
        config.dtype = DType::kBF16;
        config.align_size = 16;
        config.aux_loss_coeff = 0.01;
        config.fp8 = true;
        config.fp8_dispatch = dispatch;
        config.ep = ep;
        config.dp = dp;
        config.validate();
        INFO("H " << hidden << (dispatch ? ", fp8_dispatch" : ""));
        const Params params = test::round_params(test::random_params(config, rng), DType::kBF16);
        std::vector<Matrix> x, dy;
        for (int r = 0; r < ep * dp; ++r) {
          const int t = tokens(rng);
          x.push_back(round_to(test::random_matrix(t, hidden, rng), DType::kBF16));
          dy.push_back(round_to(test::random_matrix(t, hidden, rng), DType::kBF16));
        }
        check_mesh_equals_single(config, params, x, dy);
        // And it is FP8's: the exact mesh differs by FP8's rounding (over every rank's rows: a
        // few tokens alone may sit further out, 0.15 seen at one token).
        MoEConfig exact = config;
        exact.fp8 = exact.fp8_dispatch = false;
        std::vector<Matrix> fp8_out, exact_out;
        for (const LayerResult& r : run_mesh(config, params, x, dy)) fp8_out.push_back(r.out);
        for (const LayerResult& r : run_mesh(exact, params, x, dy)) exact_out.push_back(r.out);
        const double error = test::relative_error(concat_rows(fp8_out), concat_rows(exact_out));
        CHECK(error > 1e-3);
        CHECK(error < 0.15);
      }
    }
  }
}

TEST_CASE("mesh reference with hard routing: every token to the experts of EP rank 0",
          "[cpu][reference][mesh]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig config = test::small_config(6, 4, 8, 2);
  config.score_function = ScoreFunction::kSigmoid;
  config.expert_bias = true;
  config.ep = 2;
  config.dp = 2;
  config.align_size = 8;
  config.aux_loss_coeff = 0.1;
  config.validate();
  Params params = test::random_params(config, rng);
  params.expert_bias = {50, 50, 0, 0, 0, 0, 0, 0};  // experts 0 and 1 take everything
  std::vector<Matrix> x, dy;
  for (const int t : {3, 1, 0, 5}) {
    x.push_back(test::random_matrix(t, config.hidden, rng));
    dy.push_back(test::random_matrix(t, config.hidden, rng));
  }
  check_mesh_equals_single(config, params, x, dy);
  const auto ranks = run_mesh(config, params, x, dy);
  for (const auto& rank : ranks) {
    for (int e = 2; e < 8; ++e) CHECK(rank.tokens_per_expert[e] == 0.0);
  }
  // EP rank 1's experts got no rows: their gradients are exactly zero, not garbage.
  for (const auto& m : ranks[1].expert_grads.dw13) {
    for (const double v : m.data) REQUIRE(v == 0.0);
  }
}

TEST_CASE("T = 1 and K = E", "[cpu][reference][mesh]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig config = test::small_config(5, 3, 4, 4);
  config.ep = 2;
  config.pre_softmax = true;
  config.align_size = 16;
  config.validate();
  const Params params = test::random_params(config, rng);
  std::vector<Matrix> x = {test::random_matrix(1, 5, rng), test::random_matrix(1, 5, rng)};
  std::vector<Matrix> dy = {test::random_matrix(1, 5, rng), test::random_matrix(1, 5, rng)};
  check_mesh_equals_single(config, params, x, dy);
}
