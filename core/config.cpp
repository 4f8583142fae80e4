#include "moe/config.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "core/printable.h"
#include "moe/error.h"

namespace moe {

std::string_view score_function_name(ScoreFunction score_function) {
  switch (score_function) {
    case ScoreFunction::kSoftmax:
      return "softmax";
    case ScoreFunction::kSigmoid:
      return "sigmoid";
    case ScoreFunction::kSqrtSoftplus:
      return "sqrtsoftplus";
  }
  return "unknown";
}

ScoreFunction parse_score_function(std::string_view text) {
  if (text == "softmax") return ScoreFunction::kSoftmax;
  if (text == "sigmoid") return ScoreFunction::kSigmoid;
  if (text == "sqrtsoftplus") return ScoreFunction::kSqrtSoftplus;
  fail("score_function = '{}' is not one of softmax, sigmoid, sqrtsoftplus", printable(text));
}

std::string_view ep_transport_name(EpTransport transport) {
  switch (transport) {
    case EpTransport::kAuto:
      return "auto";
    case EpTransport::kNccl:
      return "nccl";
    case EpTransport::kPeer:
      return "peer";
    case EpTransport::kCopy:
      return "copy";
  }
  return "unknown";
}

EpTransport parse_ep_transport(std::string_view text) {
  if (text == "auto") return EpTransport::kAuto;
  if (text == "nccl") return EpTransport::kNccl;
  if (text == "peer") return EpTransport::kPeer;
  if (text == "copy") return EpTransport::kCopy;
  fail("ep_transport = '{}' is not one of auto, nccl, peer, copy", printable(text));
}

std::string_view drop_policy_name(DropPolicy policy) {
  switch (policy) {
    case DropPolicy::kProbs:
      return "probs";
    case DropPolicy::kPosition:
      return "position";
  }
  return "unknown";
}

DropPolicy parse_drop_policy(std::string_view text) {
  if (text == "probs") return DropPolicy::kProbs;
  if (text == "position") return DropPolicy::kPosition;
  fail("drop_policy = '{}' is not one of probs, position", printable(text));
}

namespace {

template <typename... Args>
[[noreturn]] void invalid(fmt::format_string<Args...> format, Args&&... args) {
  fail("invalid MoEConfig: {}", fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace

// A macro so that the message's format string stays a compile-time constant that fmt checks.
#define MOE_CONFIG_REQUIRE(condition, ...) \
  if (!(condition)) invalid(__VA_ARGS__)

std::int64_t MoEConfig::padded_rows(std::int64_t count) const {
  // Counts come from routing over files of any size, and a config built in code may skip
  // validate(): the rounding is checked rather than trusted not to wrap.
  if (count < 0) fail("padded_rows: count = {} must be >= 0", count);
  if (align_size < 0 || align_size > kMaxAlignSize)
    fail("padded_rows: align_size = {} must be in [0, {}]", align_size, kMaxAlignSize);
  if (align_size <= 1) return count;
  std::int64_t rounded_up = 0;
  if (__builtin_add_overflow(count, std::int64_t{align_size} - 1, &rounded_up))
    fail("padded_rows: {} rows padded to a multiple of {} overflow int64", count, align_size);
  return rounded_up / align_size * align_size;
}

std::int64_t MoEConfig::expert_capacity(std::int64_t tokens) const {
  if (!capacity_mode() || !std::isfinite(capacity_factor))
    fail("expert_capacity: capacity_factor = {} is not a capacity (capacity mode is off)",
         capacity_factor);
  if (tokens < 0) fail("expert_capacity: tokens = {} must be >= 0", tokens);
  if (num_experts < 1 || topk < 1)
    fail("expert_capacity: num_experts = {} and topk = {} must be >= 1", num_experts, topk);
  // tokens · topk stays exact in double up to 2^53, far past any rank's slots. An expert is offered
  // at most one slot per token, so a capacity above T can never fill: it would only pad (with
  // pad_to_capacity, E blocks of zero rows per rank), and is taken as T.
  const double rows =
      std::min(std::ceil(capacity_factor * static_cast<double>(tokens * topk) / num_experts),
               static_cast<double>(tokens));
  if (!(rows <= static_cast<double>(kMaxCapacityRows)))
    fail("capacity_factor = {} over {} tokens gives a capacity of {} rows, past the limit of {}",
         capacity_factor, tokens, rows, kMaxCapacityRows);
  const std::int64_t capacity = padded_rows(static_cast<std::int64_t>(rows));
  if (capacity > kMaxCapacityRows)
    fail(
        "capacity_factor = {} over {} tokens gives a capacity of {} rows after align_size = {}, "
        "past the limit of {}",
        capacity_factor, tokens, capacity, align_size, kMaxCapacityRows);
  return capacity;
}

std::string MoEConfig::unsupported_by_gpu_layer() const {
  if (fp8_dispatch && ep > 1 &&
      (ep_transport == EpTransport::kPeer || ep_transport == EpTransport::kCopy))
    return fmt::format(
        "fp8_dispatch with ep_transport = {}: E4M3 rows and their scales cross over the NCCL "
        "exchange (auto or nccl), for now",
        ep_transport_name(ep_transport));
  if (pad_to_capacity && ep > 1 &&
      (ep_transport == EpTransport::kPeer || ep_transport == EpTransport::kCopy))
    return fmt::format(
        "pad_to_capacity with ep_transport = {}: fixed blocks run over the NCCL exchange (auto "
        "or nccl), for now",
        ep_transport_name(ep_transport));
  return {};
}

MoEConfig::RoutingGroups MoEConfig::routing_groups() const {
  if (max_nodes_per_token > 0 && ep_ranks_per_node > 0) {
    // An EP group inside one node (ep <= ep_ranks_per_node), or over no more nodes than a token
    // may reach, limits nothing.
    const int nodes = ep > ep_ranks_per_node ? ep / ep_ranks_per_node : 1;
    if (nodes > max_nodes_per_token) return {nodes, max_nodes_per_token};
    return {};
  }
  return {num_groups, group_topk};
}

MoEConfig MoEConfig::for_one_rank() const {
  MoEConfig one = *this;
  if (node_limited_routing()) {
    const RoutingGroups groups = routing_groups();
    one.num_groups = groups.count;
    one.group_topk = groups.topk;
    one.max_nodes_per_token = one.ep_ranks_per_node = 0;
  }
  one.ep = one.dp = 1;
  return one;
}

void MoEConfig::validate() const {
  MOE_CONFIG_REQUIRE(hidden > 0, "hidden = {} must be positive", hidden);
  MOE_CONFIG_REQUIRE(ffn_hidden > 0, "ffn_hidden = {} must be positive", ffn_hidden);
  MOE_CONFIG_REQUIRE(hidden <= kMaxHidden, "hidden = {} exceeds the supported maximum {}", hidden,
                     kMaxHidden);
  MOE_CONFIG_REQUIRE(ffn_hidden <= kMaxHidden, "ffn_hidden = {} exceeds the supported maximum {}",
                     ffn_hidden, kMaxHidden);
  MOE_CONFIG_REQUIRE(num_experts >= 1 && num_experts <= kMaxExperts,
                     "num_experts = {} must be in [1, {}]", num_experts, kMaxExperts);
  MOE_CONFIG_REQUIRE(topk >= 1 && topk <= num_experts, "topk = {} must be in [1, num_experts = {}]",
                     topk, num_experts);
  MOE_CONFIG_REQUIRE(topk <= kMaxTopK, "topk = {} exceeds the supported maximum {}", topk,
                     kMaxTopK);

  MOE_CONFIG_REQUIRE(score_function == ScoreFunction::kSoftmax || !pre_softmax,
                     "pre_softmax = true needs score_function = softmax, not {}",
                     score_function_name(score_function));
  MOE_CONFIG_REQUIRE(
      !expert_bias || score_function != ScoreFunction::kSoftmax,
      "expert_bias = true needs score_function = sigmoid or sqrtsoftplus, not softmax");

  // Group-limited routing: both zero means off; anything else must be a complete, valid setting.
  // (Node-limited routing, which sets the groups from the mesh, is checked with the mesh below.)
  MOE_CONFIG_REQUIRE(num_groups >= 0, "num_groups = {} must be >= 0", num_groups);
  MOE_CONFIG_REQUIRE(group_topk >= 0, "group_topk = {} must be >= 0", group_topk);
  MOE_CONFIG_REQUIRE((num_groups == 0) == (group_topk == 0),
                     "num_groups = {} and group_topk = {}: set both (grouped routing) or neither",
                     num_groups, group_topk);
  if (num_groups > 0) {
    MOE_CONFIG_REQUIRE(num_experts % num_groups == 0,
                       "num_groups = {} must divide num_experts = {}", num_groups, num_experts);
    MOE_CONFIG_REQUIRE(group_topk <= num_groups, "group_topk = {} must be in [1, num_groups = {}]",
                       group_topk, num_groups);
    MOE_CONFIG_REQUIRE(topk % group_topk == 0, "group_topk = {} must divide topk = {}", group_topk,
                       topk);
    MOE_CONFIG_REQUIRE(
        topk / group_topk <= num_experts / num_groups,
        "topk / group_topk = {} must not exceed the experts per group, num_experts / "
        "num_groups = {}",
        topk / group_topk, num_experts / num_groups);
  }

  MOE_CONFIG_REQUIRE(std::isfinite(scaling_factor) && scaling_factor > 0,
                     "scaling_factor = {} must be positive and finite", scaling_factor);
  MOE_CONFIG_REQUIRE(scaling_factor >= kMinScalingFactor && scaling_factor <= kMaxScalingFactor,
                     "scaling_factor = {} is outside [{}, {}] (models scale by about 1)",
                     scaling_factor, kMinScalingFactor, kMaxScalingFactor);
  MOE_CONFIG_REQUIRE(std::isfinite(aux_loss_coeff) && aux_loss_coeff >= 0,
                     "aux_loss_coeff = {} must be >= 0 and finite", aux_loss_coeff);
  MOE_CONFIG_REQUIRE(aux_loss_coeff <= kMaxLossCoeff,
                     "aux_loss_coeff = {} is past {} (models use about 1e-4 to a few 1e-2)",
                     aux_loss_coeff, kMaxLossCoeff);
  MOE_CONFIG_REQUIRE(std::isfinite(z_loss_coeff) && z_loss_coeff >= 0,
                     "z_loss_coeff = {} must be >= 0 and finite", z_loss_coeff);
  MOE_CONFIG_REQUIRE(z_loss_coeff <= kMaxLossCoeff,
                     "z_loss_coeff = {} is past {} (models use about 1e-4 to a few 1e-2)",
                     z_loss_coeff, kMaxLossCoeff);
  // Bounded (kMaxAlignSize says why): a typo fails here, not in an allocation minutes later.
  MOE_CONFIG_REQUIRE(align_size >= 0 && align_size <= kMaxAlignSize,
                     "align_size = {} must be in [0, {}] (0 or 1 = no padding; a GEMM tile is "
                     "16 to 256 rows)",
                     align_size, kMaxAlignSize);
  // Capacity mode: 0 is off; its two companions mean nothing without it, so they are refused
  // rather than silently ignored.
  MOE_CONFIG_REQUIRE(std::isfinite(capacity_factor) && capacity_factor >= 0,
                     "capacity_factor = {} must be finite and >= 0 (0 = dropless)",
                     capacity_factor);
  MOE_CONFIG_REQUIRE(capacity_factor <= kMaxCapacityFactor,
                     "capacity_factor = {} is past {} (from num_experts / topk = {} on, every "
                     "expert may take every token)",
                     capacity_factor, kMaxCapacityFactor,
                     topk > 0 ? static_cast<double>(num_experts) / topk : 0.0);
  MOE_CONFIG_REQUIRE(drop_policy == DropPolicy::kProbs || drop_policy == DropPolicy::kPosition,
                     "drop_policy = {} must be probs or position", static_cast<int>(drop_policy));
  MOE_CONFIG_REQUIRE(capacity_mode() || drop_policy == DropPolicy::kProbs,
                     "drop_policy = {} needs capacity_factor (capacity mode)",
                     drop_policy_name(drop_policy));
  MOE_CONFIG_REQUIRE(capacity_mode() || !pad_to_capacity,
                     "pad_to_capacity = true needs capacity_factor (capacity mode)");
  MOE_CONFIG_REQUIRE(shared_ffn_hidden >= 0 && shared_ffn_hidden <= kMaxHidden,
                     "shared_ffn_hidden = {} must be in [0, {}] (0 = no shared experts)",
                     shared_ffn_hidden, kMaxHidden);
  MOE_CONFIG_REQUIRE(shared_experts() || !shared_gate,
                     "shared_gate = true needs shared_ffn_hidden > 0 (shared experts)");
  MOE_CONFIG_REQUIRE(dtype == DType::kBF16 || dtype == DType::kFP32,
                     "dtype = {} must be bf16 or fp32", dtype_name(dtype));
  MOE_CONFIG_REQUIRE(grad_dtype == DType::kBF16 || grad_dtype == DType::kFP32,
                     "grad_dtype = {} must be bf16 or fp32", dtype_name(grad_dtype));
  // FP8 products read 16 bytes of a row at a time: every expert's rows and both widths in
  // multiples of 16.
  MOE_CONFIG_REQUIRE(!fp8 || dtype == DType::kBF16, "fp8 = true needs dtype = bf16, got {}",
                     dtype_name(dtype));
  MOE_CONFIG_REQUIRE(!fp8 || (align_size > 0 && align_size % 16 == 0),
                     "fp8 = true needs align_size a multiple of 16, got {}", align_size);
  MOE_CONFIG_REQUIRE(!fp8 || (hidden % 16 == 0 && ffn_hidden % 16 == 0),
                     "fp8 = true needs hidden and ffn_hidden multiples of 16, got {} and {}",
                     hidden, ffn_hidden);
  MOE_CONFIG_REQUIRE(fp8 || !fp8_dispatch,
                     "fp8_dispatch = true needs fp8 = true (the experts' products read E4M3)");
  // The per-expert quantization carries each rank's expert offsets in its launch parameters.
  MOE_CONFIG_REQUIRE(!fp8 || ep < 1 || num_experts / ep <= 512,
                     "fp8 = true takes at most 512 experts a rank, got num_experts / ep = {} / {}",
                     num_experts, ep);
  MOE_CONFIG_REQUIRE(std::isfinite(activation_chunk_mib) && activation_chunk_mib >= 0 &&
                         activation_chunk_mib <= 1 << 20,
                     "activation_chunk_mib = {} must be in [0, 1048576] (0 = every row at once)",
                     activation_chunk_mib);
  MOE_CONFIG_REQUIRE(gemm_workspace_mib >= 0 && gemm_workspace_mib <= 4096,
                     "gemm_workspace_mib = {} must be in [0, 4096]", gemm_workspace_mib);
  MOE_CONFIG_REQUIRE(ep >= 1, "ep = {} must be >= 1", ep);
  MOE_CONFIG_REQUIRE(dp >= 1, "dp = {} must be >= 1", dp);
  MOE_CONFIG_REQUIRE(num_experts % ep == 0, "ep = {} must divide num_experts = {}", ep,
                     num_experts);

  // Node-limited routing: one routing group per node of ep_ranks_per_node EP ranks.
  MOE_CONFIG_REQUIRE(max_nodes_per_token >= 0, "max_nodes_per_token = {} must be >= 0",
                     max_nodes_per_token);
  MOE_CONFIG_REQUIRE(ep_ranks_per_node >= 0, "ep_ranks_per_node = {} must be >= 0",
                     ep_ranks_per_node);
  MOE_CONFIG_REQUIRE((max_nodes_per_token == 0) == (ep_ranks_per_node == 0),
                     "max_nodes_per_token = {} and ep_ranks_per_node = {}: set both (node-limited "
                     "routing) or neither",
                     max_nodes_per_token, ep_ranks_per_node);
  if (node_limited_routing()) {
    MOE_CONFIG_REQUIRE(num_groups == 0,
                       "max_nodes_per_token = {} with num_groups = {}: node-limited routing makes "
                       "one routing group per node itself; leave num_groups and group_topk at 0",
                       max_nodes_per_token, num_groups);
    // Each node kept is scored by its top topk / max_nodes_per_token experts, whatever the mesh.
    MOE_CONFIG_REQUIRE(topk % max_nodes_per_token == 0,
                       "max_nodes_per_token = {} must divide topk = {} (each node kept is scored "
                       "by its top topk / max_nodes_per_token experts)",
                       max_nodes_per_token, topk);
    // A config file may leave ep to the launcher (ep 1, one node: no limit yet); the apps validate
    // again once they set the mesh's ep.
    MOE_CONFIG_REQUIRE(ep <= ep_ranks_per_node || ep % ep_ranks_per_node == 0,
                       "ep_ranks_per_node = {} must divide ep = {}", ep_ranks_per_node, ep);
    if (const int nodes = routing_groups().count; nodes > 0) {
      MOE_CONFIG_REQUIRE(topk / max_nodes_per_token <= num_experts / nodes,
                         "topk / max_nodes_per_token = {} must not exceed the experts per node, "
                         "num_experts / nodes = {}",
                         topk / max_nodes_per_token, num_experts / nodes);
    }
  }
  MOE_CONFIG_REQUIRE(exchange_chunks >= 0 && exchange_chunks <= 1024,
                     "exchange_chunks = {} must be in [0, 1024] (0 = automatic, 1 = one chunk)",
                     exchange_chunks);
  MOE_CONFIG_REQUIRE(ep_transport == EpTransport::kAuto || ep_transport == EpTransport::kNccl ||
                         ep_transport == EpTransport::kPeer || ep_transport == EpTransport::kCopy,
                     "ep_transport = {} must be auto, nccl, peer or copy",
                     static_cast<int>(ep_transport));
  // The apps' --tokens bound: a file cannot ask for more than their command lines can.
  MOE_CONFIG_REQUIRE(bench_tokens >= 0 && bench_tokens <= (1 << 30),
                     "tokens = {} must be in [0, 2^30]", bench_tokens);
}

int MoEConfig::effective_exchange_chunks() const {
  const int local_experts = ep >= 1 ? num_experts / ep : num_experts;
  if (ep <= 1 || local_experts <= 1) return 1;
  // Automatic: four chunks hide all but about a quarter of each exchange's time (the first
  // dispatch chunk and the last combine chunk stay exposed) at four times the launches, over
  // NCCL and over the copy engines alike (whose chunks end in barriers that need no SM):
  // docs/performance.md, "Exchange".
  constexpr int kAutomaticChunks = 4;
  const int wanted = exchange_chunks == 0 ? kAutomaticChunks : exchange_chunks;
  return std::min(wanted, local_experts);
}

std::string MoEConfig::describe() const {
  std::string router(score_function_name(score_function));
  if (score_function == ScoreFunction::kSoftmax) router += pre_softmax ? "(pre)" : "(post)";
  if (expert_bias) router += "+bias";
  if (node_limited_routing()) {
    router += fmt::format(" nodes<={} ({} ranks/node)", max_nodes_per_token, ep_ranks_per_node);
  } else if (num_groups > 0) {
    router += fmt::format(" groups={}/top{}", num_groups, group_topk);
  }
  std::string features;
  if (capacity_mode()) {
    features += fmt::format(" capacity={}({}{})", capacity_factor, drop_policy_name(drop_policy),
                            pad_to_capacity ? ", padded" : "");
  }
  if (shared_experts())
    features += fmt::format(" shared={}{}{}", shared_ffn_hidden, shared_gate ? "(gated)" : "",
                            shared_expert_overlap ? "" : "(in series)");
  if (fp8) features += fp8_dispatch ? " fp8(dispatch)" : " fp8";
  return fmt::format(
      "H={} F={} E={} K={} {} scale={} aux={} z={} align={}{} {} (grads {}){} EP={} DP={}{}",
      hidden, ffn_hidden, num_experts, topk, router, scaling_factor, aux_loss_coeff, z_loss_coeff,
      align_size, features, dtype_name(dtype), dtype_name(grad_dtype),
      keep_expert_input ? " X kept" : "", ep, dp,
      ep_transport == EpTransport::kAuto ? ""
                                         : fmt::format(" ({})", ep_transport_name(ep_transport)));
}

}  // namespace moe
