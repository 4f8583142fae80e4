#include "src/scratch.h"

namespace moe {

std::size_t MoEScratch::Buffers::bytes() const {
  std::size_t total = 0;
  for (const DeviceBuffer* b : {&a, &Y, &dY, &router_ws, &layout_ws, &chunk_ws, &dprob, &dlogits,
                                &dlogits_low, &nonfinite, &grad_stage})
    total += b->bytes();
  return total + (peer_Y ? peer_Y->bytes() : 0);
}

MoEScratch::MoEScratch() : buffers_(std::make_unique<Buffers>()) {}
MoEScratch::~MoEScratch() = default;
std::size_t MoEScratch::bytes() const {
  return buffers_->bytes();
}

}  // namespace moe
