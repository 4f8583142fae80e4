// MoEBlock in capacity mode on one GPU against the fp64 reference of the whole layer: output,
// losses, dx and every weight gradient, the kept mask and the counts, over both drop policies,
// capacity factors that drop many slots, a few or none, alignments and dtypes; every token to the
// same experts; pad_to_capacity's fixed blocks; the load statistics' routed and dropped totals.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "moe/device.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "support/block_results.h"
#include "support/block_util.h"
#include "support/capacity_check.h"
#include "support/catch.h"
#include "support/gpu_util.h"

using namespace moe;
using reference::Matrix;

namespace {

// As test::draw_separated, with every input positive: a gate biased towards some experts in every
// column then sends every token to them.
void draw_positive_separated(const MoEConfig& c, const reference::Params& params, Matrix& x,
                             std::int64_t tokens, std::mt19937_64& rng) {
  x = Matrix(tokens, c.hidden);
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (int attempt = 0;; ++attempt) {
      REQUIRE(attempt < 1000);
      Matrix row = test::random_matrix(1, c.hidden, rng);
      for (auto& v : row.data) v = std::abs(v);
      row = test::round_to(row, c.dtype);
      if (!test::well_separated(c, reference::matmul_nt(row, params.gate_weight),
                                params.expert_bias, 1e-4))
        continue;
      std::copy(row.data.begin(), row.data.end(), x.row(t).begin());
      break;
    }
  }
}

// One step against the reference; returns how many slots were dropped.
int run_capacity_case(const MoEConfig& c, std::int64_t tokens, std::mt19937_64& rng,
                      bool skewed = false) {
  INFO(c.describe() << " T=" << tokens << (skewed ? " skewed" : ""));
  auto params = test::round_params(test::random_params(c, rng), c.dtype);
  if (skewed) {  // a gate that sends every token to the same experts, by a wide margin
    for (std::int64_t h = 0; h < c.hidden; ++h) {
      params.gate_weight(0, h) += 0.5;
      params.gate_weight(1, h) += 0.4;
    }
    params.gate_weight = test::round_to(params.gate_weight, c.dtype);
  }
  Matrix x, dy;
  reference::LayerResult want;
  for (int attempt = 0;; ++attempt) {
    REQUIRE(attempt < 50);
    if (skewed) {
      draw_positive_separated(c, params, x, tokens, rng);
    } else {
      test::draw_separated(c, params, x, tokens, rng);
    }
    dy = test::round_to(test::random_matrix(tokens, c.hidden, rng), c.dtype);
    want = reference::run_layer(c, params, x, dy, test::kAsStored, test::kDprobInExperts);
    if (test::capacity_boundary_clear(c, tokens, want)) break;
  }
  Stream stream;
  const Mesh mesh = Mesh::single();
  MoEBlock block(c, mesh, stream.get());
  test::load_params(block, params, 0, c.num_experts);
  const auto got = test::run_block(block, c, x, dy);
  test::check_against_reference(c, got, want);

  const MoERouting routing = block.routing();
  const auto slots = static_cast<std::size_t>(tokens * c.topk);
  const auto E = static_cast<std::size_t>(c.num_experts);
  REQUIRE(routing.kept.numel() == static_cast<std::int64_t>(slots));
  std::vector<std::int32_t> kept(slots), counts(E), dropped(E);
  copy_to_host(kept.data(), routing.kept.data, slots * 4);
  copy_to_host(counts.data(), routing.tokens_per_expert.data, E * 4);
  copy_to_host(dropped.data(), routing.dropped_per_expert.data, E * 4);
  CHECK(std::vector<int>(kept.begin(), kept.end()) == want.kept);
  for (std::size_t e = 0; e < E; ++e) {
    INFO("expert " << e);
    CHECK(counts[e] == want.tokens_per_expert[e]);
    CHECK(dropped[e] == want.dropped_per_expert[e]);
  }
  return static_cast<int>(std::count(want.kept.begin(), want.kept.end(), 0));
}

}  // namespace

