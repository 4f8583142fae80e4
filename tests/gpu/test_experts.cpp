// Expert FFN (cuBLASLt / grouped GEMMs + SwiGLU) against the fp64 reference: forward and every
// gradient, fp32 and bf16, every schedule, h kept or recomputed, X kept or refilled, uniform /
// skewed / empty experts; and the experts run span by span (the pipelined exchange's chunks), or
// with dX handed on before dw13's products, giving one call's bits.
#include <algorithm>
#include <optional>
#include <random>
#include <sstream>
#include <utility>

#include "kernels/experts.h"
#include "reference/reference.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;

namespace {

using reference::transpose;

// Per-expert matrices stacked into one [E, rows, cols] upload.
Matrix stack(const std::vector<Matrix>& parts) {
  return reference::concat_rows(parts);
}

using test::download_matrix;

enum class Rows { kUniform, kSkewed, kSomeEmpty };

struct Case {
  int hidden, ffn, experts;
  std::int64_t rows_per_expert;
  Rows rows;
  DType dtype;
  DType grad_dtype;
  ExpertSchedule schedule;
  bool recompute;
  bool in_place = false;        // dh over h and dA over a, as MoEBlock runs it
  bool one_buffer = false;      // X, y, dY and dX in one buffer, X refilled in backward (one GPU)
  bool dX_over_dY = false;      // y, then dY, then dX in one buffer, X kept (the peer exchange)
  std::int64_t chunk_rows = 0;  // a in chunks of this many rows (0: every row at once)
  bool weighed =
      false;  // rows weighed by probabilities inside the experts, their gradient in place
  int expert_chunks = 0;  // forward, then backward, over this many spans of experts in turn
  // Backward with a dX_queued call that copies the span's rows of dX aside, as an exchange would
  // send them: they must already be the final dX.
  bool dX_queued = false;
  std::string describe() const {
    std::ostringstream s;
    s << "H=" << hidden << " F=" << ffn << " E=" << experts << " rows/expert~" << rows_per_expert
      << " "
      << (rows == Rows::kUniform  ? "uniform"
          : rows == Rows::kSkewed ? "skewed"
                                  : "some empty")
      << " " << dtype_name(dtype) << " grads " << dtype_name(grad_dtype) << " "
      << expert_schedule_name(schedule) << (recompute ? " recompute h" : " keep h")
      << (in_place ? " in place" : "") << (one_buffer ? " one row buffer" : "")
      << (dX_over_dY ? " dX over dY" : "")
      << (chunk_rows > 0 ? " a in chunks of " + std::to_string(chunk_rows) + " rows" : "")
      << (weighed ? " rows weighed" : "")
      << (expert_chunks > 0 ? " in " + std::to_string(expert_chunks) + " spans" : "")
      << (dX_queued ? " dX sent once queued" : "");
    return s.str();
  }
};

// What a case computed, as the GPU left it.
struct Outputs {
  Matrix y, dX, dw13, dw2, dp;
  Matrix dX_sent;    // with dX_queued: each span's rows of dX as the call found them
  int dX_calls = 0;  // with dX_queued: how often it was called
};

// Consecutive near-equal spans of E experts (one span of all for 0).
std::vector<ExpertSpan> expert_spans(int E, int chunks) {
  if (chunks <= 0) return {ExpertSpan{}};
  std::vector<ExpertSpan> spans;
  for (int i = 0; i < chunks; ++i) spans.push_back({i * E / chunks, (i + 1) * E / chunks});
  return spans;
}

// `shared`: run on this ExpertFFN (built for c's shape and schedule) instead of a fresh one, so
// that plans cached by earlier calls with other row counts are reused.
Outputs run_case(const Case& c, std::mt19937_64& rng, ExpertFFN* shared = nullptr) {
  INFO(c.describe());
  const int H = c.hidden, F = c.ffn, E = c.experts;
  std::vector<std::int64_t> counts(E);
  std::uniform_int_distribution<std::int64_t> jitter(0, c.rows_per_expert);
  for (int e = 0; e < E; ++e) {
    switch (c.rows) {
      case Rows::kUniform:
        counts[e] = c.rows_per_expert / 2 + jitter(rng);
        break;
      case Rows::kSkewed:
        counts[e] = e == 0 ? c.rows_per_expert * E : 0;
        break;  // one expert takes all
      case Rows::kSomeEmpty:
        counts[e] = e % 3 == 1 ? 0 : jitter(rng) + 1;
        break;
    }
  }
  const auto offsets =
      reference::padded_offsets(counts, 8);  // padding rows are zero, as the layout makes them
  const std::int64_t rows = offsets.back();

  reference::ExpertWeights weights;
  for (int e = 0; e < E; ++e) {
    weights.w13.push_back(
        test::round_to(test::random_matrix(H, 2 * F, rng, 1.0 / std::sqrt(H)), c.dtype));
    weights.w2.push_back(
        test::round_to(test::random_matrix(F, H, rng, 1.0 / std::sqrt(F)), c.dtype));
  }
  Matrix X = test::random_matrix(rows, H, rng);
  Matrix dY = test::random_matrix(rows, H, rng);
  for (int e = 0; e < E; ++e) {  // zero padding rows
    for (auto r = offsets[e] + counts[e]; r < offsets[e + 1]; ++r) {
      for (int j = 0; j < H; ++j) X(r, j) = dY(r, j) = 0.0;
    }
  }
  X = test::round_to(X, c.dtype);
  dY = test::round_to(dY, c.dtype);

  // Weighed rows (MoEBlock's probabilities inside the experts): y = p ⊙ y_unweighed, so the
  // unweighed reference's backward takes p ⊙ dY, and dp = <dY, y_unweighed> row by row. Padding
  // rows weigh 0, as the permute writes them.
  std::vector<float> p(static_cast<std::size_t>(rows), 1.0f);
  Matrix dY_in = dY;
  if (c.weighed) {
    std::uniform_real_distribution<float> prob(0.05f, 1.0f);
    for (int e = 0; e < E; ++e) {
      for (auto r = offsets[e]; r < offsets[e + 1]; ++r) {
        p[r] = r < offsets[e] + counts[e] ? prob(rng) : 0.0f;
        for (int j = 0; j < H; ++j) dY_in(r, j) *= p[r];
      }
    }
  }
  auto want = reference::experts_forward(X, offsets, weights);
  const auto grads = reference::experts_backward(X, want, dY_in, offsets, weights);
  Matrix want_dp(rows, 1);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (int j = 0; j < H; ++j) want_dp(r, 0) += dY(r, j) * want.y(r, j);
    for (int j = 0; j < H; ++j) want.y(r, j) *= p[r];
  }

