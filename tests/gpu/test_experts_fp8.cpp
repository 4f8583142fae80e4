// The experts in FP8 (kernels/experts_fp8.h) against the fp64 products of the dequantized
// operands, quantized by the reference (reference::quantize_row_blocks / quantize_tiles): h, a, y
// forward; dA, dh, the row weights' gradient, dX and the weight gradients backward; at shapes
// with partial blocks and tiles, empty experts, rows weighed inside the experts, and dh and dA
// over h and a; outputs poisoned before each run; the products as cuBLASLt runs them, one expert a
// call, and as the grouped products (kernels/grouped_fp8_gemm.cuh) run them in one launch; and
// spans of experts in turn, and dX handed on before dw13, bit for bit as one call.
//
// The bound, from the arithmetic: the products' inputs are the dequantized values exactly (the
// quantizers are bit-exact against the reference, tests/gpu/test_fp8_quantize.cpp), so what
// differs is the accumulation and the output's rounding. Rounding to bf16 costs at most 2^-9 of
// the value. Hopper's FP8 tensor cores keep about 14 bits when they add one instruction's
// products (32 along K) into the accumulator (DeepSeek-V3 measured this): each product may lose
// up to 2^-13 of the largest term, so an instruction's sum up to 32 · 2^-13 = 2^-8 of its
// Σ|a·b|; cuBLASLt adds the instructions' sums, and the 128-column blocks' scaled sums, in fp32.
// So |got − exact| <= 2^-9·|exact| + 2^-8·Σ|a·b| under that model (the accumulator realigned per
// instruction; realigned across a block's four instructions the worst case is a few times
// larger). Seen on H100: up to about 2^-10·Σ|a·b|.
// Scales read from the wrong place give errors of 2^-4 to 2^-2 of Σ|a·b| (bench_fp8_gemm's other
// layouts), well outside.
#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

#include "kernels/experts_fp8.h"
#include "kernels/grouped_fp8_gemm.cuh"
#include "reference/reference.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;
using reference::transpose;

