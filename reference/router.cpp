// Forward steps 2 and 3 of docs/design.md in fp64: score functions, (grouped) top-K, probabilities,
// aux and z losses, and their backward.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "moe/error.h"
#include "reference/reference.h"

namespace moe::reference {
namespace {

constexpr double kNormEpsilon = 1e-20;  // the guard of the sigmoid normalisations

double sigmoid(double v) {
  return 1.0 / (1.0 + std::exp(-v));
}
double softplus(double v) {
  return std::max(v, 0.0) + std::log1p(std::exp(-std::abs(v)));
}

std::vector<double> softmax(std::span<const double> v) {
  const double peak = *std::max_element(v.begin(), v.end());
  std::vector<double> out(v.size());
  double sum = 0.0;
  for (std::size_t i = 0; i < v.size(); ++i) sum += out[i] = std::exp(v[i] - peak);
  for (auto& o : out) o /= sum;
  return out;
}

double logsumexp(std::span<const double> v) {
  const double peak = *std::max_element(v.begin(), v.end());
  double sum = 0.0;
  for (const double value : v) sum += std::exp(value - peak);
  return peak + std::log(sum);
}

// Elementwise score g(l) of sigmoid / sqrtsoftplus and its derivative g'(l).
// √softplus(l) = e^(l/2)·√(1 − e^l/2 + …) is e^(l/2) in double below l = −40, and that form keeps
// its value where e^l itself underflows (l < −745).
double sqrtsoftplus(double l) {
  return l < -40.0 ? std::exp(l / 2) : std::sqrt(softplus(l));
}
double elementwise_score(ScoreFunction f, double l) {
  return f == ScoreFunction::kSigmoid ? sigmoid(l) : sqrtsoftplus(l);
}
double elementwise_score_derivative(ScoreFunction f, double l) {
  if (f == ScoreFunction::kSigmoid) {
    const double s = sigmoid(l);
    return s * (1.0 - s);
  }
  // Far below zero σ(l) / softplus(l) = 1 − e^l/2 + … is 1 in double, so g' = √softplus(l) / 2;
  // the quotient would be 0/0 once e^l underflows (l < −745).
  const double s = sqrtsoftplus(l);
  return l < -40.0 ? 0.5 * s : sigmoid(l) / (2.0 * s);
}

// Indices of the `count` largest values among `candidates`, descending; ties to the lower index.
std::vector<int> top_indices(std::span<const double> values, std::vector<int> candidates,
                             int count) {
  std::stable_sort(candidates.begin(), candidates.end(),
                   [&](int a, int b) { return values[a] > values[b]; });
  candidates.resize(static_cast<std::size_t>(count));
  return candidates;
}

std::vector<int> all_indices(std::size_t n) {
  std::vector<int> indices(n);
  std::iota(indices.begin(), indices.end(), 0);
  return indices;
}

}  // namespace

std::vector<int> select_experts(const MoEConfig& config, std::span<const double> r) {
  const int E = config.num_experts;
  if (!config.grouped_routing()) return top_indices(r, all_indices(r.size()), config.topk);

  const auto [G, kept_groups] = config.routing_groups();
  const int per_group = E / G;
  const int per_group_k = config.topk / kept_groups;
  std::vector<double> group_score(static_cast<std::size_t>(G));
  for (int g = 0; g < G; ++g) {
    const auto group = r.subspan(static_cast<std::size_t>(g * per_group), per_group);
    for (const int i : top_indices(group, all_indices(group.size()), per_group_k)) {
      group_score[g] += group[i];
    }
  }
  std::vector<int> candidates;
  for (const int g : top_indices(group_score, all_indices(G), kept_groups)) {
    for (int i = 0; i < per_group; ++i) candidates.push_back(g * per_group + i);
  }
  std::sort(candidates.begin(), candidates.end());  // so ties still go to the lower index
  return top_indices(r, candidates, config.topk);
}

namespace {

// The aux loss's scores: softmax, or the elementwise score normalised over the row.
std::vector<double> aux_scores(const MoEConfig& config, std::span<const double> logits) {
  if (config.score_function == ScoreFunction::kSoftmax) return softmax(logits);
  std::vector<double> s(logits.size());
  double sum = 0.0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    sum += s[i] = elementwise_score(config.score_function, logits[i]);
  }
  for (auto& v : s) v /= sum + kNormEpsilon;
  return s;
}

}  // namespace

