// Block-scaled FP8 products on this GPU's cuBLASLt (kernels/gemm_fp8.h), against bf16:
//  1. whether cuBLASLt offers 1 × 128 activation and 128 × 128 weight scales here, and whether
//     its product equals the fp64 product of the dequantized operands with the scales laid out
//     as row_block_scales / tile_scales say (other layouts are tried and named if not);
//  2. the dense 8192³ rate, FP8 against bf16, under sustained load: FP8's ceiling;
//  3. the experts at the model shapes, T = 8192 (rows per expert as routing gives them; more
//     tokens, --expert-tokens, give the rows a rank of an EP mesh sees):
//     Fp8ExpertFFN, its activations' quantization included, against the bf16 ExpertFFN as the
//     layer runs it, forward and forward + backward; and the weights' quantization, once per
//     step.
//  4. the grouped products (kernels/grouped_fp8_gemm.cuh, every expert in one launch) against
//     cuBLASLt's, one expert a call, at the same shapes: the forward's two products, each against
//     its floor (part 2's FP8 rate, the copy rate measured here); and in part 3, the FP8 experts
//     with their passes grouped (columns "fwd grp", "step grp");
//  5. the SwiGLU with its output quantized for the next product, forward and backward, in one
//     pass (kernels/swiglu.cuh) against the SwiGLU then the quantizer, each against its bytes at
//     the copy rate.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "bench/bench_util.h"
#include "bench/stage_floors.h"
#include "kernels/experts.h"
#include "kernels/experts_fp8.h"
#include "kernels/fp8_quantize.cuh"
#include "kernels/gemm_fp8.h"
#include "kernels/grouped_fp8_gemm.cuh"
#include "kernels/swiglu.cuh"
#include "moe/config.h"
#include "reference/reference.h"

using namespace moe;

