#include "moe/error.h"

#include <mpi.h>

#include <algorithm>
#include <string>

namespace moe {

std::string readable_message(std::string_view message) {
  std::string out;
  out.reserve(std::min(message.size(), kMaxErrorBytes));
  std::size_t used = 0;
  for (; used < message.size(); ++used) {
    const auto c = static_cast<unsigned char>(message[used]);
    const bool control = (c < 0x20 && c != '\n' && c != '\t') || c == 0x7f;
    const std::size_t width = control ? 4 : 1;
    // Cut before a character that would pass the bound, and never inside a UTF-8 sequence.
    if (out.size() + width > kMaxErrorBytes) {
      while (used > 0 && out.size() > 0 &&
             (static_cast<unsigned char>(message[used]) & 0xC0) == 0x80) {
        --used;
        out.pop_back();
      }
      break;
    }
    if (control) {
      constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (used < message.size())
    out += " ... (" + std::to_string(message.size() - used) + " more bytes)";
  return out;
}

}  // namespace moe

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
