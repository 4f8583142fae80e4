// The EP group's all-to-allv collectives, which the NCCL token exchange (src/exchange_nccl.cpp)
// stands on: the counts exchange, which carries the forward's one host synchronisation, and the
// rows' all-to-allv by grouped ncclSend/ncclRecv. Zero rows to or from a peer are allowed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "moe/device.h"
#include "moe/mesh.h"

namespace moe {

struct ExchangeCounts {
  std::vector<std::int32_t> sent;       // [E] this rank's rows per global expert
  std::vector<std::int32_t> received;   // [EP · E_loc] rows from source s for local expert e
  std::vector<std::int64_t> send_rows;  // [EP] rows to each EP peer
  std::vector<std::int64_t> recv_rows;  // [EP] rows from each EP peer
  std::int64_t total_received() const;
};

class ExpertExchange {
 public:
  ExpertExchange(const Mesh& mesh, int num_experts);

  // counts [E] (device): rows this rank routes to each global expert. Writes received [EP · E_loc]
  // to `received_counts` (device) and copies both to the host; `extra_bytes` of `extra_device`
  // (may be 0) ride along in the same copy into `extra_host`. Blocks once, with the mesh timeout.
  const ExchangeCounts& exchange_counts(const std::int32_t* counts, std::int32_t* received_counts,
                                        const void* extra_device, void* extra_host,
                                        std::size_t extra_bytes, cudaStream_t stream);

  // all-to-allv of rows of `row_bytes`: send holds the rows for EP peer 0, then 1, ...; recv gets
  // those from peer 0, then 1, ...
  void exchange_rows(const void* send, const std::vector<std::int64_t>& send_rows, void* recv,
                     const std::vector<std::int64_t>& recv_rows, std::size_t row_bytes,
                     cudaStream_t stream) const;

  // The same with each peer's rows at given offsets (rows, not bytes) instead of one after the
  // other: the pipelined exchange sends a chunk of each peer's range.
  void exchange_row_ranges(const void* send, std::span<const std::int64_t> send_offsets,
                           std::span<const std::int64_t> send_rows, void* recv,
                           std::span<const std::int64_t> recv_offsets,
                           std::span<const std::int64_t> recv_rows, std::size_t row_bytes,
                           cudaStream_t stream) const;

  const ExchangeCounts& counts() const { return counts_; }

 private:
  const Mesh& mesh_;
  int experts_;
  int local_experts_;
  PinnedBuffer host_;
  Event copied_;
  ExchangeCounts counts_;
};

}  // namespace moe
