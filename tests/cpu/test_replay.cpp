// Routing replay in the fp64 reference (docs/design.md, "Routing replay"): a recorded topk_idx fed
// back reproduces its step bit for bit in every router mode; another given routing gets
// route_given's probabilities and gradients that finite differences confirm; bad indices are
// refused, naming the token, the slot and the value.
#include <algorithm>
#include <numeric>
#include <random>

#include "reference/reference.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;
using namespace moe::reference;

namespace {

struct ModeCase {
  std::string name;
  MoEConfig config;
};

std::vector<ModeCase> mode_cases() {
  MoEConfig base = test::small_config(6, 4, 8, 2);
  base.aux_loss_coeff = 0.1;
  base.z_loss_coeff = 0.01;
  base.align_size = 4;
  std::vector<ModeCase> cases;
  auto add = [&](std::string name, auto edit) {
    MoEConfig config = base;
    edit(config);
    config.validate();
    cases.push_back({std::move(name), config});
  };
  add("softmax post", [](MoEConfig&) {});
  add("softmax pre", [](MoEConfig& c) { c.pre_softmax = true; });
  add("sigmoid + bias, scaled", [](MoEConfig& c) {
    c.score_function = ScoreFunction::kSigmoid;
    c.expert_bias = true;
    c.scaling_factor = 2.5;
  });
  add("sqrtsoftplus", [](MoEConfig& c) { c.score_function = ScoreFunction::kSqrtSoftplus; });
  add("sqrtsoftplus K=1", [](MoEConfig& c) {
    c.score_function = ScoreFunction::kSqrtSoftplus;
    c.topk = 1;
  });
  add("grouped sigmoid + bias (4 groups, top 2, K=4)", [](MoEConfig& c) {
    c.score_function = ScoreFunction::kSigmoid;
    c.expert_bias = true;
    c.num_groups = 4;
    c.group_topk = 2;
    c.topk = 4;
  });
  add("grouped softmax pre (2 groups, top 1)", [](MoEConfig& c) {
    c.pre_softmax = true;
    c.num_groups = 2;
    c.group_topk = 1;
  });
  add("softmax post with capacity and gated shared experts", [](MoEConfig& c) {
    c.capacity_factor = 0.5;
    c.shared_ffn_hidden = 3;
    c.shared_gate = true;
  });
  return cases;
}

void check_bitwise_equal(const LayerResult& got, const LayerResult& want) {
  CHECK(got.routing.expert == want.routing.expert);
  CHECK(got.routing.prob == want.routing.prob);
  CHECK(got.kept == want.kept);
  CHECK(got.tokens_per_expert == want.tokens_per_expert);
  CHECK(got.dropped_per_expert == want.dropped_per_expert);
  CHECK(got.out.data == want.out.data);
  CHECK(got.aux_loss == want.aux_loss);
  CHECK(got.z_loss == want.z_loss);
  CHECK(got.dlogits.data == want.dlogits.data);
  CHECK(got.dx.data == want.dx.data);
  CHECK(got.d_gate_weight.data == want.d_gate_weight.data);
  REQUIRE(got.expert_grads.dw13.size() == want.expert_grads.dw13.size());
  for (std::size_t e = 0; e < got.expert_grads.dw13.size(); ++e) {
    CHECK(got.expert_grads.dw13[e].data == want.expert_grads.dw13[e].data);
    CHECK(got.expert_grads.dw2[e].data == want.expert_grads.dw2[e].data);
  }
  CHECK(got.shared_grads.dw13.data == want.shared_grads.dw13.data);
  CHECK(got.shared_grads.dw2.data == want.shared_grads.dw2.data);
  CHECK(got.shared_grads.dgate_weight.data == want.shared_grads.dgate_weight.data);
}

// K distinct experts per token, drawn at random: a routing the router would not choose.
std::vector<int> random_given(std::int64_t tokens, int experts, int topk, std::mt19937_64& rng) {
  std::vector<int> all(experts);
  std::iota(all.begin(), all.end(), 0);
  std::vector<int> given;
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    given.insert(given.end(), all.begin(), all.begin() + topk);
  }
  return given;
}

