// Helpers shared by the tests: seeded random inputs, relative errors, reference parameters.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "moe/config.h"
#include "moe/error.h"
#include "reference/reference.h"

namespace moe::test {

using reference::Matrix;

// The run's seed (support/main.cpp): drawn fresh for every run of a test binary, or taken from
// MOE_TEST_SEED, printed first, and the same on every rank. Every test case draws its inputs from
// it, so `MOE_TEST_SEED=<seed> <binary> "<test name>"` replays one failing case exactly.
std::uint64_t run_seed();
inline std::uint64_t fresh_seed() {
  return run_seed();
}

// How much a run covers. The default run stays short (seconds), so that it can be repeated within
// one call on the GPU machine; MOE_TEST_QUICK=1 shrinks it further for the compute-sanitizer
// tools, which slow kernels down tens of times (every code path is still taken, on fewer tokens);
// MOE_TEST_LONG=1 turns on the exhaustive sweeps: larger token counts and every combination.
enum class RunSize { kQuick, kDefault, kLong };
inline bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0' || std::string(value) == "0") return false;
  if (std::string(value) == "1") return true;
  throw Error(std::string(name) + " = '" + value + "' must be 0 or 1");
}
inline RunSize run_size() {
  const bool quick = env_flag("MOE_TEST_QUICK");
  const bool long_sweeps = env_flag("MOE_TEST_LONG");
  if (quick && long_sweeps) throw Error("MOE_TEST_QUICK and MOE_TEST_LONG are both set");
  return quick ? RunSize::kQuick : long_sweeps ? RunSize::kLong : RunSize::kDefault;
}
inline bool long_run() {
  return run_size() == RunSize::kLong;
}
// The value for this run's size.
inline std::int64_t by_run_size(std::int64_t quick, std::int64_t normal, std::int64_t long_sweep) {
  switch (run_size()) {
    case RunSize::kQuick:
      return quick;
    case RunSize::kLong:
      return long_sweep;
    case RunSize::kDefault:
      break;
  }
  return normal;
}

inline Matrix random_matrix(std::int64_t rows, std::int64_t cols, std::mt19937_64& rng,
                            double scale = 1.0) {
  std::normal_distribution<double> normal(0.0, scale);
  Matrix m(rows, cols);
  for (auto& v : m.data) v = normal(rng);
  return m;
}

// ‖got − want‖ / ‖want‖ (absolute when want is zero); NaN anywhere gives NaN, which fails any ≤.
inline double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return INFINITY;
  double diff = 0.0;
  double norm = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}
inline double relative_error(const Matrix& got, const Matrix& want) {
  if (got.rows != want.rows || got.cols != want.cols) return INFINITY;
  return relative_error(got.data, want.data);
}

using reference::round_to;

// Weights scaled like a trained layer's (1/sqrt(fan-in)), so activations stay O(1).
inline reference::Params random_params(const MoEConfig& config, std::mt19937_64& rng) {
  reference::Params params;
  const int E = config.num_experts;
  const int H = config.hidden;
  const int F = config.ffn_hidden;
  params.gate_weight = random_matrix(E, H, rng, 1.0 / std::sqrt(H));
  std::uniform_real_distribution<double> bias(-0.5, 0.5);
  params.expert_bias.resize(E);
  for (auto& b : params.expert_bias) b = bias(rng);
  for (int e = 0; e < E; ++e) {
    params.experts.w13.push_back(random_matrix(H, 2 * F, rng, 1.0 / std::sqrt(H)));
    params.experts.w2.push_back(random_matrix(F, H, rng, 1.0 / std::sqrt(F)));
  }
  // Drawn last, so that configs without shared experts draw what they always drew.
  if (config.shared_experts()) {
    const int Fs = config.shared_ffn_hidden;
    params.shared.w13 = random_matrix(H, 2 * Fs, rng, 1.0 / std::sqrt(H));
    params.shared.w2 = random_matrix(Fs, H, rng, 1.0 / std::sqrt(Fs));
  }
  if (config.shared_gate) params.shared.gate_weight = random_matrix(1, H, rng, 1.0 / std::sqrt(H));
  return params;
}

