// The reference backward against central finite differences of the reference forward (fp64).
#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>

#include "reference/reference.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;
using namespace moe::reference;

namespace {

constexpr double kStep = 1e-5;
constexpr double kTolerance = 1e-6;  // central differences: O(step²) truncation, ~1e-11 rounding

// Central differences of f over every entry of `values`.
std::vector<double> finite_differences(std::vector<double>& values,
                                       const std::function<double()>& f) {
  std::vector<double> grad(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double saved = values[i];
    values[i] = saved + kStep;
    const double up = f();
    values[i] = saved - kStep;
    const double down = f();
    values[i] = saved;
    grad[i] = (up - down) / (2 * kStep);
  }
  return grad;
}

struct RouterCase {
  std::string name;
  MoEConfig config;
};

std::vector<RouterCase> router_cases() {
  const MoEConfig base = test::small_config(6, 5, 8, 2);
  std::vector<RouterCase> cases;
  auto add = [&](std::string name, auto edit) {
    MoEConfig config = base;
    edit(config);
    config.validate();
    cases.push_back({std::move(name), config});
  };
  add("softmax post", [](MoEConfig&) {});
  add("softmax pre", [](MoEConfig& c) { c.pre_softmax = true; });
  add("softmax post K=1", [](MoEConfig& c) { c.topk = 1; });
  add("softmax pre K=1 scaled", [](MoEConfig& c) {
    c.topk = 1;
    c.pre_softmax = true;
    c.scaling_factor = 2.5;
  });
  add("sigmoid", [](MoEConfig& c) { c.score_function = ScoreFunction::kSigmoid; });
  add("sigmoid + bias", [](MoEConfig& c) {
    c.score_function = ScoreFunction::kSigmoid;
    c.expert_bias = true;
  });
  add("sigmoid K=1", [](MoEConfig& c) {
    c.score_function = ScoreFunction::kSigmoid;
    c.topk = 1;
  });
  add("sqrtsoftplus + bias, scaled", [](MoEConfig& c) {
    c.score_function = ScoreFunction::kSqrtSoftplus;
    c.expert_bias = true;
    c.scaling_factor = 2.5;
  });
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
    c.scaling_factor = 2.5;
  });
  add("grouped softmax post (2 groups, top 1)", [](MoEConfig& c) {
    c.num_groups = 2;
    c.group_topk = 1;
  });
  add("grouped softmax pre, K=E", [](MoEConfig& c) {
    c.pre_softmax = true;
    c.num_groups = 2;
    c.group_topk = 2;
    c.topk = 8;
  });
  return cases;
}

}  // namespace

TEST_CASE("router backward equals finite differences of Σ p·dp", "[cpu][reference][router]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const auto& [name, config] : router_cases()) {
    INFO(name);
    Params params = test::random_params(config, rng);
    Matrix logits;
    do {  // no score within a few steps of another: the selection cannot flip under differences
      logits = test::random_matrix(9, config.num_experts, rng);
    } while (!test::well_separated(config, logits, params.expert_bias, 1e-3));
    const Routing routing = route(config, logits, params.expert_bias);
    const Matrix dprob_matrix = test::random_matrix(9, config.topk, rng);
    const auto& dprob = dprob_matrix.data;

    // Selection is piecewise constant: finite differences see only the probabilities move.
    auto objective = [&] {
      const Routing r = route(config, logits, params.expert_bias);
      REQUIRE(r.expert == routing.expert);
      double sum = 0.0;
      for (std::size_t i = 0; i < r.prob.size(); ++i) sum += r.prob[i] * dprob[i];
      return sum;
    };
    const auto numeric = finite_differences(logits.data, objective);
    const Matrix analytic = route_backward(config, logits, routing, dprob);
    CHECK(test::relative_error(analytic.data, numeric) <= kTolerance);
  }
}

