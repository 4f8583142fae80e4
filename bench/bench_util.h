// Shared by the benchmarks: event timing with warm-up and medians, the copy-bandwidth ceiling
// measured in the same run, input rotation past the L2 cache, JSON results.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "cli/checks.h"
#include "cli/output_file.h"
#include "kernels/elementwise.cuh"
#include "kernels/gemm.h"
#include "moe/device.h"
#include "moe/error.h"

namespace moe::bench {

struct Options {
  bool quick = false;
  std::string json_path;
  std::string only;  // run only the shapes whose name contains this

  bool selected(const std::string& name) const {
    const bool match = only.empty() || name.find(only) != std::string::npos;
    matched += match ? 1 : 0;
    return match;
  }
  // After the shape loop: a filter that matched nothing is a mistyped argument, not a result.
  void check_matched() const {
    if (matched == 0) throw Error("--only \"" + only + "\" matches no shape of this benchmark");
  }
  mutable int matched = 0;
};

// The options every benchmark takes, and those one benchmark adds through `extra`. A bad
// argument prints CLI11's message after the program's name and ends the program (benchmarks are
// programs, not library code); the help comes first, as in the apps.
inline Options parse_options(int argc, char** argv,
                             const std::function<void(CLI::App&)>& extra = {}) {
  Options options;
  CLI::App app{"moe-runtime benchmark: a table on stdout, the numbers in JSON with --json"};
  cli::flags_take_no_value(app);  // --quick=0 is refused, not read as unset
  app.add_flag("--quick", options.quick, "fewer repeats (the gpu-check run)");
  app.add_option("--json", options.json_path, "write the results to this file");
  app.add_option("--only", options.only, "run only the shapes whose name contains this text");
  if (extra) extra(app);
  if (const auto stop = cli::parse_or_help(app, argc, argv)) std::exit(*stop);
  // A report that could not be written would be found missing only after the whole run.
  const std::string program = std::filesystem::path(argv[0]).filename().string();
  if (!options.json_path.empty()) {
    try {
      cli::check_output_file("--json", options.json_path, {}, cli::Written::kInPlace);
    } catch (const Error& e) {
      std::fprintf(stderr, "%s: %s\n", program.c_str(), e.what());
      std::exit(2);
    }
  }
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "%s: no CUDA GPU on this machine; a benchmark needs one.\n",
                 program.c_str());
    std::exit(2);
  }
  return options;
}

