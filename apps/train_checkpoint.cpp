#include "apps/train_checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <string_view>

#include "kernels/elementwise.cuh"
#include "moe/error.h"

namespace moe::train {

void AdamW::add(std::string name, const Tensor& param, const Tensor& grad, bool expert_sliced,
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

void AdamW::step(AdamWHyper hyper, cudaStream_t stream) {
  for (auto& s : slots_)
    adamw_step(hyper, s.grad, s.master.as<float>(), s.m.as<float>(), s.v.as<float>(), s.param,
               stream);
}

std::vector<TrainedTensor> trained_tensors(const MoEConfig& config) {
  const std::int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden;
  std::vector<TrainedTensor> tensors = {
      {"gate_weight", {E, H}, false}, {"w13", {E, 2 * F, H}, true}, {"w2", {E, H, F}, true}};
  if (config.shared_experts()) {  // replicated on every rank, as the gate is
    const std::int64_t Fs = config.shared_ffn_hidden;
    tensors.push_back({"shared_w13", {2 * Fs, H}, false});
    tensors.push_back({"shared_w2", {H, Fs}, false});
    if (config.shared_gate) tensors.push_back({"shared_gate_weight", {1, H}, false});
  }
  return tensors;
}

void check_checkpoint_fits(const MoEConfig& config) {
  for (const TrainedTensor& t : trained_tensors(config)) {
    if (!t.expert_sliced) continue;
    std::int64_t share = 1;
    for (const std::int64_t d : t.shape) share *= d;  // at most 2^11 · 2^21 · 2^20: no overflow
    share /= config.ep;
    if (share > INT_MAX)
      fail(
          "--save: {} holds {} values a rank at EP {}, more than one MPI message carries ({}); "
          "a larger --ep splits it further",
          t.name, share, config.ep, INT_MAX);
  }
}

std::unique_ptr<AdamW> optimizer_for(const MoEConfig& config, MoEBlock& block,
                                     cudaStream_t stream) {
  const MoEParameters& p = block.parameters();
  const MoEGradients& g = block.gradients();
  const std::map<std::string, std::pair<Tensor, Tensor>> tensors = {
      {"gate_weight", {p.gate_weight, g.gate_weight}},
      {"w13", {p.w13, g.w13}},
      {"w2", {p.w2, g.w2}},
      {"shared_w13", {p.shared_w13, g.shared_w13}},
      {"shared_w2", {p.shared_w2, g.shared_w2}},
      {"shared_gate_weight", {p.shared_gate_weight, g.shared_gate_weight}}};
  auto optimizer = std::make_unique<AdamW>();
  for (const TrainedTensor& t : trained_tensors(config)) {
    const auto& [param, grad] = tensors.at(t.name);
    optimizer->add(t.name, param, grad, t.expert_sliced, stream);
  }
  return optimizer;
}

std::string layer_identity(const MoEConfig& config) {
  MoEConfig layer = config;
  layer.ep = layer.dp = 1;
  layer.ep_transport = EpTransport::kAuto;
  layer.keep_expert_input = false;
  layer.shared_expert_overlap = true;  // in series, the same bits
  return layer.describe();
}

std::vector<float> download(const void* device, std::int64_t count, cudaStream_t stream) {
  MOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<float> host(static_cast<std::size_t>(count));
  copy_to_host(host.data(), device, host.size() * 4);
  return host;
}

namespace {

// A checkpoint's metadata value that counts something: decimal digits alone, no leading zero (as
// every count moe_train reads), within an int.
int metadata_count(const std::string& path, std::string_view key, const std::string& text) {
  int value = -1;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() || value < 0 ||
      (text.size() > 1 && text[0] == '0'))
    fail("{}: metadata {} = '{}' is not a non-negative integer", path, key, text);
  return value;
}

// Weights, moments and biases that are not finite would train NaN from the first step on: the F32
// `values` of tensor `name` are refused naming the first that is not.
void require_finite(const std::string& name, std::span<const std::byte> values) {
  for (std::size_t i = 0; i < values.size() / 4; ++i) {
    float value = 0;
    std::memcpy(&value, values.data() + 4 * i, 4);
    if (!std::isfinite(value))
      fail("checkpoint tensor {} holds {} at element {}: a checkpoint's values are finite", name,
           value, i);
  }
}

// `text` whole as a T, within [low, high].
template <typename T>
bool read_whole(const std::string& text, T& value, T low, T high) {
  T read{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), read);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) return false;
  if (!(read >= low && read <= high)) return false;  // NaN too
  value = read;
  return true;
}

