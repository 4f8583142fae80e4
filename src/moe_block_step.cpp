// MoEBlock's step: forward (gate → route → permute → dispatch → experts → combine → unpermute) and
// its mirror backward, each in the three phases of the split-phase calls (include/moe/moe_block.h).
// forward() and backward() run their three phases in one call; the phases themselves check their
// order (State::enter) and keep what the next phase needs in State::step.
#include <limits>

#include "moe/device.h"
#include "moe/error.h"
#include "moe/moe_block.h"
#include "src/moe_block_state.h"
#include "src/stage_support.h"
#include "src/token_exchange.h"

namespace moe {

using block_detail::StepPhase;

MoEForward MoEBlock::forward(const Tensor& x, const ForwardOptions& options) {
  s_->enter("forward", StepPhase::kIdle);
  s_->refuse_capture_of_forward("forward", x, options);
  return s_->run_call("forward", [&] {
    dispatch_phase(x, options, true);
    experts_phase();
    return combine_phase();
  });
}

MoEForward MoEBlock::infer(const Tensor& x, const ForwardOptions& options) {
  s_->enter("infer", StepPhase::kIdle);
  s_->refuse_capture_of_forward("infer", x, options);
  return s_->run_call("infer", [&] {
    dispatch_phase(x, options, false);
    experts_phase();
    return combine_phase();
  });
}

Tensor MoEBlock::backward(const Tensor& dy) {
  s_->enter("backward", StepPhase::kIdle);
  if (stream_is_capturing(s_->stream))
    s_->check_capture("backward", s_->context.T, s_->prepared_backward);
  return s_->run_call("backward", [&] {
    combine_backward_phase(dy);
    experts_backward_phase();
    return dispatch_backward_phase();
  });
}

void MoEBlock::forward_dispatch(const Tensor& x, const ForwardOptions& options) {
  s_->enter("forward_dispatch", StepPhase::kIdle);
  s_->refuse_capture_of_forward("forward_dispatch", x, options);
  s_->run_call("forward_dispatch", [&] { dispatch_phase(x, options, true); });
}

void MoEBlock::forward_experts() {
  s_->enter("forward_experts", StepPhase::kDispatched);
  s_->run_call("forward_experts", [&] { experts_phase(); });
}

MoEForward MoEBlock::forward_combine() {
  s_->enter("forward_combine", StepPhase::kExpertsDone);
  return s_->run_call("forward_combine", [&] { return combine_phase(); });
}

void MoEBlock::backward_combine(const Tensor& dy) {
  s_->enter("backward_combine", StepPhase::kIdle);
  if (stream_is_capturing(s_->stream))
    s_->check_capture("backward_combine", s_->context.T, s_->prepared_backward);
  s_->run_call("backward_combine", [&] { combine_backward_phase(dy); });
}

void MoEBlock::backward_experts() {
  s_->enter("backward_experts", StepPhase::kBackwardCombined);
  s_->run_call("backward_experts", [&] { experts_backward_phase(); });
}

Tensor MoEBlock::backward_dispatch() {
  s_->enter("backward_dispatch", StepPhase::kBackwardExpertsDone);
  return s_->run_call("backward_dispatch", [&] { return dispatch_backward_phase(); });
}

// ---- Forward ----------------------------------------------------------------------------------

// Gate, route, permute and dispatch: the rows leave for their experts.
void MoEBlock::dispatch_phase(const Tensor& x, const ForwardOptions& options, bool save_context) {
  auto& s = *s_;
  s.times.current = "arguments";
  const std::int64_t T = x.rank() == 2 ? x.dim(0) : -1;
  if (x.dtype != s.dtype || T < 0 || x.dim(1) != s.H) {
    fail("MoEBlock::forward: x must be {}[T, {}], got {}", dtype_name(s.dtype), s.H, x.describe());
  }
  if (x.data == nullptr && T > 0) fail("MoEBlock::forward: x has no data");
  expect_aligned(x, "MoEBlock::forward x");
  if (T * s.K > INT32_MAX) fail("MoEBlock::forward: T = {} tokens exceed the int32 row index", T);
  const Tensor& replay = options.replay_topk_idx;
  if (replay.data != nullptr || replay.rank() > 0) {
    expect_tensor(replay, "MoEBlock::forward replay_topk_idx", DType::kInt32, {T, s.K});
    if (replay.data == nullptr && T > 0) fail("MoEBlock::forward: replay_topk_idx has no data");
  }
  // Whether the host learns the counts and losses: always but for static shapes that were not
  // asked to (a replayed routing is checked on the host too). Under EP a forward at a new T waits
  // too: the exchange checks there that the EP group holds one T (its fixed blocks' sizes).
  const bool new_tokens_under_ep = s.mesh.ep() > 1 && T != s.prepared_forward;
  const bool wait_for_host =
      !s.static_shapes() || options.losses_on_host || replay.data != nullptr || new_tokens_under_ep;
  s.begin_step();           // a capture was let through by refuse_capture_of_forward()
  s.context.valid = false;  // a failure below leaves no half-built context
  s.context.x = x;
  s.context.T = T;
  s.step.save_context = save_context;
  s.step.wait_for_host = wait_for_host;
  s.step.weights_unchanged = options.weights_unchanged;
  s.times.used = 0;  // stage times restart with each forward; backward appends
  s.times.current = "the token exchange's set-up";
  TokenExchange& exchange = s.token_exchange();
  const cudaStream_t stream = s.stream;

  // The shared expert, when there is one, on its own stream beside the routed path: forked once
  // the exchange has taken the rows onto its own stream, so that its products run while the rows
  // travel (below); else from here, beside the gate, the router and the permute. In series it
  // runs here.
  const bool shared_beside_transfers = s.shared_expert_beside_transfers();
  s.times.current = "moe shared expert";
  if (s.shared_expert && !shared_beside_transfers)
    s.shared_expert->start_forward(x, s.params, stream);

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
    routing.fixed_groups = s.config.pad_to_capacity;
    if (routing.fixed_groups) routing.expert_group_rows = s.config.expert_capacity(T);
  }
  {
    Range r("moe losses", s.times, stream);
    s.router.reduce_losses(s.capacity ? s.capacity->dropped() : nullptr, stream);
  }

