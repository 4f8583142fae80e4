// moe_train: a small trainer that embeds moe::MoEBlock the way a real one does, and README's
// example of doing so.
//
//   mpirun -np N build/apps/moe_train [--config configs/small.yaml] [--layers 2] [--steps 200]
//                                     [--tokens 1024] [--lr 1e-3] [--ep E --dp D]
//                                     [--fp8] [--capacity-factor C]
//                                     [--save ckpt.safetensors] [--load ckpt.safetensors]
//                                     [--json train.json]
//
// The task can be learned: regression onto a fixed random teacher of the same shape. The model is
// a residual stack h_{l+1} = h_l + MoE_l(h_l) over random tokens; the loss is the mean squared
// error to the teacher's output over the global batch, plus the layers' aux and z losses. AdamW
// with fp32 master weights on the GPU, gradients summed over the mesh by the blocks, the
// aux-loss-free expert-bias update when the config has a bias, and checkpoints in safetensors
// (master weights and optimizer moments of all experts, gathered on rank 0). --json writes the
// run's settings and each logged step (loss, router losses, the first layer's load imbalance
// since the step logged before, and in capacity mode the share of its slots dropped) for
// bench/plot_train.py.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <charconv>
#include <chrono>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

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
#include "moe/safetensors.h"

using namespace moe;

namespace {

struct Options {
  std::string config_path = std::string(MOE_SOURCE_DIR) + "/configs/small.yaml";
  int layers = 2, steps = 200, tokens = 1024, ep = 0, dp = 0, log_every = 10;
  float lr = 1e-3f, weight_decay = 0.0f, bias_rate = 1e-3f;
  std::uint64_t seed = 1;
  double capacity_factor = -1;  // below 0: the config's
  bool fp8 = false;
  std::string save_path, load_path, json_path;
};

// One parameter under AdamW: the block's tensor (bf16 or fp32) and its gradient, with fp32 master
// weights and moments. `expert_sliced`: the tensor holds this rank's experts of a [E, ...] whole.
struct Slot {
  std::string name;
  Tensor param, grad;
  bool expert_sliced = false;
  DeviceBuffer master, m, v;
  Tensor master_view() { return {master.data(), DType::kFP32, param.shape}; }
};

class AdamW {
 public:
  void add(std::string name, const Tensor& param, const Tensor& grad, bool expert_sliced,
           cudaStream_t stream) {
    Slot slot;
    slot.name = std::move(name);
    slot.param = param;
    slot.grad = grad;
    slot.expert_sliced = expert_sliced;
    const std::size_t bytes = std::max<std::size_t>(param.numel() * 4, 4);
    slot.master.reserve(bytes);
    slot.m.reserve(bytes);
    slot.v.reserve(bytes);
    convert(param, slot.master_view(), stream);
    MOE_CHECK_CUDA(cudaMemsetAsync(slot.m.data(), 0, bytes, stream));
    MOE_CHECK_CUDA(cudaMemsetAsync(slot.v.data(), 0, bytes, stream));
    slots_.push_back(std::move(slot));
  }
  void step(train::AdamWHyper hyper, cudaStream_t stream) {
    for (auto& s : slots_)
      train::adamw_step(hyper, s.grad, s.master.as<float>(), s.m.as<float>(), s.v.as<float>(),
                        s.param, stream);
  }
  std::vector<Slot>& slots() { return slots_; }

 private:
  std::vector<Slot> slots_;
};

// fp32 values of device memory, once the work queued on `stream` is done.
std::vector<float> download(const void* device, std::int64_t count, cudaStream_t stream) {
  MOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<float> host(static_cast<std::size_t>(count));
  copy_to_host(host.data(), device, host.size() * 4);
  return host;
}

// A checkpoint's metadata value that counts something: decimal digits alone, within an int.
int metadata_count(const std::string& path, std::string_view key, const std::string& text) {
  int value = -1;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() || value < 0)
    fail("{}: metadata {} = '{}' is not a non-negative integer", path, key, text);
  return value;
}

