#include "moe/config.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <type_traits>
#include <vector>

#include "core/input_file.h"
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
  fail("score_function = '{}' is not one of softmax, sigmoid, sqrtsoftplus", text);
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
  fail("ep_transport = '{}' is not one of auto, nccl, peer, copy", text);
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
  fail("drop_policy = '{}' is not one of probs, position", text);
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
  // The dropped slots take a layout group of their own after the E experts'.
  if (capacity_mode() && num_experts >= kMaxExperts)
    return fmt::format(
        "capacity_factor={} with num_experts = {}: the GPU layer's capacity mode needs a layout "
        "group beside the experts', at most {} experts; moe_run --reference runs it on the CPU",
        capacity_factor, num_experts, kMaxExperts - 1);
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
  MOE_CONFIG_REQUIRE(std::isfinite(aux_loss_coeff) && aux_loss_coeff >= 0,
                     "aux_loss_coeff = {} must be >= 0 and finite", aux_loss_coeff);
  MOE_CONFIG_REQUIRE(std::isfinite(z_loss_coeff) && z_loss_coeff >= 0,
                     "z_loss_coeff = {} must be >= 0 and finite", z_loss_coeff);
  // Bounded (kMaxAlignSize says why): a typo fails here, not in an allocation minutes later.
  MOE_CONFIG_REQUIRE(align_size >= 0 && align_size <= kMaxAlignSize,
                     "align_size = {} must be in [0, {}] (0 or 1 = no padding; a GEMM tile is "
                     "16 to 256 rows)",
                     align_size, kMaxAlignSize);
  // Capacity mode: 0 is off; its two companions mean nothing without it, so they are refused
  // rather than silently ignored.
  MOE_CONFIG_REQUIRE(std::isfinite(capacity_factor) && capacity_factor >= 0,
                     "capacity_factor = {} must be positive and finite (absent = dropless)",
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
  MOE_CONFIG_REQUIRE(!fp8 || exchange_chunks <= 1,
                     "exchange_chunks = {} with fp8 = true: the FP8 experts run every local "
                     "expert in one pass, so the exchange cannot pipeline with them (use 0 or 1)",
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
  if (ep <= 1 || fp8 || local_experts <= 1) return 1;
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

namespace {

// The config's dtypes are bf16 or fp32: int32 is a dtype of tensors, never of the layer's values.
DType parse_activation_dtype(const std::string& text, const char* key) {
  if (text != "bf16" && text != "fp32") fail("{} = '{}' is not bf16 or fp32", key, text);
  return parse_dtype(text, key);
}

// A value from the file as a message shows it: a newline or tab written \n or \t, so that the
// message stays on one line (errors escape the other control characters themselves).
std::string printable(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      out += c;
    }
  }
  return out;
}

// Reads one scalar, turning yaml-cpp's conversion failure into an error that names the key.
template <typename T>
T read_scalar(const YAML::Node& node, const std::string& key, std::string_view source) {
  if (node.IsNull()) fail("{}: '{}' has no value", source, key);
  if (!node.IsScalar()) fail("{}: '{}' must be a scalar, not a list or map", source, key);
  // A number or a flag in quotes is a string to every other YAML reader: refused, not converted.
  // So is a value with any other tag than its own type's (!!str 16, !!float 16, !custom 16):
  // yaml-cpp would read each as the number.
  const std::string& tag = node.Tag();
  if constexpr (!std::is_same_v<T, std::string>) {
    if (tag == "!")
      fail("{}: {} = '{}' is quoted, which makes it a string; write it without quotes", source, key,
           node.Scalar());
  }
  const char* own_tag = std::is_same_v<T, std::string> ? "tag:yaml.org,2002:str"
                        : std::is_same_v<T, bool>      ? "tag:yaml.org,2002:bool"
                        : std::is_same_v<T, int>       ? "tag:yaml.org,2002:int"
                                                       : "tag:yaml.org,2002:float";
  if (tag != "?" && tag != "!" && tag != own_tag)
    fail("{}: {} = '{}' carries the tag '{}'; write the value alone", source, key,
         printable(node.Scalar()), printable(tag));
  // A text value is a name (a dtype, a score function, a policy): a control character in it (a
  // block scalar's newline, say) would split every message that shows it.
  if constexpr (std::is_same_v<T, std::string>) {
    const std::string& text = node.Scalar();
    if (std::any_of(text.begin(), text.end(),
                    [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; }))
      fail("{}: {} = '{}' holds a control character", source, key, printable(text));
  }
  if constexpr (std::is_same_v<T, int>) {
    // Decimal only: yaml-cpp reads a leading 0 as octal (hidden: 0100 would be 64) and 0x as hex.
    const std::string& text = node.Scalar();
    const std::size_t digits = text.find_first_not_of("+-") == 1 ? 1 : 0;
    const bool decimal = !text.empty() && text.size() > digits &&
                         text.find_first_not_of("0123456789", digits) == std::string::npos &&
                         (text[digits] != '0' || text.size() == digits + 1);
    if (!decimal)
      fail("{}: {} = '{}' is not a decimal integer (leading zeros and other bases are refused)",
           source, key, text);
  }
  if constexpr (std::is_same_v<T, bool>) {
    // true or false only: yaml-cpp also takes YAML 1.1's y, n, yes, no, on and off, which a YAML
    // 1.2 reader takes as strings, so the same file would mean different things to two tools.
    const std::string& text = node.Scalar();
    if (text != "true" && text != "false")
      fail("{}: {} = '{}' is not true or false", source, key, text);
  }
  if constexpr (std::is_same_v<T, double>) {
    // yaml-cpp turns 1e-400 into 0 and 1e400 into a failure without a reason.
    const std::string& text = node.Scalar();
    errno = 0;
    char* end = nullptr;
    (void)std::strtod(text.c_str(), &end);
    if (errno == ERANGE && end != text.c_str())
      fail("{}: {} = '{}' is beyond the range of a double (magnitudes 2.2e-308 to 1.8e308)", source,
           key, printable(text));
  }
  try {
    return node.as<T>();
  } catch (const YAML::Exception&) {
    fail("{}: {} = '{}' is not a valid value", source, key, printable(node.Scalar()));
  }
}

// A setting's own parser (an enum's name, a dtype), its error prefixed with the file and key.
template <typename Parse>
auto parse_named(const YAML::Node& node, const std::string& key, std::string_view source,
                 Parse&& parse) {
  const std::string text = read_scalar<std::string>(node, key, source);
  try {
    return parse(text);
  } catch (const Error& error) {
    fail("{}: {}", source, error.what());
  }
}

}  // namespace

