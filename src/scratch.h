// MoEScratch's buffers: device memory a block needs only inside one forward or one backward call,
// shared by the blocks built with one scratch (include/moe/moe_block.h says why that is safe).
// Each stage takes references to the buffers it uses; what a block keeps from forward to backward
// is never here.
#pragma once

#include <cstddef>
#include <memory>

#include "comm/peer_memory.h"
#include "moe/device.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"

namespace moe {

struct MoEScratch::Buffers {
  DeviceBuffer a;  // the experts: SwiGLU output; dA, then a again, in the backward
  // The peer exchange's experts' output rows (then dY and dX), mapped by every EP rank: made by
  // the first block that takes the peer exchange, shared by the blocks of the same mesh.
  std::unique_ptr<PeerBuffer> peer_Y;
  const Mesh* peer_mesh = nullptr;
  // The NCCL exchange: received rows, the experts' output, dY to send, dX (src/exchange_nccl.cpp
  // lists their roles).
  DeviceBuffer Y, dY;
  DeviceBuffer router_ws;    // router_forward's workspace
  DeviceBuffer layout_ws;    // build_layout's workspace
  DeviceBuffer chunk_ws;     // the NCCL exchange's chunk sort
  DeviceBuffer dprob;        // ∂L/∂topk_p, from the exchange's backward to the router's
  DeviceBuffer dlogits;      // the router backward's output, the gate backward's input
  DeviceBuffer dlogits_low;  // dlogits in bf16 for the gate's products
  DeviceBuffer nonfinite;    // check mode's count
  DeviceBuffer grad_stage;   // reduce_gradients' fp32 staging of bf16 gradients
  // The block whose split-phase step holds these buffers (between its forward_dispatch and
  // forward_combine, or its backward_combine and backward_dispatch), or null: the other blocks'
  // calls are refused meanwhile, since their stages would overwrite what the step has in flight.
  const void* held_by = nullptr;
  std::size_t bytes() const;
};

}  // namespace moe
