// What rounding can move the reference's gradients by, per unit of relative rounding and of sum
// length. The fp32 checks fall back to these bounds where a few tokens' gradient cancels to far
// below the terms that formed it, so that its relative error says nothing.
#include <algorithm>
#include <cmath>

#include "moe/error.h"
#include "reference/reference.h"
#include "stages.h"

namespace moe::reference {
namespace {

// dlogits as the router's backward forms them from these logits, each slot's expert held.
Matrix router_dlogits(const MoEConfig& config, const Matrix& logits, const Routing& selected,
                      const AuxStats& aux, std::span<const double> dprob) {
  const Routing routing = route_given(config, logits, selected.expert);
  Matrix dlogits = route_backward(config, logits, routing, dprob);
  if (config.aux_loss_coeff > 0) aux_loss_backward(config, logits, aux, dlogits);
  if (config.z_loss_coeff > 0) z_loss_backward(config, logits, aux.tokens, dlogits);
  return dlogits;
}

Matrix absolute(Matrix m) {
  for (double& v : m.data) v = std::fabs(v);
  return m;
}

}  // namespace

Matrix gate_gradient_magnitude(const MoEConfig& config, const Params& params, const Matrix& x,
                               const RouterFront& front, std::span<const double> dprob,
                               std::span<const double> dprob_magnitude, const Matrix& dlogits) {
  const int E = config.num_experts;
  const int K = config.topk;
  const std::int64_t T = x.rows;
  const auto slots = static_cast<std::size_t>(T * K);
  if (dprob.size() != slots || dprob_magnitude.size() != slots || front.logits.rows != T ||
      dlogits.rows != T || dlogits.cols != E)
    fail(
        "gate_gradient_magnitude: {} dprob, {} magnitudes, {} logit rows and dlogits [{},{}] for "
        "{} tokens of {} experts",
        dprob.size(), dprob_magnitude.size(), front.logits.rows, dlogits.rows, dlogits.cols, T, E);
  Matrix token_magnitude(T, E);  // of each dlogit

  // dprob's rounding, through the router's map from dprob: linear, one column per slot k.
  std::vector<double> unit(slots);
  for (int k = 0; k < K; ++k) {
    std::fill(unit.begin(), unit.end(), 0.0);
    for (std::int64_t t = 0; t < T; ++t) unit[static_cast<std::size_t>(t * K + k)] = 1.0;
    const Matrix column = route_backward(config, front.logits, front.routing, unit);
    for (std::int64_t t = 0; t < T; ++t) {
      const auto slot = static_cast<std::size_t>(t * K + k);
      for (int e = 0; e < E; ++e)
        token_magnitude(t, e) +=
            std::fabs(column(t, e)) * (dprob_magnitude[slot] + std::fabs(dprob[slot]));
    }
  }

  // The logits' rounding (each a sum over H, and stored), through the router's and the losses'
  // map from the logits: its slope by central differences, one logit column at a time. The 1
  // stands for the exponentials' own rounding, a relative error of the score, which an absolute
  // error of the logit makes.
  const Matrix logit_terms = matmul_nt(absolute(x), absolute(params.gate_weight));
  for (int j = 0; j < E; ++j) {
    Matrix up = front.logits, down = front.logits;
    std::vector<double> step(static_cast<std::size_t>(T));
    for (std::int64_t t = 0; t < T; ++t) {
      step[static_cast<std::size_t>(t)] = 1e-5 * (1.0 + std::fabs(front.logits(t, j)));
      up(t, j) += step[static_cast<std::size_t>(t)];
      down(t, j) -= step[static_cast<std::size_t>(t)];
    }
    const Matrix above = router_dlogits(config, up, front.routing, front.aux, dprob);
    const Matrix below = router_dlogits(config, down, front.routing, front.aux, dprob);
    for (std::int64_t t = 0; t < T; ++t) {
      const double error = logit_terms(t, j) + std::fabs(front.logits(t, j)) + 1.0;
      for (int e = 0; e < E; ++e)
        token_magnitude(t, e) += std::fabs(above(t, e) - below(t, e)) /
                                 (2.0 * step[static_cast<std::size_t>(t)]) * error;
    }
  }

  // The router's own last roundings, of each dlogit.
  add_into(token_magnitude, absolute(dlogits));
  return matmul_tn(token_magnitude, absolute(x));  // dWg = dlogitsᵀ · x
}

}  // namespace moe::reference
