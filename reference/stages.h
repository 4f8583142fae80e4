// Pieces of the reference layer shared by the one-GPU and the mesh runs (private to reference/).
#pragma once

#include "reference/reference.h"

namespace moe::reference {

// Steps 1-3 on one rank's tokens: gate GEMM, routing (selected or replayed), capacity mode's
// drops, and the summable loss statistics (of the routing before the drops).
struct RouterFront {
  Matrix logits;
  Routing routing;
  std::vector<int> kept;  // [T*K]
  AuxStats aux;           // this rank's part
  double z_sum = 0.0;
};

void check_params(const MoEConfig& config, const Params& params, std::int64_t hidden);
// check_params without the experts: the gate weight and the bias.
void check_gate_and_bias(const MoEConfig& config, const Params& params, std::int64_t hidden);
RouterFront router_front(const MoEConfig& config, const Params& params, const Matrix& x,
                         std::optional<std::span<const int>> replay_experts = std::nullopt);
// Capacity mode's fixed block per (source rank, expert) for a rank of `tokens` tokens with
// pad_to_capacity, else 0 (make_layout's block_rows).
std::int64_t capacity_block_rows(const MoEConfig& config, std::int64_t tokens);
// Fills routing, logits, loads and the losses (from mesh-wide statistics) into result.
void fill_forward_result(const MoEConfig& config, const RouterFront& front,
                         const AuxStats& global_aux, double global_z_sum, LayerResult& result);
// Router and gate backward: dlogits from dprob plus the loss gradients, then dx += dlogits·Wg and
// dWg = dlogitsᵀ·x. result.dx must already hold the permute backward. kAsStored feeds the gate
// GEMMs dlogits rounded to config.dtype, as the GPU does.
void router_back(const MoEConfig& config, const Params& params, const Matrix& x,
                 const RouterFront& front, const AuxStats& global_aux,
                 std::span<const double> dprob, LayerResult& result,
                 Intermediates intermediates = Intermediates::kExact);

// The magnitude behind dWg = dlogitsᵀ·x (LayerResult::d_gate_weight_magnitude), from dprob and
// each slot's dprob magnitude (expert_prob_grad_magnitude; 0 for dropped slots). A token's
// dlogits move with its dprob through the router's linear map, whose columns are taken one slot
// at a time, and with its logits (sums over H) through the router's and the losses' nonlinear map,
// whose slopes are central differences; the router's own roundings add |dlogits| (router_back's).
Matrix gate_gradient_magnitude(const MoEConfig& config, const Params& params, const Matrix& x,
                               const RouterFront& front, std::span<const double> dprob,
                               std::span<const double> dprob_magnitude, const Matrix& dlogits);

// dprob of one slot as the experts form it: <dy[token]·w2ᵀ, a(row)>, a from h's row, with
// dy·w2ᵀ rounded to `dtype` under kAsStored (experts_prob_grads, slot by slot).
double expert_prob_grad(const Matrix& dy, std::int64_t token, const Matrix& h, std::int64_t row,
                        const Matrix& w2, Intermediates intermediates, DType dtype);

// What rounding can move that slot's dprob by, per unit of relative rounding and of sum length:
// the terms of its sums by magnitude. dprob is <dy·w2ᵀ, a> where the experts form it and dy·(a·w2)
// where the combine does; both sums have the terms |dy·w2|·|a|, and the forward's sums over H
// (h = X·w13) reach a through silu's and the up half's derivatives. X is the permuted rows.
double expert_prob_grad_magnitude(const Matrix& dy, std::int64_t token, const Matrix& X,
                                  std::int64_t row, const Matrix& h, const Matrix& w13,
                                  const Matrix& w2);

}  // namespace moe::reference