// Whether the probabilities that compete for each expert's capacity are at least 1e-3 apart, so
// that no finite-difference step can change which slots are kept.
bool given_probabilities_apart(const MoEConfig& config, const Matrix& logits,
                               const std::vector<int>& given) {
  if (!config.capacity_mode()) return true;
  const Routing routing = route_given(config, logits, given);
  for (int e = 0; e < config.num_experts; ++e) {
    std::vector<double> probs;
    for (std::size_t i = 0; i < given.size(); ++i) {
      if (given[i] == e) probs.push_back(routing.prob[i]);
    }
    if (probs.size() > 1 && test::min_adjacent_gap(probs) < 1e-3) return false;
  }
  return true;
}

std::string replay_error(const MoEConfig& config, const Params& params, const Matrix& x,
                         const std::vector<int>& given) {
  LayerOptions options;
  options.replay_experts = given;
  try {
    run_layer(config, params, x, x, options);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("replaying the recorded topk_idx reproduces the step bit for bit, every router mode",
          "[cpu][reference][replay]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const auto& [name, config] : mode_cases()) {
    INFO(name);
    const Params params = test::random_params(config, rng);
    const Matrix x = test::random_matrix(9, config.hidden, rng);
    const Matrix dy = test::random_matrix(9, config.hidden, rng);
    for (const auto dprob_from : {ProbabilityGradient::kCombine, ProbabilityGradient::kExperts}) {
      LayerOptions record;
      record.dprob_from = dprob_from;
      const LayerResult recorded = run_layer(config, params, x, dy, record);
      LayerOptions replay = record;
      replay.replay_experts = recorded.routing.expert;
      check_bitwise_equal(run_layer(config, params, x, dy, replay), recorded);
      CHECK(layer_objective(config, params, x, dy, replay) ==
            layer_objective(config, params, x, dy, record));
    }
  }
}

TEST_CASE("replaying another routing takes route_given's probabilities from the current logits",
          "[cpu][reference][replay]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const auto& [name, config] : mode_cases()) {
    INFO(name);
    const Params params = test::random_params(config, rng);
    const Matrix x = test::random_matrix(7, config.hidden, rng);
    const Matrix dy = test::random_matrix(7, config.hidden, rng);
    const auto given = random_given(7, config.num_experts, config.topk, rng);
    LayerOptions options;
    options.replay_experts = given;
    const LayerResult r = run_layer(config, params, x, dy, options);
    const Routing want = route_given(config, matmul_nt(x, params.gate_weight), given);
    CHECK(r.routing.expert == given);
    CHECK(r.routing.prob == want.prob);
    // The losses do not depend on the main routing.
    const LayerResult selected = run_layer(config, params, x, dy);
    CHECK(r.aux_loss == selected.aux_loss);
    CHECK(r.z_loss == selected.z_loss);
  }
  // By hand: softmax post over the two given logits, whatever the router would choose.
  MoEConfig config = test::small_config(2, 2, 4, 2);
  Matrix logits(1, 4);
  logits.data = {4.0, 1.0, 3.0, 0.0};
  const Routing given = route_given(config, logits, std::vector<int>{3, 1});
  CHECK(given.prob[0] == Approx(1.0 / (1.0 + std::exp(1.0))));
  CHECK(given.prob[1] == Approx(1.0 / (1.0 + std::exp(-1.0))));
}

TEST_CASE("replay: layer backward equals finite differences through the given experts' p",
          "[cpu][reference][replay]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const auto& [name, config] : mode_cases()) {
    INFO(name);
    const auto given = random_given(5, config.num_experts, config.topk, rng);
    Params params;
    Matrix x;
    do {  // the aux routing and capacity still select: keep them out of the steps' reach
      params = test::random_params(config, rng);
      x = test::random_matrix(5, config.hidden, rng);
    } while (
        !test::well_separated(config, matmul_nt(x, params.gate_weight), params.expert_bias, 1e-3) ||
        !given_probabilities_apart(config, matmul_nt(x, params.gate_weight), given));
    const Matrix dy = test::random_matrix(5, config.hidden, rng);
    LayerOptions options;
    options.replay_experts = given;
    const LayerResult result = run_layer(config, params, x, dy, options);
    auto objective = [&] {
      if (config.capacity_mode()) {
        const Routing routing = route_given(config, matmul_nt(x, params.gate_weight), given);
        REQUIRE(keep_within_capacity(config, routing) == result.kept);
      }
      return layer_objective(config, params, x, dy, options);
    };
    constexpr double kTolerance = 1e-6;
    CHECK(test::relative_error(result.dx.data, test::finite_differences(x.data, objective)) <=
          kTolerance);
    CHECK(test::relative_error(result.d_gate_weight.data,
                               test::finite_differences(params.gate_weight.data, objective)) <=
          kTolerance);
  }
}

