// What the block's stages share: grow-only views of device buffers, and the stage Range (an NVTX
// range and, with stage timing on, a pair of CUDA events).
#pragma once

#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "moe/device.h"
#include "moe/tensor.h"

namespace moe {

// A grow-only device buffer viewed as a tensor of the requested shape: it grows (discarding its
// contents, after the device is done with them: cudaFree waits) when the shape needs more bytes.
inline Tensor view(DeviceBuffer& buffer, DType dtype, std::vector<std::int64_t> shape) {
  Tensor t(nullptr, dtype, std::move(shape));
  buffer.reserve(std::max<std::size_t>(t.bytes(), 16));
  t.data = buffer.data();
  return t;
}

template <typename T>
T* typed(DeviceBuffer& buffer, std::size_t count) {
  buffer.reserve(std::max<std::size_t>(count * sizeof(T), 16));
  return buffer.as<T>();
}

// Per-stage CUDA events of the last forward and backward, when stage timing is on.
struct StageTimes {
  bool on = false;
  struct Stage {
    std::string name;
    Event start{true};
    Event stop{true};
  };
  std::deque<Stage> stages;  // reused: events are created once; nested stages keep their place
  std::size_t used = 0;
};

// A stage: an NVTX range (visible in Nsight Systems) and, with timing on, a pair of events.
class Range {
 public:
  Range(const char* name, StageTimes& times, cudaStream_t stream) : times_(times), stream_(stream) {
    nvtxRangePushA(name);
    if (!times_.on) return;
    if (times_.used == times_.stages.size()) times_.stages.emplace_back();
    stage_ = &times_.stages[times_.used++];
    stage_->name = name;
    stage_->start.record(stream_);
  }
  ~Range() {
    if (stage_ != nullptr) (void)cudaEventRecord(stage_->stop.get(), stream_);
    nvtxRangePop();
  }
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  StageTimes& times_;
  cudaStream_t stream_;
  StageTimes::Stage* stage_ = nullptr;
};

}  // namespace moe
