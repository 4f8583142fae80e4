// The layer's tensors in safetensors files: what moe_run reads and writes (names and layouts in
// README.md). Weights use the nn.Linear layout of docs/design.md and hold all E experts.
//
// weights:  gate_weight [E, H], w13 [E, 2F, H], w2 [E, H, F] (BF16 or F32),
//           expert_bias [E] (F32, needed when the config has expert_bias),
//           shared_w13 [2Fs, H], shared_w2 [H, Fs] (with shared_ffn_hidden Fs > 0),
//           shared_gate_weight [1, H] (with shared_gate)
// inputs:   x [T, H], dy [T, H] (BF16 or F32), optionally tokens_per_rank [world] (I64) and
//           topk_idx [T, K] (I32: the routing to replay)
// routing:  topk_idx [T, K] (I32), the routing to replay from a file of its own (moe_run
//           --replay-routing): a routing file (moe_run --record-routing) or a results file
// results:  out, dx [T, H]; topk_idx [T, K] (I32); topk_p [T, K]; aux_loss, z_loss [1];
//           tokens_per_expert [E] (I32, kept slots); kept [T, K] (I32); dropped_per_expert [E]
//           (I32); grad.gate_weight [E, H], grad.w13 [E, 2F, H], grad.w2 [E, H, F];
//           grad.shared_w13, grad.shared_w2 (with shared experts), grad.shared_gate_weight (with
//           shared_gate) — all F32 but the I32 ones named.
//
// Checking is apart from converting: check_layer_files needs the headers and the small tensors
// only (tokens_per_rank, topk_idx), so a file of any size is checked before a byte of its large
// tensors is read, and each reader then reads only what it needs (io/rank_inputs.h,
// io/expert_streams.h).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "io/tensor_values.h"
#include "moe/config.h"
#include "moe/safetensors.h"
#include "reference/reference.h"

namespace moe {

// What checking the files learns beyond "they are right": enough to plan every rank's reads.
struct CheckedLayerFiles {
  std::int64_t tokens = 0;                         // T, the whole batch
  std::vector<std::int64_t> tokens_per_rank;       // as the inputs give it; empty when they don't
  std::string tokens_per_rank_source;              // the inputs file that gave it, for messages
  std::optional<std::vector<int>> replay_experts;  // topk_idx [T*K], checked, when given

  // Each rank's token count: tokens_per_rank, or an even split with the remainder to the first
  // ranks. Throws moe::Error when tokens_per_rank has another number of entries than `world`.
  std::vector<std::int64_t> split(int world) const;
};

// Checks every tensor's presence, dtype and shape against the config (errors name the tensor,
// what was expected and what came); a tensor the layer does not read (including expert_bias
// or the shared experts' weights when the config has none) is an error, tokens_per_rank must
// hold counts >= 0 whose sum, checked for overflow, is the batch's, and topk_idx names K distinct
// experts in [0, E) for every token (errors name the token, the slot and the value). Reads the
// headers and the small tensors tokens_per_rank and topk_idx, nothing else. With `routing`, the
// routing to replay is its topk_idx (its other tensors are not read), and the inputs must hold
// none.
CheckedLayerFiles check_layer_files(const MoEConfig& config, const TensorSource& weights,
                                    const TensorSource& inputs,
                                    const TensorSource* routing = nullptr);

struct LayerInputs {
  reference::Params params;  // the reference's math layout (w13 [H, 2F], w2 [F, H] per expert)
  reference::Matrix x;
  reference::Matrix dy;
  std::vector<std::int64_t> tokens_per_rank;       // empty when the file does not say
  std::optional<std::vector<int>> replay_experts;  // topk_idx [T*K] when the file has it
};

// check_layer_files, then every tensor converted to the reference's fp64 layout.
LayerInputs read_layer_inputs(const MoEConfig& config, const TensorSource& weights,
                              const TensorSource& inputs, const TensorSource* routing = nullptr);
// The same but the routed experts, which stay in the file (params.experts is empty): FileExperts
// (io/expert_streams.h) reads them one at a time.
LayerInputs read_layer_inputs_without_experts(const MoEConfig& config, const TensorSource& weights,
                                              const TensorSource& inputs,
                                              const TensorSource* routing = nullptr);

// The weights and inputs files of a layer (the inverse of read_layer_inputs), values stored as F32.
TensorFile layer_weights_file(const MoEConfig& config, const reference::Params& params);
TensorFile layer_inputs_file(const reference::Matrix& x, const reference::Matrix& dy);
// With a routing to replay: topk_idx [T, topk] (I32) beside x and dy.
TensorFile layer_inputs_file(const reference::Matrix& x, const reference::Matrix& dy,
                             std::span<const int> replay_experts, int topk);

// A routing file: topk_idx [T, K] (I32) alone, what --replay-routing reads back; the config's
// description in its metadata.
TensorFile routing_file(const MoEConfig& config, std::span<const std::int32_t> topk_idx);

// The results file of a single run over the whole batch (the fp64 reference's, or gathered):
// kept and dropped_per_expert always, the shared experts' gradients when the config has them.
TensorFile layer_results_file(const MoEConfig& config, const reference::LayerResult& result);

// The results file's tensors for a batch of `tokens` tokens (names, dtypes, shapes) and its
// metadata: what a TensorFileWriter declares before any result is known.
std::vector<TensorSpec> layer_results_specs(const MoEConfig& config, std::int64_t tokens);
std::map<std::string, std::string> layer_results_metadata(const MoEConfig& config);
// Every results tensor of `result` but grad.w13 and grad.w2 appended to `writer` (declared with
// layer_results_specs), the bytes layer_results_file holds; the experts' gradients come from a
// FileExpertGrads while the reference runs.
void write_layer_results(TensorFileWriter& writer, const MoEConfig& config,
                         const reference::LayerResult& result);

}  // namespace moe
