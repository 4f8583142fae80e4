#include "gpu/router_inputs.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

namespace moe::test {

using reference::Matrix;

Matrix draw_logits(std::int64_t tokens, int experts, DType dtype, std::mt19937_64& rng) {
  Matrix logits(tokens, experts);
  std::vector<int> order(experts);
  std::iota(order.begin(), order.end(), 0);
  std::uniform_real_distribution<double> offset(-1.0, 1.0);
  // Spacing and offset on a power-of-two grid: every logit then has few significant bits, so
  // sums of them (the group scores of softmax post) are exact in fp32 and in the reference, and
  // equal sums tie exactly on both sides instead of nearly.
  const double spacing =
      std::ldexp(1.0, static_cast<int>(std::floor(std::log2(std::min(8.0 / experts, 0.5)))));
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::shuffle(order.begin(), order.end(), rng);
    const double shift = std::round(offset(rng) * 16.0 / spacing) * spacing / 16.0;
    for (int e = 0; e < experts; ++e) logits(t, e) = shift + (order[e] - experts / 2.0) * spacing;
  }
  return reference::round_to(logits, dtype);
}

std::vector<double> draw_bias(int experts, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> band(-1, 1);
  std::vector<double> bias(experts);
  for (auto& b : bias) b = 2.0 * band(rng);
  return bias;
}

Matrix draw_tied_logits(std::int64_t tokens, int experts, std::mt19937_64& rng) {
  Matrix logits(tokens, experts);
  std::vector<int> order(experts);
  std::iota(order.begin(), order.end(), 0);
  std::uniform_int_distribution<int> tied_count(1, std::min(48, experts));
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::shuffle(order.begin(), order.end(), rng);
    const int tied = tied_count(rng);
    for (int j = 0; j < experts; ++j)
      logits(t, order[j]) = j < tied ? 1.0 : -4.0 * (j - tied + 1) / experts;  // bf16-exact top
  }
  return logits;
}

void move_rows_to_the_sigmoid_fallback(Matrix& logits) {
  for (std::int64_t t = 0; t < logits.rows; ++t) {
    auto row = logits.row(t);
    if (t % 3 == 0) {
      *std::max_element(row.begin(), row.end()) = 17.0;
    } else if (t % 3 == 1) {
      for (double& l : row) l -= 84.0;
    }
  }
}

void crowd_rows_into_one_lane(Matrix& logits, std::mt19937_64& rng) {
  const int experts = static_cast<int>(logits.cols);
  for (std::int64_t t = 0; t < logits.rows; t += 2) {
    auto row = logits.row(t);
    std::vector<double> values(row.begin(), row.end());
    std::sort(values.begin(), values.end(), std::greater<>());
    std::vector<int> lane, others;
    for (int e = 0; e < experts; ++e) (e % 32 == t % 32 ? lane : others).push_back(e);
    std::shuffle(lane.begin(), lane.end(), rng);
    std::shuffle(others.begin(), others.end(), rng);
    lane.insert(lane.end(), others.begin(), others.end());
    for (int i = 0; i < experts; ++i) row[lane[i]] = values[i];
  }
}

void move_rows_to_the_extremes(Matrix& logits, int topk, std::mt19937_64& rng) {
  const int experts = static_cast<int>(logits.cols);
  std::uniform_int_distribution<int> expert(0, experts - 1);
  std::uniform_int_distribution<int> coin(0, 1);
  for (std::int64_t t = 0; t < logits.rows; ++t) {
    auto row = logits.row(t);
    if (t % 3 == 0) {
      for (double& l : row) l = -1e4;
      for (int k = 0; k < topk; ++k) row[expert(rng)] = 1e4;
    } else if (t % 3 == 1) {
      for (double& l : row) l = coin(rng) ? 1e4 : -1e4;
    } else {
      for (int e = 0; e < experts / 4; ++e) row[expert(rng)] = -1e4;
    }
  }
}

}  // namespace moe::test
