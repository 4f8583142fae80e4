// moe_train --load: a checkpoint whose header does not hold the model's layers (a missing tensor,
// a wrong shape or dtype, another layer count, a step that is no count) is refused by name before
// MPI or a GPU is touched, so the error is the same on any machine. And --help beside a bad value
// prints the help.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "moe/safetensors.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;

namespace {

constexpr std::int64_t kE = 4, kH = 8, kF = 6;

// A checkpoint of `layers` layers of the small layer below, as moe_train writes it.
TensorFile checkpoint(int layers) {
  TensorFile file;
  file.metadata = {{"step", "3"}, {"layers", std::to_string(layers)}, {"config", "small"}};
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> tensors = {
      {"gate_weight", {kE, kH}}, {"w13", {kE, 2 * kF, kH}}, {"w2", {kE, kH, kF}}};
  for (int l = 0; l < layers; ++l) {
    for (const auto& [name, shape] : tensors) {
      std::int64_t n = 1;
      for (const auto d : shape) n *= d;
      const std::vector<float> zeros(static_cast<std::size_t>(n), 0.0f);
      for (const char* suffix : {"", ".exp_avg", ".exp_avg_sq"})
        file.add("layers." + std::to_string(l) + "." + name + suffix, FileDType::kF32, shape,
                 zeros.data());
    }
    const std::vector<float> bias(kE, 0.0f);
    file.add("layers." + std::to_string(l) + ".expert_bias", FileDType::kF32, {kE}, bias.data());
  }
  return file;
}

struct TrainDir {
  std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("moe_train_" + std::to_string(::getpid()));
  TrainDir() {
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "config.yaml")
        << "hidden: " << kH << "\nffn_hidden: " << kF << "\nnum_experts: " << kE << "\ntopk: 2\n";
  }
  ~TrainDir() { std::filesystem::remove_all(dir); }
  // moe_train --load FILE --layers 2: its exit status and stderr.
  int load(const TensorFile& file, std::string& error) const {
    file.write(dir / "ckpt.safetensors");
    const std::string command = std::string(MOE_TRAIN_PATH) + " --layers 2 --steps 1 --config " +
                                (dir / "config.yaml").string() + " --load " +
                                (dir / "ckpt.safetensors").string() + " 2>" +
                                (dir / "err.txt").string();
    const int status = std::system(command.c_str());
    std::ifstream in(dir / "err.txt");
    error.assign(std::istreambuf_iterator<char>(in), {});
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
};

}  // namespace

TEST_CASE("moe_train --load refuses a checkpoint of another model by name", "[cpu][train]") {
  const TrainDir d;
  std::string error;
  // A whole checkpoint passes the header: moe_train then stops at the missing GPU, or runs.
  const int good = d.load(checkpoint(2), error);
  INFO(error);
  CHECK((good == 0 || error.find("no CUDA GPU") != std::string::npos));

  CHECK(d.load(checkpoint(3), error) == 1);
  CHECK_THAT(error, test::contains_text("holds 3 layers, the model has 2 (--layers)"));

  TensorFile missing = checkpoint(2);
  TensorFile without;
  without.metadata = missing.metadata;
  for (const auto& [name, tensor] : missing.tensors()) {
    if (name != "layers.1.w2.exp_avg_sq")
      without.add(name, tensor.dtype, tensor.shape, tensor.data.data());
  }
  CHECK(d.load(without, error) == 1);
  CHECK_THAT(error, test::contains_text("has no tensor layers.1.w2.exp_avg_sq"));

  TensorFile wrong = checkpoint(2);
  TensorFile reshaped;
  reshaped.metadata = wrong.metadata;
  for (const auto& [name, tensor] : wrong.tensors()) {
    if (name == "layers.0.w13") {
      reshaped.add(name, tensor.dtype, {kE, kF, 2 * kH}, tensor.data.data());
    } else {
      reshaped.add(name, tensor.dtype, tensor.shape, tensor.data.data());
    }
  }
  CHECK(d.load(reshaped, error) == 1);
  CHECK_THAT(error, test::contains_text("layers.0.w13 is F32[4, 6, 16], the model's layer needs "
                                        "F32[4, 12, 8]"));
}

TEST_CASE("moe_train --load refuses a step it cannot count from, by value", "[cpu][train]") {
  const TrainDir d;
  std::string error;
  for (const std::string step : {"abc", "-3", "12x", " 7", "", "99999999999"}) {
    INFO("step '" << step << "'");
    TensorFile file = checkpoint(2);
    file.metadata["step"] = step;
    CHECK(d.load(file, error) == 1);
    CHECK_THAT(error,
               test::contains_text("metadata step = '" + step + "' is not a non-negative integer"));
  }
  // The step it was taken at, and one more (--steps 1), pass the largest step count.
  TensorFile last = checkpoint(2);
  last.metadata["step"] = "2147483647";
  CHECK(d.load(last, error) == 1);
  CHECK_THAT(error, test::contains_text("was taken at step 2147483647: 1 more (--steps) pass the "
                                        "largest step"));
}

TEST_CASE("--help prints the help even beside a bad value", "[cpu][train]") {
  const TrainDir d;
  const std::string out = (d.dir / "help.txt").string();
  const std::string command = std::string(MOE_TRAIN_PATH) + " --lr nan --help >" + out + " 2>&1";
  const int status = std::system(command.c_str());
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  std::ifstream in(out);
  const std::string text(std::istreambuf_iterator<char>(in), {});
  CHECK_THAT(text, test::contains_text("Usage:") && test::contains_text("--lr"));
  CHECK(text.find("nan") == std::string::npos);
}

TEST_CASE("moe_train --json is refused by name before a GPU is looked for", "[cpu][train]") {
  const TrainDir d;
  const std::string config = (d.dir / "config.yaml").string();
  const auto refusal = [&](const std::string& arguments) {
    const std::string err = (d.dir / "json_err.txt").string();
    const std::string command =
        std::string(MOE_TRAIN_PATH) + " --config " + config + " " + arguments + " 2>" + err;
    const int status = std::system(command.c_str());
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 1));
    std::ifstream in(err);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  CHECK_THAT(refusal("--json ''"), test::contains_text("--json is empty"));
  CHECK_THAT(refusal("--json " + config),
             test::contains_text("is the --config file") && test::contains_text("--json '"));
  const std::string same = (d.dir / "run.out").string();
  CHECK_THAT(refusal("--json " + same + " --save " + same),
             test::contains_text("is the --save file"));
  CHECK_THAT(refusal("--json " + (d.dir / "missing" / "run.json").string()),
             test::contains_text("does not exist"));
}
