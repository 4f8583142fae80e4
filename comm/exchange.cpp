#include "exchange.h"

#include <cstring>
#include <numeric>

#include "moe/error.h"

namespace moe {

std::int64_t ExchangeCounts::total_received() const {
  return std::accumulate(recv_rows.begin(), recv_rows.end(), std::int64_t{0});
}

ExpertExchange::ExpertExchange(const Mesh& mesh, int num_experts)
    : mesh_(mesh), experts_(num_experts), local_experts_(num_experts / mesh.ep()) {
  validate_mesh_shape(mesh.world_size(), mesh.ep(), mesh.dp(), num_experts);
}

const ExchangeCounts& ExpertExchange::exchange_counts(const std::int32_t* counts,
                                                      std::int32_t* received_counts,
                                                      const void* extra_device, void* extra_host,
                                                      std::size_t extra_bytes,
                                                      cudaStream_t stream) {
  const int EP = mesh_.ep();
  const std::size_t counts_bytes = static_cast<std::size_t>(experts_) * sizeof(std::int32_t);
  // Each peer j gets this rank's counts for j's experts; this rank gets each peer's for its own.
  if (ncclComm_t ep = mesh_.comm(MeshGroup::kExpertParallel)) {
    mesh_.group_start();
    for (int peer = 0; peer < EP; ++peer) {
      MOE_CHECK_NCCL(
          ncclSend(counts + peer * local_experts_, local_experts_, ncclInt32, peer, ep, stream));
      MOE_CHECK_NCCL(ncclRecv(received_counts + peer * local_experts_, local_experts_, ncclInt32,
                              peer, ep, stream));
    }
    mesh_.group_end("the dispatch counts exchange");
  } else {
    MOE_CHECK_CUDA(
        cudaMemcpyAsync(received_counts, counts, counts_bytes, cudaMemcpyDeviceToDevice, stream));
  }
  // The pinned buffer is free again once the previous call's copies landed (long since, as a
  // rule: that call waited for them); bounded all the same, like every wait on a mesh.
  if (cudaEventQuery(copied_.get()) != cudaSuccess)  // not a host wait, as a rule (see above)
    mesh_.wait(copied_.get(), "the previous dispatch's counts copy");
  host_.reserve(2 * counts_bytes + extra_bytes);
  auto* bytes = host_.as<char>();
  MOE_CHECK_CUDA(cudaMemcpyAsync(bytes, counts, counts_bytes, cudaMemcpyDeviceToHost, stream));
  MOE_CHECK_CUDA(cudaMemcpyAsync(bytes + counts_bytes, received_counts, counts_bytes,
                                 cudaMemcpyDeviceToHost, stream));
  if (extra_bytes > 0) {
    MOE_CHECK_CUDA(cudaMemcpyAsync(bytes + 2 * counts_bytes, extra_device, extra_bytes,
                                   cudaMemcpyDeviceToHost, stream));
  }
  copied_.record(stream);
  mesh_.wait(copied_.get(),
             "the dispatch counts exchange");  // the forward's one host synchronisation

  const auto* sent = reinterpret_cast<const std::int32_t*>(bytes);
  const auto* received = sent + experts_;
  counts_.sent.assign(sent, sent + experts_);
  counts_.received.assign(received, received + experts_);
  if (extra_bytes > 0) std::memcpy(extra_host, bytes + 2 * counts_bytes, extra_bytes);
  counts_.send_rows.assign(EP, 0);
  counts_.recv_rows.assign(EP, 0);
  for (int peer = 0; peer < EP; ++peer) {
    for (int e = 0; e < local_experts_; ++e) {
      counts_.send_rows[peer] += counts_.sent[peer * local_experts_ + e];
      counts_.recv_rows[peer] += counts_.received[peer * local_experts_ + e];
    }
  }
  return counts_;
}

void ExpertExchange::exchange_rows(const void* send, const std::vector<std::int64_t>& send_rows,
                                   void* recv, const std::vector<std::int64_t>& recv_rows,
                                   std::size_t row_bytes, cudaStream_t stream) const {
  std::vector<std::int64_t> send_offsets(send_rows.size(), 0), recv_offsets(recv_rows.size(), 0);
  for (std::size_t p = 1; p < send_rows.size(); ++p)
    send_offsets[p] = send_offsets[p - 1] + send_rows[p - 1];
  for (std::size_t p = 1; p < recv_rows.size(); ++p)
    recv_offsets[p] = recv_offsets[p - 1] + recv_rows[p - 1];
  exchange_row_ranges(send, send_offsets, send_rows, recv, recv_offsets, recv_rows, row_bytes,
                      stream);
}

void ExpertExchange::exchange_row_ranges(const void* send,
                                         std::span<const std::int64_t> send_offsets,
                                         std::span<const std::int64_t> send_rows, void* recv,
                                         std::span<const std::int64_t> recv_offsets,
                                         std::span<const std::int64_t> recv_rows,
                                         std::size_t row_bytes, cudaStream_t stream) const {
  const int EP = mesh_.ep();
  if (std::ssize(send_rows) != EP || std::ssize(recv_rows) != EP ||
      std::ssize(send_offsets) != EP || std::ssize(recv_offsets) != EP) {
    fail("exchange_rows: {} send and {} receive counts, {} and {} offsets, for {} EP peers",
         send_rows.size(), recv_rows.size(), send_offsets.size(), recv_offsets.size(), EP);
  }
  const int me = mesh_.ep_index();
  if (send_rows[me] != recv_rows[me])
    fail("exchange_rows: {} rows to self but {} from self", send_rows[me], recv_rows[me]);
  const auto bytes = [row_bytes](std::int64_t rows) {
    return static_cast<std::size_t>(rows) * row_bytes;
  };
  const auto* src = static_cast<const char*>(send);
  auto* dst = static_cast<char*>(recv);
  ncclComm_t ep = mesh_.comm(MeshGroup::kExpertParallel);
  if (ep == nullptr) {  // one EP rank: its own rows are a device copy
    if (send_rows[0] > 0) {
      MOE_CHECK_CUDA(cudaMemcpyAsync(dst + bytes(recv_offsets[0]), src + bytes(send_offsets[0]),
                                     bytes(send_rows[0]), cudaMemcpyDeviceToDevice, stream));
    }
    return;
  }
  // Own rows go through NCCL too: its kernel copies them while the links carry the rest, which
  // measured faster than a device copy beside it (bench_exchange, docs/performance.md).
  mesh_.group_start();
  for (int peer = 0; peer < EP; ++peer) {
    if (send_rows[peer] > 0) {
      MOE_CHECK_NCCL(ncclSend(src + bytes(send_offsets[peer]), bytes(send_rows[peer]), ncclInt8,
                              peer, ep, stream));
    }
    if (recv_rows[peer] > 0) {
      MOE_CHECK_NCCL(ncclRecv(dst + bytes(recv_offsets[peer]), bytes(recv_rows[peer]), ncclInt8,
                              peer, ep, stream));
    }
  }
  mesh_.group_end("the rows all-to-allv");
}

}  // namespace moe
