// A barrier over the EP group that no SM runs: each rank's stream writes its arrival into a flag of
// every peer, then waits until every peer's arrival is in its own flags. The GPU's front end runs
// both (stream memory operations), so the barrier never waits for an SM behind the kernels of other
// streams, as an NCCL collective does. The copy exchange ends each chunk's copies with it
// (docs/design.md, "Transports").
//
// The flags live in host memory that the group's processes share (one host, as the copy exchange
// needs), so that an abort releases a wait from the CPU: a store into that memory reaches the
// waiting front end without going through any GPU queue, where it could sit behind the very wait it
// should release.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "moe/device.h"
#include "moe/mesh.h"

namespace moe {

class StreamBarrier {
 public:
  // Collective over the EP group, on `stream` (host waits under the mesh's timeout). Every rank
  // maps the group's flags; if any rank cannot (no shared memory, no stream memory operations,
  // CUDA_DEVICE_MAX_CONNECTIONS=1, or MOE_STREAM_BARRIER=nccl in its environment), the whole group
  // agrees to run the barrier as an NCCL all-reduce of one zero instead. MOE_STREAM_BARRIER
  // other than "flags" or "nccl" on any rank is a moe::Error on every rank. The mesh must outlive
  // the barrier, and not be moved from.
  StreamBarrier(const Mesh& mesh, cudaStream_t stream);
  // The work that used the barrier must have finished (after an abort, the flags stay mapped to
  // the process's end: this GPU's stream, released, may still be writing and reading them).
  ~StreamBarrier();
  StreamBarrier(const StreamBarrier&) = delete;
  StreamBarrier& operator=(const StreamBarrier&) = delete;

  // Collective over the EP group: queues the barrier on `stream`; the work queued after it on any
  // rank runs once every rank's stream has reached it. Not capturable in a CUDA graph (each
  // barrier waits for a count that a replay would repeat).
  void arrive_and_wait(cudaStream_t stream);

  // Whether the flags run it (false: NCCL does).
  bool without_sm() const { return host_flags_ != nullptr; }

 private:
  void release() noexcept;
  void unmap() noexcept;

  const Mesh& mesh_;
  int ranks_ = 1, me_ = 0;
  // flags[receiver][sender], a 64-bit word each, kFlagsPerRank to a receiver's row. A sender
  // writes the low half (the count of barriers it has reached); an abort sets the high half of its
  // own row, which no sender writes, so every wait on it passes from then on.
  std::uint64_t* host_flags_ = nullptr;
  std::uintptr_t device_flags_ = 0;
  std::size_t mapped_bytes_ = 0;
  bool registered_ = false;
  std::uint32_t count_ = 0;  // barriers this rank has queued
  Mesh::AbortRelease abort_release_;
  DeviceBuffer fallback_;  // one int that the EP group all-reduces, when NCCL runs the barrier
};

}  // namespace moe
