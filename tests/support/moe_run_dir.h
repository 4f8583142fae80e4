// moe_run's tests on the CPU share these: small layers' files in a fresh directory, and moe_run
// --reference run on them (MOE_RUN_PATH, the binary under test).
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "io/layer_files.h"
#include "support/tensor_files.h"
#include "support/test_util.h"

namespace moe::test {

// Values stored as F32 exactly, so the files and the direct computation see the same numbers.
inline void add(TensorFile& file, const std::string& name, std::vector<std::int64_t> shape,
                const std::vector<double>& values) {
  const std::vector<float> f(values.begin(), values.end());
  file.add(name, FileDType::kF32, std::move(shape), f.data());
}

struct Files {
  TensorFile weights, inputs;
};

inline Files make_files(const MoEConfig& c, const reference::Params& p, const reference::Matrix& x,
                        const reference::Matrix& dy) {
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
    const reference::Matrix x = test::round_to(test::random_matrix(5, 6, rng), DType::kFP32);
    const reference::Matrix dy = test::round_to(test::random_matrix(5, 6, rng), DType::kFP32);
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

inline std::string layer_error(const MoEConfig& c, const TensorFile& weights,
                               const TensorFile& inputs) {
  try {
    read_layer_inputs(c, weights, inputs);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace moe::test
