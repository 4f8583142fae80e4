// moe_run's tensor files, end to end on the CPU: files written here, `moe_run --reference` run on
// them, its results file equal to the fp64 reference computed directly; bad files rejected.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "io/layer_files.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;

namespace {

// Values stored as F32 exactly, so the files and the direct computation see the same numbers.
void add(TensorFile& file, const std::string& name, std::vector<std::int64_t> shape,
         const std::vector<double>& values) {
  const std::vector<float> f(values.begin(), values.end());
  file.add(name, FileDType::kF32, std::move(shape), f.data());
}

struct Files {
  TensorFile weights, inputs;
};

Files make_files(const MoEConfig& c, const reference::Params& p, const Matrix& x,
                 const Matrix& dy) {
  return {layer_weights_file(c, p), layer_inputs_file(x, dy)};
}

reference::Params float_params(reference::Params p) {
  for (auto* m : {&p.gate_weight}) {
    for (auto& v : m->data) v = static_cast<float>(v);
  }
  for (auto& m : p.experts.w13) {
    for (auto& v : m.data) v = static_cast<float>(v);
  }
  for (auto& m : p.experts.w2) {
    for (auto& v : m.data) v = static_cast<float>(v);
  }
  for (auto& v : p.expert_bias) v = static_cast<float>(v);
  return p;
}

}  // namespace

TEST_CASE("moe_run --reference writes the fp64 reference's results", "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = test::small_config(12, 8, 8, 2);
  c.score_function = ScoreFunction::kSigmoid;
  c.expert_bias = true;
  c.num_groups = 4;
  c.group_topk = 2;
  c.aux_loss_coeff = 0.1;
  c.z_loss_coeff = 0.01;
  c.align_size = 4;
  c.validate();
  const auto params = float_params(test::random_params(c, rng));
  const Matrix x = test::round_to(test::random_matrix(9, c.hidden, rng), DType::kFP32);
  const Matrix dy = test::round_to(test::random_matrix(9, c.hidden, rng), DType::kFP32);
  const auto files = make_files(c, params, x, dy);

  const auto dir = std::filesystem::temp_directory_path() / ("moe_run_" + std::to_string(seed));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.yaml")
      << "hidden: 12\nffn_hidden: 8\nnum_experts: 8\ntopk: 2\nscore_function: sigmoid\n"
         "expert_bias: true\nnum_groups: 4\ngroup_topk: 2\naux_loss_coeff: 0.1\n"
         "z_loss_coeff: 0.01\nalign_size: 4\ndtype: fp32\n";
  files.weights.write(dir / "weights.safetensors");
  files.inputs.write(dir / "inputs.safetensors");
  const std::string command =
      std::string(MOE_RUN_PATH) + " --reference --config " + (dir / "config.yaml").string() +
      " --weights " + (dir / "weights.safetensors").string() + " --inputs " +
      (dir / "inputs.safetensors").string() + " --out " + (dir / "out.safetensors").string();
  REQUIRE(std::system(command.c_str()) == 0);
  const auto results = TensorFile::read(dir / "out.safetensors");

  const auto want = reference::run_layer(c, params, x, dy);
  const auto expected = layer_results_file(c, want);
  for (const auto& [name, tensor] : expected.tensors()) {
    INFO("tensor " << name);
    const auto& got = results.get(name);
    CHECK(got.shape == tensor.shape);
    CHECK(got.data == tensor.data);  // the same computation: bit for bit
  }
  // And the file's values are the reference's (out and one gradient in fp32).
  CHECK(test::relative_error(file_values(results.get("out")), want.out.data) <= 1e-6);
  CHECK(test::relative_error(file_values(results.get("grad.gate_weight")),
                             want.d_gate_weight.data) <= 1e-6);

  // A broken file: moe_run says so and fails.
  TensorFile broken = files.inputs;
  add(broken, "dy", {9, 5}, std::vector<double>(45, 0.0));
  broken.write(dir / "broken.safetensors");
  const std::string bad = std::string(MOE_RUN_PATH) + " --reference --config " +
                          (dir / "config.yaml").string() + " --weights " +
                          (dir / "weights.safetensors").string() + " --inputs " +
                          (dir / "broken.safetensors").string() + " --out " +
                          (dir / "never.safetensors").string() + " 2>/dev/null";
  CHECK(std::system(bad.c_str()) != 0);
  CHECK_FALSE(std::filesystem::exists(dir / "never.safetensors"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("layer files: every tensor checked by name, dtype and shape", "[cpu][moe_run]") {
  std::mt19937_64 rng(7);
  MoEConfig c = test::small_config(6, 4, 4, 2);
  const auto params = test::random_params(c, rng);
  const Matrix x = test::random_matrix(3, 6, rng), dy = test::random_matrix(3, 6, rng);
  auto files = make_files(c, params, x, dy);
  CHECK_NOTHROW(read_layer_inputs(c, files.weights, files.inputs));

  auto wrong = files.weights;
  add(wrong, "w2", {4, 4, 6}, std::vector<double>(96, 0.0));
  CHECK_THROWS_WITH(read_layer_inputs(c, wrong, files.inputs),
                    test::contains_text("tensor 'w2' has shape [4, 4, 6]; expected [4, 6, 4]"));
  TensorFile missing;
  add(missing, "x", {3, 6}, x.data);
  CHECK_THROWS_WITH(read_layer_inputs(c, files.weights, missing),
                    test::contains_text("no tensor named 'dy'"));
  auto split = files.inputs;
  const std::int64_t counts[2] = {1, 1};
  split.add("tokens_per_rank", FileDType::kI64, {2}, counts);
  CHECK_THROWS_WITH(read_layer_inputs(c, files.weights, split),
                    test::contains_text("sums to 2 but x has 3 tokens"));
  auto ints = files.weights;
  const std::vector<std::int32_t> zeros(24, 0);
  ints.add("gate_weight", FileDType::kI32, {4, 6}, zeros.data());
  CHECK_THROWS_WITH(read_layer_inputs(c, ints, files.inputs),
                    test::contains_text("'gate_weight' is I32; expected BF16 or F32"));
}