TEST_CASE("routing follows the design on hand-worked rows", "[cpu][reference][router]") {
  MoEConfig config = test::small_config(4, 4, 4, 2);
  Matrix logits(1, 4);
  logits.data = {1.0, 3.0, 2.0, 3.0};  // a tie: the lower index (1) wins
  Routing r = route(config, logits, {});
  CHECK(r.expert == std::vector<int>{1, 3});
  CHECK(r.prob[0] == Approx(0.5));

  config.score_function = ScoreFunction::kSigmoid;
  config.expert_bias = true;
  const std::vector<double> bias = {10.0, 0.0, 0.0, 0.0};  // picks expert 0, adds nothing to p
  r = route(config, logits, bias);
  CHECK(r.expert == std::vector<int>{0, 1});
  const double s0 = 1 / (1 + std::exp(-1.0));
  const double s1 = 1 / (1 + std::exp(-3.0));
  CHECK(r.prob[0] == Approx(s0 / (s0 + s1)));

  // Groups {0,1} and {2,3}, one kept; a group scores the sum of its top K/GK = 2 logits.
  config = test::small_config(4, 4, 4, 2);
  config.num_groups = 2;
  config.group_topk = 1;
  config.validate();
  logits.data = {3.0, 2.0, 4.0, 0.0};  // group 0 (5) beats group 1 (4): expert 2 is masked
  CHECK(route(config, logits, {}).expert == std::vector<int>{0, 1});
  logits.data = {3.0, 2.0, 4.0, 1.0};  // 5 against 5: the lower group wins the tie
  CHECK(route(config, logits, {}).expert == std::vector<int>{0, 1});
  logits.data = {3.0, 2.0, 4.0, 1.5};  // group 1 (5.5) wins
  CHECK(route(config, logits, {}).expert == std::vector<int>{2, 3});
}

TEST_CASE("node-limited routing keeps each token's experts on at most max_nodes_per_token nodes",
          "[cpu][reference][router]") {
  std::mt19937_64 rng(test::fresh_seed());
  // 16 experts over 8 EP ranks (2 each), 2 ranks to a node: 4 nodes of 4 experts.
  MoEConfig config = test::small_config(8, 8, 16, 4);
  config.score_function = ScoreFunction::kSigmoid;
  config.ep = 8;
  config.ep_ranks_per_node = 2;
  config.max_nodes_per_token = 2;
  config.validate();
  MoEConfig grouped = config;
  grouped.ep_ranks_per_node = grouped.max_nodes_per_token = 0;
  grouped.num_groups = 4;
  grouped.group_topk = 2;
  MoEConfig unlimited = config;
  unlimited.max_nodes_per_token = 4;  // every node: the plain top-K
  MoEConfig plain = config;
  plain.ep_ranks_per_node = plain.max_nodes_per_token = 0;
  const int experts_per_node = config.num_experts / config.ep * config.ep_ranks_per_node;
  int limited_tokens = 0;
  for (int t = 0; t < 200; ++t) {
    const Matrix logits = test::random_matrix(1, config.num_experts, rng);
    const auto experts = route(config, logits, {}).expert;
    std::vector<int> nodes;
    for (const int e : experts) nodes.push_back(e / experts_per_node);
    std::sort(nodes.begin(), nodes.end());
    nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
    INFO("token " << t);
    CHECK(nodes.size() <= 2);
    CHECK(experts == route(grouped, logits, {}).expert);
    CHECK(route(unlimited, logits, {}).expert == route(plain, logits, {}).expert);
    if (route(plain, logits, {}).expert != experts) ++limited_tokens;
  }
  CHECK(limited_tokens > 0);  // the limit changed some routings: it was tested, not idle

  // By hand: nodes {0..3} {4..7} {8..11} {12..15}, one kept, scored by their top 4 / 1 = 4.
  config.max_nodes_per_token = 1;
  config.validate();
  Matrix row(1, 16);
  // Node 1 (4 σ(1) ≈ 2.9) beats nodes 2 and 3 (4 σ(0) = 2) and node 0 (σ(9) + 3 σ(-9) ≈ 1.0).
  row.data = {9, -9, -9, -9, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0};
  CHECK(route(config, row, {}).expert == std::vector<int>{4, 5, 6, 7});
}

