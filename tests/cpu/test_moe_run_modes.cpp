// moe_run --reference on the CPU with the layer's modes: node-limited routing as the config's
// mesh routes, capacity mode, shared experts and routing replay round trips, the tokens split and
// the tensors each mode reads, and what of a mesh the reference leaves aside.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "io/layer_files.h"
#include "support/catch.h"
#include "support/moe_run_dir.h"
#include "support/tensor_files.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;
using test::add;
using test::file_bytes;
using test::layer_error;
using test::make_files;
using test::RunDir;

TEST_CASE("moe_run --reference routes node-limited as the config's mesh, and asks for its ep",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::string error;
  {  // No ep in the file: the nodes are unknown.
    const RunDir d(rng, "max_nodes_per_token: 1\nep_ranks_per_node: 1\n");
    CHECK(d.run(d.path("inputs.safetensors"), d.path("out.safetensors"), &error) == 1);
    CHECK_THAT(error,
               test::contains_text("max_nodes_per_token = 1 depends on the mesh: set `ep:`"));
  }
  {  // ep 2, a rank to a node: every token's two experts on one rank's pair, {0, 1} or {2, 3}.
    const RunDir d(rng, "max_nodes_per_token: 1\nep_ranks_per_node: 1\nep: 2\n");
    REQUIRE(d.run(d.path("inputs.safetensors"), d.path("out.safetensors"), &error) == 0);
    const auto results = TensorFile::read(d.dir / "out.safetensors");
    const auto& idx = results.get("topk_idx");
    std::vector<std::int32_t> experts(idx.data.size() / 4);
    std::memcpy(experts.data(), idx.data.data(), idx.data.size());
    for (std::size_t t = 0; t + 1 < experts.size(); t += 2) {
      INFO("token " << t / 2);
      CHECK(experts[t] / 2 == experts[t + 1] / 2);
    }
  }
}

TEST_CASE("layer files: tokens_per_rank counts are checked, their sum for overflow",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = test::small_config(6, 4, 4, 2);
  const auto params = test::random_params(c, rng);
  const Matrix x = test::random_matrix(3, 6, rng), dy = test::random_matrix(3, 6, rng);
  const auto files = make_files(c, params, x, dy);
  const auto with_split = [&](FileDType dtype, std::vector<std::int64_t> shape, const void* data) {
    auto inputs = files.inputs;
    inputs.add("tokens_per_rank", dtype, std::move(shape), data);
    return layer_error(c, files.weights, inputs);
  };
  // Two counts whose sum passes INT64_MAX, each valid alone.
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  const std::int64_t a = std::uniform_int_distribution<std::int64_t>(max / 2, max)(rng);
  const std::int64_t b = std::uniform_int_distribution<std::int64_t>(max - a + 1, max)(rng);
  const std::int64_t overflow[3] = {1, a, b};
  CHECK_THAT(with_split(FileDType::kI64, {3}, overflow),
             test::contains_text("tensor 'tokens_per_rank' sums past int64 at [2] (count " +
                                 std::to_string(b) + ")"));
  const std::int64_t negative_count = -std::uniform_int_distribution<std::int64_t>(1, max)(rng);
  const std::int64_t negative[2] = {3, negative_count};
  CHECK_THAT(with_split(FileDType::kI64, {2}, negative),
             test::contains_text("tensor 'tokens_per_rank' holds a negative count " +
                                 std::to_string(negative_count) + " at [1]"));
  CHECK_THAT(with_split(FileDType::kI64, {0}, nullptr),
             test::contains_text("tensor 'tokens_per_rank' has no entries"));
  const std::int32_t ints[2] = {1, 2};
  CHECK_THAT(with_split(FileDType::kI32, {2}, ints),
             test::contains_text("tensor 'tokens_per_rank' is I32[2]; expected I64 [world]"));
  const std::int64_t good[2] = {1, 2};
  CHECK_THAT(with_split(FileDType::kI64, {1, 2}, good),
             test::contains_text("tensor 'tokens_per_rank' is I64[1, 2]"));
  CHECK_THAT(with_split(FileDType::kI64, {2}, good), test::contains_text("(no error)"));
}

