// The one main of every test binary. GPU and MPI binaries exit with 77 (ctest: skipped) when no
// GPU is visible, so a machine without one never reports them as passed.
#if MOE_CATCH2_V3
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>

#include "comm/bootstrap.h"
#include "moe/device.h"
#include "support/test_main.h"

namespace moe::test {
namespace {
int g_rank = 0;
int g_size = 1;
std::uint64_t g_seed = 0;

std::uint64_t draw_run_seed() {
  if (const char* fixed = std::getenv("MOE_TEST_SEED")) {
    char* end = nullptr;
    errno = 0;
    const auto seed = std::strtoull(fixed, &end, 10);
    // Digits only: strtoull skips leading spaces and takes a sign, so " -1" would wrap.
    const bool digits = fixed[0] >= '0' && fixed[0] <= '9';
    if (!digits || end == fixed || *end != '\0' || errno == ERANGE)
      throw moe::Error(std::string("MOE_TEST_SEED = '") + fixed +
                       "' is not an unsigned 64-bit integer");
    return seed;
  }
  std::random_device device;
  return (static_cast<std::uint64_t>(device()) << 32) ^ device();
}
}  // namespace
std::uint64_t run_seed() {
  return g_seed;
}
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
    moe::test::g_seed = moe::test::draw_run_seed();  // every rank: a bad MOE_TEST_SEED fails all
    if (mpi) MOE_CHECK_MPI(MPI_Bcast(&moe::test::g_seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD));
    // First line of the output, on rank 0: a failure anywhere in the run replays from it.
    if (moe::test::g_rank == 0) {
      std::printf("test seed: %llu (replay: MOE_TEST_SEED=%llu)\n",
                  static_cast<unsigned long long>(moe::test::g_seed),
                  static_cast<unsigned long long>(moe::test::g_seed));
      std::fflush(stdout);
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
