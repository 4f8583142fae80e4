// MoEBlock's state: its config, mesh, stream, parameters, stages and the context a forward keeps
// for its backward, with the checks its public calls share (capture, finite outputs), and
// on_mesh, which turns a failure of one rank into an error on every rank. Included by
// src/moe_block.cpp and src/moe_block_step.cpp alone.
#pragma once

#include <fmt/format.h>

#include <memory>
#include <string>

#include "kernels/elementwise.cuh"
#include "moe/device.h"
#include "moe/error.h"
#include "moe/moe_block.h"
#include "src/capacity_stage.h"
#include "src/expert_stage.h"
#include "src/gate_stage.h"
#include "src/router_stage.h"
#include "src/scratch.h"
#include "src/shared_expert_stage.h"
#include "src/stage_support.h"
#include "src/token_exchange.h"

namespace moe {
namespace block_detail {

// The parameters and gradients the block allocates, used unless the trainer binds its own.
struct OwnWeights {
  DeviceBuffer gate, w13, w2, bias, dgate, dw13, dw2;
  DeviceBuffer shared_w13, shared_w2, shared_gate, dshared_w13, dshared_w2, dshared_gate;
};

// Where a block's step stands between the split-phase calls (include/moe/moe_block.h): idle, or
// the call that ran last of a forward or a backward under way.
enum class StepPhase { kIdle, kDispatched, kExpertsDone, kBackwardCombined, kBackwardExpertsDone };

// What is due next, for a refusal's message.
inline const char* what_is_due(StepPhase phase) {
  switch (phase) {
    case StepPhase::kIdle:
      return "no split-phase step is under way (forward_dispatch and backward_combine start one)";
    case StepPhase::kDispatched:
      return "the block is mid-forward, and forward_experts is due";
    case StepPhase::kExpertsDone:
      return "the block is mid-forward, and forward_combine is due";
    case StepPhase::kBackwardCombined:
      return "the block is mid-backward, and backward_experts is due";
    case StepPhase::kBackwardExpertsDone:
      return "the block is mid-backward, and backward_dispatch is due";
  }
  return "";
}

// Runs one public call of a block on a mesh of several ranks. A rank that fails leaves its peers
// waiting in a collective it will never join: it aborts the mesh's communicators, so that its
// own later calls fail at once and its peers fail at their next wait, within the mesh's timeout,
// instead of at a collective matched against the wrong one. The error then names the rank, the
// call and the stage. A buffer that grows during the call first waits for the block's stream
// under the mesh's timeout: its free would otherwise wait for the device with no limit, behind a
// collective a failed peer never joins (a previous step's gradient all-reduce, say). Not while
// the stream is captured: a capture's buffers are already sized, and a growth there fails anyway.
// The drain waits for the exchanges' own streams too (those of every block on the mesh: a
// split-phase step leaves its transfers in flight there while other blocks run).
template <typename Call>
auto on_mesh(const Mesh& mesh, cudaStream_t stream, const StageTimes& times, const char* call,
             Call&& run) {
  if (mesh.world_size() == 1) return run();
  const BufferGrowthDrain drain([&] {
    if (stream_is_capturing(stream)) return;
    drain_streams(mesh, stream, "the work queued before a buffer grows");
  });
  try {
    return run();
  } catch (const std::exception& error) {
    const bool first = !mesh.aborted();
    mesh.abort();
    if (!first) throw;
    fail("rank {}: MoEBlock::{} failed in stage '{}'; the mesh's communicators are aborted: {}",
         mesh.rank(), call, times.current, error.what());
  }
}

}  // namespace block_detail

struct MoEBlock::State {
  MoEConfig config;
  const Mesh& mesh;
  cudaStream_t stream;
  int E, E_loc, K;
  std::int64_t H, F;
  DType dtype;

  block_detail::OwnWeights own;
  MoEParameters params;
  MoEGradients grads;

  std::shared_ptr<MoEScratch> scratch;  // keeps the shared buffers alive
  MoEScratch::Buffers& shared;
  GateStage gate;
  RouterStage router;
  std::unique_ptr<CapacityStage> capacity;  // in capacity mode
  ExpertStage experts;
  std::unique_ptr<SharedExpertStage> shared_expert;  // with config.shared_ffn_hidden > 0
  // Made at construction on one EP rank, at the first forward under EP (choosing is collective).
  std::unique_ptr<TokenExchange> exchange;
  DeviceBuffer out;            // the forward's output, the block's until the next forward
  DeviceBuffer dx;             // the backward's output, the block's until the next backward
  Event initialized;           // initialize() waits for its writes
  Event step_done;             // synchronize() waits for it
  Event checked;               // check mode waits for each stage's count of non-finite values
  PinnedBuffer checked_count;  // where that count lands (pageable memory would block the copy)
  // synchronize()'s agreement over the world: this rank's count of them, and {count, -count}
  // reduced by max on the device and read back on the host.
  std::int64_t steps_agreed = 0;
  DeviceBuffer agreement{2 * sizeof(std::int64_t)};
  PinnedBuffer agreement_host;

