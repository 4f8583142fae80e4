// The roofline floor of each stage of the layer on one GPU: the larger of its FLOPs at the GEMM
// rate and the bytes it must move at the copy rate (and, under EP, the rows it sends at the link
// rate). Bytes count every stage's inputs read once and outputs written once: weights, weight
// gradients, activations (h kept from forward to backward), and the small per-token tensors;
// intermediates an ideal fused kernel keeps on chip (a, dA, dh) are not counted. Routing is taken
// as uniform: each GPU's experts receive T·K rows. Shared by moe_bench and its tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe/config.h"

namespace moe::bench {

// Measured in the same run as the step they judge.
struct Rates {
  double gemm_flops_per_s = 0;  // the GEMM rate of the layer's shapes
  double copy_bytes_per_s = 0;  // device-to-device copy
  double link_bytes_per_s = 0;  // rows to other GPUs (0 on one GPU)
};

struct StageWork {
  std::string name;  // as MoEBlock's stage timing names it
  double flops = 0;
  double bytes = 0;       // read plus written in this GPU's memory
  double link_bytes = 0;  // sent to other GPUs

  // max(FLOPs / GEMM rate, bytes / copy rate, link bytes / link rate), in milliseconds.
  double floor_ms(const Rates& rates) const;
};

// Every stage of one forward and backward of `tokens` tokens per GPU, in order: the capacity
// stage in capacity mode, and the shared expert's forward and backward with shared experts.
// probabilities_in_experts: the experts weigh their rows (one GPU, the peer exchange),
// so the combine backward reads no rows for dprob.
std::vector<StageWork> stage_work(const MoEConfig& config, std::int64_t tokens,
                                  bool probabilities_in_experts);

// MoEBlock::reduce_gradients: the expert gradients over the DP group, the gate's over the world.
StageWork gradient_reduction_work(const MoEConfig& config);

// The step's floor: every stage's, added (stages run one after another on one stream).
double step_floor_ms(const std::vector<StageWork>& stages, const Rates& rates);

}  // namespace moe::bench
