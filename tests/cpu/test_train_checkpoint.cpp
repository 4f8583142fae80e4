// moe_train --load: a checkpoint whose header does not hold the model's layers (a missing tensor,
// a wrong shape or dtype, another layer count, a step that is no count, another layer's config,
// the shared experts' tensors missing) is refused by name before MPI or a GPU is touched, so the
// error is the same on any machine. The run's settings it records are taken where the command
// line leaves them out and refused, with both values, where it gives others. And --help beside a
// bad value prints the help; --json and --save are refused where they could not be written.
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "apps/train_checkpoint.h"
#include "moe/config.h"
#include "moe/safetensors.h"
#include "support/catch.h"
#include "support/test_util.h"

using namespace moe;

namespace {

constexpr std::int64_t kE = 4, kH = 8, kF = 6;

// A checkpoint of `layers` layers of the small layer below, as moe_train writes it; with shared
// experts of width `shared` (and their gate) where it is not 0.
TensorFile checkpoint(int layers, std::int64_t shared = 0, bool shared_gate = false) {
  TensorFile file;
  file.metadata = {{"step", "3"}, {"layers", std::to_string(layers)}, {"config", "small"}};
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> tensors = {
      {"gate_weight", {kE, kH}}, {"w13", {kE, 2 * kF, kH}}, {"w2", {kE, kH, kF}}};
  if (shared > 0) {
    tensors.push_back({"shared_w13", {2 * shared, kH}});
    tensors.push_back({"shared_w2", {kH, shared}});
    if (shared_gate) tensors.push_back({"shared_gate_weight", {1, kH}});
  }
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
  // With `flags` after the others; `out`, where given, gets stdout.
  int load(const TensorFile& file, std::string& error, const std::string& flags = "",
           std::string* out = nullptr) const {
    file.write(dir / "ckpt.safetensors");
    const std::string command = std::string(MOE_TRAIN_PATH) + " --layers 2 --steps 1 --config " +
                                (dir / "config.yaml").string() + " --load " +
                                (dir / "ckpt.safetensors").string() + " " + flags + " >" +
                                (dir / "out.txt").string() + " 2>" + (dir / "err.txt").string();
    const int status = std::system(command.c_str());
    std::ifstream in(dir / "err.txt");
    error.assign(std::istreambuf_iterator<char>(in), {});
    if (out != nullptr) {
      std::ifstream out_in(dir / "out.txt");
      out->assign(std::istreambuf_iterator<char>(out_in), {});
    }
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

  // Tensors past the model's layers would be dropped unread; no mesh has an EP not dividing its
  // ranks, or of 0.
  TensorFile extra = checkpoint(3);
  extra.metadata["layers"] = "2";
  CHECK(d.load(extra, error) == 1);
  CHECK_THAT(error, test::contains_text("outside the model's 2 layers"));
  // So would a tensor of a layer index below 0, or one that no layer reads.
  for (const char* stray : {"layers.-1.w13", "layers.0.junk", "layers.0.w13.exp_avg.old"}) {
    TensorFile more = checkpoint(2);
    const FileTensor w13 = more.get("layers.0.w13");  // a copy: add may move the tensors
    more.add(stray, w13.dtype, w13.shape, w13.data.data());
    CHECK(d.load(more, error) == 1);
    CHECK_THAT(error, test::contains_text(std::string("holds tensor ") + stray));
  }
  for (const auto& [ranks, ep] : {std::pair{"1", "2"}, std::pair{"4", "0"}}) {
    TensorFile mesh = checkpoint(2);
    mesh.metadata["ranks"] = ranks;
    mesh.metadata["ep"] = ep;
    CHECK(d.load(mesh, error) == 1);
    CHECK_THAT(error, test::contains_text(std::string("metadata ep = ") + ep +
                                          " does not divide its ranks = " + ranks));
  }
}

TEST_CASE("moe_train --load refuses a step it cannot count from, by value", "[cpu][train]") {
  const TrainDir d;
  std::string error;
  for (const std::string step : {"abc", "-3", "12x", " 7", "", "99999999999", "010"}) {
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
             test::contains_text("name the same file: each needs its own"));
  CHECK_THAT(refusal("--json " + (d.dir / "missing" / "run.json").string()),
             test::contains_text("does not exist"));
  // A directory that takes no new file (/proc takes none, even from root).
  for (const char* option : {"--json", "--save"}) {
    CHECK_THAT(refusal(std::string(option) + " /proc/moe_train.out"),
               test::contains_text(std::string(option) + " '/proc/moe_train.out': no file can be "
                                                         "created in its directory '/proc'"));
  }
}

namespace {

// The small layer's config as moe_train reads it from TrainDir's file, optionally with shared
// experts.
MoEConfig small_layer(int shared_ffn_hidden = 0) {
  MoEConfig c;
  c.hidden = kH;
  c.ffn_hidden = kF;
  c.num_experts = kE;
  c.topk = 2;
  c.shared_ffn_hidden = shared_ffn_hidden;
  return c;
}

// `file` written to a temporary path, its header checked as moe_train --load checks it.
train::ResumePlan check_header(const TensorFile& file, const MoEConfig& config,
                               train::RunSettings& settings,
                               const std::vector<std::string>& given = {}) {
  const auto path =
      std::filesystem::temp_directory_path() / ("moe_ckpt_" + std::to_string(::getpid()));
  file.write(path);
  struct Remove {
    std::filesystem::path path;
    ~Remove() { std::filesystem::remove(path); }
  } remove{path};
  return train::check_checkpoint_header(path.string(), 2, 1, config, settings, given);
}

}  // namespace

TEST_CASE("moe_train --load resumes the run it was saved by: its layer and its settings",
          "[cpu][train]") {
  const MoEConfig config = small_layer();
  TensorFile file = checkpoint(2);
  file.metadata["layer"] = train::layer_identity(config);
  file.metadata["seed"] = "5";
  file.metadata["tokens"] = "512";
  file.metadata["lr"] = fmt::format("{}", 3e-4f);
  file.metadata["ranks"] = "4";

  SECTION("what the command line leaves out is the checkpoint's") {
    train::RunSettings settings;
    const train::ResumePlan plan = check_header(file, config, settings);
    CHECK(settings.seed == 5);
    CHECK(settings.tokens == 512);
    CHECK(settings.lr == 3e-4f);  // the float itself, through its shortest text
    CHECK(plan.ranks == 4);
    CHECK(plan.adopted == std::vector<std::string>{"--seed 5", "--tokens 512", "--lr 0.0003"});
  }
  SECTION("what it gives must be the checkpoint's") {
    train::RunSettings settings;
    settings.lr = 3e-4f;
    CHECK_NOTHROW(check_header(file, config, settings, {"--lr"}));
    settings.seed = 6;
    CHECK_THROWS_WITH(
        check_header(file, config, settings, {"--seed"}),
        test::contains_text("was trained with --seed 5, but this run gives --seed 6"));
  }
  SECTION("the layer is the checkpoint's, whatever the mesh") {
    train::RunSettings settings;
    MoEConfig on_a_mesh = config;
    on_a_mesh.ep = 2;
    on_a_mesh.ep_transport = EpTransport::kCopy;
    on_a_mesh.keep_expert_input = true;
    CHECK_NOTHROW(check_header(file, on_a_mesh, settings));
    MoEConfig other = config;
    other.topk = 1;
    CHECK_THROWS_WITH(check_header(file, other, settings),
                      test::contains_text("holds a layer of " + train::layer_identity(config) +
                                          ", but --config gives " + train::layer_identity(other)));
    MoEConfig fp8 = config;
    fp8.fp8 = true;
    CHECK_THROWS_WITH(check_header(file, fp8, settings), test::contains_text("--fp8"));
    MoEConfig in_series = small_layer(10);  // the shared experts in series: the same bits
    in_series.shared_expert_overlap = false;
    TensorFile shared = checkpoint(2, 10);
    shared.metadata["layer"] = train::layer_identity(small_layer(10));
    CHECK_NOTHROW(check_header(shared, in_series, settings));
  }
  SECTION("a setting it cannot read back is refused by value") {
    for (const auto& [key, text] :
         std::vector<std::pair<std::string, std::string>>{{"lr", "abc"},
                                                          {"lr", "0"},
                                                          {"lr", "nan"},
                                                          {"tokens", "0"},
                                                          {"tokens", "1e3"},
                                                          {"seed", "-1"},
                                                          {"weight_decay", "-0.5"},
                                                          {"bias_rate", "inf"}}) {
      INFO(key << " = '" << text << "'");
      TensorFile bad = file;
      bad.metadata[key] = text;
      train::RunSettings settings;
      CHECK_THROWS_WITH(
          check_header(bad, config, settings),
          test::contains_text("metadata " + key + " = '" + text + "' is not a value"));
    }
  }
  SECTION("a checkpoint of an older build, without the settings, leaves them as given") {
    TensorFile old = checkpoint(2);
    train::RunSettings settings;
    settings.seed = 9;
    const train::ResumePlan plan = check_header(old, config, settings, {"--seed"});
    CHECK(settings.seed == 9);
    CHECK(plan.adopted.empty());
    CHECK(plan.ranks == 0);
  }
}

TEST_CASE("moe_train trains and checkpoints the shared experts where the config has them",
          "[cpu][train]") {
  std::vector<std::string> names;
  for (const auto& t : train::trained_tensors(small_layer())) names.push_back(t.name);
  CHECK(names == std::vector<std::string>{"gate_weight", "w13", "w2"});
  MoEConfig gated = small_layer(10);
  gated.shared_gate = true;
  names.clear();
  for (const auto& t : train::trained_tensors(gated)) names.push_back(t.name);
  CHECK(names == std::vector<std::string>{"gate_weight", "w13", "w2", "shared_w13", "shared_w2",
                                          "shared_gate_weight"});
  // A checkpoint without them: of a build that did not train them where it records no layer,
  // else of another model.
  train::RunSettings settings;
  CHECK_THROWS_WITH(
      check_header(checkpoint(2), gated, settings),
      test::contains_text("has no tensor layers.0.shared_w13: it was saved by a "
                          "build of moe_train that did not train the shared experts"));
  TensorFile recorded = checkpoint(2);
  recorded.metadata["layer"] = train::layer_identity(gated);
  CHECK_THROWS_WITH(check_header(recorded, gated, settings),
                    test::contains_text("has no tensor layers.0.shared_w13 (a checkpoint of "
                                        "another model?)"));
  TensorFile whole = checkpoint(2, 10, true);
  whole.metadata["layer"] = train::layer_identity(gated);
  CHECK_NOTHROW(check_header(whole, gated, settings));
}

TEST_CASE("moe_train --load of node-limited routing keeps the EP size it was trained at",
          "[cpu][train]") {
  const TrainDir d;
  std::ofstream(d.dir / "config.yaml")
      << "hidden: " << kH << "\nffn_hidden: " << kF << "\nnum_experts: " << kE
      << "\ntopk: 2\nmax_nodes_per_token: 1\nep_ranks_per_node: 1\n";
  TensorFile file = checkpoint(2);
  file.metadata["ep"] = "2";
  std::string error;
  // Refused once MPI has started (the mesh's EP is known there): under the sanitizers MPI's own
  // allocations may then change the exit status, so only its failure and message are checked.
  CHECK(d.load(file, error) != 0);
  CHECK_THAT(error, test::contains_text("was trained at EP 2, this run has EP 1: node-limited "
                                        "routing (max_nodes_per_token = 1)"));
}

TEST_CASE("moe_train --load says which settings it took from the checkpoint", "[cpu][train]") {
  const TrainDir d;
  TensorFile file = checkpoint(2);
  file.metadata["seed"] = "5";
  std::string error, out;
  const int status = d.load(file, error, "", &out);
  INFO(error);
  CHECK((status == 0 || error.find("no CUDA GPU") != std::string::npos));
  CHECK_THAT(out, test::contains_text("resuming with the checkpoint's --seed 5"));
  CHECK(d.load(file, error, "--seed 6") == 1);
  CHECK_THAT(error, test::contains_text("was trained with --seed 5, but this run gives --seed 6"));
}

// The checkpoint gathers each rank's share of the experts' weights as one MPI message: a share
// past INT_MAX values is refused by name before any step runs, and a larger EP lets it through.
TEST_CASE("a checkpoint whose share of w13 a rank cannot send is refused at the start",
          "[cpu][train]") {
  MoEConfig config;
  config.hidden = 16384;
  config.ffn_hidden = 16384;
  config.num_experts = 4;
  config.topk = 1;
  config.ep = 1;
  CHECK_THROWS_WITH(train::check_checkpoint_fits(config),
                    test::contains_text("--save: w13 holds 2147483648 values a rank at EP 1"));
  config.ep = 2;
  CHECK_NOTHROW(train::check_checkpoint_fits(config));
}

// A flag for a part the config does not have is refused by name; the config's mesh and
// moe_bench's token count give way to the ranks and --tokens, and a note says so.
TEST_CASE("moe_train names what the config does not use", "[cpu][train]") {
  const TrainDir d;
  const auto run = [&](const std::string& config, const std::string& flags, std::string& out) {
    std::ofstream(d.dir / "c.yaml") << config;
    const std::string command = std::string(MOE_TRAIN_PATH) + " --config " +
                                (d.dir / "c.yaml").string() + " " + flags + " >" +
                                (d.dir / "out.txt").string() + " 2>&1";
    const int status = std::system(command.c_str());
    std::ifstream in(d.dir / "out.txt");
    out.assign(std::istreambuf_iterator<char>(in), {});
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  const std::string layer = "hidden: 64\nffn_hidden: 32\nnum_experts: 8\ntopk: 2\n";
  std::string out;
  CHECK(run(layer, "--bias-rate 5", out) == 1);
  CHECK_THAT(out, test::contains_text("--bias-rate 5 updates an expert bias, but the config has "
                                      "none (expert_bias: false)"));
  const int status = run(layer + "ep: 2\ntokens: 4096\n", "--steps 0", out);
  INFO(out);
  CHECK((status == 0 || out.find("no CUDA GPU") != std::string::npos));
  CHECK_THAT(out, test::contains_text("the config's mesh (ep = 2, dp = 1) gives way"));
  CHECK_THAT(out, test::contains_text("the config's tokens = 4096 is moe_bench's; this run takes "
                                      "1024 per GPU (--tokens)"));
}
