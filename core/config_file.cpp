// The layer's config from YAML: every key checked for its type and range, unknown and duplicated
// keys refused, each error naming the file, the key and the value (include/moe/config.h).
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <type_traits>

#include "core/input_file.h"
#include "core/printable.h"
#include "moe/config.h"
#include "moe/error.h"

namespace moe {

namespace {

// The config's dtypes are bf16 or fp32: int32 is a dtype of tensors, never of the layer's values.
DType parse_activation_dtype(const std::string& text, const char* key) {
  if (text != "bf16" && text != "fp32") fail("{} = '{}' is not bf16 or fp32", key, printable(text));
  return parse_dtype(text, key);
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
           printable(node.Scalar()));
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
           source, key, printable(text));
    errno = 0;
    const long long value = std::strtoll(text.c_str(), nullptr, 10);
    if (errno == ERANGE || value < std::numeric_limits<int>::min() ||
        value > std::numeric_limits<int>::max())
      fail("{}: {} = '{}' is beyond the range of an int ({} to {})", source, key, printable(text),
           std::numeric_limits<int>::min(), std::numeric_limits<int>::max());
  }
  if constexpr (std::is_same_v<T, bool>) {
    // true or false only: yaml-cpp also takes YAML 1.1's y, n, yes, no, on and off, which a YAML
    // 1.2 reader takes as strings, so the same file would mean different things to two tools.
    const std::string& text = node.Scalar();
    if (text != "true" && text != "false")
      fail("{}: {} = '{}' is not true or false", source, key, printable(text));
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
  // inputs.)
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
      fail("{}: key '{}' appears more than once (line {})", source, printable(key),
           entry.first.Mark().line + 1);
    }
    // yaml-cpp reads a merge key as a key like any other: the keys it would merge never arrive.
    const std::string& key_tag = entry.first.Tag();
    if (key == "<<" && (key_tag == "?" || key_tag == "tag:yaml.org,2002:merge"))
      fail(
          "{}: '<<' (line {}) is a YAML merge key, which the loader does not expand; write the "
          "merged keys out in the config's mapping",
          source, entry.first.Mark().line + 1);
    const auto setter = setters.find(key);
    if (setter == setters.end()) fail("{}: unknown key '{}'", source, printable(key));
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
