// Capacity mode in the fp64 reference (docs/design.md, "Capacity mode"): which slots each policy
// keeps, that dropped slots take no part in the layer, the padded layout, each source rank's own
// decisions on a mesh, and the backward against finite differences with the drops fixed.
#include <algorithm>
#include <array>
#include <numeric>
#include <random>

#include "reference/reference.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;
using namespace moe::reference;

namespace {

Routing hand_routing(std::int64_t tokens, int topk, std::vector<int> experts,
                     std::vector<double> probs) {
  Routing routing;
  routing.tokens = tokens;
  routing.topk = topk;
  routing.expert = std::move(experts);
  routing.prob = std::move(probs);
  return routing;
}

MoEConfig capacity_config(double capacity_factor, DropPolicy policy) {
  MoEConfig config = test::small_config(6, 4, 8, 2);
  config.capacity_factor = capacity_factor;
  config.drop_policy = policy;
  config.validate();
  return config;
}

// Expert e's output for one token, straight from the weights: what a kept slot adds, unweighted.
std::vector<double> expert_output(const Params& params, int e, std::span<const double> token) {
  Matrix x(1, static_cast<std::int64_t>(token.size()));
  std::copy(token.begin(), token.end(), x.data.begin());
  const ExpertWeights one{{params.experts.w13[e]}, {params.experts.w2[e]}};
  const std::array<std::int64_t, 2> offsets = {0, 1};
  return experts_forward(x, offsets, one).y.data;
}

// Every expert keeps min(routed, C) of this rank's slots, and kept + dropped = routed.
void check_counts(const MoEConfig& config, const LayerResult& r, std::int64_t tokens) {
  const std::int64_t C = config.expert_capacity(tokens);
  const auto routed = tokens_per_expert(r.routing, config.num_experts);
  for (int e = 0; e < config.num_experts; ++e) {
    INFO("expert " << e << ", capacity " << C);
    CHECK(r.tokens_per_expert[e] + r.dropped_per_expert[e] == routed[e]);
    CHECK(r.tokens_per_expert[e] == std::min<double>(routed[e], static_cast<double>(C)));
  }
  std::vector<double> kept(config.num_experts, 0.0);
  for (std::size_t i = 0; i < r.kept.size(); ++i) kept[r.routing.expert[i]] += r.kept[i];
  CHECK(kept == r.tokens_per_expert);
}

// Inputs whose routing, aux routing and capacity choice no finite-difference step can change:
// scores well apart, and the probabilities an expert's slots compete with, too.
bool drops_well_separated(const MoEConfig& config, const Params& params, const Matrix& x) {
  const Matrix logits = matmul_nt(x, params.gate_weight);
  if (!test::well_separated(config, logits, params.expert_bias, 1e-3)) return false;
  const Routing routing = route(config, logits, params.expert_bias);
  for (int e = 0; e < config.num_experts; ++e) {
    std::vector<double> probs;
    for (std::size_t i = 0; i < routing.expert.size(); ++i) {
      if (routing.expert[i] == e) probs.push_back(routing.prob[i]);
    }
    if (probs.size() > 1 && test::min_adjacent_gap(probs) < 1e-3) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("capacity: each drop policy on a hand-worked routing, ties to the lower token",
          "[cpu][reference][capacity]") {
  MoEConfig config = test::small_config(4, 4, 4, 2);
  // Token 0 -> experts (0, 1), token 1 -> (1, 0), token 2 -> (0, 2), token 3 -> (3, 0).
  const std::vector<int> experts = {0, 1, 1, 0, 0, 2, 3, 0};
  const Routing routing = hand_routing(4, 2, experts, {0.3, 0.2, 0.6, 0.4, 0.45, 0.55, 0.7, 0.3});

  config.capacity_factor = 0.5;  // C = ceil(0.5 · 4 · 2 / 4) = 1
  REQUIRE(config.expert_capacity(4) == 1);
  config.drop_policy = DropPolicy::kProbs;  // expert 0 keeps token 2 (0.45), expert 1 token 1
  CHECK(keep_within_capacity(config, routing) == std::vector<int>{0, 0, 1, 0, 1, 1, 1, 0});
  config.drop_policy = DropPolicy::kPosition;  // the first token of each expert
  CHECK(keep_within_capacity(config, routing) == std::vector<int>{1, 1, 0, 0, 0, 1, 1, 0});
  const auto kept = keep_within_capacity(config, routing);
  CHECK(dropped_per_expert(routing, kept, 4) == std::vector<double>{3, 1, 0, 0});

  // Equal probabilities: the lower token wins, whatever the slot.
  config.drop_policy = DropPolicy::kProbs;
  const Routing tied = hand_routing(4, 2, experts, std::vector<double>(8, 0.5));
  CHECK(keep_within_capacity(config, tied) == std::vector<int>{1, 1, 0, 0, 0, 1, 1, 0});
  // C = 2: expert 0 keeps token 1 (0.4), then the lowest of the tokens tied at 0.3 (token 0).
  config.capacity_factor = 1.0;
  const Routing boundary_tie =
      hand_routing(4, 2, experts, {0.3, 0.2, 0.6, 0.4, 0.3, 0.55, 0.7, 0.3});
  CHECK(keep_within_capacity(config, boundary_tie) == std::vector<int>{1, 1, 1, 1, 0, 1, 1, 0});

  // Dropless keeps everything.
  config.capacity_factor = 0.0;
  CHECK(keep_within_capacity(config, routing) == std::vector<int>(8, 1));
}

TEST_CASE("capacity: equal rows tie exactly and the first tokens keep their slots",
          "[cpu][reference][capacity]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const auto policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
    INFO(drop_policy_name(policy));
    const MoEConfig config = capacity_config(1.0, policy);  // 8 tokens: C = 2
    const Params params = test::random_params(config, rng);
    const Matrix row = test::random_matrix(1, config.hidden, rng);
    std::vector<Matrix> rows(8, row);
    const Matrix x = concat_rows(rows);
    const LayerResult r = run_layer(config, params, x, test::random_matrix(8, 6, rng));
    std::vector<int> want(16, 0);
    for (int i = 0; i < 4; ++i) want[i] = 1;  // tokens 0 and 1, both slots
    CHECK(r.kept == want);
    check_counts(config, r, 8);
  }
}

TEST_CASE("capacity: every token to one expert", "[cpu][reference][capacity]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const auto policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
    INFO(drop_policy_name(policy));
    MoEConfig config = capacity_config(1.0, policy);
    config.align_size = 4;
    Params params = test::random_params(config, rng);
    Matrix x = test::random_matrix(12, config.hidden, rng);
    for (std::int64_t t = 0; t < x.rows; ++t) x(t, 0) = 1.0 + std::abs(x(t, 0));
    params.gate_weight(3, 0) = 100.0;  // feature 0 is positive everywhere: expert 3 always wins
    const LayerResult r = run_layer(config, params, x, test::random_matrix(12, 6, rng));
    const std::int64_t C = config.expert_capacity(12);  // ceil(12 · 2 / 8) = 3, aligned to 4
    REQUIRE(C == 4);
    for (std::int64_t t = 0; t < 12; ++t) REQUIRE(r.routing.expert_of(t, 0) == 3);
    CHECK(r.tokens_per_expert[3] == 4);
    CHECK(r.dropped_per_expert[3] == 8);
    check_counts(config, r, 12);
    if (policy == DropPolicy::kPosition) {
      for (std::int64_t t = 0; t < 12; ++t) CHECK(r.kept[t * 2] == (t < 4 ? 1 : 0));
    } else {  // the four largest probabilities of expert 3 (p ≈ 1 may tie: lower tokens first)
      std::vector<std::int64_t> order(12);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
        return r.routing.prob_of(a, 0) > r.routing.prob_of(b, 0);
      });
      std::vector<int> want(24, 0);
      for (std::int64_t t = 0; t < 12; ++t) want[t * 2 + 1] = r.kept[t * 2 + 1];
      for (int i = 0; i < 4; ++i) want[order[i] * 2] = 1;
      CHECK(r.kept == want);
    }
  }
}

