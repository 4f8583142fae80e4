#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "moe/config.h"
#include "moe/error.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;

namespace {

const std::string kBase = R"(
hidden: 64
ffn_hidden: 32
num_experts: 8
topk: 2
)";

std::string error_of(const std::string& yaml) {
  try {
    parse_config(yaml, "test.yaml");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string load_error(const std::filesystem::path& path) {
  try {
    load_config(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// The required keys and their values, in a random order, one `key: value` line each.
std::vector<std::string> base_lines(std::mt19937_64& rng) {
  std::vector<std::string> lines = {"hidden: 64", "ffn_hidden: 32", "num_experts: 8", "topk: 2"};
  std::shuffle(lines.begin(), lines.end(), rng);
  return lines;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string text;
  for (const auto& line : lines) text += line + "\n";
  return text;
}

}  // namespace

TEST_CASE("the shipped configs load and validate", "[cpu][config]") {
  int shipped = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::string(MOE_SOURCE_DIR) + "/configs")) {
    if (entry.path().extension() != ".yaml") continue;
    INFO(entry.path().filename().string());
    const auto config = load_config(entry.path().string());
    CHECK(config.bench_tokens > 0);
    CHECK(config.dtype == DType::kBF16);
    ++shipped;
  }
  CHECK(shipped >= 6);
  const auto ds = load_config(std::string(MOE_SOURCE_DIR) + "/configs/deepseek-v3.yaml");
  CHECK(ds.hidden == 7168);
  CHECK(ds.ffn_hidden == 2048);
  CHECK(ds.num_experts == 256);
  CHECK(ds.topk == 8);
  CHECK(ds.score_function == ScoreFunction::kSigmoid);
  CHECK(ds.expert_bias);
  CHECK(ds.num_groups == 8);
  CHECK(ds.group_topk == 4);
  CHECK(ds.scaling_factor == 2.5);
  const auto mixtral = load_config(std::string(MOE_SOURCE_DIR) + "/configs/mixtral-8x7b.yaml");
  CHECK(mixtral.num_experts == 8);
  CHECK(mixtral.topk == 2);
  CHECK_FALSE(mixtral.pre_softmax);
}

TEST_CASE("defaults: grouped routing off, no bias, no losses, scale 1", "[cpu][config]") {
  const auto config = parse_config(kBase);
  CHECK_FALSE(config.grouped_routing());  // grouped routing is off by default
  CHECK(config.num_groups == 0);
  CHECK(config.group_topk == 0);
  CHECK_FALSE(config.expert_bias);
  CHECK(config.aux_loss_coeff == 0.0);
  CHECK(config.z_loss_coeff == 0.0);
  CHECK(config.scaling_factor == 1.0);
  CHECK(config.ep == 1);
  CHECK(config.dp == 1);
  CHECK(config.local_experts() == 8);
  CHECK(config.grad_dtype == DType::kFP32);
  CHECK(parse_config(kBase + "grad_dtype: bf16\n").grad_dtype == DType::kBF16);
  CHECK_FALSE(config.keep_expert_input);
  CHECK(parse_config(kBase + "keep_expert_input: true\n").keep_expert_input);
  CHECK(config.gemm_autotune);
  CHECK_FALSE(parse_config(kBase + "gemm_autotune: false\n").gemm_autotune);
  CHECK(config.ep_transport == EpTransport::kAuto);
  CHECK(parse_config(kBase + "ep_transport: nccl\n").ep_transport == EpTransport::kNccl);
  CHECK(parse_config(kBase + "ep_transport: peer\n").ep_transport == EpTransport::kPeer);
  CHECK(parse_config(kBase + "ep_transport: copy\n").ep_transport == EpTransport::kCopy);
  CHECK(config.activation_chunk_mib == 64.0);
  CHECK(parse_config(kBase + "activation_chunk_mib: 0.5\n").activation_chunk_mib == 0.5);
  CHECK(config.gemm_workspace_mib == 4);
  CHECK(parse_config(kBase + "gemm_workspace_mib: 4\n").gemm_workspace_mib == 4);
  MoEConfig bad = config;
  bad.ep_transport = static_cast<EpTransport>(7);
  CHECK_THROWS_WITH(bad.validate(),
                    test::contains_text("ep_transport = 7 must be auto, nccl, peer or copy"));
}

TEST_CASE("padded rows round each group up to align_size", "[cpu][config]") {
  auto config = parse_config(kBase + "align_size: 16\n");
  CHECK(config.padded_rows(0) == 0);
  CHECK(config.padded_rows(1) == 16);
  CHECK(config.padded_rows(16) == 16);
  CHECK(config.padded_rows(17) == 32);
  config.align_size = 0;
  CHECK(config.padded_rows(17) == 17);
  config.align_size = 1;
  CHECK(config.padded_rows(17) == 17);
}

TEST_CASE("every invalid config is rejected with a message naming the parameter and value",
          "[cpu][config]") {
  using Overrides = std::map<std::string, std::string>;
  const std::vector<std::pair<Overrides, std::string>> cases = {
      {{{"topk", "9"}}, "topk = 9 must be in [1, num_experts = 8]"},
      {{{"topk", "0"}}, "topk = 0 must be in [1, num_experts = 8]"},
      {{{"hidden", "0"}}, "hidden = 0 must be positive"},
      {{{"ffn_hidden", "-4"}}, "ffn_hidden = -4 must be positive"},
      {{{"num_experts", "0"}}, "num_experts = 0 must be in [1, 2048]"},
      {{{"num_groups", "1"}}, "num_groups = 1 and group_topk = 0: set both"},
      {{{"group_topk", "1"}}, "num_groups = 0 and group_topk = 1: set both"},
      {{{"num_groups", "3"}, {"group_topk", "1"}}, "num_groups = 3 must divide num_experts = 8"},
      {{{"num_groups", "4"}, {"group_topk", "5"}}, "group_topk = 5 must be in [1, num_groups = 4]"},
      {{{"num_groups", "4"}, {"group_topk", "3"}, {"topk", "4"}},
       "group_topk = 3 must divide topk = 4"},
      {{{"num_groups", "4"}, {"group_topk", "1"}, {"topk", "4"}},
       "topk / group_topk = 4 must not exceed the experts per group, num_experts / num_groups = 2"},
      {{{"max_nodes_per_token", "1"}},
       "max_nodes_per_token = 1 and ep_ranks_per_node = 0: set both"},
      {{{"ep_ranks_per_node", "-1"}}, "ep_ranks_per_node = -1 must be >= 0"},
      {{{"max_nodes_per_token", "1"},
        {"ep_ranks_per_node", "1"},
        {"ep", "2"},
        {"num_groups", "2"},
        {"group_topk", "1"}},
       "max_nodes_per_token = 1 with num_groups = 2: node-limited routing makes one routing group "
       "per node itself"},
      {{{"max_nodes_per_token", "3"}, {"ep_ranks_per_node", "2"}},
       "max_nodes_per_token = 3 must divide topk = 2"},
      {{{"max_nodes_per_token", "1"}, {"ep_ranks_per_node", "3"}, {"ep", "4"}},
       "ep_ranks_per_node = 3 must divide ep = 4"},
      {{{"max_nodes_per_token", "2"}, {"ep_ranks_per_node", "1"}, {"ep", "4"}, {"topk", "3"}},
       "max_nodes_per_token = 2 must divide topk = 3"},
      {{{"max_nodes_per_token", "1"}, {"ep_ranks_per_node", "1"}, {"ep", "4"}, {"topk", "4"}},
       "topk / max_nodes_per_token = 4 must not exceed the experts per node, num_experts / nodes = "
       "2"},
      {{{"expert_bias", "true"}},
       "expert_bias = true needs score_function = sigmoid or sqrtsoftplus"},
      {{{"score_function", "sigmoid"}, {"pre_softmax", "true"}},
       "pre_softmax = true needs score_function = softmax, not sigmoid"},
      {{{"scaling_factor", "0"}}, "scaling_factor = 0 must be positive"},
      {{{"aux_loss_coeff", "-0.1"}}, "aux_loss_coeff = -0.1 must be >= 0"},
      {{{"z_loss_coeff", "-1"}}, "z_loss_coeff = -1 must be >= 0"},
      {{{"scaling_factor", "3e38"}}, "scaling_factor = 3e+38 is outside [1e-06, 1000000]"},
      {{{"scaling_factor", "1e-46"}}, "scaling_factor = 1e-46 is outside [1e-06, 1000000]"},
      {{{"aux_loss_coeff", "1e308"}}, "aux_loss_coeff = 1e+308 is past 1000000"},
      {{{"z_loss_coeff", "2e6"}}, "z_loss_coeff = 2000000 is past 1000000"},
      {{{"align_size", "-8"}}, "align_size = -8 must be in [0, 4096]"},
      {{{"align_size", "4097"}}, "align_size = 4097 must be in [0, 4096]"},
      {{{"align_size", "3000000000"}},
       "align_size = '3000000000' is beyond the range of an int (-2147483648 to 2147483647)"},
      {{{"num_experts", "99999999999999999999"}},
       "num_experts = '99999999999999999999' is beyond the range of an int"},
      {{{"hidden", "-2147483649"}}, "hidden = '-2147483649' is beyond the range of an int"},
      {{{"hidden", "1048577"}}, "hidden = 1048577 exceeds the supported maximum 1048576"},
      {{{"ffn_hidden", "2000000000"}}, "ffn_hidden = 2000000000 exceeds the supported maximum"},
      {{{"hidden", ""}}, "'hidden' has no value"},
      {{{"hidden", "[64]"}}, "'hidden' must be a scalar, not a list or map"},
      {{{"activation_chunk_mib", "-1"}}, "activation_chunk_mib = -1 must be in [0, 1048576]"},
      {{{"activation_chunk_mib", ".nan"}}, "activation_chunk_mib = nan must be in [0, 1048576]"},
      {{{"activation_chunk_mib", "1e30"}}, "activation_chunk_mib = 1e+30 must be in [0, 1048576]"},
      {{{"gemm_workspace_mib", "-4"}}, "gemm_workspace_mib = -4 must be in [0, 4096]"},
      {{{"gemm_workspace_mib", "8192"}}, "gemm_workspace_mib = 8192 must be in [0, 4096]"},
      {{{"ep", "3"}}, "ep = 3 must divide num_experts = 8"},
      {{{"ep", "0"}}, "ep = 0 must be >= 1"},
      {{{"dp", "0"}}, "dp = 0 must be >= 1"},
      {{{"dtype", "int32"}}, "dtype = 'int32' is not bf16 or fp32"},
      {{{"dtype", "fp16"}}, "dtype = 'fp16' is not bf16 or fp32"},
      {{{"grad_dtype", "int32"}}, "grad_dtype = 'int32' is not bf16 or fp32"},
      {{{"score_function", "relu"}}, "score_function = 'relu' is not one of"},
      {{{"ep_transport", "ipc"}}, "ep_transport = 'ipc' is not one of auto, nccl, peer, copy"},
      {{{"exchange_chunks", "-1"}}, "exchange_chunks = -1 must be in [0, 1024]"},
      {{{"exchange_chunks", "1025"}}, "exchange_chunks = 1025 must be in [0, 1024]"},
      {{{"topk", "two"}}, "topk = 'two' is not a decimal integer"},
      // yaml-cpp would read these as octal (64, 16) and hex: refused, not misread.
      {{{"hidden", "0100"}}, "hidden = '0100' is not a decimal integer"},
      {{{"align_size", "020"}}, "align_size = '020' is not a decimal integer"},
      {{{"shared_ffn_hidden", "0x18"}}, "shared_ffn_hidden = '0x18' is not a decimal integer"},
      {{{"topk", "2.0"}}, "topk = '2.0' is not a decimal integer"},
      // YAML 1.1's booleans, which yaml-cpp would take and a YAML 1.2 reader reads as strings.
      {{{"keep_expert_input", "yes"}}, "keep_expert_input = 'yes' is not true or false"},
      {{{"keep_expert_input", "off"}}, "keep_expert_input = 'off' is not true or false"},
      {{{"gemm_autotune", "Y"}}, "gemm_autotune = 'Y' is not true or false"},
      {{{"pre_softmax", "1"}}, "pre_softmax = '1' is not true or false"},
      // Quoted, a number or a flag is a string to other YAML readers.
      {{{"hidden", "\"64\""}}, "hidden = '64' is quoted, which makes it a string"},
      {{{"aux_loss_coeff", "'0.1'"}}, "aux_loss_coeff = '0.1' is quoted"},
      {{{"keep_expert_input", "'true'"}}, "keep_expert_input = 'true' is quoted"},
      // A tag other than the value's own type's: yaml-cpp would read each as the number.
      {{{"hidden", "!!str 64"}}, "hidden = '64' carries the tag 'tag:yaml.org,2002:str'"},
      {{{"hidden", "!!float 64"}}, "hidden = '64' carries the tag 'tag:yaml.org,2002:float'"},
      {{{"aux_loss_coeff", "!mine 0.1"}}, "aux_loss_coeff = '0.1' carries the tag '!mine'"},
      {{{"dtype", "!!int fp32"}}, "dtype = 'fp32' carries the tag 'tag:yaml.org,2002:int'"},
      // Past a double's range: yaml-cpp makes 1e-400 a zero and 1e400 a failure without reason.
      {{{"scaling_factor", "1e-400"}}, "scaling_factor = '1e-400' is beyond the range of a double"},
      {{{"aux_loss_coeff", "1e400"}}, "aux_loss_coeff = '1e400' is beyond the range of a double"},
      // A name with a newline (a block scalar keeps it) would split the message that shows it.
      {{{"dtype", "|\n  fp32"}}, "dtype = 'fp32\\n' holds a control character"},
      // A no-break space or a zero-width space would look like nothing at all in the message.
      {{{"dtype", "fp32\u00a0"}}, "dtype = 'fp32\\u00a0' is not bf16 or fp32"},
      {{{"hid\u200bden", "64"}}, "unknown key 'hid\\u200bden'"},
      {{{"score_function", "softmax\u00a0"}},
       "score_function = 'softmax\\u00a0' is not one of softmax"},
      {{{"ep_transport", "\u061cnccl"}}, "ep_transport = '\\u061cnccl' is not one of"},
      {{{"capacity_factor", "1.25"}, {"drop_policy", "probs\U000E0001"}},
       "drop_policy = 'probs\\ue0001' is not one of"},
      // A merge key's keys would never arrive: named, rather than "unknown key '<<'".
      {{{"<<", "{dtype: fp32}"}}, "'<<' (line 1) is a YAML merge key, which the loader does not"},
      {{{"'<<'", "1"}}, "unknown key '<<'"},
      {{{"!!str <<", "1"}}, "unknown key '<<'"},
      {{{"tokens", "2147483647"}}, "tokens = 2147483647 must be in [0, 2^30]"},
      {{{"capacity_factor", "0"}},
       "capacity_factor = 0 must be positive and finite (omit the key for dropless routing)"},
      {{{"capacity_factor", "-1.5"}}, "capacity_factor = -1.5 must be positive and finite"},
      {{{"capacity_factor", ".nan"}}, "capacity_factor = nan must be positive and finite"},
      {{{"capacity_factor", ".inf"}}, "capacity_factor = inf must be finite and >= 0"},
      {{{"capacity_factor", "lots"}}, "capacity_factor = 'lots' is not a valid value"},
      // A typo for 1.0, which would pad every expert to T rows.
      {{{"capacity_factor", "1e9"}}, "capacity_factor = 1000000000 is past 10000"},
      {{{"capacity_factor", "1.25"}, {"drop_policy", "random"}},
       "drop_policy = 'random' is not one of probs, position"},
      {{{"drop_policy", "position"}}, "drop_policy = position needs capacity_factor"},
      {{{"drop_policy", "probs"}}, "drop_policy = probs needs capacity_factor"},
      // The validation's errors name the file too.
      {{{"pad_to_capacity", "true"}},
       "test.yaml: invalid MoEConfig: pad_to_capacity = true needs capacity_factor"},
      {{{"shared_gate", "true"}}, "shared_gate = true needs shared_ffn_hidden > 0"},
      {{{"shared_ffn_hidden", "0"}, {"shared_gate", "true"}},
       "shared_gate = true needs shared_ffn_hidden > 0"},
      {{{"shared_ffn_hidden", "-1"}}, "shared_ffn_hidden = -1 must be in [0, 1048576]"},
      {{{"shared_ffn_hidden", "1048577"}}, "shared_ffn_hidden = 1048577 must be in [0, 1048576]"},
      {{{"top_k", "2"}}, "unknown key 'top_k'"},
      {{{"fp8", "true"}, {"align_size", "16"}, {"dtype", "fp32"}},
       "fp8 = true needs dtype = bf16, got fp32"},
      {{{"fp8", "true"}}, "fp8 = true needs align_size a multiple of 16, got 0"},
      {{{"fp8", "true"}, {"align_size", "8"}},
       "fp8 = true needs align_size a multiple of 16, got 8"},
      {{{"fp8", "true"}, {"align_size", "16"}, {"hidden", "72"}},
       "fp8 = true needs hidden and ffn_hidden multiples of 16, got 72 and 32"},
      {{{"fp8", "yes please"}}, "fp8"},
      {{{"fp8_dispatch", "true"}}, "fp8_dispatch = true needs fp8 = true"},
      {{{"fp8", "true"}, {"align_size", "16"}, {"num_experts", "1024"}},
       "fp8 = true takes at most 512 experts a rank, got num_experts / ep = 1024 / 1"},
  };
  // Every error names the file it came from, the enum settings' too.
  CHECK_THAT(
      error_of("hidden: 64\nffn_hidden: 32\nnum_experts: 8\ntopk: 2\nscore_function: relu\n"),
      test::contains_text("test.yaml: score_function = 'relu' is not one of"));
  // A second YAML document is refused, not dropped.
  CHECK_THAT(error_of("hidden: 64\nffn_hidden: 32\nnum_experts: 8\ntopk: 2\n---\nhidden: 32\n"),
             test::contains_text("line 5 starts another YAML document"));
  CHECK(error_of("---\nhidden: 64\nffn_hidden: 32\nnum_experts: 8\ntopk: 2\n") == "(no error)");
  // One document may open with directives and `---` and close with `...`.
  const std::string body = "hidden: 64\nffn_hidden: 32\nnum_experts: 8\ntopk: 2\n";
  CHECK(error_of("%YAML 1.2\n---\n" + body) == "(no error)");
  CHECK(error_of("---\n" + body + "...\n# the end\n\n") == "(no error)");
  CHECK_THAT(error_of(body + "...\nhidden: 32\n"),
             test::contains_text("line 6 starts another YAML document"));
  CHECK_THAT(error_of(body + "...\n---\nhidden: 32\n"),
             test::contains_text("line 6 starts another YAML document"));
  CHECK_THAT(error_of(body + "%YAML 1.2\n"),
             test::contains_text("line 5 starts another YAML document"));
  // Collections nested past yaml-cpp's depth limit: named, where yaml-cpp says only "bad file".
  CHECK_THAT(error_of(body + "extra: " + std::string(2000, '[') + std::string(2000, ']') + "\n"),
             test::contains_text("test.yaml: collections nested") &&
                 test::contains_text("deep at line 5, column") &&
                 test::contains_text("a config is one flat map"));
  // A long value (or unknown key) is quoted by its first 64 bytes, then counted.
  for (const std::string& line :
       {"dtype: " + std::string(100000, 'x'), "expert_bias: " + std::string(100000, 'n'),
        "num_groups: " + std::string(100000, '7'), "score_function: " + std::string(100000, 'y'),
        std::string(500, 'k') + ": 1"}) {
    const std::string error = error_of(body + line + "\n");
    CHECK((error.size() < 250 && error.find("more bytes)") != std::string::npos));
  }
  for (const auto& [overrides, expected] : cases) {
    Overrides fields = {
        {"hidden", "64"}, {"ffn_hidden", "32"}, {"num_experts", "8"}, {"topk", "2"}};
    for (const auto& [key, value] : overrides) fields[key] = value;
    std::string yaml;
    for (const auto& [key, value] : fields) yaml += key + ": " + value + "\n";
    INFO(yaml);
    CHECK_THAT(error_of(yaml), test::contains_text(expected));
  }
  CHECK_THAT(error_of("hidden: 64\nffn_hidden: 32\ntopk: 2\n"),
             test::contains_text("missing required key 'num_experts'"));
  CHECK_THAT(error_of("[1, 2]"), test::contains_text("expected a map"));
  CHECK_THROWS_AS(load_config("/nonexistent/config.yaml"), Error);
}

TEST_CASE("valid grouped and biased settings are accepted", "[cpu][config]") {
  const auto config = parse_config(kBase +
                                   "score_function: sqrtsoftplus\nexpert_bias: true\n"
                                   "num_groups: 4\ngroup_topk: 2\nscaling_factor: 2.5\n"
                                   "ep: 4\ndp: 2\ndtype: fp32\n");
  CHECK(config.grouped_routing());
  CHECK(config.local_experts() == 2);
  CHECK(config.dtype == DType::kFP32);
  CHECK_THAT(config.describe(), test::contains_text("sqrtsoftplus+bias groups=4/top2"));
}

TEST_CASE("the exchange's chunks: automatic four under EP, at most the local experts",
          "[cpu][config]") {
  CHECK(parse_config(kBase).exchange_chunks == 0);
  CHECK(parse_config(kBase).effective_exchange_chunks() == 1);  // one rank: nothing to pipeline
  CHECK(parse_config(kBase + "ep: 2\n").effective_exchange_chunks() == 4);
  CHECK(parse_config(kBase + "ep: 4\n").effective_exchange_chunks() == 2);  // 2 experts a rank
  CHECK(parse_config(kBase + "ep: 8\n").effective_exchange_chunks() == 1);
  CHECK(parse_config(kBase + "ep: 2\nexchange_chunks: 3\n").effective_exchange_chunks() == 3);
  // The copy exchange pipelines as NCCL's does: in four chunks by default, at most the local
  // experts (kBase has 2 a rank at EP 4).
  CHECK(parse_config(kBase + "ep: 2\nep_transport: copy\n").effective_exchange_chunks() == 4);
  CHECK(parse_config(kBase + "ep: 4\nep_transport: copy\n").effective_exchange_chunks() == 2);
  const std::string many_experts = "hidden: 64\nffn_hidden: 32\nnum_experts: 64\ntopk: 2\n";
  CHECK(parse_config(many_experts + "ep: 4\nep_transport: copy\n").effective_exchange_chunks() ==
        4);
  CHECK(parse_config(many_experts + "ep: 8\nep_transport: copy\n").effective_exchange_chunks() ==
        4);
  CHECK(parse_config(kBase + "ep: 2\nep_transport: copy\nexchange_chunks: 3\n")
            .effective_exchange_chunks() == 3);
  CHECK(parse_config(kBase + "ep: 2\nexchange_chunks: 1\n").effective_exchange_chunks() == 1);
  CHECK(parse_config(kBase + "ep: 2\nexchange_chunks: 9\n").effective_exchange_chunks() == 4);
  // The FP8 experts pipeline as the bf16 ones do.
  CHECK(parse_config(kBase + "ep: 2\nfp8: true\nalign_size: 16\n").effective_exchange_chunks() ==
        4);
  CHECK(parse_config(kBase + "ep: 2\nfp8: true\nalign_size: 16\nexchange_chunks: 2\n")
            .effective_exchange_chunks() == 2);
}

TEST_CASE("node-limited routing is group-limited routing with one group per node",
          "[cpu][config]") {
  const auto config = parse_config(kBase +
                                   "score_function: sigmoid\nexpert_bias: true\n"
                                   "max_nodes_per_token: 2\nep_ranks_per_node: 2\nep: 8\n");
  CHECK(config.node_limited_routing());
  CHECK(config.grouped_routing());
  CHECK(config.routing_groups().count == 4);  // 8 EP ranks, 2 to a node
  CHECK(config.routing_groups().topk == 2);
  CHECK(config.num_groups == 0);
  CHECK_THAT(config.describe(), test::contains_text("nodes<=2 (2 ranks/node)"));
  // For one rank running the mesh's batch: the same groups, written out.
  const MoEConfig one = config.for_one_rank();
  CHECK(one.ep == 1);
  CHECK_FALSE(one.node_limited_routing());
  CHECK(one.num_groups == 4);
  CHECK(one.group_topk == 2);
  // No limit while the EP group spans at most max_nodes_per_token nodes: one GPU, one node, or
  // as many nodes as a token may reach. A config file may leave ep to the launcher.
  for (const char* ep : {"1", "2", "4"}) {
    INFO("ep " << ep);
    const auto loose =
        parse_config(kBase + "max_nodes_per_token: 2\nep_ranks_per_node: 2\nep: " + ep + "\n");
    CHECK(loose.node_limited_routing());
    CHECK_FALSE(loose.grouped_routing());
    CHECK(loose.for_one_rank().num_groups == 0);
  }
  const auto grouped = parse_config(kBase + "num_groups: 4\ngroup_topk: 2\n");
  CHECK_FALSE(grouped.node_limited_routing());
  CHECK(grouped.routing_groups().count == 4);
  CHECK(grouped.routing_groups().topk == 2);
}

TEST_CASE("a config with a NUL byte is refused as not text, naming the offset", "[cpu][config]") {
  std::string text = kBase;
  text.insert(text.find("topk"), 1, '\0');
  CHECK_THROWS_WITH(parse_config(text), test::contains_text("holds a NUL byte at offset") &&
                                            test::contains_text("a config is YAML text"));
}

TEST_CASE("a repeated key is an error naming the key, never a silent choice", "[cpu][config]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<std::string> keys = {"hidden",     "ffn_hidden",     "num_experts", "topk",
                                         "align_size", "scaling_factor", "dtype",       "tokens"};
  const std::map<std::string, std::vector<std::string>> values = {
      {"hidden", {"64", "128"}},   {"ffn_hidden", {"32", "48"}}, {"num_experts", {"8", "16"}},
      {"topk", {"2", "1"}},        {"align_size", {"16", "0"}},  {"scaling_factor", {"2.5", "1.0"}},
      {"dtype", {"bf16", "fp32"}}, {"tokens", {"512", "1024"}}};
  for (int round = 0; round < 10; ++round) {
    auto lines = base_lines(rng);
    const auto& key = keys[std::uniform_int_distribution<std::size_t>(0, keys.size() - 1)(rng)];
    const auto& pair = values.at(key);
    // The key twice (with equal or different values, in either order), at random places.
    const bool same = std::bernoulli_distribution(0.5)(rng);
    const bool flip = std::bernoulli_distribution(0.5)(rng);
    for (const auto& value : {pair[flip ? 1 : 0], pair[same ? (flip ? 1 : 0) : (flip ? 0 : 1)]}) {
      const auto where = std::uniform_int_distribution<std::size_t>(0, lines.size())(rng);
      lines.insert(lines.begin() + static_cast<std::ptrdiff_t>(where), key + ": " + value);
    }
    // A required key given twice also appears in base_lines: that is a third line of it.
    INFO(joined(lines));
    CHECK_THAT(error_of(joined(lines)),
               test::contains_text("test.yaml: key '" + key + "' appears more than once (line "));
  }
  // Quoting does not make a key different.
  CHECK_THAT(error_of("hidden: 64\n\"hidden\": 64\nffn_hidden: 32\nnum_experts: 8\ntopk: 2\n"),
             test::contains_text("key 'hidden' appears more than once (line 2)"));
  CHECK_THAT(error_of("[hidden]: 64\nffn_hidden: 32\nnum_experts: 8\ntopk: 2\n"),
             test::contains_text("a key must be a plain name, not a list"));
  CHECK_THAT(error_of("? {hidden: 64}\n: 1\n"),
             test::contains_text("a key must be a plain name, not a map"));
}

TEST_CASE("align_size is bounded: a huge value fails at once, not in an allocation",
          "[cpu][config]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<int> huge = {1000000, 2000000000, INT_MAX, kMaxAlignSize + 1};
  huge.push_back(std::uniform_int_distribution<int>(kMaxAlignSize + 1, INT_MAX)(rng));
  for (const int align : huge) {
    INFO("align_size " << align);
    const auto start = std::chrono::steady_clock::now();
    CHECK_THAT(
        error_of(joined(base_lines(rng)) + "align_size: " + std::to_string(align) + "\n"),
        test::contains_text("align_size = " + std::to_string(align) + " must be in [0, 4096]"));
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(1));
    MoEConfig config = test::small_config(8, 8, 4, 2);
    config.align_size = align;  // a config built in code, never validated
    CHECK_THROWS_WITH(config.padded_rows(1), test::contains_text("must be in [0, 4096]"));
  }
  // Within the bound: 64-bit rounding, and overflow is an error.
  MoEConfig config = test::small_config(8, 8, 4, 2);
  for (int round = 0; round < 100; ++round) {
    config.align_size = std::uniform_int_distribution<int>(0, kMaxAlignSize)(rng);
    const std::int64_t count = std::uniform_int_distribution<std::int64_t>(0, 1LL << 62)(rng);
    // Counts below 2^62 leave room for the padding in int64: the expected value is exact.
    const std::int64_t a = std::max(config.align_size, 1);
    const std::int64_t want = count % a == 0 ? count : count + (a - count % a);
    INFO("align " << config.align_size << " count " << count);
    CHECK(config.padded_rows(count) == want);
  }
  config.align_size = 16;
  CHECK_THROWS_WITH(config.padded_rows(INT64_MAX - 3), test::contains_text("overflow int64"));
  CHECK_THROWS_WITH(config.padded_rows(-1), test::contains_text("count = -1 must be >= 0"));
  CHECK(config.padded_rows(INT64_MAX - 15) == INT64_MAX - 15);
}