TEST_CASE("layer files: a tensor the layer does not read is an error naming it", "[cpu][moe_run]") {
  std::mt19937_64 rng(test::fresh_seed());
  MoEConfig c = test::small_config(6, 4, 4, 2);
  const auto params = test::random_params(c, rng);
  const Matrix x = test::random_matrix(3, 6, rng), dy = test::random_matrix(3, 6, rng);
  const auto files = make_files(c, params, x, dy);
  auto weights = files.weights;
  add(weights, "w1", {4, 4, 6}, std::vector<double>(96, 0.0));
  CHECK_THAT(layer_error(c, weights, files.inputs),
             test::contains_text("tensor 'w1' is not one of the weights tensors the layer reads"));
  auto biased = files.weights;
  add(biased, "expert_bias", {4}, {0.1, 0.2, 0.3, 0.4});
  CHECK_THAT(layer_error(c, biased, files.inputs),
             test::contains_text("tensor 'expert_bias' is given but the config has expert_bias: "
                                 "false"));
  MoEConfig with_bias = c;  // the opposite: the config reads a tensor the file lacks
  with_bias.expert_bias = true;
  CHECK_THAT(layer_error(with_bias, files.weights, files.inputs),
             test::contains_text("no tensor named 'expert_bias', which the config's expert_bias: "
                                 "true reads"));
  auto inputs = files.inputs;
  add(inputs, "labels", {3}, {0, 1, 2});
  CHECK_THAT(layer_error(c, files.weights, inputs),
             test::contains_text("tensor 'labels' is not one of the inputs tensors"));
}

TEST_CASE("moe_run --reference: capacity mode, shared experts and routing replay round trip",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const std::string yaml =
      "hidden: 6\nffn_hidden: 4\nnum_experts: 4\ntopk: 2\ndtype: fp32\nalign_size: 2\n"
      "capacity_factor: 0.5\ndrop_policy: position\npad_to_capacity: true\n"
      "shared_ffn_hidden: 3\nshared_gate: true\naux_loss_coeff: 0.1\n";
  const MoEConfig c = parse_config(yaml);
  const auto params = test::round_params(test::random_params(c, rng), DType::kFP32);
  const Matrix x = test::round_to(test::random_matrix(9, 6, rng), DType::kFP32);
  const Matrix dy = test::round_to(test::random_matrix(9, 6, rng), DType::kFP32);
  // A routing to replay that the router would not choose: token t -> (t mod 4, (t + 1) mod 4).
  std::vector<int> given;
  for (int t = 0; t < 9; ++t) given.insert(given.end(), {t % 4, (t + 1) % 4});

  const RunDir d(rng);
  std::ofstream(d.dir / "config.yaml") << yaml;
  layer_weights_file(c, params).write(d.dir / "weights.safetensors");
  layer_inputs_file(x, dy, given, 2).write(d.dir / "replay.safetensors");
  std::string error;
  REQUIRE(d.run(d.path("replay.safetensors"), d.path("out.safetensors"), &error) == 0);
  const auto results = TensorFile::read(d.dir / "out.safetensors");

  reference::LayerOptions options;
  options.replay_experts = given;
  const auto want = reference::run_layer(c, params, x, dy, options);
  REQUIRE(std::count(want.kept.begin(), want.kept.end(), 0) > 0);
  const auto expected = layer_results_file(c, want);
  for (const char* name : {"kept", "dropped_per_expert", "grad.shared_w13", "grad.shared_w2",
                           "grad.shared_gate_weight", "topk_idx"}) {
    CHECK(expected.contains(name));
  }
  CHECK(results.tensors().size() == expected.tensors().size());
  for (const auto& [name, tensor] : expected.tensors()) {
    INFO("tensor " << name);
    const auto& got = results.get(name);
    CHECK(got.shape == tensor.shape);
    CHECK(got.data == tensor.data);
  }
  CHECK(results.get("kept").shape == std::vector<std::int64_t>{9, 2});
  std::vector<std::int32_t> idx(18);
  std::memcpy(idx.data(), results.get("topk_idx").data.data(), 18 * 4);
  CHECK(std::vector<int>(idx.begin(), idx.end()) == given);

  // Without --reference the GPU layer runs it too, pad_to_capacity included (without a GPU,
  // moe_run stops at finding none).
  const std::string gpu = std::string(MOE_RUN_PATH) + " --config " + d.path("config.yaml") +
                          " --weights " + d.path("weights.safetensors") + " --inputs " +
                          d.path("replay.safetensors") + " --out " + d.path("gpu.safetensors") +
                          " 2>" + d.path("gpu.txt");
  {
    const int padded = WEXITSTATUS(std::system(gpu.c_str()));
    const std::string padded_error = file_bytes(d.dir / "gpu.txt");
    INFO(padded_error);
    CHECK((padded == 0 || padded_error.find("no CUDA GPU on this machine") != std::string::npos));
    CHECK(padded_error.find("pad_to_capacity") == std::string::npos);
    std::filesystem::remove(d.dir / "gpu.safetensors");
  }
  // Dropless, a replay is the GPU layer's to run: not refused (without a GPU, moe_run stops at
  // finding none; with one, it runs).
  std::ofstream(d.dir / "config.yaml") << "hidden: 6\nffn_hidden: 4\nnum_experts: 4\ntopk: 2\n"
                                       << "dtype: fp32\n";
  d.files.weights.write(d.dir / "weights.safetensors");
  const int replayed = WEXITSTATUS(std::system(gpu.c_str()));
  const std::string replay_error = file_bytes(d.dir / "gpu.txt");
  INFO(replay_error);
  CHECK((replayed == 0 || replay_error.find("no CUDA GPU on this machine") != std::string::npos));
  CHECK(replay_error.find("replay") == std::string::npos);
  std::filesystem::remove(d.dir / "gpu.safetensors");

  // Dropless: every slot kept, nothing dropped, no shared gradients.
  REQUIRE(d.run(d.path("inputs.safetensors"), d.path("plain.safetensors"), &error) == 0);
  const auto plain = TensorFile::read(d.dir / "plain.safetensors");
  std::vector<std::int32_t> kept(10), dropped(4);
  std::memcpy(kept.data(), plain.get("kept").data.data(), 40);
  std::memcpy(dropped.data(), plain.get("dropped_per_expert").data.data(), 16);
  CHECK(kept == std::vector<std::int32_t>(10, 1));
  CHECK(dropped == std::vector<std::int32_t>(4, 0));
  CHECK_FALSE(plain.contains("grad.shared_w13"));
  CHECK_FALSE(plain.contains("grad.shared_gate_weight"));
}