TEST_CASE("layer backward equals finite differences, every router mode", "[cpu][reference]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  auto cases = router_cases();
  // Losses, scaling and padding on top of two modes.
  for (auto base_index : {0, 5}) {
    RouterCase with_losses = cases[base_index];
    with_losses.name += " + aux + z + align 4";
    with_losses.config.aux_loss_coeff = 0.3;
    with_losses.config.z_loss_coeff = 0.05;
    with_losses.config.align_size = 4;
    cases.push_back(with_losses);
  }
  for (auto& [name, config] : cases) {
    INFO(name);
    Params params;
    Matrix x;
    do {  // redraw until no routing is within reach of the finite-difference steps
      params = test::random_params(config, rng);
      x = test::random_matrix(5, config.hidden, rng);
    } while (
        !test::well_separated(config, matmul_nt(x, params.gate_weight), params.expert_bias, 1e-3));
    const Matrix dy = test::random_matrix(5, config.hidden, rng);
    const LayerResult result = run_layer(config, params, x, dy);
    auto objective = [&] { return layer_objective(config, params, x, dy); };
    // dprob formed in the experts (<dy·w2ᵀ, a>) is dy·y in exact arithmetic.
    const LayerResult in_experts =
        run_layer(config, params, x, dy, Intermediates::kExact, ProbabilityGradient::kExperts);
    CHECK(test::relative_error(in_experts.dlogits.data, result.dlogits.data) <= 1e-12);
    // Inputs that do not fit each other are refused, naming what is off.
    const Routing routing = route(config, matmul_nt(x, params.gate_weight), params.expert_bias);
    const Layout layout = make_layout(routing, config.num_experts, config.align_size);
    const ExpertActivations act =
        experts_forward(permute(x, layout, routing), layout.offsets, params.experts);
    CHECK_THROWS_WITH(experts_prob_grads(Matrix(4, config.hidden), act, layout, routing,
                                         params.experts, Intermediates::kExact, DType::kFP32),
                      test::contains_text("dy has 4 rows for 5 routed tokens"));

    CHECK(test::relative_error(result.dx.data, finite_differences(x.data, objective)) <=
          kTolerance);
    CHECK(test::relative_error(result.d_gate_weight.data,
                               finite_differences(params.gate_weight.data, objective)) <=
          kTolerance);
    for (int e = 0; e < config.num_experts; ++e) {
      INFO("expert " << e);
      CHECK(test::relative_error(result.expert_grads.dw13[e].data,
                                 finite_differences(params.experts.w13[e].data, objective)) <=
            kTolerance);
      CHECK(test::relative_error(result.expert_grads.dw2[e].data,
                                 finite_differences(params.experts.w2[e].data, objective)) <=
            kTolerance);
    }
  }
}

TEST_CASE("aux and z losses alone: values and gradients", "[cpu][reference][losses]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const auto score :
       {ScoreFunction::kSoftmax, ScoreFunction::kSigmoid, ScoreFunction::kSqrtSoftplus}) {
    MoEConfig config = test::small_config(6, 3, 16, 4);
    config.score_function = score;
    config.aux_loss_coeff = 0.7;
    config.z_loss_coeff = 0.2;
    INFO(score_function_name(score));
    const Params params = test::random_params(config, rng);
    Matrix logits;
    do {
      logits = test::random_matrix(11, config.num_experts, rng, 2.0);
    } while (!test::well_separated(config, logits, params.expert_bias, 1e-3));

    // The loss values against a direct transcription of docs/design.md.
    const AuxStats stats = aux_stats(config, logits);
    const double T = 11;
    double expected_aux = 0.0;
    for (int i = 0; i < 16; ++i) expected_aux += stats.score_sum[i] * stats.tokens_per_expert[i];
    expected_aux *= 0.7 * 16 / (4 * T * T);
    CHECK(aux_loss(config, stats) == Approx(expected_aux).epsilon(1e-12));
    double f_total = 0.0;
    for (const double f : stats.tokens_per_expert) f_total += f;
    CHECK(f_total == 11 * 4);

    auto objective = [&] {
      const AuxStats s = aux_stats(config, logits);
      REQUIRE(s.tokens_per_expert == stats.tokens_per_expert);
      return aux_loss(config, s) + z_loss(config, z_loss_sum(logits), 11);
    };
    Matrix dlogits(11, config.num_experts);
    aux_loss_backward(config, logits, stats, dlogits);
    z_loss_backward(config, logits, 11, dlogits);
    CHECK(test::relative_error(dlogits.data, finite_differences(logits.data, objective)) <=
          kTolerance);
  }
}

