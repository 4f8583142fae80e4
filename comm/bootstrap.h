// MPI start-up and NCCL communicators created over MPI: the bootstrap the mesh stands on.
#pragma once

#include <mpi.h>
#include <nccl.h>

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

// Polls a non-blocking communicator until its pending calls are enqueued. Throws on an NCCL error
// or when `timeout_ms` passes (`what` names the operation); the caller, who owns the
// communicator, aborts it.
void settle(ncclComm_t comm, long timeout_ms, const char* what, int rank);

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
  // must already be this rank's GPU. The communicator is non-blocking (NCCL calls return at once
  // and are settled by polling, so a missing peer cannot block the host); the initialisation is
  // settled here, within `timeout_ms`.
  static NcclComm from_mpi(MPI_Comm comm, long timeout_ms);

  ncclComm_t get() const { return comm_; }
  int rank() const;
  int size() const;
  // Aborts the communicator (after an error or a timeout); later use is an error.
  void abort() noexcept;

 private:
  ncclComm_t comm_ = nullptr;
};

}  // namespace moe::comm
