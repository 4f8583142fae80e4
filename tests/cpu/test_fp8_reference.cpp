// The fp64 reference's E4M3 rounding and block quantization (docs/design.md, "FP8"): every code
// decodes and encodes back to itself, values between two codes round to the nearer (ties to the
// even code), magnitudes past 448 saturate, block scales are the powers of two that bring each
// block's largest value into (224, 448], and a block's values come back within half a code step.
// Then one expert's FP8 step against the exact one at the model shapes, its rows weighed inside
// the experts, and the layer with the FP8 experts (run_layer under fp8) against the exact layer.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "reference/reference.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;
using namespace moe::reference;

TEST_CASE("fp8 reference: every E4M3 code encodes back to itself", "[cpu][reference][fp8]") {
  for (int code = 0; code < 256; ++code) {
    INFO("code " << code);
    const double value = from_e4m3(static_cast<std::uint8_t>(code));
    if ((code & 0x7F) == 0x7F) {
      CHECK(std::isnan(value));
      continue;
    }
    CHECK(to_e4m3(static_cast<float>(value)) == code);
  }
  CHECK(from_e4m3(0x7E) == 448.0);
  CHECK(from_e4m3(0x01) == std::ldexp(1.0, -9));  // the smallest subnormal
  CHECK(from_e4m3(0x08) == std::ldexp(1.0, -6));  // the smallest normal
}

TEST_CASE("fp8 reference: rounding to nearest, ties to even, saturation", "[cpu][reference][fp8]") {
  // Between 1 (0x38) and 1.125 (0x39): the midpoint goes to the even code, 1.
  CHECK(to_e4m3(1.0625f) == 0x38);
  CHECK(to_e4m3(1.0626f) == 0x39);
  // Between 1.125 (0x39) and 1.25 (0x3A): the midpoint goes to 1.25.
  CHECK(to_e4m3(1.1875f) == 0x3A);
  // Subnormals: half the smallest rounds to zero (even), a little more to the smallest.
  CHECK(to_e4m3(std::ldexp(1.0f, -10)) == 0x00);
  CHECK(to_e4m3(std::ldexp(1.1f, -10)) == 0x01);
  CHECK(to_e4m3(-std::ldexp(1.0f, -9)) == 0x81);
  // Past the largest finite value: ±448, however large.
  CHECK(to_e4m3(449.0f) == 0x7E);
  CHECK(to_e4m3(1e30f) == 0x7E);
  CHECK(to_e4m3(-INFINITY) == 0xFE);
  CHECK(to_e4m3(NAN) == 0x7F);
  // Every value within half a step of its code: spacing 2^(e-3) at exponent e.
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<double> log_magnitude(-12.0, 8.7);
  for (int i = 0; i < 10000; ++i) {
    const auto value = static_cast<float>(std::exp2(log_magnitude(rng)));
    const double back = from_e4m3(to_e4m3(value));
    const double spacing =
        std::ldexp(1.0, std::max(std::ilogb(static_cast<double>(value)), -6) - 3);
    INFO("value " << value << " came back as " << back);
    CHECK(std::fabs(back - std::min<double>(value, 448.0)) <= 0.5 * spacing);
  }
}