std::vector<double> router_scores(const MoEConfig& config, std::span<const double> logits) {
  if (config.score_function == ScoreFunction::kSoftmax) return softmax(logits);
  std::vector<double> s(logits.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    s[i] = elementwise_score(config.score_function, logits[i]);
  }
  return s;
}

std::vector<double> selection_scores(const MoEConfig& config, std::span<const double> logits,
                                     std::span<const double> expert_bias) {
  if (config.score_function == ScoreFunction::kSoftmax && !config.pre_softmax) {
    return {logits.begin(), logits.end()};
  }
  auto r = router_scores(config, logits);
  if (config.expert_bias) {
    for (std::size_t i = 0; i < r.size(); ++i) r[i] += expert_bias[i];
  }
  return r;
}

void check_given_experts(const MoEConfig& config, std::int64_t tokens, std::span<const int> experts,
                         std::string_view what) {
  const int E = config.num_experts;
  const int K = config.topk;
  if (std::ssize(experts) != tokens * K) {
    fail("{}: {} experts for {} tokens of top-{}; expected [{}, {}]", what, experts.size(), tokens,
         K, tokens, K);
  }
  for (std::int64_t t = 0; t < tokens; ++t) {
    const auto chosen = experts.subspan(static_cast<std::size_t>(t * K), K);
    for (int k = 0; k < K; ++k) {
      if (chosen[k] < 0 || chosen[k] >= E)
        fail("{}: token {}, slot {}: expert {} is outside [0, {})", what, t, k, chosen[k], E);
      for (int j = 0; j < k; ++j) {
        if (chosen[j] == chosen[k])
          fail("{}: token {}, slot {}: expert {} is already in slot {} (its experts are distinct)",
               what, t, k, chosen[k], j);
      }
    }
  }
}

Routing route_given(const MoEConfig& config, const Matrix& logits, std::span<const int> experts) {
  const int E = config.num_experts;
  const int K = config.topk;
  if (logits.cols != E) fail("route: logits have {} columns, num_experts = {}", logits.cols, E);
  check_given_experts(config, logits.rows, experts, "route_given");
  Routing routing;
  routing.tokens = logits.rows;
  routing.topk = K;
  routing.expert.assign(experts.begin(), experts.end());
  routing.prob.resize(routing.expert.size());
  for (std::int64_t t = 0; t < logits.rows; ++t) {
    const auto l = logits.row(t);
    const auto chosen = std::span(routing.expert).subspan(static_cast<std::size_t>(t * K), K);
    std::vector<double> p(K);
    if (config.score_function == ScoreFunction::kSoftmax && !config.pre_softmax) {
      std::vector<double> chosen_logits(K);
      for (int k = 0; k < K; ++k) chosen_logits[k] = l[chosen[k]];
      p = softmax(chosen_logits);
    } else {
      const auto s = router_scores(config, l);
      for (int k = 0; k < K; ++k) p[k] = s[chosen[k]];
      if (config.score_function != ScoreFunction::kSoftmax && K > 1) {
        const double z = std::accumulate(p.begin(), p.end(), 0.0) + kNormEpsilon;
        for (auto& v : p) v /= z;
      }
    }
    for (int k = 0; k < K; ++k) routing.prob[t * K + k] = p[k] * config.scaling_factor;
  }
  return routing;
}

Routing route(const MoEConfig& config, const Matrix& logits, std::span<const double> expert_bias) {
  const int E = config.num_experts;
  if (logits.cols != E) fail("route: logits have {} columns, num_experts = {}", logits.cols, E);
  if (config.expert_bias && std::ssize(expert_bias) != E) {
    fail("route: expert_bias has {} entries, num_experts = {}", expert_bias.size(), E);
  }
  std::vector<int> experts;
  experts.reserve(static_cast<std::size_t>(logits.rows * config.topk));
  for (std::int64_t t = 0; t < logits.rows; ++t) {
    const auto chosen =
        select_experts(config, selection_scores(config, logits.row(t), expert_bias));
    experts.insert(experts.end(), chosen.begin(), chosen.end());
  }
  return route_given(config, logits, experts);
}