// One of RunSettings: its metadata key, its flag, its text as the checkpoint writes it, and how
// it is read back (within the range its flag takes; false where it is not).
struct SettingField {
  const char* key;
  const char* flag;
  std::function<std::string(const RunSettings&)> text;
  std::function<bool(const std::string&, RunSettings&)> read;
};

std::vector<SettingField> setting_fields() {
  const auto decimal = [](auto value) { return fmt::format("{}", value); };
  return {
      {"seed", "--seed", [=](const RunSettings& s) { return decimal(s.seed); },
       [](const std::string& t, RunSettings& s) {
         return read_whole<std::uint64_t>(t, s.seed, 0, UINT64_MAX);
       }},
      {"tokens", "--tokens", [=](const RunSettings& s) { return decimal(s.tokens); },
       [](const std::string& t, RunSettings& s) { return read_whole(t, s.tokens, 1, 1 << 30); }},
      {"lr", "--lr", [=](const RunSettings& s) { return decimal(s.lr); },
       [](const std::string& t, RunSettings& s) { return read_whole(t, s.lr, 1e-30f, 1e3f); }},
      {"weight_decay", "--weight-decay",
       [=](const RunSettings& s) { return decimal(s.weight_decay); },
       [](const std::string& t, RunSettings& s) {
         return read_whole(t, s.weight_decay, 0.0f, 1e3f);
       }},
      {"bias_rate", "--bias-rate", [=](const RunSettings& s) { return decimal(s.bias_rate); },
       [](const std::string& t, RunSettings& s) { return read_whole(t, s.bias_rate, 0.0f, 1e3f); }},
  };
}

}  // namespace

ResumePlan check_checkpoint_header(const std::string& path, int layers, int steps,
                                   const MoEConfig& config, RunSettings& settings,
                                   const std::vector<std::string>& given) {
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
  // Checkpoints record the layer and the run's settings; those of older builds may not.
  if (const auto found = metadata.find("layer");
      found != metadata.end() && found->second != layer_identity(config)) {
    fail(
        "--load '{}' holds a layer of {}, but --config gives {}: resume with the config (and "
        "--fp8, --capacity-factor) it was trained with",
        path, found->second, layer_identity(config));
  }
  ResumePlan plan;
  for (const SettingField& field : setting_fields()) {
    const auto found = metadata.find(field.key);
    if (found == metadata.end()) continue;
    RunSettings stored = settings;
    if (!field.read(found->second, stored))
      fail("--load '{}': metadata {} = '{}' is not a value {} takes", path, field.key,
           found->second, field.flag);
    const bool flag_given = std::find(given.begin(), given.end(), field.flag) != given.end();
    const std::string mine = field.text(settings), theirs = field.text(stored);
    if (flag_given && mine != theirs) {
      fail(
          "--load '{}' was trained with {} {}, but this run gives {} {}: a resumed run keeps the "
          "run's settings (leave {} out to take the checkpoint's)",
          path, field.flag, theirs, field.flag, mine, field.flag);
    }
    if (!flag_given) {
      settings = stored;
      plan.adopted.push_back(fmt::format("{} {}", field.flag, theirs));
    }
  }
  if (const auto found = metadata.find("ranks"); found != metadata.end())
    plan.ranks = metadata_count(path, "ranks", found->second);
  if (const auto found = metadata.find("ep"); found != metadata.end())
    plan.ep = metadata_count(path, "ep", found->second);
  // A run of `ranks` ranks at EP `ep`: the EP divides the ranks (a mesh is EP × DP).
  const bool names_ep = metadata.find("ep") != metadata.end();
  if (names_ep && (plan.ep == 0 || (plan.ranks > 0 && plan.ranks % plan.ep != 0)))
    fail("--load '{}': metadata ep = {} does not divide its ranks = {}: no mesh saved it", path,
         plan.ep, plan.ranks);
  // Every tensor belongs to one of the checkpoint's layers: one past them would be dropped.
  constexpr std::string_view kPrefix = "layers.";
  for (const std::string& name : file.names()) {
    int layer = -1;
    bool in_a_layer = name.starts_with(kPrefix);
    if (in_a_layer) {
      const auto [end, error] =
          std::from_chars(name.data() + kPrefix.size(), name.data() + name.size(), layer);
      in_a_layer =
          error == std::errc() && *end == '.' && layer >= 0 && layer < layers;  // '\0' at the end
    }
    if (!in_a_layer)
      fail("--load '{}' holds tensor {}, outside the model's {} layers", path, name, layers);
  }
  std::set<std::string> wanted;  // every tensor a layer reads, to refuse the others
  const bool recorded_layer = metadata.find("layer") != metadata.end();
  std::vector<TrainedTensor> tensors = trained_tensors(config);
  tensors.push_back({"expert_bias", {config.num_experts}, false});
  for (int l = 0; l < layers; ++l) {
    for (const TrainedTensor& t : tensors) {
      const bool moments = t.name != "expert_bias";
      for (const char* suffix : {"", ".exp_avg", ".exp_avg_sq"}) {
        if (!moments && *suffix != '\0') continue;
        const std::string name = fmt::format("layers.{}.{}{}", l, t.name, suffix);
        wanted.insert(name);
        if (!file.contains(name) && !recorded_layer && t.name.starts_with("shared_"))
          fail(
              "--load '{}' has no tensor {}: it was saved by a build of moe_train that did not "
              "train the shared experts, so it cannot resume this layer",
              path, name);
        if (!file.contains(name))
          fail("--load '{}' has no tensor {} (a checkpoint of another model?)", path, name);
        const TensorInfo info = file.info(name);
        if (info.dtype != FileDType::kF32 || info.shape != t.shape)
          fail("--load '{}': {} is {}[{}], the model's layer needs F32[{}] ({})", path, name,
               file_dtype_name(info.dtype), fmt::join(info.shape, ", "), fmt::join(t.shape, ", "),
               config.describe());
      }
    }
  }
  for (const std::string& name : file.names()) {
    if (!wanted.contains(name))
      fail(
          "--load '{}' holds tensor {}, which no layer of the model reads (a checkpoint of "
          "another model?)",
          path, name);
  }
  return plan;
}

