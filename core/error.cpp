#include "moe/error.h"

#include <mpi.h>

namespace moe::detail {

void check_cuda(cudaError_t status, std::string_view call, const char* file, int line) {
  if (status == cudaSuccess) return;
  fail("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(status), cudaGetErrorString(status),
       call, file, line);
}

void check_cublas(cublasStatus_t status, std::string_view call, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  fail("cuBLASLt error {} ({}) in {} at {}:{}", cublasLtGetStatusName(status),
       cublasLtGetStatusString(status), call, file, line);
}

void check_nccl(ncclResult_t status, std::string_view call, const char* file, int line) {
  // ncclInProgress is how a non-blocking communicator says "queued"; its completion is polled.
  if (status == ncclSuccess || status == ncclInProgress) return;
  fail("NCCL error {} ({}) in {} at {}:{}", static_cast<int>(status), ncclGetErrorString(status),
       call, file, line);
}

void check_mpi(int status, std::string_view call, const char* file, int line) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(status, text, &length) != MPI_SUCCESS) length = 0;
  fail("MPI error {} ({}) in {} at {}:{}", status, std::string_view(text, length), call, file,
       line);
}

}  // namespace moe::detail