TEST_CASE("capacity mode on one GPU equals the fp64 reference", "[gpu][block][capacity]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  // T = 45, K = 2, E = 8: about 11 slots per expert; a factor of 0.5 with no alignment gives
  // C = 6, so every case meant to drop does (with align 16, C = 16 may drop nothing).
  for (const DType dtype : {DType::kFP32, DType::kBF16}) {
    for (const DropPolicy policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
      for (const double factor : {0.5, 1.0, 1.25}) {
        for (const int align : {0, 16}) {
          const int dropped =
              run_capacity_case(test::capacity_config(dtype, factor, policy, align), 45, rng);
          if (factor == 0.5 && align == 0) CHECK(dropped > 0);
        }
      }
      // X kept in its own buffer (Y and dY apart from it), the SwiGLU output in chunks, one
      // token, no tokens.
      MoEConfig kept = test::capacity_config(dtype, 0.5, policy, 0);
      kept.keep_expert_input = true;
      CHECK(run_capacity_case(kept, 45, rng) > 0);
      kept.keep_expert_input = false;
      kept.activation_chunk_mib = 1.0 / 1024;
      CHECK(run_capacity_case(kept, 45, rng) > 0);
      run_capacity_case(kept, 1, rng);
      run_capacity_case(kept, 0, rng);
      // Every token to experts 0 and 1: they keep C slots each, the others get none.
      CHECK(run_capacity_case(test::capacity_config(dtype, 1.0, policy, 0), 64, rng, true) > 0);
      // Sigmoid, groups and a shared expert beside the drops.
      MoEConfig ds = test::deepseek_like(test::capacity_config(dtype, 0.5, policy, 0));
      ds.shared_ffn_hidden = 40;
      CHECK(run_capacity_case(ds, 45, rng) > 0);
    }
  }
}

TEST_CASE("capacity mode that drops nothing equals the dropless layer bitwise",
          "[gpu][block][capacity]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const DType dtype : {DType::kFP32, DType::kBF16}) {
    // C ≥ T for every expert: nothing can drop.
    MoEConfig ample = test::capacity_config(dtype, 4.0, DropPolicy::kProbs, 16);
    ample.gemm_autotune = false;  // two blocks: the same GEMM algorithms in both
    MoEConfig dropless = ample;
    dropless.capacity_factor = 0.0;
    auto params = test::round_params(test::random_params(ample, rng), dtype);
    Matrix x;
    test::draw_separated(ample, params, x, 45, rng);
    const Matrix dy = test::round_to(test::random_matrix(45, ample.hidden, rng), dtype);
    Stream stream;
    const Mesh mesh = Mesh::single();
    std::vector<test::Results> results;
    for (const MoEConfig& c : {ample, dropless}) {
      MoEBlock block(c, mesh, stream.get());
      test::load_params(block, params, 0, c.num_experts);
      results.push_back(test::run_block(block, c, x, dy));
    }
    CHECK(results[0].out.data == results[1].out.data);
    CHECK(results[0].dx.data == results[1].dx.data);
    CHECK(results[0].dgate.data == results[1].dgate.data);
    for (std::size_t e = 0; e < results[0].dw13.size(); ++e) {
      CHECK(results[0].dw13[e].data == results[1].dw13[e].data);
      CHECK(results[0].dw2[e].data == results[1].dw2[e].data);
    }
  }
}

