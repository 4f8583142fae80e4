// moe_run's tensor files, end to end on the CPU: files written here, `moe_run --reference` run on
// them, its results file equal to the fp64 reference computed directly; bad files rejected.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "io/layer_files.h"
#include "support/catch.h"
#include "support/tensor_files.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;
using test::error_from;
using test::file_bytes;

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

// A small layer's files in a fresh directory: config.yaml, weights.safetensors,
// inputs.safetensors. Removed with the object.
struct RunDir {
  std::filesystem::path dir;
  MoEConfig config;
  Files files;

  explicit RunDir(std::mt19937_64& rng, const std::string& config_extra = "") {
    dir = std::filesystem::temp_directory_path() /
          ("moe_run_" + std::to_string(::getpid()) + "_" + std::to_string(rng()));
    std::filesystem::create_directories(dir);
    config = test::small_config(6, 4, 4, 2);
    const auto params = test::round_params(test::random_params(config, rng), DType::kFP32);
    const Matrix x = test::round_to(test::random_matrix(5, 6, rng), DType::kFP32);
    const Matrix dy = test::round_to(test::random_matrix(5, 6, rng), DType::kFP32);
    files = make_files(config, params, x, dy);
    std::ofstream(dir / "config.yaml")
        << "hidden: 6\nffn_hidden: 4\nnum_experts: 4\ntopk: 2\ndtype: fp32\n"
        << config_extra;
    files.weights.write(dir / "weights.safetensors");
    files.inputs.write(dir / "inputs.safetensors");
  }
  ~RunDir() { std::filesystem::remove_all(dir); }
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;

  std::string path(const std::string& name) const { return (dir / name).string(); }

  // moe_run --reference on these files (the inputs file and --out chosen by the caller, and any
  // extra flags; flags "--gpus" leave --reference out); its exit status, and what it wrote to
  // stderr in `error`.
  int run(const std::string& inputs, const std::string& out, std::string* error,
          const std::string& flags = "") const {
    const std::string mode = flags == "--gpus" ? "" : " --reference " + flags;
    const std::string command = std::string(MOE_RUN_PATH) + mode + " --config " +
                                path("config.yaml") + " --weights " + path("weights.safetensors") +
                                " --inputs " + inputs + " --out '" + out + "' 2>" +
                                path("stderr.txt");
    const int status = std::system(command.c_str());
    std::ifstream in(path("stderr.txt"));
    std::stringstream text;
    text << in.rdbuf();
    *error = text.str();
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  }
};