  std::vector<Matrix> w13_t, w2_t;  // nn.Linear layout on the GPU
  for (int e = 0; e < E; ++e) {
    w13_t.push_back(transpose(weights.w13[e]));
    w2_t.push_back(transpose(weights.w2[e]));
  }
  const auto X_dev = test::upload_as(X, c.dtype);
  const auto dY_dev = test::upload_as(dY, c.dtype);
  const auto w13_dev = test::upload_as(stack(w13_t), c.dtype);
  const auto w2_dev = test::upload_as(stack(w2_t), c.dtype);
  const std::size_t elem = dtype_size(c.dtype), gelem = dtype_size(c.grad_dtype);
  std::optional<ExpertFFN> own;
  if (shared == nullptr) {
    own.emplace(H, F, E, c.dtype, c.schedule, 3,
                static_cast<std::size_t>(c.chunk_rows) * static_cast<std::size_t>(F) * elem);
  }
  ExpertFFN& ffn = shared != nullptr ? *shared : *own;
  const std::int64_t a_rows = ffn.activation_rows(offsets);
  if (c.chunk_rows > 0) {
    CHECK(a_rows <= c.chunk_rows);
  } else {
    CHECK(a_rows == rows);
  }
  DeviceBuffer h(rows * 2 * F * elem + 16), a(a_rows * F * elem + 16), dA(a_rows * F * elem + 16),
      dh(rows * 2 * F * elem + 16), y(rows * H * elem + 16), dX(rows * H * elem + 16),
      dw13(static_cast<std::size_t>(E) * 2 * F * H * gelem),
      dw2(static_cast<std::size_t>(E) * H * F * gelem);
  for (const auto* b : {&h, &a, &dA, &dh, &y, &dX, &dw13, &dw2}) test::poison(*b);

