#include "peer_copy.h"

#include <fmt/format.h>

#include <string>

#include "moe/error.h"

namespace moe {

PeerRowCopies::PeerRowCopies(const Mesh& mesh, cudaStream_t stream)
    : mesh_(mesh), barrier_(mesh, stream) {
  const int EP = mesh.ep();
  peer_streams_.resize(EP);
  copied_.resize(EP);
}

void PeerRowCopies::copy(const void* source, std::span<const RowCopy> copies,
                         const PeerBuffer& destination, std::size_t row_bytes,
                         cudaStream_t stream) {
  const int EP = mesh_.ep();
  forked_.record(stream);
  const auto* from = static_cast<const char*>(source);
  // The copies may run in any order and on any of the GPU's copy engines, beside the kernels
  // (the hint asks the driver to leave the SMs to them).
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  std::size_t first_attribute = 0;
  for (int peer = 0; peer < EP; ++peer) {
    destinations_.clear();
    sources_.clear();
    sizes_.clear();
    auto* to = static_cast<char*>(destination.ranks()[peer]);
    for (const RowCopy& c : copies) {
      if (c.peer != peer || c.rows == 0) continue;
      const std::size_t bytes = static_cast<std::size_t>(c.rows) * row_bytes;
      const std::size_t at = static_cast<std::size_t>(c.to) * row_bytes;
      // The copies come from the same counts as the buffers' sizes: a block past a buffer is a
      // bug here, and must not become a store into another process's memory.
      if (c.from < 0 || c.to < 0 || c.rows < 0 || at + bytes > destination.capacity(peer))
        fail(
            "PeerRowCopies::copy: {} rows from row {} to row {} pass EP rank {}'s buffer of {} "
            "bytes",
            c.rows, c.from, c.to, peer, destination.capacity(peer));
      destinations_.push_back(to + at);
      sources_.push_back(const_cast<char*>(from) + static_cast<std::size_t>(c.from) * row_bytes);
      sizes_.push_back(bytes);
    }
    if (sizes_.empty()) continue;
    const cudaStream_t lane = peer_streams_[peer].get();
    MOE_CHECK_CUDA(cudaStreamWaitEvent(lane, forked_.get(), 0));
#if CUDART_VERSION >= 13000
    MOE_CHECK_CUDA(cudaMemcpyBatchAsync(destinations_.data(), sources_.data(), sizes_.data(),
                                        sizes_.size(), &attributes, &first_attribute, 1, lane));
#else  // CUDA 12.8 and 12.9 also report the index of a copy that failed: named with its bytes
    std::size_t failed_copy = 0;
    const cudaError_t status =
        cudaMemcpyBatchAsync(destinations_.data(), sources_.data(), sizes_.data(), sizes_.size(),
                             &attributes, &first_attribute, 1, &failed_copy, lane);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      const std::string which =
          failed_copy < sizes_.size()
              ? fmt::format("copy {} ({} bytes)", failed_copy, sizes_[failed_copy])
              : std::string("a copy");
      fail("PeerRowCopies::copy: {} of {} to EP rank {} failed: {} ({})", which, sizes_.size(),
           peer, cudaGetErrorName(status), cudaGetErrorString(status));
    }
#endif
    copied_[peer].record(lane);
    MOE_CHECK_CUDA(cudaStreamWaitEvent(stream, copied_[peer].get(), 0));
  }
  // A copy has landed in the peer's memory once it completes in stream order, so the barrier,
  // behind every rank's copies, marks every rank's rows as landed everywhere.
  barrier_.arrive_and_wait(stream);
}

}  // namespace moe
