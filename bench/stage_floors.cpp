#include "bench/stage_floors.h"

#include <algorithm>

#include "kernels/fp8_quantize.cuh"
#include "moe/tensor.h"

namespace moe::bench {

double StageWork::floor_ms(const Rates& rates) const {
  double seconds = 0;
  if (flops > 0 && rates.gemm_flops_per_s > 0) seconds = flops / rates.gemm_flops_per_s;
  if (bytes > 0 && rates.copy_bytes_per_s > 0)
    seconds = std::max(seconds, bytes / rates.copy_bytes_per_s);
  if (link_bytes > 0 && rates.link_bytes_per_s > 0)
    seconds = std::max(seconds, link_bytes / rates.link_bytes_per_s);
  return seconds * 1e3;
}

std::vector<StageWork> stage_work(const MoEConfig& config, std::int64_t tokens,
                                  bool probabilities_in_experts) {
  const double T = static_cast<double>(tokens);
  const double H = config.hidden, F = config.ffn_hidden, E = config.num_experts, K = config.topk;
  const double E_loc = config.local_experts();
  const double b = static_cast<double>(dtype_size(config.dtype));
  const double g = static_cast<double>(dtype_size(config.grad_dtype));
  const double rows = T * K;
  // The rows that leave this GPU in each exchange: all but those of its own experts. Under
  // fp8_dispatch those toward the experts (the dispatch and the combine backward) go as records
  // of E4M3 codes and scales, about half of bf16's bytes.
  const double remote = config.ep > 1 ? rows * (config.ep - 1) / config.ep : 0.0;
  const double sent = remote * H * b;
  const double sent_toward_experts =
      config.fp8_dispatch ? remote * static_cast<double>(fp8_row_bytes(config.hidden)) : sent;
  const double expert_weights = E_loc * 3 * H * F;  // w13 [2F, H] and w2 [H, F] per expert

  std::vector<StageWork> stages = {
      // logits [T, E] fp32 = x · Wgᵀ
      {"moe gate", 2 * T * E * H, T * H * b + E * H * b + T * E * 4, 0},
      // logits in; topk_idx and topk_p out
      {"moe router", 0, T * E * 4 + T * K * 8, 0},
  };
  // Capacity mode: the slots' experts, probabilities and the experts' counts read; the kept
  // experts and probabilities written.
  if (config.capacity_mode()) stages.push_back({"moe capacity", 0, 2 * rows * 8 + E * 4, 0});
  stages.push_back({"moe losses", 0, 0, 0});
  const std::vector<StageWork> routed = {
      // x read, one row per slot written (or sent)
      {"moe dispatch", 0, T * H * b + rows * H * b, sent_toward_experts},
      // weights and X read; h (kept for the backward) and Y written
      {"moe experts", 6 * rows * H * F,
       expert_weights * b + rows * H * b + rows * 2 * F * b + rows * H * b, 0},
      // Y read (or received), out written
      {"moe combine", 0, rows * H * b + T * H * b, sent},
      // dy read, dY written; where the combine weighed the rows, Y read again for dprob
      {"moe combine backward", 0, T * H * b + (probabilities_in_experts ? 1 : 2) * rows * H * b,
       sent_toward_experts},
      // weights, dY, h and X read; dX and the weight gradients written
      {"moe experts backward", 12 * rows * H * F,
       expert_weights * b + expert_weights * g + rows * H * b + rows * 2 * F * b + rows * H * b +
           rows * H * b,
       0},
      // dX read (or received), dx written
      {"moe dispatch backward", 0, rows * H * b + T * H * b, sent},
      // logits and dlogits; idx, p and dp
      {"moe router backward", 0, 2 * T * E * 4 + T * K * 12, 0},
      // dlogits, x, Wg read; dx read and written; dWg (fp32) written
      {"moe gate backward", 4 * T * E * H, T * E * 4 + 3 * T * H * b + E * H * b + E * H * 4, 0},
  };
  stages.insert(stages.end(), routed.begin(), routed.end());
  if (!config.shared_experts()) return stages;

  // The shared FFN, one expert of width Fs over every token, counted where MoEBlock's timing
  // names it (its forward joins after the combine, its backward after the gate's): its products
  // must run on this GPU whether its own stream overlaps them or not.
  const double Fs = config.shared_ffn_hidden;
  const double shared_weights = 3 * H * Fs;
  const double gate = config.shared_gate ? T * 4 + H * b : 0.0;  // γ [T] fp32 and its weight
  // forward: weights and x read, h [T, 2Fs] (kept) and y written; out read, y added, out written
  const StageWork shared_forward{
      "moe shared expert", 6 * T * H * Fs,
      shared_weights * b + T * H * b + T * 2 * Fs * b + T * H * b + 3 * T * H * b + gate, 0};
  // backward: weights, dy, h and x read; the weight gradients and dX written; dx read, dX added,
  // dx written
  const StageWork shared_backward{"moe shared expert backward", 12 * T * H * Fs,
                                  shared_weights * (b + g) + 2 * T * H * b + T * 2 * Fs * b +
                                      T * H * b + 3 * T * H * b + 2 * gate + (gate > 0 ? H * 4 : 0),
                                  0};
  const auto after = [&](const char* name) {
    return std::find_if(stages.begin(), stages.end(),
                        [&](const StageWork& s) { return s.name == name; }) +
           1;
  };
  stages.insert(after("moe combine"), shared_forward);
  stages.insert(after("moe gate backward"), shared_backward);
  return stages;
}

StageWork gradient_reduction_work(const MoEConfig& config) {
  const double H = config.hidden, F = config.ffn_hidden, E = config.num_experts;
  const double g = static_cast<double>(dtype_size(config.grad_dtype));
  const double expert_weights = static_cast<double>(config.local_experts()) * 3 * H * F;
  // Gradient reduction: ring all-reduces move 2(n − 1)/n of the data; the expert gradients over
  // the DP group (in the gradient dtype), the gate's (fp32) over the world; each element is read
  // and written once in memory.
  const double dp = config.dp, world = config.ep * config.dp;
  const double expert_grad_bytes = expert_weights * g;
  const double gate_grad_bytes = E * H * 4;
  const double reduce_link = (dp > 1 ? 2 * (dp - 1) / dp * expert_grad_bytes : 0.0) +
                             (world > 1 ? 2 * (world - 1) / world * gate_grad_bytes : 0.0);
  const double reduce_bytes =
      (dp > 1 ? 2 * expert_grad_bytes : 0.0) + (world > 1 ? 2 * gate_grad_bytes : 0.0);

  return {"moe gradient reduction", 0, reduce_bytes, reduce_link};
}

double step_floor_ms(const std::vector<StageWork>& stages, const Rates& rates) {
  double total = 0;
  for (const auto& stage : stages) total += stage.floor_ms(rates);
  return total;
}

}  // namespace moe::bench
