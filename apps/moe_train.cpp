// moe_train: a small trainer that embeds moe::MoEBlock the way a real one does, and README's
// example of doing so.
//
//   mpirun -np N build/apps/moe_train [--config configs/small.yaml] [--layers 2] [--steps 200]
//                                     [--tokens 1024] [--lr 1e-3] [--ep E --dp D]
//                                     [--fp8] [--capacity-factor C]
//                                     [--save ckpt.safetensors] [--load ckpt.safetensors]
//                                     [--json train.json]
//   (and --weight-decay, --bias-rate, --seed, --log-every: --help lists every flag)
//
// The task can be learned: regression onto a fixed random teacher of the same shape. The model is
// a residual stack h_{l+1} = h_l + MoE_l(h_l) over random tokens; the loss is the mean squared
// error to the teacher's output over the global batch, plus the layers' aux and z losses. AdamW
// with fp32 master weights on the GPU over the router's gate and the experts' weights (the shared
// experts' too, where the config has them), gradients summed over the mesh by the blocks, the
// aux-loss-free expert-bias update when the config has a bias, and checkpoints in safetensors
// (master weights and optimizer moments of all experts, gathered on rank 0, with the run's
// settings: a run resumed with --load takes them, apps/train_checkpoint.h). --json writes the
// run's settings and each logged step (loss, router losses, the first layer's load imbalance
// since the step logged before, and in capacity mode the share of its slots dropped) for
// bench/plot_train.py.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "apps/train_checkpoint.h"
#include "apps/train_kernels.cuh"
#include "cli/checks.h"
#include "cli/output_file.h"
#include "comm/bootstrap.h"
#include "kernels/elementwise.cuh"
#include "moe/config.h"
#include "moe/device.h"
#include "moe/error.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"

using namespace moe;

namespace {

struct Options {
  std::string config_path = std::string(MOE_SOURCE_DIR) + "/configs/small.yaml";
  int layers = 2, steps = 200, ep = 0, dp = 0, log_every = 10;
  train::RunSettings run;       // seed, tokens, AdamW's and the bias update's rates
  double capacity_factor = -1;  // below 0: the config's
  bool fp8 = false;
  std::string save_path, load_path, json_path;
};

// `config` is checked against the mesh's shape already.
int run_training(const Options& o, const MoEConfig& config, comm::MpiSession& mpi) {
  const int world = mpi.size();
  const int ep = config.ep, dp = config.dp;
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, ep, dp, config.num_experts);
  const bool root = mesh.rank() == 0;
  Stream stream;
  const std::int64_t T = o.run.tokens, H = config.hidden;
  const std::int64_t global_tokens = T * world;

  // The student (trained) and the teacher (fixed, a different seed) stacks. The teacher runs
  // without FP8 and without drops, so that runs with them and without chase the same targets.
  MoEConfig teacher_config = config;
  teacher_config.fp8 = false;
  teacher_config.fp8_dispatch = false;  // E4M3 rows go with the FP8 experts
  teacher_config.capacity_factor = 0;
  teacher_config.pad_to_capacity = false;
  teacher_config.drop_policy = MoEConfig{}.drop_policy;  // a policy needs capacity mode
  std::vector<std::unique_ptr<MoEBlock>> student, teacher;
  std::vector<std::unique_ptr<train::AdamW>> optimizers;
  // Every layer runs on one stream, one call after another: they share what lives inside a call.
  const auto scratch = std::make_shared<MoEScratch>();
  for (int l = 0; l < o.layers; ++l) {
    student.push_back(std::make_unique<MoEBlock>(config, mesh, stream.get(), scratch));
    student.back()->initialize(o.run.seed * 1000 + l);
    teacher.push_back(std::make_unique<MoEBlock>(teacher_config, mesh, stream.get(), scratch));
    teacher.back()->initialize(o.run.seed * 1000 + 500 + l);
    optimizers.push_back(train::optimizer_for(config, *student.back(), stream.get()));
  }
  train::Checkpoint checkpoint(mesh);
  int first_step = 0;
  if (!o.load_path.empty()) {
    first_step = checkpoint.load(o.load_path, optimizers, student, stream.get());
    if (root) fmt::print("moe_train: resumed from {} at step {}\n", o.load_path, first_step);
  }