TEST_CASE("layer files: shared weights and topk_idx are read only where the config reads them",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig shared = test::small_config(6, 4, 4, 2);
  shared.shared_ffn_hidden = 3;
  shared.shared_gate = true;
  const auto params =
      test::round_params(test::random_params(shared, rng), DType::kFP32);  // exact in the F32 file
  const Matrix x = test::random_matrix(3, 6, rng), dy = test::random_matrix(3, 6, rng);
  const TensorFile weights = layer_weights_file(shared, params);
  const TensorFile inputs = layer_inputs_file(x, dy);
  const LayerInputs in = read_layer_inputs(shared, weights, inputs);
  CHECK(in.params.shared.w13.data == params.shared.w13.data);
  CHECK(in.params.shared.w2.data == params.shared.w2.data);
  CHECK(in.params.shared.gate_weight.data == params.shared.gate_weight.data);
  CHECK_FALSE(in.replay_experts.has_value());
  CHECK(weights.get("shared_w13").shape == std::vector<std::int64_t>{6, 6});
  CHECK(weights.get("shared_w2").shape == std::vector<std::int64_t>{6, 3});
  CHECK(weights.get("shared_gate_weight").shape == std::vector<std::int64_t>{1, 6});

  // Stray shared tensors.
  MoEConfig ungated = shared;
  ungated.shared_gate = false;
  CHECK_THAT(layer_error(ungated, weights, inputs),
             test::contains_text("tensor 'shared_gate_weight' is given but the config has "
                                 "shared_gate: false"));
  MoEConfig none = ungated;
  none.shared_ffn_hidden = 0;
  CHECK_THAT(layer_error(none, weights, inputs),
             test::contains_text("tensor 'shared_w13' is given but the config has "
                                 "shared_ffn_hidden: 0"));
  // Missing or misshapen ones.
  TensorFile missing = layer_weights_file(none, params);
  add(missing, "shared_w13", {6, 6}, params.shared.w13.data);
  CHECK_THAT(layer_error(ungated, missing, inputs),
             test::contains_text("no tensor named 'shared_w2', which the config's "
                                 "shared_ffn_hidden: 3 reads"));
  TensorFile misshapen = weights;
  add(misshapen, "shared_w2", {3, 6}, params.shared.w2.data);
  CHECK_THAT(layer_error(shared, misshapen, inputs),
             test::contains_text("tensor 'shared_w2' has shape [3, 6]; expected [6, 3]"));

  // topk_idx: read as given, checked for dtype, shape and values.
  const std::vector<int> given = {0, 1, 2, 3, 3, 0};
  const LayerInputs replay = read_layer_inputs(shared, weights, layer_inputs_file(x, dy, given, 2));
  REQUIRE(replay.replay_experts.has_value());
  CHECK(*replay.replay_experts == given);
  const auto idx_error = [&](FileDType dtype, std::vector<std::int64_t> shape,
                             std::vector<std::int32_t> values) {
    TensorFile file = inputs;
    file.add("topk_idx", dtype, std::move(shape), values.data());
    return layer_error(shared, weights, file);
  };
  CHECK_THAT(idx_error(FileDType::kI32, {3, 2}, {0, 1, 2, 9, 3, 0}),
             test::contains_text("tensor 'topk_idx': token 1, slot 1: expert 9 is outside [0, 4)"));
  CHECK_THAT(idx_error(FileDType::kI32, {3, 2}, {0, 1, 2, 3, 3, 3}),
             test::contains_text("tensor 'topk_idx': token 2, slot 1: expert 3 is already in "
                                 "slot 0"));
  CHECK_THAT(idx_error(FileDType::kI32, {2, 3}, {0, 1, 2, 3, 3, 0}),
             test::contains_text("tensor 'topk_idx' is I32[2, 3]; expected I32 [3, 2]"));
  CHECK_THAT(idx_error(FileDType::kF32, {3, 2}, {0, 1, 2, 3, 3, 0}),
             test::contains_text("tensor 'topk_idx' is F32[3, 2]; expected I32 [3, 2]"));
}

