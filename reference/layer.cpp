// The whole layer on one GPU in fp64: the six forward steps of docs/design.md, then the backward as
// their mirror; capacity mode, shared experts and routing replay where the config or the options
// ask for them.
#include "moe/error.h"
#include "reference/reference.h"
#include "stages.h"

namespace moe::reference {

void check_params(const MoEConfig& config, const Params& params, std::int64_t hidden) {
  const int E = config.num_experts;
  if (params.gate_weight.rows != E || params.gate_weight.cols != hidden) {
    fail("reference: gate_weight is [{},{}], expected [{},{}]", params.gate_weight.rows,
         params.gate_weight.cols, E, hidden);
  }
  if (std::ssize(params.experts.w13) != E || std::ssize(params.experts.w2) != E) {
    fail("reference: {} / {} expert weight matrices, expected {}", params.experts.w13.size(),
         params.experts.w2.size(), E);
  }
  if (config.expert_bias && std::ssize(params.expert_bias) != E) {
    fail("reference: expert_bias has {} entries, expected {}", params.expert_bias.size(), E);
  }
}

RouterFront router_front(const MoEConfig& config, const Params& params, const Matrix& x,
                         std::optional<std::span<const int>> replay_experts) {
  RouterFront front;
  front.logits = matmul_nt(x, params.gate_weight);
  front.routing = replay_experts ? route_given(config, front.logits, *replay_experts)
                                 : route(config, front.logits, params.expert_bias);
  front.kept = keep_within_capacity(config, front.routing);
  // The losses see the logits alone, so they are those of the routing before any drop.
  front.aux = aux_stats(config, front.logits);
  front.z_sum = z_loss_sum(front.logits);
  return front;
}

std::int64_t capacity_block_rows(const MoEConfig& config, std::int64_t tokens) {
  return config.pad_to_capacity ? config.expert_capacity(tokens) : 0;
}

void router_back(const MoEConfig& config, const Params& params, const Matrix& x,
                 const RouterFront& front, const AuxStats& global_aux,
                 std::span<const double> dprob, LayerResult& result, Intermediates intermediates) {
  result.dlogits = route_backward(config, front.logits, front.routing, dprob);
  if (config.aux_loss_coeff > 0)
    aux_loss_backward(config, front.logits, global_aux, result.dlogits);
  if (config.z_loss_coeff > 0)
    z_loss_backward(config, front.logits, global_aux.tokens, result.dlogits);
  const Matrix dlogits = intermediates == Intermediates::kAsStored
                             ? round_to(result.dlogits, config.dtype)
                             : result.dlogits;
  add_into(result.dx, matmul(dlogits, params.gate_weight));  // dx += dlogits · Wg
  result.d_gate_weight = matmul_tn(dlogits, x);              // dWg = dlogitsᵀ · x
}

void fill_forward_result(const MoEConfig& config, const RouterFront& front,
                         const AuxStats& global_aux, double global_z_sum, LayerResult& result) {
  const int E = config.num_experts;
  result.logits = front.logits;
  result.routing = front.routing;
  result.kept = front.kept;
  result.dropped_per_expert = dropped_per_expert(front.routing, front.kept, E);
  result.tokens_per_expert = tokens_per_expert(front.routing, E);
  for (int e = 0; e < E; ++e) result.tokens_per_expert[e] -= result.dropped_per_expert[e];
  result.aux_loss = config.aux_loss_coeff > 0 ? aux_loss(config, global_aux) : 0.0;
  result.z_loss = config.z_loss_coeff > 0 ? z_loss(config, global_z_sum, global_aux.tokens) : 0.0;
}

namespace {

struct Forward {
  RouterFront front;
  Layout layout;
  Matrix X;
  ExpertActivations act;
  SharedForward shared;  // with shared experts
  Matrix out;
};

Forward forward(const MoEConfig& config, const Params& params, const Matrix& x,
                const LayerOptions& options) {
  check_params(config, params, x.cols);
  Forward f;
  f.front = router_front(config, params, x, options.replay_experts);  // steps 1-3
  f.layout = make_layout(f.front.routing, f.front.kept, config.num_experts, config.align_size,
                         capacity_block_rows(config, x.rows));  // step 4
  f.X = permute(x, f.layout, f.front.routing);
  f.act = experts_forward(f.X, f.layout.offsets, params.experts, options.intermediates,
                          config.dtype);                          // step 5
  f.out = unpermute_combine(f.act.y, f.layout, f.front.routing);  // step 6
  if (config.shared_experts()) {
    f.shared = shared_forward(config, params.shared, x, options.intermediates);
    add_into(f.out, f.shared.out);
  }
  return f;
}

}  // namespace

LayerResult run_layer(const MoEConfig& config, const Params& params, const Matrix& x,
                      const Matrix& dy, const LayerOptions& options) {
  const Forward f = forward(config, params, x, options);
  if (dy.rows != f.out.rows || dy.cols != f.out.cols) {
    fail("run_layer: dy is [{},{}], out is [{},{}]", dy.rows, dy.cols, f.out.rows, f.out.cols);
  }
  LayerResult result;
  fill_forward_result(config, f.front, f.front.aux, f.front.z_sum, result);
  result.out = f.out;
  result.expert_rows = f.layout.rows();

  // Backward, the mirror: combine, experts, permute, router, gate; then the shared expert.
  const Matrix dY = combine_backward_rows(dy, f.layout, f.front.routing);
  const auto dprob = options.dprob_from == ProbabilityGradient::kExperts
                         ? experts_prob_grads(dy, f.act, f.layout, f.front.routing, params.experts,
                                              options.intermediates, config.dtype)
                         : combine_backward_prob(dy, f.act.y, f.layout, f.front.routing);
  result.expert_grads = experts_backward(f.X, f.act, dY, f.layout.offsets, params.experts);
  result.dx = permute_backward(result.expert_grads.dX, f.layout, f.front.routing);
  router_back(config, params, x, f.front, f.front.aux, dprob, result, options.intermediates);
  if (config.shared_experts())
    result.shared_grads = shared_backward(config, params.shared, x, f.shared, dy, result.dx);
  return result;
}

LayerResult run_layer(const MoEConfig& config, const Params& params, const Matrix& x,
                      const Matrix& dy, Intermediates intermediates,
                      ProbabilityGradient dprob_from) {
  LayerOptions options;
  options.intermediates = intermediates;
  options.dprob_from = dprob_from;
  return run_layer(config, params, x, dy, options);
}

double layer_objective(const MoEConfig& config, const Params& params, const Matrix& x,
                       const Matrix& dy, const LayerOptions& options) {
  const Forward f = forward(config, params, x, options);
  double objective = 0.0;
  for (std::size_t i = 0; i < f.out.data.size(); ++i) objective += f.out.data[i] * dy.data[i];
  if (config.aux_loss_coeff > 0) objective += aux_loss(config, f.front.aux);
  if (config.z_loss_coeff > 0) objective += z_loss(config, f.front.z_sum, f.front.aux.tokens);
  return objective;
}

}  // namespace moe::reference
