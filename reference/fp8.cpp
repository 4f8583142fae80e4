#include <algorithm>
#include <cmath>
#include <utility>

#include "moe/error.h"
#include "reference/reference.h"

namespace moe::reference {
namespace {

constexpr double kE4M3Max = 448.0;
constexpr std::int64_t kBlock = 128;

// The least e with amax <= 448 · 2^e, in [-126, 127]; 0 for a block of zeros.
int scale_exponent(float amax) {
  if (amax == 0.0f) return 0;
  if (!std::isfinite(amax)) return 127;
  int e = -126;
  while (e < 127 && static_cast<double>(amax) > kE4M3Max * std::ldexp(1.0, e)) ++e;
  return e;
}

BlockQuantized quantize(const Matrix& x, std::int64_t block_rows) {
  BlockQuantized q;
  q.rows = x.rows;
  q.cols = x.cols;
  q.block_rows = block_rows;
  q.scale_cols = (x.cols + kBlock - 1) / kBlock;
  const std::int64_t scale_rows = (x.rows + block_rows - 1) / block_rows;
  q.codes.assign(static_cast<std::size_t>(x.rows * x.cols), 0);
  q.scales.assign(static_cast<std::size_t>(scale_rows * q.scale_cols), 0.0f);
  for (std::int64_t i = 0; i < scale_rows; ++i) {
    for (std::int64_t j = 0; j < q.scale_cols; ++j) {
      const std::int64_t r0 = i * block_rows, r1 = std::min(r0 + block_rows, x.rows);
      const std::int64_t c0 = j * kBlock, c1 = std::min(c0 + kBlock, x.cols);
      float amax = 0.0f;
      for (std::int64_t r = r0; r < r1; ++r)
        for (std::int64_t c = c0; c < c1; ++c)
          amax = std::max(amax, std::fabs(static_cast<float>(x(r, c))));
      const int exponent = scale_exponent(amax);
      q.scales[static_cast<std::size_t>(i * q.scale_cols + j)] = std::ldexp(1.0f, exponent);
      const float inverse_scale = std::ldexp(1.0f, -exponent);
      for (std::int64_t r = r0; r < r1; ++r)
        for (std::int64_t c = c0; c < c1; ++c)
          q.codes[static_cast<std::size_t>(r * x.cols + c)] =
              to_e4m3(static_cast<float>(x(r, c)) * inverse_scale);
    }
  }
  return q;
}

}  // namespace

std::uint8_t to_e4m3(float value) {
  if (std::isnan(value)) return 0x7F;
  const std::uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const double magnitude = std::fabs(static_cast<double>(value));
  if (magnitude >= kE4M3Max) return sign | 0x7E;  // 448 = 1.75 · 2^8, the largest finite value
  // E4M3 has 3 mantissa bits: values of exponent e lie 2^(e-3) apart; below the smallest normal
  // exponent (-6) the subnormals keep that spacing, 2^-9.
  const int exponent = magnitude > 0.0 ? std::max(std::ilogb(magnitude), -6) : -6;
  const double spacing = std::ldexp(1.0, exponent - 3);
  const double rounded = std::nearbyint(magnitude / spacing) * spacing;  // ties to even
  if (rounded < std::ldexp(1.0, -6)) return sign | static_cast<std::uint8_t>(rounded / spacing);
  const int e = std::ilogb(rounded);
  const auto mantissa = static_cast<std::uint8_t>((std::ldexp(rounded, -e) - 1.0) * 8.0);
  return sign | static_cast<std::uint8_t>((e + 7) << 3) | mantissa;
}

double from_e4m3(std::uint8_t code) {
  const int exponent = (code >> 3) & 0xF, mantissa = code & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::nan("");
  const double magnitude =
      exponent == 0 ? std::ldexp(mantissa, -9) : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  return (code & 0x80) != 0 ? -magnitude : magnitude;
}

double BlockQuantized::value(std::int64_t r, std::int64_t c) const {
  const float scale = scales[static_cast<std::size_t>((r / block_rows) * scale_cols + c / kBlock)];
  return from_e4m3(codes[static_cast<std::size_t>(r * cols + c)]) * static_cast<double>(scale);
}

Matrix BlockQuantized::dequantized() const {
  Matrix m(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) m(r, c) = value(r, c);
  return m;
}

BlockQuantized quantize_row_blocks(const Matrix& x) {
  return quantize(x, 1);
}

BlockQuantized quantize_tiles(const Matrix& x) {
  return quantize(x, kBlock);
}

Matrix round_rows_through_fp8(const Matrix& x) {
  return round_to(quantize_row_blocks(x).dequantized(), DType::kBF16);
}

namespace {

// rows · tilesᵀ with both operands quantized and dequantized, rounded to bf16 as stored.
Matrix fp8_product(const Matrix& rows, const Matrix& tiles) {
  return round_to(
      matmul_nt(quantize_row_blocks(rows).dequantized(), quantize_tiles(tiles).dequantized()),
      DType::kBF16);
}

void check_expert_shapes(const char* call, const Matrix& X, const Matrix& w13, const Matrix& w2,
                         std::span<const double> row_weights) {
  const std::int64_t F = w2.rows;
  if (w13.rows != X.cols || w13.cols != 2 * F || w2.cols != X.cols) {
    fail("{}: X [{},{}], w13 [{},{}], w2 [{},{}] do not fit", call, X.rows, X.cols, w13.rows,
         w13.cols, w2.rows, w2.cols);
  }
  if (!row_weights.empty() && std::ssize(row_weights) != X.rows)
    fail("{}: {} row weights for {} rows", call, row_weights.size(), X.rows);
}

// a = silu(h_gate) ⊙ h_up, weighed by its row's weight where there are weights (before the
// rounding, as the GPU's SwiGLU weighs it), in bf16 as stored.
Matrix stored_swiglu(const Matrix& h, std::span<const double> row_weights) {
  const std::int64_t F = h.cols / 2;
  Matrix a(h.rows, F);
  for (std::int64_t r = 0; r < h.rows; ++r) {
    for (std::int64_t f = 0; f < F; ++f) {
      a(r, f) = silu(h(r, f)) * h(r, F + f);
      if (!row_weights.empty()) a(r, f) *= row_weights[static_cast<std::size_t>(r)];
    }
  }
  return round_to(a, DType::kBF16);
}

}  // namespace

ExpertActivations fp8_expert_forward(const Matrix& X, const Matrix& w13, const Matrix& w2,
                                     std::span<const double> row_weights) {
  check_expert_shapes("fp8_expert_forward", X, w13, w2, row_weights);
  ExpertActivations act;
  act.h = fp8_product(X, transpose(w13));  // the weight as the layer holds it, [2F, H]
  act.a = stored_swiglu(act.h, row_weights);
  act.y = fp8_product(act.a, transpose(w2));  // [H, F]
  return act;
}

Fp8ExpertBackward fp8_expert_backward(const Matrix& X, const Matrix& h, const Matrix& w13,
                                      const Matrix& w2, const Matrix& dY,
                                      std::span<const double> row_weights) {
  check_expert_shapes("fp8_expert_backward", X, w13, w2, row_weights);
  const std::int64_t F = w2.rows;
  if (h.rows != X.rows || h.cols != 2 * F || dY.rows != X.rows || dY.cols != X.cols) {
    fail("fp8_expert_backward: X [{},{}], h [{},{}], dY [{},{}] do not fit", X.rows, X.cols, h.rows,
         h.cols, dY.rows, dY.cols);
  }
  const bool weighed = !row_weights.empty();
  Fp8ExpertBackward b;
  b.dA = fp8_product(dY, w2);  // dY · w2ᵀᵀ: the transpose [F, H] in tiles
  b.dh = Matrix(X.rows, 2 * F);
  if (weighed) b.row_weight_grads.assign(static_cast<std::size_t>(X.rows), 0.0);
  for (std::int64_t r = 0; r < X.rows; ++r) {
    const double weight = weighed ? row_weights[static_cast<std::size_t>(r)] : 1.0;
    for (std::int64_t f = 0; f < F; ++f) {
      const double gate = h(r, f), up = h(r, F + f), sigma = 1.0 / (1.0 + std::exp(-gate));
      // The weighed a's gradient is the weight times dA, and the weight's own is <dA, silu ⊙ up>.
      const double grad = weight * b.dA(r, f);
      b.dh(r, f) = grad * up * sigma * (1.0 + gate * (1.0 - sigma));
      b.dh(r, F + f) = grad * gate * sigma;
      if (weighed) b.row_weight_grads[static_cast<std::size_t>(r)] += b.dA(r, f) * silu(gate) * up;
    }
  }
  b.dh = round_to(b.dh, DType::kBF16);
  b.dX = fp8_product(b.dh, w13);  // dh · w13ᵀ with w13 [H, 2F] the transpose in tiles
  // The weight gradients from the bf16 values the GPU's products read: a formed again from h, as
  // the GPU's SwiGLU backward forms it.
  b.dw13 = matmul_tn(X, b.dh);
  b.dw2 = matmul_tn(stored_swiglu(h, row_weights), dY);
  return b;
}

Matrix fp8_weight_gradient(const Matrix& a, const Matrix& b) {
  if (a.rows != b.rows)
    fail("fp8_weight_gradient: a [{},{}] and b [{},{}] hold different token counts", a.rows, a.cols,
         b.rows, b.cols);
  // A column's blocks along the tokens are the transpose's row blocks.
  return matmul_nt(quantize_row_blocks(transpose(a)).dequantized(),
                   quantize_row_blocks(transpose(b)).dequantized());
}

Fp8ExpertStep fp8_expert_step(const Matrix& X, const Matrix& w13, const Matrix& w2,
                              const Matrix& dy) {
  if (dy.rows != X.rows || dy.cols != X.cols)
    fail("fp8_expert_step: X [{},{}] and dy [{},{}] do not fit", X.rows, X.cols, dy.rows, dy.cols);
  ExpertActivations forward = fp8_expert_forward(X, w13, w2);
  Fp8ExpertBackward backward = fp8_expert_backward(X, forward.h, w13, w2, dy);
  return {std::move(forward.h),     std::move(forward.a),   std::move(forward.y),
          std::move(backward.dA),   std::move(backward.dh), std::move(backward.dX),
          std::move(backward.dw13), std::move(backward.dw2)};
}

}  // namespace moe::reference
