#include "pointer_upload.cuh"

#include <algorithm>

#include "moe/error.h"

namespace moe {
namespace {

// 8 KB of addresses: well within the 32 KB of parameters a kernel may take since CUDA 12.1.
constexpr int kAddressesPerLaunch = 1000;

struct AddressBatch {
  const void* addresses[kAddressesPerLaunch];
  int count;
};

__global__ void upload_pointers_kernel(const __grid_constant__ AddressBatch batch,
                                       const void** device) {
  for (int i = static_cast<int>(threadIdx.x); i < batch.count; i += static_cast<int>(blockDim.x))
    device[i] = batch.addresses[i];
}

}  // namespace

void upload_pointers(const void* const* addresses, std::size_t count, const void** device,
                     cudaStream_t stream) {
  for (std::size_t first = 0; first < count; first += kAddressesPerLaunch) {
    AddressBatch batch;
    batch.count = static_cast<int>(std::min<std::size_t>(kAddressesPerLaunch, count - first));
    std::copy(addresses + first, addresses + first + batch.count, batch.addresses);
    upload_pointers_kernel<<<1, 256, 0, stream>>>(batch, device + first);
    MOE_CHECK_CUDA(cudaGetLastError());
  }
}

}  // namespace moe