TEST_CASE("capacity: a capacity nothing exceeds gives the dropless results exactly",
          "[cpu][reference][capacity]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig dropless = test::small_config(6, 4, 8, 2);
  dropless.align_size = 4;
  dropless.aux_loss_coeff = 0.1;
  dropless.z_loss_coeff = 0.01;
  const Params params = test::random_params(dropless, rng);
  const Matrix x = test::random_matrix(9, 6, rng), dy = test::random_matrix(9, 6, rng);
  const LayerResult want = run_layer(dropless, params, x, dy);
  for (const bool pad : {false, true}) {
    for (const auto policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
      INFO(drop_policy_name(policy) << (pad ? ", padded" : ""));
      MoEConfig config = dropless;
      config.capacity_factor = 4.0;  // C = 9 · 2 · 4 / 8 = 9 = T: no expert can exceed it
      config.drop_policy = policy;
      config.pad_to_capacity = pad;
      config.validate();
      const LayerResult got = run_layer(config, params, x, dy);
      CHECK(got.kept == std::vector<int>(18, 1));
      CHECK(got.dropped_per_expert == std::vector<double>(8, 0.0));
      CHECK(got.tokens_per_expert == want.tokens_per_expert);
      CHECK(got.out.data == want.out.data);
      CHECK(got.dx.data == want.dx.data);
      CHECK(got.d_gate_weight.data == want.d_gate_weight.data);
      CHECK(got.aux_loss == want.aux_loss);
      CHECK(got.z_loss == want.z_loss);
      for (int e = 0; e < 8; ++e) {
        CHECK(got.expert_grads.dw13[e].data == want.expert_grads.dw13[e].data);
        CHECK(got.expert_grads.dw2[e].data == want.expert_grads.dw2[e].data);
      }
      // Padded, every expert's group is the capacity (12 after aligning 9 to 4), or else as
      // dropless.
      CHECK(got.expert_rows == (pad ? 8 * 12 : want.expert_rows));
    }
  }
}

