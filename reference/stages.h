// Pieces of the reference layer shared by the one-GPU and the mesh runs (private to src/).
#pragma once

#include "reference/reference.h"

namespace moe::reference {

// Steps 1-3 on one rank's tokens: gate GEMM, routing, and the summable loss statistics.
struct RouterFront {
  Matrix logits;
  Routing routing;
  AuxStats aux;  // this rank's part
  double z_sum = 0.0;
};

void check_params(const MoEConfig& config, const Params& params, std::int64_t hidden);
RouterFront router_front(const MoEConfig& config, const Params& params, const Matrix& x);
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

}  // namespace moe::reference
