#include "src/token_exchange.h"

#include <mutex>
#include <utility>
#include <vector>

#include "comm/peer_memory.h"
#include "kernels/permute.cuh"
#include "moe/error.h"
#include "src/exchange_impl.h"
#include "src/stage_support.h"

namespace moe {

void SlotLayout::build(const std::int32_t* topk_idx, std::int64_t tokens, int topk, int experts,
                       int align, cudaStream_t stream, int fixed_rows, int fixed_groups) {
  auto* counts = typed<std::int32_t>(counts_, experts);
  auto* offsets = typed<std::int32_t>(offsets_, experts + 1);
  auto* row_map = typed<std::int32_t>(row_map_, tokens * topk);
  workspace_.reserve(layout_workspace_bytes(tokens, topk, experts));
  build_layout({topk_idx, tokens, topk, experts, align, counts, offsets, row_map, workspace_.data(),
                fixed_rows, fixed_groups},
               stream);
}

namespace {
std::mutex registered_streams_mutex;
std::vector<std::pair<cudaStream_t, const Mesh*>> registered_streams;
}  // namespace

ExchangeStreamRegistration::ExchangeStreamRegistration(cudaStream_t stream, const Mesh& mesh)
    : stream_(stream), mesh_(&mesh) {
  const std::lock_guard lock(registered_streams_mutex);
  registered_streams.emplace_back(stream_, mesh_);
}

ExchangeStreamRegistration::~ExchangeStreamRegistration() {
  const std::lock_guard lock(registered_streams_mutex);
  std::erase(registered_streams, std::pair(stream_, mesh_));
}

void drain_streams(const Mesh& mesh, cudaStream_t stream, const char* what) {
  std::vector<cudaStream_t> streams{stream};
  {
    const std::lock_guard lock(registered_streams_mutex);
    for (const auto& [queue, owner] : registered_streams)
      if (owner == &mesh && queue != stream) streams.push_back(queue);
  }
  for (const cudaStream_t queue : streams) {
    if (stream_is_capturing(queue)) continue;
    const Event drained;
    drained.record(queue);
    mesh.wait(drained.get(), what);
  }
}

bool choosing_exchange_is_collective(const Mesh& mesh) {
  return mesh.ep() > 1;
}

std::unique_ptr<TokenExchange> make_token_exchange(const ExchangeSetup& setup) {
  const MoEConfig& config = setup.config;
  const Mesh& mesh = setup.mesh;
  if (mesh.ep() == 1) return make_local_exchange(setup);
  // Fixed blocks (pad_to_capacity) and E4M3 rows (fp8_dispatch) run over NCCL alone (the config
  // refuses peer and copy with them).
  if ((config.capacity_mode() && config.pad_to_capacity) || config.fp8_dispatch)
    return make_nccl_exchange(setup);
  bool use_peer = false;
  if (config.ep_transport != EpTransport::kNccl) {
    use_peer = ep_group_has_peer_access(mesh, setup.stream);
    if (!use_peer && config.ep_transport != EpTransport::kAuto) {
      fail(
          "MoEBlock: ep_transport = {}, but the EP group of {} ranks is not all on one host "
          "with peer access between its GPUs (at most {} ranks); use auto or nccl",
          ep_transport_name(config.ep_transport), mesh.ep(), kMaxPeerRanks);
    }
  }
  if (config.ep_transport == EpTransport::kCopy) return make_nccl_exchange(setup);
  return use_peer ? make_peer_exchange(setup) : make_nccl_exchange(setup);
}

}  // namespace moe
