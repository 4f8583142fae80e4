// The one main of every test binary. GPU and MPI binaries exit with 77 (ctest: skipped) when no
// GPU is visible, so a machine without one never reports them as passed.
#if MOE_CATCH2_V3
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include <cstdio>
#include <memory>

#include "comm/bootstrap.h"
#include "moe/device.h"
#include "support/test_main.h"

namespace moe::test {
namespace {
int g_rank = 0;
int g_size = 1;
}  // namespace
int world_rank() {
  return g_rank;
}
int world_size() {
  return g_size;
}
}  // namespace moe::test

int main(int argc, char** argv) {
  using moe::test::Needs;
  const Needs needs = moe::test::test_needs();
  try {
    std::unique_ptr<moe::comm::MpiSession> mpi;
    if (needs == Needs::kMpi) {
      mpi = std::make_unique<moe::comm::MpiSession>(&argc, &argv);
      moe::test::g_rank = mpi->rank();
      moe::test::g_size = mpi->size();
    }
    if (needs != Needs::kCpu) {
      const int gpus = moe::cuda_device_count();
      if (gpus == 0) {
        std::printf("SKIPPED: no CUDA GPU visible; this binary's tests need one.\n");
        return moe::test::kSkipExitCode;
      }
      int device = 0;
      if (mpi) device = moe::comm::node_local_rank(MPI_COMM_WORLD) % gpus;
      MOE_CHECK_CUDA(cudaSetDevice(device));
    }
    const int failed = Catch::Session().run(argc, argv);
    return failed == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test main: %s\n", e.what());
    return 1;
  }
}