namespace {

struct Quantized {
  DeviceBuffer codes, scales;
};

Quantized quantize(const DeviceBuffer& x, std::int64_t rows, std::int64_t cols, bool tiles,
                   ScaleLayout layout, std::int64_t scale_count, cudaStream_t stream) {
  Quantized q{DeviceBuffer(static_cast<std::size_t>(rows * cols)),
              DeviceBuffer(static_cast<std::size_t>(scale_count) * 4)};
  MOE_CHECK_CUDA(cudaMemsetAsync(q.scales.data(), 0, q.scales.bytes(), stream));
  if (tiles) {
    quantize_tiles(x.data(), rows, cols, q.codes.as<std::uint8_t>(), q.scales.as<float>(), layout,
                   stream);
  } else {
    quantize_row_blocks(x.data(), rows, cols, q.codes.as<std::uint8_t>(), q.scales.as<float>(),
                        layout, stream);
  }
  return q;
}

template <typename T>
std::vector<T> to_host(const DeviceBuffer& buffer) {
  std::vector<T> values(buffer.bytes() / sizeof(T));
  copy_to_host(values.data(), buffer.data(), buffer.bytes());
  return values;
}

// Largest |C_gpu − C_exact| / Σ_k |a·b| over 512 sampled entries, C_exact the fp64 product of the
// dequantized operands read with the given layouts: ~2^-9 (bf16 output) when cuBLASLt reads the
// scales as laid out, order 1 when not.
double layout_error(std::int64_t m, std::int64_t n, std::int64_t k, const Quantized& a,
                    ScaleLayout a_layout, const Quantized& b, ScaleLayout b_layout,
                    const DeviceBuffer& c) {
  const auto a_codes = to_host<std::uint8_t>(a.codes), b_codes = to_host<std::uint8_t>(b.codes);
  const auto a_scales = to_host<float>(a.scales), b_scales = to_host<float>(b.scales);
  const auto out = to_host<BF16>(c);
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::int64_t> row(0, m - 1), col(0, n - 1);
  double worst = 0;
  for (int sample = 0; sample < 512; ++sample) {
    const std::int64_t i = row(rng), j = col(rng);
    double exact = 0, magnitude = 0;
    for (std::int64_t t = 0; t < k; ++t) {
      const double av =
          reference::from_e4m3(a_codes[static_cast<std::size_t>(i * k + t)]) *
          a_scales[static_cast<std::size_t>(i * a_layout.stride_a + (t / 128) * a_layout.stride_b)];
      const double bv = reference::from_e4m3(b_codes[static_cast<std::size_t>(j * k + t)]) *
                        b_scales[static_cast<std::size_t>((j / 128) * b_layout.stride_a +
                                                          (t / 128) * b_layout.stride_b)];
      exact += av * bv;
      magnitude += std::fabs(av * bv);
    }
    const double got = from_bf16(out[static_cast<std::size_t>(i * n + j)]);
    worst = std::max(worst, std::fabs(got - exact) / std::max(magnitude, 1e-30));
  }
  return worst;
}

// Part 1: the product at a small shape whose column blocks (5) are no multiple of 4, so that a
// wrong padding shows, under each candidate layout.
nlohmann::json check_layouts(BlockScaledGemm& gemm, cudaStream_t stream) {
  const std::int64_t m = 256, n = 384, k = 640, kb = k / 128;
  nlohmann::json result = {{"m", m}, {"n", n}, {"k", k}};
  std::string why;
  if (!gemm.available(m, n, k, DType::kBF16, &why)) {
    fmt::print("block-scaled FP8: NOT AVAILABLE: {}\n", why);
    result["available"] = false;
    result["why"] = why;
    return result;
  }
  result["available"] = true;
  DeviceBuffer x(m * k * 2), w(n * k * 2), c(m * n * 2);
  init_normal(Tensor(x.data(), DType::kBF16, {m, k}), 11, 0, 1.0f, stream);
  init_normal(Tensor(w.data(), DType::kBF16, {n, k}), 12, 0, 0.05f, stream);
  const ScaleBuffer rows = row_block_scales(m, k), tiles = tile_scales(n, k);
  struct Candidate {
    const char* name;
    ScaleLayout layout;
  };
  const std::int64_t nb = (n + 127) / 128;
  const Candidate row_candidates[] = {{"column blocks contiguous over rows (library)", rows.layout},
                                      {"row-major", {kb, 1}}};
  const Candidate tile_candidates[] = {{"row-major, columns padded to 4 (library)", tiles.layout},
                                       {"row-major", {kb, 1}},
                                       {"column-major", {1, nb}},
                                       {"column-major, rows padded to 4", {1, (nb + 3) / 4 * 4}}};
  const std::int64_t room = 64 * 64;  // scale buffers large enough for every candidate
  bool library_agrees = false;
  for (const Candidate& r : row_candidates) {
    for (const Candidate& t : tile_candidates) {
      const Quantized qa = quantize(x, m, k, false, r.layout, room, stream);
      const Quantized qb = quantize(w, n, k, true, t.layout, room, stream);
      MOE_CHECK_CUDA(cudaMemsetAsync(c.data(), 0xFF, c.bytes(), stream));
      gemm.run(m, n, k, qa.codes.as<std::uint8_t>(), qa.scales.as<float>(),
               qb.codes.as<std::uint8_t>(), qb.scales.as<float>(), c.data(), DType::kBF16, stream);
      MOE_CHECK_CUDA(cudaStreamSynchronize(stream));
      const double error = layout_error(m, n, k, qa, r.layout, qb, t.layout, c);
      const bool agrees = error < 1e-2;
      fmt::print("  activations {:<46} weights {:<42} error {:.2e} {}\n", r.name, t.name, error,
                 agrees ? "AGREES" : "");
      result["candidates"].push_back(
          {{"activations", r.name}, {"weights", t.name}, {"error", error}, {"agrees", agrees}});
      if (&r == &row_candidates[0] && &t == &tile_candidates[0]) library_agrees = agrees;
    }
  }
  result["library_layout_agrees"] = library_agrees;
  fmt::print("block-scaled FP8 available; the library's scale layouts {}\n",
             library_agrees ? "agree with cuBLASLt" : "DO NOT agree with cuBLASLt");
  return result;
}

// Part 1b: a strided batch of products (experts padded to one row count) against the same
// products one by one.
nlohmann::json check_batched(BlockScaledGemm& gemm, cudaStream_t stream) {
  const std::int64_t m = 256, n = 384, k = 640;
  const int batch = 4;
  std::string why;
  if (!gemm.batched_available(m, n, k, batch, DType::kBF16, &why)) {
    fmt::print("block-scaled FP8 in a strided batch: NOT AVAILABLE: {}\n", why);
    return {{"available", false}, {"why", why}};
  }
  DeviceBuffer x(batch * m * k * 2), w(batch * n * k * 2), c(batch * m * n * 2),
      one(batch * m * n * 2);
  init_normal(Tensor(x.data(), DType::kBF16, {batch * m, k}), 13, 0, 1.0f, stream);
  init_normal(Tensor(w.data(), DType::kBF16, {batch * n, k}), 14, 0, 0.05f, stream);
  const std::int64_t a_count = row_block_scales(m, k).count;
  const ScaleBuffer tiles = tile_scales(n, k);
  DeviceBuffer xq(batch * m * k), xs(batch * a_count * 4), wq(batch * n * k),
      ws(batch * tiles.count * 4);
  std::vector<std::int64_t> offsets;
  for (int b = 0; b <= batch; ++b) offsets.push_back(b * m);
  quantize_row_blocks_segmented(x.data(), offsets, k, xq.as<std::uint8_t>(), xs.as<float>(),
                                stream);
  for (int b = 0; b < batch; ++b) {
    quantize_tiles(w.as<std::byte>() + b * n * k * 2, n, k, wq.as<std::uint8_t>() + b * n * k,
                   ws.as<float>() + b * tiles.count, tiles.layout, stream);
    gemm.run(m, n, k, xq.as<std::uint8_t>() + b * m * k, xs.as<float>() + b * a_count,
             wq.as<std::uint8_t>() + b * n * k, ws.as<float>() + b * tiles.count,
             one.as<std::byte>() + b * m * n * 2, DType::kBF16, stream);
  }
  MOE_CHECK_CUDA(cudaMemsetAsync(c.data(), 0xFF, c.bytes(), stream));
  gemm.run_batched(m, n, k, batch, xq.as<std::uint8_t>(), xs.as<float>(), wq.as<std::uint8_t>(),
                   ws.as<float>(), c.data(), DType::kBF16, stream);
  MOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  const auto batched = to_host<BF16>(c), single = to_host<BF16>(one);
  double largest = 0, difference = 0;
  for (std::size_t i = 0; i < single.size(); ++i) {
    largest = std::max(largest, std::fabs(static_cast<double>(from_bf16(single[i]))));
    const double d = std::fabs(static_cast<double>(from_bf16(batched[i])) - from_bf16(single[i]));
    difference = std::isnan(d) ? INFINITY : std::max(difference, d);
  }
  const double relative = difference / std::max(largest, 1e-30);
  const bool agrees = relative < 1e-2;
  fmt::print(
      "block-scaled FP8 in a strided batch of {}: largest difference from single products "
      "{:.2e} of the largest value: {}\n",
      batch, relative, agrees ? "AGREES" : "DOES NOT AGREE");
  return {{"available", true}, {"relative_difference", relative}, {"agrees", agrees}};
}

// Part 2: the dense 8192³ rates.
nlohmann::json dense_rates(BlockScaledGemm& gemm, cudaStream_t stream) {
  const std::int64_t n = 8192;
  const bench::GemmRate bf16 = bench::dense_gemm_rate(stream);
  DeviceBuffer x(n * n * 2), w(n * n * 2), c(n * n * 2);
  init_normal(Tensor(x.data(), DType::kBF16, {n, n}), 21, 0, 1.0f, stream);
  init_normal(Tensor(w.data(), DType::kBF16, {n, n}), 22, 0, 1.0f, stream);
  const ScaleBuffer rows = row_block_scales(n, n), tiles = tile_scales(n, n);
  const Quantized qa = quantize(x, n, n, false, rows.layout, rows.count, stream);
  const Quantized qb = quantize(w, n, n, true, tiles.layout, tiles.count, stream);
  auto product = [&](int) {
    gemm.run(n, n, n, qa.codes.as<std::uint8_t>(), qa.scales.as<float>(),
             qb.codes.as<std::uint8_t>(), qb.scales.as<float>(), c.data(), DType::kBF16, stream);
  };
  const double flop = 2.0 * n * n * n;
  bench::run_for_ms(product, stream, bench::kSteadyStateMs);
  const double fp8 = flop / (bench::median_ms(product, stream, 0, 20) * 1e-3);
  fmt::print(
      "dense 8192^3, sustained: bf16 {:.0f} TFLOP/s, block-scaled FP8 {:.0f} TFLOP/s ({:.2f}x)\n",
      bf16.sustained / 1e12, fp8 / 1e12, fp8 / bf16.sustained);
  return {{"bf16_TFLOPs", bf16.sustained / 1e12},
          {"fp8_TFLOPs", fp8 / 1e12},
          {"ratio", fp8 / bf16.sustained}};
}

// Part 3: one model shape's experts, FP8 (Fp8ExpertFFN: quantization, products, SwiGLU)
// against bf16 (ExpertFFN as the layer runs it) on the same rows: the forward alone, and forward +
// backward replayed from CUDA graphs (the GPU's time: queueing hundreds of per-expert products
// keeps the host busier than the device otherwise, as in a captured step).
nlohmann::json expert_step(const std::string& name, std::int64_t T, const bench::Options& options,
                           int streams, bool grouped, cudaStream_t stream) {
  const auto config = load_config(std::string(MOE_SOURCE_DIR) + "/configs/" + name + ".yaml");
  const std::int64_t H = config.hidden, F = config.ffn_hidden;
  const DType d = DType::kBF16, g = config.grad_dtype;
  // Weights, their gradients and the FP8 copies of the weights and their transposes: at
  // deepseek-v3 all 256 experts take 68 GB. Where they do not fit in half the free memory, the
  // GPU keeps the experts one rank of an expert-parallel mesh would (E / 2, E / 4, ...), with
  // their rows of the same routing.
  std::size_t free_bytes = 0, total_bytes = 0;
  MOE_CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  std::int64_t E = config.num_experts;
  const auto expert_bytes = [&](std::int64_t experts) {
    return static_cast<double>(experts * 3 * H * F) * (2.0 + dtype_size(g) + (grouped ? 4.0 : 2.0));
  };
  while (E > 1 && expert_bytes(E) > 0.5 * static_cast<double>(free_bytes)) E /= 2;
  auto offsets = bench::routed_offsets(T, config.topk, config.num_experts, 16);
  offsets.resize(static_cast<std::size_t>(E) + 1);
  const std::int64_t rows = offsets.back();
  ExpertFFN bf16(static_cast<int>(H), static_cast<int>(F), static_cast<int>(E), d,
                 ExpertSchedule::kBatched, 4,
                 static_cast<std::size_t>(config.activation_chunk_mib * (1 << 20)));
  Fp8ExpertFFN fp8(static_cast<int>(H), static_cast<int>(F), static_cast<int>(E), streams,
                   kDefaultGemmWorkspaceBytes, Fp8Products::kPerExpert);
  grouped = grouped && E <= kMaxGroupedGemmGroups;
  std::unique_ptr<Fp8ExpertFFN> fp8_grouped;
  if (grouped)
    fp8_grouped = std::make_unique<Fp8ExpertFFN>(static_cast<int>(H), static_cast<int>(F),
                                                 static_cast<int>(E), streams,
                                                 kDefaultGemmWorkspaceBytes, Fp8Products::kGrouped);
  const std::int64_t chunk_rows = bf16.activation_rows(offsets);
  DeviceBuffer X(rows * H * 2), dY(rows * H * 2), y(rows * H * 2), dX(rows * H * 2),
      h(rows * 2 * F * 2), a(rows * F * 2), dA(rows * F * 2), w13(E * 2 * F * H * 2),
      w2(E * H * F * 2), dw13(E * 2 * F * H * dtype_size(g)), dw2(E * H * F * dtype_size(g));
  init_normal(Tensor(X.data(), d, {rows, H}), 31, 0, 1.0f, stream);
  init_normal(Tensor(dY.data(), d, {rows, H}), 32, 0, 1.0f, stream);
  init_normal(Tensor(w13.data(), d, {E * 2 * F, H}), 33, 0, 0.02f, stream);
  init_normal(Tensor(w2.data(), d, {E * H, F}), 34, 0, 0.02f, stream);
  const Tensor X_t(X.data(), d, {rows, H}), y_t(y.data(), d, {rows, H}),
      dY_t(dY.data(), d, {rows, H}), dX_t(dX.data(), d, {rows, H}),
      w13_t(w13.data(), d, {E, 2 * F, H}), w2_t(w2.data(), d, {E, H, F}),
      dw13_t(dw13.data(), g, {E, 2 * F, H}), dw2_t(dw2.data(), g, {E, H, F});
  // dh over h and dA over a where the layer puts them; FP8 keeps a over every row.
  const ExpertActivations bf16_act{.h = Tensor(h.data(), d, {rows, 2 * F}),
                                   .a = Tensor(a.data(), d, {chunk_rows, F}),
                                   .dA = Tensor(a.data(), d, {chunk_rows, F}),
                                   .dh = Tensor(h.data(), d, {rows, 2 * F})};
  const ExpertActivations fp8_act{.h = Tensor(h.data(), d, {rows, 2 * F}),
                                  .a = Tensor(a.data(), d, {rows, F}),
                                  .dA = Tensor(dA.data(), d, {rows, F}),
                                  .dh = Tensor(h.data(), d, {rows, 2 * F})};
  auto bf16_forward = [&](int) { bf16.forward(X_t, offsets, w13_t, w2_t, bf16_act, y_t, stream); };
  auto bf16_step = [&](int i) {
    bf16_forward(i);
    bf16.backward(dY_t, X_t, offsets, w13_t, w2_t, bf16_act, false, dX_t, dw13_t, dw2_t, stream);
  };
  auto quantize_weights = [&](int) { fp8.quantize_weights(w13_t, w2_t, stream); };
  quantize_weights(0);
  if (grouped) fp8_grouped->quantize_weights(w13_t, w2_t, stream);
  auto grouped_forward = [&](int) { fp8_grouped->forward(X_t, offsets, fp8_act, y_t, stream); };
  auto grouped_step = [&](int i) {
    grouped_forward(i);
    fp8_grouped->backward(dY_t, X_t, offsets, fp8_act, dX_t, dw13_t, dw2_t, stream);
  };
  auto fp8_forward = [&](int) { fp8.forward(X_t, offsets, fp8_act, y_t, stream); };
  auto fp8_step = [&](int i) {
    fp8_forward(i);
    fp8.backward(dY_t, X_t, offsets, fp8_act, dX_t, dw13_t, dw2_t, stream);
  };
  bench::run_for_ms(
      [&](int i) {
        bf16_step(i);
        fp8_step(i);
        if (grouped) grouped_step(i);
      },
      stream, bench::kSteadyStateMs);
  const int warmup = options.quick ? 2 : 5, repeats = options.quick ? 5 : 15;
  const double bf16_ms = bench::median_ms(bf16_forward, stream, warmup, repeats);
  const double fp8_ms = bench::median_ms(fp8_forward, stream, warmup, repeats);
  const CudaGraph bf16_graph(stream, [&] { bf16_step(0); });
  const CudaGraph fp8_graph(stream, [&] { fp8_step(0); });
  const double bf16_step_ms =
      bench::median_ms([&](int) { bf16_graph.replay(stream); }, stream, warmup, repeats);
  const double fp8_step_ms =
      bench::median_ms([&](int) { fp8_graph.replay(stream); }, stream, warmup, repeats);
  const double weight_ms = bench::median_ms(quantize_weights, stream, warmup, repeats);
  double grouped_ms = 0, grouped_step_ms = 0;
  if (grouped) {
    grouped_ms = bench::median_ms(grouped_forward, stream, warmup, repeats);
    const CudaGraph grouped_graph(stream, [&] { grouped_step(0); });
    grouped_step_ms =
        bench::median_ms([&](int) { grouped_graph.replay(stream); }, stream, warmup, repeats);
  }
  // The weights' quantization reads bf16 and writes E4M3 twice (each weight and its transpose).
  const double weight_bytes = 4.0 * static_cast<double>(E * 3 * H * F);
  fmt::print(
      "{:<16} {:>4} {:>7} {:>9.3f} {:>9.3f} {:>6.2f}x {:>10.3f} {:>10.3f} {:>6.2f}x {:>8.3f} "
      "{:>8.0f} {:>9.3f} {:>10.3f}\n",
      name, E, rows / E, bf16_ms, fp8_ms, bf16_ms / fp8_ms, bf16_step_ms, fp8_step_ms,
      bf16_step_ms / fp8_step_ms, weight_ms, weight_bytes / (weight_ms * 1e-3) / 1e9, grouped_ms,
      grouped_step_ms);
  return {{"name", name},
          {"tokens", T},
          {"experts", E},
          {"rows", rows},
          {"grad_dtype", dtype_name(g)},
          {"bf16_forward_ms", bf16_ms},
          {"fp8_forward_ms", fp8_ms},
          {"forward_speedup", bf16_ms / fp8_ms},
          {"bf16_step_graph_ms", bf16_step_ms},
          {"fp8_step_graph_ms", fp8_step_ms},
          {"step_speedup", bf16_step_ms / fp8_step_ms},
          {"quantize_weights_ms", weight_ms},
          {"quantize_weights_GBps", weight_bytes / (weight_ms * 1e-3) / 1e9},
          {"fp8_grouped_forward_ms", grouped_ms},
          {"fp8_grouped_step_graph_ms", grouped_step_ms}};
}

// Part 4: one model shape's forward products (h = X·w13ᵀ, then y = a·w2ᵀ), every expert's rows
// as routing gives them: cuBLASLt one expert a call, against the grouped products in one launch,
// each product's TFLOP/s, its floor (the FLOPs at the dense FP8 rate or the operands' and output's
// bytes at the copy rate, both measured in this run, whichever is larger) and each run's share of
// it, and the two outputs' largest difference relative to their largest value.
nlohmann::json grouped_products(const std::string& name, const bench::Options& options,
                                const bench::Rates& rates, BlockScaledGemm& gemm,
                                cudaStream_t stream) {
  const auto config = load_config(std::string(MOE_SOURCE_DIR) + "/configs/" + name + ".yaml");
  const std::int64_t T = 8192, H = config.hidden, F = config.ffn_hidden;
  const std::int64_t E = std::min<std::int64_t>(config.num_experts, kMaxGroupedGemmGroups);
  auto offsets = bench::routed_offsets(T, config.topk, config.num_experts, 16);
  offsets.resize(static_cast<std::size_t>(E) + 1);
  const std::int64_t rows = offsets.back();
  nlohmann::json out = {{"name", name}, {"experts", E}, {"rows", rows}};
  for (const auto& [product, n, k] : {std::tuple{"X·w13", 2 * F, H}, std::tuple{"a·w2", H, F}}) {
    const std::int64_t kb = (k + kFP8Block - 1) / kFP8Block;
    const ScaleBuffer tiles = tile_scales(n, k);
    DeviceBuffer x(rows * k * 2), w(E * n * k * 2), x_codes(rows * k), x_scales(rows * kb * 4),
        w_codes(E * n * k), w_scales(E * tiles.count * 4), c_each(rows * n * 2),
        c_grouped(rows * n * 2);
    init_normal(Tensor(x.data(), DType::kBF16, {rows, k}), 41, 0, 1.0f, stream);
    init_normal(Tensor(w.data(), DType::kBF16, {E * n, k}), 42, 0, 0.02f, stream);
    quantize_row_blocks_segmented(x.data(), offsets, k, x_codes.as<std::uint8_t>(),
                                  x_scales.as<float>(), stream);
    quantize_tiles(w.data(), E, n, k,
                   TileOutput{w_codes.as<std::uint8_t>(), w_scales.as<float>(), tiles},
                   TileOutput{}, stream);
    auto each = [&](int) {
      for (std::int64_t e = 0; e < E; ++e) {
        const std::int64_t first = offsets[e], m = offsets[e + 1] - first;
        if (m == 0) continue;
        gemm.run(m, n, k, x_codes.as<std::uint8_t>() + first * k, x_scales.as<float>() + first * kb,
                 w_codes.as<std::uint8_t>() + e * n * k, w_scales.as<float>() + e * tiles.count,
                 c_each.as<char>() + first * n * 2, DType::kBF16, stream);
      }
    };
    const GroupedFp8Operands operands{.a = x_codes.as<std::uint8_t>(),
                                      .a_scales = x_scales.as<float>(),
                                      .b = w_codes.as<std::uint8_t>(),
                                      .b_scales = w_scales.as<float>(),
                                      .b_scale_stride = tiles.count,
                                      .c = c_grouped.data()};
    auto grouped = [&](int) { grouped_fp8_gemm(offsets, n, k, operands, stream); };
    const int warmup = options.quick ? 2 : 5, repeats = options.quick ? 5 : 15;
    const double each_ms = bench::median_ms(each, stream, warmup, repeats);
    const double grouped_ms = bench::median_ms(grouped, stream, warmup, repeats);
    const auto a = to_host<BF16>(c_each), b = to_host<BF16>(c_grouped);
    double largest = 0, difference = 0;
    for (std::size_t i = 0; i < static_cast<std::size_t>(rows * n); ++i) {
      const double u = from_bf16(a[i]), v = from_bf16(b[i]);
      largest = std::max(largest, std::fabs(u));
      difference = std::max(difference, std::isfinite(v) ? std::fabs(u - v) : 1e30);
    }
    const double flop = 2.0 * static_cast<double>(rows * n * k);
    const bench::StageWork work{.name = product,
                                .flops = flop,
                                .bytes = static_cast<double>(rows * k + E * n * k + rows * n * 2)};
    const double floor_ms = work.floor_ms(rates);
    fmt::print(
        "{:<16} {:>6} {:>4} {:>7} {:>10.3f} {:>8.0f} {:>5.0f}% {:>10.3f} {:>8.0f} {:>5.0f}% "
        "{:>6.2f}x "
        "{:>9.3f} {:>9.1e}\n",
        name, product, E, rows / E, each_ms, flop / (each_ms * 1e-3) / 1e12,
        100 * floor_ms / each_ms, grouped_ms, flop / (grouped_ms * 1e-3) / 1e12,
        100 * floor_ms / grouped_ms, each_ms / grouped_ms, floor_ms,
        difference / std::max(largest, 1e-30));
    out[product] = {{"n", n},
                    {"k", k},
                    {"per_expert_ms", each_ms},
                    {"grouped_ms", grouped_ms},
                    {"per_expert_TFLOPs", flop / (each_ms * 1e-3) / 1e12},
                    {"grouped_TFLOPs", flop / (grouped_ms * 1e-3) / 1e12},
                    {"floor_ms", floor_ms},
                    {"largest_relative_difference", difference / std::max(largest, 1e-30)}};
  }
  return out;
}

// Part 5: at one model shape's routed rows, the SwiGLU and the quantization of its output (a in
// the forward, dh in the backward, the operands of the next FP8 product), the rows weighed as the
// layer weighs them on one GPU: two passes against one. The floor is the one pass's bytes (what
// it must read and write) at the copy rate; the two passes read a or dh once more.
nlohmann::json swiglu_quantization(const std::string& name, const bench::Options& options,
                                   const bench::Rates& rates, cudaStream_t stream) {
  const auto config = load_config(std::string(MOE_SOURCE_DIR) + "/configs/" + name + ".yaml");
  const std::int64_t T = 8192, F = config.ffn_hidden;
  const std::int64_t E = std::min<std::int64_t>(config.num_experts, kMaxQuantizeSegments);
  auto offsets = bench::routed_offsets(T, config.topk, config.num_experts, 16);
  offsets.resize(static_cast<std::size_t>(E) + 1);
  const std::int64_t rows = offsets.back(), blocks = (F + kFP8Block - 1) / kFP8Block;
  const DType d = DType::kBF16;
  DeviceBuffer h(rows * 2 * F * 2), dh(rows * 2 * F * 2), a(rows * F * 2), dA(rows * F * 2),
      scale(rows * 4), dscale(rows * 4), codes(rows * 2 * F), scales(rows * 2 * blocks * 4);
  init_normal(Tensor(h.data(), d, {rows, 2 * F}), 51, 0, 1.0f, stream);
  init_normal(Tensor(dA.data(), d, {rows, F}), 52, 0, 1.0f, stream);
  init_normal(Tensor(scale.data(), DType::kFP32, {rows}), 53, 0, 1.0f, stream);
  const Tensor h_t(h.data(), d, {rows, 2 * F}), dh_t(dh.data(), d, {rows, 2 * F}),
      a_t(a.data(), d, {rows, F}), dA_t(dA.data(), d, {rows, F}),
      scale_t(scale.data(), DType::kFP32, {rows}), dscale_t(dscale.data(), DType::kFP32, {rows});
  const Fp8RowBlocks out{codes.as<std::uint8_t>(), scales.as<float>(), offsets};
  const auto forward_two = [&](int) {
    swiglu_forward(h_t, a_t, stream, scale_t);
    quantize_row_blocks_segmented(a.data(), offsets, F, out.codes, out.scales, stream);
  };
  const auto forward_one = [&](int) { swiglu_forward_fp8(h_t, a_t, out, stream, scale_t); };
  const auto backward_two = [&](int) {
    swiglu_backward(h_t, dA_t, dh_t, a_t, stream, scale_t, dscale_t);
    quantize_row_blocks_segmented(dh.data(), offsets, 2 * F, out.codes, out.scales, stream);
  };
  const auto backward_one = [&](int) {
    swiglu_backward_fp8(h_t, dA_t, dh_t, a_t, out, stream, scale_t, dscale_t);
  };
  const int warmup = options.quick ? 2 : 5, repeats = options.quick ? 5 : 15;
  const double r = static_cast<double>(rows), f = static_cast<double>(F);
  const double scale_bytes = r * static_cast<double>(blocks) * 4;
  // Forward: h in; a, its codes and scales out. Backward: h, dA and the weights in; dh, a, the
  // weights' gradients, dh's codes and scales out.
  const double forward_bytes = r * f * (4 + 2 + 1) + scale_bytes + r * 4;
  const double backward_bytes = r * f * (4 + 2 + 4 + 2 + 2) + 2 * scale_bytes + r * 8;
  nlohmann::json result = {{"name", name}, {"rows", rows}};
  for (const auto& [pass, two, one, bytes] :
       {std::tuple{"forward", std::function<void(int)>(forward_two),
                   std::function<void(int)>(forward_one), forward_bytes},
        std::tuple{"backward", std::function<void(int)>(backward_two),
                   std::function<void(int)>(backward_one), backward_bytes}}) {
    const double two_ms = bench::median_ms(two, stream, warmup, repeats);
    const double one_ms = bench::median_ms(one, stream, warmup, repeats);
    const double floor_ms = bytes / rates.copy_bytes_per_s * 1e3;
    fmt::print("{:<16} {:>8} {:>7} {:>9.3f} {:>5.0f}% {:>9.3f} {:>5.0f}% {:>6.2f}x {:>9.3f}\n",
               name, pass, rows, two_ms, 100 * floor_ms / two_ms, one_ms, 100 * floor_ms / one_ms,
               two_ms / one_ms, floor_ms);
    result[pass] = {{"two_passes_ms", two_ms}, {"one_pass_ms", one_ms}, {"floor_ms", floor_ms}};
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) try {
  int fp8_streams = 4;
  std::vector<std::int64_t> expert_tokens{8192};
  const auto options = bench::parse_options(argc, argv, [&](CLI::App& app) {
    app.add_option("--fp8-streams", fp8_streams, "streams the FP8 experts spread products over")
        ->check(cli::count_in(1, 32));
    app.add_option("--expert-tokens", expert_tokens,
                   "the experts' token counts T (T·K / E rows an expert: a mesh rank at EP = n "
                   "sees n times one GPU's)")
        ->check(cli::count_in(16, 1 << 17));
  });
  Stream stream;
  BlockScaledGemm gemm(std::size_t{32} << 20);
  nlohmann::json report = {{"bench", "fp8_gemm"},
                           {"device", bench::device_name()},
                           {"cublasLt_version", cublasLtGetVersion()}};
  fmt::print("cuBLASLt {} on {}\n", cublasLtGetVersion(), bench::device_name());
  report["layouts"] = check_layouts(gemm, stream.get());
  if (!report["layouts"]["available"].get<bool>()) {
    bench::write_json(options, report);
    return 0;
  }
  report["batched"] = check_batched(gemm, stream.get());
  report["dense"] = dense_rates(gemm, stream.get());
  fmt::print(
      "experts at T = {}: bf16 ExpertFFN (batched) against Fp8ExpertFFN (cuBLASLt over {} "
      "streams; grp: the grouped products), the "
      "forward eager, forward + backward replayed from a graph; the weights' quantization "
      "once per step\n",
      fmt::join(expert_tokens, ", "), fp8_streams);
  int device = 0;
  MOE_CHECK_CUDA(cudaGetDevice(&device));
  const bool grouped = grouped_fp8_gemm_supported(device);
  fmt::print("{:<16} {:>4} {:>7} {:>9} {:>9} {:>7} {:>10} {:>10} {:>7} {:>8} {:>8} {:>9} {:>10}\n",
             "shape", "E", "rows/E", "fwd bf16", "fwd fp8", "", "step bf16", "step fp8", "",
             "q w ms", "q w GB/s", "fwd grp", "step grp");
  report["fp8_streams"] = fp8_streams;
  for (const std::int64_t T : expert_tokens) {
    for (const char* name : {"mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"}) {
      if (!options.selected(name)) continue;
      report["experts"].push_back(
          expert_step(name, T, options, fp8_streams, grouped, stream.get()));
    }
  }
  bench::Rates rates;
  rates.gemm_flops_per_s = report["dense"]["fp8_TFLOPs"].get<double>() * 1e12;
  rates.copy_bytes_per_s = bench::copy_bandwidth(stream.get());
  report["copy_GBps"] = rates.copy_bytes_per_s / 1e9;
  if (grouped) {
    fmt::print(
        "the forward's products at T = 8192: cuBLASLt one expert a call against the grouped "
        "products in one launch; floors at {:.0f} TFLOP/s and {:.0f} GB/s\n",
        rates.gemm_flops_per_s / 1e12, rates.copy_bytes_per_s / 1e9);
    fmt::print("{:<16} {:>6} {:>4} {:>7} {:>10} {:>8} {:>6} {:>10} {:>8} {:>6} {:>7} {:>9} {:>9}\n",
               "shape", "product", "E", "rows/E", "each ms", "TFLOP/s", "floor", "grouped ms",
               "TFLOP/s", "floor", "", "floor ms", "rel diff");
    for (const char* name : {"mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"}) {
      if (!options.selected(name)) continue;
      report["grouped"].push_back(grouped_products(name, options, rates, gemm, stream.get()));
    }
  }
  fmt::print(
      "the SwiGLU and its output's quantization at T = 8192, rows weighed: two passes against "
      "one; floors at {:.0f} GB/s\n",
      rates.copy_bytes_per_s / 1e9);
  fmt::print("{:<16} {:>8} {:>7} {:>9} {:>6} {:>9} {:>6} {:>7} {:>9}\n", "shape", "pass", "rows",
             "two ms", "floor", "one ms", "floor", "", "floor ms");
  for (const char* name : {"mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"}) {
    if (!options.selected(name)) continue;
    report["swiglu_quantization"].push_back(
        swiglu_quantization(name, options, rates, stream.get()));
  }
  options.check_matched();
  bench::write_json(options, report);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_fp8_gemm: %s\n", e.what());
  return 1;
}