Matrix route_backward(const MoEConfig& config, const Matrix& logits, const Routing& routing,
                      std::span<const double> dprob) {
  const int E = config.num_experts;
  const int K = config.topk;
  const double c = config.scaling_factor;
  if (std::ssize(dprob) != logits.rows * K) {
    fail("route_backward: dprob has {} entries, expected {}", dprob.size(), logits.rows * K);
  }
  Matrix dlogits(logits.rows, E);
  for (std::int64_t t = 0; t < logits.rows; ++t) {
    const auto l = logits.row(t);
    auto dl = dlogits.row(t);
    const auto dp = dprob.subspan(static_cast<std::size_t>(t * K), K);
    auto idx = [&](int k) { return routing.expert_of(t, k); };

    if (config.score_function == ScoreFunction::kSoftmax && !config.pre_softmax) {
      std::vector<double> q(K);
      for (int k = 0; k < K; ++k) q[k] = routing.prob_of(t, k) / c;
      double q_dot_dp = 0.0;
      for (int k = 0; k < K; ++k) q_dot_dp += q[k] * dp[k];
      for (int k = 0; k < K; ++k) dl[idx(k)] = c * q[k] * (dp[k] - q_dot_dp);
    } else if (config.score_function == ScoreFunction::kSoftmax) {
      const auto s = softmax(l);
      std::vector<double> ds(E, 0.0);
      for (int k = 0; k < K; ++k) ds[idx(k)] = c * dp[k];
      double s_dot_ds = 0.0;
      for (int i = 0; i < E; ++i) s_dot_ds += s[i] * ds[i];
      for (int i = 0; i < E; ++i) dl[i] = s[i] * (ds[i] - s_dot_ds);
    } else {
      const auto f = config.score_function;
      if (K == 1) {
        dl[idx(0)] = c * dp[0] * elementwise_score_derivative(f, l[idx(0)]);
        continue;
      }
      double z = kNormEpsilon;
      double dp_dot_p = 0.0;
      for (int k = 0; k < K; ++k) {
        z += elementwise_score(f, l[idx(k)]);
        dp_dot_p += dp[k] * routing.prob_of(t, k);
      }
      for (int k = 0; k < K; ++k) {
        const double ds = (c * dp[k] - dp_dot_p) / z;
        dl[idx(k)] = ds * elementwise_score_derivative(f, l[idx(k)]);
      }
    }
  }
  return dlogits;
}

AuxStats& AuxStats::operator+=(const AuxStats& other) {
  if (tokens_per_expert.empty()) {
    tokens_per_expert.assign(other.tokens_per_expert.size(), 0.0);
    score_sum.assign(other.score_sum.size(), 0.0);
  }
  for (std::size_t i = 0; i < other.tokens_per_expert.size(); ++i) {
    tokens_per_expert[i] += other.tokens_per_expert[i];
    score_sum[i] += other.score_sum[i];
  }
  tokens += other.tokens;
  return *this;
}

AuxStats aux_stats(const MoEConfig& config, const Matrix& logits) {
  const int E = config.num_experts;
  AuxStats stats;
  stats.tokens_per_expert.assign(E, 0.0);
  stats.score_sum.assign(E, 0.0);
  stats.tokens = logits.rows;
  for (std::int64_t t = 0; t < logits.rows; ++t) {
    const auto s = aux_scores(config, logits.row(t));
    for (const int i : top_indices(s, all_indices(E), config.topk)) stats.tokens_per_expert[i] += 1;
    for (int i = 0; i < E; ++i) stats.score_sum[i] += s[i];
  }
  return stats;
}