namespace {

Matrix download_bf16(const DeviceBuffer& b, std::int64_t rows, std::int64_t cols) {
  Matrix m(rows, cols);
  const auto v = test::download<BF16>(b, m.data.size());
  for (std::size_t i = 0; i < v.size(); ++i) m.data[i] = from_bf16(v[i]);
  return m;
}

// Checks got (rows [first, first + n) of a product) against deq(a)·deq(b)ᵀ.
std::int64_t count_outside_bound(const Matrix& got, std::int64_t first,
                                 const reference::BlockQuantized& a,
                                 const reference::BlockQuantized& b, double& worst) {
  std::int64_t outside = 0;
  const Matrix da = a.dequantized(), db = b.dequantized();
  for (std::int64_t i = 0; i < da.rows; ++i) {
    for (std::int64_t j = 0; j < db.rows; ++j) {
      double exact = 0, magnitude = 0;
      for (std::int64_t k = 0; k < da.cols; ++k) {
        exact += da(i, k) * db(j, k);
        magnitude += std::fabs(da(i, k) * db(j, k));
      }
      const double error = std::fabs(got(first + i, j) - exact);
      const double bound = std::ldexp(std::fabs(exact), -9) + std::ldexp(magnitude, -8) + 1e-30;
      worst = std::max(worst, error / bound);
      if (error > bound) ++outside;
    }
  }
  return outside;
}

struct Case {
  int hidden, ffn;
  std::vector<std::int64_t> rows;  // per expert, multiples of 16
  bool weighed;
  bool in_place = false;  // dh over h and dA over a, as MoEBlock runs the experts
  std::string describe() const {
    std::ostringstream s;
    s << "H=" << hidden << " F=" << ffn << " rows";
    for (auto r : rows) s << " " << r;
    s << (weighed ? " weighed" : "") << (in_place ? " in place" : "");
    return s.str();
  }
};

Matrix absolute(const Matrix& m) {
  Matrix out = m;
  for (double& v : out.data) v = std::fabs(v);
  return out;
}

// A weight gradient (fp32) against Aᵀ·B of the bf16 values it was formed from: the products are
// exact in fp32, and summing m of them in fp32 errs by at most (m − 1) · 2^-23 of Σ|a·b| even
// where the tensor cores' adder truncates instead of rounding: under 2^-15 for the m <= 160 rows
// here.
std::int64_t count_wgrad_outside(const std::vector<float>& got, std::size_t at, const Matrix& a,
                                 const Matrix& b) {
  const Matrix exact = reference::matmul_tn(a, b);
  const Matrix magnitude = reference::matmul_tn(absolute(a), absolute(b));
  std::int64_t outside = 0;
  for (std::size_t i = 0; i < exact.data.size(); ++i) {
    const double bound = std::ldexp(magnitude.data[i], -15) + 1e-30;
    if (std::fabs(got[at + i] - exact.data[i]) > bound) ++outside;
  }
  return outside;
}

void check_case(const Case& c, Fp8Products products, std::mt19937_64& rng) {
  INFO(c.describe());
  const int E = static_cast<int>(c.rows.size());
  const std::int64_t H = c.hidden, F = c.ffn;
  std::vector<std::int64_t> offsets{0};
  for (auto r : c.rows) offsets.push_back(offsets.back() + r);
  const std::int64_t rows = offsets.back();

  const Matrix X = round_to(test::random_matrix(rows, H, rng, 1.0), DType::kBF16);
  std::vector<Matrix> w13, w2;  // nn.Linear layout: [2F, H] and [H, F]
  for (int e = 0; e < E; ++e) {
    w13.push_back(round_to(test::random_matrix(2 * F, H, rng, 1.0 / std::sqrt(H)), DType::kBF16));
    w2.push_back(round_to(test::random_matrix(H, F, rng, 1.0 / std::sqrt(F)), DType::kBF16));
  }
  std::vector<float> weights(static_cast<std::size_t>(rows));
  std::uniform_real_distribution<float> probability(0.05f, 1.0f);
  for (float& w : weights) w = probability(rng);

  const DeviceBuffer X_dev = test::upload_as(X, DType::kBF16);
  const DeviceBuffer w13_dev = test::upload_as(reference::concat_rows(w13), DType::kBF16);
  const DeviceBuffer w2_dev = test::upload_as(reference::concat_rows(w2), DType::kBF16);
  const DeviceBuffer weights_dev = test::upload(weights);
  DeviceBuffer h(static_cast<std::size_t>(rows * 2 * F) * 2 + 16),
      a(static_cast<std::size_t>(rows * F) * 2 + 16),
      y(static_cast<std::size_t>(rows * H) * 2 + 16);
  for (const auto* b : {&h, &a, &y}) test::poison(*b);

  Stream stream;
  Fp8ExpertFFN ffn(c.hidden, c.ffn, E, 3, kDefaultGemmWorkspaceBytes, products);
  ffn.quantize_weights(Tensor(w13_dev.data(), DType::kBF16, {E, 2 * F, H}),
                       Tensor(w2_dev.data(), DType::kBF16, {E, H, F}), stream.get());
  ExpertActivations act;
  act.h = Tensor(h.data(), DType::kBF16, {rows, 2 * F});
  act.a = Tensor(a.data(), DType::kBF16, {rows, F});
  if (c.weighed) act.scale = Tensor(weights_dev.data(), DType::kFP32, {rows});
  ffn.forward(Tensor(X_dev.data(), DType::kBF16, {rows, H}), offsets, act,
              Tensor(y.data(), DType::kBF16, {rows, H}), stream.get());
  stream.synchronize();

  const Matrix got_h = download_bf16(h, rows, 2 * F), got_a = download_bf16(a, rows, F),
               got_y = download_bf16(y, rows, H);
  double worst_h = 0, worst_y = 0;
  std::int64_t outside_h = 0, outside_y = 0, wrong_a = 0;
  for (int e = 0; e < E; ++e) {
    const std::int64_t first = offsets[e], n = offsets[e + 1] - first;
    if (n == 0) continue;
    const auto w13q = reference::quantize_tiles(w13[e]), w2q = reference::quantize_tiles(w2[e]);
    const auto Xq = reference::quantize_row_blocks(reference::slice_rows(X, first, first + n));
    outside_h += count_outside_bound(got_h, first, Xq, w13q, worst_h);
    // a from the GPU's h: silu(gate) · up · weight, rounded to bf16 once.
    for (std::int64_t r = first; r < first + n; ++r) {
      for (std::int64_t f = 0; f < F; ++f) {
        const double weight = c.weighed ? weights[static_cast<std::size_t>(r)] : 1.0;
        const double want = reference::silu(got_h(r, f)) * got_h(r, F + f) * weight;
        if (std::fabs(got_a(r, f) - want) > std::ldexp(std::fabs(want), -8) + 1e-30) ++wrong_a;
      }
    }
    const auto aq = reference::quantize_row_blocks(reference::slice_rows(got_a, first, first + n));
    outside_y += count_outside_bound(got_y, first, aq, w2q, worst_y);
  }
  INFO("worst error over its bound: h " << worst_h << ", y " << worst_y);
  CHECK(outside_h == 0);
  CHECK(wrong_a == 0);
  CHECK(outside_y == 0);

  // Backward: dA and dX in FP8 against the dequantized operands (the weights' transposes
  // quantized by the reference), dh and the row weights' gradient from the GPU's dA and h, the
  // weight gradients (fp32) from the GPU's dY, a, dh and X.
  const Matrix dY = round_to(test::random_matrix(rows, H, rng, 1.0), DType::kBF16);
  const DeviceBuffer dY_dev = test::upload_as(dY, DType::kBF16);
  DeviceBuffer dA_own(static_cast<std::size_t>(rows * F) * 2 + 16),
      dh_own(static_cast<std::size_t>(rows * 2 * F) * 2 + 16),
      dX(static_cast<std::size_t>(rows * H) * 2 + 16),
      dscale(static_cast<std::size_t>(rows) * 4 + 16),
      dw13(static_cast<std::size_t>(E * 2 * F * H) * 4 + 16),
      dw2(static_cast<std::size_t>(E * H * F) * 4 + 16);
  for (const auto* b : {&dA_own, &dh_own, &dX, &dscale, &dw13, &dw2}) test::poison(*b);
  const DeviceBuffer& dA_buffer = c.in_place ? a : dA_own;
  const DeviceBuffer& dh_buffer = c.in_place ? h : dh_own;
  act.dA = Tensor(dA_buffer.data(), DType::kBF16, {rows, F});
  act.dh = Tensor(dh_buffer.data(), DType::kBF16, {rows, 2 * F});
  if (c.weighed) act.dscale = Tensor(dscale.data(), DType::kFP32, {rows});
  ffn.backward(Tensor(dY_dev.data(), DType::kBF16, {rows, H}),
               Tensor(X_dev.data(), DType::kBF16, {rows, H}), offsets, act,
               Tensor(dX.data(), DType::kBF16, {rows, H}),
               Tensor(dw13.data(), DType::kFP32, {E, 2 * F, H}),
               Tensor(dw2.data(), DType::kFP32, {E, H, F}), stream.get());
  stream.synchronize();
  const Matrix got_dh = download_bf16(dh_buffer, rows, 2 * F), got_dX = download_bf16(dX, rows, H),
               got_a2 = download_bf16(a, rows, F);
  const auto got_dw13 = test::download<float>(dw13, static_cast<std::size_t>(E * 2 * F * H));
  const auto got_dw2 = test::download<float>(dw2, static_cast<std::size_t>(E * H * F));
  const auto got_dscale = test::download<float>(dscale, static_cast<std::size_t>(rows));
  double worst_dA = 0, worst_dX = 0;
  std::int64_t outside_dA = 0, outside_dX = 0, wrong_dh = 0, wrong_dscale = 0, outside_dw = 0;
  for (int e = 0; e < E; ++e) {
    const std::int64_t first = offsets[e], n = offsets[e + 1] - first;
    const auto w13_at = static_cast<std::size_t>(e * 2 * F * H);
    const auto w2_at = static_cast<std::size_t>(e * H * F);
    if (n == 0) {  // no rows: zero gradients
      for (std::size_t i = 0; i < static_cast<std::size_t>(2 * F * H); ++i)
        outside_dw += got_dw13[w13_at + i] != 0.0f;
      for (std::size_t i = 0; i < static_cast<std::size_t>(H * F); ++i)
        outside_dw += got_dw2[w2_at + i] != 0.0f;
      continue;
    }
    const auto dYq = reference::quantize_row_blocks(reference::slice_rows(dY, first, first + n));
    if (!c.in_place) {
      const Matrix got_dA = download_bf16(dA_own, rows, F);
      outside_dA += count_outside_bound(got_dA, first, dYq,
                                        reference::quantize_tiles(transpose(w2[e])), worst_dA);
      // dh = weight · dA · (up · silu'(gate), silu(gate)), rounded once; dscale = Σ dA·a/weight.
      for (std::int64_t r = first; r < first + n; ++r) {
        const double weight = c.weighed ? weights[static_cast<std::size_t>(r)] : 1.0;
        double dot = 0, dot_magnitude = 0;
        for (std::int64_t f = 0; f < F; ++f) {
          const double g = got_h(r, f), u = got_h(r, F + f), da = got_dA(r, f);
          const double sigmoid = 1.0 / (1.0 + std::exp(-g));
          const double dsilu = sigmoid * (1.0 + g * (1.0 - sigmoid));
          const double want_gate = weight * da * u * dsilu, want_up = weight * da * g * sigmoid;
          // Rounded to bf16 (2^-9) from fp32 math; silu' cancels near g = -1.28, where fp32's
          // error (a few 2^-24 of the terms) outweighs the value.
          const double terms = std::fabs(weight * da * u) * (1.0 + std::fabs(g));
          wrong_dh += std::fabs(got_dh(r, f) - want_gate) >
                      std::ldexp(std::fabs(want_gate), -8) + std::ldexp(terms, -20) + 1e-30;
          wrong_dh +=
              std::fabs(got_dh(r, F + f) - want_up) > std::ldexp(std::fabs(want_up), -8) + 1e-30;
          dot += da * g * sigmoid * u;
          dot_magnitude += std::fabs(da * g * sigmoid * u);
        }
        if (c.weighed) {
          const double error = std::fabs(got_dscale[static_cast<std::size_t>(r)] - dot);
          wrong_dscale += error > std::ldexp(dot_magnitude, -16) + 1e-30;
        }
      }
    }
    const auto dhq =
        reference::quantize_row_blocks(reference::slice_rows(got_dh, first, first + n));
    outside_dX += count_outside_bound(got_dX, first, dhq,
                                      reference::quantize_tiles(transpose(w13[e])), worst_dX);
    const Matrix dY_e = reference::slice_rows(dY, first, first + n);
    outside_dw +=
        count_wgrad_outside(got_dw2, w2_at, dY_e, reference::slice_rows(got_a2, first, first + n));
    outside_dw +=
        count_wgrad_outside(got_dw13, w13_at, reference::slice_rows(got_dh, first, first + n),
                            reference::slice_rows(X, first, first + n));
  }
  INFO("worst error over its bound: dA " << worst_dA << ", dX " << worst_dX);
  CHECK(outside_dA == 0);
  CHECK(wrong_dh == 0);
  CHECK(wrong_dscale == 0);
  CHECK(outside_dX == 0);
  CHECK(outside_dw == 0);
}

}  // namespace