  // What the forward keeps for the backward at the block's level; each stage keeps its own.
  struct Context {
    bool valid = false;  // a backward may run
    Tensor x;            // by reference: the caller keeps it until the backward
    std::int64_t T = 0;
  } context;
  bool check_finite = false;
  StageTimes times;
  // Static shapes: the token counts of the last eager forward and backward, which grew every
  // buffer and chose every GEMM algorithm that a captured call of that count will use.
  std::int64_t prepared_forward = -1;
  std::int64_t prepared_backward = -1;
  bool reduced_once = false;  // reduce_gradients has run (its first call may allocate and wait)

  // The step under way between the phases of a forward or a backward (src/moe_block_step.cpp).
  struct Step {
    block_detail::StepPhase phase = block_detail::StepPhase::kIdle;
    bool under_way = false;        // begin_step has run, end_step not yet
    bool capturing = false;        // its first phase was queued into a CUDA graph
    std::uint64_t capture_id = 0;  // that graph's capture sequence
    std::int64_t allocations = 0;  // buffer_allocations() at its first phase
    // Forward.
    bool save_context = false;
    bool wait_for_host = false;
    bool weights_unchanged = false;
    RouterTotals totals;
    ExpertRows rows;
    // Backward.
    Tensor dy;  // the caller's: kept until backward_dispatch
    float* dprob = nullptr;
    ExpertGradRows grad_rows;
  } step;

  State(const MoEConfig& c, const Mesh& m, cudaStream_t s, std::shared_ptr<MoEScratch> owner,
        MoEScratch::Buffers& buffers)
      : config(c),
        mesh(m),
        stream(s),
        E(c.num_experts),
        E_loc(c.num_experts / m.ep()),
        K(c.topk),
        H(c.hidden),
        F(c.ffn_hidden),
        dtype(c.dtype),
        scratch(std::move(owner)),
        shared(buffers),
        gate(c, buffers.dlogits_low),
        router(c, m, buffers.router_ws),
        capacity(c.capacity_mode() ? std::make_unique<CapacityStage>(c, buffers.layout_ws)
                                   : nullptr),
        experts(c, m, buffers.a),
        shared_expert(c.shared_experts() ? std::make_unique<SharedExpertStage>(c, m) : nullptr) {}

  ExchangeSetup exchange_setup() { return {config, mesh, stream, shared}; }

  // The order of the split-phase calls: `call` runs only at `expected` (kIdle for the calls that
  // start a step or stand outside one), on a scratch no other block holds where it uses the
  // scratch, and a phase after the first is captured in the CUDA graph that holds the first (and
  // only there). Refusals queue nothing. A step whose first phases were captured in a graph whose
  // capture has ended (it failed, or the trainer ended it between the phases) can never go on:
  // it is dropped here, with the forward context.
  void enter(const char* call, block_detail::StepPhase expected, bool uses_scratch = true) {
    if (step.phase != block_detail::StepPhase::kIdle && step.capturing &&
        stream_capture_id(stream) != step.capture_id) {
      end_step();
      context.valid = false;
    }
    if (step.phase != expected) {
      if (expected == block_detail::StepPhase::kIdle)
        fail("MoEBlock::{}: called out of turn: {}", call, block_detail::what_is_due(step.phase));
      fail("MoEBlock::{}: called out of turn: {}", call,
           step.phase == block_detail::StepPhase::kIdle
               ? (expected < block_detail::StepPhase::kBackwardCombined
                      ? "no forward is under way (forward_dispatch starts one)"
                      : "no backward is under way (backward_combine starts one)")
               : block_detail::what_is_due(step.phase));
    }
    if (uses_scratch && shared.held_by != nullptr && shared.held_by != this)
      fail(
          "MoEBlock::{}: another block that shares this block's MoEScratch is between the phases "
          "of a step (forward_dispatch to forward_combine, or backward_combine to "
          "backward_dispatch); blocks whose steps interleave need a MoEScratch each",
          call);
    if (expected != block_detail::StepPhase::kIdle && stream_is_capturing(stream) != step.capturing)
      fail(
          "MoEBlock::{}: the stream is {}capturing a CUDA graph, but this step's first phase was "
          "{}: a forward's or a backward's phases are captured all or none",
          call, step.capturing ? "not " : "", step.capturing ? "captured" : "queued eagerly");
  }
  // A step's first phase: its buffers are this block's until the last.
  void begin_step() {
    step.capture_id = stream_capture_id(stream);
    step.capturing = step.capture_id != 0;
    step.allocations = buffer_allocations();
    step.under_way = true;
    shared.held_by = this;
  }
  // A step's last phase, or a phase that failed: no step is under way.
  void end_step() {
    step.phase = block_detail::StepPhase::kIdle;
    step.under_way = false;
    step.dy = Tensor{};
    if (shared.held_by == this) shared.held_by = nullptr;
  }
  // A buffer that grew while the step's phases were captured: the graph would hold the old one.
  void expect_no_growth(const char* call, std::int64_t T) const {
    if (step.capturing && buffer_allocations() != step.allocations)
      fail("MoEBlock::{}: the block's buffers grew while capturing a CUDA graph at T = {}", call,
           T);
  }
  // One public call on the mesh (on_mesh). A failure once a step has begun (its arguments
  // checked) ends the step and leaves no forward context; a refused argument leaves both as they
  // were.
  template <typename Call>
  auto run_call(const char* call, Call&& run) {
    return block_detail::on_mesh(mesh, stream, times, call, [&] {
      try {
        return run();
      } catch (...) {
        if (step.under_way) {
          end_step();
          context.valid = false;
        }
        throw;
      }
    });
  }
  TokenExchange& token_exchange() {
    if (exchange == nullptr) exchange = make_token_exchange(exchange_setup());
    return *exchange;
  }
  // Whether the shared expert forks once the exchange has queued its transfers, to run while the
  // rows travel, rather than at the forward's and the backward's start (docs/design.md, "Shared
  // experts"): on its own stream, over an exchange that moves the rows on a stream of its own.
  bool shared_expert_beside_transfers() {
    return shared_expert != nullptr && shared_expert->overlaps() &&
           token_exchange().transfers_beside_the_stream();
  }

