#include "moe/mesh.h"

#include <atomic>
#include <condition_variable>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "comm/bootstrap.h"
#include "moe/device.h"
#include "moe/error.h"

namespace moe {

// Aborts the mesh when an armed deadline passes: the one way to release a host thread blocked in
// an NCCL call whose peer never comes.
class Watchdog {
 public:
  explicit Watchdog(std::function<void()> on_timeout)
      : on_timeout_(std::move(on_timeout)), thread_([this] { run(); }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }
  void arm(std::chrono::milliseconds timeout) {
    std::lock_guard lock(mutex_);
    deadline_ = std::chrono::steady_clock::now() + timeout;
    armed_ = true;
    fired_ = false;
    changed_.notify_all();
  }
  // Returns whether the deadline passed (and the mesh was aborted) while armed. The abort releases
  // the blocked NCCL call before it has finished with every communicator, so this waits for the
  // callback to return: the caller then sees the whole mesh aborted, never half of it.
  bool disarm() {
    std::unique_lock lock(mutex_);
    armed_ = false;
    changed_.notify_all();
    changed_.wait(lock, [this] { return !in_callback_; });
    return fired_;
  }

 private:
  void run() {
    std::unique_lock lock(mutex_);
    while (!stop_) {
      if (!armed_) {
        changed_.wait(lock);
        continue;
      }
      if (changed_.wait_until(lock, deadline_) == std::cv_status::timeout && armed_ && !stop_) {
        fired_ = true;
        armed_ = false;
        in_callback_ = true;
        lock.unlock();
        on_timeout_();
        lock.lock();
        in_callback_ = false;
        changed_.notify_all();
      }
    }
  }
  std::function<void()> on_timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool armed_ = false;
  bool fired_ = false;
  bool in_callback_ = false;
  bool stop_ = false;
  std::chrono::steady_clock::time_point deadline_;
  std::thread thread_;
};

// on_abort's releases, by id. The mutex is held while the abort runs them, so that an
// AbortRelease's destruction waits for a release running on another thread.
struct AbortReleases {
  std::mutex mutex;
  std::map<std::uint64_t, std::function<void()>> releases;
  bool ran = false;

