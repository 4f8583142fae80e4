// The stream barrier over an EP group of every rank (one host): it holds each rank's stream until
// the last rank's stream arrives, orders copies into peers' memory (queued on another stream and
// joined by an event, as the copy exchange queues them) before the work after it, on its flags
// and run by NCCL as the group falls back (one rank's asking is enough); and a rank's own abort,
// not a peer's, releases a wait for a rank that never arrives.
#include <mpi.h>

#include <algorithm>
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
  // On flags; with NCCL asked for on every rank; and on one rank alone, which the group's vote
  // extends to every rank.
  for (const char* runner : {"flags", "nccl", "nccl on rank 1"}) {
    DYNAMIC_SECTION("run by " << runner) {
      const std::string_view asked(runner);
      const bool nccl_here = asked == "nccl" || (asked == "nccl on rank 1" && rank == 1);
      const BarrierEnvironment environment(nccl_here ? "nccl" : nullptr);
      const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, world, kTimeout);
      const Stream stream, copies;
      StreamBarrier barrier(mesh, stream.get());
      CHECK(barrier.without_sm() == (asked == "flags"));
      // Each rank's slot of 1 MiB in every rank's buffer, copied as the copy exchange copies: on
      // a stream of its own, joined to the barrier's stream by an event.
      constexpr std::size_t kSlotInts = std::size_t{1} << 18;
      const std::size_t slot_bytes = kSlotInts * sizeof(std::int32_t);
      PeerBuffer slots(mesh);
      const std::vector<std::size_t> bytes(world, world * slot_bytes);
      slots.reserve(bytes, stream.get());
      DeviceBuffer source(slot_bytes);
      PinnedBuffer filled, seen;
      filled.reserve(slot_bytes);
      seen.reserve(world * slot_bytes);
      const Event forked, copied, landed;
      std::mt19937 rng(11 + rank);
      for (std::int32_t round = 1; round <= 40; ++round) {
        // One rank at a time is late: the others' barriers must hold them until its copies land.
        if (round % world == rank)
          std::this_thread::sleep_for(std::chrono::milliseconds(5 + rng() % 15));
        std::fill_n(filled.as<std::int32_t>(), kSlotInts, round);
        MOE_CHECK_CUDA(cudaMemcpyAsync(source.data(), filled.as<void>(), slot_bytes,
                                       cudaMemcpyHostToDevice, stream.get()));
        forked.record(stream.get());
        MOE_CHECK_CUDA(cudaStreamWaitEvent(copies.get(), forked.get(), 0));
        for (int peer = 0; peer < world; ++peer) {
          auto* slot = static_cast<char*>(slots.ranks()[peer]) + rank * slot_bytes;
          MOE_CHECK_CUDA(cudaMemcpyAsync(slot, source.data(), slot_bytes, cudaMemcpyDeviceToDevice,
                                         copies.get()));
        }
        copied.record(copies.get());
        MOE_CHECK_CUDA(cudaStreamWaitEvent(stream.get(), copied.get(), 0));
        barrier.arrive_and_wait(stream.get());
        MOE_CHECK_CUDA(cudaMemcpyAsync(seen.as<void>(), slots.local(), world * slot_bytes,
                                       cudaMemcpyDeviceToHost, stream.get()));
        landed.record(stream.get());
        mesh.wait(landed.get(), "the round's copies");
        const auto* values = seen.as<const std::int32_t>();
        std::size_t stale = 0;
        for (std::size_t i = 0; i < world * kSlotInts; ++i) stale += values[i] != round ? 1 : 0;
        INFO("round " << round << ", rank " << rank);
        REQUIRE(stale == 0);
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
    // Every other rank fails first: their aborts must not release rank 0's wait, which would
    // let it go on with rows that never came.
    if (rank != 0) mesh.abort();
    MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      CHECK_FALSE(event_done(passed));
      // Its own abort releases it, before the communicators' aborts (which would otherwise wait
      // for the device's work, the wait included, up to the mesh's timeout).
      const auto start = std::chrono::steady_clock::now();
      mesh.abort();
      CHECK(std::chrono::steady_clock::now() - start < kTimeout / 2);
      while (!event_done(passed) && std::chrono::steady_clock::now() - start < kTimeout)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      CHECK(event_done(passed));
      CHECK_THROWS_WITH(barrier.arrive_and_wait(stream.get()), test::contains_text("aborted"));
    }
    stream.synchronize();
  }
  MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
}

TEST_CASE("a stream barrier setting one rank got wrong, and an empty abort release, are refused",
          "[mpi][mesh]") {
  const int world = test::world_size(), rank = test::world_rank();
  if (!can_run(world)) return;
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, world, kTimeout);
  const Stream stream;
  {
    const BarrierEnvironment environment(rank == 1 ? "nccl-please" : nullptr);
    CHECK_THROWS_WITH(StreamBarrier(mesh, stream.get()),
                      test::contains_text("EP rank 1 has another value"));
  }
  CHECK_THROWS_WITH(mesh.on_abort({}), test::contains_text("release is empty"));
  // The mesh is still whole: a barrier after the refusals runs.
  StreamBarrier barrier(mesh, stream.get());
  barrier.arrive_and_wait(stream.get());
  const Event passed;
  passed.record(stream.get());
  mesh.wait(passed.get(), "the barrier after the refusals");
}