  // Activations: the residual stream of each layer (forward keeps its input until backward).
  const std::size_t bytes = static_cast<std::size_t>(T * H) * dtype_size(config.dtype);
  std::vector<DeviceBuffer> stream_buffers(o.layers + 1);
  std::vector<Tensor> h;
  for (auto& b : stream_buffers) {
    b.reserve(bytes);
    h.emplace_back(b.data(), config.dtype, std::vector<std::int64_t>{T, H});
  }
  DeviceBuffer target_a(bytes), target_b(bytes), grad_buffer(bytes),
      partial(train::kLossBlocks * 4);
  const Tensor target0(target_a.data(), config.dtype, {T, H}),
      target1(target_b.data(), config.dtype, {T, H}),
      grad(grad_buffer.data(), config.dtype, {T, H});

  if (root) {
    fmt::print(
        "moe_train: {} layers of {}\n  {} GPU(s), EP={} DP={}, {} tokens per GPU, AdamW lr {}\n",
        o.layers, config.describe(), world, ep, dp, T, o.run.lr);
  }
  double first_loss = -1, last_loss = 0;
  // The first layer's load since the last log line: its imbalance shows the expert bias at work;
  // in capacity mode, the share of its slots dropped.
  const auto E = static_cast<std::size_t>(config.num_experts);
  std::vector<std::int64_t> load_then(E, 0), load_now(E), dropped_then(E, 0), dropped_now(E);
  struct IntervalLoad {
    LoadImbalance imbalance;
    double dropped_fraction = 0.0;
  };
  auto interval_load = [&] {
    const MoELoadStatistics statistics = student[0]->load_statistics();
    copy_to_host(load_now.data(), statistics.tokens_per_expert.data, E * sizeof(std::int64_t));
    std::vector<std::int64_t> interval(E);
    for (std::size_t e = 0; e < E; ++e) interval[e] = load_now[e] - load_then[e];
    IntervalLoad result{load_imbalance(interval, ep)};
    if (config.capacity_mode()) {
      copy_to_host(dropped_now.data(), statistics.dropped_per_expert.data,
                   E * sizeof(std::int64_t));
      const double routed = std::accumulate(interval.begin(), interval.end(), 0.0);
      const double dropped = std::accumulate(dropped_now.begin(), dropped_now.end(), 0.0) -
                             std::accumulate(dropped_then.begin(), dropped_then.end(), 0.0);
      if (routed > 0) result.dropped_fraction = dropped / routed;
      dropped_then = dropped_now;
    }
    load_then = load_now;
    return result;
  };
  nlohmann::json log = nlohmann::json::array();
  const auto start = std::chrono::steady_clock::now();
  for (int step = first_step; step < first_step + o.steps; ++step) {
    // This step's tokens: a function of (step, rank) alone, so a resumed run sees the same data.
    // The offset is a position in the generator's stream: unsigned, it wraps modulo 2^64 (defined)
    // where step · world · T · H would pass it, and only the draws change.
    init_normal(h[0], o.run.seed * 7919 + 17,
                (static_cast<std::uint64_t>(step) * static_cast<std::uint64_t>(world) +
                 static_cast<std::uint64_t>(mesh.rank())) *
                    static_cast<std::uint64_t>(T * H),
                1.0f, stream.get());
    // The teacher's output.
    const Tensor* t_in = &h[0];
    for (int l = 0; l < o.layers; ++l) {
      const Tensor& t_out = (l % 2 == 0) ? target0 : target1;
      const auto f = teacher[l]->infer(*t_in);
      train::add(*t_in, f.out, t_out, stream.get());
      t_in = &t_out;
    }
    // Forward: the residual stack.
    double router_losses = 0;
    for (int l = 0; l < o.layers; ++l) {
      const auto f = student[l]->forward(h[l]);
      router_losses += f.aux_loss + f.z_loss;
      train::add(h[l], f.out, h[l + 1], stream.get());
    }
    // Loss over the global batch and its gradient.
    const float scale = 1.0f / static_cast<float>(global_tokens * H);
    const int parts =
        train::squared_error(h[o.layers], *t_in, scale, grad, partial.as<float>(), stream.get());
    const auto sums = train::download(partial.data(), parts, stream.get());  // the step's one wait
    double sse = std::accumulate(sums.begin(), sums.end(), 0.0);
    MOE_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &sse, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
    const double mse = sse / static_cast<double>(global_tokens * H);
    // Backward, the mirror: d h_l = d h_{l+1} + MoE_l'(d h_{l+1}).
    for (int l = o.layers - 1; l >= 0; --l) {
      const Tensor dx = student[l]->backward(grad);
      train::add(grad, dx, grad, stream.get());
    }
    // Gradients over the mesh, then the update.
    train::AdamWHyper hyper;
    hyper.lr = o.run.lr;
    hyper.weight_decay = o.run.weight_decay;
    hyper.step = step + 1;
    for (int l = 0; l < o.layers; ++l) {
      student[l]->reduce_gradients();
      optimizers[l]->step(hyper, stream.get());
      if (config.expert_bias) student[l]->update_expert_bias(o.run.bias_rate);
    }
    const double loss = mse + router_losses;
    if (first_loss < 0) first_loss = loss;
    last_loss = loss;
    if (root && ((step + 1) % o.log_every == 0 || step == first_step)) {
      stream.synchronize();
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count() /
          (step - first_step + 1);
      const IntervalLoad interval = interval_load();
      const LoadImbalance& imbalance = interval.imbalance;
      const std::string drops =
          config.capacity_mode()
              ? fmt::format("  {:.2f}% dropped", 100.0 * interval.dropped_fraction)
              : std::string();
      fmt::print(
          "step {:>5}  loss {:.6f}  (mse {:.6f}, router losses {:.3e})  load max/mean {:.2f} per "
          "expert, {:.2f} per EP rank{}  {:.1f} ms/step\n",
          step + 1, loss, mse, router_losses, imbalance.expert, imbalance.ep_rank, drops, ms);
      std::fflush(stdout);
      nlohmann::json entry = {{"step", step + 1},
                              {"loss", loss},
                              {"mse", mse},
                              {"router_losses", router_losses},
                              {"load_imbalance_expert", imbalance.expert},
                              {"load_imbalance_ep_rank", imbalance.ep_rank},
                              {"ms_per_step", ms}};
      if (config.capacity_mode()) entry["dropped_fraction"] = interval.dropped_fraction;
      log.push_back(std::move(entry));
    }
  }
  stream.synchronize();
  if (root && o.steps > 0)
    fmt::print(
        "moe_train: loss {:.6f} -> {:.6f} over {} steps; {} blocks share {:.1f} MiB of scratch\n",
        first_loss, last_loss, o.steps, 2 * o.layers,
        static_cast<double>(scratch->bytes()) / (1 << 20));
  if (!o.save_path.empty()) {
    checkpoint.save(o.save_path, optimizers, student, first_step + o.steps, config, o.run,
                    stream.get());
    if (root) fmt::print("moe_train: checkpoint written to {}\n", o.save_path);
  }
  if (root && !o.json_path.empty()) {
    const nlohmann::json report = {
        {"config", config.describe()},
        {"config_file", std::filesystem::path(o.config_path).filename().string()},
        {"layers", o.layers},
        {"ranks", world},
        {"ep", ep},
        {"dp", dp},
        {"tokens_per_gpu", T},
        {"lr", o.run.lr},
        {"weight_decay", o.run.weight_decay},
        {"bias_rate", config.expert_bias ? o.run.bias_rate : 0.0f},
        {"fp8", config.fp8},
        {"capacity_factor", config.capacity_factor},
        {"seed", o.run.seed},
        {"first_step", first_step + 1},
        {"steps", o.steps},
        {"first_loss", o.steps > 0 ? nlohmann::json(first_loss) : nlohmann::json()},
        {"last_loss", o.steps > 0 ? nlohmann::json(last_loss) : nlohmann::json()},
        {"log", log}};
    std::ofstream file(o.json_path);
    file << report.dump(2) << "\n";
    file.close();
    if (!file) fail("cannot write --json '{}'", o.json_path);
    fmt::print("moe_train: {} logged steps written to {}\n", log.size(), o.json_path);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moe_train: a residual MoE stack regressing onto a fixed teacher, over a mesh"};
  cli::flags_take_no_value(app);
  Options o;
  app.add_option("--config", o.config_path, "layer config (YAML)")->check(CLI::ExistingFile);
  app.add_option("--layers", o.layers, "MoE layers")->check(cli::count_in(1, 4096));
  app.add_option("--steps", o.steps, "optimizer steps in this run")
      ->check(cli::count_in(0, 1000000000));
  app.add_option("--tokens", o.run.tokens, "tokens per GPU per step")
      ->check(cli::count_in(1, 1 << 30));
  app.add_option("--lr", o.run.lr, "AdamW learning rate")->check(cli::finite_in(1e-30, 1e3));
  app.add_option("--weight-decay", o.run.weight_decay, "AdamW decoupled weight decay")
      ->check(cli::finite_in(0, 1e3));
  app.add_option("--bias-rate", o.run.bias_rate, "expert-bias update rate (configs with a bias)")
      ->check(cli::finite_in(0, 1e3));
  app.add_option("--ep", o.ep, "expert-parallel degree")->check(cli::count_in(1, 1 << 20));
  app.add_option("--dp", o.dp, "data-parallel degree")->check(cli::count_in(1, 1 << 20));
  app.add_option("--seed", o.run.seed, "seed of the weights and data")
      ->check(cli::unsigned_integer());
  app.add_option("--log-every", o.log_every, "print the loss every N steps")
      ->check(cli::count_in(1, 1000000000));
  app.add_flag("--fp8", o.fp8,
               "FP8 expert products in the trained stack (the config's fp8: true); the teacher "
               "runs without");
  app.add_option("--capacity-factor", o.capacity_factor,
                 "capacity mode with this factor in the trained stack, 0 for dropless (default: "
                 "the config's); the teacher never drops")
      ->check(cli::finite_in(0, kMaxCapacityFactor));
  app.add_option("--save", o.save_path, "write a checkpoint (safetensors) at the end");
  app.add_option("--load", o.load_path, "resume from a checkpoint")->check(CLI::ExistingFile);
  app.add_option("--json", o.json_path,
                 "write the run's settings and logged steps to this file (rank 0) at the end");
  if (const auto exit_code = cli::parse_or_help(app, argc, argv)) return *exit_code;
  // -0 is 0: stored as given, a resume with 0 would otherwise differ from its checkpoint's "-0".
  o.run.weight_decay += 0.0f;
  o.run.bias_rate += 0.0f;
  try {
    // The checkpoint is written after every step has run: what would make it fail is found now.
    // (--load may name it: the checkpoint is read at the start, and replaced whole at the end.)
    if (app.count("--save") > 0)
      cli::check_output_file("--save", o.save_path, {{"--config", o.config_path}});
    if (app.count("--json") > 0) {
      std::vector<std::pair<std::string, std::string>> inputs = {{"--config", o.config_path}};
      if (!o.load_path.empty()) inputs.emplace_back("--load", o.load_path);
      cli::check_output_file("--json", o.json_path, inputs, cli::Written::kInPlace);
      if (!o.save_path.empty() && cli::same_file(o.json_path, o.save_path))
        fail("--json '{}' and --save '{}' name the same file: each needs its own", o.json_path,
             o.save_path);
    }
    MoEConfig config = load_config(o.config_path);  // the file's own errors, on any machine
    if (o.fp8) config.fp8 = true;
    cli::apply_capacity_factor(config, o.capacity_factor);
    if (app.count("--bias-rate") > 0 && !config.expert_bias)
      fail("--bias-rate {} updates an expert bias, but the config has none (expert_bias: false)",
           o.run.bias_rate);
    train::ResumePlan resume;
    if (!o.load_path.empty()) {
      std::vector<std::string> given;
      for (const char* flag : {"--seed", "--tokens", "--lr", "--weight-decay", "--bias-rate"})
        if (app.count(flag) > 0) given.emplace_back(flag);
      resume = train::check_checkpoint_header(o.load_path, o.layers, o.steps, config, o.run, given);
    }
    comm::MpiSession mpi(&argc, &argv);
    comm::require_same_settings(MPI_COMM_WORLD, cli::settings_text(argc, argv, o.config_path));
    if (mpi.rank() == 0 && !resume.adopted.empty()) {
      fmt::print("moe_train: resuming with the checkpoint's {}\n", fmt::join(resume.adopted, ", "));
      std::fflush(stdout);  // said before anything can end the run
    }
    if (mpi.rank() == 0 && resume.ranks > 0 && resume.ranks != mpi.size()) {
      fmt::print(
          "moe_train: note: {} was saved by a run of {} ranks, this one has {}: its steps draw "
          "other tokens than that run's would\n",
          o.load_path, resume.ranks, mpi.size());
    }
    // The mesh is the ranks started and --ep / --dp; the config's mesh and token count (which
    // moe_bench reads) give way, and are said to.
    const int file_ep = config.ep, file_dp = config.dp;
    std::tie(config.ep, config.dp) = cli::mesh_shape(o.ep, o.dp, mpi.size());
    if (mpi.rank() == 0 && (file_ep > 1 || file_dp > 1) &&
        (file_ep != config.ep || file_dp != config.dp))
      fmt::print(
          "moe_train: note: the config's mesh (ep = {}, dp = {}) gives way to the ranks started "
          "and --ep / --dp: EP {}, DP {}\n",
          file_ep, file_dp, config.ep, config.dp);
    if (mpi.rank() == 0 && config.bench_tokens > 0 && app.count("--tokens") == 0 &&
        config.bench_tokens != o.run.tokens)
      fmt::print(
          "moe_train: note: the config's tokens = {} is moe_bench's; this run takes {} per "
          "GPU (--tokens)\n",
          config.bench_tokens, o.run.tokens);
    std::fflush(stdout);  // the notes said before anything can end the run
    if (config.node_limited_routing() && resume.ep > 0 && resume.ep != config.ep)
      fail(
          "--load '{}' was trained at EP {}, this run has EP {}: node-limited routing "
          "(max_nodes_per_token = {}) routes by the EP ranks' nodes; resume at EP {}",
          o.load_path, resume.ep, config.ep, config.max_nodes_per_token, resume.ep);
    config.validate();
    cli::check_slots_fit(o.run.tokens, config.topk);
    if (!o.save_path.empty()) train::check_checkpoint_fits(config);
    if (const std::string why = config.unsupported_by_gpu_layer(); !why.empty()) fail("{}", why);
    // Every setting is checked first, on any machine.
    if (cuda_device_count() == 0) {
      if (mpi.rank() == 0) std::fprintf(stderr, "moe_train: no CUDA GPU on this machine.\n");
      return 2;
    }
    return run_training(o, config, mpi);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_train: %s\n", e.what());
    return 1;
  }
}
