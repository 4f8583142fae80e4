// Moving reference parameters into an MoEBlock and its results back out, for the block tests.
#pragma once

#include <cstring>
#include <numeric>
#include <random>

#include "moe/moe_block.h"
#include "reference/reference.h"
#include "support/gpu_util.h"
#include "support/test_util.h"

namespace moe::test {

using reference::transpose;

inline void copy_into(const Tensor& dst, const reference::Matrix& m) {
  const auto buffer = upload_as(m, dst.dtype);
  if (static_cast<std::size_t>(m.rows * m.cols) * dtype_size(dst.dtype) != dst.bytes()) {
    throw Error("copy_into: " + dst.describe() + " does not hold a [" + std::to_string(m.rows) +
                ", " + std::to_string(m.cols) + "] matrix");
  }
  MOE_CHECK_CUDA(cudaMemcpy(dst.data, buffer.data(), dst.bytes(), cudaMemcpyDeviceToDevice));
}

// Waits for the whole device first: the layer's streams are non-blocking, and the copy (on the
// legacy stream) would not wait for them.
inline reference::Matrix read(const Tensor& t, std::int64_t rows, std::int64_t cols) {
  MOE_CHECK_CUDA(cudaDeviceSynchronize());
  reference::Matrix m(rows, cols);
  const auto n = static_cast<std::size_t>(rows * cols);
  if (t.dtype == DType::kBF16) {
    std::vector<BF16> v(n);
    copy_to_host(v.data(), t.data, n * 2);
    for (std::size_t i = 0; i < n; ++i) m.data[i] = from_bf16(v[i]);
  } else {
    std::vector<float> v(n);
    copy_to_host(v.data(), t.data, n * 4);
    for (std::size_t i = 0; i < n; ++i) m.data[i] = v[i];
  }
  return m;
}

// Whole-layer tests compare with the reference that rounds the intermediates the block stores in
// the activation dtype: the gate gradient reaches them through dprob = dy·y, whose cancellation
// turns bf16 storage error into an unbounded relative error at small T (one token gave 2.5% where
// the tolerance is 1%, reproduced exactly by the rounding reference).
inline constexpr auto kAsStored = reference::Intermediates::kAsStored;
// Where MoEBlock forms dprob: in the experts that weigh their rows (one GPU, the peer exchange),
// in the combine over NCCL; the reference rounds along the same path (reference::run_layer).
inline constexpr auto kDprobInExperts = reference::ProbabilityGradient::kExperts;
inline reference::ProbabilityGradient dprob_path(const MoEBlock& block) {
  return block.probabilities_in_experts() ? kDprobInExperts
                                          : reference::ProbabilityGradient::kCombine;
}

// Loads the gate, the bias, experts [first, first + count) and the shared expert into the block
// (nn.Linear layout).
inline void load_params(MoEBlock& block, const reference::Params& p, int first, int count) {
  const auto& view = block.parameters();
  copy_into(view.gate_weight, p.gate_weight);
  reference::Matrix bias(1, static_cast<std::int64_t>(p.expert_bias.size()));
  bias.data = p.expert_bias;
  copy_into(view.expert_bias, bias);
  std::vector<reference::Matrix> w13, w2;
  for (int e = first; e < first + count; ++e) {
    w13.push_back(transpose(p.experts.w13[e]));
    w2.push_back(transpose(p.experts.w2[e]));
  }
  copy_into(view.w13, reference::concat_rows(w13));
  copy_into(view.w2, reference::concat_rows(w2));
  // The shared expert, replicated on every rank (the reference keeps it as [H, 2Fs], [Fs, H]).
  if (view.shared_w13.data != nullptr) {
    copy_into(view.shared_w13, transpose(p.shared.w13));
    copy_into(view.shared_w2, transpose(p.shared.w2));
  }
  if (view.shared_gate_weight.data != nullptr)
    copy_into(view.shared_gate_weight, p.shared.gate_weight);
}

// Draws x one token row at a time, redrawing a row until none of its routing scores is near a tie
// (the GPU's fp32 logits then route exactly as the fp64 reference's). Per row, not per batch: a
// whole batch free of near-ties would be exponentially unlikely.
inline void draw_separated(const MoEConfig& config, const reference::Params& params,
                           reference::Matrix& x, std::int64_t tokens, std::mt19937_64& rng) {
  x = reference::Matrix(tokens, config.hidden);
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (int attempt = 0;; ++attempt) {
      if (attempt == 1000) throw Error("draw_separated: no tie-free row in 1000 draws");
      const reference::Matrix row = round_to(random_matrix(1, config.hidden, rng), config.dtype);
      if (!well_separated(config, reference::matmul_nt(row, params.gate_weight), params.expert_bias,
                          1e-4))
        continue;
      std::copy(row.data.begin(), row.data.end(), x.row(t).begin());
      break;
    }
  }
}

}  // namespace moe::test
