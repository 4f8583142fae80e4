#include <map>
#include <string>
#include <utility>
#include <vector>

#include "moe/config.h"
#include "moe/error.h"
#include "support/catch.h"

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

}  // namespace

TEST_CASE("the shipped configs load and validate", "[cpu][config]") {
  for (const char* name : {"small", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"}) {
    INFO(name);
    const auto config = load_config(std::string(MOE_SOURCE_DIR) + "/configs/" + name + ".yaml");
    CHECK(config.bench_tokens > 0);
    CHECK(config.dtype == DType::kBF16);
  }
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
  CHECK_FALSE(config.grouped_routing());  // SPEC.md pitfall 6: off must be the default
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
  CHECK(config.ep_transport == EpTransport::kAuto);
  CHECK(parse_config(kBase + "ep_transport: nccl\n").ep_transport == EpTransport::kNccl);
  CHECK(parse_config(kBase + "ep_transport: peer\n").ep_transport == EpTransport::kPeer);
  CHECK(config.activation_chunk_mib == 64.0);
  CHECK(parse_config(kBase + "activation_chunk_mib: 0.5\n").activation_chunk_mib == 0.5);
  CHECK(config.gemm_workspace_mib == 4);
  CHECK(parse_config(kBase + "gemm_workspace_mib: 4\n").gemm_workspace_mib == 4);
  MoEConfig bad = config;
  bad.ep_transport = static_cast<EpTransport>(7);
  CHECK_THROWS_WITH(bad.validate(),
                    test::contains_text("ep_transport = 7 must be auto, nccl or peer"));
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
      {{{"expert_bias", "true"}},
       "expert_bias = true needs score_function = sigmoid or sqrtsoftplus"},
      {{{"score_function", "sigmoid"}, {"pre_softmax", "true"}},
       "pre_softmax = true needs score_function = softmax, not sigmoid"},
      {{{"scaling_factor", "0"}}, "scaling_factor = 0 must be positive"},
      {{{"aux_loss_coeff", "-0.1"}}, "aux_loss_coeff = -0.1 must be >= 0"},
      {{{"z_loss_coeff", "-1"}}, "z_loss_coeff = -1 must be >= 0"},
      {{{"align_size", "-8"}}, "align_size = -8 must be >= 0"},
      {{{"activation_chunk_mib", "-1"}}, "activation_chunk_mib = -1 must be in [0, 1048576]"},
      {{{"activation_chunk_mib", ".nan"}}, "activation_chunk_mib = nan must be in [0, 1048576]"},
      {{{"activation_chunk_mib", "1e30"}}, "activation_chunk_mib = 1e+30 must be in [0, 1048576]"},
      {{{"gemm_workspace_mib", "-4"}}, "gemm_workspace_mib = -4 must be in [0, 4096]"},
      {{{"gemm_workspace_mib", "8192"}}, "gemm_workspace_mib = 8192 must be in [0, 4096]"},
      {{{"ep", "3"}}, "ep = 3 must divide num_experts = 8"},
      {{{"ep", "0"}}, "ep = 0 must be >= 1"},
      {{{"dp", "0"}}, "dp = 0 must be >= 1"},
      {{{"dtype", "int32"}}, "dtype = int32 must be bf16 or fp32"},
      {{{"dtype", "fp16"}}, "dtype = 'fp16' is not a dtype"},
      {{{"grad_dtype", "int32"}}, "grad_dtype = int32 must be bf16 or fp32"},
      {{{"score_function", "relu"}}, "score_function = 'relu' is not one of"},
      {{{"ep_transport", "ipc"}}, "ep_transport = 'ipc' is not one of auto, nccl, peer"},
      {{{"topk", "two"}}, "topk = 'two' is not a valid value"},
      {{{"top_k", "2"}}, "unknown key 'top_k'"},
  };
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
