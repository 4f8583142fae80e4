// The EP×DP mesh: world rank r = dp_index·EP + ep_index, EP groups are contiguous ranks. Built from
// MPI (the world or a communicator the trainer passes) or from an NCCL communicator the trainer
// already has; the EP and DP communicators are split from the world one.
//
// Nothing waits forever: blocking NCCL calls run under a watchdog thread that aborts the
// communicators past the timeout (NCCL allows ncclCommAbort from another thread to release a
// blocked call), and waits for device work poll the communicators' asynchronous errors; either
// way a moe::Error names the rank and the operation.
#pragma once

#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

#include <cuda_runtime_api.h>

namespace moe {

enum class MeshGroup { kWorld, kExpertParallel, kDataParallel };

struct AbortReleases;  // comm/mesh.cpp

class Mesh {
 public:
  using Timeout = std::chrono::milliseconds;
  static constexpr Timeout kDefaultTimeout{std::chrono::minutes(5)};

  // One GPU, no communicators (EP = DP = 1). Uses the current CUDA device.
  static Mesh single();
  // Collective over `comm`: validates ep·dp = size and num_experts % ep = 0 on every rank (the same
  // error everywhere, before any communication), chooses the GPU by node-local rank, creates the
  // world communicator and splits the EP and DP ones.
  static Mesh from_mpi(MPI_Comm comm, int ep, int dp, int num_experts,
                       Timeout timeout = kDefaultTimeout);
  // Over the trainer's communicator (its GPU must be current). Collective over it once: the mesh
  // splits a private copy of it and the EP and DP groups from that copy, so that nothing the mesh
  // does later, an abort after a failure included, touches the trainer's communicator.
  static Mesh from_nccl(ncclComm_t world, int ep, int dp, int num_experts,
                        Timeout timeout = kDefaultTimeout);

  Mesh(Mesh&&) noexcept;
  Mesh& operator=(Mesh&&) noexcept;
  ~Mesh();

  int rank() const { return rank_; }
  int world_size() const { return ep_ * dp_; }
  int ep() const { return ep_; }
  int dp() const { return dp_; }
  int ep_index() const { return rank_ % ep_; }
  int dp_index() const { return rank_ / ep_; }
  int device() const { return device_; }
  Timeout timeout() const { return timeout_; }
  int group_size(MeshGroup group) const;
  // The group's communicator; null for a group of one rank.
  ncclComm_t comm(MeshGroup group) const;

  // In-place sum over a group (nothing for a group of one).
  void all_reduce_sum(void* data, std::size_t count, ncclDataType_t type, MeshGroup group,
                      cudaStream_t stream) const;
  // In-place reduction by `op` over a group (nothing for a group of one).
  void all_reduce(void* data, std::size_t count, ncclDataType_t type, ncclRedOp_t op,
                  MeshGroup group, cudaStream_t stream) const;
  // Every rank's `bytes` of `send` (device) into recv[rank · bytes] (device), in group rank order
  // (nothing but the copy for a group of one).
  void all_gather(const void* send, void* recv, std::size_t bytes, MeshGroup group,
                  cudaStream_t stream) const;
  // Collective over the world: one small and one large collective of each kind the layer runs
  // (all-reduce, all-gather, send and receive to every peer) on every group, then waits. NCCL
  // connects lazily, allocating an algorithm's buffers at its first use; after this, steps
  // allocate nothing for communication, and a benchmark can tell the mesh's memory (shared by
  // every layer and the trainer) from a layer's.
  void connect(cudaStream_t stream) const;
  // Brackets NCCL calls into one group (nestable); the outermost group_end launches them under
  // the watchdog, so a missing peer raises after the timeout instead of blocking the host.
  void group_start() const;
  void group_end(std::string_view operation) const;
  // Blocks until `event` completes, polling NCCL errors; after the timeout aborts every
  // communicator and throws, naming this rank and `operation`.
  void wait(cudaEvent_t event, std::string_view operation) const;
  // How many times wait() was called on this mesh: every host synchronisation of a MoEBlock's
  // step goes through it, so a trainer or a test can count a step's synchronisations.
  std::int64_t host_waits() const noexcept { return host_waits_; }
  // Aborts every communicator of the mesh (after a failure elsewhere): later collectives are
  // errors. The trainer's communicator given to from_nccl is not one of them.
  void abort() const noexcept;
  // Whether the communicators were aborted (by abort(), a timeout or an NCCL error).
  bool aborted() const noexcept;
  // A release registered by on_abort, for as long as it lives: its destruction unregisters it,
  // and once that returns the abort neither runs nor is running it. It holds the mesh's registry
  // itself, so it stays valid across moves of the Mesh.
  class AbortRelease {
   public:
    AbortRelease() = default;
    ~AbortRelease();
    AbortRelease(AbortRelease&& other) noexcept;
    AbortRelease& operator=(AbortRelease&& other) noexcept;
    AbortRelease(const AbortRelease&) = delete;
    AbortRelease& operator=(const AbortRelease&) = delete;

   private:
    friend class Mesh;
    std::shared_ptr<AbortReleases> registry_;
    std::uint64_t id_ = 0;
  };
  // Registers `release` for the mesh's abort, which calls it once, on the aborting thread, before
  // it aborts the communicators: for device work that waits on a peer outside NCCL (a stream
  // waiting on a flag in memory, which no communicator's abort ends). Called at once if the mesh
  // is already aborted. It must neither throw nor block. A mesh without communicators (one GPU)
  // never aborts and keeps nothing.
  [[nodiscard]] AbortRelease on_abort(std::function<void()> release) const;

 private:
  Mesh() = default;
  void start_watchdog();
  struct Comms;
  int rank_ = 0;
  int ep_ = 1;
  int dp_ = 1;
  int device_ = 0;
  Timeout timeout_ = kDefaultTimeout;
  mutable int group_depth_ = 0;
  mutable std::int64_t host_waits_ = 0;
  std::unique_ptr<Comms> comms_;
};

// Throws moe::Error unless ep·dp = world and num_experts % ep = 0.
void validate_mesh_shape(int world, int ep, int dp, int num_experts);

}  // namespace moe