TEST_CASE("fp8 reference: block scales and values", "[cpu][reference][fp8]") {
  Matrix x(130, 200);
  std::mt19937_64 rng(test::fresh_seed());
  std::normal_distribution<double> normal(0.0, 1.0);
  for (double& v : x.data) v = normal(rng);
  x = round_to(x, DType::kBF16);
  for (std::int64_t c = 128; c < 200; ++c) x(5, c) = 0.0;  // a row block of zeros: scale 1
  x(7, 3) = 1000.0;                                        // an outlier owns its block's scale

  const BlockQuantized rows = quantize_row_blocks(x);
  REQUIRE(rows.scales.size() == 130 * 2);
  CHECK(rows.scales[5 * 2 + 1] == 1.0f);
  // 1000 <= 448 · 2^2 = 1792 but not <= 448 · 2: the scale is 4, and 1000 / 4 = 250 is stored
  // as 256 (E4M3 spaces values 32 apart between 256 and 448, 16 between 128 and 256).
  CHECK(rows.scales[7 * 2 + 0] == 4.0f);
  CHECK(rows.codes[7 * 200 + 3] == to_e4m3(256.0f));
  CHECK(rows.value(7, 3) == 1024.0);
  const BlockQuantized tiles = quantize_tiles(x);
  REQUIRE(tiles.scales.size() == 2 * 2);
  CHECK(tiles.scales[0] == 4.0f);
  // Scales are powers of two that put each block's largest value in (224, 448].
  for (const BlockQuantized* q : {&rows, &tiles}) {
    for (const float scale : q->scales) {
      int exponent = 0;
      CHECK(std::frexp(scale, &exponent) == 0.5f);
    }
  }
  // Each value within half a code step of the block's scale, relative to its magnitude: E4M3
  // keeps 3 mantissa bits, so at most 2^-4 of the value above the subnormal range.
  for (const BlockQuantized* q : {&rows, &tiles}) {
    for (std::int64_t r = 0; r < x.rows; ++r) {
      for (std::int64_t c = 0; c < x.cols; ++c) {
        const double scale = q->scales[static_cast<std::size_t>((r / q->block_rows) * 2 + c / 128)];
        const double bound = std::max(std::fabs(x(r, c)) / 16.0, scale * std::ldexp(1.0, -10));
        if (std::fabs(q->value(r, c) - x(r, c)) > bound) FAIL("(" << r << ", " << c << ")");
      }
    }
  }
}

namespace {

// Relative Frobenius error of the FP8 expert's results against the exact expert's, and of the
// weight gradients as the recipe would form them in FP8 (fp8_weight_gradient) from the same
// step's operands.
struct Fp8Errors {
  double y, dX, dw13, dw2;
  double recipe_dw13, recipe_dw2;
};

Fp8Errors fp8_expert_errors(std::int64_t H, std::int64_t F, std::int64_t T, bool outliers,
                            std::mt19937_64& rng) {
  Matrix X = test::random_matrix(T, H, rng);
  if (outliers) {  // tokens 8 times larger or smaller, single values 30 times their row's
    std::uniform_int_distribution<int> pick(0, 9);
    std::uniform_int_distribution<std::int64_t> column(0, H - 1);
    for (std::int64_t t = 0; t < T; ++t) {
      const int kind = pick(rng);
      for (double& v : X.row(t)) v *= kind == 0 ? 8.0 : kind == 1 ? 0.125 : 1.0;
      if (kind == 2 || kind == 3) X(t, column(rng)) *= 30.0;
    }
  }
  X = round_to(X, DType::kBF16);
  ExpertWeights weights;
  weights.w13.push_back(
      round_to(test::random_matrix(H, 2 * F, rng, 1.0 / std::sqrt(H)), DType::kBF16));
  weights.w2.push_back(round_to(test::random_matrix(F, H, rng, 1.0 / std::sqrt(F)), DType::kBF16));
  const Matrix dy = round_to(test::random_matrix(T, H, rng), DType::kBF16);
  const std::array<std::int64_t, 2> offsets{0, T};
  const ExpertActivations exact = experts_forward(X, offsets, weights);
  const ExpertGrads grads = experts_backward(X, exact, dy, offsets, weights);
  const Fp8ExpertStep fp8 = fp8_expert_step(X, weights.w13[0], weights.w2[0], dy);
  return {test::relative_error(fp8.y, exact.y),
          test::relative_error(fp8.dX, grads.dX),
          test::relative_error(fp8.dw13, grads.dw13[0]),
          test::relative_error(fp8.dw2, grads.dw2[0]),
          test::relative_error(fp8_weight_gradient(X, fp8.dh), grads.dw13[0]),
          test::relative_error(fp8_weight_gradient(fp8.a, dy), grads.dw2[0])};
}

}  // namespace