// Checkpoints: every tensor in F32 over all E experts. Expert slices travel over the EP group of
// DP index 0 (world ranks 0 .. EP-1) to rank 0, which writes the file.
class Checkpoint {
 public:
  explicit Checkpoint(const Mesh& mesh) : mesh_(mesh) {
    MOE_CHECK_MPI(MPI_Comm_split(MPI_COMM_WORLD, mesh.dp_index(), mesh.ep_index(), &ep_group_));
  }
  ~Checkpoint() { (void)MPI_Comm_free(&ep_group_); }
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  void save(const std::string& path, std::vector<std::unique_ptr<AdamW>>& optimizers,
            std::vector<std::unique_ptr<MoEBlock>>& blocks, int step, const MoEConfig& config,
            cudaStream_t stream) {
    TensorFile file;
    for (std::size_t l = 0; l < optimizers.size(); ++l) {
      for (auto& slot : optimizers[l]->slots()) {
        const std::string base = fmt::format("layers.{}.{}", l, slot.name);
        put(file, base, slot, slot.master.data(), stream);
        put(file, base + ".exp_avg", slot, slot.m.data(), stream);
        put(file, base + ".exp_avg_sq", slot, slot.v.data(), stream);
      }
      const Tensor bias = blocks[l]->parameters().expert_bias;
      const auto values = download(bias.data, bias.numel(), stream);
      file.add(fmt::format("layers.{}.expert_bias", l), FileDType::kF32, bias.shape, values.data());
    }
    if (mesh_.rank() != 0) return;
    file.metadata["step"] = std::to_string(step);
    file.metadata["layers"] = std::to_string(optimizers.size());
    file.metadata["config"] = config.describe();
    file.write(path);
  }

  // Returns the step the checkpoint was taken at.
  int load(const std::string& path, std::vector<std::unique_ptr<AdamW>>& optimizers,
           std::vector<std::unique_ptr<MoEBlock>>& blocks, cudaStream_t stream) {
    const TensorFile file = TensorFile::read(path);
    const auto layers = static_cast<std::size_t>(metadata_int(file, path, "layers"));
    if (layers != optimizers.size())
      fail("{} holds {} layers, the model has {}", path, layers, optimizers.size());
    for (std::size_t l = 0; l < optimizers.size(); ++l) {
      for (auto& slot : optimizers[l]->slots()) {
        const std::string base = fmt::format("layers.{}.{}", l, slot.name);
        take(file, base, slot, slot.master.data());
        take(file, base + ".exp_avg", slot, slot.m.data());
        take(file, base + ".exp_avg_sq", slot, slot.v.data());
        convert(slot.master_view(), slot.param, stream);
      }
      const Tensor bias = blocks[l]->parameters().expert_bias;
      const auto& stored = file.get(fmt::format("layers.{}.expert_bias", l));
      if (stored.dtype != FileDType::kF32 || stored.shape != bias.shape)
        fail("{}: layers.{}.expert_bias has the wrong dtype or shape", path, l);
      copy_to_device(bias.data, stored.data.data(), stored.data.size());
    }
    return metadata_int(file, path, "step");
  }

 private:
  static int metadata_int(const TensorFile& file, const std::string& path, const char* key) {
    const auto found = file.metadata.find(key);
    if (found == file.metadata.end()) fail("{} has no '{}' in its metadata", path, key);
    return metadata_count(path, key, found->second);
  }

  // Adds the whole tensor (all experts) to the file on rank 0.
  void put(TensorFile& file, const std::string& name, const Slot& slot, const void* device,
           cudaStream_t stream) {
    const auto local = download(device, slot.param.numel(), stream);
    std::vector<std::int64_t> shape = slot.param.shape;
    if (!slot.expert_sliced) {
      if (mesh_.rank() == 0) file.add(name, FileDType::kF32, shape, local.data());
      return;
    }
    if (mesh_.dp_index() != 0) return;  // DP replicas hold the same experts
    if (local.size() > static_cast<std::size_t>(INT_MAX))
      fail("{} has {} elements per rank, more than one MPI message holds", name, local.size());
    std::vector<float> all(mesh_.rank() == 0 ? local.size() * mesh_.ep() : 0);
    MOE_CHECK_MPI(MPI_Gather(local.data(), static_cast<int>(local.size()), MPI_FLOAT, all.data(),
                             static_cast<int>(local.size()), MPI_FLOAT, 0, ep_group_));
    shape[0] *= mesh_.ep();
    if (mesh_.rank() == 0) file.add(name, FileDType::kF32, shape, all.data());
  }

