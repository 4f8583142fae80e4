#include "io/rank_inputs.h"

#include <cstring>
#include <numeric>

#include "io/tensor_values.h"
#include "moe/error.h"

namespace moe {
namespace {

// a · b for an element offset or count of `name`, checked: the factors come from a file's
// shapes and the mesh.
std::int64_t product(std::int64_t a, std::int64_t b, const char* name) {
  std::int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out))
    fail("the range of tensor '{}' for this rank, {} · {} elements, overflows int64", name, a, b);
  return out;
}

}  // namespace

RankInputs read_rank_inputs(const MoEConfig& config, const TensorSource& weights,
                            const TensorSource& inputs, const CheckedLayerFiles& checked, int rank,
                            bool check_finite) {
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden,
                     K = config.topk;
  const int world = config.ep * config.dp;
  if (rank < 0 || rank >= world)
    fail("rank {} is outside the mesh of EP {} × DP {} ranks", rank, config.ep, config.dp);
  const std::vector<std::int64_t> split = checked.split(world);
  const DType dtype = config.dtype;
  const auto whole = [&](const TensorSource& file, const char* name) {
    return read_as(file, name, 0, file.info(name).numel, dtype, check_finite);
  };

  RankInputs in;
  in.first_token = std::accumulate(split.begin(), split.begin() + rank, std::int64_t{0});
  in.tokens = split[static_cast<std::size_t>(rank)];
  in.gate_weight = whole(weights, "gate_weight");
  const std::int64_t local = config.local_experts();
  const std::int64_t first_expert = product(rank % config.ep, local, "w13");
  const std::int64_t w13_expert = product(2 * F, H, "w13"), w2_expert = product(H, F, "w2");
  in.w13 = read_as(weights, "w13", product(first_expert, w13_expert, "w13"),
                   product(local, w13_expert, "w13"), dtype, check_finite);
  in.w2 = read_as(weights, "w2", product(first_expert, w2_expert, "w2"),
                  product(local, w2_expert, "w2"), dtype, check_finite);
  in.expert_bias.assign(static_cast<std::size_t>(E), 0.0f);
  if (config.expert_bias) {
    const auto bias = read_as(weights, "expert_bias", 0, E, DType::kFP32, check_finite);
    std::memcpy(in.expert_bias.data(), bias.data(), bias.size());
  }
  if (config.shared_experts()) {
    in.shared_w13 = whole(weights, "shared_w13");
    in.shared_w2 = whole(weights, "shared_w2");
  }
  if (config.shared_gate) in.shared_gate_weight = whole(weights, "shared_gate_weight");
  const std::int64_t first_x = product(in.first_token, H, "x");
  in.x = read_as(inputs, "x", first_x, product(in.tokens, H, "x"), dtype, check_finite);
  in.dy = read_as(inputs, "dy", first_x, product(in.tokens, H, "dy"), dtype, check_finite);
  if (checked.replay_experts) {
    const auto begin = checked.replay_experts->begin() + in.first_token * K;
    in.topk_idx.assign(begin, begin + in.tokens * K);
  }
  return in;
}

}  // namespace moe