  const DType d = c.dtype;
  const Tensor h_t(h.data(), d, {rows, 2 * F}), a_t(a.data(), d, {a_rows, F});
  ExpertActivations act = c.in_place ? ExpertActivations{.h = h_t, .a = a_t, .dA = a_t, .dh = h_t}
                                     : ExpertActivations{.h = h_t,
                                                         .a = a_t,
                                                         .dA = Tensor(dA.data(), d, {a_rows, F}),
                                                         .dh = Tensor(dh.data(), d, {rows, 2 * F})};
  const auto scale_dev = test::upload(p);
  if (c.weighed) act.scale = act.dscale = Tensor(scale_dev.data(), DType::kFP32, {rows});
  Stream stream;
  const Tensor w13_t_(w13_dev.data(), d, {E, 2 * F, H}), w2_t_(w2_dev.data(), d, {E, H, F});
  const Tensor dw13_t(dw13.data(), c.grad_dtype, {E, 2 * F, H}),
      dw2_t(dw2.data(), c.grad_dtype, {E, H, F});
  const std::size_t row_bytes = static_cast<std::size_t>(rows * H) * elem;
  DeviceBuffer dX_sent(row_bytes + 16);
  test::poison(dX_sent);
  // The span's dw13 as the call found it: still poisoned where its products run after the call.
  DeviceBuffer dw13_at_call(dw13.bytes());
  MOE_CHECK_CUDA(cudaMemset(dw13_at_call.data(), 0, dw13_at_call.bytes()));
  int dX_calls = 0;
  // The call for one span: its rows of dX (in `from`) and its experts' dw13 copied aside on the
  // stream.
  auto dX_queued = [&](const void* from, ExpertSpan span) -> ExpertFFN::DXQueued {
    if (!c.dX_queued) return {};
    return [&, from, span] {
      ++dX_calls;
      const int end_expert = std::min(span.end, E);
      const std::int64_t first = offsets[span.first], end = offsets[end_expert];
      const std::size_t at = static_cast<std::size_t>(first * H) * elem;
      MOE_CHECK_CUDA(cudaMemcpyAsync(dX_sent.as<char>() + at, static_cast<const char*>(from) + at,
                                     static_cast<std::size_t>((end - first) * H) * elem,
                                     cudaMemcpyDeviceToDevice, stream.get()));
      const std::size_t per_expert = static_cast<std::size_t>(2 * F) * H * gelem;
      MOE_CHECK_CUDA(cudaMemcpyAsync(
          dw13_at_call.as<char>() + static_cast<std::size_t>(span.first) * per_expert,
          dw13.as<char>() + static_cast<std::size_t>(span.first) * per_expert,
          static_cast<std::size_t>(end_expert - span.first) * per_expert, cudaMemcpyDeviceToDevice,
          stream.get()));
    };
  };
  if (c.one_buffer) {
    // y over X; then dY put there (MoEBlock's combine backward writes it over y); the backward
    // refills X over it when dY is dead and writes dX over X.
    const auto shared_rows = test::upload_as(X, d);
    const Tensor rows_t(shared_rows.data(), d, {rows, H});
    ffn.forward(rows_t, offsets, w13_t_, w2_t_, act, rows_t, stream.get());
    MOE_CHECK_CUDA(cudaMemcpyAsync(y.data(), shared_rows.data(), row_bytes,
                                   cudaMemcpyDeviceToDevice, stream.get()));
    MOE_CHECK_CUDA(cudaMemcpyAsync(shared_rows.data(), dY_dev.data(), row_bytes,
                                   cudaMemcpyDeviceToDevice, stream.get()));
    const auto refill = [&](cudaStream_t on) {
      MOE_CHECK_CUDA(cudaMemcpyAsync(shared_rows.data(), X_dev.data(), row_bytes,
                                     cudaMemcpyDeviceToDevice, on));
    };
    ffn.backward(rows_t, rows_t, offsets, w13_t_, w2_t_, act, false, rows_t, dw13_t, dw2_t,
                 stream.get(), refill, {}, dX_queued(shared_rows.data(), {}));
    MOE_CHECK_CUDA(cudaMemcpyAsync(dX.data(), shared_rows.data(), row_bytes,
                                   cudaMemcpyDeviceToDevice, stream.get()));
    stream.synchronize();
  } else if (c.dX_over_dY) {
    // y in its own buffer; dY stored over it (the peer combine backward does, in place); dX
    // written over dY by the backward, X kept.
    DeviceBuffer shared_rows(row_bytes + 16);
    test::poison(shared_rows);
    const Tensor rows_t(shared_rows.data(), d, {rows, H});
    const Tensor X_t(X_dev.data(), d, {rows, H});
    for (const ExpertSpan span : expert_spans(E, c.expert_chunks))
      ffn.forward(X_t, offsets, w13_t_, w2_t_, act, rows_t, stream.get(), span);
    MOE_CHECK_CUDA(cudaMemcpyAsync(y.data(), shared_rows.data(), row_bytes,
                                   cudaMemcpyDeviceToDevice, stream.get()));
    MOE_CHECK_CUDA(cudaMemcpyAsync(shared_rows.data(), dY_dev.data(), row_bytes,
                                   cudaMemcpyDeviceToDevice, stream.get()));
    for (const ExpertSpan span : expert_spans(E, c.expert_chunks)) {
      ffn.backward(rows_t, X_t, offsets, w13_t_, w2_t_, act, false, rows_t, dw13_t, dw2_t,
                   stream.get(), {}, span, dX_queued(shared_rows.data(), span));
    }
    MOE_CHECK_CUDA(cudaMemcpyAsync(dX.data(), shared_rows.data(), row_bytes,
                                   cudaMemcpyDeviceToDevice, stream.get()));
    stream.synchronize();
  } else {
    const Tensor X_t(X_dev.data(), d, {rows, H});
    for (const ExpertSpan span : expert_spans(E, c.expert_chunks)) {
      ffn.forward(X_t, offsets, w13_t_, w2_t_, act, Tensor(y.data(), d, {rows, H}), stream.get(),
                  span);
    }
    if (c.recompute) {
      stream.synchronize();
      test::poison(h);  // backward must rebuild h itself
    }
    for (const ExpertSpan span : expert_spans(E, c.expert_chunks)) {
      ffn.backward(Tensor(dY_dev.data(), d, {rows, H}), X_t, offsets, w13_t_, w2_t_, act,
                   c.recompute, Tensor(dX.data(), d, {rows, H}), dw13_t, dw2_t, stream.get(), {},
                   span, dX_queued(dX.data(), span));
    }
    stream.synchronize();
  }