namespace {
// α·E / (K·T²): the factor shared by the aux loss and its gradient.
double aux_factor(const MoEConfig& config, std::int64_t tokens) {
  if (tokens == 0) return 0.0;
  const double T = static_cast<double>(tokens);
  return config.aux_loss_coeff * config.num_experts / (config.topk * T * T);
}
}  // namespace

double aux_loss(const MoEConfig& config, const AuxStats& global) {
  double sum = 0.0;
  for (std::size_t i = 0; i < global.score_sum.size(); ++i) {
    sum += global.score_sum[i] * global.tokens_per_expert[i];
  }
  return aux_factor(config, global.tokens) * sum;
}

void aux_loss_backward(const MoEConfig& config, const Matrix& logits, const AuxStats& global,
                       Matrix& dlogits) {
  const int E = config.num_experts;
  const double factor = aux_factor(config, global.tokens);
  std::vector<double> g(E);  // ∂L/∂s_aux[t, i], the same for every token
  for (int i = 0; i < E; ++i) g[i] = factor * global.tokens_per_expert[i];

  for (std::int64_t t = 0; t < logits.rows; ++t) {
    const auto l = logits.row(t);
    auto dl = dlogits.row(t);
    if (config.score_function == ScoreFunction::kSoftmax) {
      const auto s = softmax(l);
      double s_dot_g = 0.0;
      for (int i = 0; i < E; ++i) s_dot_g += s[i] * g[i];
      for (int i = 0; i < E; ++i) dl[i] += s[i] * (g[i] - s_dot_g);
      continue;
    }
    // s_aux = u / S with u = g(l), S = Σu + ε:  du_m = g_m / S − Σ_i g_i u_i / S².
    const auto f = config.score_function;
    std::vector<double> u(E);
    double S = kNormEpsilon;
    for (int i = 0; i < E; ++i) S += u[i] = elementwise_score(f, l[i]);
    double g_dot_u = 0.0;
    for (int i = 0; i < E; ++i) g_dot_u += g[i] * u[i];
    for (int i = 0; i < E; ++i) {
      const double du = g[i] / S - g_dot_u / (S * S);
      dl[i] += du * elementwise_score_derivative(f, l[i]);
    }
  }
}

double z_loss_sum(const Matrix& logits) {
  double sum = 0.0;
  for (std::int64_t t = 0; t < logits.rows; ++t) {
    const double lse = logsumexp(logits.row(t));
    sum += lse * lse;
  }
  return sum;
}

double z_loss(const MoEConfig& config, double global_sum, std::int64_t global_tokens) {
  if (global_tokens == 0) return 0.0;
  return config.z_loss_coeff / static_cast<double>(global_tokens) * global_sum;
}

void z_loss_backward(const MoEConfig& config, const Matrix& logits, std::int64_t global_tokens,
                     Matrix& dlogits) {
  if (global_tokens == 0) return;
  const double factor = config.z_loss_coeff / static_cast<double>(global_tokens);
  for (std::int64_t t = 0; t < logits.rows; ++t) {
    const auto l = logits.row(t);
    const double lse = logsumexp(l);
    const auto s = softmax(l);
    auto dl = dlogits.row(t);
    for (std::size_t i = 0; i < s.size(); ++i) dl[i] += factor * 2.0 * lse * s[i];
  }
}

std::vector<double> tokens_per_expert(const Routing& routing, int num_experts) {
  std::vector<double> load(num_experts, 0.0);
  for (const int e : routing.expert) load[e] += 1.0;
  return load;
}

void update_expert_bias(std::span<double> expert_bias, std::span<const double> load, double rate) {
  if (expert_bias.size() != load.size()) {
    fail("update_expert_bias: {} biases, {} loads", expert_bias.size(), load.size());
  }
  if (load.empty()) return;
  const double mean =
      std::accumulate(load.begin(), load.end(), 0.0) / static_cast<double>(load.size());
  for (std::size_t i = 0; i < load.size(); ++i) {
    const double gap = mean - load[i];
    expert_bias[i] += rate * static_cast<double>((gap > 0) - (gap < 0));
  }
}

}  // namespace moe::reference
