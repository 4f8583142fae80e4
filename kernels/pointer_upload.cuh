// Operand addresses for the experts' batched and grouped GEMM calls, written to device memory by
// a kernel that carries them in its parameters: the launch copies them, so the host never waits
// for an earlier upload before reusing its own memory, and a CUDA graph that captures the launch
// keeps the addresses it was captured with.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace moe {

// device[i] = addresses[i] for i < count, queued on `stream`; one launch per 1,000 addresses.
void upload_pointers(const void* const* addresses, std::size_t count, const void** device,
                     cudaStream_t stream);

}  // namespace moe