TEST_CASE("fp8 experts: forward and backward equal the products of the dequantized operands",
          "[gpu][fp8][experts]") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<Case> cases = {
      {128, 256, {32, 0, 48}, false},         // whole tiles: the weights in one launch
      {208, 144, {16, 64, 0, 32, 16}, true},  // partial blocks and tiles, one launch an expert
      {256, 128, {160, 16}, true},            // an expert over more than one row tile
      {64, 48, {16}, false},                  // smaller than one block
      {208, 144, {48, 0, 32}, true, true},    // dh over h and dA over a
  };
  int device = 0;
  MOE_CHECK_CUDA(cudaGetDevice(&device));
  for (const Fp8Products products : {Fp8Products::kPerExpert, Fp8Products::kGrouped}) {
    if (products == Fp8Products::kGrouped && !grouped_fp8_gemm_supported(device)) {
      WARN("the grouped FP8 products need compute capability 9.0 and a build for sm_90a");
      continue;
    }
    INFO((products == Fp8Products::kGrouped ? "grouped products" : "cuBLASLt, one expert a call"));
    for (const Case& c : cases) check_case(c, products, rng);
  }
  // The default picks by the size of an expert's products: grouped below kGroupedMacsLimit
  // multiply-adds a forward on average, per expert at or above it (an expert without rows counts
  // for neither).
  INFO("Fp8Products::kAuto");
  {
    const Fp8ExpertFFN ffn(128, 64, 3);
    const std::int64_t limit = ffn.grouped_rows_limit();
    CHECK(limit == static_cast<std::int64_t>(std::ceil(kGroupedMacsLimit / (3.0 * 128 * 64))));
    CHECK(Fp8ExpertFFN(2048, 768, 3).grouped_rows_limit() == 1484);  // qwen3-30b-a3b's shape
    CHECK(Fp8ExpertFFN(7168, 2048, 3).grouped_rows_limit() == 159);  // deepseek-v3's
    const bool grouped = grouped_fp8_gemm_supported(device);
    CHECK(ffn.grouped_pass(std::vector<std::int64_t>{0, 48, 48, 64}) == grouped);
    CHECK(ffn.grouped_pass(std::vector<std::int64_t>{0, limit - 16, limit - 16, 2 * limit - 16}) ==
          grouped);
    CHECK_FALSE(ffn.grouped_pass(std::vector<std::int64_t>{0, limit, limit, 2 * limit}));
    CHECK_FALSE(ffn.grouped_pass(std::vector<std::int64_t>{0, 0, 0, limit}));
    CHECK_THROWS_WITH(ffn.grouped_pass(std::vector<std::int64_t>{0, 16}),
                      test::contains_text("2 offsets for 3 experts"));
    CHECK(Fp8ExpertFFN(128, 64, 3, 4, kDefaultGemmWorkspaceBytes, Fp8Products::kPerExpert)
              .grouped_pass(std::vector<std::int64_t>{0, 16, 32, 48}) == false);
  }
  check_case({128, 64, {48, 0, 16}, true}, Fp8Products::kAuto, rng);
}

