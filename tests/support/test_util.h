// Helpers shared by the tests: seeded random inputs, relative errors, reference parameters.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "moe/config.h"
#include "moe/reference.h"

namespace moe::test {

using reference::Matrix;

// A fresh seed per run (fresh random inputs every time); tests print it with INFO so a failure
// can be replayed.
inline std::uint64_t fresh_seed() {
  std::random_device device;
  return (static_cast<std::uint64_t>(device()) << 32) ^ device();
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
  return params;
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

}  // namespace moe::test
