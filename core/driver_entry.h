// The CUDA driver's calls that the runtime lacks (stream memory operations, tensor maps), found at
// run time through the runtime's entry-point query: linking the driver library would keep every
// binary from starting on a machine without one.
#pragma once

#include <cuda_runtime_api.h>

namespace moe {

// Points `call` at the driver's `symbol` (its CUDA 12.0 signature) and answers true, or answers
// false, leaving `call` as it was, where the driver lacks it. Never throws.
template <typename Function>
bool find_driver_call(const char* symbol, Function*& call) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t status =
      cudaGetDriverEntryPointByVersion(symbol, &address, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t status = cudaGetDriverEntryPoint(symbol, &address, cudaEnableDefault, &found);
#endif
  if (status != cudaSuccess) (void)cudaGetLastError();
  if (status != cudaSuccess || found != cudaDriverEntryPointSuccess || address == nullptr)
    return false;
  call = reinterpret_cast<Function*>(address);
  return true;
}

}  // namespace moe
