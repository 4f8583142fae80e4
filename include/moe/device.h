// RAII owners of CUDA and cuBLASLt resources, and device queries.
//
// Each owner is move-only and releases its resource in its destructor without throwing (a failed
// release at teardown cannot be acted on and must not mask the error being unwound).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "moe/error.h"

namespace moe {

// Number of CUDA devices visible to this process; 0 when there is no driver or no device.
int cuda_device_count() noexcept;

// One line per visible device: index, name, memory, SM count.
std::string describe_devices();

// How many allocations DeviceBuffer and PinnedBuffer have made in this process, every thread
// together. A step that allocates synchronises (a free waits for the device) and cannot be
// captured in a CUDA graph: tests read this around a step to show that it allocated nothing.
std::int64_t buffer_allocations() noexcept;

// While one is alive on this thread, a DeviceBuffer or PinnedBuffer that must give its memory back
// to grow calls `drain` first. A free waits for the whole device, with no time limit: behind a
// collective that a failed peer never joins, that is forever. A block on a mesh drains its own
// stream there, under the mesh's timeout, so that the wait ends in an error instead. Guards nest;
// the innermost drains.
class BufferGrowthDrain {
 public:
  explicit BufferGrowthDrain(std::function<void()> drain);
  ~BufferGrowthDrain();
  BufferGrowthDrain(const BufferGrowthDrain&) = delete;
  BufferGrowthDrain& operator=(const BufferGrowthDrain&) = delete;

  // Runs the innermost guard's drain on this thread, if any (what a growth calls before a free).
  static void before_free();

 private:
  std::function<void()> drain_;
  const BufferGrowthDrain* previous_;
};

// Device memory. Grow-only reuse is the caller's choice: reserve() keeps the allocation when it is
// already large enough.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) { reserve(bytes); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }

  // Ensures capacity for `bytes`; reallocates (discarding contents) only when it must grow.
  void reserve(std::size_t bytes);
  void release() noexcept;

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Page-locked host memory: device-to-host copies into it are truly asynchronous.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { release(); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

  void reserve(std::size_t bytes);  // grow-only, discards contents when it grows
  void release() noexcept;
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Which of the device's stream priorities a stream takes. Where kernels of several streams wait
// for SMs, the block scheduler starts those of the higher-priority stream first (it never
// preempts running blocks).
enum class StreamPriority { kDefault, kGreatest };

class Stream {
 public:
  // Non-blocking with respect to the legacy default stream.
  explicit Stream(StreamPriority priority = StreamPriority::kDefault);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept;

  cudaStream_t get() const { return stream_; }
  void synchronize() const;

 private:
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  explicit Event(bool timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  Event& operator=(Event&& other) noexcept;

  cudaEvent_t get() const { return event_; }
  void record(cudaStream_t stream) const;
  // Milliseconds from `start` to this event; both must be timing events, already completed.
  float elapsed_ms_since(const Event& start) const;

 private:
  cudaEvent_t event_ = nullptr;
};

class CublasLtHandle {
 public:
  CublasLtHandle();
  ~CublasLtHandle();
  CublasLtHandle(const CublasLtHandle&) = delete;
  CublasLtHandle& operator=(const CublasLtHandle&) = delete;
  CublasLtHandle(CublasLtHandle&& other) noexcept
      : handle_(std::exchange(other.handle_, nullptr)) {}
  CublasLtHandle& operator=(CublasLtHandle&& other) noexcept;

  cublasLtHandle_t get() const { return handle_; }

 private:
  cublasLtHandle_t handle_ = nullptr;
};

// Whether `stream` is capturing a CUDA graph now (a capture begun on it, or on a stream it joined).
bool stream_is_capturing(cudaStream_t stream);
// The capture sequence the stream is in (unique in the process), or 0 where it captures nothing.
std::uint64_t stream_capture_id(cudaStream_t stream);

// A CUDA graph of the work that `work` queues on `stream`, captured in thread-local mode (a host
// synchronisation or other capture-unsafe call on this thread fails the capture), then
// instantiated; replay() launches it on any stream. Work that throws ends the capture, which is
// discarded, and the error propagates. Streams forked from `stream` by events must join back.
class CudaGraph {
 public:
  CudaGraph(cudaStream_t stream, const std::function<void()>& work);
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  CudaGraph(CudaGraph&& other) noexcept
      : graph_(std::exchange(other.graph_, nullptr)), exec_(std::exchange(other.exec_, nullptr)) {}
  CudaGraph& operator=(CudaGraph&& other) noexcept;

  void replay(cudaStream_t stream) const;
  std::size_t nodes() const;  // the captured operations, kernels, copies and joins

 private:
  void release() noexcept;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Host <-> device copies that check their result; complete on return, for every stream.
void copy_to_device(void* dst, const void* src, std::size_t bytes);
void copy_to_host(void* dst, const void* src, std::size_t bytes);

}  // namespace moe
