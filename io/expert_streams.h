// The fp64 reference's experts streamed through files: each expert's weights read from the
// weights file when the reference asks for them, each expert's gradients written to the results
// file as soon as they are known. moe_run --reference runs layers whose experts do not fit in
// memory as doubles this way (deepseek-v3: 90 GB), holding one expert at a time.
#pragma once

#include "moe/config.h"
#include "moe/safetensors.h"
#include "reference/reference.h"

namespace moe {

// Expert e: rows e of w13 [E, 2F, H] and w2 [E, H, F], converted to doubles and to the
// reference's layout (w13 [H, 2F], w2 [F, H]), the values read_layer_inputs gives. The weights
// file must outlive this and should have passed check_layer_files.
class FileExperts final : public reference::ExpertSource {
 public:
  FileExperts(const MoEConfig& config, const TensorSource& weights);
  int num_experts() const override { return config_.num_experts; }
  reference::ExpertWeights load(int expert) const override;

 private:
  MoEConfig config_;
  const TensorSource& weights_;
};

// Appends each expert's gradients to grad.w13 and grad.w2 of a results file being written (the
// writer declared with layer_results_specs), as F32 in the files' layout: the bytes
// layer_results_file would hold. Experts must come in order, 0 to E-1.
class FileExpertGrads final : public reference::ExpertGradSink {
 public:
  FileExpertGrads(const MoEConfig& config, TensorFileWriter& writer);
  void take(int expert, reference::Matrix dw13, reference::Matrix dw2) override;

 private:
  MoEConfig config_;
  TensorFileWriter& writer_;
  int next_ = 0;
};

}  // namespace moe
