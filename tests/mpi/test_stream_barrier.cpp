// The stream barrier over an EP group of every rank (one host): it holds each rank's stream until
// the last rank's stream arrives, orders the copies into peers' memory before the work after it
// (on its flags, and run by NCCL as the group falls back), and an abort releases a wait for a rank
// that never arrives.
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string_view>
#include <thread>
#include <vector>

#include "comm/peer_memory.h"
#include "comm/stream_barrier.h"
#include "moe/device.h"
#include "moe/mesh.h"
#include "support/catch.h"
#include "support/mesh_checks.h"
#include "support/test_main.h"
#include "support/test_util.h"

using namespace moe;

namespace {

constexpr auto kTimeout = std::chrono::milliseconds(5000);

// Sets MOE_STREAM_BARRIER for a scope, on this rank.
struct BarrierEnvironment {
  explicit BarrierEnvironment(const char* value) {
    if (value != nullptr) setenv("MOE_STREAM_BARRIER", value, 1);
  }
  ~BarrierEnvironment() { unsetenv("MOE_STREAM_BARRIER"); }
};

bool can_run(int world) {
  if (world < 2) {
    WARN("needs two ranks; nothing to check with one");
    return false;
  }
  if (!test::host_gpus_have_peer_access()) {
    WARN("the ranks' GPUs lack peer access: the copy exchange, and its barrier, do not run");
    return false;
  }
  return true;
}

bool event_done(const Event& event) {
  const cudaError_t status = cudaEventQuery(event.get());
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  MOE_CHECK_CUDA(status);
  return true;
}

}  // namespace

TEST_CASE("the stream barrier holds every stream until the last rank's arrives", "[mpi][mesh]") {
  const int world = test::world_size(), rank = test::world_rank();
  if (!can_run(world)) return;
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, world, kTimeout);
  const Stream stream;
  StreamBarrier barrier(mesh, stream.get());
  CHECK(barrier.without_sm());  // one host with peer access: the flags run it
  const int last = world - 1;
  for (int round = 0; round < 3; ++round) {
    const Event passed;
    if (rank != last) {
      barrier.arrive_and_wait(stream.get());
      passed.record(stream.get());
    }
    MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    if (rank != last) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      CHECK_FALSE(event_done(passed));  // the last rank has not queued its arrival yet
    }
    MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == last) {
      barrier.arrive_and_wait(stream.get());
      passed.record(stream.get());
    }
    mesh.wait(passed.get(), "the barrier's round");
  }
}

TEST_CASE("the stream barrier orders copies into peers' memory before the work after it",
          "[mpi][mesh]") {
  const int world = test::world_size(), rank = test::world_rank();
  if (!can_run(world)) return;
  for (const char* runner : {"flags", "nccl"}) {
    DYNAMIC_SECTION("run by " << runner) {
      const BarrierEnvironment environment(std::string_view(runner) == "nccl" ? "nccl" : nullptr);
      const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, world, kTimeout);
      const Stream stream;
      StreamBarrier barrier(mesh, stream.get());
      CHECK(barrier.without_sm() == (std::string_view(runner) == "flags"));
      // Each rank's slot in every rank's buffer: one int a rank.
      PeerBuffer slots(mesh);
      const std::vector<std::size_t> bytes(world, world * sizeof(std::int32_t));
      slots.reserve(bytes, stream.get());
      DeviceBuffer round_value(sizeof(std::int32_t));
      PinnedBuffer seen;
      seen.reserve(world * sizeof(std::int32_t));
      const Event landed;
      std::mt19937 rng(11 + rank);
      for (std::int32_t round = 1; round <= 40; ++round) {
        // One rank at a time is late: the others' barriers must hold them until its copies land.
        if (round % world == rank)
          std::this_thread::sleep_for(std::chrono::milliseconds(5 + rng() % 15));
        MOE_CHECK_CUDA(cudaMemcpyAsync(round_value.data(), &round, sizeof(round),
                                       cudaMemcpyHostToDevice, stream.get()));
        for (int peer = 0; peer < world; ++peer) {
          auto* slot = static_cast<char*>(slots.ranks()[peer]) + rank * sizeof(std::int32_t);
          MOE_CHECK_CUDA(cudaMemcpyAsync(slot, round_value.data(), sizeof(round),
                                         cudaMemcpyDeviceToDevice, stream.get()));
        }
        barrier.arrive_and_wait(stream.get());
        MOE_CHECK_CUDA(cudaMemcpyAsync(seen.as<void>(), slots.local(), world * sizeof(std::int32_t),
                                       cudaMemcpyDeviceToHost, stream.get()));
        landed.record(stream.get());
        mesh.wait(landed.get(), "the round's copies");
        const auto* values = seen.as<const std::int32_t>();
        for (int source = 0; source < world; ++source) {
          INFO("round " << round << ", rank " << rank << "'s slot of rank " << source);
          REQUIRE(values[source] == round);
        }
        // The next round's copies must not land before every rank has read this one.
        barrier.arrive_and_wait(stream.get());
      }
      landed.record(stream.get());
      mesh.wait(landed.get(), "the last barrier");
    }
  }
}

TEST_CASE("an abort releases a stream barrier that waits for a rank that never arrives",
          "[mpi][mesh]") {
  const int world = test::world_size(), rank = test::world_rank();
  if (!can_run(world)) return;
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, world, kTimeout);
  const Stream stream;
  {
    StreamBarrier barrier(mesh, stream.get());
    REQUIRE(barrier.without_sm());
    const Event passed;
    if (rank == 0) {
      barrier.arrive_and_wait(stream.get());
      passed.record(stream.get());
    }
    MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      CHECK_FALSE(event_done(passed));  // rank 1 never arrives
      mesh.abort();
      const auto start = std::chrono::steady_clock::now();
      while (!event_done(passed) && std::chrono::steady_clock::now() - start < kTimeout)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      CHECK(event_done(passed));
      CHECK_THROWS_WITH(barrier.arrive_and_wait(stream.get()), test::contains_text("aborted"));
    } else {
      mesh.abort();  // a failure here, as it ends every rank's mesh
    }
    stream.synchronize();
  }
  MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
}