TEST_CASE("capacity: dropped slots add nothing to out or dx and get dp = 0",
          "[cpu][reference][capacity]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const auto policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
    INFO(drop_policy_name(policy));
    MoEConfig config = capacity_config(0.5, policy);
    const Params params = test::random_params(config, rng);
    const Matrix x = test::random_matrix(16, 6, rng), dy = test::random_matrix(16, 6, rng);
    const LayerResult r = run_layer(config, params, x, dy);
    REQUIRE(std::count(r.kept.begin(), r.kept.end(), 0) > 0);
    check_counts(config, r, 16);

    // out[t] is the kept slots' weighted outputs alone.
    for (std::int64_t t = 0; t < 16; ++t) {
      std::vector<double> want(6, 0.0);
      for (int k = 0; k < 2; ++k) {
        if (r.kept[t * 2 + k] == 0) continue;
        const auto y = expert_output(params, r.routing.expert_of(t, k), x.row(t));
        for (int j = 0; j < 6; ++j) want[j] += r.routing.prob_of(t, k) * y[j];
      }
      const auto row = r.out.row(t);
      CHECK(test::relative_error(std::vector<double>(row.begin(), row.end()), want) <= 1e-12);
    }

    // dp, formed either way, is 0 exactly where the slot was dropped, and only there.
    const Layout layout = make_layout(r.routing, r.kept, 8, config.align_size);
    const Matrix X = permute(x, layout, r.routing);
    const ExpertActivations act = experts_forward(X, layout.offsets, params.experts);
    const auto dp_combine = combine_backward_prob(dy, act.y, layout, r.routing);
    const auto dp_experts = experts_prob_grads(dy, act, layout, r.routing, params.experts,
                                               Intermediates::kExact, DType::kFP32);
    for (std::size_t i = 0; i < r.kept.size(); ++i) {
      INFO("slot " << i);
      CHECK((dp_combine[i] == 0.0) == (r.kept[i] == 0));
      CHECK(dp_experts[i] == Approx(dp_combine[i]).epsilon(1e-12).margin(1e-12));
    }
    // permute_backward sends nothing back through a dropped slot.
    const Matrix ones(X.rows, 6, 1.0);
    const Matrix dx = permute_backward(ones, layout, r.routing);
    for (std::int64_t t = 0; t < 16; ++t) {
      const int kept_slots = r.kept[t * 2] + r.kept[t * 2 + 1];
      CHECK(dx(t, 0) == kept_slots);
    }
  }

  // K = 1, sigmoid, no losses: a dropped token has out = 0, dlogits = 0 and dx = 0 exactly.
  MoEConfig config = test::small_config(6, 4, 4, 1);
  config.score_function = ScoreFunction::kSigmoid;
  config.capacity_factor = 0.5;  // 12 tokens: C = ceil(0.5 · 12 / 4) = 2 of each expert's
  config.validate();
  const Params params = test::random_params(config, rng);
  const Matrix x = test::random_matrix(12, 6, rng), dy = test::random_matrix(12, 6, rng);
  const LayerResult r = run_layer(config, params, x, dy);
  REQUIRE(std::count(r.kept.begin(), r.kept.end(), 0) >= 4);
  for (std::int64_t t = 0; t < 12; ++t) {
    if (r.kept[t] != 0) continue;
    INFO("dropped token " << t);
    for (const double v : r.out.row(t)) CHECK(v == 0.0);
    for (const double v : r.dlogits.row(t)) CHECK(v == 0.0);
    for (const double v : r.dx.row(t)) CHECK(v == 0.0);
  }
}