TEST_CASE("router backward at logits of ±1e4 is finite, and sqrtsoftplus keeps its limit",
          "[cpu][reference][router]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> coin(0, 1);
  for (auto rc : router_cases()) {
    INFO(rc.name);
    rc.config.aux_loss_coeff = 0.01;
    rc.config.z_loss_coeff = 0.001;
    const MoEConfig& config = rc.config;
    const int E = config.num_experts;
    Matrix logits(5, E);
    for (double& l : logits.data) l = coin(rng) ? 1e4 : -1e4;
    for (int e = 0; e < E; ++e) logits(0, e) = -1e4;  // a row with every score underflowing
    const std::vector<double> bias(E, 0.0);
    const Routing routing = route(config, logits, bias);
    std::vector<double> dprob(routing.prob.size(), 1.0);
    Matrix dlogits = route_backward(config, logits, routing, dprob);
    const AuxStats stats = aux_stats(config, logits);
    aux_loss_backward(config, logits, stats, dlogits);
    z_loss_backward(config, logits, logits.rows, dlogits);
    for (const double p : routing.prob) CHECK(std::isfinite(p));
    for (const double d : dlogits.data) CHECK(std::isfinite(d));
  }
  // Far below zero, g'(l) = σ(l) / (2·√softplus(l)) tends to e^(l/2) / 2: the backward of a lone
  // slot (K = 1: p = g(l), dlogit = g'(l)) keeps that value where the quotient's parts underflow.
  MoEConfig config = test::small_config(6, 5, 2, 1);
  config.score_function = ScoreFunction::kSqrtSoftplus;
  for (const double l : {-30.0, -100.0, -700.0, -800.0, -1e4}) {
    INFO("logit " << l);
    Matrix logits(1, 2);
    logits(0, 0) = l;
    logits(0, 1) = 2 * l;  // lower: expert 0 is chosen
    const Routing routing = route(config, logits, {});
    REQUIRE(routing.expert_of(0, 0) == 0);
    const Matrix dlogits = route_backward(config, logits, routing, std::vector<double>{1.0});
    const double limit = std::exp(l / 2) / 2;
    CHECK(dlogits(0, 0) == Approx(limit).epsilon(1e-12).margin(1e-300));
    CHECK(dlogits(0, 1) == 0.0);
  }
}