  void run() noexcept {
    std::lock_guard lock(mutex);
    ran = true;
    for (auto& [id, release] : releases) release();
    releases.clear();
  }
};

// Every communicator here is the mesh's own: from_nccl splits a private world from the trainer's,
// so that an abort after a failure never touches a communicator the trainer still uses.
struct Mesh::Comms {
  comm::NcclComm world;
  comm::NcclComm ep;
  comm::NcclComm dp;
  std::atomic<bool> aborted = false;
  std::shared_ptr<AbortReleases> releases = std::make_shared<AbortReleases>();
  std::unique_ptr<Watchdog> watchdog;  // last: stopped before the communicators go
  // The three aborts run side by side. An abort sets its communicator's abort flag, which its
  // kernels poll, and then frees the communicator's memory; a cudaFree waits for every kernel on
  // the device, so an abort run alone waits for the kernels of the communicators not yet aborted:
  // with a collective of another group stuck on a failed peer, forever.
  // The frees also wait for any other work on the device: a kernel that never ends, or a stream
  // held by the host, holds them for as long. So the caller waits for the aborts at most `grace`
  // and then goes on to report its error; aborts still waiting own their handles and finish on
  // their own threads whenever the device lets them.
  void abort_all(std::chrono::milliseconds grace) noexcept {
    if (aborted.exchange(true)) return;
    // First what no communicator's abort would release: an NCCL abort waits for the device's
    // work, which may sit behind such a wait.
    releases->run();
    struct Pending {
      std::mutex mutex;
      std::condition_variable finished;
      int running = 0;
    };
    std::shared_ptr<Pending> pending;
    try {
      pending = std::make_shared<Pending>();
    } catch (...) {  // no memory for it: every abort here, in turn
    }
    const ncclComm_t handles[] = {world.release(), ep.release(), dp.release()};
    ncclComm_t here[std::size(handles)] = {};
    std::size_t aborted_here = 0;
    for (const ncclComm_t handle : handles) {
      if (handle == nullptr) continue;
      bool started = false;
      if (pending) {
        try {
          {
            std::lock_guard lock(pending->mutex);
            ++pending->running;
          }
          std::thread([handle, pending] {
            (void)ncclCommAbort(handle);
            std::lock_guard lock(pending->mutex);
            --pending->running;
            pending->finished.notify_all();
          }).detach();
          started = true;
        } catch (...) {  // no thread to spare
          std::lock_guard lock(pending->mutex);
          --pending->running;
        }
      }
      if (!started) here[aborted_here++] = handle;
    }
    // Those without a thread of their own, once every other abort has set its flag.
    for (std::size_t i = 0; i < aborted_here; ++i) (void)ncclCommAbort(here[i]);
    if (!pending) return;
    std::unique_lock lock(pending->mutex);
    pending->finished.wait_for(lock, grace, [&] { return pending->running == 0; });
  }
};

void validate_mesh_shape(int world, int ep, int dp, int num_experts) {
  if (ep < 1 || dp < 1) fail("invalid mesh: ep = {} and dp = {} must be >= 1", ep, dp);
  if (ep * dp != world)
    fail("invalid mesh: ep = {} times dp = {} must equal the world size {}", ep, dp, world);
  if (num_experts % ep != 0)
    fail("invalid mesh: ep = {} must divide num_experts = {}", ep, num_experts);
}

Mesh Mesh::single() {
  Mesh mesh;
  MOE_CHECK_CUDA(cudaGetDevice(&mesh.device_));
  return mesh;
}

namespace {
comm::NcclComm split(ncclComm_t world, int color, int key) {
  ncclComm_t out = nullptr;
  MOE_CHECK_NCCL(ncclCommSplit(world, color, key, &out, nullptr));
  return comm::NcclComm(out);
}
}  // namespace

Mesh Mesh::from_mpi(MPI_Comm comm, int ep, int dp, int num_experts, Timeout timeout) {
  int rank = 0, size = 0;
  MOE_CHECK_MPI(MPI_Comm_rank(comm, &rank));
  MOE_CHECK_MPI(MPI_Comm_size(comm, &size));
  validate_mesh_shape(size, ep, dp, num_experts);  // every rank sees the same values: no hang
  // Every rank reaches each MPI collective below before it can fail: MPI waits without a timeout.
  const int local_rank = comm::node_local_rank(comm);
  const int gpus = cuda_device_count();
  // A failure here is reported by the identity check below, on every rank alike.
  if (gpus > 0 && cudaSetDevice(local_rank % gpus) != cudaSuccess) (void)cudaGetLastError();
  // NCCL refuses two ranks on one GPU with a bare "invalid usage"; say what is wrong instead, on
  // every rank alike (each sees the same gathered identities).
  comm::require_one_rank_per_gpu(comm);
  Mesh mesh;
  mesh.rank_ = rank;
  mesh.ep_ = ep;
  mesh.dp_ = dp;
  mesh.timeout_ = timeout;
  MOE_CHECK_CUDA(cudaGetDevice(&mesh.device_));
  mesh.comms_ = std::make_unique<Comms>();
  mesh.comms_->world = comm::NcclComm::from_mpi(comm);
  mesh.comms_->ep = split(mesh.comms_->world.get(), mesh.dp_index(), mesh.ep_index());
  mesh.comms_->dp = split(mesh.comms_->world.get(), mesh.ep_index(), mesh.dp_index());
  mesh.start_watchdog();
  return mesh;
}

Mesh Mesh::from_nccl(ncclComm_t world, int ep, int dp, int num_experts, Timeout timeout) {
  if (world == nullptr) fail("Mesh::from_nccl: null communicator");
  int rank = 0, size = 0;
  MOE_CHECK_NCCL(ncclCommUserRank(world, &rank));
  MOE_CHECK_NCCL(ncclCommCount(world, &size));
  validate_mesh_shape(size, ep, dp, num_experts);
  Mesh mesh;
  mesh.rank_ = rank;
  mesh.ep_ = ep;
  mesh.dp_ = dp;
  mesh.timeout_ = timeout;
  MOE_CHECK_NCCL(ncclCommCuDevice(world, &mesh.device_));
  mesh.comms_ = std::make_unique<Comms>();
  // The one collective on the trainer's communicator: a private copy of it (same ranks, same
  // order), from which the groups split and which alone an abort may touch.
  mesh.comms_->world = split(world, 0, rank);
  mesh.comms_->ep = split(mesh.comms_->world.get(), mesh.dp_index(), mesh.ep_index());
  mesh.comms_->dp = split(mesh.comms_->world.get(), mesh.ep_index(), mesh.dp_index());
  mesh.start_watchdog();
  return mesh;
}

void Mesh::start_watchdog() {
  Comms* comms = comms_.get();  // stable across moves of the Mesh
  const Timeout grace = timeout_;
  comms->watchdog = std::make_unique<Watchdog>([comms, grace] { comms->abort_all(grace); });
}

Mesh::Mesh(Mesh&&) noexcept = default;
Mesh& Mesh::operator=(Mesh&&) noexcept = default;
Mesh::~Mesh() = default;

int Mesh::group_size(MeshGroup group) const {
  switch (group) {
    case MeshGroup::kWorld:
      return world_size();
    case MeshGroup::kExpertParallel:
      return ep_;
    case MeshGroup::kDataParallel:
      return dp_;
  }
  return 1;
}

ncclComm_t Mesh::comm(MeshGroup group) const {
  if (comms_ && comms_->aborted)
    fail("rank {}: the mesh's communicators were aborted after an earlier failure", rank_);
  // A moved-from mesh keeps its shape but no communicators: a reduction over it would silently
  // do nothing.
  if (!comms_ && world_size() > 1)
    fail("rank {}: this Mesh was moved from; use the Mesh it was moved into", rank_);
  if (!comms_ || group_size(group) == 1) return nullptr;
  switch (group) {
    case MeshGroup::kWorld:
      return comms_->world.get();
    case MeshGroup::kExpertParallel:
      return comms_->ep.get();
    case MeshGroup::kDataParallel:
      return comms_->dp.get();
  }
  return nullptr;
}

void Mesh::all_reduce_sum(void* data, std::size_t count, ncclDataType_t type, MeshGroup group,
                          cudaStream_t stream) const {
  all_reduce(data, count, type, ncclSum, group, stream);
}

void Mesh::all_reduce(void* data, std::size_t count, ncclDataType_t type, ncclRedOp_t op,
                      MeshGroup group, cudaStream_t stream) const {
  ncclComm_t c = comm(group);
  if (c == nullptr || count == 0) return;
  group_start();
  MOE_CHECK_NCCL(ncclAllReduce(data, data, count, type, op, c, stream));
  group_end("an all-reduce");
}

void Mesh::all_gather(const void* send, void* recv, std::size_t bytes, MeshGroup group,
                      cudaStream_t stream) const {
  ncclComm_t c = comm(group);
  if (c == nullptr) {
    if (bytes > 0 && send != recv)
      MOE_CHECK_CUDA(cudaMemcpyAsync(recv, send, bytes, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  group_start();
  MOE_CHECK_NCCL(ncclAllGather(send, recv, bytes, ncclInt8, c, stream));
  group_end("an all-gather");
}

void Mesh::connect(cudaStream_t stream) const {
  if (!comms_) return;
  // The layer's statistics and barriers are a few bytes, gradient reductions and row exchanges
  // megabytes: NCCL may take another algorithm or protocol for each.
  constexpr std::size_t kLarge = std::size_t{4} << 20;
  DeviceBuffer buffer(kLarge * (static_cast<std::size_t>(world_size()) + 1));
  MOE_CHECK_CUDA(cudaMemsetAsync(buffer.data(), 0, buffer.bytes(), stream));
  for (const MeshGroup group :
       {MeshGroup::kWorld, MeshGroup::kExpertParallel, MeshGroup::kDataParallel}) {
    ncclComm_t c = comm(group);
    if (c == nullptr) continue;
    int size = 0, me = 0;
    MOE_CHECK_NCCL(ncclCommCount(c, &size));
    MOE_CHECK_NCCL(ncclCommUserRank(c, &me));
    for (const std::size_t bytes : {std::size_t{4}, kLarge}) {
      all_reduce_sum(buffer.data(), bytes / 4, ncclFloat32, group, stream);
      all_gather(buffer.data(), buffer.as<char>() + kLarge, bytes, group, stream);
      group_start();
      for (int peer = 0; peer < size; ++peer) {
        if (peer == me) continue;
        MOE_CHECK_NCCL(ncclSend(buffer.data(), bytes, ncclInt8, peer, c, stream));
        MOE_CHECK_NCCL(ncclRecv(buffer.as<char>() + kLarge * (1 + static_cast<std::size_t>(peer)),
                                bytes, ncclInt8, peer, c, stream));
      }
      group_end("the connection of every peer");
    }
  }
  Event done;
  done.record(stream);
  wait(done.get(), "the mesh's first collectives");
}

void Mesh::group_start() const {
  MOE_CHECK_NCCL(ncclGroupStart());
  ++group_depth_;
}

void Mesh::group_end(std::string_view operation) const {
  --group_depth_;
  if (group_depth_ > 0 || !comms_) {
    MOE_CHECK_NCCL(ncclGroupEnd());
    return;
  }
  comms_->watchdog->arm(timeout_);
  const ncclResult_t status = ncclGroupEnd();  // blocks until launched, or until aborted
  if (comms_->watchdog->disarm()) {
    fail("rank {}: {} did not complete within {} ms; the communicators were aborted", rank_,
         operation, timeout_.count());
  }
  if (status != ncclSuccess) {
    abort();
    fail("rank {}: {} failed: NCCL error {} ({}); the communicators were aborted", rank_, operation,
         static_cast<int>(status), ncclGetErrorString(status));
  }
}

void Mesh::wait(cudaEvent_t event, std::string_view operation) const {
  ++host_waits_;
  // The waits on a step's path (the dispatch's row counts) are for work queued a fraction of a
  // millisecond earlier, and the GPU idles from the event until the host queues what follows:
  // a sleeping poll overshot by the sleep's timer slack (~50 µs on Linux) plus up to the length
  // of its last backoff step, 0.1–0.2 ms per step at the layer's shapes (moe_bench's
  // dispatch stage). So spin, yielding, for the first few milliseconds;
  // a longer wait is for a peer, and backs off to 1 ms sleeps that also check the
  // communicators' errors and the deadline.
  constexpr auto kSpin = std::chrono::milliseconds(5);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout_;
  auto pause = std::chrono::microseconds(50);
  for (;;) {
    const cudaError_t status = cudaEventQuery(event);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) {
      MOE_CHECK_CUDA(status);
    }
    const auto now = std::chrono::steady_clock::now();
    if (now - start < kSpin) {
      std::this_thread::yield();
      continue;
    }
    if (comms_) {
      for (ncclComm_t c : {comms_->world.get(), comms_->ep.get(), comms_->dp.get()}) {
        ncclResult_t async = ncclSuccess;
        if (c != nullptr && ncclCommGetAsyncError(c, &async) == ncclSuccess &&
            async != ncclSuccess && async != ncclInProgress) {
          abort();
          fail("rank {}: {} failed: NCCL error {} ({}); the communicators were aborted", rank_,
               operation, static_cast<int>(async), ncclGetErrorString(async));
        }
      }
    }
    if (now > deadline) {
      abort();
      fail("rank {}: {} did not complete within {} ms; the communicators were aborted", rank_,
           operation, timeout_.count());
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

void Mesh::abort() const noexcept {
  if (comms_) comms_->abort_all(timeout_);
}

bool Mesh::aborted() const noexcept {
  return comms_ && comms_->aborted;
}

Mesh::AbortRelease Mesh::on_abort(std::function<void()> release) const {
  // The abort runs releases where nothing may throw: an empty one would end the process there.
  if (!release) fail("Mesh::on_abort: release is empty (a callable is needed)");
  AbortRelease registered;
  if (!comms_) return registered;
  // Ids are unique in the process, so that no release can ever unregister another mesh's.
  static std::atomic<std::uint64_t> next_id{1};
  AbortReleases& registry = *comms_->releases;
  {
    std::lock_guard lock(registry.mutex);
    // An abort that has run its releases sets `ran` under the mutex: later ones run here.
    if (!registry.ran) {
      registered.registry_ = comms_->releases;
      registered.id_ = next_id++;
      registry.releases.emplace(registered.id_, std::move(release));
      return registered;
    }
  }
  release();
  return registered;
}

Mesh::AbortRelease::~AbortRelease() {
  if (!registry_) return;
  std::lock_guard lock(registry_->mutex);
  registry_->releases.erase(id_);
}

Mesh::AbortRelease::AbortRelease(AbortRelease&& other) noexcept
    : registry_(std::move(other.registry_)), id_(std::exchange(other.id_, 0)) {}

Mesh::AbortRelease& Mesh::AbortRelease::operator=(AbortRelease&& other) noexcept {
  if (this != &other) {
    AbortRelease old(std::move(*this));
    registry_ = std::move(other.registry_);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

}  // namespace moe
