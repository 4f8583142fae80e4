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
#include "support/moe_run_dir.h"
#include "support/tensor_files.h"
#include "support/test_util.h"

using namespace moe;
using reference::Matrix;
using test::add;
using test::file_bytes;
using test::make_files;
using test::RunDir;

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

TEST_CASE("moe_run reads --ep and --dp as decimal whole numbers, as the other apps do",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const RunDir d(rng);
  // CLI11 alone reads 010 as octal 8 and takes 0x2 and +1.
  for (const std::string value : {"010", "0x2", "+1", "1.0", "0"}) {
    for (const char* option : {"--ep", "--dp"}) {
      INFO(option << " " << value);
      std::string error;
      CHECK(d.run(d.path("inputs.safetensors"), d.path("out.safetensors"), &error,
                  std::string(option) + " " + value) != 0);
      CHECK_THAT(error,
                 test::contains_text(value == "0" ? "0 is not in [1, 1048576]"
                                                  : "'" + value + "' is not a whole number"));
    }
  }
}

// --reference is one process: launched as several (here as Open MPI's and a PMI launcher's
// environment says), each would compute the whole batch and write the same files.
TEST_CASE("moe_run --reference refuses to run as several processes of a launcher",
          "[cpu][moe_run]") {
  const auto seed = test::fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const RunDir d(rng);
  for (const char* launcher : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    INFO(launcher);
    ::setenv(launcher, "2", 1);
    std::string error;
    const int status = d.run(d.path("inputs.safetensors"), d.path("out.safetensors"), &error);
    ::unsetenv(launcher);
    CHECK(status != 0);
    CHECK_THAT(error, test::contains_text("an MPI launcher started 2 of them"));
    CHECK_FALSE(std::filesystem::exists(d.path("out.safetensors")));
  }
  ::setenv("OMPI_COMM_WORLD_SIZE", "1", 1);  // one process of a launcher runs as without one
  std::string error;
  CHECK(d.run(d.path("inputs.safetensors"), d.path("out.safetensors"), &error) == 0);
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
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

// A finite F32 value beyond bf16's range becomes Inf in a bf16 layer: the check sees the values
// as the layer holds them and says so, where the file alone would pass.
TEST_CASE("check_finite and read_as name an F32 value that overflows bf16", "[cpu][moe_run]") {
  const std::vector<float> values = {1.0f, -2.5f, 3.4e38f, 7.0f, -3.4e38f, 0.5f};
  TensorFile file;
  file.add("x", FileDType::kF32, {2, 3}, values.data());
  CHECK_NOTHROW(check_finite(file));
  CHECK_NOTHROW(check_finite(file, DType::kFP32));
  const std::string want =
      "tensor 'x' holds 3.4e+38 at [0, 2], beyond the range of bf16, the dtype the layer holds it "
      "in (2 of its 6 elements are NaN, Inf or beyond bf16)";
  CHECK_THROWS_WITH(check_finite(file, DType::kBF16), test::contains_text(want));
  CHECK_THROWS_WITH(read_as(file, "x", 0, 6, DType::kBF16, true), test::contains_text(want));
  CHECK_NOTHROW(read_as(file, "x", 0, 6, DType::kFP32, true));
  CHECK_NOTHROW(read_as(file, "x", 0, 6, DType::kBF16, false));  // --no-check-finite
  // Within range it passes, the largest bf16 value included, and values that round down to it.
  const std::vector<float> near = {3.38953139e38f, -1.0f, 3.39e38f};
  TensorFile fine;
  fine.add("y", FileDType::kF32, {3}, near.data());
  CHECK_NOTHROW(check_finite(fine, DType::kBF16));
  // A NaN first, then values beyond bf16: the count says what it counted.
  const std::vector<float> mixed = {std::numeric_limits<float>::quiet_NaN(), 3.4e38f, -3.4e38f};
  TensorFile both;
  both.add("z", FileDType::kF32, {3}, mixed.data());
  CHECK_THROWS_WITH(check_finite(both, DType::kBF16),
                    test::contains_text("tensor 'z' holds nan at [0] (3 of its 3 elements are "
                                        "NaN, Inf or beyond bf16)"));
  // A tensor the layer keeps in fp32 (the expert bias) is judged as fp32.
  constexpr std::string_view kFp32[] = {"x"};
  CHECK_NOTHROW(check_finite(file, DType::kBF16, kFp32));
}