TEST_CASE("fp8 experts: bad input is named", "[gpu][fp8][experts]") {
  CHECK_THROWS_WITH(Fp8ExpertFFN(100, 128, 2), test::contains_text("hidden = 100"));
  CHECK_THROWS_WITH(Fp8ExpertFFN(128, 128, 0), test::contains_text("local_experts = 0"));
  Fp8ExpertFFN ffn(128, 128, 2);
  Stream stream;
  DeviceBuffer buffer(1 << 20);
  const std::vector<std::int64_t> offsets{0, 16, 40};
  const Tensor X(buffer.data(), DType::kBF16, {40, 128});
  ExpertActivations act;
  act.h = Tensor(buffer.data(), DType::kBF16, {40, 256});
  act.a = Tensor(buffer.data(), DType::kBF16, {40, 128});
  CHECK_THROWS_WITH(ffn.forward(X, offsets, act, X, stream.get()),
                    test::contains_text("quantize_weights was not called"));
  ffn.quantize_weights(Tensor(buffer.data(), DType::kBF16, {2, 256, 128}),
                       Tensor(buffer.data(), DType::kBF16, {2, 128, 128}), stream.get());
  CHECK_THROWS_WITH(ffn.forward(X, offsets, act, X, stream.get()),
                    test::contains_text("expert 1 has 24 rows"));
  CHECK_THROWS_WITH(
      ffn.quantize_weights(Tensor(buffer.data(), DType::kFP32, {2, 256, 128}),
                           Tensor(buffer.data(), DType::kBF16, {2, 128, 128}), stream.get()),
      test::contains_text("w13"));
  stream.synchronize();
}

