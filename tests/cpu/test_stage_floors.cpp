// The stages' roofline floors (bench/stage_floors.h) against sums worked by hand.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bench/stage_floors.h"
#include "moe/config.h"
#include "support/catch.h"

using namespace moe;

namespace {

// Returns a copy: a reference would be one GCC's -Wdangling-reference cannot prove safe when the
// name is a temporary.
bench::StageWork stage(std::string_view name, const std::vector<bench::StageWork>& stages) {
  const auto found = std::find_if(stages.begin(), stages.end(),
                                  [&](const bench::StageWork& s) { return s.name == name; });
  REQUIRE(found != stages.end());
  return *found;
}

MoEConfig deepseek_v3() {
  return load_config(std::string(MOE_SOURCE_DIR) + "/configs/deepseek-v3.yaml");
}

}  // namespace

TEST_CASE("a floor is the largest of its FLOPs, bytes and link bytes at their rates",
          "[cpu][bench]") {
  const bench::Rates rates{1e15, 4e12, 5e11};
  CHECK(bench::StageWork{"gemm", 2e12, 4e9, 0}.floor_ms(rates) == Approx(2.0));
  CHECK(bench::StageWork{"copy", 1e12, 8e9, 0}.floor_ms(rates) == Approx(2.0));
  CHECK(bench::StageWork{"link", 0, 4e9, 1e9}.floor_ms(rates) == Approx(2.0));
  CHECK(bench::StageWork{"none", 0, 0, 0}.floor_ms(rates) == 0.0);
  // A rate not measured (one GPU has no link) bounds nothing.
  CHECK(bench::StageWork{"link", 0, 4e9, 1e9}.floor_ms({1e15, 4e12, 0}) == Approx(1.0));
}

TEST_CASE("deepseek-v3's experts backward on one GPU is bound by its weight gradients",
          "[cpu][bench]") {
  MoEConfig config = deepseek_v3();
  const std::int64_t T = 1024;
  const double params = 256.0 * 3 * 7168 * 2048;  // 11.3 G expert parameters
  const double rows = T * 8.0;
  for (const DType grad : {DType::kFP32, DType::kBF16}) {
    config.grad_dtype = grad;
    const auto stages = bench::stage_work(config, T, true);
    const bench::StageWork backward = stage("moe experts backward", stages);
    const double g = grad == DType::kFP32 ? 4 : 2;
    // Weights read (bf16) and gradients written, then dY, h, X read and dX written.
    const double want = params * 2 + params * g + rows * 7168 * 2 * 3 + rows * 2 * 2048 * 2;
    CHECK(backward.bytes == Approx(want).epsilon(1e-12));
    CHECK(backward.flops == Approx(12 * rows * 7168 * 2048).epsilon(1e-12));
    // At 4.8 TB/s and 800 TFLOP/s the bytes decide: with fp32 gradients, 45 GB of them alone.
    const bench::Rates h200{8e14, 4.8e12, 0};
    CHECK(backward.floor_ms(h200) == Approx(want / 4.8e12 * 1e3).epsilon(1e-12));
    CHECK(backward.floor_ms(h200) > backward.flops / 8e14 * 1e3);
    if (grad == DType::kFP32) CHECK(params * g > 45e9);
  }
}