TEST_CASE("replay on a mesh equals the single run on the concatenated batch",
          "[cpu][reference][replay][mesh]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const auto& [ep, dp] : {std::pair{2, 2}, std::pair{2, 1}}) {
    INFO("EP " << ep << " DP " << dp);
    MoEConfig single = mode_cases()[2].config;  // sigmoid + bias: replay ignores the bias
    single.shared_ffn_hidden = 3;
    const Params params = test::random_params(single, rng);
    MoEConfig config = single;
    config.ep = ep;
    config.dp = dp;
    config.validate();
    std::vector<Matrix> xs, dys;
    std::vector<std::vector<int>> given;
    for (int r = 0; r < ep * dp; ++r) {
      const int t = r == 1 ? 0 : 3 + r;
      xs.push_back(test::random_matrix(t, 6, rng));
      dys.push_back(test::random_matrix(t, 6, rng));
      given.push_back(random_given(t, 8, config.topk, rng));
    }
    std::vector<int> all_given;
    for (const auto& g : given) all_given.insert(all_given.end(), g.begin(), g.end());
    LayerOptions options;
    options.replay_experts = all_given;
    const LayerResult want = run_layer(single, params, concat_rows(xs), concat_rows(dys), options);
    const auto ranks = run_mesh(config, params, xs, dys, given);
    std::int64_t first = 0;
    for (int r = 0; r < ep * dp; ++r) {
      INFO("rank " << r);
      const std::int64_t last = first + xs[r].rows;
      CHECK(ranks[r].routing.expert == given[r]);
      CHECK(test::relative_error(ranks[r].out, slice_rows(want.out, first, last)) <= 1e-11);
      CHECK(test::relative_error(ranks[r].dx, slice_rows(want.dx, first, last)) <= 1e-11);
      CHECK(test::relative_error(ranks[r].d_gate_weight, want.d_gate_weight) <= 1e-11);
      CHECK(test::relative_error(ranks[r].shared_grads.dw13, want.shared_grads.dw13) <= 1e-11);
      const int E_loc = config.local_experts();
      for (int le = 0; le < E_loc; ++le) {
        const int e = (r % ep) * E_loc + le;
        CHECK(test::relative_error(ranks[r].expert_grads.dw13[le], want.expert_grads.dw13[e]) <=
              1e-11);
      }
      first = last;
    }
    given.pop_back();
    CHECK_THROWS_WITH(run_mesh(config, params, xs, dys, given),
                      test::contains_text("replayed routings for a mesh of"));
  }
}

TEST_CASE("replay refuses indices out of range, repeated in a token, or of the wrong count",
          "[cpu][reference][replay]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const MoEConfig config = test::small_config(6, 4, 8, 2);
  const Params params = test::random_params(config, rng);
  const Matrix x = test::random_matrix(3, 6, rng);
  std::vector<int> given = random_given(3, 8, 2, rng);
  CHECK(replay_error(config, params, x, given) == "(no error)");

  auto bad = given;
  bad[3] = 8;  // token 1, slot 1
  CHECK_THAT(replay_error(config, params, x, bad),
             test::contains_text("token 1, slot 1: expert 8 is outside [0, 8)"));
  bad = given;
  bad[4] = -3;
  CHECK_THAT(replay_error(config, params, x, bad),
             test::contains_text("token 2, slot 0: expert -3 is outside [0, 8)"));
  bad = given;
  bad[5] = bad[4];
  CHECK_THAT(replay_error(config, params, x, bad),
             test::contains_text("token 2, slot 1: expert " + std::to_string(bad[4]) +
                                 " is already in slot 0"));
  bad = given;
  bad.pop_back();
  CHECK_THAT(replay_error(config, params, x, bad),
             test::contains_text("5 experts for 3 tokens of top-2; expected [3, 2]"));
  CHECK_THAT(replay_error(config, params, x, {}),
             test::contains_text("0 experts for 3 tokens of top-2"));
}
