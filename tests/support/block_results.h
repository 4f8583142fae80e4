// One MoEBlock step's results read back to the host, and their check against the fp64 reference
// of the whole layer: the GPU tests of the block share them.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "moe/moe_block.h"
#include "reference/reference.h"
#include "support/block_util.h"
#include "support/catch.h"

namespace moe::test {

struct Results {
  Matrix out, dx, dgate;
  std::vector<Matrix> dw13, dw2;                 // nn.Linear layout
  Matrix shared_dw13, shared_dw2, shared_dgate;  // with a shared expert (nn.Linear layout)
  float aux = 0, z = 0;
};

// The losses stay on the device: what a forward that waits for nothing, or is captured in a CUDA
// graph, must be told.
inline ForwardOptions losses_on_device() {
  ForwardOptions options;
  options.losses_on_host = false;
  return options;
}

// A forward whose backward has not run yet: x must stay on the device until then.
struct Pending {
  DeviceBuffer x_dev;
  Results results;
};

inline Pending start_block(MoEBlock& block, const MoEConfig& c, const Matrix& x,
                           const ForwardOptions& options = {}) {
  Pending p{upload_as(x, c.dtype), {}};
  const auto fwd = block.forward(Tensor(p.x_dev.data(), c.dtype, {x.rows, c.hidden}), options);
  MOE_CHECK_CUDA(cudaDeviceSynchronize());
  p.results.out = read(fwd.out, x.rows, c.hidden);
  p.results.aux = fwd.aux_loss;
  p.results.z = fwd.z_loss;
  return p;
}

// The block's gradients as they lie on the device, into r.
inline void read_gradients(const MoEBlock& block, const MoEConfig& c, Results& r) {
  const auto& g = block.gradients();
  r.dgate = read(g.gate_weight, c.num_experts, c.hidden);
  const int E_loc = static_cast<int>(g.w13.dim(0));
  const Matrix all13 = read(g.w13, E_loc * 2 * c.ffn_hidden, c.hidden);
  const Matrix all2 = read(g.w2, static_cast<std::int64_t>(E_loc) * c.hidden, c.ffn_hidden);
  for (int e = 0; e < E_loc; ++e) {
    r.dw13.push_back(
        reference::slice_rows(all13, e * 2 * c.ffn_hidden, (e + 1) * 2 * c.ffn_hidden));
    r.dw2.push_back(
        reference::slice_rows(all2, static_cast<std::int64_t>(e) * c.hidden, (e + 1) * c.hidden));
  }
  if (c.shared_experts()) {
    r.shared_dw13 = read(g.shared_w13, 2 * c.shared_ffn_hidden, c.hidden);
    r.shared_dw2 = read(g.shared_w2, c.hidden, c.shared_ffn_hidden);
  }
  if (c.shared_gate) r.shared_dgate = read(g.shared_gate_weight, 1, c.hidden);
}

inline Results finish_block(MoEBlock& block, const MoEConfig& c, Pending pending,
                            const Matrix& dy) {
  const auto dy_dev = upload_as(dy, c.dtype);
  const Tensor dx = block.backward(Tensor(dy_dev.data(), c.dtype, {dy.rows, c.hidden}));
  MOE_CHECK_CUDA(cudaDeviceSynchronize());
  Results r = std::move(pending.results);
  r.dx = read(dx, dy.rows, c.hidden);
  read_gradients(block, c, r);
  return r;
}

// A step's results as they lie on the device (a replayed graph's): out, dx, the gradients, and
// the losses from their device copy.
inline Results read_step(const MoEBlock& block, const MoEConfig& c, const MoEForward& fwd,
                         const Tensor& dx, std::int64_t tokens) {
  Results r;
  r.out = read(fwd.out, tokens, c.hidden);
  r.dx = read(dx, tokens, c.hidden);
  float losses[2];
  copy_to_host(losses, fwd.losses.data, sizeof(losses));
  r.aux = losses[0];
  r.z = losses[1];
  read_gradients(block, c, r);
  return r;
}

inline Results run_block(MoEBlock& block, const MoEConfig& c, const Matrix& x, const Matrix& dy) {
  return finish_block(block, c, start_block(block, c, x), dy);
}

// A gradient within the dtype's relative tolerance, or, in fp32 where that tolerance is beyond
// what rounding's worst case allows, within that worst case: each sum by at most its length ·
// 2^-24 of its terms by magnitude, which the reference gives element by element (`magnitude`, per
// unit of relative rounding and of length; empty where it gives none). `length` adds up the sums'
// lengths, so the bound is loose (a worst case, not a typical error). At a few tokens a gate's
// gradient is a few dot products whose terms may cancel, so its size says little about its error:
// seen at T = 1 for the shared gate (3.5e-5 relative, seed 690907976341150114) and for the router's
// gate (1.1e-5, seed 15818488217545370004).
inline void check_within_rounding(const char* name, DType dtype, const Matrix& got,
                                  const Matrix& exact, const Matrix& magnitude, std::int64_t length,
                                  double tol) {
  INFO(name);
  const double relative = relative_error(got, exact);
  const double rounding = static_cast<double>(length) * std::ldexp(1.0, -24);
  // The fallback only where the bound itself says tol is out of reach: where rounding's worst
  // case, over the whole gradient, exceeds tol of its size. Elsewhere the relative check stands.
  double bound_squares = 0.0, exact_squares = 0.0;
  if (magnitude.data.size() == exact.data.size()) {
    for (std::size_t i = 0; i < exact.data.size(); ++i) {
      bound_squares += rounding * rounding * magnitude.data[i] * magnitude.data[i];
      exact_squares += exact.data[i] * exact.data[i];
    }
  }
  const bool out_of_reach = bound_squares > tol * tol * exact_squares;
  if (dtype != DType::kFP32 || relative <= tol || magnitude.data.empty() || !out_of_reach) {
    CHECK(relative <= tol);
    return;
  }
  REQUIRE(magnitude.data.size() == exact.data.size());
  REQUIRE(got.data.size() == exact.data.size());
  std::int64_t outside = 0;
  for (std::size_t i = 0; i < exact.data.size(); ++i) {
    if (!(std::fabs(got.data[i] - exact.data[i]) <= rounding * magnitude.data[i])) ++outside;
  }
  INFO("relative error " << relative << " over the tolerance " << tol
                         << "; elements outside fp32's rounding bound: " << outside);
  CHECK(outside == 0);
}

inline void check_against_reference(const MoEConfig& c, const Results& got,
                                    const reference::LayerResult& want) {
  const double tol = c.dtype == DType::kBF16 ? 1e-2 : 1e-5;
  CHECK(relative_error(got.out, want.out) <= tol);
  CHECK(relative_error(got.dx, want.dx) <= tol);
  // The router's gate gradient sums over H (the logits, dy·w2ᵀ or y), F (dprob), E (the
  // router's normalisations), K and T (dWg), with a few single roundings besides.
  const std::int64_t tokens = want.out.rows;
  check_within_rounding("router gate", c.dtype, got.dgate, want.d_gate_weight,
                        want.d_gate_weight_magnitude,
                        c.hidden + c.ffn_hidden + c.num_experts + c.topk + tokens + 16, tol);
  CHECK(got.aux == Approx(want.aux_loss).epsilon(1e-5).margin(1e-9));
  CHECK(got.z == Approx(want.z_loss).epsilon(1e-5).margin(1e-9));
  for (std::size_t e = 0; e < got.dw13.size(); ++e) {
    INFO("expert " << e);
    CHECK(relative_error(got.dw13[e], transpose(want.expert_grads.dw13[e])) <= tol);
    CHECK(relative_error(got.dw2[e], transpose(want.expert_grads.dw2[e])) <= tol);
  }
  if (c.shared_experts()) {
    INFO("shared expert");
    CHECK(relative_error(got.shared_dw13, transpose(want.shared_grads.dw13)) <= tol);
    CHECK(relative_error(got.shared_dw2, transpose(want.shared_grads.dw2)) <= tol);
  }
  // The shared gate's sums: over H (dy·w2ᵀ, h, its logit), Fs (⟨dA, a⟩) and T; a few roundings
  // more for the sigmoid factor and the product with x.
  if (c.shared_gate) {
    check_within_rounding("shared gate", c.dtype, got.shared_dgate, want.shared_grads.dgate_weight,
                          want.shared_grads.dgate_weight_magnitude,
                          c.hidden + c.shared_ffn_hidden + tokens + 8, tol);
  }
}

inline bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

inline void check_identical(const Results& got, const Results& want) {
  CHECK(got.out.data == want.out.data);
  CHECK(got.dx.data == want.dx.data);
  CHECK(got.dgate.data == want.dgate.data);
  CHECK(same_bits(got.aux, want.aux));
  CHECK(same_bits(got.z, want.z));
  REQUIRE(got.dw13.size() == want.dw13.size());
  for (std::size_t e = 0; e < got.dw13.size(); ++e) {
    INFO("expert " << e);
    CHECK(got.dw13[e].data == want.dw13[e].data);
    CHECK(got.dw2[e].data == want.dw2[e].data);
  }
  CHECK(got.shared_dw13.data == want.shared_dw13.data);
  CHECK(got.shared_dw2.data == want.shared_dw2.data);
  CHECK(got.shared_dgate.data == want.shared_dgate.data);
}

// NaN bytes over everything a step writes, so that a replay that skipped a write shows.
inline void poison_step(const MoEBlock& block, const MoEForward& fwd, const Tensor& dx,
                        cudaStream_t stream) {
  const MoEGradients& g = block.gradients();
  for (const Tensor* t : {&fwd.out, &fwd.losses, &dx, &g.gate_weight, &g.w13, &g.w2, &g.shared_w13,
                          &g.shared_w2, &g.shared_gate_weight}) {
    if (t->data != nullptr) MOE_CHECK_CUDA(cudaMemsetAsync(t->data, 0xff, t->bytes(), stream));
  }
}

// Work of another micro-batch between two split-phase calls: kernels over a buffer of its own, on
// the block's stream, long enough to sit beside the exchange's transfers.
class OtherWork {
 public:
  explicit OtherWork(cudaStream_t stream) : stream_(stream), buffer_(kBytes) {}
  void queue() const {
    for (int i = 0; i < 4; ++i) MOE_CHECK_CUDA(cudaMemsetAsync(buffer_.data(), i, kBytes, stream_));
  }

 private:
  static constexpr std::size_t kBytes = std::size_t{32} << 20;
  cudaStream_t stream_;
  DeviceBuffer buffer_;
};

struct PhasedStep {
  MoEForward forward;
  Tensor dx;
};

// A forward and a backward in their six split-phase calls, with `between` queued between each two.
inline PhasedStep run_phases(MoEBlock& block, const Tensor& x, const Tensor& dy,
                             const ForwardOptions& options, const std::function<void()>& between) {
  PhasedStep step;
  block.forward_dispatch(x, options);
  between();
  block.forward_experts();
  between();
  step.forward = block.forward_combine();
  between();
  block.backward_combine(dy);
  between();
  block.backward_experts();
  between();
  step.dx = block.backward_dispatch();
  return step;
}

}  // namespace moe::test