  const double tolerance = c.dtype == DType::kBF16 ? 1e-2 : 1e-5;
  Outputs got{download_matrix(y, rows, H, d),
              download_matrix(dX, rows, H, d),
              download_matrix(dw13, static_cast<std::int64_t>(E) * 2 * F, H, c.grad_dtype),
              download_matrix(dw2, static_cast<std::int64_t>(E) * H, F, c.grad_dtype),
              download_matrix(scale_dev, rows, 1, DType::kFP32),
              c.dX_queued ? download_matrix(dX_sent, rows, H, d) : Matrix{},
              dX_calls};
  if (c.dX_queued) {
    CHECK(dX_calls == std::ssize(expert_spans(E, c.expert_chunks)));
    CHECK(got.dX_sent.data == got.dX.data);
    if (!c.one_buffer) {  // the refill's dw13 reads X before dX is written over it
      std::vector<unsigned char> seen(dw13_at_call.bytes());
      MOE_CHECK_CUDA(
          cudaMemcpy(seen.data(), dw13_at_call.data(), seen.size(), cudaMemcpyDeviceToHost));
      CHECK(std::count(seen.begin(), seen.end(), 0xFF) == std::ssize(seen));
    }
  }
  CHECK(test::relative_error(got.y, want.y) <= tolerance);
  if (c.weighed) CHECK(test::relative_error(got.dp, want_dp) <= tolerance);
  CHECK(test::relative_error(got.dX, grads.dX) <= tolerance);
  const Matrix& got_dw13 = got.dw13;
  const Matrix& got_dw2 = got.dw2;
  for (int e = 0; e < E; ++e) {
    INFO("expert " << e << " with " << counts[e] << " rows");
    const Matrix got13 = reference::slice_rows(got_dw13, e * 2 * F, (e + 1) * 2 * F);
    const Matrix got2 = reference::slice_rows(got_dw2, e * H, (e + 1) * H);
    if (counts[e] == 0) {  // zero rows: exactly zero gradients, not garbage
      for (const double v : got13.data) REQUIRE(v == 0.0);
      for (const double v : got2.data) REQUIRE(v == 0.0);
      continue;
    }
    CHECK(test::relative_error(got13, transpose(grads.dw13[e])) <= tolerance);
    CHECK(test::relative_error(got2, transpose(grads.dw2[e])) <= tolerance);
  }
  return got;
}

}  // namespace