namespace {

// What one run left on the GPU, byte for byte.
struct SpanRun {
  std::vector<std::uint8_t> y, a, dX, dw13, dw2, dscale;
  std::vector<std::uint8_t> dX_sent;  // with dX_queued: each span's rows of dX as the call found
  std::vector<std::uint8_t> dw13_at_call;  // ... and its experts' dw13
  int calls = 0;
};

// How run_spans runs a case.
struct SpanOptions {
  int spans = 0;            // near-equal spans of experts in turn (0: one call)
  bool dX_queued = false;   // each backward call copies its span's dX and dw13 aside when called
  bool dX_over_dY = false;  // dX written over dY, as the NCCL exchange's rows are
  int only = -1;            // run this span alone (forward and backward), the rest left poisoned
  DType grad = DType::kFP32;
  // Run once eagerly (which sizes the scratch), poison the outputs and restore dY, then capture
  // the same forward and backward in a CUDA graph and replay it.
  bool graph = false;
};

// Forward, then backward, over the spans `o` asks for, dh and dA over h and a as MoEBlock runs
// them, rows weighed where the case says; inputs drawn from `seed`, outputs poisoned first.
SpanRun run_spans(const Case& c, Fp8Products products, const SpanOptions& o, std::uint64_t seed) {
  const int spans = o.spans;
  const bool dX_queued = o.dX_queued, dX_over_dY = o.dX_over_dY;
  std::mt19937_64 rng(seed);
  const int E = static_cast<int>(c.rows.size());
  const std::int64_t H = c.hidden, F = c.ffn;
  std::vector<std::int64_t> offsets{0};
  for (auto r : c.rows) offsets.push_back(offsets.back() + r);
  const std::int64_t rows = offsets.back();
  std::vector<Matrix> w13, w2;
  for (int e = 0; e < E; ++e) {
    w13.push_back(test::random_matrix(2 * F, H, rng, 1.0 / std::sqrt(H)));
    w2.push_back(test::random_matrix(H, F, rng, 1.0 / std::sqrt(F)));
  }
  std::vector<float> weights(static_cast<std::size_t>(rows));
  std::uniform_real_distribution<float> probability(0.05f, 1.0f);
  for (float& w : weights) w = probability(rng);
  const DeviceBuffer X = test::upload_as(test::random_matrix(rows, H, rng, 1.0), DType::kBF16);
  const Matrix dY_host = test::random_matrix(rows, H, rng, 1.0);
  const DeviceBuffer dY = test::upload_as(dY_host, DType::kBF16);
  const DeviceBuffer w13_dev = test::upload_as(reference::concat_rows(w13), DType::kBF16);
  const DeviceBuffer w2_dev = test::upload_as(reference::concat_rows(w2), DType::kBF16);
  const DeviceBuffer scale = test::upload(weights);
  const auto bytes = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  DeviceBuffer h(bytes(rows * 2 * F * 2)), a(bytes(rows * F * 2)), y(bytes(rows * H * 2)),
      dX_own(bytes(rows * H * 2)), dscale(bytes(rows * 4)),
      dw13(bytes(E * 2 * F * H) * dtype_size(o.grad)), dw2(bytes(E * H * F) * dtype_size(o.grad)),
      dX_sent(bytes(rows * H * 2)), dw13_at_call(dw13.bytes());
  const auto poison_outputs = [&] {
    for (const auto* b : {&h, &a, &y, &dX_own, &dscale, &dw13, &dw2, &dX_sent}) test::poison(*b);
    MOE_CHECK_CUDA(cudaMemset(dw13_at_call.data(), 0, dw13_at_call.bytes()));
    MOE_CHECK_CUDA(cudaDeviceSynchronize());  // the legacy stream orders nothing on `stream`
  };
  poison_outputs();

  Stream stream;
  Fp8ExpertFFN ffn(c.hidden, c.ffn, E, 3, kDefaultGemmWorkspaceBytes, products);
  ffn.quantize_weights(Tensor(w13_dev.data(), DType::kBF16, {E, 2 * F, H}),
                       Tensor(w2_dev.data(), DType::kBF16, {E, H, F}), stream.get());
  ExpertActivations act;
  act.h = act.dh = Tensor(h.data(), DType::kBF16, {rows, 2 * F});
  act.a = act.dA = Tensor(a.data(), DType::kBF16, {rows, F});
  if (c.weighed) {
    act.scale = Tensor(scale.data(), DType::kFP32, {rows});
    act.dscale = Tensor(dscale.data(), DType::kFP32, {rows});
  }
  std::vector<ExpertSpan> parts{ExpertSpan{}};
  if (spans > 0) {
    parts.clear();
    for (int i = 0; i < spans; ++i) {
      if (o.only < 0 || o.only == i) parts.push_back({i * E / spans, (i + 1) * E / spans});
    }
  }
  const Tensor X_t(X.data(), DType::kBF16, {rows, H});
  const Tensor dY_t(dY.data(), DType::kBF16, {rows, H});
  const Tensor dX_t = dX_over_dY ? dY_t : Tensor(dX_own.data(), DType::kBF16, {rows, H});
  int calls = 0;
  const auto step = [&] {
    for (const ExpertSpan span : parts)
      ffn.forward(X_t, offsets, act, Tensor(y.data(), DType::kBF16, {rows, H}), stream.get(), span);
    for (const ExpertSpan span : parts) {
      ExpertFFN::DXQueued hand_on;
      if (dX_queued) {
        hand_on = [&, span] {
          ++calls;
          const int end = std::min(span.end, E);
          const std::int64_t first = offsets[span.first], last = offsets[end];
          MOE_CHECK_CUDA(cudaMemcpyAsync(
              dX_sent.as<char>() + first * H * 2, dX_t.as<char>() + first * H * 2,
              bytes((last - first) * H * 2), cudaMemcpyDeviceToDevice, stream.get()));
          const std::size_t per_expert = bytes(2 * F * H) * dtype_size(o.grad);
          MOE_CHECK_CUDA(cudaMemcpyAsync(dw13_at_call.as<char>() + span.first * per_expert,
                                         dw13.as<char>() + span.first * per_expert,
                                         (end - span.first) * per_expert, cudaMemcpyDeviceToDevice,
                                         stream.get()));
        };
      }
      ffn.backward(dY_t, X_t, offsets, act, dX_t, Tensor(dw13.data(), o.grad, {E, 2 * F, H}),
                   Tensor(dw2.data(), o.grad, {E, H, F}), stream.get(), {}, span, hand_on);
    }
  };
  step();
  if (o.graph) {
    stream.synchronize();
    poison_outputs();
    const DeviceBuffer dY_again = test::upload_as(dY_host, DType::kBF16);
    MOE_CHECK_CUDA(cudaMemcpy(dY.data(), dY_again.data(), dY.bytes(), cudaMemcpyDeviceToDevice));
    MOE_CHECK_CUDA(cudaDeviceSynchronize());  // a device-to-device copy may return before it ends
    calls = 0;
    const CudaGraph graph(stream.get(), step);
    graph.replay(stream.get());
  }
  stream.synchronize();
  const auto raw = [](const void* data, std::size_t n) {
    std::vector<std::uint8_t> out(n);
    MOE_CHECK_CUDA(cudaMemcpy(out.data(), data, n, cudaMemcpyDeviceToHost));
    return out;
  };
  return {raw(y.data(), y.bytes()),
          raw(a.data(), a.bytes()),
          raw(dX_t.data, dX_t.bytes()),
          raw(dw13.data(), dw13.bytes()),
          raw(dw2.data(), dw2.bytes()),
          raw(dscale.data(), dscale.bytes()),
          dX_queued ? raw(dX_sent.data(), dX_sent.bytes()) : std::vector<std::uint8_t>{},
          dX_queued ? raw(dw13_at_call.data(), dw13_at_call.bytes()) : std::vector<std::uint8_t>{},
          calls};
}

// Bytes [first, end) of `got` as `want` has them, and every other byte still the poison (0xFF).
bool only_in(const std::vector<std::uint8_t>& got, const std::vector<std::uint8_t>& want,
             std::size_t first, std::size_t end) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (i >= first && i < end ? got[i] != want[i] : got[i] != 0xFF) return false;
  }
  return got.size() == want.size();
}

}  // namespace

