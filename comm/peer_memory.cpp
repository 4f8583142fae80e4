#include "peer_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "moe/error.h"

namespace moe {
namespace {

// Every EP rank's `mine` on every rank, through `staging` (device) and the mesh's timed wait.
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

struct Identity {
  char host[64];
  char bus[32];
};

std::size_t round_up(std::size_t bytes, std::size_t multiple) {
  return (bytes + multiple - 1) / multiple * multiple;
}

}  // namespace

bool ep_group_has_peer_access(const Mesh& mesh, cudaStream_t stream) {
  const int EP = mesh.ep();
  if (EP < 2 || EP > kMaxPeerRanks) return false;  // the same on every rank: no vote needed
  DeviceBuffer staging;
  Event done;
  Identity me{};
  if (gethostname(me.host, sizeof(me.host) - 1) != 0) std::strcpy(me.host, "?");
  MOE_CHECK_CUDA(cudaDeviceGetPCIBusId(me.bus, sizeof(me.bus), mesh.device()));
  const auto everyone =
      all_gather_host(mesh, me, staging, done, stream, "the EP group's peer-access check");
  int ok = 1;
  for (int r = 0; r < EP && ok; ++r) {
    if (r == mesh.ep_index()) continue;
    const Identity& peer = everyone[r];
    int device = -1, can = 0;
    if (std::strncmp(peer.host, me.host, sizeof(me.host)) != 0 ||
        cudaDeviceGetByPCIBusId(&device, peer.bus) != cudaSuccess) {
      (void)cudaGetLastError();  // a GPU this process cannot see: no peer access
      ok = 0;
    } else if (device != mesh.device()) {
      MOE_CHECK_CUDA(cudaDeviceCanAccessPeer(&can, mesh.device(), device));
      ok = can;
    }
  }
  const auto votes = all_gather_host(mesh, ok, staging, done, stream, "the peer-access vote");
  return std::all_of(votes.begin(), votes.end(), [](int v) { return v == 1; });
}

PeerBuffer::PeerBuffer(const Mesh& mesh)
    : mesh_(mesh), ranks_(mesh.ep()), me_(mesh.ep_index()), capacity_(mesh.ep(), 0) {
  if (mesh.ep() > kMaxPeerRanks)
    fail("PeerBuffer: ep = {} exceeds the {} ranks the peer exchange addresses", mesh.ep(),
         kMaxPeerRanks);
}

PeerBuffer::~PeerBuffer() {
  for (int r = 0; r < ranks_; ++r) close_mapping(r);
}

void PeerBuffer::close_mapping(int rank) noexcept {
  if (rank != me_ && mapped_[rank] != nullptr) (void)cudaIpcCloseMemHandle(mapped_[rank]);
  mapped_[rank] = nullptr;
}

void PeerBuffer::reserve(std::span<const std::size_t> bytes, cudaStream_t stream) {
  const int EP = mesh_.ep(), me = mesh_.ep_index();
  if (std::ssize(bytes) != EP)
    fail("PeerBuffer::reserve: {} sizes for {} EP ranks", bytes.size(), EP);
  std::vector<bool> grows(EP, false);
  bool any = false;
  for (int r = 0; r < EP; ++r) {
    grows[r] = bytes[r] > capacity_[r] || capacity_[r] == 0;  // none yet: map one
    any = any || grows[r];
  }
  if (!any) return;
  // Nothing queued may still use a mapping that closes, and no rank may free a buffer another
  // still maps (CUDA leaves that undefined): wait, close, then agree before anyone frees.
  done_.record(stream);
  mesh_.wait(done_.get(), "the work queued before the peer buffers grow");
  for (int r = 0; r < EP; ++r) {
    if (grows[r]) close_mapping(r);
  }
  (void)all_gather_host(mesh_, 0, staging_, done_, stream, "the peer buffers' unmapping");
  for (int r = 0; r < EP; ++r) {
    // Headroom: the next steps' routing differs a little; 2 MiB granules, as the driver maps.
    if (grows[r]) capacity_[r] = round_up(bytes[r] + bytes[r] / 8 + 1, std::size_t{2} << 20);
  }
  if (grows[me]) {
    local_.release();
    local_.reserve(capacity_[me]);
  }
  cudaIpcMemHandle_t handle{};
  MOE_CHECK_CUDA(cudaIpcGetMemHandle(&handle, local_.data()));
  const auto handles =
      all_gather_host(mesh_, handle, staging_, done_, stream, "the peer buffers' handles");
  for (int r = 0; r < EP; ++r) {
    if (r == me) {
      mapped_[r] = local_.data();
    } else if (grows[r]) {
      MOE_CHECK_CUDA(cudaIpcOpenMemHandle(&mapped_[r], handles[r], cudaIpcMemLazyEnablePeerAccess));
    }
  }
}

}  // namespace moe