TEST_CASE("expert FFN forward and backward against the reference", "[gpu][experts]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  int index = 0;
  for (const int E : {1, 8, 64, 128}) {
    for (const Rows rows : {Rows::kUniform, Rows::kSkewed, Rows::kSomeEmpty}) {
      for (const ExpertSchedule schedule :
           {ExpertSchedule::kStreams, ExpertSchedule::kBatched, ExpertSchedule::kGrouped}) {
        ++index;
        const DType dtype = index % 2 ? DType::kBF16 : DType::kFP32;
        const DType grad = index % 3 == 0 ? DType::kFP32 : dtype;
        const int H = E >= 64 ? 64 : 96,
                  F = E >= 64 ? 40 : 72;  // F = 40: odd for 16-byte packs of bf16
        // a in chunks: of about one expert (several small ones at E >= 64), and smaller than
        // an expert, so that experts are cut into pieces whose dw2 add up.
        const std::int64_t chunk_rows = index % 5 == 0 ? 40 : index % 5 == 3 ? 13 : 0;
        run_case({H, F, E, E >= 64 ? 6 : 24, rows, dtype, grad, schedule, index % 4 == 0,
                  index % 4 >= 2, index % 4 == 2, index % 4 == 3, chunk_rows, index % 3 != 1},
                 rng);
      }
    }
  }
}

TEST_CASE("expert FFN at the model shapes, scaled down", "[gpu][experts]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  // mixtral-8x7b (H 4096, F 14336), qwen3-30b-a3b (2048, 768), deepseek-v3 (7168, 2048): widths
  // divided so that the fp64 reference stays within seconds, row counts as top-K routing gives.
  run_case({512, 1792, 8, 64, Rows::kUniform, DType::kBF16, DType::kFP32, ExpertSchedule::kStreams,
            false},
           rng);
  run_case({512, 1792, 8, 64, Rows::kUniform, DType::kBF16, DType::kBF16, ExpertSchedule::kStreams,
            false, true},
           rng);
  run_case({512, 192, 32, 16, Rows::kSomeEmpty, DType::kBF16, DType::kBF16,
            ExpertSchedule::kGrouped, false},
           rng);
  run_case({448, 128, 16, 16, Rows::kUniform, DType::kFP32, DType::kFP32, ExpertSchedule::kGrouped,
            true},
           rng);
  run_case(
      {448, 128, 16, 16, Rows::kSkewed, DType::kBF16, DType::kFP32, ExpertSchedule::kStreams, true},
      rng);
  run_case({448, 129, 16, 16, Rows::kSomeEmpty, DType::kFP32, DType::kFP32,
            ExpertSchedule::kGrouped, true, true},
           rng);
  // Batched calls whose operands are only 4-byte aligned (F = 129 fp32), and in place.
  run_case({448, 129, 16, 16, Rows::kUniform, DType::kFP32, DType::kFP32, ExpertSchedule::kBatched,
            false, true},
           rng);
  run_case({512, 192, 32, 16, Rows::kUniform, DType::kBF16, DType::kBF16, ExpertSchedule::kBatched,
            true},
           rng);
  // One row buffer, as MoEBlock runs on one GPU.
  run_case({512, 1792, 8, 64, Rows::kUniform, DType::kBF16, DType::kBF16, ExpertSchedule::kBatched,
            false, true, true},
           rng);
  run_case({448, 128, 16, 16, Rows::kSomeEmpty, DType::kBF16, DType::kFP32,
            ExpertSchedule::kGrouped, false, true, true},
           rng);
  // dX over dY with X kept, as MoEBlock runs under the peer exchange.
  run_case({512, 192, 32, 16, Rows::kSomeEmpty, DType::kBF16, DType::kBF16,
            ExpertSchedule::kBatched, false, true, false, true},
           rng);
  // a in chunks, as MoEBlock runs it: mixtral's experts cut into pieces (64-row tiles), in one
  // row buffer and with dX over dY; deepseek's several experts to a chunk.
  run_case({512, 1792, 8, 64, Rows::kUniform, DType::kBF16, DType::kBF16, ExpertSchedule::kBatched,
            false, true, true, false, 64},
           rng);
  run_case({512, 1792, 8, 64, Rows::kSkewed, DType::kBF16, DType::kFP32, ExpertSchedule::kBatched,
            false, true, false, true, 192},
           rng);
  run_case({448, 128, 16, 16, Rows::kUniform, DType::kBF16, DType::kBF16, ExpertSchedule::kBatched,
            false, true, false, true, 64},
           rng);
  // Rows weighed inside the experts, as MoEBlock runs on one GPU and over the peer exchange:
  // mixtral cut into pieces in one row buffer, deepseek's small experts with dX over dY, fp32.
  run_case({512, 1792, 8, 64, Rows::kUniform, DType::kBF16, DType::kBF16, ExpertSchedule::kBatched,
            false, true, true, false, 64, true},
           rng);
  run_case({448, 128, 16, 16, Rows::kSomeEmpty, DType::kBF16, DType::kFP32,
            ExpertSchedule::kBatched, false, true, false, true, 64, true},
           rng);
  run_case({448, 129, 16, 16, Rows::kSkewed, DType::kFP32, DType::kFP32, ExpertSchedule::kGrouped,
            false, false, false, false, 0, true},
           rng);
}