TEST_CASE("the step's floor adds its stages; the gradient reduction counts only on a mesh",
          "[cpu][bench]") {
  MoEConfig config = load_config(std::string(MOE_SOURCE_DIR) + "/configs/mixtral-8x7b.yaml");
  const bench::Rates rates{7e14, 3e12, 0};
  const auto stages = bench::stage_work(config, 4096, true);
  double sum = 0;
  for (const auto& s : stages) sum += s.floor_ms(rates);
  CHECK(bench::step_floor_ms(stages, rates) == Approx(sum));
  CHECK(stage("moe dispatch", stages).link_bytes == 0.0);
  CHECK(bench::gradient_reduction_work(config).floor_ms(rates) == 0.0);

  // EP = 2, DP = 2: half the rows leave each GPU; the experts' gradients cross the DP pair, the
  // gate's the world of four.
  config.ep = 2;
  config.dp = 2;
  const auto mesh_stages = bench::stage_work(config, 4096, false);
  const double b = 2, H = config.hidden;
  CHECK(stage("moe dispatch", mesh_stages).link_bytes == Approx(4096.0 * 2 * H * b / 2));
  // The combine backward reads the rows again for dprob when the combine weighed them.
  CHECK(stage("moe combine backward", mesh_stages).bytes ==
        Approx(stage("moe combine backward", stages).bytes + 4096.0 * 2 * H * b));
  const auto reduction = bench::gradient_reduction_work(config);
  const double expert_grads = 4.0 * 3 * H * config.ffn_hidden * 4;  // E_loc = 4, fp32
  const double gate_grads = 8.0 * H * 4;
  CHECK(reduction.link_bytes == Approx(expert_grads + 2 * 3.0 / 4 * gate_grads));
}

TEST_CASE("capacity mode and shared experts have their floors, where MoEBlock names their stages",
          "[cpu][bench]") {
  MoEConfig config = deepseek_v3();  // a shared expert of width 2048
  REQUIRE(config.shared_ffn_hidden == 2048);
  config.capacity_factor = 1.25;
  const std::int64_t T = 8192;
  const auto stages = bench::stage_work(config, T, true);
  std::vector<std::string> names;
  for (const auto& s : stages) names.push_back(s.name);
  CHECK(names == std::vector<std::string>{
                     "moe gate", "moe router", "moe capacity", "moe losses", "moe dispatch",
                     "moe experts", "moe combine", "moe shared expert", "moe combine backward",
                     "moe experts backward", "moe dispatch backward", "moe router backward",
                     "moe gate backward", "moe shared expert backward"});
  // The shared FFN's six products: 18 T H Fs FLOPs, 3.14 ms at 690 TFLOP/s.
  const double H = 7168, Fs = 2048;
  const bench::StageWork forward = stage("moe shared expert", stages);
  const bench::StageWork backward = stage("moe shared expert backward", stages);
  CHECK(forward.flops == Approx(6 * T * H * Fs));
  CHECK(backward.flops == Approx(12 * T * H * Fs));
  const bench::Rates h200{690e12, 4.19e12, 0};
  CHECK(forward.floor_ms(h200) + backward.floor_ms(h200) == Approx(3.137).epsilon(1e-3));
  // bf16 weights read twice, fp32 gradients written once; x read twice, dy once; h written and
  // read; y, dX and the adds into out and dx.
  const double weights = 3 * H * Fs;
  CHECK(forward.bytes == Approx(weights * 2 + T * H * 2 * 5 + T * 2 * Fs * 2));
  CHECK(backward.bytes == Approx(weights * 6 + T * H * 2 * 6 + T * 2 * Fs * 2));
  // The capacity stage reads and writes the slots' experts and probabilities.
  CHECK(stage("moe capacity", stages).bytes == Approx(2.0 * T * 8 * 8 + 256 * 4));
  // Without them, neither stage; the routed stages are the same.
  config.capacity_factor = 0;
  config.shared_ffn_hidden = 0;
  const auto plain = bench::stage_work(config, T, true);
  CHECK(plain.size() == stages.size() - 3);
  CHECK(stage("moe experts backward", plain).bytes ==
        Approx(stage("moe experts backward", stages).bytes));
}

namespace {

// floor_table's exit status and output (stdout and stderr) for the given arguments.
std::pair<int, std::string> run_floor_table(const std::string& arguments) {
  const std::string out = (std::filesystem::temp_directory_path() /
                           ("floor_table_" + std::to_string(::getpid()) + ".txt"))
                              .string();
  const int status = std::system(
      (std::string(FLOOR_TABLE_PATH) + " " + arguments + " > " + out + " 2>&1").c_str());
  std::ifstream in(out);
  std::stringstream text;
  text << in.rdbuf();
  std::remove(out.c_str());
  return {status, text.str()};
}

}  // namespace

