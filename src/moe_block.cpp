// MoEBlock: the layer's steps forward (gate → route → permute → dispatch → experts → combine →
// unpermute), their mirror backward, over one GPU or an EP×DP mesh. Each step is one call into its
// stage (src/gate_stage.h, src/router_stage.h, src/expert_stage.h) or into the token exchange
// (src/token_exchange.h), which owns everything that depends on how rows cross the EP group.
#include "moe/moe_block.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kernels/elementwise.cuh"
#include "kernels/router.cuh"
#include "moe/device.h"
#include "moe/error.h"
#include "src/capacity_stage.h"
#include "src/expert_stage.h"
#include "src/gate_stage.h"
#include "src/gradient_reduction.h"
#include "src/moe_block_state.h"
#include "src/router_stage.h"
#include "src/scratch.h"
#include "src/shared_expert_stage.h"
#include "src/stage_support.h"
#include "src/token_exchange.h"

namespace moe {

using block_detail::on_mesh;

MoEBlock::MoEBlock(const MoEConfig& config, const Mesh& mesh, cudaStream_t stream,
                   std::shared_ptr<MoEScratch> scratch) {
  config.validate();
  // Capacity mode and shared experts are defined (docs/design.md) and run in the CPU reference;
  // the kernels do not run them yet, and a silently dropless layer would train a different model.
  if (const std::string why = config.unsupported_by_gpu_layer(); !why.empty()) fail("{}", why);
  if (config.ep != mesh.ep() || config.dp != mesh.dp()) {
    fail("MoEBlock: config has ep = {}, dp = {} but the mesh is {} x {}", config.ep, config.dp,
         mesh.ep(), mesh.dp());
  }
  validate_mesh_shape(mesh.world_size(), mesh.ep(), mesh.dp(), config.num_experts);
  if (scratch == nullptr) scratch = std::make_shared<MoEScratch>();
  if (scratch->has_stream_ && scratch->stream_ != stream) {
    fail(
        "MoEBlock: stream = {}, but the shared scratch serves stream {} (blocks that share a "
        "scratch must run in order on one stream)",
        static_cast<const void*>(stream), static_cast<const void*>(scratch->stream_));
  }
  scratch->has_stream_ = true;
  scratch->stream_ = stream;
  MoEScratch::Buffers& buffers = *scratch->buffers_;
  s_ = std::make_unique<State>(config, mesh, stream, std::move(scratch), buffers);
  auto& s = *s_;
  if (!choosing_exchange_is_collective(mesh)) s.exchange = make_token_exchange(s.exchange_setup());
  const std::int64_t E = s.E, E_loc = s.E_loc, H = s.H, F = s.F;
  s.params.gate_weight = view(s.own.gate, s.dtype, {E, H});
  s.params.w13 = view(s.own.w13, s.dtype, {E_loc, 2 * F, H});
  s.params.w2 = view(s.own.w2, s.dtype, {E_loc, H, F});
  s.params.expert_bias = view(s.own.bias, DType::kFP32, {E});
  const DType grad = config.grad_dtype;
  s.grads.gate_weight = view(s.own.dgate, DType::kFP32, {E, H});
  s.grads.w13 = view(s.own.dw13, grad, {E_loc, 2 * F, H});
  s.grads.w2 = view(s.own.dw2, grad, {E_loc, H, F});
  if (config.shared_experts()) {
    const std::int64_t Fs = config.shared_ffn_hidden;
    s.params.shared_w13 = view(s.own.shared_w13, s.dtype, {2 * Fs, H});
    s.params.shared_w2 = view(s.own.shared_w2, s.dtype, {H, Fs});
    s.grads.shared_w13 = view(s.own.dshared_w13, grad, {2 * Fs, H});
    s.grads.shared_w2 = view(s.own.dshared_w2, grad, {H, Fs});
    if (config.shared_gate) {
      s.params.shared_gate_weight = view(s.own.shared_gate, s.dtype, {1, H});
      s.grads.shared_gate_weight = view(s.own.dshared_gate, DType::kFP32, {1, H});
    }
  }
  initialize(0);
}

// On a mesh of several ranks the frees below wait for the whole device with no time limit, behind
// any collective a failed peer never joins (this block's last gradient all-reduce, say). So the
// block first waits for its stream under the mesh's timeout, and where that fails the mesh is
// aborted (the wait does so itself on a timeout): its collectives then end, the frees return, and
// the peers fail at their next wait. A destructor cannot throw: the reason goes to stderr, the
// one place this rank's trainer can still learn it from (its later calls only say "aborted").
MoEBlock::~MoEBlock() {
  const Mesh& mesh = s_->mesh;
  try {
    if (mesh.world_size() == 1 || mesh.aborted() || stream_is_capturing(s_->stream)) return;
    const Event drained;
    drained.record(s_->stream);
    mesh.wait(drained.get(), "the work queued before a block's buffers are freed");
  } catch (const std::exception& error) {
    mesh.abort();
    std::fprintf(stderr, "moe: ~MoEBlock aborted the mesh's communicators: %s\n", error.what());
  } catch (...) {
    mesh.abort();
  }
}

const MoEConfig& MoEBlock::config() const {
  return s_->config;
}
const MoEParameters& MoEBlock::parameters() const {
  return s_->params;
}
const MoEGradients& MoEBlock::gradients() const {
  return s_->grads;
}
void MoEBlock::set_check_finite(bool on) {
  s_->check_finite = on;
}

void MoEBlock::bind(const MoEParameters& p, const MoEGradients& g) {
  auto& s = *s_;
  const std::int64_t E = s.E, E_loc = s.E_loc, H = s.H, F = s.F;
  expect_tensor(p.gate_weight, "MoEBlock::bind gate_weight", s.dtype, {E, H});
  expect_tensor(p.w13, "MoEBlock::bind w13", s.dtype, {E_loc, 2 * F, H});
  expect_tensor(p.w2, "MoEBlock::bind w2", s.dtype, {E_loc, H, F});
  expect_tensor(p.expert_bias, "MoEBlock::bind expert_bias", DType::kFP32, {E});
  expect_tensor(g.gate_weight, "MoEBlock::bind gradient of gate_weight", DType::kFP32, {E, H});
  const DType grad = s.config.grad_dtype;
  expect_tensor(g.w13, "MoEBlock::bind gradient of w13", grad, {E_loc, 2 * F, H});
  expect_tensor(g.w2, "MoEBlock::bind gradient of w2", grad, {E_loc, H, F});
  if (s.config.shared_experts()) {
    const std::int64_t Fs = s.config.shared_ffn_hidden;
    expect_tensor(p.shared_w13, "MoEBlock::bind shared_w13", s.dtype, {2 * Fs, H});
    expect_tensor(p.shared_w2, "MoEBlock::bind shared_w2", s.dtype, {H, Fs});
    expect_tensor(g.shared_w13, "MoEBlock::bind gradient of shared_w13", grad, {2 * Fs, H});
    expect_tensor(g.shared_w2, "MoEBlock::bind gradient of shared_w2", grad, {H, Fs});
  }
  if (s.config.shared_gate) {
    expect_tensor(p.shared_gate_weight, "MoEBlock::bind shared_gate_weight", s.dtype, {1, H});
    expect_tensor(g.shared_gate_weight, "MoEBlock::bind gradient of shared_gate_weight",
                  DType::kFP32, {1, H});
  }
  s.params = p;
  s.grads = g;
  s.experts.weights_changed();
}

void MoEBlock::initialize(std::uint64_t seed) {
  auto& s = *s_;
  const auto first_expert = static_cast<std::uint64_t>(s.mesh.ep_index()) * s.E_loc;
  const auto w13_size = static_cast<std::uint64_t>(2 * s.F * s.H);
  const auto w2_size = static_cast<std::uint64_t>(s.H * s.F);
  // Distinct streams of numbers per tensor; a global expert's slice is the same on every rank.
  init_normal(s.params.gate_weight, seed, 0, 1.0f / std::sqrt(static_cast<float>(s.H)), s.stream);
  init_normal(s.params.w13, seed ^ 0x13, first_expert * w13_size,
              1.0f / std::sqrt(static_cast<float>(s.H)), s.stream);
  init_normal(s.params.w2, seed ^ 0x2, first_expert * w2_size,
              1.0f / std::sqrt(static_cast<float>(s.F)), s.stream);
  MOE_CHECK_CUDA(
      cudaMemsetAsync(s.params.expert_bias.data, 0, s.params.expert_bias.bytes(), s.stream));
  if (s.config.shared_experts()) {  // replicated: the same values on every rank
    const auto Fs = static_cast<float>(s.config.shared_ffn_hidden);
    const float input_scale = 1.0f / std::sqrt(static_cast<float>(s.H));
    init_normal(s.params.shared_w13, seed ^ 0x5113, 0, input_scale, s.stream);
    init_normal(s.params.shared_w2, seed ^ 0x5112, 0, 1.0f / std::sqrt(Fs), s.stream);
    if (s.config.shared_gate)
      init_normal(s.params.shared_gate_weight, seed ^ 0x5167, 0, input_scale, s.stream);
  }
  // Returns once the values are written: the caller may overwrite the parameters next from any
  // stream (a checkpoint loaded with cudaMemcpy, say), which nothing would order after these
  // writes, so that writes queued behind slow work would land last and replace the caller's.
  s.initialized.record(s.stream);
  s.mesh.wait(s.initialized.get(), "the parameters' initialisation");
  s.experts.weights_changed();
}

MoEForward MoEBlock::forward(const Tensor& x, const ForwardOptions& options) {
  s_->refuse_capture_of_forward("forward", x, options);
  return on_mesh(
      s_->mesh, s_->stream, s_->times, "forward", [&] { return run_forward(x, options, true); },
      [this] { return s_->exchange_stream(); });
}
MoEForward MoEBlock::infer(const Tensor& x, const ForwardOptions& options) {
  s_->refuse_capture_of_forward("infer", x, options);
  return on_mesh(
      s_->mesh, s_->stream, s_->times, "infer", [&] { return run_forward(x, options, false); },
      [this] { return s_->exchange_stream(); });
}

MoEForward MoEBlock::run_forward(const Tensor& x, const ForwardOptions& options,
                                 bool save_context) {
  auto& s = *s_;
  s.times.current = "arguments";
  const std::int64_t T = x.rank() == 2 ? x.dim(0) : -1;
  if (x.dtype != s.dtype || T < 0 || x.dim(1) != s.H) {
    fail("MoEBlock::forward: x must be {}[T, {}], got {}", dtype_name(s.dtype), s.H, x.describe());
  }
  if (x.data == nullptr && T > 0) fail("MoEBlock::forward: x has no data");
  if (T * s.K > INT32_MAX) fail("MoEBlock::forward: T = {} tokens exceed the int32 row index", T);
  const Tensor& replay = options.replay_topk_idx;
  if (replay.data != nullptr || replay.rank() > 0) {
    expect_tensor(replay, "MoEBlock::forward replay_topk_idx", DType::kInt32, {T, s.K});
    if (replay.data == nullptr && T > 0) fail("MoEBlock::forward: replay_topk_idx has no data");
  }
  // Capturing: refuse_capture_of_forward() let it through.
  const bool capturing = stream_is_capturing(s.stream);
  // Whether the host learns the counts and losses: always but for static shapes that were not
  // asked to (a replayed routing is checked on the host too). Under EP a forward at a new T waits
  // too: the exchange checks there that the EP group holds one T (its fixed blocks' sizes).
  const bool new_tokens_under_ep = s.mesh.ep() > 1 && T != s.prepared_forward;
  const bool wait_for_host =
      !s.static_shapes() || options.losses_on_host || replay.data != nullptr || new_tokens_under_ep;
  const std::int64_t allocations = buffer_allocations();
  s.context.valid = false;  // a failure below leaves no half-built context
  s.times.used = 0;         // stage times restart with each forward; backward appends
  s.times.current = "the token exchange's set-up";
  TokenExchange& exchange = s.token_exchange();
  const cudaStream_t stream = s.stream;

  // The shared expert, when there is one, on its own stream beside the routed path.
  s.times.current = "moe shared expert";
  if (s.shared_expert) s.shared_expert->start_forward(x, s.params, stream);

  // Gate: logits [T, E] = x · Wgᵀ, fp32.
  Tensor logits;
  {
    Range r("moe gate", s.times, stream);
    logits = s.gate.forward(x, s.params.gate_weight, stream);
    s.check("gate", logits);
  }

  // Route: top-K, probabilities, expert counts; in capacity mode the drops (before anything is
  // queued on the mesh: their buffers may grow); then the losses over the whole mesh.
  {
    Range r("moe router", s.times, stream);
    s.router.forward(logits, s.params.expert_bias, replay.as<std::int32_t>(), stream);
  }
  SlotRouting routing{s.router.topk_idx(), s.router.topk_p(), s.router.device_totals(),
                      sizeof(RouterTotals)};
  routing.to_host = wait_for_host;
  // From the config alone: every rank of the EP group queues the same exchanges.
  routing.expert_chunks = s.config.effective_exchange_chunks();
  if (s.capacity) {
    Range r("moe capacity", s.times, stream);
    s.capacity->forward(s.router.topk_idx(), s.router.topk_p(), s.router.tokens_per_expert(), T,
                        stream);
    routing.topk_idx = s.capacity->kept_idx();
    routing.topk_p = s.capacity->kept_p();
    routing.has_dropped_group = true;
    routing.fixed_groups = s.config.pad_to_capacity;
    if (routing.fixed_groups) routing.expert_group_rows = s.config.expert_capacity(T);
  }
  {
    Range r("moe losses", s.times, stream);
    s.router.reduce_losses(stream);
  }

  // Permute and dispatch: the slots' rows to their experts, padded expert-major; the row counts,
  // T_glob and the losses reach the host (the one host synchronisation), unless the shapes are
  // static and the host was not asked to learn the losses.
  RouterTotals totals;
  {
    Range r("moe dispatch", s.times, stream);
    exchange.permute(x, routing);
    exchange.dispatch(x, wait_for_host ? &totals : nullptr);
    if (wait_for_host) s.router.set_totals(totals);
  }
  const ExpertRows rows = exchange.expert_rows();
  s.check_rows("dispatch", rows.input, rows.chunks, exchange);

  // Experts, h = X·w13ᵀ, a = silu(h_gate) ⊙ h_up, Y = a·w2ᵀ, and combine, back to the senders:
  // chunk by chunk of experts where the exchange pipelines, each chunk's experts as soon as its
  // rows arrive and its combine under the next chunk's products.
  for (int chunk = 0; chunk < std::ssize(rows.chunks); ++chunk) {
    {
      Range r("moe experts", s.times, stream);
      exchange.await_rows(chunk);
      s.experts.forward(rows, s.params.w13, s.params.w2, stream, options.weights_unchanged,
                        rows.chunks[chunk]);
    }
    Range r("moe combine", s.times, stream);
    exchange.combine(chunk);
  }
  s.check("experts", rows.output);  // after every chunk (the combine only reads the output)

  // Unpermute: out[t] = Σ_k p[t,k] · Y_row(t,k), a plain sum where the experts weighed their rows.
  const Tensor out = view(s.out, s.dtype, {T, s.H});
  {
    Range r("moe combine", s.times, stream);
    exchange.unpermute(out);
    s.check("combine", out);
  }
  if (s.shared_expert) {
    Range r("moe shared expert", s.times, stream);
    s.shared_expert->add_output(out, stream);
    s.check("shared expert", out);
  }

  if (capturing && buffer_allocations() != allocations)
    fail("MoEBlock::forward: the block's buffers grew while capturing a CUDA graph at T = {}", T);
  if (!capturing && s.static_shapes()) s.prepared_forward = T;
  s.context.x = x;
  s.context.T = T;
  s.context.valid = save_context;
  const float unread = std::numeric_limits<float>::quiet_NaN();
  return {out, wait_for_host ? totals.losses[0] : unread, wait_for_host ? totals.losses[1] : unread,
          Tensor(s.router.device_losses(), DType::kFP32, {2})};
}

Tensor MoEBlock::backward(const Tensor& dy) {
  if (stream_is_capturing(s_->stream))
    s_->check_capture("backward", s_->context.T, s_->prepared_backward);
  return on_mesh(s_->mesh, s_->stream, s_->times, "backward", [&] { return run_backward(dy); });
}

Tensor MoEBlock::run_backward(const Tensor& dy) {
  auto& s = *s_;
  s.times.current = "arguments";
  if (!s.context.valid)
    fail(
        "MoEBlock::backward: no forward context (call forward first; backward runs once per "
        "forward)");
  const std::int64_t T = s.context.T;
  expect_tensor(dy, "MoEBlock::backward dy", s.dtype, {T, s.H});
  const bool capturing = stream_is_capturing(s.stream);  // check_capture() let it in
  const std::int64_t allocations = buffer_allocations();
  s.context.valid = false;
  TokenExchange& exchange = *s.exchange;
  const cudaStream_t stream = s.stream;
  // ∂L/∂topk_p: from the unpermute backward where it weighed the rows, else from beside the rows,
  // where the experts' backward left it.
  float* dprob = typed<float>(s.shared.dprob, T * s.K);
  const Tensor dx = view(s.dx, s.dtype, {T, s.H});

  // The shared expert's backward on its own stream, beside the routed path's.
  s.times.current = "moe shared expert backward";
  if (s.shared_expert) s.shared_expert->start_backward(dy, s.params, s.grads, stream);

  // Unpermute and combine backward: dy to every slot's row, then to the experts' ranks.
  ExpertGradRows rows;
  {
    Range r("moe combine backward", s.times, stream);
    exchange.unpermute_backward(dy, dprob);
    exchange.combine_backward();
    rows = exchange.expert_grad_rows(s.context.x);
    s.check_rows("combine backward", rows.dY, rows.chunks, exchange);
  }

  // Experts backward and dispatch backward, dX back to the senders: chunk by chunk where the
  // exchange pipelines, as in the forward.
  for (int chunk = 0; chunk < std::ssize(rows.chunks); ++chunk) {
    {
      Range r("moe experts backward", s.times, stream);
      exchange.await_rows(chunk);
      s.experts.backward(rows, s.params.w13, s.params.w2, s.grads.w13, s.grads.w2, stream,
                         rows.chunks[chunk]);
    }
    Range r("moe dispatch backward", s.times, stream);
    exchange.dispatch_backward(chunk);
  }
  s.check("experts backward", rows.dX);  // after every chunk (its return only reads dX)

  // Permute backward: dx[t] = Σ_k dX_row(t,k).
  {
    Range r("moe dispatch backward", s.times, stream);
    exchange.permute_backward(dx, dprob);
  }

  // Route backward, with the loss gradients (mesh-wide f and T_glob).
  const Tensor dlogits = view(s.shared.dlogits, DType::kFP32, {T, s.E});
  {
    Range r("moe router backward", s.times, stream);
    s.router.backward(dprob, dlogits, stream);
    s.check("router backward", dlogits);
  }

  // Gate backward: dx += dlogits · Wg, dWg = dlogitsᵀ · x (fp32 accumulation).
  {
    Range r("moe gate backward", s.times, stream);
    s.gate.backward(dlogits, s.context.x, s.params.gate_weight, s.grads.gate_weight, dx, stream);
    s.check("gate backward", dx);
  }
  if (s.shared_expert) {
    Range r("moe shared expert backward", s.times, stream);
    s.shared_expert->add_input_grad(dx, s.params, stream);
    s.check("shared expert backward", dx);
  }
  if (capturing && buffer_allocations() != allocations)
    fail("MoEBlock::backward: the block's buffers grew while capturing a CUDA graph at T = {}", T);
  if (!capturing && s.static_shapes()) s.prepared_backward = T;
  return dx;
}

void MoEBlock::reduce_gradients() {
  auto& s = *s_;
  if (stream_is_capturing(s.stream)) {
    if (const char* why = s.capture_blocker())
      fail("MoEBlock::reduce_gradients: the stream is capturing a CUDA graph, but {}", why);
    if (!s.reduced_once || !s.experts.gemm_algorithms_agreed(s.mesh))
      fail(
          "MoEBlock::reduce_gradients: the stream is capturing a CUDA graph, but the ranks have "
          "not agreed on the GEMM algorithms yet, which an eager reduce_gradients after a step "
          "does on the host");
  }
  on_mesh(s.mesh, s.stream, s.times, "reduce_gradients", [&] {
    const std::int64_t allocations = buffer_allocations();
    Range r("moe gradient reduction", s.times, s.stream);
    moe::reduce_gradients(s.config, s.grads, s.mesh, s.shared.grad_stage, s.stream);
    // After the first step's products were all timed: from here every rank runs the same
    // algorithms (one host wait, at the first call only).
    s.experts.agree_gemm_algorithms(s.mesh, s.stream);
    if (stream_is_capturing(s.stream) && buffer_allocations() != allocations)
      fail("MoEBlock::reduce_gradients: the gradient staging grew while capturing a CUDA graph");
    s.reduced_once = true;
  });
}

// On a mesh, the end of a step is agreed. Each rank first waits for its own step's work; only
// then does it contribute how many synchronize() calls it has made, and each must read back its
// own count as both the largest and the smallest. A rank whose peers gave up on it (they timed
// out while it stalled) may see its own collectives complete, over data its peers queued before
// they aborted, this one included were it queued with the rest; a peer that timed out never
// queues it, so the late rank times out on it, or reads counts that disagree.
void MoEBlock::synchronize() {
  auto& s = *s_;
  if (stream_is_capturing(s.stream))
    fail(
        "MoEBlock::synchronize: waits on the host, which a stream capturing a CUDA graph cannot "
        "do: call it after the graph's replay");
  on_mesh(s.mesh, s.stream, s.times, "synchronize", [&] {
    s.times.current = "the end of the step";
    s.step_done.record(s.stream);
    s.mesh.wait(s.step_done.get(), "the block's queued work");
    const std::int64_t step = ++s.steps_agreed;
    if (s.mesh.world_size() == 1) return;
    const std::int64_t mine[2] = {step, -step};
    s.agreement_host.reserve(sizeof(mine));
    std::memcpy(s.agreement_host.as<std::int64_t>(), mine, sizeof(mine));
    MOE_CHECK_CUDA(cudaMemcpyAsync(s.agreement.data(), s.agreement_host.as<std::int64_t>(),
                                   sizeof(mine), cudaMemcpyHostToDevice, s.stream));
    s.mesh.all_reduce(s.agreement.data(), 2, ncclInt64, ncclMax, MeshGroup::kWorld, s.stream);
    MOE_CHECK_CUDA(cudaMemcpyAsync(s.agreement_host.as<std::int64_t>(), s.agreement.data(),
                                   sizeof(mine), cudaMemcpyDeviceToHost, s.stream));
    s.step_done.record(s.stream);
    s.mesh.wait(s.step_done.get(), "the ranks' agreement on the end of the step");
    std::int64_t agreed[2];
    std::memcpy(agreed, s.agreement_host.as<std::int64_t>(), sizeof(agreed));
    if (agreed[0] != step || -agreed[1] != step) {
      fail(
          "rank {}: the ranks do not agree on the end of step {}: their counts of "
          "synchronize() calls range from {} to {} (a peer failed and aborted, or the ranks' "
          "calls differ)",
          s.mesh.rank(), step, -agreed[1], agreed[0]);
    }
  });
}

MoERouting MoEBlock::routing() const {
  auto& s = *s_;
  MoERouting r;
  r.topk_idx = Tensor(s.router.topk_idx(), DType::kInt32, {s.context.T, s.K});
  r.topk_p = Tensor(s.router.topk_p(), DType::kFP32, {s.context.T, s.K});
  r.tokens_per_expert = Tensor(s.router.tokens_per_expert(), DType::kInt32, {s.E});
  if (s.capacity) {
    r.tokens_per_expert.data = const_cast<std::int32_t*>(s.capacity->kept_counts());
    r.kept =
        Tensor(const_cast<std::int32_t*>(s.capacity->kept()), DType::kInt32, {s.context.T, s.K});
    r.dropped_per_expert =
        Tensor(const_cast<std::int32_t*>(s.capacity->dropped()), DType::kInt32, {s.E});
  }
  return r;
}

void MoEBlock::record_routing(const Tensor& topk_idx) const {
  auto& s = *s_;
  expect_tensor(topk_idx, "MoEBlock::record_routing topk_idx", DType::kInt32, {s.context.T, s.K});
  if (topk_idx.bytes() == 0) return;
  if (topk_idx.data == nullptr) fail("MoEBlock::record_routing: topk_idx has no data");
  MOE_CHECK_CUDA(cudaMemcpyAsync(topk_idx.data, s.router.topk_idx(), topk_idx.bytes(),
                                 cudaMemcpyDeviceToDevice, s.stream));
}

MoELoadStatistics MoEBlock::load_statistics() const {
  auto& s = *s_;
  if (s.router.load_total() == nullptr) s.router.reset_load_total(s.stream);
  return {Tensor(const_cast<std::int64_t*>(s.router.load_total()), DType::kInt64, {s.E}),
          s.router.load_steps()};
}

void MoEBlock::reset_load_statistics() {
  s_->router.reset_load_total(s_->stream);
}

LoadImbalance load_imbalance(std::span<const std::int64_t> tokens_per_expert, int ep) {
  const auto experts = static_cast<std::int64_t>(tokens_per_expert.size());
  if (ep < 1 || experts % ep != 0)
    fail("load_imbalance: ep = {} must be >= 1 and divide the {} experts", ep, experts);
  LoadImbalance imbalance;
  if (experts == 0) return imbalance;
  std::int64_t total = 0, largest = 0;
  std::vector<std::int64_t> per_rank(static_cast<std::size_t>(ep), 0);
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::int64_t load = tokens_per_expert[static_cast<std::size_t>(e)];
    if (load < 0) fail("load_imbalance: expert {} has a negative load {}", e, load);
    total += load;
    largest = std::max(largest, load);
    per_rank[static_cast<std::size_t>(e / (experts / ep))] += load;
  }
  if (total == 0) return imbalance;
  const double total_d = static_cast<double>(total);
  imbalance.expert = static_cast<double>(largest) * static_cast<double>(experts) / total_d;
  imbalance.ep_rank =
      static_cast<double>(*std::max_element(per_rank.begin(), per_rank.end())) * ep / total_d;
  return imbalance;
}