TEST_CASE(
    "fp8 experts: spans in turn, dX handed on before dw13, and a CUDA graph give one call's bits",
    "[gpu][fp8][experts]") {
  const std::uint64_t seed = test::fresh_seed();
  int device = 0;
  MOE_CHECK_CUDA(cudaGetDevice(&device));
  // Rows weighed inside the experts with fp32 weight gradients, as on one GPU; unweighed with
  // bf16 ones, as over NCCL with bf16 gradients.
  const std::pair<Case, DType> cases[] = {
      {{208, 144, {16, 64, 0, 32, 48}, true, true}, DType::kFP32},
      {{128, 64, {32, 0, 16, 48}, false, true}, DType::kBF16}};
  for (const Fp8Products products : {Fp8Products::kPerExpert, Fp8Products::kGrouped}) {
    if (products == Fp8Products::kGrouped && !grouped_fp8_gemm_supported(device)) continue;
    INFO((products == Fp8Products::kGrouped ? "grouped products" : "cuBLASLt, one expert a call"));
    for (const auto& [c, grad] : cases) {
      INFO(c.describe() << " grads " << dtype_name(grad));
      const int E = static_cast<int>(c.rows.size());
      for (const bool dX_over_dY : {false, true}) {
        INFO((dX_over_dY ? "dX over dY" : "dX apart"));
        const SpanRun one = run_spans(c, products, {.dX_over_dY = dX_over_dY, .grad = grad}, seed);
        // Spans of 2 and 3 experts, one a span (an empty one among them); then dX handed on;
        // then three spans with dX handed on captured in a CUDA graph and replayed (the
        // per-expert schedule's weight gradients fork to their streams and join inside it). The
        // host counts the hand-on calls of the capture; dX_sent and dw13_at_call show that the
        // replay ran their copies, in their place among the products.
        struct Variant {
          int spans;
          bool dX_queued, graph;
        };
        const Variant variants[] = {{2, false, false}, {3, false, false}, {E, false, false},
                                    {0, true, false},  {3, true, false},  {3, true, true}};
        for (const auto& [spans, dX_queued, graph] : variants) {
          INFO(spans << " spans" << (dX_queued ? ", dX handed on" : "")
                     << (graph ? ", in a CUDA graph" : ""));
          const SpanRun got = run_spans(c, products,
                                        {.spans = spans,
                                         .dX_queued = dX_queued,
                                         .dX_over_dY = dX_over_dY,
                                         .grad = grad,
                                         .graph = graph},
                                        seed);
          CHECK(got.y == one.y);
          CHECK(got.a == one.a);
          CHECK(got.dX == one.dX);
          CHECK(got.dw13 == one.dw13);
          CHECK(got.dw2 == one.dw2);
          CHECK(got.dscale == one.dscale);
          if (!dX_queued) continue;
          CHECK(got.calls == std::max(spans, 1));
          CHECK(got.dX_sent == one.dX);  // the final dX, not rows still to be written
          // dw13's products come after the call: the span's dw13 still poisoned there.
          CHECK(std::count(got.dw13_at_call.begin(), got.dw13_at_call.end(), 0xFF) ==
                std::ssize(got.dw13_at_call));
        }
        if (dX_over_dY) continue;  // dX's other rows hold dY there, not poison
        // Each span alone writes its own rows and experts and nothing else.
        std::vector<std::int64_t> offsets{0};
        for (auto r : c.rows) offsets.push_back(offsets.back() + r);
        for (int only = 0; only < 3; ++only) {
          INFO("span " << only << " of 3 alone");
          const SpanRun got =
              run_spans(c, products, {.spans = 3, .only = only, .grad = grad}, seed);
          const int first = only * E / 3, end = (only + 1) * E / 3;
          const auto row_bytes = [&](std::size_t width) {
            return std::pair{static_cast<std::size_t>(offsets[first]) * width,
                             static_cast<std::size_t>(offsets[end]) * width};
          };
          const auto expert_bytes = [&](std::size_t size) {
            return std::pair{first * size, end * size};
          };
          const std::size_t H = c.hidden, F = c.ffn, g = dtype_size(grad);
          const auto [y0, y1] = row_bytes(H * 2);
          const auto [a0, a1] = row_bytes(F * 2);
          const auto [s0, s1] = row_bytes(4);
          const auto [w0, w1] = expert_bytes(2 * F * H * g);
          const auto [v0, v1] = expert_bytes(H * F * g);
          CHECK(only_in(got.y, one.y, y0, y1));
          CHECK(only_in(got.a, one.a, a0, a1));
          CHECK(only_in(got.dX, one.dX, y0, y1));
          if (c.weighed) CHECK(only_in(got.dscale, one.dscale, s0, s1));
          CHECK(only_in(got.dw13, one.dw13, w0, w1));
          CHECK(only_in(got.dw2, one.dw2, v0, v1));
        }
      }
    }
  }
}