  void take(const TensorFile& file, const std::string& name, const Slot& slot, void* device) {
    const auto& stored = file.get(name);
    std::vector<std::int64_t> shape = slot.param.shape;
    if (slot.expert_sliced) shape[0] *= mesh_.ep();
    if (stored.dtype != FileDType::kF32 || stored.shape != shape)
      fail("checkpoint tensor {} is {}{}, expected F32 of {} elements along dim 0", name,
           file_dtype_name(stored.dtype), fmt::join(stored.shape, "x"), shape[0]);
    const std::size_t bytes = static_cast<std::size_t>(slot.param.numel()) * 4;
    const std::size_t first = slot.expert_sliced ? bytes * mesh_.ep_index() : 0;
    copy_to_device(device, stored.data.data() + first, bytes);
  }

  const Mesh& mesh_;
  MPI_Comm ep_group_ = MPI_COMM_NULL;
};

// What the header of a checkpoint to resume from must say, checked before anything starts: a
// moe_train checkpoint of as many layers, each with every tensor the model's layer holds, F32 in
// the layer's shapes (all experts: the checkpoint is the whole model, whatever the mesh).
void check_checkpoint_header(const std::string& path, int layers, int steps,
                             const MoEConfig& config) {
  const TensorFileReader file(path);
  const auto& metadata = file.metadata();
  for (const char* key : {"step", "layers", "config"}) {
    if (metadata.find(key) == metadata.end())
      fail("--load '{}' is not a moe_train checkpoint: its metadata has no '{}'", path, key);
  }
  const int step = metadata_count(path, "step", metadata.at("step"));
  if (step > INT_MAX - steps)
    fail("--load '{}' was taken at step {}: {} more (--steps) pass the largest step, {}", path,
         step, steps, INT_MAX);
  if (metadata.at("layers") != std::to_string(layers))
    fail("--load '{}' holds {} layers, the model has {} (--layers)", path, metadata.at("layers"),
         layers);
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden;
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> tensors = {
      {"gate_weight", {E, H}}, {"w13", {E, 2 * F, H}}, {"w2", {E, H, F}}};
  for (int l = 0; l < layers; ++l) {
    auto expect = [&](const std::string& name, const std::vector<std::int64_t>& shape) {
      if (!file.contains(name))
        fail("--load '{}' has no tensor {} (a checkpoint of another model?)", path, name);
      const TensorInfo info = file.info(name);
      if (info.dtype != FileDType::kF32 || info.shape != shape)
        fail("--load '{}': {} is {}[{}], the model's layer needs F32[{}] ({})", path, name,
             file_dtype_name(info.dtype), fmt::join(info.shape, ", "), fmt::join(shape, ", "),
             config.describe());
    };
    for (const auto& [name, shape] : tensors) {
      const std::string base = fmt::format("layers.{}.{}", l, name);
      for (const char* suffix : {"", ".exp_avg", ".exp_avg_sq"}) expect(base + suffix, shape);
    }
    expect(fmt::format("layers.{}.expert_bias", l), {E});
  }
}