// bench/floor_table prints, for a config and rates, the floors stage_work gives with fp32 and
// with bf16 weight gradients; and refuses an EP that does not divide the experts by name.
TEST_CASE("floor_table prints the step floors of both gradient dtypes", "[cpu][bench]") {
  const auto [status, text] =
      run_floor_table(std::string("--config ") + MOE_SOURCE_DIR +
                      "/configs/deepseek-v3.yaml --tokens 1024 --gemm-tflops 700 --copy-gbps 4000");
  INFO(text);
  REQUIRE(status == 0);
  MoEConfig config = deepseek_v3();
  config.ep = config.dp = 1;
  const bench::Rates rates{700e12, 4000e9, 0};
  std::string want = "| step | | |";
  for (const DType grad : {DType::kFP32, DType::kBF16}) {
    config.grad_dtype = grad;
    want += fmt::format(" {:.3f} | |",
                        bench::step_floor_ms(bench::stage_work(config, 1024, true), rates));
  }
  want.resize(want.size() - 2);  // the last cell closes the row
  CHECK_THAT(text, test::contains_text(want));
  // At T = 1024 the fp32 gradients bound the experts backward by their bytes: the two differ.
  CHECK_THAT(text, test::contains_text("| moe experts backward |"));

  const auto [bad_status, bad_text] = run_floor_table(std::string("--config ") + MOE_SOURCE_DIR +
                                                      "/configs/deepseek-v3.yaml --ep 3");
  CHECK(bad_status != 0);
  CHECK_THAT(bad_text, test::contains_text("num_experts"));
}

// A rate that is not a finite number would drop out of every stage's max() and leave floors that
// look right: each is refused by name, as is a token count in octal-looking digits.
TEST_CASE("floor_table refuses rates that are not finite numbers", "[cpu][bench]") {
  const std::string config = std::string(" --config ") + MOE_SOURCE_DIR + "/configs/small.yaml";
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"--gemm-tflops nan", "--gemm-tflops: nan"},
      {"--copy-gbps inf", "--copy-gbps: inf"},
      {"--ep 2 --link-gbps NaN", "--link-gbps: NaN"},
      {"--gemm-tflops 0", "--gemm-tflops: 0"},
      {"--tokens 010", "--tokens: '010'"}};
  for (const auto& [arguments, named] : refused) {
    const auto [status, text] = run_floor_table(arguments + config);
    INFO(arguments << ": " << text);
    CHECK(status != 0);
    CHECK_THAT(text, test::contains_text(named));
  }
}

// Without --transport the config's exchange is priced (auto as peer), and the header names the
// one priced alone.
TEST_CASE("floor_table prices the config's exchange unless told another", "[cpu][bench]") {
  const std::string config =
      std::string(" --config ") + MOE_SOURCE_DIR + "/configs/qwen3-30b-a3b.yaml --ep 4";
  const auto [auto_status, auto_text] = run_floor_table(config);
  INFO(auto_text);
  REQUIRE(auto_status == 0);
  CHECK_THAT(auto_text, test::contains_text("EP 4 over peer"));
  const auto [status, text] = run_floor_table(config + " --transport nccl");
  INFO(text);
  REQUIRE(status == 0);
  CHECK_THAT(text, test::contains_text("(nccl)"));
  CHECK_THAT(text, test::contains_text("EP 4 over nccl"));
  CHECK_THAT(text, !test::contains_text("over peer"));
  // Past the peer exchange's 8 ranks auto is NCCL, as the layer resolves it.
  const auto [auto_wide_status, auto_wide_text] = run_floor_table(
      std::string(" --config ") + MOE_SOURCE_DIR + "/configs/qwen3-30b-a3b.yaml --ep 16");
  INFO(auto_wide_text);
  REQUIRE(auto_wide_status == 0);
  CHECK_THAT(auto_wide_text, test::contains_text("EP 16 over nccl"));
}
