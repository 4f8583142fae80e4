// What moe_bench times besides the layer's step: the EP group's p2p rate (the exchange's link
// ceiling) and the split-phase step with other work between its calls.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "moe/mesh.h"
#include "moe/moe_block.h"

namespace moe::layer_timing {

// The middle value (the upper one of an even count); 0 for none.
double median(std::vector<double> v);

// Bytes per second one rank sends to its EP peers when all send at once (grouped send/recv); 0
// without an EP group.
double p2p_rate(const Mesh& mesh, cudaStream_t stream);

// The split-phase step with `products` dense [T, H] x [H, H] products of other work between each
// two of its calls, the whole step followed by the same work, and the work alone: medians over
// `iters` runs, the slowest rank's.
struct SplitPhaseTimes {
  double phased_ms = 0, serial_ms = 0, other_ms = 0;
};
SplitPhaseTimes time_split_phase(MoEBlock& block, const Tensor& x, const Tensor& dy,
                                 const ForwardOptions& options, int products, int iters,
                                 cudaStream_t stream);

}  // namespace moe::layer_timing