// What FP8 costs at the model shapes (docs/design.md, "FP8", Accuracy): one expert's step with
// the GPU's quantization (bit-exact to these quantizers) against the exact step, at the model's H
// and F. mixtral-8x7b's expert (F = 14336) takes gigabytes in fp64 and runs with MOE_TEST_LONG=1.
TEST_CASE("fp8 reference: one expert's step at the model shapes stays within FP8's bound",
          "[cpu][reference][fp8]") {
  std::mt19937_64 rng(test::fresh_seed());
  struct Shape {
    const char* name;
    std::int64_t H, F;
  };
  std::vector<Shape> shapes = {{"qwen3-30b-a3b", 2048, 768}, {"deepseek-v3", 7168, 2048}};
  if (test::long_run()) shapes.push_back({"mixtral-8x7b", 4096, 14336});
  const std::int64_t T = test::by_run_size(4, 16, 64);
  for (const Shape& s : shapes) {
    for (const bool outliers : {false, true}) {
      const Fp8Errors e = fp8_expert_errors(s.H, s.F, T, outliers, rng);
      std::printf(
          "fp8 expert error: %s T=%lld%s: y %.4f dX %.4f dw13 %.4f dw2 %.4f (in FP8 as the "
          "recipe: dw13 %.4f dw2 %.4f)\n",
          s.name, static_cast<long long>(T), outliers ? " outliers" : "", e.y, e.dX, e.dw13, e.dw2,
          e.recipe_dw13, e.recipe_dw2);
      INFO(s.name << (outliers ? " with outliers" : ""));
      const double bound = outliers ? 0.15 : 0.1;
      CHECK(e.y <= bound);
      CHECK(e.dX <= bound);
      CHECK(e.dw13 <= bound);
      CHECK(e.dw2 <= bound);
      // FP8 weight gradients add their operands' rounding to what the step's FP8 products
      // changed upstream.
      CHECK(e.recipe_dw13 <= bound);
      CHECK(e.recipe_dw2 <= bound);
      CHECK(e.recipe_dw13 > e.dw13);
      CHECK(e.recipe_dw2 > e.dw2);
    }
  }
}

// The recipe's weight gradient quantizes along the tokens: values of at most four significant
// bits, whatever their column's scale, come through exactly; one large value spoils the small
// ones of its own 128 tokens in its column only.
TEST_CASE("fp8 reference: weight gradients quantized along the tokens", "[cpu][reference][fp8]") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t T = 300, m = 5, n = 3;  // three blocks of tokens, the last one short
  std::uniform_int_distribution<int> small(-15, 15);
  Matrix a(T, m), b(T, n);
  for (double& v : a.data) v = small(rng);
  for (double& v : b.data) v = std::ldexp(small(rng), -20);
  CHECK(fp8_weight_gradient(a, b).data == matmul_tn(a, b).data);
  // A value 2^20 times the others in token 5 of column 1: under that block's scale (2^16) the
  // small values of the column's first 128 tokens round to zero; its next blocks and the other
  // columns keep theirs.
  Matrix spoiled = a;
  spoiled(5, 1) = std::ldexp(15.0, 20);
  const Matrix got = fp8_weight_gradient(spoiled, b), exact = matmul_tn(spoiled, b);
  for (std::int64_t j = 0; j < n; ++j) {
    for (std::int64_t i = 0; i < m; ++i) {
      if (i == 1) continue;
      CHECK(got(i, j) == exact(i, j));
    }
    double kept = 0.0;  // column 1 as the quantization leaves it: token 5, then blocks 2 and 3
    for (std::int64_t t = 0; t < T; ++t)
      if (t == 5 || t >= 128) kept += spoiled(t, 1) * b(t, j);
    CHECK(got(1, j) == Approx(kept).margin(1e-9));
  }
  // The same along b's tokens: a value 2^20 times the others in token 200 of b's column 2 spoils
  // that column's second block (tokens 128 to 255).
  Matrix spoiled_b = b;
  spoiled_b(200, 2) = 15.0;
  const Matrix got_b = fp8_weight_gradient(a, spoiled_b), exact_b = matmul_tn(a, spoiled_b);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < 2; ++j) CHECK(got_b(i, j) == exact_b(i, j));
    double kept = 0.0;
    for (std::int64_t t = 0; t < T; ++t)
      if (t == 200 || t < 128 || t >= 256) kept += a(t, i) * spoiled_b(t, 2);
    CHECK(got_b(i, 2) == Approx(kept).margin(1e-9));
  }
  CHECK_THROWS_WITH(fp8_weight_gradient(Matrix(4, 2), Matrix(5, 2)),
                    test::contains_text("a [4,2] and b [5,2] hold different token counts"));
}

