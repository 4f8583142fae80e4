// layer_files_tool: the two ends of the moe_run integration test.
//   layer_files_tool make DIR SEED [VARIANT [WORLD]]
//       writes DIR/config.yaml, weights.safetensors, inputs.safetensors (fp32, routing free of
//       near-ties). VARIANT plain (the default); replay: a topk_idx to replay (any distinct
//       experts a token) and tokens_per_rank splitting the batch unevenly over WORLD ranks;
//       shared: shared experts with a gate.
//   layer_files_tool compare A B TOL    A and B hold the same result tensors, equal: routing and
//                                        counts exactly, the rest within relative L2 error TOL
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>

#include "io/layer_files.h"
#include "support/test_util.h"

using namespace moe;

namespace {

int make(const std::string& dir, std::uint64_t seed, const std::string& variant, int world) {
  if (variant != "plain" && variant != "replay" && variant != "shared")
    throw Error("make: VARIANT is plain, replay or shared, not '" + variant + "'");
  // The uneven split below gives every rank of up to 8 at least one of the 100 tokens.
  if (world < 1 || world > 8)
    throw Error("make: WORLD = " + std::to_string(world) + " is not in [1, 8]");
  if (!std::filesystem::is_directory(dir))
    throw Error("make: DIR '" + dir + "' is not a directory");
  std::string yaml =
      "hidden: 64\nffn_hidden: 48\nnum_experts: 8\ntopk: 2\nscore_function: sigmoid\nexpert_bias: "
      "true\n"
      "num_groups: 4\ngroup_topk: 2\nscaling_factor: 2.5\naux_loss_coeff: 0.05\nz_loss_coeff: "
      "0.01\n"
      "align_size: 16\ndtype: fp32\n"
      // cuBLASLt's first proposal in every process: a step replayed by another moe_run process
      // then runs the same products, so it is bitwise the recorded one.
      "gemm_autotune: false\n";
  if (variant == "shared") yaml += "shared_ffn_hidden: 24\nshared_gate: true\n";
  std::ofstream config(dir + "/config.yaml");
  config << yaml;
  config.close();
  if (!config) throw Error("make: cannot write '" + dir + "/config.yaml'");
  const MoEConfig c = parse_config(yaml);
  std::mt19937_64 rng(seed);
  auto p = test::random_params(c, rng);
  p.gate_weight = test::round_to(p.gate_weight, DType::kFP32);
  for (auto& b : p.expert_bias) b = static_cast<float>(b);
  const std::int64_t T = 100, H = c.hidden;
  reference::Matrix x(T, H);
  for (std::int64_t t = 0; t < T; ++t) {  // each row redrawn until no routing score is near a tie
    for (;;) {
      const auto row = test::round_to(test::random_matrix(1, H, rng), DType::kFP32);
      if (!test::well_separated(c, reference::matmul_nt(row, p.gate_weight), p.expert_bias, 1e-4))
        continue;
      std::copy(row.data.begin(), row.data.end(), x.row(t).begin());
      break;
    }
  }
  const TensorFile weights = layer_weights_file(c, p);
  TensorFile inputs = layer_inputs_file(x, test::random_matrix(T, H, rng));
  if (variant == "replay") {
    // Any K distinct experts a token, so the replayed routing differs from the router's choice.
    std::vector<std::int32_t> given;
    for (std::int64_t t = 0; t < T; ++t) {
      const int first = std::uniform_int_distribution<int>(0, 7)(rng);
      const int second = (first + std::uniform_int_distribution<int>(1, 7)(rng)) % 8;
      given.insert(given.end(), {first, second});
    }
    inputs.add("topk_idx", FileDType::kI32, {T, 2}, given.data());
    // Rank r takes a share growing with r, every rank at least one token (up to 8 ranks).
    std::vector<std::int64_t> split;
    const std::int64_t weight_sum = std::int64_t{world} * (world + 1) / 2;
    for (int r = 0; r < world; ++r) split.push_back(T * (r + 1) / weight_sum);
    split.back() += T - std::accumulate(split.begin(), split.end(), std::int64_t{0});
    inputs.add("tokens_per_rank", FileDType::kI64, {world}, split.data());
  }
  weights.write(dir + "/weights.safetensors");
  inputs.write(dir + "/inputs.safetensors");
  return 0;
}

int compare(const std::string& a_path, const std::string& b_path, double tolerance) {
  const auto a = TensorFile::read(a_path);
  const auto b = TensorFile::read(b_path);
  int failures = 0;
  std::size_t compared = b.tensors().size();
  // A tensor of A that B lacks is a difference too: nothing would check its values.
  for (const auto& [name, extra] : a.tensors()) {
    if (b.tensors().count(name) == 0) {
      std::printf("%-20s DIFFERENT (in %s only)\n", name.c_str(), a_path.c_str());
      ++failures;
      ++compared;
    }
  }
  const auto describe = [](const FileTensor& t) {
    std::string shape;
    for (const auto d : t.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    return std::string(file_dtype_name(t.dtype)) + "[" + shape + "]";
  };
  for (const auto& [name, want] : b.tensors()) {
    if (a.tensors().count(name) == 0) {
      std::printf("%-20s DIFFERENT (in %s only)\n", name.c_str(), b_path.c_str());
      ++failures;
      continue;
    }
    const auto& got = a.get(name);
    if (got.shape != want.shape || got.dtype != want.dtype) {
      std::printf("%-20s DIFFERENT (%s against %s)\n", name.c_str(), describe(got).c_str(),
                  describe(want).c_str());
      ++failures;
      continue;
    }
    if (want.dtype == FileDType::kI32 || want.dtype == FileDType::kI64) {
      const std::size_t size = want.dtype == FileDType::kI32 ? 4 : 8;
      std::size_t unequal = 0;
      for (std::size_t i = 0; i + size <= want.data.size(); i += size)
        unequal += std::memcmp(got.data.data() + i, want.data.data() + i, size) != 0;
      std::printf("%-20s %s (%zu of %zu integers differ)\n", name.c_str(),
                  unequal == 0 ? "equal" : "DIFFERENT", unequal, want.data.size() / size);
      failures += unequal != 0;
      continue;
    }
    const double error = test::relative_error(file_values(got), file_values(want));
    const bool ok = error <= tolerance;
    std::printf("%-20s %s (relative error %.3g)\n", name.c_str(), ok ? "equal" : "DIFFERENT",
                error);
    failures += !ok;
  }
  std::printf("%d of %zu tensors differ\n", failures, compared);
  return failures == 0 ? 0 : 1;
}

// The whole of `text` as a number of type T, or an error naming the argument and the text.
template <typename T>
T whole_number(const char* what, const std::string& text) {
  T value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size())
    throw Error(std::string(what) + " '" + text + "' is not a number of its kind");
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string verb = argc > 1 ? argv[1] : "";
    if (verb == "make" && argc >= 4 && argc <= 6) {
      const std::string variant = argc > 4 ? argv[4] : "plain";
      const int world = argc > 5 ? whole_number<int>("WORLD", argv[5]) : 1;
      return make(argv[2], whole_number<std::uint64_t>("SEED", argv[3]), variant, world);
    }
    if (verb == "compare" && argc == 5) {
      const double tolerance = whole_number<double>("TOLERANCE", argv[4]);
      if (!(tolerance >= 0) || !std::isfinite(tolerance))
        throw Error("compare: TOLERANCE '" + std::string(argv[4]) + "' must be finite and >= 0");
      return compare(argv[2], argv[3], tolerance);
    }
    std::fprintf(stderr,
                 "usage: layer_files_tool make DIR SEED [plain|replay|shared [WORLD]] | compare A "
                 "B TOLERANCE\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "layer_files_tool: %s\n", e.what());
    return 1;
  }
}
