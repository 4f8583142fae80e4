// Shared experts in fp64 (docs/design.md, "Shared experts"): one SwiGLU FFN on every token,
// optionally scaled by a sigmoid gate, added to the routed experts' output; and its backward.
#include <array>
#include <cmath>

#include "moe/error.h"
#include "reference/reference.h"
#include "reference/stages.h"

namespace moe::reference {
namespace {

void check_shared(const MoEConfig& config, const SharedExpert& shared, std::int64_t hidden) {
  const std::int64_t Fs = config.shared_ffn_hidden;
  if (shared.w13.rows != hidden || shared.w13.cols != 2 * Fs)
    fail("reference: shared w13 is [{},{}], expected [{},{}]", shared.w13.rows, shared.w13.cols,
         hidden, 2 * Fs);
  if (shared.w2.rows != Fs || shared.w2.cols != hidden)
    fail("reference: shared w2 is [{},{}], expected [{},{}]", shared.w2.rows, shared.w2.cols, Fs,
         hidden);
  if (config.shared_gate && (shared.gate_weight.rows != 1 || shared.gate_weight.cols != hidden))
    fail("reference: shared gate_weight is [{},{}], expected [1,{}]", shared.gate_weight.rows,
         shared.gate_weight.cols, hidden);
}

// The shared FFN is one expert whose row group is every token, so the routed experts' code runs
// it unchanged.
ExpertWeights as_expert(const SharedExpert& shared) {
  return {{shared.w13}, {shared.w2}};
}

double sigmoid(double v) {
  return 1.0 / (1.0 + std::exp(-v));
}

}  // namespace

SharedForward shared_forward(const MoEConfig& config, const SharedExpert& shared, const Matrix& x,
                             Intermediates intermediates) {
  check_shared(config, shared, x.cols);
  const std::array<std::int64_t, 2> offsets = {0, x.rows};
  SharedForward f;
  f.intermediates = intermediates;
  f.act = experts_forward(x, offsets, as_expert(shared), intermediates, config.dtype);
  f.gate.assign(static_cast<std::size_t>(x.rows), 1.0);
  f.out = f.act.y;
  if (config.shared_gate) {
    const Matrix logit = matmul_nt(x, shared.gate_weight);  // [T, 1]
    for (std::int64_t t = 0; t < x.rows; ++t) {
      const double g = f.gate[t] = sigmoid(logit(t, 0));
      for (auto& v : f.out.row(t)) v *= g;
    }
  }
  return f;
}

SharedExpertGrads shared_backward(const MoEConfig& config, const SharedExpert& shared,
                                  const Matrix& x, const SharedForward& forward, const Matrix& dy,
                                  Matrix& dx) {
  check_shared(config, shared, x.cols);
  if (dy.rows != x.rows || dy.cols != x.cols || dx.rows != x.rows || dx.cols != x.cols)
    fail("shared_backward: x [{},{}], dy [{},{}], dx [{},{}] must match", x.rows, x.cols, dy.rows,
         dy.cols, dx.rows, dx.cols);
  // out = g ⊙ y: y sees g·dy, and the gate's logit sees g(1 − g)·<dy, y>.
  Matrix dY = dy;
  Matrix dlogit(x.rows, 1), dlogit_magnitude(x.rows, 1);
  for (std::int64_t t = 0; t < x.rows; ++t) {
    const double g = forward.gate[t];
    // At one token this is the whole gate gradient: a dot product whose terms may cancel, so the
    // reference rounds where the GPU's experts do.
    double dy_dot_y = 0.0;
    if (forward.intermediates == Intermediates::kAsStored) {
      dy_dot_y =
          expert_prob_grad(dy, t, forward.act.h, t, shared.w2, forward.intermediates, config.dtype);
    } else {
      for (std::int64_t j = 0; j < x.cols; ++j) dy_dot_y += dy(t, j) * forward.act.y(t, j);
    }
    if (config.shared_gate) {
      // What rounding can move the logit's gradient by, per unit of relative rounding: <dy, y>
      // by its sums' terms, and the gate's logit (a sum over H) through the sigmoid's slope.
      double logit_terms = 0.0;
      for (std::int64_t i = 0; i < x.cols; ++i)
        logit_terms += std::fabs(x(t, i) * shared.gate_weight(0, i));
      dlogit_magnitude(t, 0) =
          std::fabs(g * (1.0 - g)) *
              expert_prob_grad_magnitude(dy, t, x, t, forward.act.h, shared.w13, shared.w2) +
          std::fabs(g * (1.0 - g) * (1.0 - 2.0 * g)) * logit_terms * std::fabs(dy_dot_y);
    }
    dlogit(t, 0) = g * (1.0 - g) * dy_dot_y;
    for (auto& v : dY.row(t)) v *= g;
  }
  const std::array<std::int64_t, 2> offsets = {0, x.rows};
  ExpertGrads grads = experts_backward(x, forward.act, dY, offsets, as_expert(shared));
  add_into(dx, grads.dX);
  SharedExpertGrads out;
  out.dw13 = std::move(grads.dw13.front());
  out.dw2 = std::move(grads.dw2.front());
  if (config.shared_gate) {
    add_into(dx, matmul(dlogit, shared.gate_weight));  // dx += dlogit · g_w
    out.dgate_weight = matmul_tn(dlogit, x);           // dg_w = dlogitᵀ · x
    Matrix x_magnitude = x;
    for (double& v : x_magnitude.data) v = std::fabs(v);
    out.dgate_weight_magnitude = matmul_tn(dlogit_magnitude, x_magnitude);
  }
  return out;
}

}  // namespace moe::reference