// The halves of the FP8 step that the layer runs apart, with rows weighed inside the experts.
// Weights that are powers of two commute with every rounding on the way (bf16's, and E4M3's,
// whose block scale takes the power), so the weighed step is the unweighed one scaled, bit for
// bit: what shows that the weight enters where the GPU applies it, before a is quantized, and
// multiplies dh. The weights' gradients are <dA, silu(h_gate) ⊙ h_up>, whatever the weights.
TEST_CASE("fp8 reference: rows weighed inside the FP8 experts", "[cpu][reference][fp8]") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t H = 256, F = 144, T = 24;
  const Matrix X = round_to(test::random_matrix(T, H, rng), DType::kBF16);
  const Matrix w13 = round_to(test::random_matrix(H, 2 * F, rng, 1.0 / 16), DType::kBF16);
  const Matrix w2 = round_to(test::random_matrix(F, H, rng, 1.0 / 12), DType::kBF16);
  const Matrix dY = round_to(test::random_matrix(T, H, rng), DType::kBF16);
  std::vector<double> weights(T);
  for (std::int64_t r = 0; r < T; ++r) weights[r] = std::ldexp(1.0, static_cast<int>(r % 5) - 3);
  const Fp8ExpertStep plain = fp8_expert_step(X, w13, w2, dY);
  const ExpertActivations forward = fp8_expert_forward(X, w13, w2, weights);
  const Fp8ExpertBackward backward = fp8_expert_backward(X, forward.h, w13, w2, dY, weights);
  CHECK(forward.h.data == plain.h.data);
  CHECK(backward.dA.data == plain.dA.data);  // dY reaches the experts unweighed
  const auto scaled_rows = [&](const Matrix& m) {
    Matrix s = m;
    for (std::int64_t r = 0; r < m.rows; ++r)
      for (double& v : s.row(r)) v *= weights[r];
    return s;
  };
  CHECK(forward.a.data == scaled_rows(plain.a).data);
  CHECK(forward.y.data == scaled_rows(plain.y).data);
  CHECK(backward.dh.data == scaled_rows(plain.dh).data);
  CHECK(backward.dX.data == scaled_rows(plain.dX).data);
  // dw13 = Xᵀ·dh and dw2 = aᵀ·dY over rows weighed alike: the unweighed ones with dh (or a) scaled.
  CHECK(backward.dw13.data == matmul_tn(X, scaled_rows(plain.dh)).data);
  CHECK(backward.dw2.data == matmul_tn(scaled_rows(plain.a), dY).data);
  REQUIRE(backward.row_weight_grads.size() == static_cast<std::size_t>(T));
  for (std::int64_t r = 0; r < T; ++r) {
    double dot = 0.0;
    for (std::int64_t f = 0; f < F; ++f) dot += plain.dA(r, f) * plain.a(r, f);
    // plain.a is rounded to bf16, the weight's gradient reads silu·up unrounded: 2^-9 of each term.
    double terms = 0.0;
    for (std::int64_t f = 0; f < F; ++f) terms += std::fabs(plain.dA(r, f) * plain.a(r, f));
    INFO("row " << r);
    CHECK(std::fabs(backward.row_weight_grads[r] - dot) <= std::ldexp(terms, -8));
  }
  CHECK(fp8_expert_backward(X, forward.h, w13, w2, dY).row_weight_grads.empty());
  CHECK_THROWS_WITH(fp8_expert_forward(X, w13, w2, std::span(weights).first(3)),
                    test::contains_text("3 row weights for 24 rows"));
}