// Every expert's block exactly C rows (the kernel test checks the layout itself): the zero rows
// change no result, so the layer still equals the reference, dropping or not.
TEST_CASE("pad_to_capacity on one GPU equals the fp64 reference", "[gpu][block][capacity]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const auto padded = [](MoEConfig c) {
    c.pad_to_capacity = true;
    c.validate();
    return c;
  };
  for (const DType dtype : {DType::kFP32, DType::kBF16}) {
    for (const DropPolicy policy : {DropPolicy::kProbs, DropPolicy::kPosition}) {
      CHECK(run_capacity_case(padded(test::capacity_config(dtype, 0.5, policy, 0)), 45, rng) > 0);
      run_capacity_case(padded(test::capacity_config(dtype, 1.25, policy, 16)), 45, rng);
      run_capacity_case(padded(test::capacity_config(dtype, 2.0, policy, 0)), 45, rng);
      MoEConfig kept = padded(test::capacity_config(dtype, 0.5, policy, 0));
      kept.keep_expert_input = true;
      CHECK(run_capacity_case(kept, 45, rng) > 0);
      run_capacity_case(kept, 1, rng);
      run_capacity_case(kept, 0, rng);
      CHECK(run_capacity_case(padded(test::capacity_config(dtype, 1.0, policy, 0)), 64, rng, true) >
            0);
    }
  }
}

// The load statistics over several forwards of one block: each expert's routed slots (kept or
// not) and, in capacity mode, its dropped ones, summed over the steps as the reference counts them;
// a reset starts them again from zero. Dropless, there are no drop totals.
TEST_CASE("load statistics accumulate routed and dropped slots over forwards",
          "[gpu][block][capacity]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const double factor : {0.5, 0.0}) {
    MoEConfig c = test::capacity_config(DType::kBF16, 0.5, DropPolicy::kProbs, 0);
    c.capacity_factor = factor;
    c.validate();
    INFO(c.describe());
    const auto params = test::round_params(test::random_params(c, rng), c.dtype);
    Stream stream;
    const Mesh mesh = Mesh::single();
    MoEBlock block(c, mesh, stream.get());
    test::load_params(block, params, 0, c.num_experts);
    const auto E = static_cast<std::size_t>(c.num_experts);
    const auto read_totals = [&](const Tensor& t) {
      std::vector<std::int64_t> v(E);
      REQUIRE(t.numel() == c.num_experts);
      block.synchronize();
      copy_to_host(v.data(), t.data, E * 8);
      return v;
    };
    std::vector<std::int64_t> routed(E, 0), dropped(E, 0);
    std::int64_t steps = 0;
    for (const std::int64_t tokens : {45, 30, 1, 0, 64}) {
      INFO("T=" << tokens);
      if (tokens == 1) {  // the statistics start again after a reset
        block.reset_load_statistics();
        std::fill(routed.begin(), routed.end(), 0);
        std::fill(dropped.begin(), dropped.end(), 0);
        steps = 0;
        const MoELoadStatistics cleared = block.load_statistics();
        CHECK(cleared.steps == 0);
        CHECK(read_totals(cleared.tokens_per_expert) == routed);
        if (factor > 0) CHECK(read_totals(cleared.dropped_per_expert) == dropped);
      }
      Matrix x;
      reference::LayerResult want;
      for (int attempt = 0;; ++attempt) {
        REQUIRE(attempt < 50);
        test::draw_separated(c, params, x, tokens, rng);
        want = reference::run_layer(c, params, x, Matrix(tokens, c.hidden), test::kAsStored,
                                    test::kDprobInExperts);
        if (!c.capacity_mode() || test::capacity_boundary_clear(c, tokens, want)) break;
      }
      const Matrix dy = test::round_to(test::random_matrix(tokens, c.hidden, rng), c.dtype);
      test::run_block(block, c, x, dy);
      ++steps;
      for (std::size_t e = 0; e < E; ++e) {
        const double dropped_now = factor > 0 ? want.dropped_per_expert[e] : 0.0;
        routed[e] += static_cast<std::int64_t>(want.tokens_per_expert[e] + dropped_now);
        dropped[e] += static_cast<std::int64_t>(dropped_now);
      }
      const MoELoadStatistics load = block.load_statistics();
      CHECK(load.steps == steps);
      CHECK(read_totals(load.tokens_per_expert) == routed);
      if (factor > 0) {
        CHECK(read_totals(load.dropped_per_expert) == dropped);
      } else {
        CHECK(load.dropped_per_expert.data == nullptr);
      }
    }
    if (factor > 0) CHECK(std::accumulate(dropped.begin(), dropped.end(), std::int64_t{0}) > 0);
  }
}
