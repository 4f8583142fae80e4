// moe_bench: the expert-parallel benchmark. Until MoEBlock exists this is a stand-in: under mpirun
// it starts MPI, gives each rank its GPU, and prints the GPUs and the configured layer.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>

#include "comm/bootstrap.h"
#include "moe/config.h"
#include "moe/device.h"
#include "moe/error.h"

int main(int argc, char** argv) {
  CLI::App app{"moe_bench: forward and backward of the MoE layer over an EP x DP mesh"};
  std::string config_path = std::string(MOE_SOURCE_DIR) + "/configs/small.yaml";
  int tokens = 0;
  app.add_option("--config", config_path, "layer config (YAML)")->check(CLI::ExistingFile);
  app.add_option("--tokens", tokens, "tokens per GPU (default: the config's)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);

  try {
    moe::comm::MpiSession mpi(&argc, &argv);
    auto config = moe::load_config(config_path);
    if (tokens > 0) config.bench_tokens = tokens;
    const int gpus = moe::cuda_device_count();
    if (gpus == 0) {
      if (mpi.rank() == 0) {
        std::fprintf(stderr, "moe_bench: no CUDA GPU on this machine; it needs at least one.\n");
      }
      return 2;
    }
    const int local_rank = moe::comm::node_local_rank(MPI_COMM_WORLD);
    MOE_CHECK_CUDA(cudaSetDevice(local_rank % gpus));
    if (mpi.rank() == 0) {
      fmt::print("{}", moe::describe_devices());
      fmt::print("config {}: {}\n", std::filesystem::path(config_path).filename().string(),
                 config.describe());
      fmt::print("ranks: {}, tokens per GPU: {}\n", mpi.size(), config.bench_tokens);
      fmt::print(
          "moe_bench: the layer benchmark arrives with MoEBlock (issue 8); nothing timed.\n");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_bench: %s\n", e.what());
    return 1;
  }
}