// Median milliseconds of `body` over `repeats` runs after `warmup` runs, timed with events.
// `body(i)` gets the run index so that it can rotate among input sets.
inline double median_ms(const std::function<void(int)>& body, cudaStream_t stream, int warmup,
                        int repeats) {
  for (int i = 0; i < warmup; ++i) body(i);
  std::vector<double> times;
  Event start(true), stop(true);
  for (int i = 0; i < repeats; ++i) {
    start.record(stream);
    body(warmup + i);
    stop.record(stream);
    MOE_CHECK_CUDA(cudaEventSynchronize(stop.get()));
    times.push_back(stop.elapsed_ms_since(start));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Milliseconds per call when `calls` calls go back to back between two events (median of
// `repeats` such batches): the GPU's time once the host runs ahead, without the host's launch
// cost that an isolated call (median_ms) includes.
inline double back_to_back_ms(const std::function<void(int)>& body, cudaStream_t stream, int warmup,
                              int repeats, int calls) {
  for (int i = 0; i < warmup; ++i) body(i);
  std::vector<double> times;
  Event start(true), stop(true);
  for (int r = 0; r < repeats; ++r) {
    start.record(stream);
    for (int i = 0; i < calls; ++i) body(warmup + r * calls + i);
    stop.record(stream);
    MOE_CHECK_CUDA(cudaEventSynchronize(stop.get()));
    times.push_back(stop.elapsed_ms_since(start) / calls);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written.
inline double copy_bandwidth(cudaStream_t stream) {
  const std::size_t bytes = std::size_t{1} << 30;
  DeviceBuffer a(bytes), b(bytes);
  MOE_CHECK_CUDA(cudaMemsetAsync(a.data(), 1, bytes, stream));
  const double ms = median_ms(
      [&](int) {
        MOE_CHECK_CUDA(
            cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, stream));
      },
      stream, 3, 10);
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3);
}

// A busy GPU runs slower than a fresh one: under sustained GEMMs an H200 reaches its 700 W power
// cap within ~100 ms and nvidia-smi shows the SM clock fall from 1980 to ~1400-1500 MHz (throttle
// reason "SW power cap"). Measured on an H200: an 8192^3 product ran at 797 TFLOP/s over its first
// ~20 ms and at 683-690 TFLOP/s from then on, for seconds. A rate taken in the first milliseconds
// is a burst, not a ceiling; ceilings, and the timings compared with them, are taken after this
// much load.
constexpr double kSteadyStateMs = 1000.0;

// Runs `body` back to back until at least `ms` of GPU time has passed (at least once): brings the
// GPU to the clock it holds under sustained load.
inline void run_for_ms(const std::function<void(int)>& body, cudaStream_t stream, double ms) {
  Event start(true), stop(true);
  start.record(stream);
  body(0);
  stop.record(stream);
  MOE_CHECK_CUDA(cudaEventSynchronize(stop.get()));
  const double one = std::max<double>(stop.elapsed_ms_since(start), 1e-3);
  const int calls = static_cast<int>(std::min(ms / one, 1e6));
  for (int i = 1; i < calls; ++i) body(i);
  MOE_CHECK_CUDA(cudaStreamSynchronize(stream));
}

// Dense bf16 GEMM rate in FLOP/s: an 8192^3 cuBLASLt product on non-zero data (zeros run faster),
// its algorithm tuned as the expert products' are, so that neither side of the ratio is favoured.
// `sustained` after kSteadyStateMs of the product (the ceiling); `burst` over its first ~20 ms.
struct GemmRate {
  double sustained = 0;
  double burst = 0;
};
inline GemmRate dense_gemm_rate(cudaStream_t stream) {
  const std::int64_t n = 8192;
  DeviceBuffer a(n * n * 2), b(n * n * 2), c(n * n * 2);
  init_normal(Tensor(a.data(), DType::kBF16, {n, n}), 1, 0, 1.0f, stream);
  init_normal(Tensor(b.data(), DType::kBF16, {n, n}), 2, 0, 1.0f, stream);
  GemmRunner gemm(std::size_t{32} << 20, std::make_shared<GemmTuning>());
  const GemmShape shape{n, n, n, false, true, DType::kBF16, DType::kBF16, DType::kBF16};
  auto product = [&](int) { gemm.run(shape, a.data(), b.data(), c.data(), stream); };
  const double flop = 2.0 * n * n * n;
  GemmRate rate;
  rate.burst = flop / (median_ms(product, stream, 3, 10) * 1e-3);
  run_for_ms(product, stream, kSteadyStateMs);
  rate.sustained = flop / (median_ms(product, stream, 0, 20) * 1e-3);
  return rate;
}

inline std::string device_name() {
  int device = 0;
  MOE_CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  MOE_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

// Enough copies of an input of `bytes` that cycling through them streams from HBM, not L2.
inline int rotation_sets(std::size_t bytes) {
  const std::size_t l2_span = std::size_t{256} << 20;  // several times the 50-60 MB L2
  return static_cast<int>(
      std::clamp<std::size_t>(l2_span / std::max<std::size_t>(bytes, 1), 1, 16));
}

// Copy bandwidth at a given size, bytes/s counting bytes read plus bytes written: a
// cudaMemcpyAsync that moves `moved_bytes` in all (half read, half written), through enough copies
// of source and destination that every run streams from HBM. A kernel moving that many bytes
// pays the same ramp-up and drain; `back_to_back` times 20 copies between two events.
inline double copy_bandwidth_at(std::size_t moved_bytes, bool back_to_back, cudaStream_t stream) {
  const std::size_t bytes = std::max<std::size_t>(moved_bytes / 2, 16);
  const int sets = rotation_sets(2 * bytes);
  std::vector<DeviceBuffer> from, to;
  for (int i = 0; i < sets; ++i) {
    from.emplace_back(bytes);
    to.emplace_back(bytes);
    MOE_CHECK_CUDA(cudaMemsetAsync(from.back().data(), 1, bytes, stream));
  }
  auto copy = [&](int i) {
    MOE_CHECK_CUDA(cudaMemcpyAsync(to[i % sets].data(), from[i % sets].data(), bytes,
                                   cudaMemcpyDeviceToDevice, stream));
  };
  const double ms =
      back_to_back ? back_to_back_ms(copy, stream, 3, 10, 20) : median_ms(copy, stream, 3, 20);
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3);
}

// Rows per expert as top-K routing gives them, each padded to `align`: T·K picks uniform over the
// E experts from a 64-bit LCG that bench/peers.py reproduces bit for bit, so both sides time the
// same row counts (uniform counts would let equal shapes batch perfectly, which routing never
// gives).
inline std::vector<std::int64_t> routed_offsets(std::int64_t tokens, int topk, int experts,
                                                int align) {
  std::vector<std::int64_t> counts(static_cast<std::size_t>(experts), 0);
  std::uint64_t state = 20261122;
  for (std::int64_t i = 0; i < tokens * topk; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    ++counts[static_cast<std::size_t>((state >> 33) % static_cast<std::uint64_t>(experts))];
  }
  std::vector<std::int64_t> offsets(counts.size() + 1, 0);
  for (std::size_t e = 0; e < counts.size(); ++e)
    offsets[e + 1] = offsets[e] + (counts[e] + align - 1) / align * align;
  return offsets;
}

// The report whole, or none: a write that fails (a full disk) removes the file and throws.
inline void write_json(const Options& options, const nlohmann::json& report) {
  if (options.json_path.empty()) return;
  {
    std::ofstream out(options.json_path);
    out << report.dump(2) << "\n";
    out.close();
    if (out) return;
  }
  std::error_code ignored;
  std::filesystem::remove(options.json_path, ignored);
  throw Error("--json '" + options.json_path + "' could not be written whole; nothing was left");
}

}  // namespace moe::bench
