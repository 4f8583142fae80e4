// The MPI + NCCL harness: every rank on its own GPU, an NCCL all-reduce equal to the host sum.
#include <mpi.h>

#include <random>

#include "comm/bootstrap.h"
#include "moe/device.h"
#include "support/catch.h"
#include "support/test_main.h"
#include "support/test_util.h"

using namespace moe;

TEST_CASE("NCCL all-reduce over all ranks equals the host sum", "[mpi][harness]") {
  const int rank = test::world_rank();
  const int size = test::world_size();
  // A fresh seed from rank 0, so every rank can build every rank's input on the host.
  std::uint64_t seed = rank == 0 ? test::fresh_seed() : 0;
  MOE_CHECK_MPI(MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD));
  INFO("seed " << seed << " rank " << rank << " of " << size);

  auto comm = comm::NcclComm::from_mpi(MPI_COMM_WORLD);
  REQUIRE(comm.rank() == rank);
  REQUIRE(comm.size() == size);

  constexpr std::size_t n = (1u << 20) + 3;
  std::vector<std::vector<float>> inputs(size, std::vector<float>(n));
  for (int r = 0; r < size; ++r) {
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(r));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& v : inputs[r]) v = normal(rng);
  }
  DeviceBuffer send(n * 4), recv(n * 4);
  copy_to_device(send.data(), inputs[rank].data(), n * 4);
  MOE_CHECK_CUDA(cudaMemset(recv.data(), 0xFF, n * 4));  // poison: NaN
  MOE_CHECK_CUDA(cudaDeviceSynchronize());               // the fill is on the legacy stream
  Stream stream;
  MOE_CHECK_NCCL(
      ncclAllReduce(send.data(), recv.data(), n, ncclFloat32, ncclSum, comm.get(), stream.get()));
  stream.synchronize();
  std::vector<float> got(n);
  copy_to_host(got.data(), recv.data(), n * 4);

  std::vector<double> want(n, 0.0), got_double(got.begin(), got.end());
  for (const auto& input : inputs) {
    for (std::size_t i = 0; i < n; ++i) want[i] += input[i];
  }
  CHECK(test::relative_error(got_double, want) <= 1e-6);
}
