// moe_train's optimizer state and checkpoints. A checkpoint (safetensors) holds, for every layer,
// the fp32 master weights and AdamW moments of each trained tensor over all experts and the expert
// bias, and in its metadata the step, the layer count, the layer's config and the run's settings
// (seed, tokens per GPU, AdamW's and the bias update's rates, the rank count), so that a run
// resumed from it continues the same run: what the command line leaves out is taken from the
// checkpoint, and what it gives otherwise is refused by name.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "apps/train_kernels.cuh"
#include "moe/config.h"
#include "moe/device.h"
#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "moe/safetensors.h"

namespace moe::train {

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
           cudaStream_t stream);
  void step(AdamWHyper hyper, cudaStream_t stream);
  std::vector<Slot>& slots() { return slots_; }

 private:
  std::vector<Slot> slots_;
};

// A tensor of each layer that moe_train trains, named as its checkpoints name it, in its shape
// over all experts; `expert_sliced`: split over the EP ranks along dim 0 (the experts).
struct TrainedTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  bool expert_sliced = false;
};
// The router's gate and the experts' weights, and the shared experts' (with their gate) where
// the config has them.
std::vector<TrainedTensor> trained_tensors(const MoEConfig& config);
// Throws moe::Error, naming the tensor, where a rank's share of an expert-sliced tensor is more
// than one MPI message carries (INT_MAX values): the checkpoint gathers each share as one, after
// every step has run, so a run that could not save is refused before it starts.
void check_checkpoint_fits(const MoEConfig& config);
// An optimizer over one block's trained tensors, in trained_tensors' order.
std::unique_ptr<AdamW> optimizer_for(const MoEConfig& config, MoEBlock& block, cudaStream_t stream);

// The settings that make a run the run it is, beside the layer's config: a resumed run must
// start from the same ones.
struct RunSettings {
  std::uint64_t seed = 1;
  int tokens = 1024;  // per GPU and step
  float lr = 1e-3f, weight_decay = 0.0f, bias_rate = 1e-3f;
};

// What resuming from a checkpoint found, before MPI or a GPU was touched.
struct ResumePlan {
  int ranks = 0;  // the saving run's rank count (0: not recorded)
  int ep = 0;     // and its EP size, which node-limited routing depends on (0: not recorded)
  std::vector<std::string> adopted;  // the settings taken from the checkpoint, as `--flag value`
};

// Checks the header of the checkpoint to resume from: a moe_train checkpoint of `layers` layers,
// each holding every trained tensor in F32 in the model's shapes (all experts: the checkpoint is
// the whole model, whatever the mesh), of the same layer (its config, leaving the mesh and the
// performance settings aside), its step plus `steps` within an int. `settings` the command line
// gave (`given`: their flags) must equal the checkpoint's; the others take the checkpoint's.
// Every refusal names the file, the setting and both values.
ResumePlan check_checkpoint_header(const std::string& path, int layers, int steps,
                                   const MoEConfig& config, RunSettings& settings,
                                   const std::vector<std::string>& given);

// The config as a checkpoint records the layer: everything that defines what it computes, and
// nothing of the mesh it ran on or of how fast (EP, DP, transport, X kept, the shared experts'
// overlap). Node-limited routing depends on EP too: the checkpoint records EP beside it.
std::string layer_identity(const MoEConfig& config);

// Checkpoints: every tensor in F32 over all E experts. Expert slices travel over the EP group of
// DP index 0 (world ranks 0 .. EP-1) to rank 0, which writes the file.
class Checkpoint {
 public:
  explicit Checkpoint(const Mesh& mesh);
  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  void save(const std::string& path, std::vector<std::unique_ptr<AdamW>>& optimizers,
            std::vector<std::unique_ptr<MoEBlock>>& blocks, int step, const MoEConfig& config,
            const RunSettings& settings, cudaStream_t stream);
  // Returns the step the checkpoint was taken at.
  int load(const std::string& path, std::vector<std::unique_ptr<AdamW>>& optimizers,
           std::vector<std::unique_ptr<MoEBlock>>& blocks, cudaStream_t stream);

 private:
  void put(TensorFile& file, const std::string& name, const Slot& slot, const void* device,
           cudaStream_t stream);
  void take(const TensorFile& file, const std::string& name, const Slot& slot, void* device);

  const Mesh& mesh_;
  MPI_Comm ep_group_ = MPI_COMM_NULL;
};

// fp32 values of device memory, once the work queued on `stream` is done.
std::vector<float> download(const void* device, std::int64_t count, cudaStream_t stream);

}  // namespace moe::train
