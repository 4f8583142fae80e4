// moe_run --record-routing and --replay-routing on the CPU (--reference): a step's routing written
// to a file of its own, read back as the routing to replay, from that file or from a results
// file; replaying a step's own routing reproduces the step bit for bit; and each way of getting
// the files wrong refused by name before anything runs.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "io/layer_files.h"
#include "support/catch.h"
#include "support/moe_run_dir.h"
#include "support/test_util.h"

using namespace moe;
using test::RunDir;

namespace {

std::vector<std::int32_t> topk_idx_of(const TensorFile& file) {
  const FileTensor& t = file.get("topk_idx");
  std::vector<std::int32_t> idx(t.data.size() / 4);
  std::memcpy(idx.data(), t.data.data(), t.data.size());
  return idx;
}

// Every tensor of `got` equal to `want`'s, bit for bit, and no other.
void check_same_results(const TensorFile& got, const TensorFile& want) {
  CHECK(got.tensors().size() == want.tensors().size());
  for (const auto& [name, tensor] : want.tensors()) {
    INFO("tensor " << name);
    REQUIRE(got.contains(name));
    CHECK(got.get(name).shape == tensor.shape);
    CHECK(got.get(name).data == tensor.data);
  }
}

}  // namespace

TEST_CASE("moe_run records a step's routing and replays it from that file or a results file",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  // Capacity mode by probability: the drops follow the routing, so a replay must give them too.
  const RunDir d(rng, "capacity_factor: 0.5\naux_loss_coeff: 0.1\n");
  std::string error;

  // Recorded: topk_idx [T, K] alone, the results' own.
  REQUIRE(d.run(d.path("inputs.safetensors"), d.path("step.safetensors"), &error,
                "--record-routing " + d.path("routing.safetensors")) == 0);
  const auto step = TensorFile::read(d.dir / "step.safetensors");
  const auto recorded = TensorFile::read(d.dir / "routing.safetensors");
  REQUIRE(recorded.tensors().size() == 1);
  CHECK(recorded.get("topk_idx").dtype == FileDType::kI32);
  CHECK(recorded.get("topk_idx").shape == std::vector<std::int64_t>{5, 2});
  CHECK(topk_idx_of(recorded) == topk_idx_of(step));
  CHECK(recorded.metadata.at("config") == load_config(d.path("config.yaml")).describe());

  // Replayed from the recorded file, and from the results file itself: the step again, bit for
  // bit (outputs, gradients, losses, drops).
  for (const char* source : {"routing.safetensors", "step.safetensors"}) {
    INFO("replaying " << source);
    REQUIRE(d.run(d.path("inputs.safetensors"), d.path("again.safetensors"), &error,
                  "--replay-routing " + d.path(source)) == 0);
    check_same_results(TensorFile::read(d.dir / "again.safetensors"), step);
  }

  // A routing the router would not choose (token t to t mod 4 and (t + 1) mod 4), given in a
  // routing file: the same results as with it in the inputs file.
  std::vector<std::int32_t> given;
  for (int t = 0; t < 5; ++t) given.insert(given.end(), {t % 4, (t + 1) % 4});
  routing_file(d.config, given).write(d.dir / "given.safetensors");
  auto inputs_with_routing = d.files.inputs;
  inputs_with_routing.add("topk_idx", FileDType::kI32, {5, 2}, given.data());
  inputs_with_routing.write(d.dir / "inputs_replay.safetensors");
  REQUIRE(d.run(d.path("inputs.safetensors"), d.path("by_file.safetensors"), &error,
                "--replay-routing " + d.path("given.safetensors")) == 0);
  REQUIRE(d.run(d.path("inputs_replay.safetensors"), d.path("by_inputs.safetensors"), &error) == 0);
  const auto by_file = TensorFile::read(d.dir / "by_file.safetensors");
  check_same_results(by_file, TensorFile::read(d.dir / "by_inputs.safetensors"));
  CHECK(topk_idx_of(by_file) == given);
}

TEST_CASE("moe_run refuses a routing given twice, missing or malformed, and a record over a file",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const RunDir d(rng);
  std::string error;
  std::vector<std::int32_t> given(10, 0);
  for (int t = 0; t < 5; ++t) given[2 * t + 1] = 1;
  routing_file(d.config, given).write(d.dir / "given.safetensors");
  const auto refused = [&](const std::string& inputs, const std::string& flags) {
    CHECK(d.run(d.path(inputs), d.path("out.safetensors"), &error, flags) != 0);
    CHECK_FALSE(std::filesystem::exists(d.dir / "out.safetensors"));
    return error;
  };

  // Twice: in the inputs and in --replay-routing.
  auto inputs_with_routing = d.files.inputs;
  inputs_with_routing.add("topk_idx", FileDType::kI32, {5, 2}, given.data());
  inputs_with_routing.write(d.dir / "inputs_replay.safetensors");
  CHECK_THAT(
      refused("inputs_replay.safetensors", "--replay-routing " + d.path("given.safetensors")),
      test::contains_text("tensor 'topk_idx' gives a routing to replay, and so does " +
                          d.path("given.safetensors") + ": give the routing once"));
  // A file without topk_idx (the weights).
  CHECK_THAT(
      refused("inputs.safetensors", "--replay-routing " + d.path("weights.safetensors")),
      test::contains_text(d.path("weights.safetensors") +
                          ": no tensor named 'topk_idx' (the routing to replay, I32 [5, 2])"));
  // Another batch's routing: one token short.
  routing_file(d.config, std::span(given).first(8)).write(d.dir / "short.safetensors");
  CHECK_THAT(refused("inputs.safetensors", "--replay-routing " + d.path("short.safetensors")),
             test::contains_text("tensor 'topk_idx' is I32[4, 2]; expected I32 [5, 2]"));
  // An expert named twice by one token.
  std::vector<std::int32_t> twice = given;
  twice[7] = twice[6];
  routing_file(d.config, twice).write(d.dir / "twice.safetensors");
  CHECK_THAT(refused("inputs.safetensors", "--replay-routing " + d.path("twice.safetensors")),
             test::contains_text("token 3"));
  // A missing file, and the record and the results in one file or over an input.
  CHECK_THAT(refused("inputs.safetensors", "--replay-routing " + d.path("none.safetensors")),
             test::contains_text("none.safetensors"));
  CHECK_THAT(refused("inputs.safetensors", "--record-routing " + d.path("out.safetensors")),
             test::contains_text("is the --out file"));
  CHECK_THAT(refused("inputs.safetensors", "--record-routing " + d.path("./out.safetensors")),
             test::contains_text("the routing and the results need two files"));
  CHECK_THAT(refused("inputs.safetensors", "--record-routing " + d.path("inputs.safetensors")),
             test::contains_text("refusing to overwrite an input"));
  CHECK_THAT(refused("inputs.safetensors", "--replay-routing " + d.path("given.safetensors") +
                                               " --record-routing " + d.path("given.safetensors")),
             test::contains_text("is the --replay-routing file"));
  CHECK_THAT(refused("inputs.safetensors", "--record-routing ''"),
             test::contains_text("--record-routing is empty"));
  CHECK_THAT(refused("inputs.safetensors", "--record-routing --no-check-finite"),
             test::contains_text("looks like an option"));
  // The routing file is left as it was.
  CHECK(topk_idx_of(TensorFile::read(d.dir / "given.safetensors")) == given);
}