TEST_CASE("capacity: the losses are those of the routing before the drops",
          "[cpu][reference][capacity]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig config = test::small_config(6, 4, 8, 2);
  config.aux_loss_coeff = 0.3;
  config.z_loss_coeff = 0.05;
  const Params params = test::random_params(config, rng);
  const Matrix x = test::random_matrix(10, 6, rng), dy = test::random_matrix(10, 6, rng);
  const LayerResult dropless = run_layer(config, params, x, dy);
  config.capacity_factor = 0.25;
  const LayerResult dropping = run_layer(config, params, x, dy);
  REQUIRE(std::count(dropping.kept.begin(), dropping.kept.end(), 0) > 0);
  CHECK(dropping.aux_loss == dropless.aux_loss);
  CHECK(dropping.z_loss == dropless.z_loss);
  CHECK(dropping.routing.expert == dropless.routing.expert);
  CHECK(dropping.routing.prob == dropless.routing.prob);
  // The expert-bias load is the routing before the drops: kept + dropped.
  std::vector<double> load = dropping.tokens_per_expert;
  for (int e = 0; e < 8; ++e) load[e] += dropping.dropped_per_expert[e];
  CHECK(load == dropless.tokens_per_expert);
  CHECK(load == tokens_per_expert(dropping.routing, 8));
}