// The fp32 checks of the gates' gradients fall back to a rounding bound where a few tokens'
// gradient cancels: |error| ≤ length · 2^-24 · magnitude. The magnitude claims to bound what a
// relative error of one unit in every term of every sum does to each element, to first order. A
// relative perturbation ε of every input is such an error: each term of the sums the magnitude
// counts is a product of two inputs (x·Wg, dy·w2, x·w13), so it moves by at most 2ε of itself,
// and the gradient by at most 2ε · magnitude, whatever the cancellation. This checks the model's
// sensitivity to its inputs' sums; the roundings of the router's own intermediates (the scores
// and their normalisation) are outside it, counted by the |dlogits| term and the length.
TEST_CASE("the gates' rounding magnitudes bound relative perturbations of every input",
          "[cpu][reference]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> coin(0, 1);
  constexpr double kEpsilon = 1e-7;  // first order; the double rounding it shows is ~1e-9 of it
  auto perturb = [&](Matrix& m) {
    for (double& v : m.data) v *= 1.0 + (coin(rng) != 0 ? kEpsilon : -kEpsilon);
  };
  LayerOptions options;
  options.rounding_magnitudes = true;
  auto cases = router_cases();
  RouterCase gated = cases[0];
  gated.name += " + gated shared expert + aux + z";
  gated.config.shared_ffn_hidden = 4;
  gated.config.shared_gate = true;
  gated.config.aux_loss_coeff = 0.3;
  gated.config.z_loss_coeff = 0.05;
  cases.push_back(gated);
  for (auto& [name, config] : cases) {
    for (const std::int64_t tokens : {1, 5}) {
      INFO(name << ", T = " << tokens);
      Params params;
      Matrix x;
      do {  // no routing within reach of the perturbation
        params = test::random_params(config, rng);
        x = test::random_matrix(tokens, config.hidden, rng);
      } while (!test::well_separated(config, matmul_nt(x, params.gate_weight), params.expert_bias,
                                     1e-3));
      Matrix dy = test::random_matrix(tokens, config.hidden, rng);
      const LayerResult exact = run_layer(config, params, x, dy, options);
      REQUIRE(exact.d_gate_weight_magnitude.data.size() == exact.d_gate_weight.data.size());
      perturb(x);
      perturb(dy);
      perturb(params.gate_weight);
      for (auto* experts : {&params.experts.w13, &params.experts.w2})
        for (Matrix& w : *experts) perturb(w);
      if (config.shared_experts()) {
        perturb(params.shared.w13);
        perturb(params.shared.w2);
        perturb(params.shared.gate_weight);
      }
      const LayerResult moved = run_layer(config, params, x, dy, options);
      auto outside = [&](const Matrix& a, const Matrix& b, const Matrix& magnitude) {
        int count = 0;
        for (std::size_t i = 0; i < a.data.size(); ++i)
          count += std::fabs(a.data[i] - b.data[i]) > 2 * kEpsilon * magnitude.data[i];
        return count;
      };
      CHECK(outside(moved.d_gate_weight, exact.d_gate_weight, exact.d_gate_weight_magnitude) == 0);
      if (config.shared_gate) {
        CHECK(outside(moved.shared_grads.dgate_weight, exact.shared_grads.dgate_weight,
                      exact.shared_grads.dgate_weight_magnitude) == 0);
      }
    }
  }
  // bf16 runs never fall back to the bound, and the reference forms none; nor unasked.
  MoEConfig bf16 = cases[0].config;
  bf16.dtype = DType::kBF16;
  const Params params = test::random_params(bf16, rng);
  const Matrix x = test::random_matrix(3, bf16.hidden, rng);
  CHECK(run_layer(bf16, params, x, x, options).d_gate_weight_magnitude.data.empty());
  const Params fp32_params = test::random_params(cases[0].config, rng);
  CHECK(run_layer(cases[0].config, fp32_params, x, x).d_gate_weight_magnitude.data.empty());
}

// The products pass over zero rows (alignment padding) without their inner loops: the results are
// bitwise those of the plain sums, at a signed zero row too.
TEST_CASE("reference products give the plain sums where rows are zero", "[cpu][reference]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  Matrix a = test::random_matrix(7, 5, rng);
  const Matrix b = test::random_matrix(4, 5, rng);
  for (std::int64_t k = 0; k < a.cols; ++k) {
    a(1, k) = 0.0;
    a(4, k) = -0.0;
  }
  a(6, 2) = 0.0;  // a zero inside a row that is not
  const Matrix c = matmul_nt(a, b);
  for (std::int64_t i = 0; i < a.rows; ++i) {
    for (std::int64_t j = 0; j < b.rows; ++j) {
      double sum = 0.0;
      for (std::int64_t k = 0; k < a.cols; ++k) sum += a(i, k) * b(j, k);
      INFO("[" << i << ", " << j << "]");
      CHECK(c(i, j) == sum);
      CHECK(std::signbit(c(i, j)) == std::signbit(sum));
    }
  }
}