std::string layer_error(const MoEConfig& c, const TensorFile& weights, const TensorFile& inputs) {
  try {
    read_layer_inputs(c, weights, inputs);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
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
  const auto params = test::round_params(test::random_params(c, rng), DType::kFP32);
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

TEST_CASE("moe_run refuses an --out that is one of its inputs, before writing anything",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const RunDir d(rng);
  std::filesystem::create_hard_link(d.dir / "weights.safetensors", d.dir / "hard.safetensors");
  std::filesystem::create_symlink(d.dir / "config.yaml", d.dir / "link.yaml");
  const std::string weights = file_bytes(d.dir / "weights.safetensors");
  const std::string inputs = file_bytes(d.dir / "inputs.safetensors");
  const std::string config = file_bytes(d.dir / "config.yaml");
  const std::vector<std::pair<std::string, std::string>> outs = {
      {d.path("weights.safetensors"), "--weights"},
      {d.path("inputs.safetensors"), "--inputs"},
      {(d.dir / "." / "inputs.safetensors").string(), "--inputs"},
      {(d.dir / "sub" / ".." / "config.yaml").string(), "--config"},
      {d.path("hard.safetensors"), "--weights"},
      {d.path("link.yaml"), "--config"}};
  std::filesystem::create_directories(d.dir / "sub");
  for (const auto& [out, option] : outs) {
    INFO("--out " << out);
    std::string error;
    CHECK(d.run(d.path("inputs.safetensors"), out, &error) == 1);
    CHECK_THAT(error, test::contains_text("--out '" + out + "' is the " + option + " file"));
    CHECK_THAT(error, test::contains_text("refusing to overwrite an input"));
  }
  CHECK(file_bytes(d.dir / "weights.safetensors") == weights);
  CHECK(file_bytes(d.dir / "inputs.safetensors") == inputs);
  CHECK(file_bytes(d.dir / "config.yaml") == config);
  std::string error;
  CHECK(d.run(d.path("inputs.safetensors"), d.path("out.safetensors"), &error) == 0);
}

// Results are written after the whole run: an --out that writing would refuse is refused before
// anything runs, on the GPUs' path as under --reference (on a machine without a GPU that path
// would otherwise end in "no CUDA GPU"; with one, in an error after the run).
TEST_CASE("moe_run refuses an --out it could not write before anything runs", "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const RunDir d(rng);
  std::filesystem::create_directories(d.dir / "folder");
  std::filesystem::create_symlink(d.dir / "missing" / "target", d.dir / "dangling");
  REQUIRE(::mkfifo(d.path("fifo").c_str(), 0600) == 0);
  const std::string long_name = std::string(300, 'a') + ".safetensors";
  const std::vector<std::pair<std::string, std::string>> outs = {
      {d.path("folder"), "is a directory; name a file"},
      {d.path("dangling"), "is a symbolic link that leads nowhere"},
      {d.path("fifo"), "is not a regular file"},
      {"/dev/null", "is not a regular file"},
      {d.path("missing/out.safetensors"),
       "the directory '" + d.path("missing") + "' does not exist"},
      {"", "--out is empty"},
      {"--no-check-finite", "looks like an option, not a file name"},
      {d.path(long_name), "has 312 bytes; file systems take at most 255"}};
  for (const std::string flags : {"", "--gpus"}) {
    for (const auto& [out, message] : outs) {
      INFO("--out '" << out << "' " << flags);
      std::string error;
      CHECK(d.run(d.path("inputs.safetensors"), out, &error, flags) == 1);
      CHECK_THAT(error, test::contains_text(message));
    }
  }
  CHECK_FALSE(std::filesystem::exists(d.dir / "folder" / "out.safetensors"));
  CHECK(std::filesystem::is_fifo(d.dir / "fifo"));
}

TEST_CASE("moe_run names the tensor holding NaN or Inf; --no-check-finite lets it through",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const RunDir d(rng);
  const std::vector<std::string> names = {"x", "dy", "gate_weight", "w13", "w2"};
  for (int round = 0; round < 3; ++round) {
    const auto& name = names[std::uniform_int_distribution<std::size_t>(0, names.size() - 1)(rng)];
    const bool input = name == "x" || name == "dy";
    TensorFile file = input ? d.files.inputs : d.files.weights;
    FileTensor& t = file.get(name);
    const auto n = static_cast<std::size_t>(t.numel());
    const auto at = std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
    const float bad[3] = {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()};
    const int which = std::uniform_int_distribution<int>(0, 2)(rng);
    std::memcpy(t.data.data() + at * 4, &bad[which], 4);
    // The element's index in every dimension.
    std::string index;
    std::size_t rest = at;
    for (std::size_t dim = t.shape.size(); dim-- > 0;) {
      const auto extent = static_cast<std::size_t>(t.shape[dim]);
      index = std::to_string(rest % extent) + (index.empty() ? "" : ", " + index);
      rest /= extent;
    }
    // A bad inputs file is given as --inputs; bad weights replace weights.safetensors.
    const std::string bad_path = input ? d.path("bad.safetensors") : d.path("weights.safetensors");
    const std::string inputs = input ? bad_path : d.path("inputs.safetensors");
    file.write(bad_path);
    INFO("tensor " << name << " element " << at);
    std::string error;
    const std::string value = which == 0 ? "nan" : which == 1 ? "inf" : "-inf";
    CHECK(d.run(inputs, d.path("out.safetensors"), &error) == 1);
    CHECK_THAT(error, test::contains_text(bad_path + ": tensor '" + name + "' holds " + value +
                                          " at [" + index + "] (1 of its " + std::to_string(n) +
                                          " elements are NaN or Inf)"));
    CHECK_FALSE(std::filesystem::exists(d.dir / "out.safetensors"));
    // Turned off, the values go through (the results then hold NaN: the caller asked for it).
    CHECK(d.run(inputs, d.path("out.safetensors"), &error, "--no-check-finite") == 0);
    CHECK(std::filesystem::exists(d.dir / "out.safetensors"));
    std::filesystem::remove(d.dir / "out.safetensors");
    d.files.weights.write(d.dir / "weights.safetensors");
  }
}

TEST_CASE("moe_run refuses results that overflow to Inf, leaving an older --out as it was",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const RunDir d(rng);
  // Finite inputs whose products overflow fp32: every x is 1e30 and every expert weight 0.5, so
  // h is 3e30 in every column and the experts' SwiGLU about 1e61.
  const auto fill = [](TensorFile& file, const std::string& name, float value) {
    FileTensor& t = file.get(name);
    for (std::int64_t i = 0; i < t.numel(); ++i) std::memcpy(t.data.data() + i * 4, &value, 4);
  };
  TensorFile inputs = d.files.inputs;
  fill(inputs, "x", 1e30f);
  inputs.write(d.path("huge.safetensors"));
  TensorFile weights = d.files.weights;
  fill(weights, "w13", 0.5f);
  fill(weights, "w2", 0.5f);
  weights.write(d.path("weights.safetensors"));
  std::ofstream(d.dir / "out.safetensors") << "older results";
  std::string error;
  CHECK(d.run(d.path("huge.safetensors"), d.path("out.safetensors"), &error) == 1);
  CHECK_THAT(error,
             test::contains_text("tensor file '" + d.path("out.safetensors") + "': tensor '") &&
                 test::contains_text("results that are not finite are refused"));
  CHECK(file_bytes(d.dir / "out.safetensors") == "older results");
  // Asked for, they are written.
  CHECK(d.run(d.path("huge.safetensors"), d.path("out.safetensors"), &error, "--no-check-finite") ==
        0);
  CHECK(file_bytes(d.dir / "out.safetensors") != "older results");
}

TEST_CASE("moe_run: an align_size beyond the bound fails at once with its value",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const char* align : {"1000000", "2000000000"}) {
    const RunDir d(rng, std::string("align_size: ") + align + "\n");
    std::string error;
    const auto start = std::chrono::steady_clock::now();
    CHECK(d.run(d.path("inputs.safetensors"), d.path("out.safetensors"), &error) == 1);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
    CHECK_THAT(error,
               test::contains_text(std::string("align_size = ") + align + " must be in [0, 4096]"));
  }
}

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
  auto inputs = files.inputs;
  add(inputs, "labels", {3}, {0, 1, 2});
  CHECK_THAT(layer_error(c, files.weights, inputs),
             test::contains_text("tensor 'labels' is not one of the inputs tensors"));
}

