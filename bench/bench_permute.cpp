// Permute, unpermute-combine and their backward at T = 8192, bf16: achieved bandwidth over the copy
// bandwidth measured in the same run.
#include <fmt/format.h>

#include <numeric>
#include <random>

#include "bench/bench_util.h"
#include "kernels/permute.cuh"

using namespace moe;

int main(int argc, char** argv) try {
  const auto options = bench::parse_options(argc, argv);
  Stream stream;
  const double bandwidth = bench::copy_bandwidth(stream.get());
  const std::int64_t T = 8192;
  const int E = 64;
  const int align = 16;
  nlohmann::json report = {{"bench", "permute"},
                           {"device", bench::device_name()},
                           {"tokens", T},
                           {"copy_bandwidth_GBps", bandwidth / 1e9},
                           {"results", nlohmann::json::array()}};
  fmt::print("permute stages, T={}, E={}, bf16, align {}; copy bandwidth {:.0f} GB/s ({})\n", T, E,
             align, bandwidth / 1e9, bench::device_name());
  // Each stage timed alone between two events (host launch included) and back to back (20 calls
  // between two events: the GPU's time when the host runs ahead, as inside the layer).
  // floor%: against the 1 GiB copy rate; sized%: against copies of each stage's own size
  // (isolated, then back to back).
  fmt::print("{:<14} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>10} {:>7} {:>7} {:>7}\n", "shape",
             "permute", "combine", "comb.bwd", "perm.bwd", "total us", "floor%", "b2b us", "floor%",
             "sized%", "b2b sz%");
  for (const int H : {2048, 4096, 7168}) {
    for (const int K : {2, 8}) {
      const std::string name = fmt::format("H{} K{}", H, K);
      if (!options.selected(name)) continue;
      std::mt19937 rng(7);
      std::vector<std::int32_t> idx;
      std::vector<int> all(E);
      std::iota(all.begin(), all.end(), 0);
      for (std::int64_t t = 0; t < T; ++t) {
        std::shuffle(all.begin(), all.end(), rng);
        idx.insert(idx.end(), all.begin(), all.begin() + K);
      }
      std::vector<float> prob(idx.size(), 0.5f);
      DeviceBuffer idx_dev(idx.size() * 4), prob_dev(prob.size() * 4), counts(E * 4),
          offsets((E + 1) * 4), row_map(idx.size() * 4), workspace(layout_workspace_bytes(T, K, E)),
          dprob(prob.size() * 4);
      copy_to_device(idx_dev.data(), idx.data(), idx.size() * 4);
      copy_to_device(prob_dev.data(), prob.data(), prob.size() * 4);
      build_layout({idx_dev.as<std::int32_t>(), T, K, E, align, counts.as<std::int32_t>(),
                    offsets.as<std::int32_t>(), row_map.as<std::int32_t>(), workspace.data()},
                   stream.get());
      std::int32_t rows = 0;
      copy_to_host(&rows, offsets.as<std::int32_t>() + E, 4);
      const std::size_t token_bytes = static_cast<std::size_t>(T * H) * 2;
      const std::size_t row_bytes = static_cast<std::size_t>(rows) * H * 2;
      const int sets = bench::rotation_sets(token_bytes + row_bytes);
      std::vector<DeviceBuffer> x, X;
      for (int s = 0; s < sets; ++s) {
        x.emplace_back(token_bytes);
        X.emplace_back(row_bytes);
        MOE_CHECK_CUDA(
            cudaMemsetAsync(x.back().data(), 0x3c, token_bytes, stream.get()));  // 1.17 in bf16
        MOE_CHECK_CUDA(cudaMemsetAsync(X.back().data(), 0x3c, row_bytes, stream.get()));
      }
      DeviceBuffer out(token_bytes), dY(row_bytes);
      auto tok = [&](const DeviceBuffer& b) { return Tensor(b.data(), DType::kBF16, {T, H}); };
      auto row = [&](const DeviceBuffer& b) { return Tensor(b.data(), DType::kBF16, {rows, H}); };
      const auto* rm = row_map.as<std::int32_t>();
      const auto* off = offsets.as<std::int32_t>();
      const auto* cnt = counts.as<std::int32_t>();
      const int warmup = options.quick ? 3 : 10, repeats = options.quick ? 20 : 50;
      double back_to_back_us = 0;
      auto time = [&](auto body) {
        back_to_back_us +=
            bench::back_to_back_ms(body, stream.get(), warmup, repeats / 2, 20) * 1e3;
        return bench::median_ms(body, stream.get(), warmup, repeats) * 1e3;
      };
      const double permute_us = time([&](int i) {
        permute_rows(tok(x[i % sets]), rm, K, off, cnt, E, row(X[i % sets]), stream.get());
      });
      const double combine_us = time([&](int i) {
        unpermute_combine(row(X[i % sets]), rm, prob_dev.as<float>(), K, tok(out), stream.get());
      });
      const double backward_us = time([&](int i) {
        combine_backward(tok(x[i % sets]), row(X[i % sets]), rm, prob_dev.as<float>(), K, off, cnt,
                         E, row(dY), dprob.as<float>(), stream.get());
      });
      const double permute_bwd_us = time([&](int i) {
        unpermute_combine(row(X[i % sets]), rm, nullptr, K, tok(out), stream.get());
      });
      const double total_us = permute_us + combine_us + backward_us + permute_bwd_us;
      // Bytes each stage must move: permute reads x and writes the rows; the combine (and the
      // permute backward) reads the rows and writes a token matrix; the combine backward reads dy
      // and the rows and writes dY.
      const double routed = static_cast<double>(T) * K * H * 2;
      const double tokens = static_cast<double>(token_bytes);
      const double bytes =
          (tokens + routed) + (routed + tokens) + (tokens + 2 * routed) + (routed + tokens);
      const double floor_us = bytes / bandwidth * 1e6;
      // The same bytes at the copy rate of a copy of each stage's size (the 1 GiB copy above is
      // the asymptote; a ~100 MB stage, like a ~100 MB copy, pays ramp-up and drain on top).
      const double three_stages = tokens + routed, combine_backward_bytes = tokens + 2 * routed;
      auto same_size_floor_us = [&](bool back_to_back) {
        return (3 * three_stages /
                    bench::copy_bandwidth_at(static_cast<std::size_t>(three_stages), back_to_back,
                                             stream.get()) +
                combine_backward_bytes /
                    bench::copy_bandwidth_at(static_cast<std::size_t>(combine_backward_bytes),
                                             back_to_back, stream.get())) *
               1e6;
      };
      const double sized_floor_us = same_size_floor_us(false);
      const double sized_b2b_floor_us = same_size_floor_us(true);
      fmt::print(
          "{:<14} {:>10.1f} {:>10.1f} {:>10.1f} {:>10.1f} {:>10.1f} {:>6.0f}% {:>10.1f} "
          "{:>6.0f}% {:>6.0f}% {:>6.0f}%\n",
          name, permute_us, combine_us, backward_us, permute_bwd_us, total_us,
          100 * floor_us / total_us, back_to_back_us, 100 * floor_us / back_to_back_us,
          100 * sized_floor_us / total_us, 100 * sized_b2b_floor_us / back_to_back_us);
      report["results"].push_back(
          {{"name", name},
           {"hidden", H},
           {"topk", K},
           {"permute_us", permute_us},
           {"combine_us", combine_us},
           {"combine_backward_us", backward_us},
           {"permute_backward_us", permute_bwd_us},
           {"total_us", total_us},
           {"back_to_back_us", back_to_back_us},
           {"back_to_back_fraction_of_floor", floor_us / back_to_back_us},
           {"floor_us", floor_us},
           {"fraction_of_floor", floor_us / total_us},
           {"same_size_copy_floor_us", sized_floor_us},
           {"fraction_of_same_size_copy", sized_floor_us / total_us},
           {"back_to_back_fraction_of_same_size_copy", sized_b2b_floor_us / back_to_back_us}});
    }
  }
  options.check_matched();
  bench::write_json(options, report);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_permute: %s\n", e.what());
  return 1;
}
