// The shared expert: one SwiGLU FFN of width Fs over every token, optionally scaled by a sigmoid
// gate, added to the routed output (docs/design.md, "Shared experts"). It runs on a stream of its
// own, forked from the block's stream and joined where its result is added, so that it overlaps
// the routed path; or, with shared_expert_overlap off, on the block's stream, in series. MoEBlock
// picks the fork: where x is ready, or where the token exchange has taken the rows onto a stream
// of its own (docs/design.md, "Shared experts").
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "moe/config.h"
#include "moe/device.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "moe/tensor.h"
#include "src/expert_stage.h"

namespace moe {

class SharedExpertStage {
 public:
  SharedExpertStage(const MoEConfig& config, const Mesh& mesh);

  // Starts the forward on x [T, H] behind the work queued on `stream` so far; x must stay until
  // the backward.
  void start_forward(const Tensor& x, const MoEParameters& params, cudaStream_t stream);
  // out += the shared expert's output, queued on `stream` behind the shared expert's forward.
  void add_output(const Tensor& out, cudaStream_t stream);
  // Starts the backward from dy [T, H] (its weight gradients overwritten).
  void start_backward(const Tensor& dy, const MoEParameters& params, const MoEGradients& grads,
                      cudaStream_t stream);
  // dx += the shared expert's input gradient, queued on `stream` behind its backward.
  void add_input_grad(const Tensor& dx, const MoEParameters& params, cudaStream_t stream);

  // Whether it runs on a stream of its own (shared_expert_overlap).
  bool overlaps() const { return overlap_; }

  // Its FFN is one expert: plain products only, which ExpertFFN never times, so there are no
  // GEMM algorithms for the ranks to agree on.

 private:
  bool gated_;
  bool overlap_;  // on side_; else on the block's stream
  std::int64_t H_, Fs_;
  DType dtype_;
  Stream side_;
  Event forked_, joined_;
  DeviceBuffer activations_;  // the FFN's a chunk: its own, as it runs beside the routed experts
  ExpertStage ffn_;           // one expert over every token
  DeviceBuffer y_, dx_, logit_, gate_, workspace_;
  Tensor x_;                           // the forward's input, kept for the backward
  std::vector<std::int64_t> offsets_;  // {0, T}: every token is the one expert's row
};

}  // namespace moe