// Parameters rounded to what the block stores (dtype for weights, fp32 for the bias).
inline reference::Params round_params(reference::Params p, DType dtype) {
  p.gate_weight = round_to(p.gate_weight, dtype);
  for (auto& w : p.experts.w13) w = round_to(w, dtype);
  for (auto& w : p.experts.w2) w = round_to(w, dtype);
  for (auto& b : p.expert_bias) b = static_cast<float>(b);
  if (p.shared.w13.rows > 0) p.shared.w13 = round_to(p.shared.w13, dtype);
  if (p.shared.w2.rows > 0) p.shared.w2 = round_to(p.shared.w2, dtype);
  if (p.shared.gate_weight.rows > 0) p.shared.gate_weight = round_to(p.shared.gate_weight, dtype);
  return p;
}

// Central differences of f over every entry of `values`, each moved by ±step in turn (fp64:
// O(step²) truncation, ~1e-11 rounding at step 1e-5).
inline std::vector<double> finite_differences(std::vector<double>& values,
                                              const std::function<double()>& f,
                                              double step = 1e-5) {
  std::vector<double> grad(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double saved = values[i];
    values[i] = saved + step;
    const double up = f();
    values[i] = saved - step;
    const double down = f();
    values[i] = saved;
    grad[i] = (up - down) / (2 * step);
  }
  return grad;
}

// A small config for reference tests; fields are overridden per case.
inline MoEConfig small_config(int hidden, int ffn, int experts, int topk) {
  MoEConfig config;
  config.hidden = hidden;
  config.ffn_hidden = ffn;
  config.num_experts = experts;
  config.topk = topk;
  config.dtype = DType::kFP32;
  return config;
}

// A small config with FP8 experts: bf16, rows aligned to 16 (as fp8 needs), an aux loss, the
// GEMM heuristic's choices (the FP8 products are not timed).
inline MoEConfig fp8_config(int hidden, int ffn, int experts, int topk) {
  MoEConfig c = small_config(hidden, ffn, experts, topk);
  c.dtype = DType::kBF16;
  c.align_size = 16;
  c.fp8 = true;
  c.aux_loss_coeff = 0.01;
  c.gemm_autotune = false;
  return c;
}

// deepseek-v3's router, scaled down, on `base`'s other settings: 16 experts, sigmoid + bias, 4
// groups keeping 2, top-4, scale 2.5.
inline MoEConfig deepseek_like(MoEConfig base) {
  base.num_experts = 16;
  base.topk = 4;
  base.score_function = ScoreFunction::kSigmoid;
  base.expert_bias = true;
  base.num_groups = 4;
  base.group_topk = 2;
  base.scaling_factor = 2.5;
  return base;
}

}  // namespace moe::test

namespace moe::test {

inline double min_adjacent_gap(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  double gap = INFINITY;
  for (std::size_t i = 1; i < values.size(); ++i) gap = std::min(gap, values[i] - values[i - 1]);
  return gap;
}

// Whether every token's logits, selection scores and group scores are at least `gap` apart, so
// that a perturbation smaller than that (a finite-difference step) cannot change any routing.
inline bool well_separated(const MoEConfig& config, const reference::Matrix& logits,
                           std::span<const double> bias, double gap) {
  for (std::int64_t t = 0; t < logits.rows; ++t) {
    const auto row = logits.row(t);
    const auto r = reference::selection_scores(config, row, bias);
    if (min_adjacent_gap({row.begin(), row.end()}) < gap || min_adjacent_gap(r) < gap) return false;
    if (!config.grouped_routing()) continue;
    const auto [groups, kept_groups] = config.routing_groups();
    const int per_group = config.num_experts / groups;
    const int per_group_k = config.topk / kept_groups;
    std::vector<double> group_scores;
    for (int g = 0; g < groups; ++g) {
      std::vector<double> members(r.begin() + g * per_group, r.begin() + (g + 1) * per_group);
      std::sort(members.rbegin(), members.rend());
      group_scores.push_back(std::accumulate(members.begin(), members.begin() + per_group_k, 0.0));
    }
    if (min_adjacent_gap(group_scores) < gap) return false;
  }
  return true;
}

}  // namespace moe::test
