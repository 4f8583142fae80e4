#include "moe/device.h"

#include <fmt/format.h>

#include <atomic>

namespace moe {

int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error for later callers
    return 0;
  }
  return count;
}

std::string describe_devices() {
  const int count = cuda_device_count();
  if (count == 0) return "no CUDA device visible\n";
  std::string text;
  for (int device = 0; device < count; ++device) {
    cudaDeviceProp prop{};
    MOE_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
    text += fmt::format("GPU {}: {} (sm_{}{}), {:.1f} GiB, {} SMs\n", device, prop.name, prop.major,
                        prop.minor, static_cast<double>(prop.totalGlobalMem) / (1 << 30),
                        prop.multiProcessorCount);
  }
  return text;
}

namespace {
std::atomic<std::int64_t> allocations{0};
thread_local const BufferGrowthDrain* innermost_drain = nullptr;
}  // namespace

BufferGrowthDrain::BufferGrowthDrain(std::function<void()> drain)
    : drain_(std::move(drain)), previous_(innermost_drain) {
  innermost_drain = this;
}

BufferGrowthDrain::~BufferGrowthDrain() {
  innermost_drain = previous_;
}

void BufferGrowthDrain::before_free() {
  if (innermost_drain != nullptr && innermost_drain->drain_) innermost_drain->drain_();
}

std::int64_t buffer_allocations() noexcept {
  return allocations.load();
}

void DeviceBuffer::reserve(std::size_t bytes) {
  if (bytes <= bytes_) return;
  if (data_ != nullptr) BufferGrowthDrain::before_free();
  release();
  allocations.fetch_add(1);
  MOE_CHECK_CUDA(cudaMalloc(&data_, bytes));
  bytes_ = bytes;
}

void DeviceBuffer::release() noexcept {
  if (data_ != nullptr) (void)cudaFree(data_);
  data_ = nullptr;
  bytes_ = 0;
}

void PinnedBuffer::reserve(std::size_t bytes) {
  if (bytes <= bytes_) return;
  if (data_ != nullptr) BufferGrowthDrain::before_free();
  release();
  allocations.fetch_add(1);
  MOE_CHECK_CUDA(cudaMallocHost(&data_, bytes));
  bytes_ = bytes;
}

void PinnedBuffer::release() noexcept {
  if (data_ != nullptr) (void)cudaFreeHost(data_);
  data_ = nullptr;
  bytes_ = 0;
}

Stream::Stream(StreamPriority priority) {
  int least = 0, greatest = 0;
  if (priority == StreamPriority::kGreatest)
    MOE_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  MOE_CHECK_CUDA(cudaStreamCreateWithPriority(
      &stream_, cudaStreamNonBlocking, priority == StreamPriority::kGreatest ? greatest : 0));
}
Stream::~Stream() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}
Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}
void Stream::synchronize() const {
  MOE_CHECK_CUDA(cudaStreamSynchronize(stream_));
}

Event::Event(bool timing) {
  MOE_CHECK_CUDA(
      cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
}
Event::~Event() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}
Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}
void Event::record(cudaStream_t stream) const {
  MOE_CHECK_CUDA(cudaEventRecord(event_, stream));
}
float Event::elapsed_ms_since(const Event& start) const {
  float ms = 0.0f;
  MOE_CHECK_CUDA(cudaEventElapsedTime(&ms, start.event_, event_));
  return ms;
}

CublasLtHandle::CublasLtHandle() {
  MOE_CHECK_CUBLAS(cublasLtCreate(&handle_));
}
CublasLtHandle::~CublasLtHandle() {
  if (handle_ != nullptr) (void)cublasLtDestroy(handle_);
}
CublasLtHandle& CublasLtHandle::operator=(CublasLtHandle&& other) noexcept {
  if (this != &other) {
    if (handle_ != nullptr) (void)cublasLtDestroy(handle_);
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MOE_CHECK_CUDA(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

std::uint64_t stream_capture_id(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  MOE_CHECK_CUDA(cudaStreamGetCaptureInfo(stream, &status, &id));
  return status == cudaStreamCaptureStatusNone ? 0 : id;
}

CudaGraph::CudaGraph(cudaStream_t stream, const std::function<void()>& work) {
  if (!work) fail("CudaGraph: empty work");
  MOE_CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    work();
  } catch (...) {
    cudaGraph_t partial = nullptr;
    (void)cudaStreamEndCapture(stream, &partial);  // invalidated captures end with an error
    if (partial != nullptr) (void)cudaGraphDestroy(partial);
    (void)cudaGetLastError();
    throw;
  }
  MOE_CHECK_CUDA(cudaStreamEndCapture(stream, &graph_));
  try {
    // Each kernel keeps the priority of the stream it was captured from (the exchange's stream
    // runs above the others); without the flag a replay would run them all at the priority of
    // the stream it is launched into.
    MOE_CHECK_CUDA(cudaGraphInstantiate(&exec_, graph_, cudaGraphInstantiateFlagUseNodePriority));
  } catch (...) {
    release();
    throw;
  }
}
CudaGraph::~CudaGraph() {
  release();
}
CudaGraph& CudaGraph::operator=(CudaGraph&& other) noexcept {
  if (this != &other) {
    release();
    graph_ = std::exchange(other.graph_, nullptr);
    exec_ = std::exchange(other.exec_, nullptr);
  }
  return *this;
}
void CudaGraph::release() noexcept {
  if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
  if (graph_ != nullptr) (void)cudaGraphDestroy(graph_);
  exec_ = nullptr;
  graph_ = nullptr;
}
void CudaGraph::replay(cudaStream_t stream) const {
  MOE_CHECK_CUDA(cudaGraphLaunch(exec_, stream));
}
std::size_t CudaGraph::nodes() const {
  std::size_t count = 0;
  MOE_CHECK_CUDA(cudaGraphGetNodes(graph_, nullptr, &count));
  return count;
}

void copy_to_device(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  MOE_CHECK_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  // From pageable memory cudaMemcpy may return once the bytes are staged, before they land; a
  // kernel on a non-blocking stream could then read the old contents.
  MOE_CHECK_CUDA(cudaStreamSynchronize(cudaStreamLegacy));
}
void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  MOE_CHECK_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

}  // namespace moe
