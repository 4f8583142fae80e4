#include "bootstrap.h"

#include "moe/error.h"

namespace moe::comm {

MpiSession::MpiSession(int* argc, char*** argv) {
  int initialised = 0;
  MOE_CHECK_MPI(MPI_Initialized(&initialised));
  if (!initialised) {
    int provided = 0;
    MOE_CHECK_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
    owns_ = true;
  }
  MOE_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  MOE_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &size_));
}

MpiSession::~MpiSession() {
  int finalised = 0;
  if (owns_ && MPI_Finalized(&finalised) == MPI_SUCCESS && !finalised) (void)MPI_Finalize();
}

int node_local_rank(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  MOE_CHECK_MPI(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int rank = 0;
  const int status = MPI_Comm_rank(node, &rank);
  (void)MPI_Comm_free(&node);
  MOE_CHECK_MPI(status);
  return rank;
}

NcclComm::~NcclComm() {
  if (comm_ != nullptr) (void)ncclCommDestroy(comm_);
}

NcclComm& NcclComm::operator=(NcclComm&& other) noexcept {
  if (this != &other) {
    if (comm_ != nullptr) (void)ncclCommDestroy(comm_);
    comm_ = std::exchange(other.comm_, nullptr);
  }
  return *this;
}

NcclComm NcclComm::from_mpi(MPI_Comm comm) {
  int rank = 0;
  int size = 0;
  MOE_CHECK_MPI(MPI_Comm_rank(comm, &rank));
  MOE_CHECK_MPI(MPI_Comm_size(comm, &size));
  ncclUniqueId id{};
  if (rank == 0) MOE_CHECK_NCCL(ncclGetUniqueId(&id));
  MOE_CHECK_MPI(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm));
  ncclComm_t handle = nullptr;
  MOE_CHECK_NCCL(ncclCommInitRank(&handle, size, id, rank));
  return NcclComm(handle);
}

int NcclComm::rank() const {
  int rank = 0;
  MOE_CHECK_NCCL(ncclCommUserRank(comm_, &rank));
  return rank;
}

int NcclComm::size() const {
  int size = 0;
  MOE_CHECK_NCCL(ncclCommCount(comm_, &size));
  return size;
}

void NcclComm::abort() noexcept {
  if (comm_ != nullptr) (void)ncclCommAbort(comm_);
  comm_ = nullptr;
}

}  // namespace moe::comm