  // Permute and dispatch: the slots' rows to their experts, padded expert-major; the row counts,
  // T_glob and the losses reach the host (the one host synchronisation), unless the shapes are
  // static and the host was not asked to learn the losses.
  {
    Range r("moe dispatch", s.times, stream);
    exchange.permute(x, routing);
    exchange.dispatch(x, wait_for_host ? &s.step.totals : nullptr);
    if (wait_for_host) s.router.set_totals(s.step.totals);
  }
  if (shared_beside_transfers) {
    s.times.current = "moe shared expert";
    s.shared_expert->start_forward(x, s.params, stream);
  }
  s.times.current = "moe dispatch";
  s.step.rows = exchange.expert_rows();
  s.check_rows("dispatch", s.step.rows.input, s.step.rows.chunks, exchange);
  s.step.phase = StepPhase::kDispatched;
}

// Experts, h = X·w13ᵀ, a = silu(h_gate) ⊙ h_up, Y = a·w2ᵀ, and combine, back to the senders: chunk
// by chunk of experts where the exchange pipelines, each chunk's experts as soon as its rows
// arrive and its combine under the next chunk's products.
void MoEBlock::experts_phase() {
  auto& s = *s_;
  TokenExchange& exchange = *s.exchange;
  const ExpertRows& rows = s.step.rows;
  const cudaStream_t stream = s.stream;
  if (s.config.fp8) {
    // The FP8 weights' quantization, while the first chunk's rows are on their way.
    Range r("moe experts", s.times, stream);
    s.experts.prepare_forward(s.params.w13, s.params.w2, stream, s.step.weights_unchanged);
  }
  for (int chunk = 0; chunk < std::ssize(rows.chunks); ++chunk) {
    {
      // A wait for rows still on their way is the exchange's time, not the experts'.
      Range r("moe dispatch", s.times, stream);
      exchange.await_rows(chunk);
    }
    {
      Range r("moe experts", s.times, stream);
      s.experts.forward(rows, s.params.w13, s.params.w2, stream, rows.chunks[chunk]);
    }
    Range r("moe combine", s.times, stream);
    exchange.combine(chunk);
  }
  s.check("experts", rows.output);  // after every chunk (the combine only reads the output)
  s.step.phase = StepPhase::kExpertsDone;
}

// Unpermute: out[t] = Σ_k p[t,k] · Y_row(t,k), a plain sum where the experts weighed their rows;
// then the shared expert's output.
MoEForward MoEBlock::combine_phase() {
  auto& s = *s_;
  const std::int64_t T = s.context.T;
  const cudaStream_t stream = s.stream;
  const Tensor out = view(s.out, s.dtype, {T, s.H});
  {
    Range r("moe combine", s.times, stream);
    s.exchange->unpermute(out);
    s.check("combine", out);
  }
  if (s.shared_expert) {
    Range r("moe shared expert", s.times, stream);
    s.shared_expert->add_output(out, stream);
    s.check("shared expert", out);
  }
  s.expect_no_growth("forward", T);
  if (!s.step.capturing && s.static_shapes()) s.prepared_forward = T;
  s.context.valid = s.step.save_context;
  const bool waited = s.step.wait_for_host;
  s.end_step();
  const float unread = std::numeric_limits<float>::quiet_NaN();
  return {out, waited ? s.step.totals.losses[0] : unread, waited ? s.step.totals.losses[1] : unread,
          Tensor(s.router.device_losses(), DType::kFP32, {2})};
}

