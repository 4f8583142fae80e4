// MPI start-up and NCCL communicators created over MPI: the bootstrap the mesh stands on.
#pragma once

#include <mpi.h>
#include <nccl.h>

#include <string_view>
#include <utility>

namespace moe::comm {

// Initialises MPI (with thread support for a trainer's helper threads) unless the trainer already
// did, and finalises it only if it initialised it.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  bool owns_ = false;
  int rank_ = 0;
  int size_ = 1;
};

// Rank among the processes of `comm` on this node: chooses the GPU.
int node_local_rank(MPI_Comm comm);

// Collective over `comm`, after each rank chose its GPU: throws the same moe::Error on every rank
// when two ranks hold one GPU (found by the GPUs' UUIDs, unique across machines), naming the
// ranks, the GPU and the remedy. NCCL cannot run two ranks on one GPU.
void require_one_rank_per_gpu(MPI_Comm comm);

// Collective over `comm`: throws the same moe::Error on every rank when the ranks' `settings` (a
// program's command line and config, as text) differ, naming the ranks that differ from rank 0.
// Ranks that run different steps, shapes or layer counts would wait on each other's
// collectives; this finds them before the first.
void require_same_settings(MPI_Comm comm, std::string_view settings);

// Owns an NCCL communicator; destroys it, or aborts it after a failure so that no peer hangs on it.
class NcclComm {
 public:
  NcclComm() = default;
  explicit NcclComm(ncclComm_t comm) : comm_(comm) {}
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  NcclComm(NcclComm&& other) noexcept : comm_(std::exchange(other.comm_, nullptr)) {}
  NcclComm& operator=(NcclComm&& other) noexcept;

  // Collective over `comm`: rank 0 makes the unique id, MPI broadcasts it. The current CUDA device
  // must already be this rank's GPU. The communicator is blocking: a call returns once its work
  // is on the stream, so stream order holds; Mesh bounds blocking calls with a watchdog.
  static NcclComm from_mpi(MPI_Comm comm);

  ncclComm_t get() const { return comm_; }
  int rank() const;
  int size() const;
  // Aborts the communicator (after an error or a timeout); later use is an error.
  void abort() noexcept;
  // Gives up ownership: the caller destroys or aborts the handle.
  [[nodiscard]] ncclComm_t release() noexcept { return std::exchange(comm_, nullptr); }

 private:
  ncclComm_t comm_ = nullptr;
};

}  // namespace moe::comm