MoEConfig parse_config(std::string_view yaml_text, std::string_view source) {
  // yaml-cpp's own message would stop at the byte (a binary file given as the config, say).
  if (const auto nul = yaml_text.find('\0'); nul != std::string_view::npos)
    fail("{}: holds a NUL byte at offset {}; a config is YAML text", source, nul);
  // One document: yaml-cpp's Load reads the first and drops the rest without a word, so a
  // document marker after the first key is refused here. (Its LoadAll loops on some malformed
  // inputs, which the fuzzer found.)
  // Directives (%YAML) and a `---` may open the document, and a `...` may close it; content, a
  // directive or a `---` after the content, or anything after a `...`, is another document.
  bool content = false, ended = false;
  std::size_t line_number = 0;
  for (std::size_t at = 0; at <= yaml_text.size();) {
    const std::size_t end = std::min(yaml_text.find('\n', at), yaml_text.size());
    const std::string_view line = yaml_text.substr(at, end - at);
    ++line_number;
    const auto is_marker = [&](std::string_view marker) {
      return line.starts_with(marker) &&
             (line.size() == 3 || line[3] == ' ' || line[3] == '\t' || line[3] == '\r');
    };
    const std::size_t first = line.find_first_not_of(" \t\r");
    const bool blank = first == std::string_view::npos || line[first] == '#';
    const bool opener = is_marker("---") || line.starts_with('%');
    const bool closer = is_marker("...");
    if ((opener && content) || (!opener && !closer && !blank && ended))
      fail("{}: line {} starts another YAML document; a config is one map of `key: value` pairs",
           source, line_number);
    if (closer && content) ended = true;
    if (!blank && !opener && !closer) content = true;
    at = end + 1;
  }
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::DeepRecursion& e) {  // yaml-cpp says only "bad file"
    fail(
        "{}: collections nested {} deep at line {}, column {}: a config is one flat map of "
        "`key: value` pairs",
        source, e.depth(), e.mark.line + 1, e.mark.column + 1);
  } catch (const YAML::Exception& e) {
    fail("{}: not valid YAML: {}", source, e.what());
  }
  if (!root.IsMap()) fail("{}: expected a map of `key: value` pairs", source);

  MoEConfig config;
  using Setter = std::function<void(const YAML::Node&, const std::string&)>;
  auto integer = [&](int MoEConfig::*field) -> Setter {
    return [&config, field, source](const YAML::Node& n, const std::string& k) {
      config.*field = read_scalar<int>(n, k, source);
    };
  };
  auto real = [&](double MoEConfig::*field) -> Setter {
    return [&config, field, source](const YAML::Node& n, const std::string& k) {
      config.*field = read_scalar<double>(n, k, source);
    };
  };
  auto flag = [&](bool MoEConfig::*field) -> Setter {
    return [&config, field, source](const YAML::Node& n, const std::string& k) {
      config.*field = read_scalar<bool>(n, k, source);
    };
  };
  const std::map<std::string, Setter> setters = {
      {"hidden", integer(&MoEConfig::hidden)},
      {"ffn_hidden", integer(&MoEConfig::ffn_hidden)},
      {"num_experts", integer(&MoEConfig::num_experts)},
      {"topk", integer(&MoEConfig::topk)},
      {"score_function",
       [&](const YAML::Node& n, const std::string& k) {
         config.score_function = parse_named(n, k, source, parse_score_function);
       }},
      {"pre_softmax", flag(&MoEConfig::pre_softmax)},
      {"num_groups", integer(&MoEConfig::num_groups)},
      {"group_topk", integer(&MoEConfig::group_topk)},
      {"max_nodes_per_token", integer(&MoEConfig::max_nodes_per_token)},
      {"ep_ranks_per_node", integer(&MoEConfig::ep_ranks_per_node)},
      {"scaling_factor", real(&MoEConfig::scaling_factor)},
      {"expert_bias", flag(&MoEConfig::expert_bias)},
      {"aux_loss_coeff", real(&MoEConfig::aux_loss_coeff)},
      {"z_loss_coeff", real(&MoEConfig::z_loss_coeff)},
      {"align_size", integer(&MoEConfig::align_size)},
      {"capacity_factor", real(&MoEConfig::capacity_factor)},
      {"drop_policy",
       [&](const YAML::Node& n, const std::string& k) {
         config.drop_policy = parse_named(n, k, source, parse_drop_policy);
       }},
      {"pad_to_capacity", flag(&MoEConfig::pad_to_capacity)},
      {"shared_ffn_hidden", integer(&MoEConfig::shared_ffn_hidden)},
      {"shared_gate", flag(&MoEConfig::shared_gate)},
      {"shared_expert_overlap", flag(&MoEConfig::shared_expert_overlap)},
      {"fp8", flag(&MoEConfig::fp8)},
      {"fp8_dispatch", flag(&MoEConfig::fp8_dispatch)},
      {"dtype",
       [&](const YAML::Node& n, const std::string& k) {
         config.dtype = parse_named(n, k, source, [](const std::string& text) {
           return parse_activation_dtype(text, "dtype");
         });
       }},
      {"grad_dtype",
       [&](const YAML::Node& n, const std::string& k) {
         config.grad_dtype = parse_named(n, k, source, [](const std::string& text) {
           return parse_activation_dtype(text, "grad_dtype");
         });
       }},
      {"keep_expert_input", flag(&MoEConfig::keep_expert_input)},
      {"activation_chunk_mib", real(&MoEConfig::activation_chunk_mib)},
      {"gemm_workspace_mib", integer(&MoEConfig::gemm_workspace_mib)},
      {"gemm_autotune", flag(&MoEConfig::gemm_autotune)},
      {"ep", integer(&MoEConfig::ep)},
      {"dp", integer(&MoEConfig::dp)},
      {"ep_transport",
       [&](const YAML::Node& n, const std::string& k) {
         config.ep_transport = parse_named(n, k, source, parse_ep_transport);
       }},
      {"exchange_chunks", integer(&MoEConfig::exchange_chunks)},
      {"tokens", integer(&MoEConfig::bench_tokens)},
  };

  // yaml-cpp keeps every entry of a mapping, repeated keys included, and lookups see the first:
  // walking the entries is where a repeated key shows, and it is an error (which one was meant?).
  std::set<std::string> seen;
  for (const auto& entry : root) {
    if (!entry.first.IsScalar())
      fail("{}: a key must be a plain name, not a {}", source,
           entry.first.IsSequence() ? "list"
           : entry.first.IsMap()    ? "map"
                                    : "null");
    const std::string key = entry.first.Scalar();
    if (!seen.insert(key).second) {
      fail("{}: key '{}' appears more than once (line {})", source, key,
           entry.first.Mark().line + 1);
    }
    const auto setter = setters.find(key);
    if (setter == setters.end()) fail("{}: unknown key '{}'", source, key);
    setter->second(entry.second, key);
  }
  for (const char* required : {"hidden", "ffn_hidden", "num_experts", "topk"}) {
    if (seen.count(required) == 0) fail("{}: missing required key '{}'", source, required);
  }
  // In a config built in code 0 means dropless; written in a file it is a value, and no value
  // turns capacity mode off (absence does), so a 0 there is more likely a slip than a wish.
  if (seen.count("capacity_factor") != 0 && !(config.capacity_factor > 0))
    fail("{}: capacity_factor = {} must be positive and finite (omit the key for dropless routing)",
         source, config.capacity_factor);
  if (seen.count("drop_policy") != 0 && !config.capacity_mode())
    fail("{}: drop_policy = {} needs capacity_factor (capacity mode)", source,
         drop_policy_name(config.drop_policy));
  try {
    config.validate();
  } catch (const Error& e) {  // the file's name first, as for every other error of the file
    fail("{}: {}", source, e.what());
  }
  return config;
}

MoEConfig load_config(const std::filesystem::path& path) {
  return parse_config(InputFile(path, kMaxConfigBytes, "config file").read_all(), path.string());
}

}  // namespace moe