namespace {

// The fp64 layer with fp8 off as the stages compose it, all experts at once (experts_forward and
// experts_backward, not the streamed path run_layer takes): out, dx, dlogits and the expert
// gradients, where dprob comes from the combine. Nothing rounded.
LayerResult composed_exact_layer(const MoEConfig& c, const Params& params, const Matrix& x,
                                 const Matrix& dy) {
  LayerResult r;
  r.logits = matmul_nt(x, params.gate_weight);
  r.routing = route(c, r.logits, params.expert_bias);
  const Layout layout = make_layout(r.routing, c.num_experts, c.align_size);
  const Matrix X = permute(x, layout, r.routing);
  const ExpertActivations act = experts_forward(X, layout.offsets, params.experts);
  r.out = unpermute_combine(act.y, layout, r.routing);
  const Matrix dY = combine_backward_rows(dy, layout, r.routing);
  r.expert_grads = experts_backward(X, act, dY, layout.offsets, params.experts);
  const std::vector<double> dprob = combine_backward_prob(dy, act.y, layout, r.routing);
  r.dlogits = route_backward(c, r.logits, r.routing, dprob);
  if (c.aux_loss_coeff > 0) aux_loss_backward(c, r.logits, aux_stats(c, r.logits), r.dlogits);
  if (c.z_loss_coeff > 0) z_loss_backward(c, r.logits, x.rows, r.dlogits);
  r.dx = permute_backward(r.expert_grads.dX, layout, r.routing);
  add_into(r.dx, matmul(r.dlogits, params.gate_weight));
  return r;
}

}  // namespace