// `config` is checked against the mesh's shape already.
int run_training(const Options& o, const MoEConfig& config, comm::MpiSession& mpi) {
  const int world = mpi.size();
  const int ep = config.ep, dp = config.dp;
  const Mesh mesh = Mesh::from_mpi(MPI_COMM_WORLD, ep, dp, config.num_experts);
  const bool root = mesh.rank() == 0;
  Stream stream;
  const std::int64_t T = o.tokens, H = config.hidden;
  const std::int64_t global_tokens = T * world;

  // The student (trained) and the teacher (fixed, a different seed) stacks. The teacher runs
  // without FP8 and without drops, so that runs with them and without chase the same targets.
  MoEConfig teacher_config = config;
  teacher_config.fp8 = false;
  teacher_config.capacity_factor = 0;
  teacher_config.pad_to_capacity = false;
  std::vector<std::unique_ptr<MoEBlock>> student, teacher;
  std::vector<std::unique_ptr<AdamW>> optimizers;
  // Every layer runs on one stream, one call after another: they share what lives inside a call.
  const auto scratch = std::make_shared<MoEScratch>();
  for (int l = 0; l < o.layers; ++l) {
    student.push_back(std::make_unique<MoEBlock>(config, mesh, stream.get(), scratch));
    student.back()->initialize(o.seed * 1000 + l);
    teacher.push_back(std::make_unique<MoEBlock>(teacher_config, mesh, stream.get(), scratch));
    teacher.back()->initialize(o.seed * 1000 + 500 + l);
    auto optimizer = std::make_unique<AdamW>();
    const auto& p = student.back()->parameters();
    const auto& g = student.back()->gradients();
    optimizer->add("gate_weight", p.gate_weight, g.gate_weight, false, stream.get());
    optimizer->add("w13", p.w13, g.w13, true, stream.get());
    optimizer->add("w2", p.w2, g.w2, true, stream.get());
    optimizers.push_back(std::move(optimizer));
  }
  Checkpoint checkpoint(mesh);
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
        o.layers, config.describe(), world, ep, dp, T, o.lr);
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
    init_normal(h[0], o.seed * 7919 + 17,
                static_cast<std::uint64_t>(step * world + mesh.rank()) * T * H, 1.0f, stream.get());
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
    const auto sums = download(partial.data(), parts, stream.get());  // the step's one wait
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
    hyper.lr = o.lr;
    hyper.weight_decay = o.weight_decay;
    hyper.step = step + 1;
    for (int l = 0; l < o.layers; ++l) {
      student[l]->reduce_gradients();
      optimizers[l]->step(hyper, stream.get());
      if (config.expert_bias) student[l]->update_expert_bias(o.bias_rate);
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
    checkpoint.save(o.save_path, optimizers, student, first_step + o.steps, config, stream.get());
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
        {"lr", o.lr},
        {"weight_decay", o.weight_decay},
        {"bias_rate", config.expert_bias ? o.bias_rate : 0.0f},
        {"fp8", config.fp8},
        {"capacity_factor", config.capacity_factor},
        {"seed", o.seed},
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
  Options o;
  app.add_option("--config", o.config_path, "layer config (YAML)")->check(CLI::ExistingFile);
  app.add_option("--layers", o.layers, "MoE layers")->check(cli::count_in(1, 4096));
  app.add_option("--steps", o.steps, "optimizer steps in this run")
      ->check(cli::count_in(0, 1000000000));
  app.add_option("--tokens", o.tokens, "tokens per GPU per step")->check(cli::count_in(1, 1 << 30));
  app.add_option("--lr", o.lr, "AdamW learning rate")->check(cli::finite_in(1e-30, 1e3));
  app.add_option("--weight-decay", o.weight_decay, "AdamW decoupled weight decay")
      ->check(cli::finite_in(0, 1e3));
  app.add_option("--bias-rate", o.bias_rate, "expert-bias update rate (configs with a bias)")
      ->check(cli::finite_in(0, 1e3));
  app.add_option("--ep", o.ep, "expert-parallel degree")->check(cli::count_in(1, 1 << 20));
  app.add_option("--dp", o.dp, "data-parallel degree")->check(cli::count_in(1, 1 << 20));
  app.add_option("--seed", o.seed, "seed of the weights and data")->check(cli::unsigned_integer());
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
  try {
    // The checkpoint is written after every step has run: what would make it fail is found now.
    // (--load may name it: the checkpoint is read at the start, and replaced whole at the end.)
    if (app.count("--save") > 0)
      cli::check_output_file("--save", o.save_path, {{"--config", o.config_path}});
    if (app.count("--json") > 0) {
      std::vector<std::pair<std::string, std::string>> inputs = {{"--config", o.config_path}};
      if (!o.load_path.empty()) inputs.emplace_back("--load", o.load_path);
      if (!o.save_path.empty()) inputs.emplace_back("--save", o.save_path);
      cli::check_output_file("--json", o.json_path, inputs);
    }
    MoEConfig config = load_config(o.config_path);  // the file's own errors, on any machine
    if (o.fp8) config.fp8 = true;
    cli::apply_capacity_factor(config, o.capacity_factor);
    if (!o.load_path.empty()) check_checkpoint_header(o.load_path, o.layers, o.steps, config);
    comm::MpiSession mpi(&argc, &argv);
    std::tie(config.ep, config.dp) = cli::mesh_shape(o.ep, o.dp, mpi.size());
    config.validate();
    cli::check_slots_fit(o.tokens, config.topk);
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
