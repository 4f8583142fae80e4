#include "src/router_stage.h"

#include "kernels/elementwise.cuh"
#include "moe/error.h"
#include "src/stage_support.h"

namespace moe {

RouterParams router_params(const MoEConfig& config) {
  RouterParams p;
  p.num_experts = config.num_experts;
  p.topk = config.topk;
  p.score_function = config.score_function;
  p.pre_softmax = config.pre_softmax;
  p.num_groups = config.routing_groups().count;  // node-limited routing: one group per node
  p.group_topk = config.routing_groups().topk;
  p.scaling_factor = static_cast<float>(config.scaling_factor);
  p.expert_bias = config.expert_bias;
  p.aux_loss = config.aux_loss_coeff > 0;
  p.z_loss = config.z_loss_coeff > 0;
  return p;
}

RouterStage::RouterStage(const MoEConfig& config, const Mesh& mesh, DeviceBuffer& workspace)
    : config_(config), mesh_(mesh), params_(router_params(config)), workspace_(workspace) {}

void RouterStage::forward(const Tensor& logits, const Tensor& expert_bias,
                          const std::int32_t* given, cudaStream_t stream) {
  const std::int64_t T = logits.dim(0);
  const int E = config_.num_experts, K = config_.topk;
  saved_.logits = logits;
  RouterForwardArgs a;
  a.logits = logits.data;
  a.tokens = T;
  a.topk_idx = typed<std::int32_t>(topk_idx_, T * K);
  a.topk_p = typed<float>(topk_p_, T * K);
  a.tokens_per_expert = typed<std::int32_t>(counts_, E);
  a.aux_tokens_per_expert = typed<std::int32_t>(aux_counts_, E);
  a.aux_score_sum = typed<float>(score_sum_, E);
  a.z_sum = typed<float>(z_sum_, 1);
  typed<std::int32_t>(global_load_, E);
  if (config_.capacity_mode()) typed<std::int32_t>(global_dropped_, E);
  // The totals (and in capacity mode the drops') exist before reduce_losses queues its group.
  if (load_total_.bytes() == 0) reset_load_total(stream);
  auto* totals = typed<RouterTotals>(scalars_, 1);
  a.expert_bias = config_.expert_bias ? expert_bias.as<float>() : nullptr;
  const std::size_t workspace_bytes = router_workspace_bytes(params_, T);
  if (workspace_.bytes() < workspace_bytes) {  // a new allocation starts cleared
    workspace_.reserve(workspace_bytes);
    router_workspace_clear(params_, workspace_.data(), stream);
  }
  a.workspace = workspace_.data();
  if (mesh_.world_size() == 1) {  // these tokens are the whole batch: losses come with them
    a.losses = reinterpret_cast<float*>(&totals->losses);
    a.aux_loss_coeff = config_.aux_loss_coeff;
    a.z_loss_coeff = config_.z_loss_coeff;
  }
  router_forward(params_, a, stream);
  MOE_CHECK_CUDA(cudaMemsetAsync(&totals->first_invalid_given, 0xff,
                                 sizeof(totals->first_invalid_given), stream));
  if (given != nullptr) {
    RouterReplayArgs r;
    r.logits = logits.as<float>();
    r.given = given;
    r.tokens = T;
    r.topk_idx = a.topk_idx;
    r.topk_p = a.topk_p;
    r.tokens_per_expert = a.tokens_per_expert;
    r.first_invalid = reinterpret_cast<unsigned long long*>(&totals->first_invalid_given);
    router_replay(params_, r, stream);
  }
}

void RouterStage::set_totals(const RouterTotals& totals) {
  const auto [latest, earliest_negated] = totals.forward_agreement;
  if (mesh_.world_size() > 1 && (latest != forwards_ || -earliest_negated != forwards_)) {
    fail(
        "rank {}: the ranks do not agree on forward {}: their counts of forwards range from {} "
        "to {} (a peer failed and aborted, or the ranks' calls differ)",
        mesh_.rank(), forwards_, -earliest_negated, latest);
  }
  if (totals.first_invalid_given == RouterTotals::kAllGivenValid &&
      totals.mesh_first_invalid_given != RouterTotals::kAllGivenValid) {
    fail(
        "MoEBlock::forward: another rank's replay_topk_idx holds an invalid expert (that rank's "
        "error names it)");
  }
  if (totals.first_invalid_given != RouterTotals::kAllGivenValid) {
    const std::uint64_t slot = totals.first_invalid_given >> 32;
    const auto expert = static_cast<std::int32_t>(totals.first_invalid_given & 0xffffffffu);
    const int K = config_.topk;
    fail(
        "MoEBlock::forward: replay_topk_idx token {}, slot {}: expert {} is outside [0, {}) or "
        "repeats an earlier slot of the token",
        slot / K, slot % K, expert, config_.num_experts);
  }
}

void RouterStage::reduce_losses(const std::int32_t* dropped, cudaStream_t stream) {
  const int E = config_.num_experts;
  auto* totals = scalars_.as<RouterTotals>();
  auto* global_tokens = &totals->global_tokens;
  auto* aux_counts = aux_counts_.as<std::int32_t>();
  auto* score_sum = score_sum_.as<float>();
  auto* z_sum = z_sum_.as<float>();
  ++forwards_;
  // On one rank T_glob is T, known on the host. On a mesh this rank's T and its count of forwards
  // go up as kernel parameters, not copies from host memory: a captured graph then writes the
  // values it was captured with, whatever the host holds when it is replayed.
  saved_.global_tokens = saved_.logits.dim(0);
  if (mesh_.world_size() > 1) {
    const std::int64_t tokens = saved_.logits.dim(0);
    const std::int64_t agreement[2] = {forwards_, -forwards_};
    write_values(global_tokens, std::span(&tokens, 1), stream);
    write_values(totals->forward_agreement, agreement, stream);
  }
  MOE_CHECK_CUDA(cudaMemcpyAsync(global_load_.data(), counts_.data(), E * sizeof(std::int32_t),
                                 cudaMemcpyDeviceToDevice, stream));
  if (dropped != nullptr) {
    MOE_CHECK_CUDA(cudaMemcpyAsync(global_dropped_.data(), dropped, E * sizeof(std::int32_t),
                                   cudaMemcpyDeviceToDevice, stream));
  }
  MOE_CHECK_CUDA(cudaMemcpyAsync(&totals->mesh_first_invalid_given, &totals->first_invalid_given,
                                 sizeof(std::uint64_t), cudaMemcpyDeviceToDevice, stream));
  mesh_.group_start();
  mesh_.all_reduce_sum(global_tokens, 1, ncclInt64, MeshGroup::kWorld, stream);
  mesh_.all_reduce_sum(global_load_.data(), E, ncclInt32, MeshGroup::kWorld, stream);
  if (dropped != nullptr)
    mesh_.all_reduce_sum(global_dropped_.data(), E, ncclInt32, MeshGroup::kWorld, stream);
  if (params_.aux_loss) {
    mesh_.all_reduce_sum(aux_counts, E, ncclInt32, MeshGroup::kWorld, stream);
    mesh_.all_reduce_sum(score_sum, E, ncclFloat32, MeshGroup::kWorld, stream);
  }
  if (params_.z_loss) mesh_.all_reduce_sum(z_sum, 1, ncclFloat32, MeshGroup::kWorld, stream);
  // Every step, replaying or not, so that every rank's group holds the same operations.
  mesh_.all_reduce(&totals->mesh_first_invalid_given, 1, ncclUint64, ncclMin, MeshGroup::kWorld,
                   stream);
  mesh_.all_reduce(totals->forward_agreement, 2, ncclInt64, ncclMax, MeshGroup::kWorld, stream);
  mesh_.group_end("the loss statistics all-reduce");
  accumulate_load(load_total_.as<std::int64_t>(), global_load_.as<std::int32_t>(), E, stream);
  if (dropped != nullptr) {
    accumulate_load(drop_total_.as<std::int64_t>(), global_dropped_.as<std::int32_t>(), E, stream);
  }
  ++load_steps_;
  if (mesh_.world_size() > 1) {
    router_losses(params_, config_.aux_loss_coeff, config_.z_loss_coeff, aux_counts, score_sum,
                  z_sum, global_tokens, reinterpret_cast<float*>(&totals->losses),
                  typed<float>(loss_factors_, 2), stream);
  }
}

void RouterStage::reset_load_total(cudaStream_t stream) {
  const auto bytes = static_cast<std::size_t>(config_.num_experts) * sizeof(std::int64_t);
  load_total_.reserve(bytes);
  MOE_CHECK_CUDA(cudaMemsetAsync(load_total_.data(), 0, bytes, stream));
  if (config_.capacity_mode()) {  // the drops are counted from the same forward on
    drop_total_.reserve(bytes);
    MOE_CHECK_CUDA(cudaMemsetAsync(drop_total_.data(), 0, bytes, stream));
  }
  load_steps_ = 0;
}

void RouterStage::backward(const float* dprob, const Tensor& dlogits, cudaStream_t stream) {
  RouterBackwardArgs a;
  a.logits = saved_.logits.data;
  a.tokens = saved_.logits.dim(0);
  a.topk_idx = topk_idx();
  a.topk_p = topk_p();
  a.dprob = dprob;
  a.aux_tokens_per_expert = params_.aux_loss ? aux_counts_.as<std::int32_t>() : nullptr;
  // One rank: T_glob is T, on the host. A mesh: the factors router_losses left on the device.
  if (mesh_.world_size() > 1) {
    a.loss_factors = loss_factors_.as<float>();
  } else {
    a.aux_factor = params_.aux_loss
                       ? aux_loss_factor(params_, config_.aux_loss_coeff, saved_.global_tokens)
                       : 0.0f;
    a.z_factor = params_.z_loss ? z_loss_factor(config_.z_loss_coeff, saved_.global_tokens) : 0.0f;
  }
  a.dlogits = dlogits.as<float>();
  router_backward(params_, a, stream);
}

}  // namespace moe