// The layer under config.fp8 (run_layer with the routed experts as FP8 forms them) against the
// same layer with fp8 off: the router and the shared expert are untouched (bit for bit), the
// routed experts' results within FP8's bound (as tests/gpu/test_moe_block_fp8.cpp derives it),
// and the FP8 layer where the combine weighs the rows is fp8_expert_step expert by expert. With
// fp8 off the layer is what it was: the stages' exact composition, bit for bit.
TEST_CASE("fp8 reference: the layer with FP8 experts and with fp8 off", "[cpu][reference][fp8]") {
  std::mt19937_64 rng(test::fresh_seed());
  MoEConfig shared = test::fp8_config(128, 256, 8, 2);
  shared.shared_ffn_hidden = 64;
  for (const MoEConfig& c : {test::fp8_config(128, 128, 8, 2),
                             test::deepseek_like(test::fp8_config(256, 144, 8, 2)), shared}) {
    INFO(c.describe());
    c.validate();
    const Params params = test::round_params(test::random_params(c, rng), c.dtype);
    const std::int64_t T = 48;
    const Matrix x = round_to(test::random_matrix(T, c.hidden, rng), c.dtype);
    const Matrix dy = round_to(test::random_matrix(T, c.hidden, rng), c.dtype);
    MoEConfig exact_config = c;
    exact_config.fp8 = false;

    if (!c.shared_experts()) {
      const LayerResult exact = run_layer(exact_config, params, x, dy);
      const LayerResult composed = composed_exact_layer(exact_config, params, x, dy);
      CHECK(exact.out.data == composed.out.data);
      CHECK(exact.dx.data == composed.dx.data);
      CHECK(exact.dlogits.data == composed.dlogits.data);
      for (int e = 0; e < c.num_experts; ++e) {
        CHECK(exact.expert_grads.dw13[e].data == composed.expert_grads.dw13[e].data);
        CHECK(exact.expert_grads.dw2[e].data == composed.expert_grads.dw2[e].data);
      }
    }

    for (const auto dprob_from : {ProbabilityGradient::kCombine, ProbabilityGradient::kExperts}) {
      const bool in_experts = dprob_from == ProbabilityGradient::kExperts;
      INFO((in_experts ? "experts weigh their rows" : "the combine weighs the rows"));
      const LayerResult exact =
          run_layer(exact_config, params, x, dy, Intermediates::kAsStored, dprob_from);
      const LayerResult fp8 = run_layer(c, params, x, dy, Intermediates::kAsStored, dprob_from);
      CHECK(fp8.logits.data == exact.logits.data);
      CHECK(fp8.routing.expert == exact.routing.expert);
      CHECK(fp8.aux_loss == exact.aux_loss);
      if (c.shared_experts()) {
        CHECK(fp8.shared_grads.dw13.data == exact.shared_grads.dw13.data);
        CHECK(fp8.shared_grads.dw2.data == exact.shared_grads.dw2.data);
      }
      // The worst expert's weight gradients, each error against its expert's bound: FP8's 0.1
      // where several rows sum into the gradient, 0.2 for an expert of fewer than four rows,
      // whose dw2 is a row or two of dY ⊗ a and so carries one row's error of a whole (up to
      // about 0.11 seen at one row), unaveraged.
      double dw13 = 0, dw2 = 0;
      for (int e = 0; e < c.num_experts; ++e) {
        const auto rows = std::count(fp8.routing.expert.begin(), fp8.routing.expert.end(), e);
        const double bound = rows >= 4 ? 0.1 : 0.2;
        dw13 = std::max(
            dw13, 0.1 / bound *
                      test::relative_error(fp8.expert_grads.dw13[e], exact.expert_grads.dw13[e]));
        dw2 = std::max(
            dw2,
            0.1 / bound * test::relative_error(fp8.expert_grads.dw2[e], exact.expert_grads.dw2[e]));
      }
      const double out = test::relative_error(fp8.out, exact.out);
      const double dx = test::relative_error(fp8.dx, exact.dx);
      const double dgate = test::relative_error(fp8.d_gate_weight, exact.d_gate_weight);
      std::printf(
          "fp8 reference layer error: %s T=%lld%s: out %.4f dx %.4f dgate %.4f dw13 %.4f "
          "dw2 %.4f (weight gradients: the worst expert's, against 0.1 for its rows)\n",
          c.describe().c_str(), static_cast<long long>(T), in_experts ? " (experts weigh)" : "",
          out, dx, dgate, dw13, dw2);
      CHECK(out <= 0.1);
      CHECK(dx <= 0.1);
      CHECK(dw13 <= 0.1);
      CHECK(dw2 <= 0.1);

      if (in_experts || c.shared_experts()) continue;
      // Where the combine weighs the rows, each expert runs fp8_expert_step on its rows with
      // dY = p·dy in bf16, and the combine weighs y.
      const Layout layout = make_layout(fp8.routing, c.num_experts, c.align_size);
      const Matrix X = permute(x, layout, fp8.routing);
      const Matrix dY = round_to(combine_backward_rows(dy, layout, fp8.routing), DType::kBF16);
      std::vector<Matrix> ys;
      for (int e = 0; e < c.num_experts; ++e) {
        const std::int64_t begin = layout.offsets[e], end = layout.offsets[e + 1];
        Fp8ExpertStep step = fp8_expert_step(slice_rows(X, begin, end), params.experts.w13[e],
                                             params.experts.w2[e], slice_rows(dY, begin, end));
        INFO("expert " << e);
        if (begin < end) {
          CHECK(fp8.expert_grads.dw13[e].data == step.dw13.data);
          CHECK(fp8.expert_grads.dw2[e].data == step.dw2.data);
        }
        ys.push_back(std::move(step.y));
      }
      CHECK(fp8.out.data == unpermute_combine(concat_rows(ys), layout, fp8.routing).data);
    }
  }
  // (The mesh reference runs the FP8 experts too: test_mesh_reference holds it to this one.)
}

