// Router forward + backward at T = 16384 (or --tokens): time, fraction of the memory-traffic floor
// (bytes the kernels must read and write over the copy bandwidth measured in this run).
#include <fmt/format.h>

#include <random>

#include "bench/bench_util.h"
#include "bench/streaming_pass.h"
#include "kernels/router.cuh"
#include "moe/config.h"
#include "src/router_stage.h"

using namespace moe;

namespace {

struct Shape {
  std::string name;
  MoEConfig config;
};

MoEConfig make(int experts, int topk, ScoreFunction f, bool bias, int groups, int group_topk,
               double scale) {
  MoEConfig c;
  c.hidden = 8;
  c.ffn_hidden = 8;
  c.num_experts = experts;
  c.topk = topk;
  c.score_function = f;
  c.expert_bias = bias;
  c.num_groups = groups;
  c.group_topk = group_topk;
  c.scaling_factor = scale;
  c.aux_loss_coeff = 0.01;
  c.z_loss_coeff = 0.001;
  c.validate();
  return c;
}

}  // namespace

int main(int argc, char** argv) try {
  std::int64_t T = 16384;
  const auto options = bench::parse_options(argc, argv, [&](CLI::App& app) {
    app.add_option("--tokens", T, "tokens per run (the issue's shape: 16384)")
        ->check(cli::count_in(1, 1 << 24));
  });
  Stream stream;
  const double bandwidth = bench::copy_bandwidth(stream.get());
  const std::vector<Shape> shapes = {
      {"E8 K2 softmax (mixtral)", make(8, 2, ScoreFunction::kSoftmax, false, 0, 0, 1.0)},
      {"E128 K8 softmax (qwen3)", make(128, 8, ScoreFunction::kSoftmax, false, 0, 0, 1.0)},
      {"E256 K8 sigmoid+bias 8/4 groups (deepseek-v3)",
       make(256, 8, ScoreFunction::kSigmoid, true, 8, 4, 2.5)},
      {"E1024 K8 sigmoid", make(1024, 8, ScoreFunction::kSigmoid, false, 0, 0, 1.0)},
  };
  nlohmann::json report = {{"bench", "router"},
                           {"device", bench::device_name()},
                           {"tokens", T},
                           {"copy_bandwidth_GBps", bandwidth / 1e9},
                           {"results", nlohmann::json::array()}};
  fmt::print(
      "router fwd+bwd, T={}, fp32 logits, aux + z losses on; copy bandwidth {:.0f} GB/s ({})\n", T,
      bandwidth / 1e9, bench::device_name());
  fmt::print("{:<48} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9} {:>8} {:>8} {:>9} {:>8} {:>8}\n", "shape",
             "fwd us", "bwd us", "total us", "floor us", "floor%", "b2b us", "floor%", "b2b sz%",
             "2pass us", "ceil%", "of 2pass");
  for (const auto& shape : shapes) {
    if (!options.selected(shape.name)) continue;
    const auto& c = shape.config;
    const int E = c.num_experts;
    const int K = c.topk;
    const RouterParams params = router_params(c);
    const std::size_t logits_bytes = static_cast<std::size_t>(T * E) * 4;
    const int sets = bench::rotation_sets(logits_bytes * 2);

    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> host(static_cast<std::size_t>(T * E));
    std::vector<DeviceBuffer> logits, dlogits;
    for (int s = 0; s < sets; ++s) {
      for (auto& v : host) v = normal(rng);
      logits.emplace_back(logits_bytes);
      copy_to_device(logits.back().data(), host.data(), logits_bytes);
      dlogits.emplace_back(logits_bytes);
    }
    std::vector<float> bias(E, 0.0f), dp(static_cast<std::size_t>(T * K));
    for (auto& v : dp) v = normal(rng);
    DeviceBuffer bias_dev(E * 4), dp_dev(dp.size() * 4), idx(dp.size() * 4), prob(dp.size() * 4),
        counts(E * 4), aux_counts(E * 4), score_sum(E * 4), z(16), losses(16),
        workspace(router_workspace_bytes(params, T));
    router_workspace_clear(params, workspace.data(), stream.get());
    copy_to_device(bias_dev.data(), bias.data(), E * 4);
    copy_to_device(dp_dev.data(), dp.data(), dp.size() * 4);

    auto forward = [&](int i) {
      RouterForwardArgs a;
      a.logits = logits[i % sets].data();
      a.tokens = T;
      a.expert_bias = bias_dev.as<float>();
      a.topk_idx = idx.as<std::int32_t>();
      a.topk_p = prob.as<float>();
      a.tokens_per_expert = counts.as<std::int32_t>();
      a.aux_tokens_per_expert = aux_counts.as<std::int32_t>();
      a.aux_score_sum = score_sum.as<float>();
      a.z_sum = z.as<float>();
      a.workspace = workspace.data();
      // One GPU, as the layer runs it there: the losses come from the forward's last block.
      a.losses = losses.as<float>();
      a.aux_loss_coeff = c.aux_loss_coeff;
      a.z_loss_coeff = c.z_loss_coeff;
      router_forward(params, a, stream.get());
    };
    auto backward = [&](int i) {
      RouterBackwardArgs a;
      a.logits = logits[i % sets].data();
      a.tokens = T;
      a.topk_idx = idx.as<std::int32_t>();
      a.topk_p = prob.as<float>();
      a.dprob = dp_dev.as<float>();
      a.aux_tokens_per_expert = aux_counts.as<std::int32_t>();
      a.aux_factor = aux_loss_factor(params, c.aux_loss_coeff, T);
      a.z_factor = z_loss_factor(c.z_loss_coeff, T);
      a.dlogits = dlogits[i % sets].as<float>();
      router_backward(params, a, stream.get());
    };
    const int warmup = options.quick ? 3 : 10;
    const int repeats = options.quick ? 20 : 100;
    const double fwd_ms = bench::median_ms(forward, stream.get(), warmup, repeats);
    const double bwd_ms = bench::median_ms(backward, stream.get(), warmup, repeats);
    auto both = [&](int i) {
      forward(i);
      backward(i);
    };
    const double total_ms = bench::median_ms(both, stream.get(), warmup, repeats);
    const double b2b_ms = bench::back_to_back_ms(both, stream.get(), warmup, 5, 20);
    // Must move: forward reads the logits and writes idx and p; backward reads the logits, idx,
    // p and dp and writes dlogits (the loss statistics are O(E)).
    const double bytes =
        3.0 * static_cast<double>(logits_bytes) + 5.0 * static_cast<double>(T * K) * 4;
    const double floor_ms = bytes / bandwidth * 1e3;
    // The same bytes at the rate of copies of each pass's own size, back to back: a few MB move
    // far below the 1 GiB copy rate.
    const double forward_bytes =
        static_cast<double>(logits_bytes) + 2.0 * static_cast<double>(T * K) * 4;
    const double sized_b2b_floor_ms =
        (forward_bytes /
             bench::copy_bandwidth_at(static_cast<std::size_t>(forward_bytes), true, stream.get()) +
         (bytes - forward_bytes) /
             bench::copy_bandwidth_at(static_cast<std::size_t>(bytes - forward_bytes), true,
                                      stream.get())) *
        1e3;
    // The same bytes moved by two bare passes (bench/streaming_pass.h), one launch each, timed
    // as the router is (isolated, events around both): about the most of the floor that a
    // forward and a backward of one launch each can reach at this size ("ceil%").
    const auto slot_bytes = static_cast<std::size_t>(T * K) * 4;
    DeviceBuffer pass_out(2 * slot_bytes + 16), pass_in(3 * slot_bytes + 16);
    MOE_CHECK_CUDA(cudaMemsetAsync(pass_in.data(), 0, pass_in.bytes(), stream.get()));
    auto two_passes = [&](int i) {
      // Forward: the logits in, idx and p out. Backward: the logits, idx, p and dp in, dlogits out.
      bench::launch_streaming_pass({.first = logits[i % sets].data(),
                                    .first_bytes = logits_bytes,
                                    .out = pass_out.data(),
                                    .out_bytes = 2 * slot_bytes},
                                   stream.get());
      bench::launch_streaming_pass({.first = logits[i % sets].data(),
                                    .first_bytes = logits_bytes,
                                    .second = pass_in.data(),
                                    .second_bytes = 3 * slot_bytes,
                                    .out = dlogits[i % sets].data(),
                                    .out_bytes = logits_bytes},
                                   stream.get());
    };
    const double passes_ms = bench::median_ms(two_passes, stream.get(), warmup, repeats);
    fmt::print(
        "{:<48} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>7.0f}% {:>9.1f} {:>7.0f}% {:>7.0f}% "
        "{:>9.1f} {:>7.0f}% {:>7.0f}%\n",
        shape.name, fwd_ms * 1e3, bwd_ms * 1e3, total_ms * 1e3, floor_ms * 1e3,
        100 * floor_ms / total_ms, b2b_ms * 1e3, 100 * floor_ms / b2b_ms,
        100 * sized_b2b_floor_ms / b2b_ms, passes_ms * 1e3, 100 * floor_ms / passes_ms,
        100 * passes_ms / total_ms);
    report["results"].push_back(
        {{"name", shape.name},
         {"experts", E},
         {"topk", K},
         {"forward_us", fwd_ms * 1e3},
         {"backward_us", bwd_ms * 1e3},
         {"total_us", total_ms * 1e3},
         {"back_to_back_us", b2b_ms * 1e3},
         {"floor_us", floor_ms * 1e3},
         {"fraction_of_floor", floor_ms / total_ms},
         {"back_to_back_fraction_of_same_size_copy", sized_b2b_floor_ms / b2b_ms},
         {"two_passes_us", passes_ms * 1e3},
         {"two_passes_fraction_of_floor", floor_ms / passes_ms},
         {"fraction_of_two_passes", passes_ms / total_ms}});
  }
  options.check_matched();
  bench::write_json(options, report);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_router: %s\n", e.what());
  return 1;
}
