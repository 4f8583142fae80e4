// The whole layer on one GPU in fp64: the six forward steps of docs/design.md, then the backward as
// their mirror; capacity mode, shared experts, routing replay and FP8 experts where the config or
// the options ask for them. The routed experts are taken one at a time (ExpertSource), in memory
// or streamed.
#include <algorithm>
#include <array>

#include "moe/error.h"
#include "reference/reference.h"
#include "stages.h"

namespace moe::reference {

void check_gate_and_bias(const MoEConfig& config, const Params& params, std::int64_t hidden) {
  const int E = config.num_experts;
  if (params.gate_weight.rows != E || params.gate_weight.cols != hidden) {
    fail("reference: gate_weight is [{},{}], expected [{},{}]", params.gate_weight.rows,
         params.gate_weight.cols, E, hidden);
  }
  if (config.expert_bias && std::ssize(params.expert_bias) != E) {
    fail("reference: expert_bias has {} entries, expected {}", params.expert_bias.size(), E);
  }
}

void check_params(const MoEConfig& config, const Params& params, std::int64_t hidden) {
  check_gate_and_bias(config, params, hidden);
  const int E = config.num_experts;
  if (std::ssize(params.experts.w13) != E || std::ssize(params.experts.w2) != E) {
    fail("reference: {} / {} expert weight matrices, expected {}", params.experts.w13.size(),
         params.experts.w2.size(), E);
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

int ExpertsInMemory::num_experts() const {
  return static_cast<int>(experts_.w13.size());
}

ExpertWeights ExpertsInMemory::load(int expert) const {
  if (expert < 0 || expert >= num_experts() || experts_.w2.size() != experts_.w13.size())
    fail("ExpertsInMemory: expert {} of {} / {} weight matrices", expert, experts_.w13.size(),
         experts_.w2.size());
  return {{experts_.w13[expert]}, {experts_.w2[expert]}};
}

void ExpertGradsInMemory::take(int expert, Matrix dw13_of_expert, Matrix dw2_of_expert) {
  if (expert != std::ssize(dw13))
    fail("ExpertGradsInMemory: gradients of expert {} after {} experts", expert, dw13.size());
  dw13.push_back(std::move(dw13_of_expert));
  dw2.push_back(std::move(dw2_of_expert));
}

namespace {

// Expert e's weights, checked against the layer's shapes: a source that reads a file could hand
// back anything.
ExpertWeights load_expert(const ExpertSource& experts, int e, std::int64_t H, std::int64_t F) {
  ExpertWeights w = experts.load(e);
  const bool one = w.w13.size() == 1 && w.w2.size() == 1;
  if (!one || w.w13[0].rows != H || w.w13[0].cols != 2 * F || w.w2[0].rows != F ||
      w.w2[0].cols != H) {
    fail(
        "reference: expert {} was loaded as {} w13 and {} w2 matrices{}; expected one [{},{}] "
        "and one [{},{}]",
        e, w.w13.size(), w.w2.size(),
        one ? fmt::format(" of [{},{}] and [{},{}]", w.w13[0].rows, w.w13[0].cols, w.w2[0].rows,
                          w.w2[0].cols)
            : "",
        H, 2 * F, F, H);
  }
  return w;
}

// Under fp8, whether the experts weigh their rows by the probabilities themselves, as the GPU's
// do where they form dprob: the weighing then comes before a is quantized, and dY reaches them
// unweighed. Elsewhere the combine weighs the rows; without fp8 where it happens changes nothing
// but roundings, which the reference leaves to the combine.
bool fp8_experts_weigh_rows(const MoEConfig& config, const LayerOptions& options) {
  return config.fp8 && options.dprob_from == ProbabilityGradient::kExperts;
}

// Each row's probability, for experts that weigh their rows (padding rows 0).
std::vector<double> row_probabilities(const Layout& layout, const Routing& routing) {
  std::vector<double> weights(static_cast<std::size_t>(layout.rows()), 0.0);
  for (std::size_t slot = 0; slot < layout.row.size(); ++slot) {
    if (layout.row[slot] != Layout::kDroppedRow)
      weights[static_cast<std::size_t>(layout.row[slot])] = routing.prob[slot];
  }
  return weights;
}

// The routing with every probability 1: the combine a plain sum and its backward a copy of dy,
// for rows the experts weighed.
Routing unweighed(Routing routing) {
  std::fill(routing.prob.begin(), routing.prob.end(), 1.0);
  return routing;
}

// Rows [begin, end) of per-row weights, or none.
std::span<const double> rows_of(std::span<const double> row_weights, std::int64_t begin,
                                std::int64_t end) {
  if (row_weights.empty()) return {};
  return row_weights.subspan(static_cast<std::size_t>(begin),
                             static_cast<std::size_t>(end - begin));
}

// Step 5 one expert at a time. Each expert's rows are computed from its own rows and weights
// alone, so running experts_forward on one expert's rows gives what it gives on all rows at once
// (so does the FP8 step: activations are quantized row by row, weights expert by expert).
ExpertActivations experts_forward_streamed(const MoEConfig& config, const Matrix& X,
                                           std::span<const std::int64_t> offsets,
                                           const ExpertSource& experts, Intermediates intermediates,
                                           std::span<const double> row_weights) {
  const std::int64_t H = X.cols, F = config.ffn_hidden;
  std::vector<Matrix> hs, as, ys;
  for (int e = 0; e < config.num_experts; ++e) {
    const Matrix Xe = slice_rows(X, offsets[e], offsets[e + 1]);
    if (Xe.rows == 0) {  // nothing to compute: its weights are not read
      hs.emplace_back(0, 2 * F);
      as.emplace_back(0, F);
      ys.emplace_back(0, H);
      continue;
    }
    const std::array<std::int64_t, 2> rows = {0, Xe.rows};
    const ExpertWeights w = load_expert(experts, e, H, F);
    ExpertActivations act =
        config.fp8 ? fp8_expert_forward(Xe, w.w13[0], w.w2[0],
                                        rows_of(row_weights, offsets[e], offsets[e + 1]))
                   : experts_forward(Xe, rows, w, intermediates, config.dtype);
    hs.push_back(std::move(act.h));
    as.push_back(std::move(act.a));
    ys.push_back(std::move(act.y));
  }
  return {concat_rows(hs), concat_rows(as), concat_rows(ys)};
}

// The experts' backward one at a time, each expert's weights loaded again: dX of every row, each
// expert's weight gradients handed to `sink`, and, when `dprob` is given, its slots' dp as the
// experts form it (ProbabilityGradient::kExperts), and when `dprob_magnitude` is given, what
// rounding can move each kept slot's dp by (expert_prob_grad_magnitude). Under fp8, the FP8 step's
// backward, with the rows weighed by `row_weights` where there are any (dp is then their
// gradient).
Matrix experts_backward_streamed(const MoEConfig& config, const Matrix& X,
                                 const ExpertActivations& act, const Matrix& dY, const Matrix& dy,
                                 const Layout& layout, const Routing& routing,
                                 const ExpertSource& experts, ExpertGradSink& sink,
                                 Intermediates intermediates, std::span<const double> row_weights,
                                 std::vector<double>* dprob, std::vector<double>* dprob_magnitude) {
  const std::int64_t H = X.cols, F = config.ffn_hidden;
  std::vector<std::vector<std::int64_t>> slots_of(config.num_experts);  // t·K + k, kept slots
  for (std::int64_t t = 0; t < routing.tokens; ++t) {
    for (int k = 0; k < routing.topk; ++k) {
      if (layout.row_of(t, k, routing.topk) != Layout::kDroppedRow)
        slots_of[routing.expert_of(t, k)].push_back(t * routing.topk + k);
    }
  }
  std::vector<Matrix> dXs;
  for (int e = 0; e < config.num_experts; ++e) {
    const std::int64_t begin = layout.offsets[e], end = layout.offsets[e + 1];
    if (begin == end) {  // no rows: zero gradients, weights not read
      dXs.emplace_back(0, H);
      sink.take(e, Matrix(H, 2 * F), Matrix(F, H));
      continue;
    }
    const ExpertWeights w = load_expert(experts, e, H, F);
    if (dprob_magnitude != nullptr) {
      for (const std::int64_t slot : slots_of[e]) {
        (*dprob_magnitude)[slot] = expert_prob_grad_magnitude(
            dy, slot / routing.topk, X, layout.row[static_cast<std::size_t>(slot)], act.h, w.w13[0],
            w.w2[0]);
      }
    }
    if (config.fp8) {
      Fp8ExpertBackward grads = fp8_expert_backward(
          slice_rows(X, begin, end), slice_rows(act.h, begin, end), w.w13[0], w.w2[0],
          slice_rows(dY, begin, end), rows_of(row_weights, begin, end));
      if (dprob != nullptr) {
        if (grads.row_weight_grads.empty())
          fail("reference: fp8 experts form dprob only where they weigh their rows");
        for (const std::int64_t slot : slots_of[e]) {
          const std::int64_t row = layout.row[static_cast<std::size_t>(slot)];
          (*dprob)[slot] = grads.row_weight_grads[static_cast<std::size_t>(row - begin)];
        }
      }
      dXs.push_back(std::move(grads.dX));
      sink.take(e, std::move(grads.dw13), std::move(grads.dw2));
      continue;
    }
    if (dprob != nullptr) {
      for (const std::int64_t slot : slots_of[e]) {
        const std::int64_t t = slot / routing.topk;
        const std::int64_t row = layout.row[static_cast<std::size_t>(slot)];
        (*dprob)[slot] = expert_prob_grad(dy, t, act.h, row, w.w2[0], intermediates, config.dtype);
      }
    }
    const ExpertActivations rows_act = {slice_rows(act.h, begin, end),
                                        slice_rows(act.a, begin, end), Matrix()};
    const std::array<std::int64_t, 2> rows = {0, end - begin};
    ExpertGrads grads =
        experts_backward(slice_rows(X, begin, end), rows_act, slice_rows(dY, begin, end), rows, w);
    dXs.push_back(std::move(grads.dX));
    sink.take(e, std::move(grads.dw13[0]), std::move(grads.dw2[0]));
  }
  return concat_rows(dXs);
}

struct Forward {
  RouterFront front;
  Layout layout;
  Matrix X;
  std::vector<double> row_weights;  // FP8 experts that weigh their rows: each row's p; else empty
  Routing combine_routing;          // the routing the combine weighs by (all 1 where they did)
  ExpertActivations act;
  SharedForward shared;  // with shared experts
  Matrix out;
};

Forward forward(const MoEConfig& config, const Params& params, const ExpertSource& experts,
                const Matrix& x, const LayerOptions& options) {
  check_gate_and_bias(config, params, x.cols);
  if (experts.num_experts() != config.num_experts)
    fail("reference: {} experts to load, expected {}", experts.num_experts(), config.num_experts);
  Forward f;
  f.front = router_front(config, params, x, options.replay_experts);  // steps 1-3
  f.layout = make_layout(f.front.routing, f.front.kept, config.num_experts, config.align_size,
                         capacity_block_rows(config, x.rows));  // step 4
  f.X = permute(x, f.layout, f.front.routing);
  if (config.fp8_dispatch) f.X = round_rows_through_fp8(f.X);  // the rows as the experts get them
  const bool experts_weigh_rows = fp8_experts_weigh_rows(config, options);
  if (experts_weigh_rows) f.row_weights = row_probabilities(f.layout, f.front.routing);
  f.combine_routing = experts_weigh_rows ? unweighed(f.front.routing) : f.front.routing;
  f.act = experts_forward_streamed(config, f.X, f.layout.offsets, experts, options.intermediates,
                                   f.row_weights);                  // step 5
  f.out = unpermute_combine(f.act.y, f.layout, f.combine_routing);  // step 6
  if (config.shared_experts()) {
    f.shared = shared_forward(config, params.shared, x, options.intermediates);
    add_into(f.out, f.shared.out);
  }
  return f;
}

}  // namespace

LayerResult run_layer(const MoEConfig& config, const Params& params, const ExpertSource& experts,
                      const Matrix& x, const Matrix& dy, ExpertGradSink& expert_grads,
                      const LayerOptions& options) {
  const Forward f = forward(config, params, experts, x, options);
  if (dy.rows != f.out.rows || dy.cols != f.out.cols) {
    fail("run_layer: dy is [{},{}], out is [{},{}]", dy.rows, dy.cols, f.out.rows, f.out.cols);
  }
  LayerResult result;
  fill_forward_result(config, f.front, f.front.aux, f.front.z_sum, result);
  result.out = f.out;
  result.expert_rows = f.layout.rows();

  // Backward, the mirror: combine, experts, permute, router, gate; then the shared expert.
  Matrix dY = combine_backward_rows(dy, f.layout, f.combine_routing);
  if (config.fp8) dY = round_to(dY, DType::kBF16);  // FP8 quantizes the bf16 rows the GPU stores
  if (config.fp8_dispatch) dY = round_rows_through_fp8(dY);  // as they reach the experts
  const bool dprob_in_experts = options.dprob_from == ProbabilityGradient::kExperts;
  std::vector<double> dprob = dprob_in_experts
                                  ? std::vector<double>(f.front.routing.expert.size(), 0.0)
                                  : combine_backward_prob(dy, f.act.y, f.layout, f.front.routing);
  // fp32's checks may fall back to a rounding bound of the gate's gradient; bf16's never do.
  const bool bound_gate_gradient = options.rounding_magnitudes && config.dtype == DType::kFP32;
  std::vector<double> dprob_magnitude(bound_gate_gradient ? dprob.size() : 0, 0.0);
  result.expert_grads.dX = experts_backward_streamed(
      config, f.X, f.act, dY, dy, f.layout, f.front.routing, experts, expert_grads,
      options.intermediates, f.row_weights, dprob_in_experts ? &dprob : nullptr,
      bound_gate_gradient ? &dprob_magnitude : nullptr);
  result.dx = permute_backward(result.expert_grads.dX, f.layout, f.front.routing);
  router_back(config, params, x, f.front, f.front.aux, dprob, result, options.intermediates);
  if (bound_gate_gradient) {
    result.d_gate_weight_magnitude =
        gate_gradient_magnitude(config, params, x, f.front, dprob, dprob_magnitude, result.dlogits);
  }
  if (config.shared_experts())
    result.shared_grads = shared_backward(config, params.shared, x, f.shared, dy, result.dx);
  return result;
}

LayerResult run_layer(const MoEConfig& config, const Params& params, const Matrix& x,
                      const Matrix& dy, const LayerOptions& options) {
  check_params(config, params, x.cols);
  const ExpertsInMemory experts(params.experts);
  ExpertGradsInMemory grads;
  LayerResult result = run_layer(config, params, experts, x, dy, grads, options);
  result.expert_grads.dw13 = std::move(grads.dw13);
  result.expert_grads.dw2 = std::move(grads.dw2);
  return result;
}

LayerResult run_layer(const MoEConfig& config, const Params& params, const Matrix& x,
                      const Matrix& dy, Intermediates intermediates,
                      ProbabilityGradient dprob_from) {
  LayerOptions options;
  options.intermediates = intermediates;
  options.dprob_from = dprob_from;
  options.rounding_magnitudes = intermediates == Intermediates::kAsStored;
  return run_layer(config, params, x, dy, options);
}

double layer_objective(const MoEConfig& config, const Params& params, const Matrix& x,
                       const Matrix& dy, const LayerOptions& options) {
  check_params(config, params, x.cols);
  const Forward f = forward(config, params, ExpertsInMemory(params.experts), x, options);
  double objective = 0.0;
  for (std::size_t i = 0; i < f.out.data.size(); ++i) objective += f.out.data[i] * dy.data[i];
  if (config.aux_loss_coeff > 0) objective += aux_loss(config, f.front.aux);
  if (config.z_loss_coeff > 0) objective += z_loss(config, f.front.z_sum, f.front.aux.tokens);
  return objective;
}

}  // namespace moe::reference
