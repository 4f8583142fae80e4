// What the block's stages share: grow-only views of device buffers, and the stage Range (an NVTX
// range and, with stage timing on, a pair of CUDA events).
#pragma once

#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
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
  // The stage entered last (timing on or off): what a failure names.
  const char* current = "";
};

// Fault injection for tests: when set, every stage calls the hook with its name as it begins, so a
// test can make one rank throw or stall at a chosen stage. Empty (the default) costs one test.
using StageHook = std::function<void(const char* stage)>;
void set_stage_hook(StageHook hook);
const StageHook& stage_hook();

// A stage: an NVTX range (visible in Nsight Systems) and, with timing on, a pair of events.
class Range {
 public:
  Range(const char* name, StageTimes& times, cudaStream_t stream) : times_(times), stream_(stream) {
    times_.current = name;
    if (const StageHook& hook = stage_hook()) hook(name);  // before anything a throw would leave
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