TEST_CASE("check_finite finds the first NaN or Inf of BF16 and F32 tensors", "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const FileDType dtype : {FileDType::kBF16, FileDType::kF32}) {
    const std::vector<std::int64_t> shape = {
        std::uniform_int_distribution<std::int64_t>(1, 4)(rng),
        std::uniform_int_distribution<std::int64_t>(1, 5)(rng),
        std::uniform_int_distribution<std::int64_t>(1, 6)(rng)};
    const auto n = static_cast<std::size_t>(shape[0] * shape[1] * shape[2]);
    std::vector<float> values(n);
    for (auto& v : values) v = std::normal_distribution<float>(0, 1)(rng);
    TensorFile clean;
    const auto put = [&](TensorFile& file) {
      if (dtype == FileDType::kF32) {
        file.add("t", dtype, shape, values.data());
      } else {
        std::vector<BF16> bf(n);
        for (std::size_t i = 0; i < n; ++i) bf[i] = to_bf16(values[i]);
        file.add("t", dtype, shape, bf.data());
      }
    };
    put(clean);
    CHECK_NOTHROW(check_finite(clean));
    const auto bad =
        std::uniform_int_distribution<std::size_t>(1, std::min<std::size_t>(n, 4))(rng);
    std::vector<std::size_t> at(n);
    std::iota(at.begin(), at.end(), 0);
    std::shuffle(at.begin(), at.end(), rng);
    at.resize(bad);
    for (const auto i : at) values[i] = std::numeric_limits<float>::infinity();
    const auto first = *std::min_element(at.begin(), at.end());
    const auto plane = static_cast<std::size_t>(shape[1] * shape[2]);
    TensorFile dirty;
    put(dirty);
    const std::string index = std::to_string(first / plane) + ", " +
                              std::to_string(first % plane / shape[2]) + ", " +
                              std::to_string(first % static_cast<std::size_t>(shape[2]));
    CHECK_THROWS_WITH(
        check_finite(dirty),
        test::contains_text("tensor 't' holds inf at [" + index + "] (" + std::to_string(bad) +
                            " of its " + std::to_string(n) + " elements are NaN or Inf)"));
  }
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
             test::contains_text("no tensor named 'shared_w2'"));
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
}
