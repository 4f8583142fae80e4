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
  const std::int64_t Fs = shared.w2.rows;
  for (std::int64_t t = 0; t < x.rows; ++t) {
    const double g = forward.gate[t];
    if (config.shared_gate) {
      // What rounding can move the logit's gradient by, per unit of relative rounding: the
      // backward's sums (dA = dy·w2ᵀ over H, ⟨dA, a⟩ over Fs) by their terms' magnitudes, and
      // the forward's, which reach it through a (h = x·w13 over H, each h by its terms'
      // magnitudes, scaled by a's sensitivity to it) and through the gate (its logit over H).
      double magnitude = 0.0, dot = 0.0;
      for (std::int64_t f = 0; f < Fs; ++f) {
        double dA = 0.0, dA_magnitude = 0.0, gate_terms = 0.0, up_terms = 0.0;
        for (std::int64_t i = 0; i < x.cols; ++i) {
          dA += dy(t, i) * shared.w2(f, i);
          dA_magnitude += std::fabs(dy(t, i) * shared.w2(f, i));
          gate_terms += std::fabs(x(t, i) * shared.w13(i, f));
          up_terms += std::fabs(x(t, i) * shared.w13(i, Fs + f));
        }
        const double h_gate = forward.act.h(t, f), h_up = forward.act.h(t, Fs + f);
        const double sigma = 1.0 / (1.0 + std::exp(-h_gate));
        const double dsilu = sigma * (1.0 + h_gate * (1.0 - sigma));
        const double a = silu(h_gate) * h_up;
        dot += dA * a;
        magnitude +=
            dA_magnitude * std::fabs(a) + std::fabs(dA) * (std::fabs(dsilu * h_up) * gate_terms +
                                                           std::fabs(silu(h_gate)) * up_terms);
      }
      double logit_terms = 0.0;
      for (std::int64_t i = 0; i < x.cols; ++i)
        logit_terms += std::fabs(x(t, i) * shared.gate_weight(0, i));
      dlogit_magnitude(t, 0) =
          std::fabs(g * (1.0 - g)) * magnitude +
          std::fabs(g * (1.0 - g) * (1.0 - 2.0 * g)) * logit_terms * std::fabs(dot);
    }
    // At one token this is the whole gate gradient: a dot product whose terms may cancel, so the
    // reference rounds where the GPU's experts do.
    double dy_dot_y = 0.0;
    if (forward.intermediates == Intermediates::kAsStored) {
      dy_dot_y =
          expert_prob_grad(dy, t, forward.act.h, t, shared.w2, forward.intermediates, config.dtype);
    } else {
      for (std::int64_t j = 0; j < x.cols; ++j) dy_dot_y += dy(t, j) * forward.act.y(t, j);
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
