// MoEBlock: its construction, parameters and gradients, the gradient reduction, the end-of-step
// agreement, routing records and load statistics, over one GPU or an EP×DP mesh. The step itself,
// forward and backward in their phases, is src/moe_block_step.cpp: each of its steps is one call
// into its stage (src/gate_stage.h, src/router_stage.h, src/expert_stage.h) or into the token
// exchange (src/token_exchange.h), which owns everything that depends on how rows cross the EP
// group.
#include "moe/moe_block.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <utility>
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
  s_->end_step();  // a step left between its phases holds the shared scratch no longer
  try {
    if (mesh.world_size() == 1 || mesh.aborted() || stream_is_capturing(s_->stream)) return;
    // The exchanges' own streams too: a step left between its phases has transfers there.
    drain_streams(mesh, s_->stream, "the work queued before a block's buffers are freed");
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
  s_->enter("set_check_finite", block_detail::StepPhase::kIdle, /*uses_scratch=*/false);
  s_->check_finite = on;
}

void MoEBlock::bind(const MoEParameters& p, const MoEGradients& g) {
  auto& s = *s_;
  s.enter("bind", block_detail::StepPhase::kIdle, /*uses_scratch=*/false);
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
  // Every operand of a GEMM (the expert bias is read a float at a time).
  for (const auto& [tensor, name] : std::initializer_list<std::pair<const Tensor&, const char*>>{
           {p.gate_weight, "MoEBlock::bind gate_weight"},
           {p.w13, "MoEBlock::bind w13"},
           {p.w2, "MoEBlock::bind w2"},
           {p.shared_w13, "MoEBlock::bind shared_w13"},
           {p.shared_w2, "MoEBlock::bind shared_w2"},
           {p.shared_gate_weight, "MoEBlock::bind shared_gate_weight"},
           {g.gate_weight, "MoEBlock::bind gradient of gate_weight"},
           {g.w13, "MoEBlock::bind gradient of w13"},
           {g.w2, "MoEBlock::bind gradient of w2"},
           {g.shared_w13, "MoEBlock::bind gradient of shared_w13"},
           {g.shared_w2, "MoEBlock::bind gradient of shared_w2"},
           {g.shared_gate_weight, "MoEBlock::bind gradient of shared_gate_weight"}})
    expect_aligned(tensor, name);
  s.params = p;
  s.grads = g;
  s.experts.weights_changed();
}

void MoEBlock::initialize(std::uint64_t seed) {
  auto& s = *s_;
  s.enter("initialize", block_detail::StepPhase::kIdle, /*uses_scratch=*/false);
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

void MoEBlock::reduce_gradients() {
  auto& s = *s_;
  s.enter("reduce_gradients", block_detail::StepPhase::kIdle);
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
  s.enter("synchronize", block_detail::StepPhase::kIdle, /*uses_scratch=*/false);
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
  MoELoadStatistics statistics;
  statistics.tokens_per_expert =
      Tensor(const_cast<std::int64_t*>(s.router.load_total()), DType::kInt64, {s.E});
  if (s.capacity) {
    statistics.dropped_per_expert =
        Tensor(const_cast<std::int64_t*>(s.router.drop_total()), DType::kInt64, {s.E});
  }
  statistics.steps = s.router.load_steps();
  return statistics;
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
  s_->enter("set_stage_timing", block_detail::StepPhase::kIdle, /*uses_scratch=*/false);
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
  s.enter("update_expert_bias", block_detail::StepPhase::kIdle, /*uses_scratch=*/false);
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
