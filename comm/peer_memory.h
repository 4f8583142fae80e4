// Buffers that every rank of the EP group can load from and store to (CUDA IPC, over NVLink on
// one host), so that the dispatch and combine can be plain kernels writing rows where the experts
// read them, instead of NCCL operations into staging buffers: the plumbing of the peer token
// exchange (src/exchange_peer.cpp; docs/design.md, "Transports").
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <span>
#include <vector>

#include "moe/config.h"
#include "moe/device.h"
#include "moe/error.h"
#include "moe/mesh.h"

namespace moe {

// Collective over the EP group: true on every rank when the group has 2 to kMaxPeerRanks ranks,
// all on this host, and every rank's GPU can map every other's memory; false on every rank
// otherwise (the answer is agreed, never half the group).
bool ep_group_has_peer_access(const Mesh& mesh, cudaStream_t stream);

// Every EP rank's `mine` on every rank, in EP rank order, through `staging` (device) and the
// mesh's timed wait: how the EP group agrees on host values (handles, votes) outside a step.
template <typename T>
std::vector<T> all_gather_host(const Mesh& mesh, const T& mine, DeviceBuffer& staging,
                               const Event& done, cudaStream_t stream, const char* what) {
  const int EP = mesh.ep();
  staging.reserve(sizeof(T) * (EP + 1));
  auto* gathered = staging.as<char>() + sizeof(T);
  MOE_CHECK_CUDA(cudaMemcpyAsync(staging.data(), &mine, sizeof(T), cudaMemcpyHostToDevice, stream));
  mesh.all_gather(staging.data(), gathered, sizeof(T), MeshGroup::kExpertParallel, stream);
  done.record(stream);
  mesh.wait(done.get(), what);
  std::vector<T> out(EP);
  copy_to_host(out.data(), gathered, sizeof(T) * EP);
  return out;
}

// One grow-only device buffer per EP rank, each mapped into every rank of the group.
class PeerBuffer {
 public:
  // The mesh must outlive the buffer.
  explicit PeerBuffer(const Mesh& mesh);
  // Collective over the EP group once the buffer was reserved, and bounded by the mesh's timeout
  // (local once the mesh was aborted): no rank frees its buffer before every rank has closed its
  // mappings. The work that used the buffer must have finished.
  ~PeerBuffer();
  PeerBuffer(const PeerBuffer&) = delete;
  PeerBuffer& operator=(const PeerBuffer&) = delete;

  // Collective over the EP group; every rank passes the same bytes[EP] (each rank's need, known
  // everywhere from the all-gathered counts). Ranks whose buffer is smaller grow it, with
  // headroom, and every rank maps the new buffers; when nothing grows it returns at once without
  // communicating. Contents of a grown buffer are discarded. Waits for `stream` when it remaps.
  void reserve(std::span<const std::size_t> bytes, cudaStream_t stream);

  void* local() const { return local_.data(); }
  std::size_t bytes() const { return local_.bytes(); }
  // [EP rank] = that rank's buffer, addressable from this GPU (this rank's own at its index).
  const std::array<void*, kMaxPeerRanks>& ranks() const { return mapped_; }
  // The bytes of EP rank r's buffer (0 before the first reserve).
  std::size_t capacity(int rank) const { return capacity_.at(rank); }

 private:
  void close_mapping(int rank) noexcept;

  const Mesh& mesh_;
  int ranks_, me_;
  DeviceBuffer local_;
  std::vector<std::size_t> capacity_;  // [EP], the same on every rank
  std::array<void*, kMaxPeerRanks> mapped_{};
  DeviceBuffer staging_;  // the handles' all-gather
  Event done_;
};

}  // namespace moe