TEST_CASE("capacity: pad_to_capacity makes every (source, expert) block C rows",
          "[cpu][reference][capacity]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig config = capacity_config(0.75, DropPolicy::kProbs);
  config.align_size = 4;
  config.pad_to_capacity = true;
  const Params params = test::random_params(config, rng);
  const Matrix x = test::random_matrix(10, 6, rng), dy = test::random_matrix(10, 6, rng);
  const std::int64_t C = config.expert_capacity(10);  // ceil(0.75 · 20 / 8) = 2, aligned to 4
  REQUIRE(C == 4);
  const LayerResult padded = run_layer(config, params, x, dy);
  CHECK(padded.expert_rows == 8 * C);
  check_counts(config, padded, 10);
  const Layout layout = make_layout(padded.routing, padded.kept, 8, 4, C);
  for (int e = 0; e < 8; ++e) CHECK(layout.group_rows(e) == C);

  // Padding changes the layout, not the results.
  MoEConfig unpadded = config;
  unpadded.pad_to_capacity = false;
  const LayerResult plain = run_layer(unpadded, params, x, dy);
  CHECK(plain.kept == padded.kept);
  CHECK(plain.expert_rows <= padded.expert_rows);  // equal when every group is full
  CHECK(test::relative_error(padded.out, plain.out) <= 1e-14);
  CHECK(test::relative_error(padded.dx, plain.dx) <= 1e-14);

  // On a mesh each expert receives EP blocks of C rows.
  config.ep = 2;
  config.dp = 2;
  config.validate();
  std::vector<Matrix> xs, dys;
  for (const int t : {7, 7, 3, 3}) {
    xs.push_back(test::random_matrix(t, 6, rng));
    dys.push_back(test::random_matrix(t, 6, rng));
  }
  const auto ranks = run_mesh(config, params, xs, dys);
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    const std::int64_t block = config.expert_capacity(xs[r].rows);
    CHECK(ranks[r].expert_rows == config.local_experts() * config.ep * block);
  }
  // The EP group of DP index 1 with unequal token counts is refused, naming them.
  xs[3] = test::random_matrix(5, 6, rng);
  dys[3] = test::random_matrix(5, 6, rng);
  CHECK_THROWS_WITH(run_mesh(config, params, xs, dys),
                    test::contains_text("pad_to_capacity = true needs the same token count on "
                                        "every rank of an EP group; the ranks of DP index 1 hold "
                                        "[3, 5]"));
}

TEST_CASE("capacity on a mesh: each source rank drops on its own tokens",
          "[cpu][reference][capacity][mesh]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  // 9 or more tokens put at least 18 slots on 8 experts of capacity 2: some rank must drop.
  std::uniform_int_distribution<int> tokens(9, 14);
  for (const auto& [ep, dp] : {std::pair{2, 1}, std::pair{2, 2}}) {
    for (const auto policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
      INFO("EP " << ep << " DP " << dp << ", " << drop_policy_name(policy));
      MoEConfig single = capacity_config(0.5, policy);  // C = ceil(T / 8), aligned to 2: 2
      single.align_size = 2;
      single.shared_ffn_hidden = 3;
      const Params params = test::random_params(single, rng);
      MoEConfig config = single;
      config.ep = ep;
      config.dp = dp;
      config.validate();
      std::vector<Matrix> xs, dys;
      for (int r = 0; r < ep * dp; ++r) {
        const int t = tokens(rng);
        xs.push_back(test::random_matrix(t, 6, rng));
        dys.push_back(test::random_matrix(t, 6, rng));
      }
      const auto ranks = run_mesh(config, params, xs, dys);
      // Without the losses a rank's tokens see nothing of the others' but the shared weights'
      // gradients: the mesh is each rank run alone, and the weight gradients are their sums.
      Matrix gate_sum(8, 6);
      std::vector<Matrix> dw13_sum(8, Matrix(6, 8)), dw2_sum(8, Matrix(4, 6));
      Matrix shared_dw13_sum(6, 6), shared_dw2_sum(3, 6);
      bool any_dropped = false;
      for (int r = 0; r < ep * dp; ++r) {
        INFO("rank " << r << ", " << xs[r].rows << " tokens");
        const LayerResult alone = run_layer(single, params, xs[r], dys[r]);
        const LayerResult& got = ranks[r];
        CHECK(got.kept == alone.kept);
        CHECK(got.tokens_per_expert == alone.tokens_per_expert);
        CHECK(got.dropped_per_expert == alone.dropped_per_expert);
        check_counts(config, got, xs[r].rows);
        CHECK(test::relative_error(got.out, alone.out) <= 1e-12);
        CHECK(test::relative_error(got.dx, alone.dx) <= 1e-12);
        add_into(gate_sum, alone.d_gate_weight);
        add_into(shared_dw13_sum, alone.shared_grads.dw13);
        add_into(shared_dw2_sum, alone.shared_grads.dw2);
        for (int e = 0; e < 8; ++e) {
          add_into(dw13_sum[e], alone.expert_grads.dw13[e]);
          add_into(dw2_sum[e], alone.expert_grads.dw2[e]);
        }
        any_dropped = any_dropped || std::count(got.kept.begin(), got.kept.end(), 0) > 0;
      }
      CHECK(any_dropped);
      const int E_loc = config.local_experts();
      for (int r = 0; r < ep * dp; ++r) {
        CHECK(test::relative_error(ranks[r].d_gate_weight, gate_sum) <= 1e-12);
        CHECK(test::relative_error(ranks[r].shared_grads.dw13, shared_dw13_sum) <= 1e-12);
        CHECK(test::relative_error(ranks[r].shared_grads.dw2, shared_dw2_sum) <= 1e-12);
        for (int le = 0; le < E_loc; ++le) {
          const int e = (r % ep) * E_loc + le;
          CHECK(test::relative_error(ranks[r].expert_grads.dw13[le], dw13_sum[e]) <= 1e-12);
          CHECK(test::relative_error(ranks[r].expert_grads.dw2[le], dw2_sum[e]) <= 1e-12);
        }
      }
    }
  }
}

