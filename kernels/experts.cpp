// The experts' forward and backward as products and SwiGLU passes over the padded rows; how the
// products launch is kernels/experts_launch.cpp.
#include "experts.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>

#include "moe/error.h"
#include "swiglu.cuh"

namespace moe {

std::string_view expert_schedule_name(ExpertSchedule schedule) {
  switch (schedule) {
    case ExpertSchedule::kStreams:
      return "streams";
    case ExpertSchedule::kBatched:
      return "batched";
    case ExpertSchedule::kGrouped:
      return "grouped";
  }
  return "unknown";
}

void ExpertFFN::set_host_wait(std::function<void(cudaEvent_t)> wait) {
  if (!wait) fail("ExpertFFN::set_host_wait: empty function");
  host_wait_ = std::move(wait);
}

void ExpertFFN::check_offsets(std::span<const std::int64_t> offsets) const {
  if (std::ssize(offsets) != experts_ + 1) {
    fail("ExpertFFN: {} offsets for {} local experts (expected {})", offsets.size(), experts_,
         experts_ + 1);
  }
  for (int e = 0; e < experts_; ++e) {
    if (offsets[e] < 0 || offsets[e + 1] < offsets[e])
      fail("ExpertFFN: offsets[{}..{}] = {}, {} decrease", e, e + 1, offsets[e], offsets[e + 1]);
  }
}

void ExpertFFN::check_shapes(const Tensor& X, std::span<const std::int64_t> offsets,
                             const Tensor& w13, const Tensor& w2,
                             const ExpertActivations& act) const {
  check_offsets(offsets);
  const std::int64_t rows = offsets.back();
  const std::int64_t H = hidden_, F = ffn_, E = experts_;
  expect_tensor(X, "ExpertFFN X", dtype_, {rows, H});
  expect_tensor(w13, "ExpertFFN w13", dtype_, {E, 2 * F, H});
  expect_tensor(w2, "ExpertFFN w2", dtype_, {E, H, F});
  expect_tensor(act.h, "ExpertFFN h", dtype_, {rows, 2 * F});
  expect_tensor(act.a, "ExpertFFN a", dtype_, {activation_rows(offsets), F});
  if (!act.scale.shape.empty()) expect_tensor(act.scale, "ExpertFFN scale", DType::kFP32, {rows});
}

namespace {
// Rows [first, first + count) of an optional per-row vector (Tensor{} stays Tensor{}).
Tensor row_range(const Tensor& rows, std::int64_t first, std::int64_t count) {
  if (rows.shape.empty()) return {};
  return Tensor(rows.as<char>() + first * static_cast<std::int64_t>(dtype_size(rows.dtype)),
                rows.dtype, {count});
}
}  // namespace

std::vector<ExpertFFN::Chunk> ExpertFFN::plan_chunks(std::span<const std::int64_t> offsets) const {
  std::vector<Chunk> chunks;
  Chunk open;
  auto close = [&] {
    if (open.rows > 0) chunks.push_back(std::move(open));
    open = Chunk{};
  };
  for (int e = 0; e < experts_; ++e) {
    const std::int64_t first = offsets[e], m = offsets[e + 1] - offsets[e];
    if (m == 0) continue;
    if (m > chunk_rows_ - open.rows) close();
    if (m <= chunk_rows_) {
      if (open.rows == 0) open.first_row = first;
      open.pieces.push_back({e, first, m, true});
      open.rows += m;
      continue;
    }
    // Larger than a chunk: near-equal pieces (whole 64-row tiles where they fit), one a chunk.
    const std::int64_t count = (m + chunk_rows_ - 1) / chunk_rows_;
    std::int64_t piece = (m + count - 1) / count;
    if (chunk_rows_ >= 64) piece = std::min(chunk_rows_, (piece + 63) / 64 * 64);
    for (std::int64_t r = 0; r < m; r += piece) {
      const std::int64_t n = std::min(piece, m - r);
      chunks.push_back({first + r, n, {{e, first + r, n, r == 0}}});
    }
  }
  close();
  return chunks;
}

std::int64_t ExpertFFN::activation_rows(std::span<const std::int64_t> offsets) const {
  if (std::ssize(offsets) != experts_ + 1) {
    fail("ExpertFFN: {} offsets for {} local experts (expected {})", offsets.size(), experts_,
         experts_ + 1);
  }
  if (chunk_rows_ >= offsets.back()) return offsets.back();
  std::int64_t most = 0;
  for (const auto& chunk : plan_chunks(offsets)) most = std::max(most, chunk.rows);
  return most;
}

void ExpertFFN::up_products(const Tensor& X, std::span<const std::int64_t> offsets,
                            const Tensor& w13, const Tensor& h, std::vector<Product>& out) const {
  const std::int64_t H = hidden_, F = ffn_;
  const std::size_t elem = dtype_size(dtype_);
  for (int e = 0; e < experts_; ++e) {
    const std::int64_t m = offsets[e + 1] - offsets[e];
    if (m == 0) continue;
    out.push_back({{m, 2 * F, H, false, true, dtype_, dtype_, dtype_},
                   X.as<char>() + offsets[e] * H * elem,
                   w13.as<char>() + e * 2 * F * H * elem,
                   h.as<char>() + offsets[e] * 2 * F * elem,
                   0.0f,
                   e});
  }
}

std::pair<std::int64_t, std::int64_t> ExpertFFN::span_rows(const Chunk& chunk, ExpertSpan span) {
  std::int64_t first = -1, end = 0;
  for (const Piece& p : chunk.pieces) {
    if (p.expert < span.first || p.expert >= span.end) continue;
    if (first < 0) first = p.first_row;
    end = p.first_row + p.rows;
  }
  return first < 0 ? std::pair<std::int64_t, std::int64_t>{0, 0}
                   : std::pair<std::int64_t, std::int64_t>{first, end - first};
}

void ExpertFFN::forward(const Tensor& X, std::span<const std::int64_t> offsets, const Tensor& w13,
                        const Tensor& w2, const ExpertActivations& act, const Tensor& y,
                        cudaStream_t stream, ExpertSpan span) {
  check_shapes(X, offsets, w13, w2, act);
  span = {span.first, std::min(span.end, experts_)};
  if (span.first < 0 || span.first > span.end)
    fail("ExpertFFN::forward: experts [{}, {}) of {}", span.first, span.end, experts_);
  const std::int64_t H = hidden_, F = ffn_;
  expect_tensor(y, "ExpertFFN y", dtype_, {offsets.back(), H});
  const std::size_t elem = dtype_size(dtype_);

  std::vector<Product> products;
  up_products(X, offsets, w13, act.h, products);
  run(products, stream, nullptr, span);  // h = X·w13ᵀ
  // Per chunk (the next one's SwiGLU waits for these products, the last readers of a):
  // a = silu(h_gate) ⊙ h_up, y = a·w2ᵀ. The chunks are the call's over every expert, each cut to
  // the span's rows.
  for (const Chunk& chunk : plan_chunks(offsets)) {
    const auto [first, rows] = span_rows(chunk, span);
    if (rows == 0) continue;
    swiglu_forward(
        Tensor(act.h.as<char>() + first * 2 * F * elem, dtype_, {rows, 2 * F}),
        Tensor(act.a.as<char>() + (first - chunk.first_row) * F * elem, dtype_, {rows, F}), stream,
        row_range(act.scale, first, rows));
    products.clear();
    for (const Piece& p : chunk.pieces) {
      products.push_back({{p.rows, H, F, false, true, dtype_, dtype_, dtype_},
                          act.a.as<char>() + (p.first_row - chunk.first_row) * F * elem,
                          w2.as<char>() + p.expert * H * F * elem,
                          y.as<char>() + p.first_row * H * elem,
                          0.0f,
                          p.expert});
    }
    run(products, stream, nullptr, span);
  }
}

void ExpertFFN::backward(const Tensor& dY, const Tensor& X, std::span<const std::int64_t> offsets,
                         const Tensor& w13, const Tensor& w2, const ExpertActivations& act,
                         bool recompute_h, const Tensor& dX, const Tensor& dw13, const Tensor& dw2,
                         cudaStream_t stream, const RefillInput& refill_input, ExpertSpan span,
                         const DXQueued& dX_queued) {
  check_shapes(X, offsets, w13, w2, act);
  span = {span.first, std::min(span.end, experts_)};
  if (span.first < 0 || span.first > span.end)
    fail("ExpertFFN::backward: experts [{}, {}) of {}", span.first, span.end, experts_);
  if (refill_input && (span.first > 0 || span.end < experts_))
    fail("ExpertFFN::backward: a refill writes every expert's X; it runs over all experts only");
  if (recompute_h && refill_input)
    fail("ExpertFFN::backward: recompute_h needs X on entry; it cannot be refilled later");
  const std::int64_t rows = offsets.back();
  const std::int64_t H = hidden_, F = ffn_, E = experts_;
  expect_tensor(dY, "ExpertFFN dY", dtype_, {rows, H});
  expect_tensor(dX, "ExpertFFN dX", dtype_, {rows, H});
  expect_tensor(act.dA, "ExpertFFN dA", dtype_, {activation_rows(offsets), F});
  expect_tensor(act.dh, "ExpertFFN dh", dtype_, {rows, 2 * F});
  if (act.scale.shape.empty() != act.dscale.shape.empty())
    fail("ExpertFFN::backward: scale is {} and dscale {}; give both or neither",
         act.scale.describe(), act.dscale.describe());
  if (!act.dscale.shape.empty())
    expect_tensor(act.dscale, "ExpertFFN dscale", DType::kFP32, {rows});
  const DType grad_type = dw13.dtype;
  if (grad_type != DType::kBF16 && grad_type != DType::kFP32)
    fail("ExpertFFN: dw13 dtype {} must be bf16 or fp32", dtype_name(grad_type));
  expect_tensor(dw13, "ExpertFFN dw13", grad_type, {E, 2 * F, H});
  expect_tensor(dw2, "ExpertFFN dw2", grad_type, {E, H, F});
  const std::size_t elem = dtype_size(dtype_);
  const std::size_t grad_elem = dtype_size(grad_type);

  std::vector<Product> products;
  if (recompute_h) {
    up_products(X, offsets, w13, act.h, products);
    run(products, stream, nullptr, span);
  }
  // Per chunk: dA = dY·w2, then dh and a again from h and dA. Cut into chunks, each chunk's dw2 =
  // dYᵀ·a follows before the next chunk's dA overwrites a; in one chunk, dw2 joins the fan-out
  // below, the most overlap.
  const std::vector<Chunk> chunks = plan_chunks(offsets);
  const bool chunked = chunks.size() > 1;
  for (const Chunk& chunk : chunks) {
    const auto [first, rows] = span_rows(chunk, span);
    if (rows == 0) continue;
    products.clear();
    for (const Piece& p : chunk.pieces) {
      products.push_back({{p.rows, F, H, false, false, dtype_, dtype_, dtype_},
                          dY.as<char>() + p.first_row * H * elem,
                          w2.as<char>() + p.expert * H * F * elem,
                          act.dA.as<char>() + (p.first_row - chunk.first_row) * F * elem,
                          0.0f,
                          p.expert});
    }
    run(products, stream, nullptr, span);
    auto rows_of = [&](const Tensor& t, std::int64_t width) {
      return Tensor(t.as<char>() + first * width * elem, dtype_, {rows, width});
    };
    auto chunk_rows_of = [&](const Tensor& t) {  // a and dA hold the chunk from its first row
      return Tensor(t.as<char>() + (first - chunk.first_row) * F * elem, dtype_, {rows, F});
    };
    swiglu_backward(rows_of(act.h, 2 * F), chunk_rows_of(act.dA), rows_of(act.dh, 2 * F),
                    chunk_rows_of(act.a), stream, row_range(act.scale, first, rows),
                    row_range(act.dscale, first, rows));
    if (!chunked) continue;
    products.clear();
    for (const Piece& p : chunk.pieces) {
      products.push_back({{H, F, p.rows, true, false, dtype_, dtype_, grad_type},
                          dY.as<char>() + p.first_row * H * elem,
                          act.a.as<char>() + (p.first_row - chunk.first_row) * F * elem,
                          dw2.as<char>() + p.expert * H * F * grad_elem,
                          p.first_of_expert ? 0.0f : 1.0f,
                          p.expert});
    }
    run(products, stream, nullptr, span);
  }
  // dw2 = dYᵀ·a (unless done per chunk) and dw13 = dhᵀ·X (with no rows, K = 0, these write
  // zeros); dX = dh·w13. Separate buffers: one fan-out over all of them, the most overlap. dX over
  // dY (X kept): one fan-out, each expert's dX behind its dw2 (the last reader of its rows of dY)
  // on one stream. One buffer: dw2, X refilled, then each dw13 with its expert's dX behind it on
  // one stream.
  const bool dX_over_dY = !refill_input && dX.data == dY.data;
  // With dX_queued (and no refill), dw13's products leave the fan-out and run after the call.
  const bool dw13_last = dX_queued && !refill_input;
  std::vector<Product> all, dw2_products, dw13_products, dX_products;
  for (int e = 0; e < experts_; ++e) {
    const std::int64_t m = offsets[e + 1] - offsets[e];
    const bool dw2_here = !chunked || m == 0;  // chunked: only the zeros of an empty expert
    const char* dh_e = act.dh.as<char>() + offsets[e] * 2 * F * elem;
    const Product dw2_e{{H, F, m, true, false, dtype_, dtype_, grad_type},
                        dY.as<char>() + offsets[e] * H * elem,
                        act.a.as<char>() + offsets[e] * F * elem,
                        dw2.as<char>() + e * H * F * grad_elem,
                        0.0f,
                        e};
    const Product dw13_e{{2 * F, H, m, true, false, dtype_, dtype_, grad_type},
                         dh_e,
                         X.as<char>() + offsets[e] * H * elem,
                         dw13.as<char>() + e * 2 * F * H * grad_elem,
                         0.0f,
                         e};
    const Product dX_e{{m, H, 2 * F, false, false, dtype_, dtype_, dtype_},
                       dh_e,
                       w13.as<char>() + e * 2 * F * H * elem,
                       dX.as<char>() + offsets[e] * H * elem,
                       0.0f,
                       e};
    const Product none{};  // a follower slot with nothing to run (m·n = 0)
    if (dX_over_dY) {      // dw2_products holds the leads, dX_products their followers
      if (dw2_here) {
        dw2_products.push_back(dw2_e);
        dX_products.push_back(dX_e);  // with no rows m = 0: nothing runs
      } else {
        dw2_products.push_back(dX_e);  // dY's readers of this expert ran chunk by chunk
        dX_products.push_back(none);
      }
      if (dw13_last) {
        dw13_products.push_back(dw13_e);
      } else {
        dw2_products.push_back(dw13_e);
        dX_products.push_back(none);
      }
    } else if (refill_input) {
      if (dw2_here) dw2_products.push_back(dw2_e);
      dw13_products.push_back(dw13_e);
      dX_products.push_back(dX_e);  // aligned with dw13's, empty with no rows
    } else {
      if (dw2_here) all.push_back(dw2_e);
      (dw13_last ? dw13_products : all).push_back(dw13_e);
      if (m > 0) all.push_back(dX_e);
    }
  }
  if (!refill_input) {
    if (dX_over_dY) {
      run(dw2_products, stream, &dX_products, span);
    } else {
      run(all, stream, nullptr, span);
    }
    if (dw13_last) {
      dX_queued();
      run(dw13_products, stream, nullptr, span);
    }
    return;
  }
  run(dw2_products, stream);                 // the last reads of dY
  refill_input(stream);                      // X over dY
  run(dw13_products, stream, &dX_products);  // dX over X_e once dw13_e has read it
  if (dX_queued) dX_queued();
}

void ExpertFFN::weight_gradients(const Tensor& dY, const Tensor& X,
                                 std::span<const std::int64_t> offsets, const Tensor& a,
                                 const Tensor& dh, const Tensor& dw13, const Tensor& dw2,
                                 cudaStream_t stream, const RefillInput& between, ExpertSpan span) {
  check_offsets(offsets);
  span = {span.first, std::min(span.end, experts_)};
  if (span.first < 0 || span.first > span.end)
    fail("ExpertFFN::weight_gradients: experts [{}, {}) of {}", span.first, span.end, experts_);
  const std::int64_t rows = offsets.back(), H = hidden_, F = ffn_, E = experts_;
  expect_tensor(dY, "ExpertFFN dY", dtype_, {rows, H});
  expect_tensor(X, "ExpertFFN X", dtype_, {rows, H});
  expect_tensor(a, "ExpertFFN a", dtype_, {rows, F});
  expect_tensor(dh, "ExpertFFN dh", dtype_, {rows, 2 * F});
  const DType grad_type = dw13.dtype;
  if (grad_type != DType::kBF16 && grad_type != DType::kFP32)
    fail("ExpertFFN: dw13 dtype {} must be bf16 or fp32", dtype_name(grad_type));
  expect_tensor(dw13, "ExpertFFN dw13", grad_type, {E, 2 * F, H});
  expect_tensor(dw2, "ExpertFFN dw2", grad_type, {E, H, F});
  const std::size_t elem = dtype_size(dtype_), grad_elem = dtype_size(grad_type);
  std::vector<Product> dw2_products, dw13_products;
  for (int e = 0; e < experts_; ++e) {
    const std::int64_t first = offsets[e], m = offsets[e + 1] - first;
    dw2_products.push_back({{H, F, m, true, false, dtype_, dtype_, grad_type},
                            dY.as<char>() + first * H * elem,
                            a.as<char>() + first * F * elem,
                            dw2.as<char>() + e * H * F * grad_elem,
                            0.0f,
                            e});
    dw13_products.push_back({{2 * F, H, m, true, false, dtype_, dtype_, grad_type},
                             dh.as<char>() + first * 2 * F * elem,
                             X.as<char>() + first * H * elem,
                             dw13.as<char>() + e * 2 * F * H * grad_elem,
                             0.0f,
                             e});
  }
  if (between) {
    run(dw2_products, stream, nullptr, span);
    between(stream);
    run(dw13_products, stream, nullptr, span);
    return;
  }
  dw2_products.insert(dw2_products.end(), dw13_products.begin(), dw13_products.end());
  run(dw2_products, stream, nullptr, span);
}

}  // namespace moe
