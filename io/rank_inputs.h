// One rank's share of moe_run's files on an EP × DP mesh, read and converted as its GPU takes it.
//
// A rank reads only what it holds: its experts' slices of w13 and w2 and its tokens' rows of x,
// dy and topk_idx. The gate weight, the expert bias and the shared experts' weights, small and
// replicated on every rank, it reads whole. At deepseek-v3 scale on EP 8 that is 2.8 GB of
// weights a rank in bf16 instead of 22.5 GB (or 90 GB as doubles).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "io/layer_files.h"
#include "moe/config.h"
#include "moe/safetensors.h"

namespace moe {

// Everything in config.dtype (bf16 or fp32), the bytes to upload, but expert_bias (fp32, as the
// layer holds it) and topk_idx (int32).
struct RankInputs {
  std::int64_t first_token = 0;  // this rank's tokens are [first_token, first_token + tokens)
  std::int64_t tokens = 0;
  std::vector<std::byte> gate_weight;         // [E, H]
  std::vector<std::byte> w13;                 // [E_loc, 2F, H]: experts [ep_index·E_loc, ...)
  std::vector<std::byte> w2;                  // [E_loc, H, F]
  std::vector<float> expert_bias;             // [E]; zeros without config.expert_bias
  std::vector<std::byte> shared_w13;          // [2Fs, H], with shared experts
  std::vector<std::byte> shared_w2;           // [H, Fs], with shared experts
  std::vector<std::byte> shared_gate_weight;  // [1, H], with shared_gate
  std::vector<std::byte> x;                   // [tokens, H]
  std::vector<std::byte> dy;                  // [tokens, H]
  std::vector<std::int32_t> topk_idx;         // [tokens, K] to replay; empty when not replaying
};

// The share of world rank `rank` (rank = dp_index · EP + ep_index; config.ep and config.dp give
// the mesh) of files that passed check_layer_files. topk_idx comes from `checked`, the values
// that were checked. With check_finite, a NaN or Inf among the values this rank reads is an
// error naming the file, the tensor and the element's index in the whole tensor; the ranks
// together read, and so check, every value.
RankInputs read_rank_inputs(const MoEConfig& config, const TensorSource& weights,
                            const TensorSource& inputs, const CheckedLayerFiles& checked, int rank,
                            bool check_finite);

}  // namespace moe