Checkpoint::Checkpoint(const Mesh& mesh) : mesh_(mesh) {
  MOE_CHECK_MPI(MPI_Comm_split(MPI_COMM_WORLD, mesh.dp_index(), mesh.ep_index(), &ep_group_));
}

Checkpoint::~Checkpoint() {
  (void)MPI_Comm_free(&ep_group_);
}

void Checkpoint::save(const std::string& path, std::vector<std::unique_ptr<AdamW>>& optimizers,
                      std::vector<std::unique_ptr<MoEBlock>>& blocks, int step,
                      const MoEConfig& config, const RunSettings& settings, cudaStream_t stream) {
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
  file.metadata["layer"] = layer_identity(config);
  for (const SettingField& field : setting_fields())
    file.metadata[field.key] = field.text(settings);
  file.metadata["ranks"] = std::to_string(mesh_.world_size());
  file.metadata["ep"] = std::to_string(mesh_.ep());
  file.write(path);
}

int Checkpoint::load(const std::string& path, std::vector<std::unique_ptr<AdamW>>& optimizers,
                     std::vector<std::unique_ptr<MoEBlock>>& blocks, cudaStream_t stream) {
  const TensorFile file = TensorFile::read(path);
  const auto count = [&](const char* key) {
    const auto found = file.metadata.find(key);
    if (found == file.metadata.end()) fail("{} has no '{}' in its metadata", path, key);
    return metadata_count(path, key, found->second);
  };
  const auto layers = static_cast<std::size_t>(count("layers"));
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
    require_finite(fmt::format("layers.{}.expert_bias", l), stored.data);
    copy_to_device(bias.data, stored.data.data(), stored.data.size());
  }
  return count("step");
}

// Adds the whole tensor (all experts) to the file on rank 0.
void Checkpoint::put(TensorFile& file, const std::string& name, const Slot& slot,
                     const void* device, cudaStream_t stream) {
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

void Checkpoint::take(const TensorFile& file, const std::string& name, const Slot& slot,
                      void* device) {
  const auto& stored = file.get(name);
  std::vector<std::int64_t> shape = slot.param.shape;
  if (slot.expert_sliced) shape[0] *= mesh_.ep();
  if (stored.dtype != FileDType::kF32 || stored.shape != shape)
    fail("checkpoint tensor {} is {}{}, expected F32 of {} elements along dim 0", name,
         file_dtype_name(stored.dtype), fmt::join(stored.shape, "x"), shape[0]);
  const std::size_t bytes = static_cast<std::size_t>(slot.param.numel()) * 4;
  const std::size_t first = slot.expert_sliced ? bytes * mesh_.ep_index() : 0;
  // The whole tensor, not this rank's share: every rank refuses the same file alike, where one
  // failing alone would leave its peers to wait in the first collective.
  require_finite(name, stored.data);
  copy_to_device(device, stored.data.data() + first, bytes);
}

}  // namespace moe::train
