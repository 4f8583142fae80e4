// Forward step 5 of docs/design.md in fp64: SwiGLU experts over the padded expert-major
// rows, and their backward.
#include <cmath>

#include "moe/error.h"
#include "reference/reference.h"
#include "stages.h"

namespace moe::reference {
namespace {
double sigmoid(double v) {
  return 1.0 / (1.0 + std::exp(-v));
}
}  // namespace

double silu(double v) {
  return v * sigmoid(v);
}

ExpertActivations experts_forward(const Matrix& X, std::span<const std::int64_t> offsets,
                                  const ExpertWeights& weights, Intermediates intermediates,
                                  DType dtype) {
  const auto stored = [&](Matrix m) {
    return intermediates == Intermediates::kAsStored ? round_to(m, dtype) : m;
  };
  const std::size_t experts = offsets.size() - 1;
  if (weights.w13.size() != experts || weights.w2.size() != experts) {
    fail("experts_forward: {} row groups, {} / {} weight matrices", experts, weights.w13.size(),
         weights.w2.size());
  }
  if (offsets.back() != X.rows)
    fail("experts_forward: offsets end at {}, X has {} rows", offsets.back(), X.rows);
  ExpertActivations parts;
  std::vector<Matrix> hs, as, ys;
  for (std::size_t e = 0; e < experts; ++e) {
    const Matrix Xe = slice_rows(X, offsets[e], offsets[e + 1]);
    const Matrix h = stored(matmul(Xe, weights.w13[e]));
    const std::int64_t F = h.cols / 2;
    Matrix a(h.rows, F);
    for (std::int64_t r = 0; r < h.rows; ++r) {
      for (std::int64_t j = 0; j < F; ++j) a(r, j) = silu(h(r, j)) * h(r, F + j);
    }
    a = stored(std::move(a));
    ys.push_back(stored(matmul(a, weights.w2[e])));
    hs.push_back(h);
    as.push_back(std::move(a));
  }
  const std::int64_t H = weights.w2.empty() ? X.cols : weights.w2.front().cols;
  const std::int64_t F = weights.w2.empty() ? 0 : weights.w2.front().rows;
  parts.h = hs.empty() ? Matrix(0, 2 * F) : concat_rows(hs);
  parts.a = as.empty() ? Matrix(0, F) : concat_rows(as);
  parts.y = ys.empty() ? Matrix(0, H) : concat_rows(ys);
  return parts;
}

ExpertGrads experts_backward(const Matrix& X, const ExpertActivations& act, const Matrix& dY,
                             std::span<const std::int64_t> offsets, const ExpertWeights& weights) {
  const std::size_t experts = offsets.size() - 1;
  ExpertGrads grads;
  std::vector<Matrix> dXs;
  for (std::size_t e = 0; e < experts; ++e) {
    const auto begin = offsets[e];
    const auto end = offsets[e + 1];
    const Matrix Xe = slice_rows(X, begin, end);
    const Matrix he = slice_rows(act.h, begin, end);
    const Matrix ae = slice_rows(act.a, begin, end);
    const Matrix dYe = slice_rows(dY, begin, end);

    const Matrix dA = matmul_nt(dYe, weights.w2[e]);  // dY · W2ᵀ
    grads.dw2.push_back(matmul_tn(ae, dYe));          // Aᵀ · dY
    const std::int64_t F = dA.cols;
    Matrix dh(he.rows, 2 * F);
    for (std::int64_t r = 0; r < he.rows; ++r) {
      for (std::int64_t j = 0; j < F; ++j) {
        const double gate = he(r, j);
        const double up = he(r, F + j);
        const double s = sigmoid(gate);
        dh(r, j) =
            dA(r, j) * up * s * (1.0 + gate * (1.0 - s));  // silu'(g) = σ(g)(1 + g(1 − σ(g)))
        dh(r, F + j) = dA(r, j) * gate * s;                // silu(g)
      }
    }
    dXs.push_back(matmul_nt(dh, weights.w13[e]));  // dh · W13ᵀ
    grads.dw13.push_back(matmul_tn(Xe, dh));       // Xᵀ · dh
  }
  grads.dX = dXs.empty() ? Matrix(0, X.cols) : concat_rows(dXs);
  return grads;
}

double expert_prob_grad(const Matrix& dy, std::int64_t token, const Matrix& h, std::int64_t row,
                        const Matrix& w2, Intermediates intermediates, DType dtype) {
  const std::int64_t F = h.cols / 2;
  Matrix dA(1, F);  // dy[t]·w2ᵀ, the product's output
  for (std::int64_t j = 0; j < F; ++j) {
    for (std::int64_t i = 0; i < dy.cols; ++i) dA(0, j) += dy(token, i) * w2(j, i);
  }
  if (intermediates == Intermediates::kAsStored) dA = round_to(dA, dtype);
  double dot = 0.0;
  for (std::int64_t j = 0; j < F; ++j) dot += dA(0, j) * silu(h(row, j)) * h(row, F + j);
  return dot;
}

double expert_prob_grad_magnitude(const Matrix& dy, std::int64_t token, const Matrix& X,
                                  std::int64_t row, const Matrix& h, const Matrix& w13,
                                  const Matrix& w2) {
  const std::int64_t F = w2.rows, H = w2.cols;
  double magnitude = 0.0;
  for (std::int64_t f = 0; f < F; ++f) {
    // The sum over H: dA = dy·w2ᵀ and y = a·w2 share their terms |dy·w2|·|a|. An error δa of a
    // (from h's two sums over H, through silu's and the up half's derivatives) moves dprob by
    // δa·dA on either path, to first order.
    double dA = 0.0, dA_terms = 0.0, gate_terms = 0.0, up_terms = 0.0;
    for (std::int64_t i = 0; i < H; ++i) {
      dA += dy(token, i) * w2(f, i);
      dA_terms += std::fabs(dy(token, i) * w2(f, i));
      gate_terms += std::fabs(X(row, i) * w13(i, f));
      up_terms += std::fabs(X(row, i) * w13(i, F + f));
    }
    const double gate = h(row, f), up = h(row, F + f);
    const double s = sigmoid(gate);
    const double dsilu = s * (1.0 + gate * (1.0 - s));
    magnitude +=
        dA_terms * std::fabs(silu(gate) * up) +
        std::fabs(dA) * (std::fabs(dsilu * up) * gate_terms + std::fabs(silu(gate)) * up_terms);
  }
  return magnitude;
}

std::vector<double> experts_prob_grads(const Matrix& dy, const ExpertActivations& act,
                                       const Layout& layout, const Routing& routing,
                                       const ExpertWeights& weights, Intermediates intermediates,
                                       DType dtype) {
  const std::int64_t F = act.h.cols / 2;
  if (dy.rows != routing.tokens)
    fail("experts_prob_grads: dy has {} rows for {} routed tokens", dy.rows, routing.tokens);
  if (act.h.rows != layout.rows() || layout.row.size() != routing.expert.size())
    fail("experts_prob_grads: h has {} rows, the layout {} ({} slots for {} routed)", act.h.rows,
         layout.rows(), layout.row.size(), routing.expert.size());
  for (const int e : routing.expert) {
    if (e < 0 || static_cast<std::size_t>(e) >= weights.w2.size())
      fail("experts_prob_grads: routed expert {} outside the {} w2 matrices", e, weights.w2.size());
    const Matrix& w2 = weights.w2[static_cast<std::size_t>(e)];
    if (w2.rows != F || w2.cols != dy.cols)
      fail("experts_prob_grads: w2 of expert {} is [{},{}], expected [{},{}]", e, w2.rows, w2.cols,
           F, dy.cols);
  }
  std::vector<double> dprob(routing.expert.size(), 0.0);
  for (std::int64_t t = 0; t < routing.tokens; ++t) {
    for (int k = 0; k < routing.topk; ++k) {
      const std::int64_t row = layout.row_of(t, k, routing.topk);
      if (row == Layout::kDroppedRow) continue;  // a dropped slot's dp is 0
      const Matrix& w2 = weights.w2[static_cast<std::size_t>(routing.expert_of(t, k))];
      dprob[t * routing.topk + k] = expert_prob_grad(dy, t, act.h, row, w2, intermediates, dtype);
    }
  }
  return dprob;
}

}  // namespace moe::reference