TEST_CASE("moe_run --reference says what of a mesh it leaves aside, and that it computed exactly",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::string error;
  const RunDir plain(rng);
  REQUIRE(plain.run(plain.path("inputs.safetensors"), plain.path("out.safetensors"), &error) == 0);
  CHECK(error.find("note") == std::string::npos);
  const auto results = TensorFileReader(plain.dir / "out.safetensors");
  REQUIRE(results.metadata().count("computed_by") == 1);
  CHECK(results.metadata().at("computed_by").find("fp64 reference") != std::string::npos);

  // A mesh in the config, in capacity mode: the run goes on, and says that C comes from the batch.
  const RunDir mesh(rng, "ep: 2\ncapacity_factor: 1.0\n");
  REQUIRE(mesh.run(mesh.path("inputs.safetensors"), mesh.path("out.safetensors"), &error) == 0);
  CHECK_THAT(error, test::contains_text("the config's mesh (ep = 2, dp = 1) has no effect"));
  CHECK_THAT(error, test::contains_text("capacity comes from all the batch's tokens"));

  // A tokens split in the inputs: the same, without capacity mode.
  const RunDir split(rng);
  auto inputs = split.files.inputs;
  const std::int64_t counts[2] = {2, 3};
  inputs.add("tokens_per_rank", FileDType::kI64, {2}, counts);
  inputs.write(split.dir / "split.safetensors");
  REQUIRE(split.run(split.path("split.safetensors"), split.path("out.safetensors"), &error) == 0);
  CHECK_THAT(error, test::contains_text("the inputs' tokens_per_rank has no effect"));
  CHECK(error.find("capacity") == std::string::npos);

  // A malformed split: its error, and no note calling the tensor ineffective before it.
  auto bad_inputs = split.files.inputs;
  const std::int64_t negative[2] = {7, -2};
  bad_inputs.add("tokens_per_rank", FileDType::kI64, {2}, negative);
  bad_inputs.write(split.dir / "bad_split.safetensors");
  CHECK(split.run(split.path("bad_split.safetensors"), split.path("bad.safetensors"), &error) != 0);
  CHECK_THAT(error,
             test::contains_text("tensor 'tokens_per_rank' holds a negative count -2 at [1]"));
  CHECK(error.find("no effect") == std::string::npos);
}

TEST_CASE("moe_run on the GPUs checks the mesh's share of the batch before looking for one",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::string error;
  // Run alone, as one rank: where this machine has a GPU the runs go on, and only the notes and
  // refusals are checked.
  const RunDir mesh(rng, "ep: 2\n");
  mesh.run(mesh.path("inputs.safetensors"), mesh.path("out.safetensors"), &error, "--gpus");
  CHECK_THAT(error, test::contains_text("the config's mesh (ep = 2, dp = 1) gives way to the mesh "
                                        "of the ranks started and --ep / --dp: EP 1, DP 1"));

  const RunDir split(rng);
  auto inputs = split.files.inputs;
  const std::int64_t counts[2] = {2, 3};
  inputs.add("tokens_per_rank", FileDType::kI64, {2}, counts);
  inputs.write(split.dir / "split.safetensors");
  // Refused once MPI has started (the ranks are known there): under the sanitizers MPI's own
  // allocations may then change the exit status, so only its failure and message are checked.
  CHECK(split.run(split.path("split.safetensors"), split.path("out.safetensors"), &error,
                  "--gpus") != 0);
  CHECK_THAT(error, test::contains_text("tensor 'tokens_per_rank' has 2 entries for 1 ranks"));
}