TEST_CASE("load_config reads regular files of bounded size only", "[cpu][config]") {
  const auto dir =
      std::filesystem::temp_directory_path() /
      ("moe_config_" + std::to_string(::getpid()) + "_" + std::to_string(test::fresh_seed()));
  std::filesystem::create_directories(dir);
  CHECK_THAT(load_error(dir), test::contains_text("config file '" + dir.string() +
                                                  "' is a directory; only regular files"));
  const auto fifo = dir / "fifo.yaml";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THAT(load_error(fifo), test::contains_text("is a FIFO"));  // and returns: no hang
  CHECK_THAT(load_error("/dev/zero"), test::contains_text("is a character device"));
  std::ofstream(dir / "big.yaml") << kBase << "# " << std::string(kMaxConfigBytes, 'x') << "\n";
  CHECK_THAT(load_error(dir / "big.yaml"), test::contains_text("more than the limit of 1048576"));
  std::ofstream(dir / "ok.yaml") << kBase;
  CHECK(load_config(dir / "ok.yaml").hidden == 64);
  std::filesystem::remove_all(dir);
}

TEST_CASE("capacity mode and shared experts: keys, defaults, description, capacity",
          "[cpu][config]") {
  const auto plain = parse_config(kBase);
  CHECK(plain.capacity_factor == 0.0);
  CHECK_FALSE(plain.capacity_mode());
  CHECK(plain.drop_policy == DropPolicy::kProbs);
  CHECK_FALSE(plain.pad_to_capacity);
  CHECK(plain.shared_ffn_hidden == 0);
  CHECK_FALSE(plain.shared_experts());
  CHECK_FALSE(plain.shared_gate);
  CHECK(plain.shared_expert_overlap);
  CHECK_THAT(plain.describe(), !test::contains_text("capacity"));
  CHECK_THAT(plain.describe(), !test::contains_text("shared"));
  CHECK(plain.unsupported_by_gpu_layer().empty());

  const auto full = parse_config(kBase +
                                 "capacity_factor: 1.25\ndrop_policy: position\n"
                                 "pad_to_capacity: true\nshared_ffn_hidden: 16\n"
                                 "shared_gate: true\nalign_size: 4\n");
  CHECK(full.capacity_factor == 1.25);
  CHECK(full.drop_policy == DropPolicy::kPosition);
  CHECK(full.pad_to_capacity);
  CHECK(full.shared_ffn_hidden == 16);
  CHECK(full.shared_gate);
  CHECK_THAT(full.describe(), test::contains_text("capacity=1.25(position, padded)"));
  CHECK_THAT(full.describe(), test::contains_text("shared=16(gated)"));
  const auto probs = parse_config(kBase + "capacity_factor: 2\nshared_ffn_hidden: 8\n");
  CHECK(probs.drop_policy == DropPolicy::kProbs);
  CHECK_THAT(probs.describe(), test::contains_text("capacity=2(probs)"));
  CHECK_THAT(probs.describe(), test::contains_text("shared=8 "));
  const auto series = parse_config(kBase + "shared_ffn_hidden: 8\nshared_expert_overlap: false\n");
  CHECK_FALSE(series.shared_expert_overlap);
  CHECK_THAT(series.describe(), test::contains_text("shared=8(in series) "));

  // The GPU layer's refusal names the setting and its value; it runs every capacity setting,
  // pad_to_capacity under EP included, but fixed blocks over the peer exchange.
  CHECK(full.unsupported_by_gpu_layer().empty());
  MoEConfig under_ep = full;
  under_ep.ep = 2;
  CHECK(under_ep.unsupported_by_gpu_layer().empty());
  CHECK(parse_config(kBase + "capacity_factor: 1.25\n").unsupported_by_gpu_layer().empty());
  MoEConfig widest = parse_config(kBase + "capacity_factor: 1.25\n");
  widest.num_experts = kMaxExperts;
  CHECK(widest.unsupported_by_gpu_layer().empty());  // dropped slots take no layout group
  CHECK(parse_config(kBase + "capacity_factor: 1.25\nep: 2\n").unsupported_by_gpu_layer().empty());
  CHECK(parse_config(kBase + "capacity_factor: 1.25\nep: 2\nep_transport: peer\n")
            .unsupported_by_gpu_layer()
            .empty());
  CHECK(
      parse_config(kBase + "capacity_factor: 1.25\npad_to_capacity: true\nep: 2\n"
                           "ep_transport: peer\n")
          .unsupported_by_gpu_layer() ==
      "pad_to_capacity with ep_transport = peer: fixed blocks run over the NCCL exchange (auto or "
      "nccl), for now");
  CHECK_THAT(parse_config(kBase + "capacity_factor: 1.25\npad_to_capacity: true\nep: 2\n"
                                  "ep_transport: copy\n")
                 .unsupported_by_gpu_layer(),
             test::contains_text("pad_to_capacity with ep_transport = copy"));
  const std::string fp8_dispatch = "fp8: true\nfp8_dispatch: true\nalign_size: 16\nep: 2\n";
  CHECK(parse_config(kBase + fp8_dispatch).unsupported_by_gpu_layer().empty());
  CHECK(parse_config(kBase + fp8_dispatch + "ep_transport: nccl\n")
            .unsupported_by_gpu_layer()
            .empty());
  CHECK(parse_config(kBase + fp8_dispatch + "ep_transport: peer\n").unsupported_by_gpu_layer() ==
        "fp8_dispatch with ep_transport = peer: E4M3 rows and their scales cross over the NCCL "
        "exchange (auto or nccl), for now");
  CHECK_THAT(parse_config(kBase + fp8_dispatch + "ep_transport: copy\n").unsupported_by_gpu_layer(),
             test::contains_text("fp8_dispatch with ep_transport = copy"));
  CHECK(parse_config(kBase + "shared_ffn_hidden: 8\nshared_gate: true\n")
            .unsupported_by_gpu_layer()
            .empty());

  // C = ceil(capacity_factor · T · K / E), then aligned: E = 8, K = 2 here.
  MoEConfig config = parse_config(kBase + "capacity_factor: 1.25\n");
  CHECK(config.expert_capacity(10) == 4);  // 1.25 · 20 / 8 = 3.125
  CHECK(config.expert_capacity(16) == 5);  // exactly 5
  CHECK(config.expert_capacity(1) == 1);
  CHECK(config.expert_capacity(0) == 0);
  config.align_size = 4;
  CHECK(config.expert_capacity(10) == 4);
  CHECK(config.expert_capacity(16) == 8);
  CHECK(config.expert_capacity(0) == 0);
  CHECK_THROWS_WITH(config.expert_capacity(-1), test::contains_text("tokens = -1 must be >= 0"));
  // An expert is offered one slot per token at most: C is capped at T, then aligned.
  config.capacity_factor = 1e12;
  CHECK(config.expert_capacity(1000000) == 1000000);
  CHECK(config.expert_capacity(10) == 12);  // 10, aligned to 4
  config.align_size = 0;
  CHECK(config.expert_capacity(7) == 7);
  // Only T itself can pass the row limit now.
  CHECK_THROWS_WITH(config.expert_capacity(std::int64_t{1} << 40),
                    test::contains_text("over 1099511627776 tokens gives a capacity of"));
  CHECK_THROWS_WITH(plain.expert_capacity(10),
                    test::contains_text("capacity_factor = 0 is not a capacity"));

  // A config built in code: 0 is dropless, and the companions are checked there too.
  MoEConfig built = test::small_config(8, 8, 4, 2);
  built.drop_policy = DropPolicy::kPosition;
  CHECK_THROWS_WITH(built.validate(),
                    test::contains_text("drop_policy = position needs capacity_factor"));
  built.capacity_factor = std::nan("");
  CHECK_THROWS_WITH(built.validate(),
                    test::contains_text("capacity_factor = nan must be finite and >= 0"));
  built.capacity_factor = 0.5;
  CHECK_NOTHROW(built.validate());
}

TEST_CASE("the capacity and shared-expert keys may not repeat either", "[cpu][config]") {
  const std::vector<std::pair<std::string, std::string>> keys = {{"capacity_factor", "1.0"},
                                                                 {"drop_policy", "probs"},
                                                                 {"pad_to_capacity", "false"},
                                                                 {"shared_ffn_hidden", "16"},
                                                                 {"shared_gate", "true"}};
  std::string settings;
  for (const auto& [key, value] : keys) settings += key + ": " + value + "\n";
  CHECK_NOTHROW(parse_config(kBase + settings));
  for (const auto& [key, value] : keys) {
    INFO(key);
    CHECK_THAT(error_of(kBase + settings + key + ": " + value + "\n"),
               test::contains_text("key '" + key + "' appears more than once"));
  }
}