// fp8_dispatch's rows: what they round to is a fixed point of the rounding, and the FP8 products
// quantize it into the very values they would take from the unrounded rows (a block's largest
// value, in (224, 448] times its scale, rounds into [224, 448]: the scale stays, or halves when it
// lands on 224, and the codes double exactly). So the layer's out, dx and gate gradient do not
// move; only the weight gradients, which read the rows unquantized, do.
TEST_CASE("fp8 reference: rows rounded through FP8 on their way to the experts",
          "[cpu][reference][fp8]") {
  std::mt19937_64 rng(test::fresh_seed());
  // Rows of mixed magnitudes, and blocks whose largest value lies just above 224 times a power of
  // two, where the rounded block's scale halves.
  Matrix x = round_to(test::random_matrix(64, 384, rng), DType::kBF16);
  std::uniform_real_distribution<double> above(224.0, 232.0);
  for (std::int64_t r = 0; r < x.rows; r += 3)
    x(r, (r * 7) % x.cols) = above(rng) * std::ldexp(1.0, r % 9 - 12);
  for (std::int64_t r = 1; r < x.rows; r += 5)
    for (std::int64_t c = 0; c < 128; ++c) x(r, c) *= 1e-5;
  x = round_to(x, DType::kBF16);
  const Matrix rounded = round_rows_through_fp8(x);
  CHECK(rounded.data == round_to(rounded, DType::kBF16).data);
  CHECK(round_rows_through_fp8(rounded).data == rounded.data);
  CHECK(quantize_row_blocks(rounded).dequantized().data ==
        quantize_row_blocks(x).dequantized().data);
  CHECK(test::relative_error(rounded, x) <= 0.05);
  CHECK(test::relative_error(rounded, x) > 0.0);

  for (const MoEConfig& base :
       {test::fp8_config(128, 128, 8, 2), test::deepseek_like(test::fp8_config(256, 144, 8, 2))}) {
    MoEConfig dispatch = base;
    dispatch.fp8_dispatch = true;
    dispatch.validate();
    INFO(dispatch.describe());
    const Params params = test::round_params(test::random_params(base, rng), base.dtype);
    const Matrix xs = round_to(test::random_matrix(40, base.hidden, rng), base.dtype);
    const Matrix dy = round_to(test::random_matrix(40, base.hidden, rng), base.dtype);
    for (const auto dprob_from : {ProbabilityGradient::kCombine, ProbabilityGradient::kExperts}) {
      const LayerResult plain =
          run_layer(base, params, xs, dy, Intermediates::kAsStored, dprob_from);
      const LayerResult rows =
          run_layer(dispatch, params, xs, dy, Intermediates::kAsStored, dprob_from);
      CHECK(rows.out.data == plain.out.data);
      CHECK(rows.dx.data == plain.dx.data);
      CHECK(rows.d_gate_weight.data == plain.d_gate_weight.data);
      double moved = 0;
      for (int e = 0; e < base.num_experts; ++e) {
        moved = std::max(
            moved, test::relative_error(rows.expert_grads.dw13[e], plain.expert_grads.dw13[e]));
        CHECK(test::relative_error(rows.expert_grads.dw2[e], plain.expert_grads.dw2[e]) <= 0.1);
      }
      CHECK(moved > 0.0);
      CHECK(moved <= 0.1);
    }
  }
}