EpTransport MoEBlock::ep_transport() const {
  return s_->exchange ? s_->exchange->transport() : EpTransport::kAuto;
}

bool MoEBlock::probabilities_in_experts() const {
  return s_->exchange && s_->exchange->probabilities_in_experts();
}

void MoEBlock::set_stage_timing(bool on) {
  s_->times.on = on;
  s_->times.used = 0;
}

std::vector<MoEBlock::StageTime> MoEBlock::stage_times() const {
  std::vector<StageTime> out;
  for (std::size_t i = 0; i < s_->times.used; ++i) {
    const auto& stage = s_->times.stages[i];
    MOE_CHECK_CUDA(cudaEventSynchronize(stage.stop.get()));
    out.push_back({stage.name, stage.stop.elapsed_ms_since(stage.start)});
  }
  return out;
}

void MoEBlock::update_expert_bias(float rate) {
  auto& s = *s_;
  if (!s.config.expert_bias)
    fail("MoEBlock::update_expert_bias: the config has expert_bias = false");
  if (s.router.global_load() == nullptr)
    fail("MoEBlock::update_expert_bias: no forward has counted the loads yet");
  s.times.current = "the expert bias update";
  on_mesh(s.mesh, s.stream, s.times, "update_expert_bias", [&] {
    moe::update_expert_bias(s.params.expert_bias.as<float>(), s.router.global_load(), s.E, rate,
                            s.stream);
  });
}

}  // namespace moe