  // Capacity mode with pad_to_capacity: every shape of a step is known on the host beforehand (on
  // one EP rank and, with fixed blocks in the exchange, under EP), so a step needs nothing from
  // the device (docs/design.md, "Static shapes and CUDA graphs").
  bool static_shapes() const { return config.capacity_mode() && config.pad_to_capacity; }

  // A call whose stream is capturing a CUDA graph is refused where it would wait on the host or
  // allocate; the error says why. The public calls ask before on_mesh, so that a refusal queues
  // nothing and leaves a mesh as it was (an error inside on_mesh aborts the communicators).
  // This says why the block's calls cannot be captured now, or null.
  const char* capture_blocker() const {
    if (!config.capacity_mode() || !config.pad_to_capacity)
      return "a layer without capacity_factor and pad_to_capacity reads its row counts on the "
             "host every forward";
    if (check_finite) return "check mode (set_check_finite) reads every stage's output on the host";
    if (times.on) return "stage timing (set_stage_timing) reads its events on the host";
    return nullptr;
  }

  // As capture_blocker, and a token count T other than the last eager call's (`prepared`).
  void check_capture(const char* call, std::int64_t T, std::int64_t prepared) const {
    if (const char* why = capture_blocker())
      fail("MoEBlock::{}: the stream is capturing a CUDA graph, but {}", call, why);
    if (T != prepared) {
      const std::string last = prepared < 0
                                   ? std::string("has not run one eagerly yet")
                                   : fmt::format("last ran one eagerly at T = {}", prepared);
      fail(
          "MoEBlock::{}: the stream is capturing a CUDA graph at T = {} tokens, but the block {}: "
          "run one forward and backward at this token count first, so that no buffer grows and "
          "every GEMM algorithm is chosen before the capture",
          call, T, last);
    }
  }

  // A forward or infer of a capture, refused where it cannot be captured.
  void refuse_capture_of_forward(const char* call, const Tensor& x,
                                 const ForwardOptions& options) const {
    if (!stream_is_capturing(stream)) return;
    check_capture(call, x.rank() == 2 ? x.dim(0) : -1, prepared_forward);
    if (options.losses_on_host)
      fail(
          "MoEBlock::{}: the stream is capturing a CUDA graph, but ForwardOptions::losses_on_host "
          "asks for the losses on the host: pass false and read MoEForward::losses on the device",
          call);
    if (options.replay_topk_idx.data != nullptr)
      fail(
          "MoEBlock::{}: the stream is capturing a CUDA graph, but replay_topk_idx is checked on "
          "the host",
          call);
  }

  // Check mode: the stage's output must be finite. The host waits for the count under the mesh's
  // timeout: on a mesh the stream may wait for rows from a peer that failed.
  // check() of rows that a pipelined exchange delivers chunk by chunk: the stream first waits for
  // every chunk (check mode only; otherwise the experts wait for each chunk in turn).
  void check_rows(const char* stage, const Tensor& t, std::span<const ExpertSpan> chunks,
                  TokenExchange& exchange) {
    if (!check_finite) return;
    for (int chunk = 0; chunk < std::ssize(chunks); ++chunk) exchange.await_rows(chunk);
    check(stage, t);
  }
  void check(const char* stage, const Tensor& t) {
    if (!check_finite) return;
    int* count = typed<int>(shared.nonfinite, 1);
    count_nonfinite(t, count, stream);
    checked_count.reserve(sizeof(int));
    MOE_CHECK_CUDA(cudaMemcpyAsync(checked_count.as<int>(), count, sizeof(int),
                                   cudaMemcpyDeviceToHost, stream));
    checked.record(stream);
    mesh.wait(checked.get(), "check mode's count of a stage's non-finite values");
    const int host = *checked_count.as<int>();
    if (host > 0)
      fail("rank {}: stage '{}' produced {} NaN or Inf values in {}", mesh.rank(), stage, host,
           t.describe());
  }
};

}  // namespace moe
