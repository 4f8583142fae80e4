// The least time a kernel that moves given bytes can take on this GPU: one launch that reads up to
// two buffers and writes one, with nothing in between but 16-byte loads and stores. A benchmark
// that counts a stage's floor in bytes times these passes beside the stage to learn how close a
// kernel of that size and launch count can come to the floor at all (launch, ramp-up and drain
// included).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace moe::bench {

struct StreamingPass {
  const void* first = nullptr;  // read
  std::size_t first_bytes = 0;
  const void* second = nullptr;  // read (may be null)
  std::size_t second_bytes = 0;
  void* out = nullptr;  // written (may be null)
  std::size_t out_bytes = 0;
};

// Every buffer 16-byte aligned; sizes are rounded up to 16 bytes, so each buffer must hold its
// size rounded up.
void launch_streaming_pass(const StreamingPass& pass, cudaStream_t stream);

}  // namespace moe::bench
