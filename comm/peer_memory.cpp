#include "peer_memory.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "moe/error.h"

namespace moe {
namespace {

// A GPU by its UUID, unique across machines: a peer's GPU that this process can find among its
// own devices is on this host, whatever the host names say (names can repeat, or be cut short).
using GpuUuid = std::array<char, 16>;

GpuUuid uuid_of(int device) {
  cudaDeviceProp props{};
  MOE_CHECK_CUDA(cudaGetDeviceProperties(&props, device));
  GpuUuid uuid{};
  static_assert(sizeof(props.uuid.bytes) == sizeof(GpuUuid));
  std::memcpy(uuid.data(), props.uuid.bytes, uuid.size());
  return uuid;
}

// The device of this process whose UUID is `uuid`, or -1.
int local_device_of(const GpuUuid& uuid) {
  for (int device = 0; device < cuda_device_count(); ++device) {
    if (uuid_of(device) == uuid) return device;
  }
  return -1;
}

std::size_t round_up(std::size_t bytes, std::size_t multiple) {
  return (bytes + multiple - 1) / multiple * multiple;
}

}  // namespace

bool ep_group_has_peer_access(const Mesh& mesh, cudaStream_t stream) {
  const int EP = mesh.ep();
  if (EP < 2 || EP > kMaxPeerRanks) return false;  // the same on every rank: no vote needed
  DeviceBuffer staging;
  Event done;
  const GpuUuid mine = uuid_of(mesh.device());
  const auto everyone =
      all_gather_host(mesh, mine, staging, done, stream, "the EP group's peer-access check");
  int ok = 1;
  for (int r = 0; r < EP && ok; ++r) {
    if (r == mesh.ep_index()) continue;
    const int device = local_device_of(everyone[r]);
    if (device < 0 || device == mesh.device()) {
      ok = 0;  // another host's GPU, one this process cannot see, or this rank's own GPU
    } else {
      int can = 0;
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
  // Freeing memory that another process still maps is undefined, so the EP group tears down in
  // step: every rank closes its mappings, then all agree before any rank frees. The owner of the
  // buffer has let the work that used it finish (PeerExchange's destructor). The agreement is
  // bounded by the mesh's timeout: a destructor never blocks for good. Once the mesh has failed
  // there is no agreement, and the buffer is not freed at all.
  const bool reserved = mapped_[me_] != nullptr;
  for (int r = 0; r < ranks_; ++r) close_mapping(r);
  if (reserved && mesh_.aborted()) {
    // The peers may have failed anywhere, their kernels still loading or storing here once their
    // aborts release them: the buffer is left to the process's end, never freed under them.
    (void)new DeviceBuffer(std::move(local_));
    return;
  }
  if (!reserved) return;
  try {
    const Stream teardown;
    (void)all_gather_host(mesh_, 0, staging_, done_, teardown.get(), "the peer buffers' teardown");
  } catch (const std::exception&) {
    mesh_.abort();
    (void)new DeviceBuffer(std::move(local_));  // as above: a peer may still use it
  }
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
  // A growth frees the old buffer as any buffer's does: behind the exchanges' own streams too,
  // under the mesh's timeout (BufferGrowthDrain).
  if (grows[me]) local_.reserve(capacity_[me]);
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