// ---- Backward ---------------------------------------------------------------------------------

// Unpermute and combine backward: dy to every slot's row, then to the experts' ranks.
void MoEBlock::combine_backward_phase(const Tensor& dy) {
  auto& s = *s_;
  s.times.current = "arguments";
  if (!s.context.valid)
    fail(
        "MoEBlock::backward: no forward context (call forward first; backward runs once per "
        "forward)");
  const std::int64_t T = s.context.T;
  expect_tensor(dy, "MoEBlock::backward dy", s.dtype, {T, s.H});
  expect_aligned(dy, "MoEBlock::backward dy");
  s.begin_step();  // a capture was let through by check_capture()
  s.context.valid = false;
  s.step.dy = dy;
  TokenExchange& exchange = *s.exchange;
  const cudaStream_t stream = s.stream;
  // ∂L/∂topk_p: from the unpermute backward where it weighed the rows, else from beside the rows,
  // where the experts' backward left it. Both it and dx grow here, before a collective is queued.
  s.step.dprob = typed<float>(s.shared.dprob, T * s.K);
  view(s.dx, s.dtype, {T, s.H});

  // The shared expert's backward on its own stream beside the routed path's, forked as the
  // forward forked it: once the exchange carries dY, or here, before the unpermute backward.
  const bool shared_beside_transfers = s.shared_expert_beside_transfers();
  s.times.current = "moe shared expert backward";
  if (s.shared_expert && !shared_beside_transfers)
    s.shared_expert->start_backward(dy, s.params, s.grads, stream);

  {
    Range r("moe combine backward", s.times, stream);
    exchange.unpermute_backward(dy, s.step.dprob);
    exchange.combine_backward();
  }
  if (shared_beside_transfers) {
    s.times.current = "moe shared expert backward";
    s.shared_expert->start_backward(dy, s.params, s.grads, stream);
  }
  s.times.current = "moe combine backward";
  s.step.grad_rows = exchange.expert_grad_rows(s.context.x);
  s.check_rows("combine backward", s.step.grad_rows.dY, s.step.grad_rows.chunks, exchange);
  s.step.phase = StepPhase::kBackwardCombined;
}

// Experts backward and dispatch backward, dX back to the senders: chunk by chunk where the
// exchange pipelines, as in the forward.
void MoEBlock::experts_backward_phase() {
  auto& s = *s_;
  TokenExchange& exchange = *s.exchange;
  const ExpertGradRows& rows = s.step.grad_rows;
  const cudaStream_t stream = s.stream;
  for (int chunk = 0; chunk < std::ssize(rows.chunks); ++chunk) {
    {
      Range r("moe combine backward", s.times, stream);
      exchange.await_rows(chunk);
    }
    // The last chunk's dX has no later chunk's products to run beside: where the transfers run
    // beside the stream, it leaves as soon as it is queued, and the chunk's dw13 products run
    // beside it (only an event is queued on the block's stream in between). The other chunks
    // keep one fan-out of their products. Algorithm trials want the device alone: until the
    // ranks agree on the algorithms, dw13 before the transfer.
    const bool send_early = chunk + 1 == std::ssize(rows.chunks) &&
                            exchange.transfers_beside_the_stream() &&
                            s.experts.gemm_algorithms_agreed(s.mesh);
    ExpertFFN::DXQueued send_dX;
    if (send_early) {
      send_dX = [&] {
        {
          Range send("moe dispatch backward", s.times, stream);
          exchange.dispatch_backward(chunk);
        }
        s.times.current = "moe experts backward";  // dw13's products
      };
    }
    {
      Range r("moe experts backward", s.times, stream);
      s.experts.backward(rows, s.params.w13, s.params.w2, s.grads.w13, s.grads.w2, stream,
                         rows.chunks[chunk], send_dX);
    }
    if (send_early) continue;
    Range r("moe dispatch backward", s.times, stream);
    exchange.dispatch_backward(chunk);
  }
  s.check("experts backward", rows.dX);  // after every chunk (its return only reads dX)
  s.step.phase = StepPhase::kBackwardExpertsDone;
}

// Permute backward, then the router's and the gate's: dx and the gate's gradient.
Tensor MoEBlock::dispatch_backward_phase() {
  auto& s = *s_;
  const std::int64_t T = s.context.T;
  const cudaStream_t stream = s.stream;
  float* dprob = s.step.dprob;
  const Tensor dx(s.dx.data(), s.dtype, {T, s.H});  // grown by the combine backward

  // Permute backward: dx[t] = Σ_k dX_row(t,k).
  {
    Range r("moe dispatch backward", s.times, stream);
    s.exchange->permute_backward(dx, dprob);
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
  s.expect_no_growth("backward", T);
  if (!s.step.capturing && s.static_shapes()) s.prepared_backward = T;
  s.end_step();
  return dx;
}

}  // namespace moe