TEST_CASE("capacity: layer backward equals finite differences with the drops fixed",
          "[cpu][reference][capacity]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const bool pad : {false, true}) {
    for (const auto policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
      INFO(drop_policy_name(policy) << (pad ? ", padded" : ""));
      MoEConfig config = test::small_config(6, 5, 4, 2);
      config.capacity_factor = 0.5;  // 6 tokens: C = ceil(0.5 · 6 · 2 / 4) = 2 of up to 6
      config.drop_policy = policy;
      config.pad_to_capacity = pad;
      config.align_size = 2;
      config.aux_loss_coeff = 0.3;
      config.z_loss_coeff = 0.05;
      config.validate();
      Params params;
      Matrix x;
      do {
        params = test::random_params(config, rng);
        x = test::random_matrix(6, config.hidden, rng);
      } while (!drops_well_separated(config, params, x));
      const Matrix dy = test::random_matrix(6, config.hidden, rng);
      const LayerResult result = run_layer(config, params, x, dy);
      REQUIRE(std::count(result.kept.begin(), result.kept.end(), 0) > 0);
      auto objective = [&] {
        const Routing routing = route(config, matmul_nt(x, params.gate_weight), {});
        REQUIRE(routing.expert == result.routing.expert);
        REQUIRE(keep_within_capacity(config, routing) == result.kept);
        return layer_objective(config, params, x, dy);
      };
      constexpr double kTolerance = 1e-6;
      CHECK(test::relative_error(result.dx.data, test::finite_differences(x.data, objective)) <=
            kTolerance);
      CHECK(test::relative_error(result.d_gate_weight.data,
                                 test::finite_differences(params.gate_weight.data, objective)) <=
            kTolerance);
      for (int e = 0; e < config.num_experts; ++e) {
        INFO("expert " << e);
        CHECK(test::relative_error(
                  result.expert_grads.dw13[e].data,
                  test::finite_differences(params.experts.w13[e].data, objective)) <= kTolerance);
        CHECK(test::relative_error(
                  result.expert_grads.dw2[e].data,
                  test::finite_differences(params.experts.w2[e].data, objective)) <= kTolerance);
      }
    }
  }
}
