// Block-scaled FP8 products on this GPU's cuBLASLt (kernels/gemm_fp8.h), against bf16:
//  1. whether cuBLASLt offers 1 × 128 activation and 128 × 128 weight scales here, and whether
//     its product equals the fp64 product of the dequantized operands with the scales laid out
//     as row_block_scales / tile_scales say (other layouts are tried and named if not);
//  2. the dense 8192³ rate, FP8 against bf16, under sustained load: FP8's ceiling;
//  3. the expert forward products of the model shapes at T = 8192 (rows per expert as routing
//     gives them), one product per expert on one stream, FP8 against bf16 on the same row
//     counts, and the quantization passes an FP8 step adds (activations: one launch over every
//     row; weights: once per step).
#include <fmt/format.h>

#include <cmath>
#include <random>

#include "bench/bench_util.h"
#include "kernels/fp8_quantize.cuh"
#include "kernels/gemm_fp8.h"
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
               qb.codes.as<std::uint8_t>(), qb.scales.as<float>(), c.data(), DType::kBF16,
               stream);
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
  fmt::print("dense 8192^3, sustained: bf16 {:.0f} TFLOP/s, block-scaled FP8 {:.0f} TFLOP/s ({:.2f}x)\n",
             bf16.sustained / 1e12, fp8 / 1e12, fp8 / bf16.sustained);
  return {{"bf16_TFLOPs", bf16.sustained / 1e12}, {"fp8_TFLOPs", fp8 / 1e12},
          {"ratio", fp8 / bf16.sustained}};
}

