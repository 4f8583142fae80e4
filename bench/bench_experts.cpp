// Expert FFN forward + backward at the mixtral-8x7b, qwen3-30b-a3b and deepseek-v3 shapes, T = 8192
// tokens routed with top-K, all experts local, bf16: TFLOP/s over the dense bf16 GEMM rate (an
// 8192³ product under sustained load) measured in the same run, for every schedule, each timed
// after a warm-up as long as the dense rate's. Row counts as routing gives them
// (bench::routed_offsets), padded to 16 rows as torch._grouped_mm needs; the peer uses the same.
#include <fmt/format.h>

#include <cmath>
#include <memory>

#include "bench/bench_util.h"
#include "kernels/experts.h"
#include "kernels/gemm.h"
#include "moe/config.h"

using namespace moe;

int main(int argc, char** argv) try {
  double chunk_mib = MoEConfig{}.activation_chunk_mib;
  int workspace_mib = static_cast<int>(kDefaultGemmWorkspaceBytes >> 20);
  const auto options = bench::parse_options(argc, argv, [&](CLI::App& app) {
    app.add_option("--chunk-mib", chunk_mib,
                   "the SwiGLU output in chunks of at most this many MiB (0: every row at once)")
        ->check(cli::finite_in(0, 1048576));
    app.add_option("--workspace-mib", workspace_mib, "cuBLASLt workspace per stream, MiB")
        ->check(cli::count_in(0, 4096));
  });
  Stream stream;
  const bench::GemmRate dense = bench::dense_gemm_rate(stream.get());
  const double rate = dense.sustained;
  const std::int64_t T = 8192;
  nlohmann::json report = {{"bench", "experts"},
                           {"device", bench::device_name()},
                           {"tokens", T},
                           {"dense_TFLOPs", rate / 1e12},
                           {"dense_TFLOPs_burst", dense.burst / 1e12},
                           {"results", nlohmann::json::array()}};
  fmt::print(
      "expert FFN fwd+bwd, T={} routed, bf16, bf16 grads, a in chunks of {} MiB, workspace {} "
      "MiB; dense bf16 GEMM {:.0f} TFLOP/s sustained, {:.0f} in a burst ({})\n",
      T, chunk_mib, workspace_mib, rate / 1e12, dense.burst / 1e12, bench::device_name());
  report["activation_chunk_mib"] = chunk_mib;
  report["workspace_mib"] = workspace_mib;
  fmt::print("{:<16} {:>9} {:>12} {:>9} {:>9} {:>9} {:>7}\n", "shape", "schedule", "rows/expert",
             "fwd us", "bwd us", "TFLOP/s", "dense%");
  for (const char* name : {"mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"}) {
    if (!options.selected(name)) continue;
    const auto config = load_config(std::string(MOE_SOURCE_DIR) + "/configs/" + name + ".yaml");
    const std::int64_t H = config.hidden, F = config.ffn_hidden, E = config.num_experts;
    const auto offsets = bench::routed_offsets(T, config.topk, static_cast<int>(E), 16);
    const std::int64_t rows = offsets.back();
    const std::int64_t per_expert = rows / E;  // mean, for the table
    auto make_ffn = [&](ExpertSchedule schedule) {
      return std::make_unique<ExpertFFN>(static_cast<int>(H), static_cast<int>(F),
                                         static_cast<int>(E), DType::kBF16, schedule, 4,
                                         static_cast<std::size_t>(chunk_mib * (1 << 20)),
                                         static_cast<std::size_t>(workspace_mib) << 20);
    };
    const std::int64_t a_rows = make_ffn(ExpertSchedule::kStreams)->activation_rows(offsets);
    DeviceBuffer X(rows * H * 2), dY(rows * H * 2), y(rows * H * 2), dX(rows * H * 2),
        h(rows * 2 * F * 2), a(a_rows * F * 2), dA(a_rows * F * 2), dh(rows * 2 * F * 2),
        w13(E * 2 * F * H * 2), w2(E * H * F * 2), dw13(E * 2 * F * H * 2), dw2(E * H * F * 2);
    // Random values, as training has and as the PyTorch peer uses: a GEMM on constant data draws
    // less power and runs faster, which would flatter the numbers.
    const DType d = DType::kBF16;
    init_normal(Tensor(X.data(), d, {rows, H}), 1, 0, 1.0f, stream.get());
    init_normal(Tensor(dY.data(), d, {rows, H}), 2, 0, 1.0f, stream.get());
    init_normal(Tensor(w13.data(), d, {E, 2 * F, H}), 3, 0, 1.0f / std::sqrt(static_cast<float>(H)),
                stream.get());
    init_normal(Tensor(w2.data(), d, {E, H, F}), 4, 0, 1.0f / std::sqrt(static_cast<float>(F)),
                stream.get());
    const ExpertActivations act{.h = Tensor(h.data(), d, {rows, 2 * F}),
                                .a = Tensor(a.data(), d, {a_rows, F}),
                                .dA = Tensor(dA.data(), d, {a_rows, F}),
                                .dh = Tensor(dh.data(), d, {rows, 2 * F})};
    const Tensor X_t(X.data(), d, {rows, H}), w13_t(w13.data(), d, {E, 2 * F, H}),
        w2_t(w2.data(), d, {E, H, F});
    const double flops_fwd = 6.0 * static_cast<double>(rows * H * F);
    nlohmann::json entry = {
        {"name", name}, {"rows_per_expert", per_expert}, {"activation_rows", a_rows}};
    double best_us = 1e30;
    for (const ExpertSchedule schedule :
         {ExpertSchedule::kStreams, ExpertSchedule::kBatched, ExpertSchedule::kGrouped}) {
      const auto ffn_owned = make_ffn(schedule);
      ExpertFFN& ffn = *ffn_owned;
      auto forward = [&](int) {
        ffn.forward(X_t, offsets, w13_t, w2_t, act, Tensor(y.data(), d, {rows, H}), stream.get());
      };
      auto backward = [&](int) {
        ffn.backward(Tensor(dY.data(), d, {rows, H}), X_t, offsets, w13_t, w2_t, act, false,
                     Tensor(dX.data(), d, {rows, H}), Tensor(dw13.data(), d, {E, 2 * F, H}),
                     Tensor(dw2.data(), d, {E, H, F}), stream.get());
      };
      // Timed at the clock the GPU holds under sustained load, as the dense rate is.
      bench::run_for_ms(
          [&](int i) {
            forward(i);
            backward(i);
          },
          stream.get(), bench::kSteadyStateMs);
      const int warmup = options.quick ? 2 : 5, repeats = options.quick ? 5 : 20;
      const double fwd_us = bench::median_ms(forward, stream.get(), warmup, repeats) * 1e3;
      const double bwd_us = bench::median_ms(backward, stream.get(), warmup, repeats) * 1e3;
      const double tflops = 3.0 * flops_fwd / ((fwd_us + bwd_us) * 1e-6) / 1e12;
      fmt::print("{:<16} {:>9} {:>12} {:>9.0f} {:>9.0f} {:>9.0f} {:>6.0f}%\n", name,
                 expert_schedule_name(schedule), per_expert, fwd_us, bwd_us, tflops,
                 100 * tflops * 1e12 / rate);
      entry[std::string(expert_schedule_name(schedule))] = {
          {"forward_us", fwd_us}, {"backward_us", bwd_us}, {"TFLOPs", tflops}};
      best_us = std::min(best_us, fwd_us + bwd_us);
    }
    entry["total_us"] = best_us;
    entry["fraction_of_dense"] = 3.0 * flops_fwd / (best_us * 1e-6) / rate;
    report["results"].push_back(entry);
  }
  options.check_matched();
  bench::write_json(options, report);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_experts: %s\n", e.what());
  return 1;
}
