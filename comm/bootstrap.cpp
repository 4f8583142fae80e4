#include "bootstrap.h"

#include <cuda_runtime_api.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "moe/device.h"
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

void require_same_settings(MPI_Comm comm, std::string_view settings) {
  int rank = 0, size = 0;
  MOE_CHECK_MPI(MPI_Comm_rank(comm, &rank));
  MOE_CHECK_MPI(MPI_Comm_size(comm, &size));
  if (size == 1) return;
  std::uint64_t hash = 1469598103934665603ull;  // FNV-1a: equal texts, equal hashes
  for (const char c : settings) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  std::vector<std::uint64_t> all(static_cast<std::size_t>(size));
  MOE_CHECK_MPI(MPI_Allgather(&hash, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, comm));
  std::vector<int> differ;
  for (int r = 1; r < size; ++r)
    if (all[static_cast<std::size_t>(r)] != all[0]) differ.push_back(r);
  if (!differ.empty())
    fail(
        "the ranks were started with different settings: the command line or config of rank(s) "
        "{} differ from rank 0's ({} ranks); every rank runs the same steps and shapes",
        fmt::join(differ, ", "), size);
}

void require_one_rank_per_gpu(MPI_Comm comm) {
  int rank = 0, size = 0;
  MOE_CHECK_MPI(MPI_Comm_rank(comm, &rank));
  MOE_CHECK_MPI(MPI_Comm_size(comm, &size));
  // A rank that cannot read its GPU's identity still joins the gather, so that no rank waits in
  // MPI (which has no timeout) for one that threw.
  struct Identity {
    char uuid[16] = {};
    int readable = 0;
    int gpus = 0;
  } mine;
  mine.gpus = cuda_device_count();
  cudaDeviceProp props{};
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaGetDeviceProperties(&props, device) == cudaSuccess) {
    static_assert(sizeof(props.uuid.bytes) == sizeof(mine.uuid));
    std::memcpy(mine.uuid, props.uuid.bytes, sizeof(mine.uuid));
    mine.readable = 1;
  }
  (void)cudaGetLastError();
  std::vector<Identity> all(static_cast<std::size_t>(size));
  MOE_CHECK_MPI(MPI_Allgather(&mine, sizeof(Identity), MPI_BYTE, all.data(), sizeof(Identity),
                              MPI_BYTE, comm));
  for (int r = 0; r < size; ++r) {
    if (all[r].gpus == 0) fail("rank {} of {} sees no CUDA GPU", r, size);
    if (!all[r].readable) fail("rank {} of {} could not read the identity of its GPU", r, size);
  }
  for (int a = 0; a < size; ++a) {
    for (int b = a + 1; b < size; ++b) {
      if (std::memcmp(all[a].uuid, all[b].uuid, sizeof(Identity::uuid)) != 0) continue;
      std::string uuid;
      for (const char byte : all[a].uuid)
        uuid += fmt::format("{:02x}", static_cast<unsigned char>(byte));
      fail(
          "ranks {} and {} of {} both run on GPU {} (NCCL needs one GPU per rank): start at most "
          "as many ranks per node as it has GPUs (rank {} sees {}), or give each rank its own "
          "GPU through CUDA_VISIBLE_DEVICES",
          a, b, size, uuid, rank, cuda_device_count());
    }
  }
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
