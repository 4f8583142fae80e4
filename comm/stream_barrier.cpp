#include "stream_barrier.h"

#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#include "comm/peer_memory.h"
#include "core/driver_entry.h"
#include "moe/error.h"

namespace moe {
namespace {

// A receiver's row of flags: one 64-byte line, whatever the group's size.
constexpr std::size_t kFlagsPerRank = 8;
static_assert(kMaxPeerRanks <= static_cast<int>(kFlagsPerRank));

// The driver's stream memory operations (core/driver_entry.h).
struct DriverCalls {
  CUresult (*write_value32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*wait_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*error_name)(CUresult, const char**) = nullptr;
};

// The calls, or null where the driver lacks one.
const DriverCalls* driver_calls() {
  static const DriverCalls* const calls = []() -> const DriverCalls* {
    static DriverCalls found;
    const bool all = find_driver_call("cuStreamWriteValue32", found.write_value32) &&
                     find_driver_call("cuStreamWaitValue64", found.wait_value64) &&
                     find_driver_call("cuDeviceGet", found.device_get) &&
                     find_driver_call("cuDeviceGetAttribute", found.device_attribute) &&
                     find_driver_call("cuGetErrorName", found.error_name);
    return all ? &found : nullptr;
  }();
  return calls;
}

void check_driver(CUresult status, const char* call) {
  if (status == CUDA_SUCCESS) return;
  const char* name = "unknown";
  if (driver_calls() != nullptr) (void)driver_calls()->error_name(status, &name);
  fail("{} failed: {} ({})", call, name, static_cast<int>(status));
}

// Whether this process can run the flags: the driver's calls, 64-bit waits, host registration,
// more than one hardware queue, and no MOE_STREAM_BARRIER=nccl. Never throws: a rank that cannot
// votes no, so that the group agrees at once.
// MOE_STREAM_BARRIER: unset or "flags" (the flags where they can run), or "nccl"; anything else
// is kBadSetting, which the group reports on every rank.
enum class Asked { kFlags, kNccl, kBadSetting };
Asked asked_runner() {
  const char* asked = std::getenv("MOE_STREAM_BARRIER");
  if (asked == nullptr || std::strcmp(asked, "flags") == 0) return Asked::kFlags;
  return std::strcmp(asked, "nccl") == 0 ? Asked::kNccl : Asked::kBadSetting;
}

bool flags_possible_here(int device) {
  if (asked_runner() != Asked::kFlags) return false;
  // With one hardware queue for every stream, a wait on flags would hold all the device's later
  // work, other streams' included, until the barrier passes: the overlap the copy exchange
  // pipelines for would be gone. An NCCL kernel holds an SM but not the queue.
  if (const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
      connections != nullptr && std::strcmp(connections, "1") == 0)
    return false;
  const DriverCalls* calls = driver_calls();
  if (calls == nullptr) return false;
  CUdevice handle = 0;
  int wait64 = 0;
  if (calls->device_get(&handle, device) != CUDA_SUCCESS ||
      calls->device_attribute(&wait64, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, handle) !=
          CUDA_SUCCESS)
    return false;
  int registers = 0;
  if (cudaDeviceGetAttribute(&registers, cudaDevAttrHostRegisterSupported, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return wait64 != 0 && registers != 0;
}

std::string shared_name(std::uint64_t id) {
  return fmt::format("/moe-stream-barrier-{:016x}", id);
}

// What EP rank 0 tells the group: the shared memory's name, and whether it made it.
struct Offer {
  std::uint64_t id = 0;
  int made = 0;
  int bad_setting = 0;  // this rank's MOE_STREAM_BARRIER is neither "flags" nor "nccl"
};

// Closes a descriptor, and unlinks the shared memory that this rank created, at scope exit.
struct SharedMemoryGuard {
  int fd = -1;
  std::string created;
  ~SharedMemoryGuard() {
    if (fd >= 0) (void)::close(fd);
    if (!created.empty()) (void)::shm_unlink(created.c_str());
  }
};

}  // namespace

StreamBarrier::StreamBarrier(const Mesh& mesh, cudaStream_t stream)
    : mesh_(mesh), ranks_(mesh.ep()), me_(mesh.ep_index()) {
  fallback_.reserve(sizeof(int));
  const int zero = 0;
  copy_to_device(fallback_.data(), &zero, sizeof(zero));
  if (ranks_ < 2) return;
  if (ranks_ > kMaxPeerRanks)
    fail("StreamBarrier: ep = {} exceeds the {} ranks of one host's flags", ranks_, kMaxPeerRanks);
  const std::size_t bytes = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  static_assert(kMaxPeerRanks * kFlagsPerRank * sizeof(std::uint64_t) <= 4096);

  DeviceBuffer staging;
  const Event done;
  SharedMemoryGuard shared;
  bool ok = flags_possible_here(mesh.device());
  Offer offer;
  if (me_ == 0 && ok) {
    // A name no other job on this host uses; should it exist (O_EXCL), the group votes no.
    // Nothing here may throw (std::random_device can): the peers wait in the all-gather below.
    const auto now =
        static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    offer.id = (now * 0x9E3779B97F4A7C15ull) ^ (static_cast<std::uint64_t>(::getpid()) << 32) ^
               reinterpret_cast<std::uintptr_t>(this);
    const std::string name = shared_name(offer.id);
    shared.fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (shared.fd >= 0) shared.created = name;
    ok = shared.fd >= 0 && ::ftruncate(shared.fd, static_cast<off_t>(bytes)) == 0;
  }
  offer.made = ok ? 1 : 0;
  offer.bad_setting = asked_runner() == Asked::kBadSetting ? 1 : 0;
  const auto offers =
      all_gather_host(mesh, offer, staging, done, stream, "the stream barrier's shared flags");
  // A setting one rank got wrong fails every rank alike (the creator's guard unlinks its name).
  for (int r = 0; r < ranks_; ++r) {
    if (offers[r].bad_setting == 0) continue;
    const char* here = std::getenv("MOE_STREAM_BARRIER");
    fail(
        "StreamBarrier: MOE_STREAM_BARRIER must be \"flags\" or \"nccl\"; EP rank {} has another "
        "value (this rank's: \"{}\")",
        r, here != nullptr ? here : "");
  }
  ok = ok && offers[0].made == 1;
  if (me_ != 0 && ok) {
    shared.fd = ::shm_open(shared_name(offers[0].id).c_str(), O_RDWR, 0);
    ok = shared.fd >= 0;
  }
  try {
    if (ok) {
      void* mapped = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, shared.fd, 0);
      if (mapped != MAP_FAILED) {
        host_flags_ = static_cast<std::uint64_t*>(mapped);
        mapped_bytes_ = bytes;
      }
      ok = host_flags_ != nullptr;
    }
    if (ok) {
      const cudaError_t status =
          cudaHostRegister(host_flags_, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
      if (status != cudaSuccess) (void)cudaGetLastError();  // not sticky: the group votes
      registered_ = status == cudaSuccess;
      void* device = nullptr;
      ok = registered_ && cudaHostGetDevicePointer(&device, host_flags_, 0) == cudaSuccess;
      if (!ok) (void)cudaGetLastError();
      device_flags_ = reinterpret_cast<std::uintptr_t>(device);
    }
    // Every rank has opened the memory (or failed to) before the vote ends; the creator's guard
    // then unlinks the name, so nothing is left behind in /dev/shm whatever happens later.
    const auto votes =
        all_gather_host(mesh, ok ? 1 : 0, staging, done, stream, "the stream barrier's vote");
    for (const int vote : votes) ok = ok && vote == 1;
  } catch (...) {
    unmap();
    throw;
  }
  if (!ok) {
    unmap();  // NCCL runs the barrier on every rank
    return;
  }
  try {
    abort_release_ = mesh.on_abort([this] { release(); });
  } catch (...) {
    unmap();
    throw;
  }
}

StreamBarrier::~StreamBarrier() {
  abort_release_ = {};          // no abort runs release() from here on
  if (mesh_.aborted()) return;  // this GPU's stream may still reach its flags: left mapped
  unmap();
}

void StreamBarrier::unmap() noexcept {
  if (registered_) (void)cudaHostUnregister(host_flags_);
  if (host_flags_ != nullptr) (void)::munmap(host_flags_, mapped_bytes_);
  registered_ = false;
  host_flags_ = nullptr;
  device_flags_ = 0;
}

void StreamBarrier::release() noexcept {
  // The high half of each of this rank's flags (little-endian: the second 32-bit word).
  for (int sender = 0; sender < ranks_; ++sender) {
    auto* high = reinterpret_cast<std::uint32_t*>(host_flags_ + me_ * kFlagsPerRank + sender) + 1;
    std::atomic_ref<std::uint32_t>(*high).store(1, std::memory_order_release);
  }
}

void StreamBarrier::arrive_and_wait(cudaStream_t stream) {
  if (ranks_ < 2) return;
  if (!without_sm()) {
    mesh_.all_reduce_sum(fallback_.data(), 1, ncclInt32, MeshGroup::kExpertParallel, stream);
    return;
  }
  // A barrier after an abort would pass at once: the group is gone, as NCCL's would say (and
  // comm() names a mesh that was moved from, whose abort no longer reaches this barrier).
  (void)mesh_.comm(MeshGroup::kExpertParallel);
  if (stream_is_capturing(stream))
    fail(
        "StreamBarrier: a barrier on flags cannot be captured in a CUDA graph (a replay would wait "
        "for the counts it was captured with)");
  if (count_ == UINT32_MAX) fail("StreamBarrier: {} barriers, the most its flags count", count_);
  ++count_;
  const DriverCalls& calls = *driver_calls();
  const auto flag = [&](int receiver, int sender) {
    return static_cast<CUdeviceptr>(device_flags_ +
                                    (receiver * kFlagsPerRank + sender) * sizeof(std::uint64_t));
  };
  const auto cu_stream = reinterpret_cast<CUstream>(stream);
  // The write follows the stream's earlier work, and fences it: a peer that sees the count sees
  // every copy this rank queued before it.
  for (int peer = 0; peer < ranks_; ++peer) {
    if (peer == me_) continue;
    check_driver(
        calls.write_value32(cu_stream, flag(peer, me_), count_, CU_STREAM_WRITE_VALUE_DEFAULT),
        "cuStreamWriteValue32");
  }
  for (int peer = 0; peer < ranks_; ++peer) {
    if (peer == me_) continue;
    check_driver(calls.wait_value64(cu_stream, flag(me_, peer), count_, CU_STREAM_WAIT_VALUE_GEQ),
                 "cuStreamWaitValue64");
  }
}

}  // namespace moe