TEST_CASE("batched expert calls reuse their plans as row counts change", "[gpu][experts]") {
  // Each batch-count class (a power of two) gets its algorithm once; later steps with other
  // counts in that class, other padded row counts and other alignments must still be exact.
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const DType dtype : {DType::kBF16, DType::kFP32}) {
    const int H = 96, F = dtype == DType::kBF16 ? 72 : 37, E = 64;
    ExpertFFN ffn(H, F, E, dtype, ExpertSchedule::kBatched, 3);
    for (int step = 0; step < 4; ++step) {
      INFO("step " << step);
      const Rows rows = step == 2 ? Rows::kSomeEmpty : Rows::kUniform;
      run_case({H, F, E, 8 + 4 * step, rows, dtype, dtype, ExpertSchedule::kBatched, step % 2 == 1},
               rng, &ffn);
    }
  }
}

TEST_CASE("expert FFN run span by span of experts gives one call's bits", "[gpu][experts]") {
  // The pipelined exchange runs the experts chunk by chunk as their rows arrive: every product is
  // launched as the call over all experts launches it (the same batches' size classes, hence the
  // same algorithms on one ExpertFFN), so the spans' results are one call's, bit for bit, with
  // a cut into chunks and pieces, empty experts, weighed rows and dX over dY.
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<Case> cases = {
      {96, 72, 8, 24, Rows::kUniform, DType::kBF16, DType::kFP32, ExpertSchedule::kBatched, false},
      {96, 72, 8, 24, Rows::kSomeEmpty, DType::kFP32, DType::kFP32, ExpertSchedule::kBatched, false,
       true, false, false, 40},
      {448, 128, 16, 16, Rows::kSomeEmpty, DType::kBF16, DType::kFP32, ExpertSchedule::kBatched,
       false, true, false, true, 64, true},
      {512, 1792, 8, 64, Rows::kUniform, DType::kBF16, DType::kBF16, ExpertSchedule::kBatched,
       false, true, false, true, 64},
      {64, 40, 64, 6, Rows::kUniform, DType::kBF16, DType::kBF16, ExpertSchedule::kStreams, true},
  };
  for (Case c : cases) {
    ExpertFFN ffn(c.hidden, c.ffn, c.experts, c.dtype, c.schedule, 3,
                  static_cast<std::size_t>(c.chunk_rows) * static_cast<std::size_t>(c.ffn) *
                      dtype_size(c.dtype));
    std::mt19937_64 same_inputs = rng;
    const Outputs one = run_case(c, same_inputs, &ffn);
    // In spans; then with dX sent once queued (the last chunk of a pipelined exchange's
    // backward): dw13's products after the call change no bit, and the rows sent are the final
    // dX (run_case checks).
    const std::pair<int, bool> variants[] = {
        {2, false}, {3, false}, {c.experts, false}, {0, true}, {3, true}};
    for (const auto& [chunks, dX_queued] : variants) {
      c.expert_chunks = chunks;
      c.dX_queued = dX_queued;
      INFO(c.describe());
      same_inputs = rng;
      const Outputs got = run_case(c, same_inputs, &ffn);
      CHECK(got.y.data == one.y.data);
      CHECK(got.dX.data == one.dX.data);
      CHECK(got.dw13.data == one.dw13.data);
      CHECK(got.dw2.data == one.dw2.data);
      if (c.weighed) CHECK(got.dp.data == one.dp.data);
    }
    c.dX_queued = false;
    rng = same_inputs;
  }
}

TEST_CASE("expert FFN rejects bad shapes", "[gpu][experts]") {
  CHECK_THROWS_WITH(ExpertFFN(0, 8, 2, DType::kBF16), test::contains_text("hidden = 0"));
  ExpertFFN ffn(8, 8, 2, DType::kBF16);
  const std::vector<std::int64_t> offsets = {0, 4};  // one expert short
  const Tensor t(nullptr, DType::kBF16, {4, 8});
  CHECK_THROWS_WITH(ffn.forward(t, offsets, t, t, {.h = t, .a = t, .dA = t, .dh = t}, t, nullptr),
                    test::contains_text("2 offsets for 2 local experts"));
}
