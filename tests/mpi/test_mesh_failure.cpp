// A peer that never joins the exchange: the others raise a moe::Error naming the rank and the
// operation within the timeout, instead of hanging. Needs at least two ranks.
#include <mpi.h>

#include <chrono>

#include "comm/exchange.h"
#include "moe/device.h"
#include "moe/mesh.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_main.h"

using namespace moe;

TEST_CASE("a missing peer makes the others fail within the timeout", "[mpi][mesh]") {
  const int world = test::world_size();
  if (world < 2) {
    WARN("needs two ranks; nothing to check with one");
    return;
  }
  const int E = 2 * world;
  Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, E, std::chrono::milliseconds(3000));
  ExpertExchange exchange(mesh, E);
  DeviceBuffer counts(E * 4), received(E * 4);
  MOE_CHECK_CUDA(cudaMemset(counts.data(), 0, E * 4));
  MOE_CHECK_CUDA(cudaDeviceSynchronize());  // the fill is on the legacy stream
  Stream stream;
  if (test::world_rank() != 1) {
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(
        exchange.exchange_counts(counts.as<std::int32_t>(), received.as<std::int32_t>(), nullptr,
                                 nullptr, 0, stream.get()),
        test::contains_text("did not complete within 3000 ms"));
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));
    CHECK_THROWS_WITH(mesh.comm(MeshGroup::kWorld), test::contains_text("aborted"));
    MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
  } else {
    // The failed peer: alive, but it never joins the exchange; once the others have given up it
    // drops its communicators too.
    MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    mesh.abort();
  }
}
