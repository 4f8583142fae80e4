// floor_table: every stage's roofline floor (bench/stage_floors.h) for a config, T and EP at given
// rates, with fp32 and bf16 weight gradients side by side. The floors moe_bench prints beside its
// measured stages, computed on any machine, with no GPU: the rates default to one H200's,
// sustained (docs/performance.md, "Measured ceilings").
//
//   build/bench/floor_table --config configs/deepseek-v3.yaml [--tokens 8192] [--ep 1]
//       [--transport peer|nccl|copy] [--gemm-tflops 674] [--copy-gbps 4180] [--link-gbps 296]
// The transport defaults to the config's ep_transport, auto as the layer resolves it on one host.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/stage_floors.h"
#include "cli/checks.h"
#include "moe/config.h"
#include "moe/error.h"
#include "moe/types.h"

namespace {

using moe::bench::StageWork;

// Each stage's work with the weight gradients in `grad`.
std::vector<StageWork> stages_with(moe::MoEConfig config, moe::DType grad, std::int64_t tokens,
                                   bool probabilities_in_experts) {
  config.grad_dtype = grad;
  return moe::bench::stage_work(config, tokens, probabilities_in_experts);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"floor_table: each stage's roofline floor, fp32 and bf16 weight gradients"};
  std::string config_path, transport;
  int tokens = 0, ep = 1;
  double gemm_tflops = 674, copy_gbps = 4180, link_gbps = 296;
  app.add_option("--config", config_path, "layer config (YAML)")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--tokens", tokens, "tokens per GPU (default: the config's, else 8192)")
      ->check(moe::cli::count_in(1, 1 << 30));
  app.add_option("--ep", ep, "expert-parallel degree (a divisor of the experts)")
      ->check(moe::cli::count_in(1, 1 << 20));
  app.add_option("--transport", transport,
                 "the EP exchange: peer (the experts weigh their rows) or nccl / copy (the "
                 "combine weighs them, and its backward reads the rows again for dprob); default: "
                 "the config's ep_transport, auto as the layer resolves it on one host")
      ->check(CLI::IsMember({"peer", "nccl", "copy"}));
  app.add_option("--gemm-tflops", gemm_tflops, "sustained GEMM rate, TFLOP/s")
      ->check(moe::cli::finite_in(1e-3, 1e6));
  app.add_option("--copy-gbps", copy_gbps, "device-to-device copy rate, GB/s")
      ->check(moe::cli::finite_in(1e-3, 1e9));
  app.add_option("--link-gbps", link_gbps, "rows to other GPUs, GB/s (EP > 1)")
      ->check(moe::cli::finite_in(1e-3, 1e9));
  if (const auto stop = moe::cli::parse_or_help(app, argc, argv)) return *stop;
  try {
    moe::MoEConfig config = moe::load_config(config_path);
    config.ep = ep;
    config.dp = 1;
    if (transport.empty()) transport = std::string(moe::ep_transport_name(config.ep_transport));
    // auto as the layer resolves it on one host: the peer exchange up to kMaxPeerRanks, NCCL
    // beyond, and NCCL for E4M3 rows and fixed blocks, which cross over it alone.
    if (transport == "auto")
      transport = ep > moe::kMaxPeerRanks || config.fp8_dispatch || config.pad_to_capacity ? "nccl"
                                                                                           : "peer";
    if (ep > 1) config.ep_transport = moe::parse_ep_transport(transport);  // as the header says
    config.validate();
    if (const std::string why = config.unsupported_by_gpu_layer(); !why.empty())
      moe::fail("{}", why);
    const std::int64_t T =
        tokens > 0 ? tokens : (config.bench_tokens > 0 ? config.bench_tokens : 8192);
    // One GPU's local exchange weighs the rows in the experts, as the peer exchange does.
    const bool in_experts = ep == 1 || transport == "peer";
    const moe::bench::Rates rates{gemm_tflops * 1e12, copy_gbps * 1e9,
                                  ep > 1 ? link_gbps * 1e9 : 0.0};
    const auto fp32 = stages_with(config, moe::DType::kFP32, T, in_experts);
    const auto bf16 = stages_with(config, moe::DType::kBF16, T, in_experts);
    std::printf("%s, T = %lld per GPU, EP %d%s; GEMM %g TFLOP/s, copies %g GB/s%s\n",
                config.describe().c_str(), static_cast<long long>(T), ep,
                ep > 1 ? fmt::format(" over {}", transport).c_str() : "", gemm_tflops, copy_gbps,
                ep > 1 ? fmt::format(", link {} GB/s", link_gbps).c_str() : "");
    std::printf(
        "| stage | GFLOP | GB, fp32 gradients | floor ms | GB, bf16 gradients | floor ms |\n");
    std::printf("| --- | --- | --- | --- | --- | --- |\n");
    for (std::size_t i = 0; i < fp32.size(); ++i) {
      std::printf("| %s | %.1f | %.2f | %.3f | %.2f | %.3f |\n", fp32[i].name.c_str(),
                  fp32[i].flops / 1e9, (fp32[i].bytes + fp32[i].link_bytes) / 1e9,
                  fp32[i].floor_ms(rates), (bf16[i].bytes + bf16[i].link_bytes) / 1e9,
                  bf16[i].floor_ms(rates));
    }
    std::printf("| step | | | %.3f | | %.3f |\n", moe::bench::step_floor_ms(fp32, rates),
                moe::bench::step_floor_ms(bf16, rates));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "floor_table: %s\n", e.what());
    return 1;
  }
}
