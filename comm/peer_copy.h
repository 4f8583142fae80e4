// The rows' all-to-allv by the GPUs' copy engines: blocks of rows copied straight into the
// PeerBuffers of the EP group's ranks, so that no SM moves them and the experts' products keep
// every SM while the rows cross (docs/design.md, "Transports"). The copy exchange
// (ep_transport: copy) stands on it; its counts still cross by NCCL.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "comm/peer_memory.h"
#include "comm/stream_barrier.h"
#include "moe/device.h"
#include "moe/mesh.h"

namespace moe {

// `rows` rows from row `from` of this rank's source to row `to` of EP rank `peer`'s buffer.
struct RowCopy {
  int peer = 0;
  std::int64_t from = 0, to = 0, rows = 0;
};

class PeerRowCopies {
 public:
  // Collective over the EP group (its barrier's setup, on `stream`). The mesh must outlive the
  // copies.
  PeerRowCopies(const Mesh& mesh, cudaStream_t stream);

  // Collective over the EP group: every rank calls it with its own copies (any number, to any
  // rank, itself included). Each peer's copies run as one batch on a stream of that peer, forked
  // from `stream` and joined back to it; a barrier over the EP group follows on `stream` (a
  // StreamBarrier, which needs no SM), so that the work queued after it on any rank finds every
  // rank's rows to it landed.
  void copy(const void* source, std::span<const RowCopy> copies, const PeerBuffer& destination,
            std::size_t row_bytes, cudaStream_t stream);

 private:
  const Mesh& mesh_;
  std::vector<Stream> peer_streams_;  // [EP]
  std::vector<Event> copied_;         // [EP]
  Event forked_;
  StreamBarrier barrier_;
  // One peer's batch, reused from call to call.
  std::vector<void*> destinations_;
  std::vector<void*> sources_;  // not const: CUDA 12's batch copy takes void**
  std::vector<std::size_t> sizes_;
};

}  // namespace moe
