// Failures on a mesh: a peer that never joins the exchange (the others raise a moe::Error naming
// the rank and the operation within the timeout, instead of hanging; needs two ranks), an abort
// that leaves the trainer's communicator working, a moved-from mesh, two ranks on one GPU, a
// stream stalled past the timeout (on one GPU too).
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <utility>

#include "comm/bootstrap.h"
#include "comm/exchange.h"
#include "moe/device.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "support/catch.h"
#include "support/gpu_util.h"
#include "support/test_main.h"
#include "support/test_util.h"

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

TEST_CASE("a mesh over the trainer's communicator never aborts it", "[mpi][mesh]") {
  const int world = test::world_size();
  comm::NcclComm trainer = comm::NcclComm::from_mpi(MPI_COMM_WORLD);
  Mesh mesh = Mesh::from_nccl(trainer.get(), world, 1, 2 * world, std::chrono::milliseconds(3000));
  mesh.abort();  // what a failure does
  CHECK(mesh.aborted());
  CHECK_THROWS_WITH(mesh.comm(MeshGroup::kWorld), test::contains_text("aborted"));

  // The trainer's communicator still sums.
  Stream stream;
  DeviceBuffer value(sizeof(float));
  const float one = 1.0f;
  copy_to_device(value.data(), &one, sizeof(float));
  MOE_CHECK_NCCL(ncclAllReduce(value.data(), value.data(), 1, ncclFloat32, ncclSum, trainer.get(),
                               stream.get()));
  stream.synchronize();
  float sum = 0.0f;
  copy_to_host(&sum, value.data(), sizeof(float));
  CHECK(sum == static_cast<float>(world));
}

TEST_CASE("a moved-from mesh refuses collectives instead of doing nothing", "[mpi][mesh]") {
  const int world = test::world_size();
  if (world < 2) {
    WARN("needs two ranks; a mesh of one rank has nothing to reduce");
    return;
  }
  Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, 2 * world);
  const Mesh moved = std::move(mesh);
  Stream stream;
  DeviceBuffer value(sizeof(float));
  CHECK_THROWS_WITH(
      mesh.all_reduce_sum(value.data(), 1, ncclFloat32, MeshGroup::kWorld, stream.get()),
      test::contains_text("moved from"));
  CHECK(moved.comm(MeshGroup::kWorld) != nullptr);
}

namespace {

// Holds a stream where it is queued until release() (or a minute, whatever happens): a stream
// stalled without a kernel, as a hung kernel or a peer that never comes would stall it.
class StreamStall {
 public:
  explicit StreamStall(cudaStream_t stream) {
    MOE_CHECK_CUDA(cudaLaunchHostFunc(stream, &StreamStall::hold, &released_));
  }
  ~StreamStall() { release(); }
  StreamStall(const StreamStall&) = delete;
  StreamStall& operator=(const StreamStall&) = delete;
  void release() { released_ = true; }

 private:
  static void CUDART_CB hold(void* flag) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(1);
    while (!static_cast<std::atomic<bool>*>(flag)->load() &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  std::atomic<bool> released_ = false;
};

}  // namespace

TEST_CASE("a stalled stream is an error within the timeout, on one rank as on many",
          "[mpi][mesh]") {
  const int world = test::world_size();
  const auto timeout = std::chrono::milliseconds(500);
  MoEConfig config = test::small_config(32, 24, 2 * world, 2);
  config.ep = world;
  config.gemm_autotune = false;
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, world, 1, config.num_experts, timeout);
  Stream stream;
  {
    // A wait on the mesh behind the stall.
    StreamStall stall(stream.get());
    Event queued;
    queued.record(stream.get());
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(mesh.wait(queued.get(), "the stalled stream's event"),
                      test::contains_text("the stalled stream's event did not complete within "
                                          "500 ms"));
    CHECK(std::chrono::steady_clock::now() - start < timeout + std::chrono::seconds(2));
    stall.release();
    stream.synchronize();
  }
  if (world == 1) {  // (on several ranks the wait above aborted the mesh)
    // A block's synchronize() behind the stall: an error, not a wait without end.
    MoEBlock block(config, mesh, stream.get());
    StreamStall stall(stream.get());
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(block.synchronize(),
                      test::contains_text("the block's queued work did not complete within "
                                          "500 ms"));
    CHECK(std::chrono::steady_clock::now() - start < timeout + std::chrono::seconds(2));
    stall.release();
    stream.synchronize();
  }
  MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
}

// Run as two ranks that see one GPU (tests/CMakeLists.txt: mpi.test_mesh_failure.same_gpu).
TEST_CASE("two ranks on one GPU are told to start one rank per GPU", "[.same-gpu]") {
  REQUIRE(test::world_size() == 2);
  CHECK_THROWS_WITH(
      Mesh::from_mpi(MPI_COMM_WORLD, 2, 1, 4),
      test::contains_text("both run on GPU") && test::contains_text("one GPU per rank"));
}