// Part 3: one model shape's expert forward products.
nlohmann::json expert_products(const std::string& name, BlockScaledGemm& fp8,
                               const bench::Options& options, cudaStream_t stream) {
  const auto config = load_config(std::string(MOE_SOURCE_DIR) + "/configs/" + name + ".yaml");
  const std::int64_t T = 8192, H = config.hidden, F = config.ffn_hidden, E = config.num_experts;
  const auto offsets = bench::routed_offsets(T, config.topk, static_cast<int>(E), 16);
  const std::int64_t rows = offsets.back();
  const DType d = DType::kBF16;
  DeviceBuffer X(rows * H * 2), a(rows * F * 2), h(rows * 2 * F * 2), y(rows * H * 2),
      w13(E * 2 * F * H * 2), w2(E * H * F * 2);
  init_normal(Tensor(X.data(), d, {rows, H}), 31, 0, 1.0f, stream);
  init_normal(Tensor(a.data(), d, {rows, F}), 32, 0, 1.0f, stream);
  init_normal(Tensor(w13.data(), d, {E * 2 * F, H}), 33, 0, 0.02f, stream);
  init_normal(Tensor(w2.data(), d, {E * H, F}), 34, 0, 0.02f, stream);

  GemmRunner bf16(kDefaultGemmWorkspaceBytes, std::make_shared<GemmTuning>());
  auto bf16_products = [&](int) {
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int64_t r0 = offsets[e], n_e = offsets[e + 1] - r0;
      if (n_e == 0) continue;
      bf16.run({n_e, 2 * F, H, false, true, d, d, d}, X.as<std::byte>() + r0 * H * 2,
               w13.as<std::byte>() + e * 2 * F * H * 2, h.as<std::byte>() + r0 * 2 * F * 2,
               stream);
      bf16.run({n_e, H, F, false, true, d, d, d}, a.as<std::byte>() + r0 * F * 2,
               w2.as<std::byte>() + e * H * F * 2, y.as<std::byte>() + r0 * H * 2, stream);
    }
  };
  // Activation scales per expert: its row blocks' layout over its own rows, at the expert's
  // first row times the column blocks (what a permute that quantizes would write).
  const std::int64_t xb = (H + 127) / 128, ab = (F + 127) / 128;
  DeviceBuffer Xq(rows * H), aq(rows * F), Xs(rows * xb * 4), as(rows * ab * 4), w13q(E * 2 * F * H),
      w2q(E * H * F);
  const ScaleBuffer w13_tiles = tile_scales(2 * F, H), w2_tiles = tile_scales(H, F);
  DeviceBuffer w13s(E * w13_tiles.count * 4), w2s(E * w2_tiles.count * 4);
  auto quantize_activations = [&](int) {
    quantize_row_blocks(X.data(), rows, H, Xq.as<std::uint8_t>(), Xs.as<float>(),
                        row_block_scales(rows, H).layout, stream);
    quantize_row_blocks(a.data(), rows, F, aq.as<std::uint8_t>(), as.as<float>(),
                        row_block_scales(rows, F).layout, stream);
  };
  auto quantize_weights = [&](int) {
    for (std::int64_t e = 0; e < E; ++e) {
      quantize_tiles(w13.as<std::byte>() + e * 2 * F * H * 2, 2 * F, H,
                     w13q.as<std::uint8_t>() + e * 2 * F * H, w13s.as<float>() + e * w13_tiles.count,
                     w13_tiles.layout, stream);
      quantize_tiles(w2.as<std::byte>() + e * H * F * 2, H, F, w2q.as<std::uint8_t>() + e * H * F,
                     w2s.as<float>() + e * w2_tiles.count, w2_tiles.layout, stream);
    }
  };
  quantize_activations(0);
  quantize_weights(0);
  auto fp8_products = [&](int) {
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int64_t r0 = offsets[e], n_e = offsets[e + 1] - r0;
      if (n_e == 0) continue;
      fp8.run(n_e, 2 * F, H, Xq.as<std::uint8_t>() + r0 * H, Xs.as<float>() + r0 * xb,
              w13q.as<std::uint8_t>() + e * 2 * F * H, w13s.as<float>() + e * w13_tiles.count,
              h.as<std::byte>() + r0 * 2 * F * 2, d, stream);
      fp8.run(n_e, H, F, aq.as<std::uint8_t>() + r0 * F, as.as<float>() + r0 * ab,
              w2q.as<std::uint8_t>() + e * H * F, w2s.as<float>() + e * w2_tiles.count,
              y.as<std::byte>() + r0 * H * 2, d, stream);
    }
  };
  bench::run_for_ms(
      [&](int i) {
        bf16_products(i);
        fp8_products(i);
      },
      stream, bench::kSteadyStateMs);
  const int warmup = options.quick ? 2 : 5, repeats = options.quick ? 5 : 15;
  const double bf16_ms = bench::median_ms(bf16_products, stream, warmup, repeats);
  const double fp8_ms = bench::median_ms(fp8_products, stream, warmup, repeats);
  const double act_ms = bench::median_ms(quantize_activations, stream, warmup, repeats);
  const double weight_ms = bench::median_ms(quantize_weights, stream, warmup, repeats);
  const double flop = 6.0 * static_cast<double>(T * config.topk) * H * F;
  fmt::print("{:<16} {:>8} {:>9.3f} {:>9.3f} {:>7.2f}x {:>9.3f} {:>9.3f} {:>7.2f}x {:>8.0f} {:>8.0f}\n",
             name, rows / E, bf16_ms, fp8_ms, bf16_ms / fp8_ms, act_ms, weight_ms,
             bf16_ms / (fp8_ms + act_ms), flop / (bf16_ms * 1e-3) / 1e12,
             flop / (fp8_ms * 1e-3) / 1e12);
  return {{"name", name},          {"rows", rows},
          {"bf16_ms", bf16_ms},    {"fp8_ms", fp8_ms},
          {"quantize_activations_ms", act_ms}, {"quantize_weights_ms", weight_ms},
          {"speedup_products", bf16_ms / fp8_ms},
          {"speedup_with_activation_quantization", bf16_ms / (fp8_ms + act_ms)}};
}

}  // namespace

int main(int argc, char** argv) try {
  const auto options = bench::parse_options(argc, argv);
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
  report["dense"] = dense_rates(gemm, stream.get());
  fmt::print("expert forward products, T = 8192, one product per expert on one stream:\n");
  fmt::print("{:<16} {:>8} {:>9} {:>9} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8}\n", "shape", "rows/E",
             "bf16 ms", "fp8 ms", "ratio", "q act ms", "q w ms", "w/ q act", "bf16 TF", "fp8 TF");
  for (const char* name : {"mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"}) {
    if (!options.selected(name)) continue;
    report["experts"].push_back(expert_products(name, gemm, options, stream.get()));
  }
  options.check_matched();
  bench::write_json(options, report);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_fp8_gemm: %s\n", e.what());
  return 1;
}
