#include "experts_fp8.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "fp8_quantize.cuh"
#include "grouped_fp8_gemm.cuh"
#include "moe/error.h"
#include "swiglu.cuh"

namespace moe {
namespace {

std::int64_t column_blocks(std::int64_t cols) {
  return (cols + kFP8Block - 1) / kFP8Block;
}

}  // namespace

Fp8ExpertFFN::Fp8ExpertFFN(int hidden, int ffn, int local_experts, int streams,
                           std::size_t workspace_bytes, Fp8Products products)
    : hidden_(hidden), ffn_(ffn), experts_(local_experts), products_(products) {
  if (hidden <= 0 || hidden % 16 != 0 || ffn <= 0 || ffn % 16 != 0) {
    fail("Fp8ExpertFFN: hidden = {} and ffn = {} must be positive multiples of 16", hidden, ffn);
  }
  if (local_experts <= 0 || local_experts > kMaxQuantizeSegments) {
    fail("Fp8ExpertFFN: local_experts = {} must be in [1, {}]", local_experts,
         kMaxQuantizeSegments);
  }
  if (streams < 1) fail("Fp8ExpertFFN: streams = {} must be >= 1", streams);
  int device = 0;
  MOE_CHECK_CUDA(cudaGetDevice(&device));
  const bool supported = grouped_fp8_gemm_supported(device);
  grouped_available_ = supported && local_experts <= kMaxGroupedGemmGroups;
  if (products == Fp8Products::kGrouped && !supported)
    fail(
        "Fp8ExpertFFN: device {} cannot run the grouped FP8 products (compute capability 9.0, a "
        "build for sm_90a and the driver's tensor maps)",
        device);
  if (products == Fp8Products::kGrouped && local_experts > kMaxGroupedGemmGroups)
    fail("Fp8ExpertFFN: local_experts = {} exceeds the grouped products' {} groups", local_experts,
         kMaxGroupedGemmGroups);
  const std::int64_t H = hidden, F = ffn, E = local_experts;
  auto allocate = [E](Weights& w, std::int64_t rows, std::int64_t cols) {
    w.tiles = tile_scales(rows, cols);
    w.codes.reserve(static_cast<std::size_t>(E * rows * cols));
    w.scales.reserve(static_cast<std::size_t>(E * w.tiles.count) * sizeof(float));
  };
  allocate(w13_, 2 * F, H);
  allocate(w2_, H, F);
  allocate(w13_transposed_, H, 2 * F);
  allocate(w2_transposed_, F, H);
  for (int s = 0; s < streams; ++s) {
    streams_.emplace_back();
    gemms_.push_back(std::make_unique<BlockScaledGemm>(workspace_bytes));
    joins_.emplace_back();
  }
  // Untimed (the heuristic's first algorithm): timing would wait on the host inside a step.
  const auto weight_gradients = [&](ExpertSchedule schedule) {
    return std::make_unique<ExpertFFN>(hidden, ffn, local_experts, DType::kBF16, schedule, streams,
                                       0, workspace_bytes, /*autotune=*/false);
  };
  // Only the schedules grouped_pass can pick: each holds its own workspace (and streams).
  const bool grouped_reachable =
      products == Fp8Products::kGrouped || (products == Fp8Products::kAuto && grouped_available_);
  if (grouped_reachable) batched_grads_ = weight_gradients(ExpertSchedule::kBatched);
  if (products != Fp8Products::kGrouped)
    per_expert_grads_ = weight_gradients(ExpertSchedule::kStreams);
}

void Fp8ExpertFFN::quantize_weights(const Tensor& w13, const Tensor& w2, cudaStream_t stream) {
  const std::int64_t H = hidden_, F = ffn_, E = experts_;
  expect_tensor(w13, "Fp8ExpertFFN w13", DType::kBF16, {E, 2 * F, H});
  expect_tensor(w2, "Fp8ExpertFFN w2", DType::kBF16, {E, H, F});
  auto output = [](Weights& w) {
    return TileOutput{w.codes.as<std::uint8_t>(), w.scales.as<float>(), w.tiles};
  };
  quantize_tiles(w13.data, E, 2 * F, H, output(w13_), output(w13_transposed_), stream);
  quantize_tiles(w2.data, E, H, F, output(w2_), output(w2_transposed_), stream);
  has_weights_ = true;
}

void Fp8ExpertFFN::check_offsets(std::span<const std::int64_t> offsets, const char* call) const {
  if (!has_weights_) fail("Fp8ExpertFFN::{}: quantize_weights was not called", call);
  if (offsets.size() != static_cast<std::size_t>(experts_) + 1) {
    fail("Fp8ExpertFFN::{}: {} offsets for {} experts (need experts + 1)", call, offsets.size(),
         experts_);
  }
  for (int e = 0; e < experts_; ++e) {
    const std::int64_t rows = offsets[e + 1] - offsets[e];
    if (rows < 0 || rows % 16 != 0) {
      fail(
          "Fp8ExpertFFN::{}: expert {} has {} rows; FP8 products take multiples of 16 "
          "(align_size)",
          call, e, rows);
    }
  }
}

Fp8ExpertFFN::Part Fp8ExpertFFN::part(std::span<const std::int64_t> offsets, ExpertSpan span,
                                      const char* call) const {
  check_offsets(offsets, call);
  Part p;
  p.first = span.first;
  p.end = std::min(span.end, experts_);
  if (p.first < 0 || p.first > p.end)
    fail("Fp8ExpertFFN::{}: experts [{}, {}) of {}", call, span.first, span.end, experts_);
  p.first_row = offsets[p.first];
  p.rows = offsets[p.end] - p.first_row;
  for (int e = p.first; e <= p.end; ++e) p.offsets.push_back(offsets[e] - p.first_row);
  p.grouped = grouped_pass(offsets);
  return p;
}

namespace {

// Rows [first, first + count) of a row-major tensor; an absent one (no shape) stays absent.
Tensor row_slice(const Tensor& t, std::int64_t first, std::int64_t count) {
  if (t.shape.empty()) return Tensor{};
  const std::int64_t row = t.dim(0) > 0 ? t.numel() / t.dim(0) : 0;
  std::vector<std::int64_t> shape{count};
  shape.insert(shape.end(), t.shape.begin() + 1, t.shape.end());
  return Tensor(t.as<char>() + static_cast<std::size_t>(first * row) * dtype_size(t.dtype), t.dtype,
                std::move(shape));
}

}  // namespace

void Fp8ExpertFFN::forward(const Tensor& X, std::span<const std::int64_t> offsets,
                           const ExpertActivations& act, const Tensor& y, cudaStream_t stream,
                           ExpertSpan span, const QuantizedRows& X_codes) {
  const Part p = part(offsets, span, "forward");
  const std::int64_t H = hidden_, F = ffn_, rows = offsets.back();
  expect_tensor(X, "Fp8ExpertFFN X", DType::kBF16, {rows, H});
  expect_tensor(act.h, "Fp8ExpertFFN h", DType::kBF16, {rows, 2 * F});
  expect_tensor(act.a, "Fp8ExpertFFN a", DType::kBF16, {rows, F});
  expect_tensor(y, "Fp8ExpertFFN y", DType::kBF16, {rows, H});
  reserve_scratch(rows, X_codes.given());
  if (p.rows == 0) return;
  const auto slice = [&](const Tensor& t) { return row_slice(t, p.first_row, p.rows); };
  const Fp8RowBlocks x_codes = input_rows(X_codes, p, "forward"), a_codes = scratch(1, p, F);
  const Tensor h = slice(act.h);
  if (!X_codes.given())
    quantize_row_blocks_segmented(slice(X).data, p.offsets, H, x_codes.codes, x_codes.scales,
                                  stream);
  fp8_pass(p, x_codes, H, w13_, 2 * F, h.data, stream);  // h = X·w13ᵀ
  swiglu_forward_fp8(h, slice(act.a), a_codes, stream, slice(act.scale));
  fp8_pass(p, a_codes, F, w2_, H, slice(y).data, stream);  // y = a·w2ᵀ
}

void Fp8ExpertFFN::reserve_scratch(std::int64_t rows, bool rows_given) {
  for (int i = rows_given ? 1 : 0; i < 2; ++i) {
    // Sized for the backward's dh too (2F wide), so that the buffers grow at most once a step: a
    // growth frees the old buffer, which waits for the device, transfers in flight included.
    const std::int64_t width = i == 0 ? hidden_ : 2 * std::int64_t{ffn_};
    codes_[i].reserve(static_cast<std::size_t>(rows * width));
    scales_[i].reserve(static_cast<std::size_t>(rows * column_blocks(width)) * sizeof(float));
  }
}

Fp8RowBlocks Fp8ExpertFFN::scratch(int buffer, const Part& part, std::int64_t width) {
  return {codes_[buffer].as<std::uint8_t>() + part.first_row * width,
          scales_[buffer].as<float>() + part.first_row * column_blocks(width), part.offsets};
}

Fp8RowBlocks Fp8ExpertFFN::input_rows(const QuantizedRows& given, const Part& part,
                                      const char* call) {
  if (!given.given()) return scratch(0, part, hidden_);
  if (given.scales == nullptr) fail("Fp8ExpertFFN::{}: quantized rows without scales", call);
  // Every expert's rows, of which the part's begin at its first row (its experts' scales there).
  return {given.codes + part.first_row * hidden_,
          given.scales + part.first_row * column_blocks(hidden_), part.offsets};
}

void Fp8ExpertFFN::backward(const Tensor& dY, const Tensor& X,
                            std::span<const std::int64_t> offsets, const ExpertActivations& act,
                            const Tensor& dX, const Tensor& dw13, const Tensor& dw2,
                            cudaStream_t stream, const ExpertFFN::RefillInput& refill_input,
                            ExpertSpan span, const ExpertFFN::DXQueued& dX_queued,
                            const QuantizedRows& dY_codes_given) {
  const Part p = part(offsets, span, "backward");
  const std::int64_t H = hidden_, F = ffn_, E = experts_, rows = offsets.back();
  const DType d = DType::kBF16;
  if (refill_input && (p.first > 0 || p.end < experts_))
    fail(
        "Fp8ExpertFFN::backward: X refilled for experts [{}, {}) of {}; a refill takes every "
        "expert",
        p.first, p.end, experts_);
  expect_tensor(dY, "Fp8ExpertFFN dY", d, {rows, H});
  expect_tensor(X, "Fp8ExpertFFN X", d, {rows, H});
  expect_tensor(act.h, "Fp8ExpertFFN h", d, {rows, 2 * F});
  expect_tensor(act.a, "Fp8ExpertFFN a", d, {rows, F});
  expect_tensor(act.dA, "Fp8ExpertFFN dA", d, {rows, F});
  expect_tensor(act.dh, "Fp8ExpertFFN dh", d, {rows, 2 * F});
  expect_tensor(dX, "Fp8ExpertFFN dX", d, {rows, H});
  if (act.scale.shape.empty() != act.dscale.shape.empty()) {
    fail("Fp8ExpertFFN::backward: scale is {} and dscale {}; give both or neither",
         act.scale.describe(), act.dscale.describe());
  }
  const DType grad = dw13.dtype;
  if (grad != DType::kBF16 && grad != DType::kFP32)
    fail("Fp8ExpertFFN: dw13 dtype {} must be bf16 or fp32", dtype_name(grad));
  expect_tensor(dw13, "Fp8ExpertFFN dw13", grad, {E, 2 * F, H});
  expect_tensor(dw2, "Fp8ExpertFFN dw2", grad, {E, H, F});
  reserve_scratch(rows, dY_codes_given.given());
  const auto slice = [&](const Tensor& t) { return row_slice(t, p.first_row, p.rows); };
  const Fp8RowBlocks dY_codes = input_rows(dY_codes_given, p, "backward"),
                     dh_codes = scratch(1, p, 2 * F);
  if (p.rows > 0) {  // without rows, only the experts' zero weight gradients are left to write
    if (!dY_codes_given.given())
      quantize_row_blocks_segmented(slice(dY).data, p.offsets, H, dY_codes.codes, dY_codes.scales,
                                    stream);
    fp8_pass(p, dY_codes, H, w2_transposed_, F, slice(act.dA).data, stream);  // dA = dY·w2
    swiglu_backward_fp8(slice(act.h), slice(act.dA), slice(act.dh), slice(act.a), dh_codes, stream,
                        slice(act.scale), slice(act.dscale));
  }
  // dX = dh·w13 in FP8 from dh's codes, after dw2 = dYᵀ·a (so that it may be written over dY):
  // where dX is not X and nothing is refilled, before dw13 = dhᵀ·X, with dX_queued called in
  // between; otherwise after both, with X refilled between them. The weight gradients run in bf16
  // (zero without rows) and follow the FP8 passes: where those are grouped (small experts),
  // batched as the bf16 experts batch them (the experts of one row count in one call); else one
  // a call, largest first (each measured faster where it runs: docs/performance.md, "FP8").
  const auto dX_pass = [&](cudaStream_t on) {
    fp8_pass(p, dh_codes, 2 * F, w13_transposed_, H, slice(dX).data, on);
  };
  const bool dX_between = dX_queued && !refill_input && dX.data != X.data;
  ExpertFFN::RefillInput between = refill_input;
  if (dX_between) {
    between = [&](cudaStream_t on) {
      dX_pass(on);
      dX_queued();
    };
  }
  ExpertFFN& grads = p.grouped ? *batched_grads_ : *per_expert_grads_;
  grads.weight_gradients(dY, X, offsets, act.a, act.dh, dw13, dw2, stream, between,
                         {p.first, p.end});
  if (dX_between) return;
  dX_pass(stream);
  if (dX_queued) dX_queued();
}

void Fp8ExpertFFN::fp8_pass(const Part& part, const Fp8RowBlocks& a, std::int64_t k,
                            const Weights& weights, std::int64_t n, void* out,
                            cudaStream_t stream) {
  const std::uint8_t* b = weights.codes.as<std::uint8_t>() + part.first * n * k;
  const float* b_scales = weights.scales.as<float>() + part.first * weights.tiles.count;
  if (part.grouped) {
    if (part.rows == 0) return;
    const GroupedFp8Operands operands{.a = a.codes,
                                      .a_scales = a.scales,
                                      .b = b,
                                      .b_scales = b_scales,
                                      .b_scale_stride = weights.tiles.count,
                                      .c = out};
    grouped_fp8_gemm(part.offsets, n, k, operands, stream);
    return;
  }
  std::vector<Product> products;
  for (int e = 0; e + 1 < std::ssize(part.offsets); ++e) {
    const std::int64_t first = part.offsets[e], m = part.offsets[e + 1] - first;
    if (m == 0) continue;
    products.push_back({m, n, k, a.codes + first * k, a.scales + first * column_blocks(k),
                        b + e * n * k, b_scales + e * weights.tiles.count,
                        static_cast<char*>(out) + first * n * 2});
  }
  run(products, stream);
}

bool Fp8ExpertFFN::grouped_pass(std::span<const std::int64_t> offsets) const {
  if (offsets.size() != static_cast<std::size_t>(experts_) + 1)
    fail("Fp8ExpertFFN::grouped_pass: {} offsets for {} experts (need experts + 1)", offsets.size(),
         experts_);
  if (products_ != Fp8Products::kAuto) return products_ == Fp8Products::kGrouped;
  if (!grouped_available_) return false;
  std::int64_t with_rows = 0;
  for (std::size_t e = 0; e + 1 < offsets.size(); ++e) with_rows += offsets[e + 1] > offsets[e];
  return offsets.back() < grouped_rows_limit() * std::max<std::int64_t>(with_rows, 1);
}

std::int64_t Fp8ExpertFFN::grouped_rows_limit() const {
  return static_cast<std::int64_t>(
      std::ceil(kGroupedMacsLimit / (3.0 * static_cast<double>(hidden_) * ffn_)));
}

void Fp8ExpertFFN::run(std::vector<Product> products, cudaStream_t stream) {
  if (products.empty()) return;
  // Largest first, each to the least loaded stream, so that no stream is left with a long tail.
  const auto work = [](const Product& p) { return p.m * p.n * std::max<std::int64_t>(p.k, 1); };
  std::stable_sort(products.begin(), products.end(),
                   [&](const Product& x, const Product& y) { return work(x) > work(y); });
  const std::size_t lanes = std::min(streams_.size(), products.size());
  std::vector<std::int64_t> load(lanes, 0);
  fork_.record(stream);
  for (std::size_t s = 0; s < lanes; ++s)
    MOE_CHECK_CUDA(cudaStreamWaitEvent(streams_[s].get(), fork_.get(), 0));
  for (const Product& p : products) {
    const auto lane =
        static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    load[lane] += work(p);
    gemms_[lane]->run(p.m, p.n, p.k, p.a, p.a_scales, p.b, p.b_scales, p.c, DType::kBF16,
                      streams_[lane].get());
  }
  for (std::size_t s = 0; s < lanes; ++s) {
    joins_[s].record(streams_[s].get());
    MOE_CHECK_CUDA(cudaStreamWaitEvent(stream, joins_[s].get(), 0));
  }
}

}  // namespace moe
